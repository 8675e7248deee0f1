//! The CSI Node service of `ferrite csi --mode node` over its real gRPC socket and a real daemon.
//! Here (no kernel block devices): identity, info, capabilities and every error a caller can
//! cause. The full lifecycle on real devices is `node_lifecycle_on_block_devices`, which the VM
//! tier runs in a guest (tests/vm/csi_node.sh).

use crate::common;

use std::path::Path;

use common::csi::{block_cap, channel, code, mount_cap, start_csi};
use common::{Daemon, pattern};
use ferrite_proto::csi::v1 as csi;
use ferrite_proto::csi_addons::reclaimspace as rs;
use tonic::Code;

use csi::volume_capability::access_mode::Mode;

fn stage(id: &str, staging: &Path, cap: csi::VolumeCapability) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

fn publish(id: &str, staging: &Path, target: &Path, cap: csi::VolumeCapability) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn node_service_checks_and_errors_without_kernel_devices() {
    let dir = tempfile::tempdir().unwrap();
    let da = dir.path().join("a");
    std::fs::create_dir_all(&da).unwrap();
    let mut a = Daemon::start(&da);
    a.ok(&["volume", "create", "v1", "64M"]);
    let _csi = start_csi(
        dir.path(),
        &[("node-a", &a)],
        &[
            "--mode",
            "node",
            "--node-id",
            "node-a",
            "--attach-transport",
            "ublk",
            "--max-volumes",
            "7",
            "--addons-endpoint",
            &dir.path().join("addons.sock").display().to_string(),
        ],
    );
    let ch = channel(&dir.path().join("csi.sock")).await;
    let addons = channel(&dir.path().join("addons.sock")).await;
    let mut id = csi::identity_client::IdentityClient::new(ch.clone());
    let mut node = csi::node_client::NodeClient::new(ch.clone());

    // Identity of a node plugin: no controller service, and the controller RPCs are not served.
    let caps = id.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}).await.unwrap().into_inner();
    let controller = csi::plugin_capability::service::Type::ControllerService as i32;
    assert!(
        !caps
            .capabilities
            .iter()
            .any(|c| matches!(&c.r#type, Some(csi::plugin_capability::Type::Service(s)) if s.r#type == controller))
    );
    let mut ctl = csi::controller_client::ControllerClient::new(ch);
    assert_eq!(
        code(ctl.controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {}).await),
        Code::Unimplemented
    );

    let info = node.node_get_info(csi::NodeGetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.node_id, "node-a");
    assert_eq!(info.max_volumes_per_node, 7);
    let segments = info.accessible_topology.unwrap().segments;
    assert_eq!(segments["topology.ferrite.dev/node"], "node-a");
    assert_eq!(segments.len(), 1, "a daemon without a zone reports none: {segments:?}");
    let caps = node.node_get_capabilities(csi::NodeGetCapabilitiesRequest {}).await.unwrap().into_inner();
    use csi::node_service_capability::rpc::Type;
    let rpcs: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| c.r#type.as_ref().map(|csi::node_service_capability::Type::Rpc(r)| r.r#type))
        .collect();
    for t in [Type::StageUnstageVolume, Type::GetVolumeStats, Type::ExpandVolume, Type::VolumeCondition] {
        assert!(rpcs.contains(&(t as i32)), "{t:?} missing from {rpcs:?}");
    }

    let (staging, target) = (dir.path().join("staging"), dir.path().join("target"));
    let w = || mount_cap(Mode::SingleNodeWriter);
    // Required fields first.
    assert_eq!(code(node.node_stage_volume(stage("", &staging, w())).await), Code::InvalidArgument);
    assert_eq!(code(node.node_stage_volume(stage("node-a/v1", Path::new(""), w())).await), Code::InvalidArgument);
    let mut r = stage("node-a/v1", &staging, w());
    r.volume_capability = None;
    assert_eq!(code(node.node_stage_volume(r).await), Code::InvalidArgument);
    let mut bad = w();
    if let Some(csi::volume_capability::AccessType::Mount(m)) = &mut bad.access_type {
        m.fs_type = "btrfs".into();
    }
    assert_eq!(code(node.node_stage_volume(stage("node-a/v1", &staging, bad)).await), Code::InvalidArgument);
    let multi = mount_cap(Mode::MultiNodeMultiWriter);
    assert_eq!(code(node.node_stage_volume(stage("node-a/v1", &staging, multi)).await), Code::InvalidArgument);
    let mut p = publish("node-a/v1", &staging, &target, w());
    p.target_path.clear();
    assert_eq!(code(node.node_publish_volume(p).await), Code::InvalidArgument);
    let p = publish("node-a/v1", Path::new(""), &target, w());
    assert_eq!(code(node.node_publish_volume(p).await), Code::InvalidArgument);
    let unpub = |id: &str, t: &Path| csi::NodeUnpublishVolumeRequest {
        volume_id: id.into(),
        target_path: t.display().to_string(),
    };
    assert_eq!(code(node.node_unpublish_volume(unpub("", &target)).await), Code::InvalidArgument);
    assert_eq!(code(node.node_unpublish_volume(unpub("node-a/v1", Path::new(""))).await), Code::InvalidArgument);
    let unstage = |id: &str, s: &Path| csi::NodeUnstageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: s.display().to_string(),
    };
    assert_eq!(code(node.node_unstage_volume(unstage("node-a/v1", Path::new(""))).await), Code::InvalidArgument);
    let stats = |id: &str, p: &Path| csi::NodeGetVolumeStatsRequest {
        volume_id: id.into(),
        volume_path: p.display().to_string(),
        staging_target_path: String::new(),
    };
    assert_eq!(code(node.node_get_volume_stats(stats("node-a/v1", Path::new(""))).await), Code::InvalidArgument);
    let expand = |id: &str, p: &Path, bytes: i64| csi::NodeExpandVolumeRequest {
        volume_id: id.into(),
        volume_path: p.display().to_string(),
        capacity_range: Some(csi::CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
        ..Default::default()
    };
    assert_eq!(code(node.node_expand_volume(expand("", &target, 1)).await), Code::InvalidArgument);

    // Volumes that are not here: another node's, unknown ones, ids we never made.
    for id in ["node-b/v1", "node-a/missing", "garbage"] {
        assert_eq!(code(node.node_stage_volume(stage(id, &staging, w())).await), Code::NotFound, "{id}");
    }
    assert_eq!(code(node.node_get_volume_stats(stats("node-a/missing", dir.path())).await), Code::NotFound);
    // Undoing what is not done here is done: another node's volume is neither staged nor
    // published here; an id we never made is NotFound.
    node.node_unstage_volume(unstage("node-b/v1", &staging)).await.unwrap();
    node.node_unpublish_volume(unpub("node-b/v1", &target)).await.unwrap();
    assert_eq!(code(node.node_unstage_volume(unstage("garbage", &staging)).await), Code::NotFound);
    assert_eq!(code(node.node_get_volume_stats(stats("node-a/v1", &dir.path().join("nope"))).await), Code::NotFound);

    // No ublk on this kernel: staging with --attach-transport ublk fails cleanly and leaves nothing attached.
    let e = node.node_stage_volume(stage("node-a/v1", &staging, w())).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("ublk"), "{}", e.message());
    assert!(a.ok(&["attachments"]).lines().count() <= 1, "{}", a.ok(&["attachments"]));
    let e = node.node_stage_volume(stage("node-a/v1", &staging, block_cap(Mode::SingleNodeWriter))).await;
    assert_eq!(code(e), Code::FailedPrecondition);

    // Not staged: publish and expand say so; stats report an abnormal condition, not an error.
    let p = publish("node-a/v1", &staging, &target, w());
    assert_eq!(code(node.node_publish_volume(p).await), Code::FailedPrecondition);
    assert!(!target.exists(), "a failed publish must not leave its target behind");
    assert_eq!(code(node.node_expand_volume(expand("node-a/v1", &target, 1 << 20)).await), Code::FailedPrecondition);
    let too_big = expand("node-a/v1", &target, 1 << 40);
    let e = node.node_expand_volume(too_big).await.unwrap_err();
    assert!(e.code() == Code::FailedPrecondition && e.message().contains("ControllerExpandVolume"), "{e:?}");
    let s = node.node_get_volume_stats(stats("node-a/v1", dir.path())).await.unwrap().into_inner();
    let cond = s.volume_condition.unwrap();
    assert!(cond.abnormal && cond.message.contains("not attached"), "{cond:?}");
    assert!(s.usage.iter().any(|u| u.unit == csi::volume_usage::Unit::Inodes as i32 && u.total > 0));

    // Node reclaim needs a path, and a staged volume.
    let mut rn = rs::reclaim_space_node_client::ReclaimSpaceNodeClient::new(addons.clone());
    let reclaim = |id: &str, p: &Path| rs::NodeReclaimSpaceRequest {
        volume_id: id.into(),
        volume_path: p.display().to_string(),
        ..Default::default()
    };
    assert_eq!(code(rn.node_reclaim_space(reclaim("", dir.path())).await), Code::InvalidArgument);
    assert_eq!(code(rn.node_reclaim_space(reclaim("node-a/v1", Path::new(""))).await), Code::InvalidArgument);
    assert_eq!(code(rn.node_reclaim_space(reclaim("node-b/v1", dir.path())).await), Code::NotFound);
    assert_eq!(code(rn.node_reclaim_space(reclaim("node-a/v1", dir.path())).await), Code::FailedPrecondition);

    // Unpublish and unstage are idempotent: nothing there is success; a leftover target is removed.
    node.node_unpublish_volume(unpub("node-a/v1", &target)).await.unwrap();
    std::fs::create_dir_all(&target).unwrap();
    node.node_unpublish_volume(unpub("node-a/v1", &target)).await.unwrap();
    assert!(!target.exists());
    node.node_unpublish_volume(unpub("node-a/v1", &target)).await.unwrap();
    node.node_unstage_volume(unstage("node-a/v1", &staging)).await.unwrap();
    node.node_unstage_volume(unstage("node-a/v1", &staging)).await.unwrap();

    // Probe covers the plugin, not its daemon: a daemon restarting (an upgrade) does not fail
    // the node plugin's liveness; the calls that need the daemon say it is unavailable.
    assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
    a.stop();
    assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
    assert_eq!(code(node.node_stage_volume(stage("node-a/v1", &staging, w())).await), Code::Unavailable);
}

