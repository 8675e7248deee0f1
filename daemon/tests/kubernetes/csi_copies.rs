//! Replicated volumes through the CSI controller (a StorageClass's `replicas`), over the real
//! gRPC socket of `ferrite csi --mode controller` and three daemons on three loopback addresses
//! standing for three nodes: copies placed on distinct nodes, the volume's own operations
//! (expansion, limits, snapshots, clones, listing) on every copy or on the primary, a volume id
//! that follows its primary after a promotion, and deletion of every copy. An encrypted one keeps
//! its copies locked until a publish hands them the key, and is served where it is published.

use crate::common;

use common::csi::{channel, create, start_csi_with, tcp_node, tcp_node_with};
use common::nbd::{connect, read_image, write_on};
use common::{Daemon, pattern};
use ferrite_proto::csi::v1 as csi;
use serde_json::Value;

const MIB: i64 = 1 << 20;

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;

fn replicated(name: &str, bytes: i64, node: &str, copies: &str) -> csi::CreateVolumeRequest {
    let mut r = create(name, bytes, Some(node));
    r.parameters.insert("replicas".into(), copies.into());
    r
}

fn sync(d: &Daemon, volume: &str) -> Value {
    d.json(&["replica", "status", volume])
}

fn names(d: &Daemon) -> Vec<String> {
    d.json(&["volume", "list"]).as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_owned()).collect()
}

/// A CSI snapshot `name` of the volume with id `source`.
async fn snapshot(ctl: &mut Controller, source: &str, name: &str) -> csi::Snapshot {
    let r = csi::CreateSnapshotRequest { source_volume_id: source.to_owned(), name: name.into(), ..Default::default() };
    ctl.create_snapshot(r).await.unwrap().into_inner().snapshot.unwrap()
}

