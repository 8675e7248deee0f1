//! Snapshots that are backups, through the CSI controller (a VolumeSnapshotClass's `backup`
//! parameter) over mutual TLS as the controller role: two daemons on two loopback addresses (and a
//! third, for a witness, with no target)
//! sharing a paced S3 target (SeaweedFS) named in a targets file of their own. CreateSnapshot
//! answers "not ready" while the upload runs and the backup once it is there; CreateVolume from
//! it restores on the node the topology picks, and a replicated class waits for the restore
//! before its copies are made; DeleteSnapshot deletes the backup and its base snapshot; what the
//! controller may not do with backups is refused.

use crate::common;
use crate::weed;

use std::time::{Duration, Instant};

use common::csi::{channel, create, start_csi_with, tcp_node_with, tls_channel};
use common::nbd::{connect, read_image, write_on};
use common::pattern;
use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use tonic::Code;

const MIB: i64 = 1 << 20;

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;

fn backup_snapshot(source: &str, name: &str) -> csi::CreateSnapshotRequest {
    csi::CreateSnapshotRequest {
        source_volume_id: source.to_owned(),
        name: name.into(),
        parameters: [("backup".to_owned(), "offsite".to_owned())].into(),
        ..Default::default()
    }
}

fn from_snapshot(name: &str, node: &str, snapshot_id: &str, copies: &str) -> csi::CreateVolumeRequest {
    let mut r = create(name, 16 * MIB, Some(node));
    r.parameters.insert("replicas".into(), copies.into());
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: snapshot_id.to_owned(),
        })),
    });
    r
}

