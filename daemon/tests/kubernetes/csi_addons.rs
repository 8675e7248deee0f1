//! CSI-Addons conformance over the real gRPC socket of `ferrite csi --mode controller`, with two
//! real daemons on different loopback addresses (127.0.0.2 and 127.0.0.3) standing for two
//! nodes: their admin APIs and NBD exports listen on TCP there, the node directory names them by
//! address, and clients connect from other loopback addresses (127.0.0.9, .10, .11) so fencing
//! has someone to refuse.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::Daemon;
use common::csi::{channel, code, create, start_csi_with, tcp_node};
use ferrite_proto::csi::v1 as csi;
use ferrite_proto::csi_addons::{fence, identity, reclaimspace as rs, volumegroup as vg};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};
use tonic::Code;

/// A TCP connection to `to` from the loopback address `from`.
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(format!("{from}:0").parse().unwrap()).unwrap();
    s.connect(to).await.unwrap()
}

/// What the server sends first on a new connection: the NBD greeting, or nothing (EOF) when the
/// address is fenced.
async fn greeting(s: &mut TcpStream) -> Vec<u8> {
    let mut buf = vec![0u8; 8];
    let n =
        tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await.expect("server answered").unwrap_or(0);
    buf.truncate(n);
    buf
}

/// Whether the server closes the connection (EOF or reset) within a few seconds; what it sent
/// before is skipped.
async fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    let eof = async {
        loop {
            if matches!(s.read(&mut buf).await, Ok(0) | Err(_)) {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), eof).await.is_ok()
}

/// Whether the admin listener at `to` closes a mutual-TLS connection from `from` with the
/// certificate `who` right after its handshake.
async fn tls_closed_from(from: &str, to: SocketAddr, pki: &std::path::Path, who: &str) -> bool {
    let tcp = connect_from(from, to).await;
    let (cert, key) = (pki.join(format!("{who}.pem")), pki.join(format!("{who}-key.pem")));
    let cfg = ferrite_tls::client_config(&pki.join("ca.pem"), Some((&cert, &key)), &[b"h2"]).unwrap();
    let name = ferrite_tls::server_name(&to.to_string()).unwrap();
    match ferrite_tls::TlsConnector::from(cfg).connect(name, tcp).await {
        Err(_) => true,
        Ok(mut s) => {
            let mut buf = [0u8; 64];
            let eof = async { while !matches!(s.read(&mut buf).await, Ok(0) | Err(_)) {} };
            tokio::time::timeout(Duration::from_secs(3), eof).await.is_ok()
        }
    }
}