/// Waits until every member of `volume` on its primary `d` is in sync.
fn in_sync(d: &Daemon, volume: &str, members: usize) {
    let start = std::time::Instant::now();
    loop {
        let s = sync(d, volume);
        let m = s["members"].as_array().map_or(0, |m| m.iter().filter(|m| m["state"] != "ejected").count());
        if s["members"].as_array().is_some_and(|all| all.len() == members) && m == members {
            let rebuilding = s["members"].as_array().unwrap().iter().any(|m| m["state"] == "rebuilding");
            if !rebuilding {
                return;
            }
        }
        assert!(start.elapsed().as_secs() < 60, "{volume} did not get {members} members in sync: {s}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn replicated_volumes_through_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    let (a, a_admin, _) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (b, b_admin, _) = tcp_node(&dir.path().join("b"), "127.0.0.3");
    let (c, c_admin, _) = tcp_node(&dir.path().join("c"), "127.0.0.4");
    let d = [&a, &b, &c];
    let nodes = [
        ("node-a", format!("tcp://{a_admin}")),
        ("node-b", format!("tcp://{b_admin}")),
        ("node-c", format!("tcp://{c_admin}")),
    ];
    let _csi = start_csi_with(dir.path(), &nodes, &["--mode", "controller"]);
    let ch = channel(&dir.path().join("csi.sock")).await;
    let mut ctl = csi::controller_client::ControllerClient::new(ch);

    println!("== three copies, the primary on the node the topology prefers");
    let v = ctl.create_volume(replicated("r1", 16 * MIB, "node-b", "3")).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(v.volume_id, "_/r1", "a replicated volume's id names no node");
    let copies = &v.volume_context["copies"];
    assert_eq!(copies.split(',').count(), 3, "{copies}");
    assert!(copies.starts_with("node-b,"), "{copies}");
    // Accessible where each copy is: publishing to one moves the primary there.
    let mut at: Vec<&str> =
        v.accessible_topology.iter().map(|t| t.segments["topology.ferrite.dev/node"].as_str()).collect();
    at.sort_unstable();
    assert_eq!(at, ["node-a", "node-b", "node-c"]);
    for n in d {
        assert!(names(n).contains(&"r1".to_owned()));
    }
    assert_eq!(sync(&b, "r1")["role"], "primary");
    in_sync(&b, "r1", 3);
    // A retry finds the same volume and copies.
    let again =
        ctl.create_volume(replicated("r1", 16 * MIB, "node-b", "3")).await.unwrap().into_inner().volume.unwrap();
    assert_eq!((again.volume_id, &again.volume_context["copies"]), (v.volume_id.clone(), copies));
    // Listed once, where its primary is.
    let listed = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner().entries;
    let ids: Vec<String> = listed.iter().map(|e| e.volume.as_ref().unwrap().volume_id.clone()).collect();
    assert_eq!(ids, ["_/r1"]);

    println!("== capacity for a class of three copies: the room of its third-roomiest node");
    let capacity = |copies: &str, node: Option<&str>| {
        let mut ctl = ctl.clone();
        let r = csi::GetCapacityRequest {
            parameters: [("replicas".to_owned(), copies.to_owned())].into(),
            accessible_topology: node
                .map(|n| csi::Topology { segments: [("topology.ferrite.dev/node".to_owned(), n.to_owned())].into() }),
            ..Default::default()
        };
        async move { ctl.get_capacity(r).await.unwrap().into_inner().available_capacity }
    };
    let free: Vec<i64> = d.iter().map(|n| n.json(&["pool", "status"])["free"].as_i64().unwrap()).collect();
    let three = capacity("3", None).await;
    assert!(three > 0 && free.iter().all(|f| three <= *f), "{three} vs {free:?}");
    let one: i64 = capacity("1", None).await;
    assert!(one >= free.iter().sum::<i64>() - 3 * MIB && one <= free.iter().sum(), "{one} vs {free:?}");
    assert!(capacity("1", Some("node-a")).await <= free[0]);
    assert_eq!(capacity("3", Some("node-x")).await, 0, "an unknown node has no room");

    println!("== writes reach every copy; expansion and limits apply to all of them");
    b.ok(&["export", "nbd", "r1"]);
    let mut s = connect(&b.nbd(), "r1");
    let data = pattern(7, 1 << 20);
    assert_eq!(write_on(&mut s, 0, &data), 0);
    drop(s);
    b.ok(&["export", "stop", "r1"]);
    let range = csi::CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 };
    let grown = ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            capacity_range: Some(range),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 32 * MIB);
    for n in d {
        assert_eq!(n.json(&["volume", "show", "r1"])["size"], 32 * MIB);
    }
    let params = [("iops".to_owned(), "800".to_owned())].into();
    ctl.controller_modify_volume(csi::ControllerModifyVolumeRequest {
        volume_id: v.volume_id.clone(),
        mutable_parameters: params,
        ..Default::default()
    })
    .await
    .unwrap();
    for n in d {
        assert_eq!(n.json(&["volume", "show", "r1"])["limits"]["iops"], 800, "every copy keeps the limits");
    }
    let image = read_image(&b, "r1", 32 << 20);
    assert!(image[..data.len()] == data[..]);
    for n in [&a, &c] {
        assert!(read_image(n, "r1", 32 << 20) == image, "a copy differs from the primary");
    }

    println!("== a snapshot on every copy; a clone of it gets copies of its own");
    let snap = snapshot(&mut ctl, &v.volume_id, "s1").await;
    assert_eq!(snap.snapshot_id, "_/s1");
    let mut r = replicated("r2", 32 * MIB, "node-b", "2");
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: snap.snapshot_id.clone(),
        })),
    });
    let clone = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(clone.volume_id, "_/r2");
    assert_eq!(clone.volume_context["copies"].split(',').count(), 2);
    // Two copies and a witness on the third node: either copy's node may be away.
    in_sync(&b, "r2", 3);
    let witness = sync(&b, "r2")["members"].as_array().unwrap().iter().filter(|m| m["state"] == "witness").count();
    assert_eq!(witness, 1, "{}", sync(&b, "r2"));
    let other = clone.volume_context["copies"].split(',').nth(1).unwrap().to_owned();
    let holder = d[usize::from(other.as_bytes()[5] - b'a')];
    assert!(read_image(holder, "r2", 1 << 20) == data, "the clone's copy on {other} holds the snapshot's data");

    println!("== after a promotion the same id reaches the new primary");
    a.ok(&["replica", "promote", "r1"]);
    assert_eq!(sync(&a, "r1")["role"], "primary");
    let got = ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 32 * MIB);
    let range = csi::CapacityRange { required_bytes: 48 * MIB, limit_bytes: 0 };
    ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        capacity_range: Some(range),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(a.json(&["volume", "show", "r1"])["size"], 48 * MIB, "grown through the new primary");

    println!("== publishing to a node with an in-sync copy moves the primary there");
    in_sync(&a, "r1", 3);
    let publish = csi::ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: "node-c".into(),
        volume_capability: Some(common::csi::mount_cap(csi::volume_capability::access_mode::Mode::SingleNodeWriter)),
        ..Default::default()
    };
    let ctx = ctl.controller_publish_volume(publish).await.unwrap().into_inner().publish_context;
    assert_eq!(ctx["primary"], "node-c");
    assert_eq!(sync(&c, "r1")["role"], "primary");
    let unpublish = csi::ControllerUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: "node-c".into(),
        ..Default::default()
    };
    ctl.controller_unpublish_volume(unpublish).await.unwrap();

    println!("== remoteAccess: accessible from every node; a node without a copy is served through its relay");
    let mut r = replicated("r3", 16 * MIB, "node-a", "2");
    r.parameters.insert("remoteAccess".into(), "true".into());
    let r3 = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    assert!(r3.accessible_topology.is_empty(), "{:?}", r3.accessible_topology);
    let members = sync(&a, "r3")["members"].clone();
    let witness = members.as_array().unwrap().iter().find(|m| m["state"] == "witness").unwrap();
    let no_copy = nodes.iter().find(|(_, e)| witness["endpoint"] == *e).unwrap().0;
    let publish = |node: &str| csi::ControllerPublishVolumeRequest {
        volume_id: r3.volume_id.clone(),
        node_id: node.into(),
        volume_capability: Some(common::csi::mount_cap(csi::volume_capability::access_mode::Mode::SingleNodeWriter)),
        volume_context: r3.volume_context.clone(),
        ..Default::default()
    };
    let ctx = ctl.controller_publish_volume(publish(no_copy)).await.unwrap().into_inner().publish_context;
    assert_eq!(ctx["primary"], "node-a", "{ctx:?}");
    assert!(!ctx["nbd"].is_empty() && !ctx["export"].is_empty(), "a remote publication: {ctx:?}");
    // The other copy holds a standby publication to the node, and the context names its NBD
    // listener: a failover finds the node allowed there, and its relay follows.
    let (copy_node, _) = nodes.iter().find(|(n, _)| *n != "node-a" && *n != no_copy).unwrap();
    let copy = d[usize::from(copy_node.as_bytes()[5] - b'a')];
    let standby = |d: &Daemon| {
        let exports = d.json(&["export", "list"]);
        exports.as_array().unwrap().iter().find(|e| e["volume"] == "r3").cloned()
    };
    let e = standby(copy).unwrap_or_else(|| panic!("no standby publication on {copy_node}"));
    assert_eq!((e["allow"][0].as_str(), e["name"].as_str()), (Some(no_copy), Some(ctx["export"].as_str())), "{e}");
    assert_eq!(ctx["copies"], e["tcp_address"].as_str().unwrap(), "{ctx:?}");
    assert_ne!(ctx["copies"], ctx["nbd"]);
    let again = ctl.controller_publish_volume(publish(no_copy)).await.unwrap().into_inner().publish_context;
    assert_eq!(again, ctx, "publishing again is the same publication");
    let unpublish = |node: &str| csi::ControllerUnpublishVolumeRequest {
        volume_id: r3.volume_id.clone(),
        node_id: node.into(),
        ..Default::default()
    };
    ctl.controller_unpublish_volume(unpublish(no_copy)).await.unwrap();
    assert!(standby(copy).is_none() && standby(&a).is_none(), "unpublishing ends the standby publication too");
    let mut bad = replicated("r4", 16 * MIB, "node-a", "2");
    bad.parameters.insert("remoteAccess".into(), "yes".into());
    let e = ctl.create_volume(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: r3.volume_id.clone(), ..Default::default() })
        .await
        .unwrap();

    println!("== without remoteAccess, a node holding no copy (the witness's) is refused");
    let r5 = ctl.create_volume(replicated("r5", 16 * MIB, "node-a", "2")).await.unwrap().into_inner().volume.unwrap();
    let members = sync(&a, "r5")["members"].clone();
    let witness = members.as_array().unwrap().iter().find(|m| m["state"] == "witness").unwrap();
    let no_copy = nodes.iter().find(|(_, e)| witness["endpoint"] == *e).unwrap().0;
    let req = csi::ControllerPublishVolumeRequest {
        volume_id: r5.volume_id.clone(),
        node_id: no_copy.into(),
        volume_capability: Some(common::csi::mount_cap(csi::volume_capability::access_mode::Mode::SingleNodeWriter)),
        volume_context: r5.volume_context.clone(),
        ..Default::default()
    };
    let e = ctl.controller_publish_volume(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(e.message().contains(&format!("node {no_copy} holds none")), "{e}");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: r5.volume_id, ..Default::default() }).await.unwrap();

    println!("== deletion removes every copy");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: clone.volume_id, ..Default::default() }).await.unwrap();
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id, ..Default::default() })
        .await
        .unwrap();
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await.unwrap();
    for n in d {
        assert!(names(n).is_empty(), "{:?} left: {:?}", n.dir, names(n));
    }
    // Deleting again: nothing left, still success.
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id, ..Default::default() }).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_encrypted_replicated_volume_is_served_where_it_is_published() {
    let dir = tempfile::tempdir().unwrap();
    let (a, a_admin, _) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (b, b_admin, _) = tcp_node(&dir.path().join("b"), "127.0.0.3");
    let (c, c_admin, _) = tcp_node(&dir.path().join("c"), "127.0.0.4");
    let nodes = [
        ("node-a", format!("tcp://{a_admin}")),
        ("node-b", format!("tcp://{b_admin}")),
        ("node-c", format!("tcp://{c_admin}")),
    ];
    let _csi = start_csi_with(dir.path(), &nodes, &["--mode", "controller"]);
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    let secrets: std::collections::HashMap<String, String> =
        [("encryptionKey".into(), "c3".repeat(32)), ("encryptionKeyID".into(), "team-c".into())].into();

    let mut r = replicated("e1", 16 * MIB, "node-a", "2");
    r.parameters.insert("encrypted".into(), "true".into());
    r.secrets = secrets.clone();
    let v = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    // The copy on node-b or node-c, the witness on the other.
    let other = v.volume_context["copies"].strip_prefix("node-a,").unwrap().to_owned();
    let holder = if other == "node-b" { &b } else { &c };
    in_sync(&a, "e1", 3);
    a.ok(&["export", "nbd", "e1"]);
    let data = pattern(11, 1 << 20);
    assert_eq!(write_on(&mut connect(&a.nbd(), "e1"), 4096, &data), 0);
    a.ok(&["export", "stop", "e1"]);
    // The copy holds ciphertext and no key.
    assert_eq!(holder.json(&["volume", "show", "e1"])["encryption"]["unlocked"], false);

    // Published to the copy's node: its copy becomes the primary (locality) and opens with the key the
    // publish carries; without the key the publish is refused.
    let publish = |secrets| csi::ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: other.clone(),
        volume_capability: Some(common::csi::mount_cap(csi::volume_capability::access_mode::Mode::SingleNodeWriter)),
        secrets,
        ..Default::default()
    };
    let refused = ctl.controller_publish_volume(publish(Default::default())).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    let ctx = ctl.controller_publish_volume(publish(secrets)).await.unwrap().into_inner().publish_context;
    assert_eq!(ctx["primary"], other);
    assert_eq!(holder.json(&["volume", "show", "e1"])["encryption"]["unlocked"], true);
    assert!(read_image(holder, "e1", 16 << 20)[4096..4096 + data.len()] == data[..]);
}