fn write_tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    for i in 0..24u64 {
        let rel = format!("d{}/f{i}", i % 4);
        let data = pattern(i, usize::try_from(i * 29 * 1024 + 100).unwrap());
        std::fs::create_dir_all(dir.join(format!("d{}", i % 4))).unwrap();
        std::fs::write(dir.join(&rel), &data).unwrap();
        files.push((rel, data));
    }
    files.push(("big".into(), pattern(99, 12 << 20)));
    std::fs::write(dir.join("big"), &files.last().unwrap().1).unwrap();
    assert!(std::process::Command::new("sync").status().unwrap().success());
    files
}

fn check_tree(dir: &Path, files: &[(String, Vec<u8>)]) {
    for (rel, data) in files {
        assert!(std::fs::read(dir.join(rel)).unwrap() == *data, "{} differs", dir.join(rel).display());
    }
}

fn is_read_only(err: std::io::Error) -> bool {
    const EROFS: i32 = 30;
    err.raw_os_error() == Some(EROFS)
}

struct Lifecycle {
    dir: tempfile::TempDir,
    daemon: Daemon,
    ctl: csi::controller_client::ControllerClient<tonic::transport::Channel>,
    node: csi::node_client::NodeClient<tonic::transport::Channel>,
    reclaim: rs::reclaim_space_node_client::ReclaimSpaceNodeClient<tonic::transport::Channel>,
    cleaner: rs::reclaim_space_controller_client::ReclaimSpaceControllerClient<tonic::transport::Channel>,
}

