//! CSI conformance over the real gRPC socket of `ferrite csi --mode controller`, with two real
//! daemons on two loopback addresses (127.0.0.2, 127.0.0.3) standing for two nodes (node-a,
//! node-b) in its node directory.

use crate::common;

use std::collections::HashMap;

use common::Daemon;
use common::csi::{channel, code, create, mount_cap, start_csi, start_csi_with, tcp_node};
use ferrite_proto::csi::v1 as csi;
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn controller_conformance_across_two_nodes() {
    let dir = tempfile::tempdir().unwrap();
    // Two nodes on two loopback addresses, reached over their TCP admin listeners.
    let (mut a, a_admin, _) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (mut b, b_admin, _) = tcp_node(&dir.path().join("b"), "127.0.0.3");
    // node-c holds no storage: remote-access volumes are scheduled there and reached remotely.
    let nodes =
        [("node-a", format!("tcp://{a_admin}")), ("node-b", format!("tcp://{b_admin}")), ("node-c", String::new())];
    let _csi = start_csi_with(dir.path(), &nodes, &["--mode", "controller"]);
    let ch = channel(&dir.path().join("csi.sock")).await;
    let mut id = csi::identity_client::IdentityClient::new(ch.clone());
    let ctl_channel = ch.clone();
    let mut ctl = csi::controller_client::ControllerClient::new(ch);

    // Identity.
    let info = id.get_plugin_info(csi::GetPluginInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.name, "csi.ferrite.dev");
    let caps = id.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}).await.unwrap().into_inner();
    let services: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(csi::plugin_capability::Type::Service(s)) => Some(s.r#type),
            _ => None,
        })
        .collect();
    use csi::plugin_capability::service::Type as S;
    assert!(services.contains(&(S::ControllerService as i32)));
    assert!(services.contains(&(S::VolumeAccessibilityConstraints as i32)));
    assert!(services.contains(&(S::GroupControllerService as i32)));
    assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));

    // CreateVolume: required fields and validation first.
    assert_eq!(code(ctl.create_volume(create("", 1 << 20, None)).await), Code::InvalidArgument);
    let mut r = create("v1", 1 << 20, None);
    r.volume_capabilities.clear();
    assert_eq!(code(ctl.create_volume(r).await), Code::InvalidArgument);
    let mut r = create("v1", 1 << 20, None);
    r.volume_capabilities = vec![mount_cap(csi::volume_capability::access_mode::Mode::MultiNodeMultiWriter)];
    assert_eq!(code(ctl.create_volume(r).await), Code::InvalidArgument);
    let mut r = create("v1", 1 << 20, None);
    r.parameters.insert("replicas".into(), "4".into());
    assert_eq!(code(ctl.create_volume(r).await), Code::InvalidArgument);
    let mut r = create("v1", 1 << 20, None);
    r.parameters.insert("color".into(), "blue".into());
    assert_eq!(code(ctl.create_volume(r).await), Code::InvalidArgument);
    // Three copies on two nodes: refused before anything is made.
    let mut r = create("v1", 1 << 20, None);
    r.parameters.insert("replicas".into(), "3".into());
    assert_eq!(code(ctl.create_volume(r).await), Code::ResourceExhausted);
    assert!(a.json(&["volume", "list"]).as_array().unwrap().is_empty());
    let mut r = create("v1", 10_000, None);
    r.capacity_range.as_mut().unwrap().limit_bytes = 10_000;
    assert_eq!(code(ctl.create_volume(r).await), Code::OutOfRange);
    assert_eq!(code(ctl.create_volume(create("v1", 1 << 20, Some("node-z"))).await), Code::ResourceExhausted);

    // Placement by topology, idempotency by name, AlreadyExists on an incompatible repeat.
    let v1 = ctl.create_volume(create("v1", 10_000, Some("node-b"))).await.unwrap().into_inner().volume.unwrap();
    assert!(v1.volume_id.starts_with("node-b/"), "{}", v1.volume_id);
    assert_eq!(v1.capacity_bytes, 12_288, "rounded up to whole 4 KiB blocks");
    assert_eq!(v1.accessible_topology[0].segments["topology.ferrite.dev/node"], "node-b");
    let again = ctl.create_volume(create("v1", 10_000, Some("node-b"))).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(again.volume_id, v1.volume_id);
    assert_eq!(code(ctl.create_volume(create("v1", 1 << 30, None)).await), Code::AlreadyExists);
    assert!(b.ok(&["volume", "list"]).contains("v1"));
    // A name the engine does not accept still works, and stays idempotent.
    let odd = ctl.create_volume(create("my data/ü", 1 << 20, Some("node-a"))).await.unwrap().into_inner();
    let odd2 = ctl.create_volume(create("my data/ü", 1 << 20, Some("node-a"))).await.unwrap().into_inner();
    assert_eq!(odd.volume.unwrap().volume_id, odd2.volume.unwrap().volume_id);

    // A clone of a volume lives with its source, whatever topology asked for.
    let mut r = create("v1-clone", 1 << 20, Some("node-a"));
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
            volume_id: v1.volume_id.clone(),
        })),
    });
    let c = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    assert!(c.volume_id.starts_with("node-b/") && c.capacity_bytes == 1 << 20, "{c:?}");
    let mut r = create("bad-clone", 1 << 20, None);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
            volume_id: "node-b/nope".into(),
        })),
    });
    assert_eq!(code(ctl.create_volume(r).await), Code::NotFound);

    // ListVolumes: pagination over both nodes, Aborted on a bad token.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let req = csi::ListVolumesRequest { max_entries: 2, starting_token: token.clone() };
        let page = ctl.list_volumes(req).await.unwrap().into_inner();
        assert!(page.entries.len() <= 2);
        seen.extend(page.entries.into_iter().map(|e| e.volume.unwrap().volume_id));
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen.len(), 3, "{seen:?}"); // v1, its clone, and the odd name
    assert!(seen.contains(&v1.volume_id) && seen.contains(&c.volume_id));
    let bad = ctl.list_volumes(csi::ListVolumesRequest { max_entries: 0, starting_token: "zz".into() }).await;
    assert_eq!(bad.unwrap_err().code(), Code::Aborted);

    // ControllerGetVolume, ValidateVolumeCapabilities.
    let g = ctl.controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v1.volume_id.clone() }).await;
    assert_eq!(g.unwrap().into_inner().volume.unwrap().capacity_bytes, 12_288);
    let g = ctl.controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: "node-a/missing".into() }).await;
    assert_eq!(g.unwrap_err().code(), Code::NotFound);
    let vreq = |vol: &str, mode| csi::ValidateVolumeCapabilitiesRequest {
        volume_id: vol.into(),
        volume_capabilities: vec![mount_cap(mode)],
        ..Default::default()
    };
    use csi::volume_capability::access_mode::Mode as M;
    let ok = ctl.validate_volume_capabilities(vreq(&v1.volume_id, M::SingleNodeWriter)).await.unwrap();
    assert!(ok.into_inner().confirmed.is_some());
    let no = ctl.validate_volume_capabilities(vreq(&v1.volume_id, M::MultiNodeMultiWriter)).await.unwrap();
    let no = no.into_inner();
    assert!(no.confirmed.is_none() && !no.message.is_empty());
    let missing = ctl.validate_volume_capabilities(vreq("node-a/missing", M::SingleNodeWriter)).await;
    assert_eq!(missing.unwrap_err().code(), Code::NotFound);

    // Expand (idempotent; never shrinks), GetCapacity per topology.
    let grow = |bytes| csi::ControllerExpandVolumeRequest {
        volume_id: v1.volume_id.clone(),
        capacity_range: Some(csi::CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
        ..Default::default()
    };
    let e = ctl.controller_expand_volume(grow(1 << 21)).await.unwrap().into_inner();
    assert!(e.capacity_bytes == 1 << 21 && e.node_expansion_required);
    let e = ctl.controller_expand_volume(grow(4096)).await.unwrap().into_inner();
    assert_eq!(e.capacity_bytes, 1 << 21);
    let cap = |node: Option<&str>| csi::GetCapacityRequest {
        accessible_topology: node
            .map(|n| csi::Topology { segments: HashMap::from([("topology.ferrite.dev/node".into(), n.into())]) }),
        ..Default::default()
    };
    let ca = ctl.get_capacity(cap(Some("node-a"))).await.unwrap().into_inner().available_capacity;
    let cb = ctl.get_capacity(cap(Some("node-b"))).await.unwrap().into_inner().available_capacity;
    let all = ctl.get_capacity(cap(None)).await.unwrap().into_inner().available_capacity;
    assert!(ca > 0 && cb > 0 && all == ca + cb, "{ca} {cb} {all}");
    assert_eq!(ctl.get_capacity(cap(Some("node-z"))).await.unwrap().into_inner().available_capacity, 0);
    // A node without storage: nothing for local volumes; for a remote-access class what the pool
    // with the most room (where CreateVolume puts the volume) has, so that capacity tracking
    // lets the scheduler pick the node (WaitForFirstConsumer). Never for an unknown node.
    assert_eq!(ctl.get_capacity(cap(Some("node-c"))).await.unwrap().into_inner().available_capacity, 0);
    let remote = |node: &str| {
        let mut r = cap(Some(node));
        r.parameters.insert("remoteAccess".into(), "true".into());
        r
    };
    let rc = ctl.get_capacity(remote("node-c")).await.unwrap().into_inner();
    assert_eq!(rc.available_capacity, ca.max(cb), "{rc:?}");
    assert_eq!(ctl.get_capacity(remote("node-z")).await.unwrap().into_inner().available_capacity, 0);
    let mut r = create("remote-1", 1 << 20, Some("node-c"));
    r.parameters.insert("remoteAccess".into(), "true".into());
    let v = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    let most = if ca >= cb { "node-a/" } else { "node-b/" };
    assert!(v.volume_id.starts_with(most), "a remote volume asked for on node-c goes where the room is: {v:?}");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id, ..Default::default() }).await.unwrap();

    // Snapshots: validation, idempotency, filters, pagination, clone from a snapshot, delete.
    let snap = |name: &str, source: &str| csi::CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: source.into(),
        ..Default::default()
    };
    let scode = |r: Result<tonic::Response<csi::CreateSnapshotResponse>, tonic::Status>| r.unwrap_err().code();
    assert_eq!(scode(ctl.create_snapshot(snap("", &v1.volume_id)).await), Code::InvalidArgument);
    assert_eq!(scode(ctl.create_snapshot(snap("s1", "")).await), Code::InvalidArgument);
    assert_eq!(scode(ctl.create_snapshot(snap("s1", "node-a/missing")).await), Code::NotFound);
    let s1 = ctl.create_snapshot(snap("s1", &v1.volume_id)).await.unwrap().into_inner().snapshot.unwrap();
    assert!(s1.snapshot_id == "node-b/s1" && s1.source_volume_id == v1.volume_id && s1.ready_to_use, "{s1:?}");
    assert_eq!(s1.size_bytes, 1 << 21);
    let again = ctl.create_snapshot(snap("s1", &v1.volume_id)).await.unwrap().into_inner().snapshot.unwrap();
    assert_eq!(again.snapshot_id, s1.snapshot_id);
    assert_eq!(scode(ctl.create_snapshot(snap("s1", &c.volume_id)).await), Code::AlreadyExists);
    ctl.create_snapshot(snap("s2", &c.volume_id)).await.unwrap();
    let list = |max: i32, token: &str, source: &str, id: &str| csi::ListSnapshotsRequest {
        max_entries: max,
        starting_token: token.into(),
        source_volume_id: source.into(),
        snapshot_id: id.into(),
        ..Default::default()
    };
    let ids_of = |r: csi::ListSnapshotsResponse| {
        (r.entries.into_iter().map(|e| e.snapshot.unwrap().snapshot_id).collect::<Vec<_>>(), r.next_token)
    };
    let (all_snaps, _) = ids_of(ctl.list_snapshots(list(0, "", "", "")).await.unwrap().into_inner());
    assert_eq!(all_snaps, vec!["node-b/s1", "node-b/s2"]);
    let (by_src, _) = ids_of(ctl.list_snapshots(list(0, "", &v1.volume_id, "")).await.unwrap().into_inner());
    assert_eq!(by_src, vec!["node-b/s1"]);
    let (by_id, _) = ids_of(ctl.list_snapshots(list(0, "", "", "node-b/s2")).await.unwrap().into_inner());
    assert_eq!(by_id, vec!["node-b/s2"]);
    let (none, _) = ids_of(ctl.list_snapshots(list(0, "", "", "garbage")).await.unwrap().into_inner());
    assert!(none.is_empty());
    let (first, token) = ids_of(ctl.list_snapshots(list(1, "", "", "")).await.unwrap().into_inner());
    let (second, end) = ids_of(ctl.list_snapshots(list(1, &token, "", "")).await.unwrap().into_inner());
    assert_eq!((first.len(), second.len(), end.as_str()), (1, 1, ""));
    assert_ne!(first, second);
    assert_eq!(ctl.list_snapshots(list(0, "x", "", "")).await.unwrap_err().code(), Code::Aborted);
    let get = |id: &str| csi::GetSnapshotRequest { snapshot_id: id.into(), ..Default::default() };
    assert_eq!(ctl.get_snapshot(get("node-b/s1")).await.unwrap().into_inner().snapshot.unwrap().size_bytes, 1 << 21);
    assert_eq!(ctl.get_snapshot(get("node-a/s1")).await.unwrap_err().code(), Code::NotFound);
    let mut r = create("from-s1", 1 << 22, None);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: s1.snapshot_id.clone(),
        })),
    });
    let restored = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    assert!(restored.volume_id.starts_with("node-b/") && restored.capacity_bytes == 1 << 22, "{restored:?}");
    let dels = |id: &str| csi::DeleteSnapshotRequest { snapshot_id: id.into(), ..Default::default() };
    ctl.delete_snapshot(dels("node-b/s2")).await.unwrap();
    ctl.delete_snapshot(dels("node-b/s2")).await.unwrap();
    ctl.delete_snapshot(dels("garbage")).await.unwrap();
    assert_eq!(ctl.delete_snapshot(dels("")).await.unwrap_err().code(), Code::InvalidArgument);

    // Group snapshots: one node's volumes, one point of the log; idempotent; ids checked.
    let mut gc = csi::group_controller_client::GroupControllerClient::new(ctl_channel.clone());
    let gcaps = gc.group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {}).await.unwrap();
    assert_eq!(gcaps.into_inner().capabilities.len(), 1);
    let g1 = ctl.create_volume(create("g1", 1 << 20, Some("node-a"))).await.unwrap().into_inner().volume.unwrap();
    let g2 = ctl.create_volume(create("g2", 1 << 20, Some("node-a"))).await.unwrap().into_inner().volume.unwrap();
    let gsreq = |name: &str, vols: &[&str]| csi::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: vols.iter().map(|v| v.to_string()).collect(),
        ..Default::default()
    };
    let gs = gc.create_volume_group_snapshot(gsreq("gs1", &[&g1.volume_id, &g2.volume_id])).await.unwrap();
    let gs = gs.into_inner().group_snapshot.unwrap();
    assert_eq!(gs.snapshots.len(), 2);
    assert!(gs.snapshots.iter().all(|s| s.group_snapshot_id == gs.group_snapshot_id && s.ready_to_use));
    let again = gc.create_volume_group_snapshot(gsreq("gs1", &[&g2.volume_id, &g1.volume_id])).await.unwrap();
    assert_eq!(again.into_inner().group_snapshot.unwrap().group_snapshot_id, gs.group_snapshot_id);
    let gerr =
        |r: Result<tonic::Response<csi::CreateVolumeGroupSnapshotResponse>, tonic::Status>| r.unwrap_err().code();
    assert_eq!(gerr(gc.create_volume_group_snapshot(gsreq("gs1", &[&g1.volume_id])).await), Code::AlreadyExists);
    let cross = gsreq("gs2", &[&g1.volume_id, &c.volume_id]);
    assert_eq!(gerr(gc.create_volume_group_snapshot(cross).await), Code::FailedPrecondition);
    assert_eq!(gerr(gc.create_volume_group_snapshot(gsreq("gs3", &[])).await), Code::InvalidArgument);
    let member_ids: Vec<String> = gs.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
    let gget = |ids: Vec<String>| csi::GetVolumeGroupSnapshotRequest {
        group_snapshot_id: gs.group_snapshot_id.clone(),
        snapshot_ids: ids,
        ..Default::default()
    };
    assert_eq!(
        gc.get_volume_group_snapshot(gget(member_ids.clone()))
            .await
            .unwrap()
            .into_inner()
            .group_snapshot
            .unwrap()
            .snapshots
            .len(),
        2
    );
    let wrong = gc.get_volume_group_snapshot(gget(vec![member_ids[0].clone()])).await;
    assert_eq!(wrong.unwrap_err().code(), Code::InvalidArgument);
    let gdel = || csi::DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: gs.group_snapshot_id.clone(),
        snapshot_ids: member_ids.clone(),
        ..Default::default()
    };
    gc.delete_volume_group_snapshot(gdel()).await.unwrap();
    gc.delete_volume_group_snapshot(gdel()).await.unwrap();
    assert_eq!(gc.get_volume_group_snapshot(gget(vec![])).await.unwrap_err().code(), Code::NotFound);
    assert!(a.ok(&["group", "list"]).lines().count() <= 1, "the transient group is gone");

    // DeleteVolume: in use is FailedPrecondition, then deleted; unknown ids succeed.
    b.ok(&["export", "nbd", "v1"]);
    let del = |id: &str| csi::DeleteVolumeRequest { volume_id: id.into(), ..Default::default() };
    assert_eq!(ctl.delete_volume(del(&v1.volume_id)).await.unwrap_err().code(), Code::FailedPrecondition);
    b.ok(&["export", "stop", "v1"]);
    ctl.delete_volume(del(&v1.volume_id)).await.unwrap();
    ctl.delete_volume(del(&v1.volume_id)).await.unwrap();
    ctl.delete_volume(del("not-an-id")).await.unwrap();
    ctl.delete_volume(del("node-z/v1")).await.unwrap();
    assert_eq!(ctl.delete_volume(del("")).await.unwrap_err().code(), Code::InvalidArgument);
    assert!(!b.ok(&["volume", "list"]).contains("v1 "));

    // Probe answers from the plugin's own state, ready, even once no daemon answers: the
    // livenessprobe must not restart the controller for a lost node.
    a.stop();
    b.stop();
    assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
}