/// The node a replicated volume was made on leaves the directory (its Node deleted): the
/// volume's old `<node>/<name>` id and its node-free id still reach the surviving copies once
/// one of them is promoted; deletion removes every copy that is left. A copy whose node does
/// not answer keeps a deletion from changing anything until it answers.
#[tokio::test(flavor = "multi_thread")]
async fn a_replicated_volume_outlives_the_node_it_was_made_on() {
    let dir = tempfile::tempdir().unwrap();
    let (a, a_admin, _) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (mut b, b_admin, _) = tcp_node(&dir.path().join("b"), "127.0.0.3");
    let (mut c, c_admin, _) = tcp_node(&dir.path().join("c"), "127.0.0.4");
    let (ea, eb, ec) = (format!("tcp://{a_admin}"), format!("tcp://{b_admin}"), format!("tcp://{c_admin}"));
    let all = [("node-a", ea.clone()), ("node-b", eb), ("node-c", ec.clone())];
    let csi_dir = dir.path();
    let mut csi_proc = Some(start_csi_with(csi_dir, &all, &["--mode", "controller"]));
    let sock = csi_dir.join("csi.sock");
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&sock).await);

    let v = ctl.create_volume(replicated("r1", 16 * MIB, "node-b", "3")).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(v.volume_id, "_/r1");
    in_sync(&b, "r1", 3);
    b.ok(&["export", "nbd", "r1"]);
    let data = pattern(5, 1 << 20);
    assert_eq!(write_on(&mut connect(&b.nbd(), "r1"), 0, &data), 0);
    b.ok(&["export", "stop", "r1"]);
    in_sync(&b, "r1", 3);
    let got = ctl.controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() }).await;
    let condition = got.unwrap().into_inner().status.unwrap().volume_condition.unwrap();
    assert!(!condition.abnormal && condition.message.contains("every copy in sync"), "{condition:?}");
    // Taken on node-b, the primary, and at the same point on every copy.
    let s0 = snapshot(&mut ctl, &v.volume_id, "s0").await;
    assert_eq!(s0.snapshot_id, "_/s0", "a replicated volume's snapshot names no node");
    for n in [&a, &b, &c] {
        assert_eq!(n.json(&["snapshot", "show", "s0"])["volume"], "r1", "{:?} holds no copy of s0", n.dir);
    }
    let e = a.cli(&["snapshot", "create", "r1", "on-a-copy"]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("snapshot it on its primary"), "{e:?}");

    println!("== node-b's Node is deleted: its daemon gone, the directory without it");
    b.crash();
    drop(csi_proc.take());
    let rest = [("node-a", ea.clone()), ("node-c", ec.clone())];
    csi_proc = Some(start_csi_with(csi_dir, &rest, &["--mode", "controller"]));
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&sock).await);
    let old_id = "node-b/r1".to_owned();
    let get = |id: &str| csi::ControllerGetVolumeRequest { volume_id: id.to_owned() };
    // No copy serves as primary yet: not "does not exist", but unavailable, naming the copies.
    let e = ctl.controller_get_volume(get(&old_id)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(e.message().contains("node-a") && e.message().contains("node-c"), "{e}");
    // Failover's part (the Kubernetes tier runs the real one): a's copy is promoted with c's vote.
    a.ok(&["replica", "promote", "r1"]);
    for id in [&old_id, &v.volume_id] {
        let got = ctl.controller_get_volume(get(id)).await.unwrap().into_inner().volume.unwrap();
        assert_eq!((got.volume_id.as_str(), got.capacity_bytes), (id.as_str(), 16 * MIB));
    }
    // node-b's copy is gone: the volume is abnormal (CSI VolumeCondition), and says which copy.
    let status = ctl.controller_get_volume(get(&v.volume_id)).await.unwrap().into_inner().status.unwrap();
    let condition = status.volume_condition.unwrap();
    println!("   {condition:?}; {}", a.json(&["replica", "status", "r1"]));
    assert!(condition.abnormal && condition.message.contains(&b_admin.to_string()), "{condition:?}");
    let range = csi::CapacityRange { required_bytes: 24 * MIB, limit_bytes: 0 };
    ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
        volume_id: old_id.clone(),
        capacity_range: Some(range),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(a.json(&["volume", "show", "r1"])["size"], 24 * MIB);
    ctl.controller_modify_volume(csi::ControllerModifyVolumeRequest {
        volume_id: old_id.clone(),
        mutable_parameters: [("iops".to_owned(), "500".to_owned())].into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(a.json(&["volume", "show", "r1"])["limits"]["iops"], 500);
    let snap = snapshot(&mut ctl, &old_id, "s1").await;
    assert_eq!((snap.snapshot_id.as_str(), snap.source_volume_id.as_str()), ("_/s1", old_id.as_str()));

    println!("== the snapshot taken before the primary's node went: listed once, restorable, its delta answers");
    let list = ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await.unwrap().into_inner().entries;
    let ids: Vec<String> = list.iter().map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone()).collect();
    assert_eq!(ids, ["_/s0", "_/s1"], "each snapshot once");
    let mut from = create("from-s0", 16 * MIB, Some("node-c"));
    from.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: s0.snapshot_id.clone(),
        })),
    });
    let restored = ctl.create_volume(from).await.unwrap().into_inner().volume.unwrap();
    let (at, name) = restored.volume_id.split_once('/').unwrap();
    let holder = if at == "node-a" { &a } else { &c };
    assert!(read_image(holder, name, 1 << 20) == data, "the restored volume holds what s0 saw");
    let mut md = ferrite_proto::csi::v1::snapshot_metadata_client::SnapshotMetadataClient::new(channel(&sock).await);
    let req = csi::GetMetadataDeltaRequest {
        base_snapshot_id: s0.snapshot_id.clone(),
        target_snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    };
    let mut stream = md.get_metadata_delta(req).await.unwrap().into_inner();
    let mut changed = 0;
    while let Some(m) = stream.message().await.unwrap() {
        changed += m.block_metadata.len();
    }
    assert_eq!(changed, 0, "nothing was written between s0 and s1");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: restored.volume_id, ..Default::default() }).await.unwrap();
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: s0.snapshot_id, ..Default::default() })
        .await
        .unwrap();
    for n in [&a, &c] {
        assert!(!n.cli(&["snapshot", "show", "s0"]).status.success(), "{:?} keeps s0", n.dir);
    }
    let publish = |readonly| csi::ControllerPublishVolumeRequest {
        volume_id: old_id.clone(),
        node_id: "node-a".into(),
        volume_capability: Some(common::csi::mount_cap(csi::volume_capability::access_mode::Mode::SingleNodeWriter)),
        readonly,
        ..Default::default()
    };
    let ctx = ctl.controller_publish_volume(publish(false)).await.unwrap().into_inner().publish_context;
    assert_eq!(ctx["primary"], "node-a");
    assert!(read_image(&a, "r1", 1 << 20) == data, "the promoted copy holds what node-b's primary acknowledged");
    let unpublish = csi::ControllerUnpublishVolumeRequest {
        volume_id: old_id.clone(),
        node_id: "node-a".into(),
        ..Default::default()
    };
    ctl.controller_unpublish_volume(unpublish.clone()).await.unwrap();
    // Unpublished on the new primary: a publication of another kind is taken now.
    ctl.controller_publish_volume(publish(true)).await.unwrap();
    ctl.controller_unpublish_volume(unpublish).await.unwrap();

    println!("== a copy whose node does not answer: deletion changes nothing, and is retried");
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id, ..Default::default() })
        .await
        .unwrap();
    let pid = c.child.as_ref().unwrap().id().to_string();
    assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let e = ctl
        .delete_volume(csi::DeleteVolumeRequest { volume_id: old_id.clone(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(e.message().contains("node-c"), "{e}");
    assert!(names(&a).contains(&"r1".to_owned()), "nothing deleted while a copy is silent");
    assert!(std::process::Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());

    println!("== deletion removes the copies left, and node-b's leaves the membership with its node");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: old_id.clone(), ..Default::default() }).await.unwrap();
    for n in [&a, &c] {
        assert!(names(n).is_empty(), "{:?} left: {:?}", n.dir, names(n));
    }
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id, ..Default::default() }).await.unwrap();
    c.stop();
    drop(csi_proc);
}