impl Lifecycle {
    fn path(&self, p: &str) -> std::path::PathBuf {
        self.dir.path().join(p)
    }

    /// NodeReclaimSpace through `path` (a mount, or "" for a raw block volume): (pre, post) bytes.
    async fn node_reclaim(&mut self, id: &str, path: &str) -> Result<(i64, i64), tonic::Status> {
        let r = rs::NodeReclaimSpaceRequest {
            volume_id: id.into(),
            volume_path: if path.is_empty() {
                self.path("unused").display().to_string()
            } else {
                self.path(path).display().to_string()
            },
            ..Default::default()
        };
        let r = self.reclaim.node_reclaim_space(r).await?.into_inner();
        Ok((r.pre_usage.unwrap().usage_bytes, r.post_usage.unwrap().usage_bytes))
    }

    fn transport(&self) -> &'static str {
        if self.daemon.ok(&["attachments"]).contains("ublk") { "ublk" } else { "nbd" }
    }

    async fn create(&mut self, name: &str, bytes: i64, cap: csi::VolumeCapability, source: Option<String>) -> String {
        let mut r = common::csi::create(name, bytes, Some("node-a"));
        r.volume_capabilities = vec![cap];
        r.volume_content_source = source.map(|snapshot_id| csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
                snapshot_id,
            })),
        });
        self.ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap().volume_id
    }

    async fn snapshot(&mut self, name: &str, volume_id: &str) -> String {
        let r =
            csi::CreateSnapshotRequest { source_volume_id: volume_id.into(), name: name.into(), ..Default::default() };
        self.ctl.create_snapshot(r).await.unwrap().into_inner().snapshot.unwrap().snapshot_id
    }

    async fn stage(&mut self, id: &str, staging: &str, cap: &csi::VolumeCapability) {
        let staging = self.path(staging);
        self.node.node_stage_volume(stage(id, &staging, cap.clone())).await.unwrap();
    }

    async fn publish(&mut self, id: &str, staging: &str, target: &str, cap: &csi::VolumeCapability, ro: bool) {
        let mut r = publish(id, &self.path(staging), &self.path(target), cap.clone());
        r.readonly = ro;
        self.node.node_publish_volume(r).await.unwrap();
    }

    async fn unpublish(&mut self, id: &str, target: &str) {
        let r = csi::NodeUnpublishVolumeRequest {
            volume_id: id.into(),
            target_path: self.path(target).display().to_string(),
        };
        self.node.node_unpublish_volume(r.clone()).await.unwrap();
        self.node.node_unpublish_volume(r).await.unwrap(); // idempotent
        assert!(!self.path(target).exists());
    }

    async fn unstage(&mut self, id: &str, staging: &str) {
        let r = csi::NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: self.path(staging).display().to_string(),
        };
        self.node.node_unstage_volume(r.clone()).await.unwrap();
        self.node.node_unstage_volume(r).await.unwrap(); // idempotent
    }

    async fn stats(&mut self, id: &str, path: &str) -> csi::NodeGetVolumeStatsResponse {
        let r = csi::NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: self.path(path).display().to_string(),
            staging_target_path: String::new(),
        };
        self.node.node_get_volume_stats(r).await.unwrap().into_inner()
    }

    /// ControllerExpandVolume, then NodeExpandVolume on `path`. Online where the device can grow
    /// live (kernel NBD; ublk with UPDATE_SIZE); otherwise the node says so and the next stage
    /// applies the size, which `restage` does.
    async fn expand(&mut self, id: &str, path: &str, bytes: i64, cap: &csi::VolumeCapability) -> bool {
        let r = csi::ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        };
        let done = self.ctl.controller_expand_volume(r).await.unwrap().into_inner();
        assert_eq!(done.capacity_bytes, bytes);
        let r = csi::NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: self.path(path).display().to_string(),
            capacity_range: Some(csi::CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        };
        match self.node.node_expand_volume(r).await {
            Ok(r) => {
                assert_eq!(r.into_inner().capacity_bytes, bytes);
                true
            }
            Err(e) => {
                assert_eq!(self.transport(), "ublk", "only ublk before Linux 6.16 cannot grow online: {e:?}");
                assert!(e.code() == Code::FailedPrecondition && e.message().contains("UPDATE_SIZE"), "{e:?}");
                println!("   ublk here cannot grow online: {}", e.message());
                false
            }
        }
    }
}

