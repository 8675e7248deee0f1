//! CSI-Addons Replication conformance over the real gRPC socket of `ferrite csi --mode
//! controller`: two real daemons on 127.0.0.2 and 127.0.0.3 (their admin APIs on TCP with mutual
//! TLS, which is also the replication link), every RPC, the state transitions and the error codes.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::csi::{channel, code, create, start_csi_with, tcp_node};
use common::nbd::{open, read_image, write_on};
use ferrite_proto::csi::v1 as csi;
use ferrite_proto::csi_addons::identity;
use ferrite_proto::csi_addons::replication as rp;
use rp::replication_source::{Type, VolumeGroupSource, VolumeSource};
use tonic::Code;

fn source(id: &str) -> Option<rp::ReplicationSource> {
    Some(rp::ReplicationSource { r#type: Some(Type::Volume(VolumeSource { volume_id: id.into() })) })
}

fn params(list: &[(&str, &str)]) -> HashMap<String, String> {
    list.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn enable(id: &str, p: &[(&str, &str)]) -> rp::EnableVolumeReplicationRequest {
    rp::EnableVolumeReplicationRequest { replication_source: source(id), parameters: params(p), ..Default::default() }
}

fn promote(id: &str, force: bool) -> rp::PromoteVolumeRequest {
    rp::PromoteVolumeRequest { replication_source: source(id), force, ..Default::default() }
}

fn demote(id: &str) -> rp::DemoteVolumeRequest {
    rp::DemoteVolumeRequest { replication_source: source(id), ..Default::default() }
}

fn resync(id: &str) -> rp::ResyncVolumeRequest {
    rp::ResyncVolumeRequest { replication_source: source(id), ..Default::default() }
}

fn info(id: &str) -> rp::GetVolumeReplicationInfoRequest {
    rp::GetVolumeReplicationInfoRequest { replication_source: source(id), ..Default::default() }
}

fn disable(id: &str) -> rp::DisableVolumeReplicationRequest {
    rp::DisableVolumeReplicationRequest { replication_source: source(id), ..Default::default() }
}

/// Retries `f` until it returns Some, for up to 30 s.
async fn eventually<T, F: std::future::Future<Output = Option<T>>>(what: &str, mut f: impl FnMut() -> F) -> T {
    let start = Instant::now();
    loop {
        if let Some(t) = f().await {
            return t;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{what} did not happen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_conformance_between_two_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let (a, a_admin, _) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (b, b_admin, _) = tcp_node(&dir.path().join("b"), "127.0.0.3");
    let _csi = start_csi_with(
        dir.path(),
        &[("node-a", format!("tcp://{a_admin}")), ("node-b", format!("tcp://{b_admin}"))],
        &[
            "--mode",
            "controller",
            "--addons-endpoint",
            &dir.path().join("addons.sock").display().to_string(),
            // The operator's peers: replication goes to these and nowhere else.
            "--replication-peer=b=node:node-b",
            "--replication-peer=a=node:node-a",
        ],
    );
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    let addons = channel(&dir.path().join("addons.sock")).await;
    let mut rc = rp::controller_client::ControllerClient::new(addons.clone());

    // Advertised by the add-ons identity.
    let caps = identity::identity_client::IdentityClient::new(addons)
        .get_capabilities(identity::GetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let replication = identity::capability::volume_replication::Type::VolumeReplication as i32;
    assert!(caps.iter().any(
        |c| matches!(&c.r#type, Some(identity::capability::Type::VolumeReplication(r)) if r.r#type == replication)
    ));

    let v = ctl.create_volume(create("pvc-1", 8 << 20, Some("node-a"))).await.unwrap().into_inner().volume.unwrap();
    let id = v.volume_id.clone();
    assert_eq!(write_on(&mut open(&a, "pvc-1"), 0, &[7u8; 1 << 20]), 0);
    let peer = [("peer", "b"), ("schedulingInterval", "1s")];

    // Bad requests.
    let none = rp::EnableVolumeReplicationRequest { parameters: params(&peer), ..Default::default() };
    assert_eq!(code(rc.enable_volume_replication(none).await), Code::InvalidArgument);
    let err =
        rc.enable_volume_replication(enable(&id, &[("peerNode", "node-b"), ("colour", "red")])).await.unwrap_err();
    assert!(err.code() == Code::InvalidArgument && err.message().contains("colour"), "{err}");
    let err = rc.enable_volume_replication(enable(&id, &[("peerNode", "node-b"), ("schedulingInterval", "5y")])).await;
    assert_eq!(code(err), Code::InvalidArgument);
    assert_eq!(
        code(rc.enable_volume_replication(enable(&id, &[("schedulingInterval", "1m")])).await),
        Code::InvalidArgument
    );
    // A peer the operator did not list, whichever way it is named: refused, and nothing is pushed.
    let b_endpoint = format!("tcp://{b_admin}");
    for unlisted in [
        ("peerNode", "node-z"),
        ("peer", "c"),
        ("peerEndpoint", "tcp://127.0.0.9:7070"),
        ("peerEndpoint", "node:node-b"),
    ] {
        let err = rc.enable_volume_replication(enable(&id, &[unlisted])).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{unlisted:?}: {err}");
        assert!(err.message().contains("--replication-peer"), "{err}");
    }
    let two = enable(&id, &[("peer", "b"), ("peerEndpoint", b_endpoint.as_str())]);
    assert_eq!(code(rc.enable_volume_replication(two).await), Code::InvalidArgument);
    assert_eq!(code(rc.enable_volume_replication(enable("node-a/missing", &peer)).await), Code::NotFound);
    let group = rp::EnableVolumeReplicationRequest {
        replication_source: Some(rp::ReplicationSource {
            r#type: Some(Type::Volumegroup(VolumeGroupSource { volume_group_id: "node-a/g".into() })),
        }),
        parameters: params(&peer),
        ..Default::default()
    };
    assert_eq!(code(rc.enable_volume_replication(group).await), Code::NotFound);
    for c in [code(rc.promote_volume(promote(&id, false)).await), code(rc.demote_volume(demote(&id)).await)] {
        assert_eq!(c, Code::FailedPrecondition, "not replicated yet");
    }
    assert_eq!(code(rc.get_volume_replication_info(info(&id)).await), Code::FailedPrecondition);

    // Enabled (twice: idempotent); the 1 s schedule syncs it, and the info says so.
    rc.enable_volume_replication(enable(&id, &peer)).await.unwrap();
    rc.enable_volume_replication(enable(&id, &peer)).await.unwrap();
    let i = eventually("a first sync", || {
        let (mut rc, id) = (rc.clone(), id.clone());
        async move { rc.get_volume_replication_info(info(&id)).await.ok().map(|r| r.into_inner()) }
    })
    .await;
    assert_eq!(i.status, rp::get_volume_replication_info_response::Status::Healthy as i32, "{i:?}");
    assert!(i.last_sync_time.is_some_and(|t| t.seconds > 1_700_000_000));
    assert!(i.last_sync_bytes >= 0);
    let b_id = "node-b/pvc-1";
    let dest = |src| rp::GetReplicationDestinationInfoRequest { replication_source: src, ..Default::default() };
    let d = rc.get_replication_destination_info(dest(source(&id))).await.unwrap().into_inner();
    assert_eq!(
        d.replication_destination.and_then(|d| d.r#type),
        Some(rp::replication_destination::Type::Volume(rp::replication_destination::VolumeDestination {
            volume_id: b_id.into()
        }))
    );
    assert_eq!(code(rc.get_volume_replication_info(info(b_id)).await), Code::FailedPrecondition, "B is no primary");
    // Enabling on the secondary (the other cluster's VolumeReplication) is accepted as is.
    rc.enable_volume_replication(enable(b_id, &[("peerNode", "node-a")])).await.unwrap();

    // Promotion of B must wait for A's demotion; A cannot be resynced while primary.
    let err = rc.promote_volume(promote(b_id, false)).await.unwrap_err();
    assert!(err.code() == Code::FailedPrecondition && err.message().contains("still primary"), "{err}");
    assert_eq!(code(rc.resync_volume(resync(&id)).await), Code::FailedPrecondition);
    rc.promote_volume(promote(&id, false)).await.unwrap(); // already primary: idempotent

    // Planned failover: demote A (final delta), promote B; then resync A until ready.
    rc.demote_volume(demote(&id)).await.unwrap();
    rc.demote_volume(demote(&id)).await.unwrap();
    rc.promote_volume(promote(b_id, false)).await.unwrap();
    assert_eq!(read_image(&b, "pvc-1", 1 << 20), vec![7u8; 1 << 20]);
    assert_eq!(write_on(&mut open(&b, "pvc-1"), 0, &[8u8; 4096]), 0);
    eventually("A resynced from B", || {
        let (mut rc, id) = (rc.clone(), id.clone());
        async move { rc.resync_volume(resync(&id)).await.unwrap().into_inner().ready.then_some(()) }
    })
    .await;
    let s: serde_json::Value = serde_json::from_str(&a.ok(&["-o", "json", "replica", "status", "pvc-1"])).unwrap();
    assert_eq!(s["role"], "secondary", "{s}");

    // Disable on both sides, twice (idempotent); after that nothing is replicated.
    for vid in [b_id, &id, b_id, &id] {
        rc.disable_volume_replication(disable(vid)).await.unwrap();
    }
    assert_eq!(code(rc.promote_volume(promote(&id, true)).await), Code::FailedPrecondition);
    assert_eq!(code(rc.disable_volume_replication(disable("node-a/missing")).await), Code::NotFound);

    // A volume group replicates as one unit.
    ctl.create_volume(create("pvc-2", 8 << 20, Some("node-a"))).await.unwrap();
    a.ok(&["group", "create", "grp", "pvc-2"]);
    let grp = || {
        Some(rp::ReplicationSource {
            r#type: Some(Type::Volumegroup(VolumeGroupSource { volume_group_id: "node-a/grp".into() })),
        })
    };
    let req = rp::EnableVolumeReplicationRequest {
        replication_source: grp(),
        parameters: params(&peer),
        ..Default::default()
    };
    rc.enable_volume_replication(req).await.unwrap();
    let i = eventually("a first group sync", || {
        let mut rc = rc.clone();
        async move {
            let req = rp::GetVolumeReplicationInfoRequest { replication_source: grp(), ..Default::default() };
            rc.get_volume_replication_info(req).await.ok().map(|r| r.into_inner())
        }
    })
    .await;
    assert_eq!(i.status, rp::get_volume_replication_info_response::Status::Healthy as i32, "{i:?}");
    let d = rc.get_replication_destination_info(dest(grp())).await.unwrap().into_inner();
    let Some(rp::replication_destination::Type::Volumegroup(g)) = d.replication_destination.and_then(|d| d.r#type)
    else {
        panic!("a group's destination is a group")
    };
    assert_eq!(g.volume_group_id, "node-b/grp");
    assert_eq!(g.volume_ids, HashMap::from([("node-a/pvc-2".to_owned(), "node-b/pvc-2".to_owned())]));
    assert_eq!(code(rc.get_replication_destination_info(dest(source("node-a/missing"))).await), Code::NotFound);
    let s: serde_json::Value = serde_json::from_str(&b.ok(&["-o", "json", "replica", "status", "grp"])).unwrap();
    assert_eq!((s["group"].as_bool(), s["role"].as_str()), (Some(true), Some("secondary")), "{s}");
}