/// Copies spread across zones (the daemons' `zone`, from their Nodes' labels): `zoneSpread:
/// required` puts each copy in a zone of its own or refuses the volume, `preferred` spreads
/// where it can; NodeGetInfo reports the zone as a topology segment.
#[tokio::test(flavor = "multi_thread")]
async fn copies_spread_across_zones() {
    let dir = tempfile::tempdir().unwrap();
    let zones = [("a", "127.0.0.2", "z1"), ("b", "127.0.0.3", "z1"), ("c", "127.0.0.4", "z2")];
    let mut d = Vec::new();
    let mut nodes = Vec::new();
    for (n, ip, zone) in zones {
        let (daemon, admin, _) = tcp_node_with(&dir.path().join(n), ip, &format!("zone = \"{zone}\"\nregion = \"r1\""));
        d.push(daemon);
        nodes.push((format!("node-{n}"), format!("tcp://{admin}")));
    }
    let all: Vec<(&str, String)> = nodes.iter().map(|(n, e)| (n.as_str(), e.clone())).collect();
    let _csi = start_csi_with(dir.path(), &all, &["--mode", "controller"]);
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    assert_eq!(d[0].json(&["pool", "status"])["zone"], "z1");

    println!("== required: two copies in two zones, whichever node has more room");
    let mut r = replicated("spread", 16 * MIB, "node-a", "2");
    r.parameters.insert("zoneSpread".into(), "required".into());
    let v = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(v.volume_context["copies"], "node-a,node-c", "the copy goes to z2, not to node-b in z1");
    assert_eq!(v.volume_context["zoneSpread"], "required");
    // Three copies cannot be in three zones here.
    let mut r = replicated("three", 16 * MIB, "node-a", "3");
    r.parameters.insert("zoneSpread".into(), "required".into());
    let e = ctl.create_volume(r).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    assert!(e.message().contains("zoneSpread required") && e.message().contains("z1, z2"), "{e}");
    assert!(names(&d[1]).is_empty() && names(&d[2]) == ["spread"], "nothing added for the refused volume");
    let mut r = replicated("three", 16 * MIB, "node-a", "3");
    r.parameters.insert("zoneSpread".into(), "preferred".into());
    let three = ctl.create_volume(r).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(three.volume_context["copies"].split(',').count(), 3);
    for id in [v.volume_id, three.volume_id] {
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id, ..Default::default() }).await.unwrap();
    }
}