fn total_bytes(s: &csi::NodeGetVolumeStatsResponse) -> i64 {
    s.usage.iter().find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32).unwrap().total
}

/// Stage → publish (rw and ro) → files → snapshot → clone staged elsewhere → files match →
/// expand while mounted → unpublish/unstage idempotent, for a filesystem volume.
async fn filesystem_lifecycle(l: &mut Lifecycle, fs: &str) {
    println!("== {fs} volume");
    let mut cap = mount_cap(Mode::SingleNodeWriter);
    if let Some(csi::volume_capability::AccessType::Mount(m)) = &mut cap.access_type {
        m.fs_type = fs.into();
    }
    // mkfs.xfs wants at least 300 MB.
    let id = l.create(&format!("{fs}-vol"), 320 << 20, cap.clone(), None).await;
    // A second stage while the first is still running is Aborted (attach + mkfs take seconds).
    let first = {
        let mut node = l.node.clone();
        let r = stage(&id, &l.path("s1"), cap.clone());
        tokio::spawn(async move { node.node_stage_volume(r).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(code(l.node.node_stage_volume(stage(&id, &l.path("s1"), cap.clone())).await), Code::Aborted);
    first.await.unwrap().unwrap();
    println!("   attached over {}", l.transport());
    l.stage(&id, "s1", &cap).await; // idempotent
    l.publish(&id, "s1", "t1", &cap, false).await;
    l.publish(&id, "s1", "t1", &cap, false).await; // idempotent
    let mut r = publish(&id, &l.path("s1"), &l.path("t1"), cap.clone());
    r.readonly = true;
    assert_eq!(code(l.node.node_publish_volume(r).await), Code::AlreadyExists);
    l.publish(&id, "s1", "t2", &cap, true).await;
    let files = write_tree(&l.path("t1"));
    check_tree(&l.path("t2"), &files);
    assert!(is_read_only(std::fs::write(l.path("t2/new"), b"x").unwrap_err()));

    let s = l.stats(&id, "t1").await;
    let cond = s.volume_condition.clone().unwrap();
    assert!(!cond.abnormal, "{cond:?}");
    let before = total_bytes(&s);
    assert!(before > 200 << 20 && s.usage.iter().any(|u| u.used > 12 << 20), "{s:?}");

    println!("   snapshot, clone, stage the clone elsewhere");
    let snap = l.snapshot(&format!("{fs}-snap"), &id).await;
    let clone = l.create(&format!("{fs}-clone"), 320 << 20, cap.clone(), Some(snap.clone())).await;
    l.stage(&clone, "s2", &cap).await;
    l.publish(&clone, "s2", "t3", &cap, false).await;
    check_tree(&l.path("t3"), &files);
    std::fs::write(l.path("t3/only-in-clone"), b"clone").unwrap();
    assert!(!l.path("t1/only-in-clone").exists());

    println!("   expand while mounted");
    if !l.expand(&id, "t1", 640 << 20, &cap).await {
        l.unpublish(&id, "t2").await;
        l.unpublish(&id, "t1").await;
        l.unstage(&id, "s1").await;
        l.stage(&id, "s1", &cap).await;
        l.publish(&id, "s1", "t1", &cap, false).await;
    }
    let after = total_bytes(&l.stats(&id, "t1").await);
    assert!(after > before + (250 << 20), "filesystem did not grow: {before} → {after}");
    check_tree(&l.path("t1"), &files);

    println!("   delete files, reclaim on the node (fstrim) and the controller (cleaner)");
    std::fs::remove_file(l.path("t1/big")).unwrap();
    std::fs::remove_dir_all(l.path("t1/d1")).unwrap();
    assert!(std::process::Command::new("sync").status().unwrap().success());
    let (pre, post) = l.node_reclaim(&id, "t1").await.unwrap();
    println!("   allocated {pre} → {post} bytes");
    assert!(post + (10 << 20) < pre, "trimming freed the deleted files' blocks: {pre} → {post}");
    let r = rs::ControllerReclaimSpaceRequest { volume_id: id.clone(), ..Default::default() };
    let r = l.cleaner.controller_reclaim_space(r).await.unwrap().into_inner();
    let (pre, post) = (r.pre_usage.unwrap().usage_bytes, r.post_usage.unwrap().usage_bytes);
    println!("   pool used {pre} → {post} bytes");
    assert!(post <= pre);

    println!("   teardown: unstage refuses while published; everything idempotent");
    let r = csi::NodeUnstageVolumeRequest {
        volume_id: clone.clone(),
        staging_target_path: l.path("s2").display().to_string(),
    };
    assert_eq!(code(l.node.node_unstage_volume(r).await), Code::FailedPrecondition);
    l.unpublish(&clone, "t3").await;
    l.unstage(&clone, "s2").await;
    if l.path("t2").exists() {
        l.unpublish(&id, "t2").await;
    }
    l.unpublish(&id, "t1").await;
    l.unstage(&id, "s1").await;
    assert!(!l.daemon.ok(&["attachments"]).contains(&format!("{fs}-")), "{}", l.daemon.ok(&["attachments"]));
    for v in [&clone, &id] {
        l.ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.clone(), ..Default::default() }).await.unwrap();
    }
    l.ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap, ..Default::default() }).await.unwrap();
}

