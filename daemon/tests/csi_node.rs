//! The CSI Node service of `ferrite csi --mode node` over its real gRPC socket and a real daemon.
//! Here (no kernel block devices): identity, info, capabilities and every error a caller can
//! cause. The full lifecycle on real devices is `node_lifecycle_on_block_devices`, which the VM
//! tier runs in a guest (tests/vm/csi_node.sh).

mod common;

use std::path::Path;

use common::Daemon;
use common::csi::{block_cap, channel, code, mount_cap, start_csi};
use ferrite_proto::csi::v1 as csi;
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
        &["--mode", "node", "--node-id", "node-a", "--attach-transport", "ublk", "--max-volumes", "7"],
    );
    let ch = channel(&dir.path().join("csi.sock")).await;
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
    assert_eq!(info.accessible_topology.unwrap().segments["topology.ferrite.dev/node"], "node-a");
    let caps = node.node_get_capabilities(csi::NodeGetCapabilitiesRequest {}).await.unwrap().into_inner();
    use csi::node_service_capability::rpc::Type;
    let rpcs: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(csi::node_service_capability::Type::Rpc(r)) => Some(r.r#type),
            None => None,
        })
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

    // Unpublish and unstage are idempotent: nothing there is success; a leftover target is removed.
    node.node_unpublish_volume(unpub("node-a/v1", &target)).await.unwrap();
    std::fs::create_dir_all(&target).unwrap();
    node.node_unpublish_volume(unpub("node-a/v1", &target)).await.unwrap();
    assert!(!target.exists());
    node.node_unpublish_volume(unpub("node-a/v1", &target)).await.unwrap();
    node.node_unstage_volume(unstage("node-a/v1", &staging)).await.unwrap();
    node.node_unstage_volume(unstage("node-a/v1", &staging)).await.unwrap();

    // Probe follows the daemon.
    assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
    a.stop();
    assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(false));
    assert_eq!(code(node.node_stage_volume(stage("node-a/v1", &staging, w())).await), Code::Unavailable);
}