/// A node whose daemon accepts connections and never answers (powered off behind a listening
/// address, partitioned), sorted first: CreateVolume, ListVolumes, GetCapacity, ListSnapshots
/// and Probe all answer, the listing naming the node it could not read. The times are printed.
#[tokio::test(flavor = "multi_thread")]
async fn a_silent_node_never_stalls_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.4:0").unwrap();
    let da = dir.path().join("a");
    std::fs::create_dir_all(&da).unwrap();
    let a = Daemon::start(&da);
    let nodes =
        [("node-0", format!("tcp://{}", silent.local_addr().unwrap())), ("node-a", a.admin().display().to_string())];
    let _csi = common::csi::start_csi_with(dir.path(), &nodes, &["--mode", "controller"]);
    let ch = channel(&dir.path().join("csi.sock")).await;
    let mut ctl = csi::controller_client::ControllerClient::new(ch.clone());
    let mut id = csi::identity_client::IdentityClient::new(ch);
    let timed = |what: &str, t: std::time::Instant| println!("   {what}: {:?} with node-0 silent", t.elapsed());
    let t = std::time::Instant::now();
    assert_eq!(id.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "Probe took {:?}", t.elapsed());
    timed("Probe", t);
    let t = std::time::Instant::now();
    let v = ctl.create_volume(create("v", 1 << 20, None)).await.unwrap().into_inner().volume.unwrap();
    assert!(v.volume_id.starts_with("node-a/"), "{v:?}");
    timed("CreateVolume", t);
    let t = std::time::Instant::now();
    let listed = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap();
    assert_eq!(listed.metadata().get("ferrite-unread-nodes").unwrap(), "node-0");
    let ids: Vec<_> = listed.get_ref().entries.iter().map(|e| e.volume.as_ref().unwrap().volume_id.clone()).collect();
    assert_eq!(ids, std::slice::from_ref(&v.volume_id));
    timed("ListVolumes", t);
    let t = std::time::Instant::now();
    let cap = ctl.get_capacity(csi::GetCapacityRequest::default()).await.unwrap().into_inner();
    assert!(cap.available_capacity > 0, "{cap:?}");
    timed("GetCapacity", t);
    let t = std::time::Instant::now();
    ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await.unwrap();
    timed("ListSnapshots", t);
    drop(silent);
}