/// The same for a raw block volume: the device node bound onto a file.
async fn block_lifecycle(l: &mut Lifecycle) {
    use std::io::{Read, Seek, SeekFrom, Write};
    println!("== raw block volume");
    let cap = block_cap(Mode::SingleNodeWriter);
    let id = l.create("blk-vol", 64 << 20, cap.clone(), None).await;
    l.stage(&id, "s3", &cap).await;
    l.stage(&id, "s3", &cap).await;
    l.publish(&id, "s3", "t4", &cap, false).await;
    l.publish(&id, "s3", "t4", &cap, false).await;
    let data = pattern(7, 4 << 20);
    let mut f = std::fs::OpenOptions::new().write(true).open(l.path("t4")).unwrap();
    f.seek(SeekFrom::Start(1 << 20)).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let read_at = |p: &Path| {
        let mut f = std::fs::File::open(p).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        let mut got = vec![0; 4 << 20];
        f.read_exact(&mut got).unwrap();
        got
    };
    // Read-only for every publish of the device or for none.
    let mut r = publish(&id, &l.path("s3"), &l.path("t5"), cap.clone());
    r.readonly = true;
    assert_eq!(code(l.node.node_publish_volume(r).await), Code::FailedPrecondition);
    assert!(!l.path("t5").exists());
    l.unpublish(&id, "t4").await;
    l.publish(&id, "s3", "t5", &cap, true).await;
    assert!(read_at(&l.path("t5")) == data);
    let refused = match std::fs::OpenOptions::new().write(true).open(l.path("t5")) {
        Err(e) => e.raw_os_error(),
        Ok(mut f) => f.write_all(&data[..4096]).and_then(|()| f.sync_all()).err().and_then(|e| e.raw_os_error()),
    };
    assert!(matches!(refused, Some(1 | 13 | 30)), "a read-only publish took a write: {refused:?}"); // EPERM, EACCES, EROFS
    assert_eq!(
        code(l.node.node_publish_volume(publish(&id, &l.path("s3"), &l.path("t4"), cap.clone())).await),
        Code::FailedPrecondition
    );
    l.unpublish(&id, "t5").await;
    l.publish(&id, "s3", "t4", &cap, false).await;
    std::fs::OpenOptions::new().write(true).open(l.path("t4")).unwrap().write_all(&data[..4096]).unwrap();
    let s = l.stats(&id, "t4").await;
    assert_eq!(total_bytes(&s), 64 << 20);
    assert!(!s.volume_condition.unwrap().abnormal);

    let snap = l.snapshot("blk-snap", &id).await;
    let clone = l.create("blk-clone", 64 << 20, cap.clone(), Some(snap.clone())).await;
    l.stage(&clone, "s4", &cap).await;
    l.publish(&clone, "s4", "t6", &cap, false).await;
    assert!(read_at(&l.path("t6")) == data);

    if l.expand(&id, "t4", 128 << 20, &cap).await {
        assert_eq!(total_bytes(&l.stats(&id, "t4").await), 128 << 20);
    }

    println!("   zero 2 MiB, reclaim: refused while published, then discards the zeroed blocks");
    let mut f = std::fs::OpenOptions::new().write(true).open(l.path("t4")).unwrap();
    f.seek(SeekFrom::Start(2 << 20)).unwrap();
    f.write_all(&vec![0u8; 2 << 20]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(l.node_reclaim(&id, "").await.unwrap_err().code(), Code::FailedPrecondition);
    l.unpublish(&id, "t4").await;
    let (pre, post) = l.node_reclaim(&id, "").await.unwrap();
    println!("   allocated {pre} → {post} bytes");
    assert!(post + (2 << 20) <= pre, "{pre} → {post}");
    l.publish(&id, "s3", "t4", &cap, false).await;
    let mut want = data.clone();
    want[1 << 20..3 << 20].fill(0);
    assert!(read_at(&l.path("t4")) == want, "only zeroed blocks were discarded");
    for (v, t, s) in [(&clone, "t6", "s4"), (&id, "t4", "s3")] {
        l.unpublish(v, t).await;
        l.unstage(v, s).await;
    }
    assert!(!l.daemon.ok(&["attachments"]).contains("blk-"));
}

/// Mount points under the test directory, from the mount table.
fn mounts_under(dir: &Path) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir = dir.display().to_string();
    table.lines().filter_map(|l| l.split(' ').nth(4)).filter(|t| t.starts_with(&dir)).map(str::to_owned).collect()
}