fn cidrs(list: &[&str]) -> Vec<fence::Cidr> {
    list.iter().map(|c| fence::Cidr { cidr: (*c).into() }).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn addons_conformance_with_two_nodes_on_loopback_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let (a, a_admin, a_nbd) = tcp_node(&dir.path().join("a"), "127.0.0.2");
    let (mut b, b_admin, b_nbd) = tcp_node(&dir.path().join("b"), "127.0.0.3");
    let _csi = start_csi_with(
        dir.path(),
        &[("node-a", format!("tcp://{a_admin}")), ("node-b", format!("tcp://{b_admin}"))],
        &["--mode", "controller", "--addons-endpoint", &dir.path().join("addons.sock").display().to_string()],
    );
    let ch = channel(&dir.path().join("csi.sock")).await;
    let addons = channel(&dir.path().join("addons.sock")).await;
    let mut ctl = csi::controller_client::ControllerClient::new(ch);

    // Identity of the add-ons endpoint.
    let mut ident = identity::identity_client::IdentityClient::new(addons.clone());
    assert_eq!(ident.get_identity(identity::GetIdentityRequest {}).await.unwrap().into_inner().name, "csi.ferrite.dev");
    assert_eq!(ident.probe(identity::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
    let caps = ident.get_capabilities(identity::GetCapabilitiesRequest {}).await.unwrap().into_inner().capabilities;
    use identity::capability::Type as T;
    let has = |f: &dyn Fn(&T) -> bool| caps.iter().any(|c| c.r#type.as_ref().is_some_and(f));
    assert!(has(
        &|t| matches!(t, T::Service(s) if s.r#type == identity::capability::service::Type::ControllerService as i32)
    ));
    assert!(!has(
        &|t| matches!(t, T::Service(s) if s.r#type == identity::capability::service::Type::NodeService as i32)
    ));
    assert!(has(
        &|t| matches!(t, T::NetworkFence(f) if f.r#type == identity::capability::network_fence::Type::GetClientsToFence as i32)
    ));
    assert!(has(
        &|t| matches!(t, T::VolumeGroup(g) if g.r#type == identity::capability::volume_group::Type::ModifyVolumeGroup as i32)
    ));
    // A controller reclaims offline (ControllerReclaimSpace); online is the node's.
    let reclaim = identity::capability::reclaim_space::Type::Offline as i32;
    assert!(has(&|t| matches!(t, T::ReclaimSpace(r) if r.r#type == reclaim)));
    assert!(!has(&|t| matches!(t, T::ReclaimSpace(r) if r.r#type != reclaim)));

    // ---- NetworkFence ----
    let mut f = fence::fence_controller_client::FenceControllerClient::new(addons.clone());
    let fence_req = |list: &[&str]| fence::FenceClusterNetworkRequest { cidrs: cidrs(list), ..Default::default() };
    assert_eq!(code(f.fence_cluster_network(fence_req(&[])).await), Code::InvalidArgument);
    assert_eq!(code(f.fence_cluster_network(fence_req(&[""])).await), Code::InvalidArgument);
    assert_eq!(code(f.fence_cluster_network(fence_req(&["300.1.1.1/8"])).await), Code::InvalidArgument);
    assert_eq!(code(f.fence_cluster_network(fence_req(&["10.0.0.0/40"])).await), Code::InvalidArgument);
    // A fence takes one node's clients at most: nothing wider than 256 addresses, nothing that
    // covers two nodes' addresses (node-a is 127.0.0.2, node-b 127.0.0.3).
    for wide in [&["0.0.0.0/0"][..], &["127.0.0.9", "127.0.0.0/8"], &["127.0.0.2/31"], &["::/0"]] {
        let s = f.fence_cluster_network(fence_req(wide)).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{wide:?}: {s:?}");
        assert!(s.message().starts_with("fence refused:"), "{wide:?}: {}", s.message());
    }
    let mut with_param = fence_req(&["127.0.0.9"]);
    with_param.parameters.insert("clusterID".into(), "x".into());
    assert_eq!(code(f.fence_cluster_network(with_param).await), Code::InvalidArgument);
    let list = |f: &mut fence::fence_controller_client::FenceControllerClient<_>| {
        let mut f = f.clone();
        async move {
            let r = f.list_cluster_fence(fence::ListClusterFenceRequest::default()).await.unwrap().into_inner();
            r.cidrs.into_iter().map(|c| c.cidr).collect::<Vec<_>>()
        }
    };
    assert!(list(&mut f).await.is_empty(), "a bad request changed nothing");

    // Before fencing: clients from .9 and .11 get the NBD greeting; .11 stays connected.
    let mut c9 = connect_from("127.0.0.9", a_nbd).await;
    assert_eq!(greeting(&mut c9).await, b"NBDMAGIC");
    drop(c9);
    let mut c11 = connect_from("127.0.0.11", a_nbd).await;
    assert_eq!(greeting(&mut c11).await, b"NBDMAGIC");
    let clients = f.get_fence_clients(fence::GetFenceClientsRequest::default()).await.unwrap().into_inner().clients;
    assert!(
        clients.iter().any(|c| c.id == "127.0.0.11" && c.addresses.iter().any(|a| a.cidr == "127.0.0.11/32")),
        "{clients:?}"
    );

    f.fence_cluster_network(fence_req(&["127.0.0.9", "127.0.0.11/32"])).await.unwrap();
    f.fence_cluster_network(fence_req(&["127.0.0.9"])).await.unwrap(); // idempotent
    assert_eq!(list(&mut f).await, ["127.0.0.11/32", "127.0.0.9/32"]);
    assert!(closed(&mut c11).await, "fencing cuts an open connection");
    for target in [a_nbd, b_nbd] {
        let mut c = connect_from("127.0.0.9", target).await;
        assert!(greeting(&mut c).await.is_empty(), "a fenced address is refused by {target}");
    }
    // The admin listener refuses fenced addresses too, once it knows who the client is: a node's
    // certificate is closed, the controller's passes (it may run on the fenced node).
    let pki = dir.path().join("pki");
    assert!(tls_closed_from("127.0.0.9", a_admin, &pki, "node-127-0-0-3").await, "a fenced node got in");
    assert!(!tls_closed_from("127.0.0.9", a_admin, &pki, "csi").await, "the controller was fenced out");
    let mut c10 = connect_from("127.0.0.10", a_nbd).await;
    assert_eq!(greeting(&mut c10).await, b"NBDMAGIC", "other addresses are not affected");
    drop(c10);
    let clients = f.get_fence_clients(fence::GetFenceClientsRequest::default()).await.unwrap().into_inner().clients;
    assert!(!clients.iter().any(|c| c.id == "127.0.0.11"), "{clients:?}");

    // Persisted by each daemon: a restarted node still refuses.
    b.stop();
    let mut b = Daemon::start(&dir.path().join("b"));
    let mut c = connect_from("127.0.0.9", b_nbd).await;
    assert!(greeting(&mut c).await.is_empty());
    assert_eq!(list(&mut f).await, ["127.0.0.11/32", "127.0.0.9/32"]);

    let unfence = |l: &[&str]| fence::UnfenceClusterNetworkRequest { cidrs: cidrs(l), ..Default::default() };
    assert_eq!(code(f.unfence_cluster_network(unfence(&[])).await), Code::InvalidArgument);
    f.unfence_cluster_network(unfence(&["127.0.0.9/32"])).await.unwrap();
    f.unfence_cluster_network(unfence(&["127.0.0.9/32"])).await.unwrap(); // idempotent
    assert_eq!(list(&mut f).await, ["127.0.0.11/32"]);
    for target in [a_nbd, b_nbd] {
        let mut c = connect_from("127.0.0.9", target).await;
        assert_eq!(greeting(&mut c).await, b"NBDMAGIC", "unfencing restores access to {target}");
    }
    f.unfence_cluster_network(unfence(&["127.0.0.11"])).await.unwrap();
    let mut c11 = connect_from("127.0.0.11", b_nbd).await;
    assert_eq!(greeting(&mut c11).await, b"NBDMAGIC");

    // ---- ReclaimSpace (controller): the cleaner on the volume's node ----
    let mut rc = rs::reclaim_space_controller_client::ReclaimSpaceControllerClient::new(addons.clone());
    let reclaim = |id: &str| rs::ControllerReclaimSpaceRequest { volume_id: id.into(), ..Default::default() };
    assert_eq!(code(rc.controller_reclaim_space(reclaim("")).await), Code::InvalidArgument);
    assert_eq!(code(rc.controller_reclaim_space(reclaim("node-a/missing")).await), Code::NotFound);
    let v = ctl.create_volume(create("r1", 64 << 20, Some("node-a"))).await.unwrap().into_inner().volume.unwrap();
    let uri = a.qemu_uri("r1");
    a.ok(&["export", "nbd", "r1"]);
    let io = |cmd: &str| {
        let o = std::process::Command::new("qemu-io").args(["-f", "raw", "-c", cmd, &uri]).output().unwrap();
        assert!(o.status.success(), "qemu-io {cmd}: {}", String::from_utf8_lossy(&o.stderr));
    };
    if common::have("qemu-io") {
        io("write -P 0x5a 0 48M");
        io("discard 0 40M");
        a.ok(&["export", "stop", "r1"]);
        let r = rc.controller_reclaim_space(reclaim(&v.volume_id)).await.unwrap().into_inner();
        let (pre, post) = (r.pre_usage.unwrap().usage_bytes, r.post_usage.unwrap().usage_bytes);
        assert!(post + (24 << 20) <= pre, "the cleaner gave back what the discard freed: {pre} → {post}");
    }

    // ---- VolumeGroup ----
    let mut g = vg::controller_client::ControllerClient::new(addons);
    let mk = |name: &str, vols: &[&str]| vg::CreateVolumeGroupRequest {
        name: name.into(),
        volume_ids: vols.iter().map(|v| (*v).to_owned()).collect(),
        ..Default::default()
    };
    let va =
        ctl.create_volume(create("ga", 1 << 20, Some("node-a"))).await.unwrap().into_inner().volume.unwrap().volume_id;
    let va2 =
        ctl.create_volume(create("ga2", 1 << 20, Some("node-a"))).await.unwrap().into_inner().volume.unwrap().volume_id;
    let vb =
        ctl.create_volume(create("gb", 1 << 20, Some("node-b"))).await.unwrap().into_inner().volume.unwrap().volume_id;
    assert_eq!(code(g.create_volume_group(mk("", &[&va])).await), Code::InvalidArgument);
    assert_eq!(code(g.create_volume_group(mk("g1", &[&va, &vb])).await), Code::FailedPrecondition);
    assert_eq!(code(g.create_volume_group(mk("g1", &["node-a/missing"])).await), Code::NotFound);
    assert_eq!(code(g.create_volume_group(mk("g0", &[])).await), Code::InvalidArgument, "which node?");
    let g1 = g.create_volume_group(mk("g1", &[&va, &va2])).await.unwrap().into_inner().volume_group.unwrap();
    assert_eq!(g1.volumes.len(), 2);
    assert!(g1.volume_group_id.starts_with("node-a/"));
    let again = g.create_volume_group(mk("g1", &[&va2, &va])).await.unwrap().into_inner().volume_group.unwrap();
    assert_eq!(again.volume_group_id, g1.volume_group_id, "idempotent");
    assert_eq!(code(g.create_volume_group(mk("g1", &[&va])).await), Code::AlreadyExists);
    assert_eq!(code(g.create_volume_group(mk("g2", &[&va])).await), Code::FailedPrecondition, "one group per volume");
    let mut empty = mk("g-empty", &[]);
    empty.parameters.insert("node".into(), "node-b".into());
    let ge = g.create_volume_group(empty).await.unwrap().into_inner().volume_group.unwrap();
    assert!(ge.volume_group_id.starts_with("node-b/") && ge.volumes.is_empty());
    let mut bad = mk("g3", &[]);
    bad.parameters.insert("zone".into(), "x".into());
    assert_eq!(code(g.create_volume_group(bad).await), Code::InvalidArgument);

    let modify = |id: &str, vols: &[&str]| vg::ModifyVolumeGroupMembershipRequest {
        volume_group_id: id.into(),
        volume_ids: vols.iter().map(|v| (*v).to_owned()).collect(),
        ..Default::default()
    };
    assert_eq!(code(g.modify_volume_group_membership(modify("", &[])).await), Code::InvalidArgument);
    assert_eq!(code(g.modify_volume_group_membership(modify("node-a/nope", &[])).await), Code::NotFound);
    let m = g.modify_volume_group_membership(modify(&g1.volume_group_id, &[&va2])).await.unwrap().into_inner();
    let members: Vec<String> = m.volume_group.unwrap().volumes.into_iter().map(|v| v.volume_id).collect();
    assert_eq!(members, std::slice::from_ref(&va2));
    g.modify_volume_group_membership(modify(&g1.volume_group_id, &[&va2])).await.unwrap(); // idempotent
    assert_eq!(
        code(g.modify_volume_group_membership(modify(&g1.volume_group_id, &[&vb])).await),
        Code::InvalidArgument,
        "a volume of another node"
    );
    let get = |id: &str| vg::ControllerGetVolumeGroupRequest { volume_group_id: id.into(), ..Default::default() };
    let got = g.controller_get_volume_group(get(&g1.volume_group_id)).await.unwrap().into_inner().volume_group.unwrap();
    assert_eq!(got.volumes.len(), 1);
    assert_eq!(code(g.controller_get_volume_group(get("node-a/nope")).await), Code::NotFound);
    assert_eq!(code(g.controller_get_volume_group(get("")).await), Code::InvalidArgument);

    let page = |max: i32, token: &str| vg::ListVolumeGroupsRequest {
        max_entries: max,
        starting_token: token.into(),
        ..Default::default()
    };
    let p1 = g.list_volume_groups(page(1, "")).await.unwrap().into_inner();
    assert_eq!(p1.entries.len(), 1);
    let p2 = g.list_volume_groups(page(1, &p1.next_token)).await.unwrap().into_inner();
    assert_eq!(p2.entries.len(), 1);
    assert!(p2.next_token.is_empty(), "two groups in all");
    assert_ne!(p1.entries[0].volume_group, p2.entries[0].volume_group);
    assert_eq!(code(g.list_volume_groups(page(1, "bogus")).await), Code::Aborted);

    let del = |id: &str| vg::DeleteVolumeGroupRequest { volume_group_id: id.into(), ..Default::default() };
    assert_eq!(code(g.delete_volume_group(del(&g1.volume_group_id)).await), Code::FailedPrecondition);
    g.modify_volume_group_membership(modify(&g1.volume_group_id, &[])).await.unwrap();
    g.delete_volume_group(del(&g1.volume_group_id)).await.unwrap();
    g.delete_volume_group(del(&g1.volume_group_id)).await.unwrap(); // idempotent
    g.delete_volume_group(del(&ge.volume_group_id)).await.unwrap();
    g.delete_volume_group(del("never/made")).await.unwrap();
    assert_eq!(code(g.delete_volume_group(del("")).await), Code::InvalidArgument);
    assert!(a.ok(&["volume", "list"]).contains("ga2"), "deleting a group never deletes its volumes");
    b.stop();
}