/// A second operation on a volume while the first is still running is Aborted. The first one
/// here hangs on purpose: its node's "daemon" accepts connections and never answers.
#[tokio::test(flavor = "multi_thread")]
async fn an_operation_in_flight_aborts_a_second_one_on_the_same_volume() {
    let dir = tempfile::tempdir().unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.4:0").unwrap();
    let endpoint = format!("tcp://{}", silent.local_addr().unwrap());
    let _csi = common::csi::start_csi_with(dir.path(), &[("node-slow", endpoint)], &["--mode", "controller"]);
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    let first = {
        let mut ctl = ctl.clone();
        tokio::spawn(async move { ctl.create_volume(create("v", 1 << 20, Some("node-slow"))).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(!first.is_finished(), "the first call is stuck on the silent node");
    assert_eq!(code(ctl.create_volume(create("v", 1 << 20, Some("node-slow"))).await), Code::Aborted);
    // Other volumes are not held up by it: this one (its node unknown, so its copies are looked
    // for everywhere) gets its own answer, the silent node's (Unavailable: it may hold a copy).
    let other = ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: "node-x/w".into(), ..Default::default() });
    assert_eq!(code(other.await), Code::Unavailable);
    drop(silent);
    let r = tokio::time::timeout(std::time::Duration::from_secs(30), first).await.expect("the first call ends");
    assert!(r.unwrap().is_err());
    // Once it has ended, the name is free again (and fails for its own reason).
    assert_ne!(code(ctl.create_volume(create("v", 1 << 20, Some("node-slow"))).await), Code::Aborted);
}

/// Per-volume limits as mutable parameters: set at CreateVolume, changed by
/// ControllerModifyVolume (idempotent; unknown keys and bad values refused naming the key),
/// reported by ControllerGetVolume, and in force on the daemon.
#[tokio::test(flavor = "multi_thread")]
async fn modify_volume_sets_limits_online() {
    let dir = tempfile::tempdir().unwrap();
    let da = dir.path().join("a");
    std::fs::create_dir_all(&da).unwrap();
    let d = Daemon::start(&da);
    let _csi = start_csi(dir.path(), &[("node-a", &d)], &["--mode", "controller"]);
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    let caps = ctl.controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {}).await.unwrap().into_inner();
    let modify = csi::controller_service_capability::rpc::Type::ModifyVolume as i32;
    assert!(caps.capabilities.iter().any(|c| matches!(&c.r#type,
        Some(csi::controller_service_capability::Type::Rpc(r)) if r.r#type == modify)));
    let params = |kv: &[(&str, &str)]| -> HashMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    };
    let mut req = create("db", 1 << 20, Some("node-a"));
    req.mutable_parameters = params(&[("writeIops", "300"), ("bandwidth", "200M")]);
    let id = ctl.create_volume(req).await.unwrap().into_inner().volume.unwrap().volume_id;
    let shown = d.json(&["volume", "show", "db"]);
    assert_eq!((shown["limits"]["write_iops"].as_u64(), shown["limits"]["bps"].as_u64()), (Some(300), Some(200 << 20)));

    let modify = |id: &str, kv: HashMap<String, String>| csi::ControllerModifyVolumeRequest {
        volume_id: id.into(),
        mutable_parameters: kv,
        ..Default::default()
    };
    for _ in 0..2 {
        ctl.controller_modify_volume(modify(&id, params(&[("iops", "5000"), ("burst", "2s")]))).await.unwrap();
    }
    let shown = d.json(&["volume", "show", "db"]);
    assert_eq!(shown["limits"]["iops"], 5000);
    assert_eq!(shown["limits"]["write_iops"], 0, "a class replaces the limits as a whole");
    assert_eq!(shown["limits"]["burst_ms"], 2000);
    let got = ctl.controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id.clone() }).await.unwrap();
    let ctx = got.into_inner().volume.unwrap().volume_context;
    assert_eq!(ctx, params(&[("iops", "5000"), ("burst", "2000ms")]));

    for (kv, key) in [(params(&[("maxIops", "1")]), "maxIops"), (params(&[("iops", "fast")]), "iops")] {
        let e = ctl.controller_modify_volume(modify(&id, kv)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(key), "{}", e.message());
    }
    assert_eq!(d.json(&["volume", "show", "db"])["limits"]["iops"], 5000, "a refused change changes nothing");
    let e = ctl.controller_modify_volume(modify("node-a/missing", params(&[("iops", "1")]))).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(code(ctl.controller_modify_volume(modify("", HashMap::new())).await), Code::InvalidArgument);
    let mut bad = create("bad", 1 << 20, Some("node-a"));
    bad.mutable_parameters = params(&[("readBandwidth", "lots")]);
    assert_eq!(code(ctl.create_volume(bad).await), Code::InvalidArgument);
    ctl.controller_modify_volume(modify(&id, HashMap::new())).await.unwrap();
    assert!(d.ok(&["volume", "show", "db"]).contains("none"));
    // A retry of a CreateVolume that made the volume but not its limits completes it.
    d.ok(&["volume", "create", "half", "1M"]);
    let mut again = create("half", 1 << 20, Some("node-a"));
    again.mutable_parameters = params(&[("iops", "77")]);
    ctl.create_volume(again).await.unwrap();
    assert_eq!(d.json(&["volume", "show", "half"])["limits"]["iops"], 77);
}