/// SINGLE_NODE_SINGLE_WRITER: a second target is refused and leaves nothing behind; after the
/// first is unpublished the second may publish; every unpublish removes its bind and target.
async fn single_writer(l: &mut Lifecycle, cap: csi::VolumeCapability) {
    let block = matches!(cap.access_type, Some(csi::volume_capability::AccessType::Block(_)));
    println!("== SINGLE_NODE_SINGLE_WRITER, {}", if block { "raw block" } else { "filesystem" });
    let id = l.create(if block { "snsw-blk" } else { "snsw-fs" }, 64 << 20, cap.clone(), None).await;
    l.stage(&id, "s5", &cap).await;
    l.publish(&id, "s5", "t7", &cap, false).await;
    l.publish(&id, "s5", "t7", &cap, false).await; // the same target again is fine
    let second = l.node.node_publish_volume(publish(&id, &l.path("s5"), &l.path("t8"), cap.clone())).await;
    let err = second.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("t7"), "the refusal names the target in use: {}", err.message());
    assert!(!l.path("t8").exists(), "a refused publish leaves no target");
    l.unpublish(&id, "t7").await;
    l.publish(&id, "s5", "t8", &cap, false).await;
    l.unpublish(&id, "t8").await;
    l.unstage(&id, "s5").await;
    let left = mounts_under(l.dir.path());
    assert!(left.is_empty(), "mounts left behind: {left:?}");
    assert!(!l.path("t7").exists() && !l.path("t8").exists());
    l.ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id, ..Default::default() }).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root and kernel block devices (ublk or nbd): the VM tier runs it (tests/vm/csi_node.sh)"]