/// Calls `f` until it stops answering `retry` (at most a minute); its last answer.
async fn until<T, F, Fut>(retry: Code, mut f: F) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let start = Instant::now();
    loop {
        match f().await {
            Err(s) if s.code() == retry && start.elapsed() < Duration::from_secs(60) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn backup_snapshots_through_the_controller() {
    let Some(store) = weed::Weed::start(true) else { return };
    let dir = tempfile::tempdir().unwrap();
    // The targets file, as the DaemonSet mounts it from a Secret: paths relative to it. Paced to
    // 2 MiB/s so that the 12 MiB backed up and restored below take longer than a call waits.
    let secret = dir.path().join("backup");
    std::fs::create_dir_all(&secret).unwrap();
    let targets = format!(
        "[offsite]\nkind = \"s3\"\nendpoint = \"{}\"\nbucket = \"ferrite-test\"\nprefix = \"csi\"\n\
         credentials = \".\"\nchunk-size = \"1M\"\nbandwidth = \"2M\"\n\
         [second-site]\nkind = \"dir\"\npath = {:?}\nchunk-size = \"1M\"\n",
        store.endpoint(),
        dir.path().join("second-site").display().to_string()
    );
    std::fs::write(secret.join("targets.toml"), targets).unwrap();
    std::fs::write(secret.join("access-key-id"), "ferrite").unwrap();
    std::fs::write(secret.join("secret-access-key"), "ferrite-secret").unwrap();
    let extra = format!("backup-targets-file = {:?}", secret.join("targets.toml").display().to_string());
    let (a, a_admin, _) = tcp_node_with(&dir.path().join("a"), "127.0.0.2", &extra);
    let (b, b_admin, _) = tcp_node_with(&dir.path().join("b"), "127.0.0.3", &extra);
    // A third node for a replicated class's witness; it has no target and needs none.
    let (_c, c_admin, _) = tcp_node_with(&dir.path().join("c"), "127.0.0.4", "");
    let nodes = [
        ("node-a", format!("tcp://{a_admin}")),
        ("node-b", format!("tcp://{b_admin}")),
        ("node-c", format!("tcp://{c_admin}")),
    ];
    let _csi = start_csi_with(dir.path(), &nodes, &["--mode", "controller"]);
    let mut ctl: Controller =
        csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);

    println!("== a backup snapshot: not ready while it uploads, then the backup");
    let v = ctl.create_volume(create("v1", 16 * MIB, Some("node-a"))).await.unwrap().into_inner().volume.unwrap();
    a.ok(&["export", "nbd", "v1"]);
    // Noise (it does not compress): 4 MiB at 0, 8 MiB at 8 MiB; the rest stays zero.
    let mut s = connect(&a.nbd(), "v1");
    assert_eq!(write_on(&mut s, 0, &pattern(1, 4 << 20)), 0);
    assert_eq!(write_on(&mut s, 8 << 20, &pattern(2, 8 << 20)), 0);
    drop(s);
    a.ok(&["export", "stop", "v1"]);
    let first = ctl.create_snapshot(backup_snapshot(&v.volume_id, "nightly")).await.unwrap().into_inner();
    let first = first.snapshot.unwrap();
    assert_eq!(first.snapshot_id, "backup:offsite/v1/csi.nightly");
    assert!(!first.ready_to_use, "12 MiB at 2 MiB/s is not done within the call: {first:?}");
    // The point in time is the first call's: asked again, the same snapshot, until it is done.
    let start = Instant::now();
    let done = loop {
        let s = ctl.create_snapshot(backup_snapshot(&v.volume_id, "nightly")).await.unwrap().into_inner();
        let s = s.snapshot.unwrap();
        assert_eq!(s.snapshot_id, first.snapshot_id);
        if s.ready_to_use {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the backup did not finish");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(done.size_bytes, 16 * MIB);
    let listed = b.json(&["backup", "list", "--target", "offsite"]);
    assert_eq!(listed.as_array().unwrap().len(), 1, "one backup, however often it was asked for: {listed}");
    let by_id = csi::ListSnapshotsRequest { snapshot_id: done.snapshot_id.clone(), ..Default::default() };
    let got = ctl.list_snapshots(by_id.clone()).await.unwrap().into_inner().entries;
    assert_eq!(got.len(), 1);
    assert!(got[0].snapshot.as_ref().unwrap().ready_to_use);
    let stranger = csi::ListSnapshotsRequest { snapshot_id: "backup:offsite/v1/csi.none".into(), ..Default::default() };
    assert!(ctl.list_snapshots(stranger).await.unwrap().into_inner().entries.is_empty());

    println!("== a claim from it restores on the node the topology picks, serving at once");
    let r = ctl.create_volume(from_snapshot("r1", "node-b", &done.snapshot_id, "1")).await.unwrap().into_inner();
    assert_eq!(r.volume.unwrap().volume_id, "node-b/r1");
    let want = read_image(&a, "v1", 16 << 20);
    assert!(read_image(&b, "r1", 16 << 20) == want, "the restored volume holds the snapshot's bytes");

    println!("== a replicated class: restored once, its copies made when the restore is done");
    let call = || {
        let mut ctl = ctl.clone();
        let req = from_snapshot("r2", "node-a", &done.snapshot_id, "2");
        async move { ctl.create_volume(req).await }
    };
    let refused = call().await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused}");
    assert!(refused.message().contains("being restored"), "{refused}");
    let v2 = until(Code::Unavailable, call).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(v2.volume_id, "_/r2");
    let copies = &v2.volume_context["copies"];
    assert!(copies.starts_with("node-a,") && copies.split(',').count() == 2, "{copies}");
    let primary = a.json(&["replica", "status", "r2"]);
    assert_eq!(primary["role"], "primary", "{primary}");
    let start = Instant::now();
    while !a.json(&["replica", "status", "r2"])["members"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["state"] != "rebuilding")
    {
        assert!(start.elapsed() < Duration::from_secs(60), "r2's copy did not get in sync");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(read_image(&a, "r2", 16 << 20) == want);

    println!("== what does not fit is refused");
    let mut enc = from_snapshot("r3", "node-a", &done.snapshot_id, "1");
    enc.parameters.insert("encrypted".into(), "true".into());
    enc.secrets.insert("encryptionKey".into(), "11".repeat(32));
    let e = ctl.create_volume(enc).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("plain volume"), "{e}");
    let mut bad = backup_snapshot(&v.volume_id, "y");
    bad.parameters.insert("backup".into(), "nowhere".into());
    let e = ctl.create_snapshot(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("nowhere"), "{e}");
    // The controller makes, finds, deletes and restores single backups; listing, verifying and
    // pruning a target stay an operator's.
    let mut as_controller =
        pb::backups_client::BackupsClient::new(tls_channel(&a_admin.to_string(), &dir.path().join("pki"), "csi").await);
    let e = as_controller.prune_backups(pb::PruneBackupsRequest { target: "offsite".into(), ..Default::default() });
    assert_eq!(e.await.unwrap_err().code(), Code::PermissionDenied);
    let e = as_controller.list_backups(pb::ListBackupsRequest { target: "offsite".into(), volume: String::new() });
    assert_eq!(e.await.unwrap_err().code(), Code::PermissionDenied);
    // It deletes only the backups it made: an operator's is out of its reach.
    let operators = a.json(&["backup", "create", "v1", "--target", "offsite"]);
    let name = operators["name"].as_str().unwrap().to_owned();
    let e = as_controller.delete_backup(pb::DeleteBackupRequest { target: "offsite".into(), name: name.clone() });
    let e = e.await.unwrap_err();
    assert!(e.code() == Code::PermissionDenied && e.message().contains("only an operator"), "{e:?}");
    assert_eq!(b.json(&["backup", "show", &name, "--target", "offsite"])["name"], name.as_str());
    // An operator's copy of the CSI snapshot's backup to a second site is the operator's: the
    // controller may not delete it there; and an operator's prune keeps the CSI snapshot's.
    let config = dir.path().join("a").join("ferrite.toml").display().to_string();
    let copied =
        a.json(&["backup", "copy", "v1/csi.nightly", "--from", "offsite", "--to", "second-site", "--config", &config]);
    assert_eq!(copied["to"], "second-site", "{copied}");
    let shown = a.json(&["backup", "show", "v1/csi.nightly", "--target", "second-site"]);
    assert_eq!(shown["copied_from"], "offsite", "{shown}");
    let req = pb::DeleteBackupRequest { target: "second-site".into(), name: "v1/csi.nightly".into() };
    let e = as_controller.delete_backup(req).await.unwrap_err();
    assert!(e.code() == Code::PermissionDenied && e.message().contains("operator's copy"), "{e:?}");
    let pruned = a.json(&["backup", "prune", "--target", "offsite", "--keep-last", "1"]);
    assert_eq!(pruned["backups_deleted"], serde_json::json!([]), "{pruned}");

    println!("== deleting the snapshot deletes the backup and the snapshot it was taken from");
    let delete = csi::DeleteSnapshotRequest { snapshot_id: done.snapshot_id.clone(), ..Default::default() };
    ctl.delete_snapshot(delete.clone()).await.unwrap();
    ctl.delete_snapshot(delete).await.unwrap();
    assert!(ctl.list_snapshots(by_id).await.unwrap().into_inner().entries.is_empty());
    let listed = b.json(&["backup", "list", "--target", "offsite"]);
    assert_eq!(listed.as_array().map(|l| l.iter().map(|b| b["name"].clone()).collect()), Some(vec![name.into()]));
    let left = a.ok(&["snapshot", "list"]);
    assert!(!left.contains("v1.backup.offsite.csi.nightly") && left.contains("v1.backup.offsite.2"), "{left}");
}