/// ControllerPublishVolume / ControllerUnpublishVolume over the real socket: required fields,
/// unknown volume or node, idempotent repeats, an incompatible repeat, a second node, a node
/// past its attach limit, and the record the daemon keeps (an export allowed to the node).
#[tokio::test(flavor = "multi_thread")]
async fn publish_and_unpublish_follow_the_spec() {
    use csi::volume_capability::access_mode::Mode as M;
    let dir = tempfile::tempdir().unwrap();
    let (a, a_admin, _) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (b, b_admin, _) = tcp_node(&dir.path().join("b"), "127.0.0.3");
    // node-c holds no storage: remote-access volumes are scheduled there and reached remotely.
    let nodes =
        [("node-a", format!("tcp://{a_admin}")), ("node-b", format!("tcp://{b_admin}")), ("node-c", String::new())];
    let _csi = start_csi_with(dir.path(), &nodes, &["--mode", "controller", "--max-volumes", "2"]);
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    let caps = ctl.controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {}).await.unwrap().into_inner();
    let has = |t: csi::controller_service_capability::rpc::Type| {
        caps.capabilities.iter().any(
            |c| matches!(&c.r#type, Some(csi::controller_service_capability::Type::Rpc(r)) if r.r#type == t as i32),
        )
    };
    use csi::controller_service_capability::rpc::Type as T;
    assert!(has(T::PublishUnpublishVolume) && has(T::PublishReadonly));

    let v = ctl.create_volume(create("p1", 1 << 20, Some("node-a"))).await.unwrap().into_inner().volume.unwrap();
    let publish = |vol: &str, node: &str, readonly: bool| csi::ControllerPublishVolumeRequest {
        volume_id: vol.into(),
        node_id: node.into(),
        volume_capability: Some(mount_cap(M::SingleNodeWriter)),
        readonly,
        ..Default::default()
    };
    // Required fields, and what does not exist.
    assert_eq!(code(ctl.controller_publish_volume(publish("", "node-a", false)).await), Code::InvalidArgument);
    assert_eq!(code(ctl.controller_publish_volume(publish(&v.volume_id, "", false)).await), Code::InvalidArgument);
    let mut r = publish(&v.volume_id, "node-a", false);
    r.volume_capability = None;
    assert_eq!(code(ctl.controller_publish_volume(r).await), Code::InvalidArgument);
    let mut r = publish(&v.volume_id, "node-a", false);
    r.volume_capability = Some(mount_cap(M::MultiNodeMultiWriter));
    assert_eq!(code(ctl.controller_publish_volume(r).await), Code::InvalidArgument);
    assert_eq!(code(ctl.controller_publish_volume(publish("node-a/nope", "node-a", false)).await), Code::NotFound);
    assert_eq!(code(ctl.controller_publish_volume(publish(&v.volume_id, "node-z", false)).await), Code::NotFound);

    // On its own node: a local publication, recorded on the daemon; a repeat is the same.
    let ctx = ctl.controller_publish_volume(publish(&v.volume_id, "node-a", false)).await.unwrap().into_inner();
    assert_eq!(ctx.publish_context["primary"], "node-a");
    let again = ctl.controller_publish_volume(publish(&v.volume_id, "node-a", false)).await.unwrap().into_inner();
    assert_eq!(again.publish_context, ctx.publish_context);
    let exports = a.json(&["export", "list"]);
    let e = exports.as_array().unwrap().iter().find(|e| e["name"] == "csi-publish-p1").cloned().unwrap();
    assert_eq!(e["allow"], serde_json::json!(["local"]), "{e}");
    // Incompatible repeat, and a second node while published.
    assert_eq!(code(ctl.controller_publish_volume(publish(&v.volume_id, "node-a", true)).await), Code::AlreadyExists);
    assert_eq!(
        code(ctl.controller_publish_volume(publish(&v.volume_id, "node-b", false)).await),
        Code::FailedPrecondition
    );
    // A published volume is not deleted.
    let del = ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() });
    assert_eq!(code(del.await), Code::FailedPrecondition);

    // Unpublish: required fields; from a node it is not published to, nothing; then for real,
    // and again (idempotent).
    let unpublish = |vol: &str, node: &str| csi::ControllerUnpublishVolumeRequest {
        volume_id: vol.into(),
        node_id: node.into(),
        ..Default::default()
    };
    assert_eq!(code(ctl.controller_unpublish_volume(unpublish("", "node-a")).await), Code::InvalidArgument);
    assert_eq!(code(ctl.controller_unpublish_volume(unpublish(&v.volume_id, "")).await), Code::InvalidArgument);
    ctl.controller_unpublish_volume(unpublish(&v.volume_id, "node-b")).await.unwrap();
    assert!(a.ok(&["export", "list"]).contains("csi-publish-p1"));
    for _ in 0..2 {
        ctl.controller_unpublish_volume(unpublish(&v.volume_id, "node-a")).await.unwrap();
    }
    assert!(!a.ok(&["export", "list"]).contains("csi-publish-p1"));
    for gone in ["node-a/nope", "node-z/p1", "garbage"] {
        ctl.controller_unpublish_volume(unpublish(gone, "node-a")).await.unwrap();
    }

    // A node holding no copy gets only a remote-access volume: the context CreateVolume wrote
    // says which (outside Kubernetes, a context without it is not), whatever the node's labels.
    assert_eq!(v.volume_context["remoteAccess"], "false");
    for context in [v.volume_context.clone(), HashMap::new()] {
        let r =
            csi::ControllerPublishVolumeRequest { volume_context: context, ..publish(&v.volume_id, "node-b", true) };
        let e = ctl.controller_publish_volume(r).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("node-b holds none"), "{}", e.message());
    }
    assert!(!a.ok(&["export", "list"]).contains("csi-publish-p1"), "a refused publication leaves no export");
    let mut remote = create("r1", 1 << 20, Some("node-a"));
    remote.parameters = HashMap::from([("remoteAccess".to_owned(), "true".to_owned())]);
    let v = ctl.create_volume(remote).await.unwrap().into_inner().volume.unwrap();
    assert_eq!((v.volume_context["remoteAccess"].as_str(), v.accessible_topology.len()), ("true", 0));
    let remote = |vol: &csi::Volume, node: &str, readonly: bool| csi::ControllerPublishVolumeRequest {
        volume_context: vol.volume_context.clone(),
        ..publish(&vol.volume_id, node, readonly)
    };

    // Over the network: allowed to the node's identity, read-only when asked.
    let ctx = ctl.controller_publish_volume(remote(&v, "node-b", true)).await.unwrap().into_inner();
    assert_eq!(ctx.publish_context["primary"], "node-a");
    assert!(!ctx.publish_context["nbd"].is_empty(), "{:?}", ctx.publish_context);
    let e = a.json(&["export", "list"]);
    let e = e.as_array().unwrap().iter().find(|e| e["name"] == "csi-publish-r1").cloned().unwrap();
    assert_eq!((e["allow"].clone(), e["read_only"].clone()), (serde_json::json!(["node-b"]), true.into()), "{e}");
    // One node at a time: node-a, which holds it, is refused while node-b has it.
    let e = ctl.controller_publish_volume(remote(&v, "node-a", true)).await.unwrap_err();
    assert!(e.code() == Code::FailedPrecondition && e.message().contains("one node at a time"), "{e:?}");
    // Only node-b's certificate opens it: node-a's daemon relaying for itself is refused before
    // any device is made, and keeps no attachment.
    let (nbd, export) = (&ctx.publish_context["nbd"], &ctx.publish_context["export"]);
    let o = a.cli(&["attach", "r1", "--remote", nbd, "--export", export]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("refused"), "{err}");
    assert!(a.json(&["attachments"]).as_array().unwrap().is_empty());
    ctl.controller_unpublish_volume(unpublish(&v.volume_id, "node-b")).await.unwrap();

    // The attach limit (2 here) counts every daemon's publications to the node.
    let mut vols = Vec::new();
    for (i, on) in ["node-a", "node-b", "node-a"].iter().enumerate() {
        let mut r = create(&format!("q{i}"), 1 << 20, Some(on));
        r.parameters = HashMap::from([("remoteAccess".to_owned(), "true".to_owned())]);
        vols.push(ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap());
    }
    let ids: Vec<String> = vols.iter().map(|v| v.volume_id.clone()).collect();
    ctl.controller_publish_volume(remote(&vols[0], "node-b", false)).await.unwrap();
    ctl.controller_publish_volume(remote(&vols[1], "node-b", false)).await.unwrap();
    assert_eq!(code(ctl.controller_publish_volume(remote(&vols[2], "node-b", false)).await), Code::ResourceExhausted);
    ctl.controller_unpublish_volume(unpublish(&ids[0], "node-b")).await.unwrap();
    ctl.controller_publish_volume(remote(&vols[2], "node-b", false)).await.unwrap();

    // What the daemon takes from the controller: one node's identity or local, nothing wider.
    let mut admin = ferrite_proto::ferrite::v1::admin_client::AdminClient::new(
        common::csi::tls_channel(&a_admin.to_string(), &dir.path().join("pki"), "csi").await,
    );
    let req = |volume: &str, node: &str, local: bool| ferrite_proto::ferrite::v1::PublishVolumeRequest {
        volume: volume.into(),
        node: node.into(),
        local,
        read_only: false,
    };
    for (r, want) in [
        (req("q2", "10.0.0.0/8", false), Code::InvalidArgument),
        (req("q2", "", false), Code::InvalidArgument),
        (req("q2", "node-b", true), Code::InvalidArgument),
        (req("q2@s", "node-b", false), Code::InvalidArgument),
        (req("nope", "node-b", false), Code::NotFound),
    ] {
        assert_eq!(code(admin.publish_volume(r).await), want);
    }
    drop(b);
}