async fn node_lifecycle_on_block_devices() {
    let dir = tempfile::tempdir().unwrap();
    let da = dir.path().join("a");
    std::fs::create_dir_all(&da).unwrap();
    let daemon = Daemon::start(&da);
    let addons = dir.path().join("addons.sock").display().to_string();
    let args = ["--mode", "all", "--node-id", "node-a", "--addons-endpoint", &addons];
    let _csi = start_csi(dir.path(), &[("node-a", &daemon)], &args);
    let ch = channel(&dir.path().join("csi.sock")).await;
    let ctl = csi::controller_client::ControllerClient::new(ch.clone());
    let node = csi::node_client::NodeClient::new(ch);
    let ach = channel(Path::new(&addons)).await;
    let reclaim = rs::reclaim_space_node_client::ReclaimSpaceNodeClient::new(ach.clone());
    let cleaner = rs::reclaim_space_controller_client::ReclaimSpaceControllerClient::new(ach);
    let mut l = Lifecycle { dir, daemon, ctl, node, reclaim, cleaner };
    filesystem_lifecycle(&mut l, "ext4").await;
    filesystem_lifecycle(&mut l, "xfs").await;
    block_lifecycle(&mut l).await;
    single_writer(&mut l, mount_cap(Mode::SingleNodeSingleWriter)).await;
    single_writer(&mut l, block_cap(Mode::SingleNodeSingleWriter)).await;
    println!("CSI_NODE_LIFECYCLE_OK");
}

/// A node without a copy of the volume: ControllerPublish grants it the primary's export,
/// NodeStage attaches it through the node's own daemon (kernel NBD, relayed over TLS), files go
/// in, the volume grows online from the other node, and after unpublishing the export the old
/// publish context no longer opens it.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root and the kernel NBD client: the VM tier runs it (tests/vm/remote_nbd.sh)"]
async fn a_node_without_the_volume_stages_it_from_its_primary() {
    stage_from_primary(false).await;
}

/// The same on a node that holds no storage (no daemon: `--no-storage`, as a Kubernetes node
/// without the storage label): the node plugin attaches the volume itself, with the node's
/// certificate; killed (-9) while the volume is mounted and started again, it takes the device
/// back and the filesystem goes on.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root and the kernel NBD client: the VM tier runs it (tests/vm/remote_nbd.sh)"]
async fn a_node_without_storage_stages_it_from_its_primary() {
    stage_from_primary(true).await;
}

async fn stage_from_primary(no_storage: bool) {
    use common::csi::{certs, create, start_csi_with, tcp_node};
    let dir = tempfile::tempdir().unwrap();
    let (_a, a_admin, _) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (na, nb) = ("node-127-0-0-2", "node-127-0-0-3");
    let node_dir = dir.path().join("node-b");
    std::fs::create_dir_all(&node_dir).unwrap();
    // node-b: its daemon, or none and the node plugin's own attachments on the same socket path.
    let (b, b_daemon, plugin_args) = if no_storage {
        let pki = dir.path().join("pki");
        certs(&pki, nb, &["127.0.0.3"]);
        let tls = node_dir.join("tls");
        std::fs::create_dir_all(&tls).unwrap();
        for (from, to) in
            [(format!("{nb}.pem"), "tls.crt"), (format!("{nb}-key.pem"), "tls.key"), ("ca.pem".into(), "ca.crt")]
        {
            std::fs::copy(pki.join(from), tls.join(to)).unwrap();
        }
        let b = Daemon { dir: node_dir.join("run"), child: None };
        let args: Vec<String> = [
            "--no-storage",
            "--admin-socket",
            &b.admin().display().to_string(),
            "--node-tls-dir",
            &tls.display().to_string(),
            "--attach-state-dir",
            &node_dir.join("state").display().to_string(),
        ]
        .map(str::to_owned)
        .into();
        (b, None, args)
    } else {
        let (b, b_admin, _) = tcp_node(&dir.path().join("b"), "127.0.0.3");
        (Daemon { dir: b.dir.clone(), child: None }, Some((b, b_admin)), Vec::new())
    };
    let b_endpoint = b_daemon.as_ref().map_or_else(String::new, |(_, a)| format!("tcp://{a}"));
    let nodes = [(na, format!("tcp://{a_admin}")), (nb, b_endpoint)];
    let _ctl = start_csi_with(dir.path(), &nodes, &["--mode", "controller"]);
    let mut args = vec!["--mode", "node", "--node-id", nb];
    args.extend(plugin_args.iter().map(String::as_str));
    let start_plugin = || start_csi_with(&node_dir, &[(nb, b.admin().display().to_string())], &args);
    let mut plugin = start_plugin();
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    let mut node = csi::node_client::NodeClient::new(channel(&node_dir.join("csi.sock")).await);
    let cap = mount_cap(Mode::SingleNodeWriter);
    let mut far = create("far", 256 << 20, Some(na));
    far.parameters.insert("remoteAccess".into(), "true".into());
    let far = ctl.create_volume(far).await.unwrap().into_inner().volume.unwrap();
    let id = far.volume_id.clone();
    let (staging, target) = (dir.path().join("staging"), dir.path().join("target"));

    // Without a publication the node has nothing to reach it with.
    let e = node.node_stage_volume(stage(&id, &staging, cap.clone())).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let publish_req = csi::ControllerPublishVolumeRequest {
        volume_id: id.clone(),
        node_id: nb.into(),
        volume_capability: Some(cap.clone()),
        volume_context: far.volume_context.clone(),
        ..Default::default()
    };
    let ctx = ctl.controller_publish_volume(publish_req).await.unwrap().into_inner().publish_context;
    assert_eq!(ctx["primary"], na);
    let mut s = stage(&id, &staging, cap.clone());
    s.publish_context = ctx.clone();
    node.node_stage_volume(s.clone()).await.unwrap();
    node.node_stage_volume(s.clone()).await.unwrap(); // idempotent
    let att = b.json(&["attachments"]);
    assert_eq!(att[0]["remote"], ctx["nbd"].as_str(), "{att}");
    let mut p = publish(&id, &staging, &target, cap.clone());
    p.publish_context = ctx.clone();
    node.node_publish_volume(p).await.unwrap();
    let mut files = write_tree(&target);
    check_tree(&target, &files);
    if no_storage {
        // The plugin dies with the volume mounted; a new one takes the device back.
        drop(plugin);
        plugin = start_plugin();
        node = csi::node_client::NodeClient::new(channel(&node_dir.join("csi.sock")).await);
        assert_eq!(b.json(&["attachments"])[0]["remote"], ctx["nbd"].as_str());
        files.push(("after".into(), pattern(7, 3 << 20)));
        std::fs::write(target.join("after"), &files.last().unwrap().1).unwrap();
        assert!(std::process::Command::new("sync").status().unwrap().success());
        std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
        check_tree(&target, &files);
        // A local volume cannot be attached where no storage is.
        let e = node.node_stage_volume(stage(&id, &dir.path().join("s2"), cap.clone())).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
    }
    let stats = csi::NodeGetVolumeStatsRequest {
        volume_id: id.clone(),
        volume_path: target.display().to_string(),
        staging_target_path: String::new(),
    };
    let st = node.node_get_volume_stats(stats.clone()).await.unwrap().into_inner();
    assert!(!st.volume_condition.unwrap().abnormal);

    // The primary's node grows it; the node's device and filesystem follow online.
    let grow = csi::ControllerExpandVolumeRequest {
        volume_id: id.clone(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 512 << 20, limit_bytes: 0 }),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    ctl.controller_expand_volume(grow).await.unwrap();
    let r = csi::NodeExpandVolumeRequest {
        volume_id: id.clone(),
        volume_path: target.display().to_string(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 512 << 20, limit_bytes: 0 }),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    assert_eq!(node.node_expand_volume(r).await.unwrap().into_inner().capacity_bytes, 512 << 20);
    let st = node.node_get_volume_stats(stats).await.unwrap().into_inner();
    assert!(total_bytes(&st) > 400 << 20, "{st:?}");
    check_tree(&target, &files);

    // Unpublish on the node, then the controller's: the export is gone, the old context fails.
    let r = csi::NodeUnpublishVolumeRequest { volume_id: id.clone(), target_path: target.display().to_string() };
    node.node_unpublish_volume(r).await.unwrap();
    let r = csi::NodeUnstageVolumeRequest { volume_id: id.clone(), staging_target_path: staging.display().to_string() };
    node.node_unstage_volume(r.clone()).await.unwrap();
    node.node_unstage_volume(r).await.unwrap(); // idempotent
    assert!(b.json(&["attachments"]).as_array().unwrap().is_empty());
    let unpublish =
        csi::ControllerUnpublishVolumeRequest { volume_id: id.clone(), node_id: nb.into(), ..Default::default() };
    ctl.controller_unpublish_volume(unpublish).await.unwrap();
    let e = node.node_stage_volume(s).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(b.json(&["attachments"]).as_array().unwrap().is_empty());
    drop(plugin);
    println!("CSI_REMOTE_STAGE_OK");
}
