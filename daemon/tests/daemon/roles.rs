//! Who may call what, over real mutual TLS: every RPC of `admin.proto`, `replica.proto` and
//! `mirror.proto`, called with the certificate of each role (and of no role), is refused with
//! PermissionDenied exactly where the table below says so. The table is the spec: an RPC the
//! protos gain without a row here fails the test. Calls carry empty requests, so an allowed call
//! fails on its arguments (or does something harmless), never on its caller.

use crate::common;

use common::Daemon;
use common::csi::{certs, closed_for, free_port, tls_channel, tls_connection};
use tonic::Code;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// What the CSI driver calls (controller and node modes, CSI-Addons).
const CONTROLLER: &[&str] = &[
    "CreateVolume",
    "ListVolumes",
    "GetVolume",
    "GrowVolume",
    "SetVolumeLimits",
    "DeleteVolume",
    "CloneVolume",
    "UnlockVolume",
    "RekeyVolume",
    "CreateSnapshot",
    "ListSnapshots",
    "GetSnapshot",
    "DeleteSnapshot",
    "ChangedRanges",
    "EnableReplication",
    "DisableReplication",
    "DemoteReplication",
    "PromoteReplication",
    "ResyncReplication",
    "ListReplications",
    "AddSyncReplica",
    "RemoveSyncReplica",
    "PromoteSyncReplica",
    "ListSyncReplicas",
    "CreateGroup",
    "UpdateGroup",
    "DeleteGroup",
    "ListGroups",
    "CreateGroupSnapshot",
    "ListGroupSnapshots",
    "DeleteGroupSnapshot",
    "PoolStatus",
    "Version",
    "ReclaimPool",
    "FenceNetworks",
    "UnfenceNetworks",
    "ListFences",
    "ListClients",
    "PublishVolume",
    "UnpublishVolume",
    "ListPublications",
];

/// Operators only.
const OPERATOR: &[&str] = &[
    "SyncReplication",
    "CloneGroupSnapshot",
    "StartExport",
    "StopExport",
    "ListExports",
    "ScrubPool",
    "DefragVolume",
    // The node plugin attaches over the admin socket.
    "AttachVolume",
    "DetachVolume",
    "ResizeAttachment",
    "ListAttachments",
];

/// The Replica and Mirror services: replication peers (and operators).
const PEER: &[&str] = &["Position", "Push", "Sync", "GroupCommit", "Stream", "Record", "Get", "Rebuild"];

/// One RPC: its path, and whether its request or its response is a stream.
struct Rpc {
    path: String,
    name: String,
    client_stream: bool,
    server_stream: bool,
}

fn rpcs(service: &str, proto: &str) -> Vec<Rpc> {
    proto
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rpc "))
        .map(|l| {
            let name = l.split('(').next().unwrap().trim().to_owned();
            let (args, ret) = l.split_once("returns").unwrap();
            Rpc {
                path: format!("/ferrite.v1.{service}/{name}"),
                client_stream: args.contains("(stream "),
                server_stream: ret.contains("(stream "),
                name,
            }
        })
        .collect()
}

/// Calls `rpc` with an empty request (an empty stream for a client stream); its status.
async fn call(ch: &Channel, rpc: &Rpc) -> Result<(), tonic::Status> {
    type Codec = tonic_prost::ProstCodec<(), ()>;
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = PathAndQuery::try_from(rpc.path.as_str()).unwrap();
    if rpc.client_stream && rpc.server_stream {
        let req = tonic::Request::new(tokio_stream::iter(Vec::<()>::new()));
        let mut s = grpc.streaming(req, path, Codec::default()).await?;
        s.get_mut().message().await.map(drop)
    } else if rpc.client_stream {
        let req = tonic::Request::new(tokio_stream::iter(Vec::<()>::new()));
        grpc.client_streaming(req, path, Codec::default()).await.map(drop)
    } else if rpc.server_stream {
        let mut s = grpc.server_streaming(tonic::Request::new(()), path, Codec::default()).await?;
        // The first message or status: a refusal comes before any.
        s.get_mut().message().await.map(drop)
    } else {
        grpc.unary(tonic::Request::new(()), path, Codec::default()).await.map(drop)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_with_every_role_is_allowed_or_refused_as_the_table_says() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    certs(&pki, "server", &["127.0.0.1"]);
    for who in ["op", "ctl", "peer", "reader", "nobody"] {
        certs(&pki, who, &[]);
    }
    let admin = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let p = |f: &str| pki.join(f).display().to_string();
    let cfg = format!(
        "pool-size = \"1G\"\nsegment-size = \"4M\"\nmax-connections = 8\nadmin-listen = \"{admin}\"\nmetrics-listen = \"{metrics}\"\ntls-cert = {:?}\ntls-key = {:?}\n\
         tls-client-ca = {:?}\n[roles]\n\"op\" = \"operator\"\n\"ctl\" = \"controller\"\n\
         \"peer\" = \"replication-peer\"\n\"reader\" = \"nbd-client\"\n",
        p("server.pem"),
        p("server-key.pem"),
        p("ca.pem")
    );
    std::fs::write(data.join("ferrite.toml"), cfg).unwrap();
    let mut d = Daemon::start(&data);

    let mut all = rpcs("Admin", include_str!("../../../proto/ferrite/v1/admin.proto"));
    all.extend(rpcs("Replica", include_str!("../../../proto/ferrite/v1/replica.proto")));
    all.extend(rpcs("Mirror", include_str!("../../../proto/ferrite/v1/mirror.proto")));
    for rpc in &all {
        let rows = [CONTROLLER, OPERATOR, PEER].iter().filter(|t| t.contains(&rpc.name.as_str())).count();
        assert_eq!(rows, 1, "{} must have exactly one row in this test's role table", rpc.path);
    }
    let mut refused = 0;
    for (who, allowed) in [
        ("op", &[CONTROLLER, OPERATOR, PEER][..]),
        ("ctl", &[CONTROLLER][..]),
        ("peer", &[PEER][..]),
        ("reader", &[][..]),
    ] {
        let ch = tls_channel(&admin, &pki, who).await;
        for rpc in &all {
            let may = allowed.iter().any(|t| t.contains(&rpc.name.as_str()));
            let got = call(&ch, rpc).await;
            let denied = got.as_ref().is_err_and(|e| e.code() == Code::PermissionDenied);
            assert_eq!(denied, !may, "{who} calling {}: {got:?}", rpc.path);
            if denied {
                refused += 1;
                let msg = got.unwrap_err().message().to_owned();
                assert!(msg.contains(who) && msg.contains(&rpc.name), "{msg}");
            }
        }
    }
    assert!(refused > 100, "{refused}");
    controller_lifts_only_its_own_fences(&admin, &pki).await;
    controller_carries_the_keys_it_uses(&admin, &pki).await;
    controller_replicates_only_to_replication_peers(&admin, &pki).await;
    only_controllers_and_operators_pass_a_fence_of_their_address(&d, &admin, &pki).await;

    // A certificate naming no configured identity is closed right after its handshake (and
    // counted); one identity holds at most half the connection slots (4 of 8 here): neither a
    // crowd of role-less connections nor one peer's idle ones keep the controller out.
    assert!(closed_for(&admin, &pki, "nobody").await, "a certificate with no role kept its connection");
    let mut held = Vec::new();
    for who in std::iter::repeat_n("nobody", 24).chain(std::iter::repeat_n("peer", 6)) {
        held.push(tls_connection(&admin, &pki, who).await);
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let ch = tls_channel(&admin, &pki, "ctl").await;
    let list = Rpc {
        path: "/ferrite.v1.Admin/ListVolumes".into(),
        name: "ListVolumes".into(),
        client_stream: false,
        server_stream: false,
    };
    call(&ch, &list).await.expect("the controller was kept out");
    let (op, op_key) = (pki.join("op.pem"), pki.join("op-key.pem"));
    let m = common::scrape_tls(&metrics, &pki.join("ca.pem"), Some((&op, &op_key))).unwrap();
    // The metrics endpoint: operators and the metrics role only.
    for who in ["ctl", "peer", "reader"] {
        let (cert, key) = (pki.join(format!("{who}.pem")), pki.join(format!("{who}-key.pem")));
        let got = common::scrape_tls(&metrics, &pki.join("ca.pem"), Some((&cert, &key)));
        assert!(got.as_ref().map_or(true, |t| !t.contains("200 OK")), "{who} read the metrics: {got:?}");
    }
    drop(held);
    let count = |name: &str| m.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok()).unwrap_or(0);
    // The 24 held, and the first (which the client may open twice: connect, then the call).
    assert!(count("ferrite_admin_connections_no_role_total ") >= 25, "{m}");
    assert!(m.contains("ferrite_admin_connections_identity_full_total 2"), "{m}");
    // Refusals are logged with the identity and the call, and nothing was harmed.
    assert!(d.log().contains("call refused"));
    assert!(d.stop().success(), "{}", d.log());
}

/// A fence records its maker: the controller's failover and its NetworkFence are separate marks,
/// and the controller lifts neither an operator's fence nor the other job's mark.
async fn controller_lifts_only_its_own_fences(admin: &str, pki: &std::path::Path) {
    use ferrite_proto::ferrite::v1::{FenceRequest, ListFencesRequest, admin_client::AdminClient};
    let op = AdminClient::new(tls_channel(admin, pki, "op").await);
    let ctl = AdminClient::new(tls_channel(admin, pki, "ctl").await);
    let req = |cidr: &str, owner: &str| FenceRequest { cidrs: vec![cidr.into()], owner: owner.into() };
    op.clone().fence_networks(req("10.250.0.0/16", "")).await.unwrap();
    ctl.clone().fence_networks(req("10.251.0.0/16", "failover")).await.unwrap();
    ctl.clone().fence_networks(req("10.250.0.0/16", "failover")).await.unwrap();
    for (cidr, owner) in [("10.250.0.0/16", ""), ("10.251.0.0/16", "network-fence")] {
        let e = ctl.clone().unfence_networks(req(cidr, owner)).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{cidr} {owner}: {e:?}");
        assert!(e.message().contains("only its makers"), "{e:?}");
    }
    let bad = ctl.clone().fence_networks(req("10.252.0.0/16", "Not A Name")).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    // The failover's lift leaves the operator's fence of the same block in place.
    for cidr in ["10.250.0.0/16", "10.251.0.0/16"] {
        ctl.clone().unfence_networks(req(cidr, "failover")).await.unwrap();
    }
    let list = ctl.clone().list_fences(ListFencesRequest {}).await.unwrap().into_inner();
    assert_eq!(list.cidrs, ["10.250.0.0/16"]);
    assert_eq!(list.fences[0].by, ["operator"]);
    // An operator lifts every mark.
    op.clone().unfence_networks(req("10.250.0.0/16", "")).await.unwrap();
    assert!(op.clone().list_fences(ListFencesRequest {}).await.unwrap().into_inner().cidrs.is_empty());
}

/// Only an operator names a key-directory key by its id alone; a controller carries the key, and
/// a key that is not the volume's current one opens and rewraps nothing.
async fn controller_carries_the_keys_it_uses(admin: &str, pki: &std::path::Path) {
    use ferrite_proto::ferrite::v1::{
        CreateVolumeRequest, GetVolumeRequest, KeyRef, RekeyVolumeRequest, UnlockVolumeRequest,
        admin_client::AdminClient,
    };
    let op = AdminClient::new(tls_channel(admin, pki, "op").await);
    let ctl = AdminClient::new(tls_channel(admin, pki, "ctl").await);
    let by_id = |id: &str| Some(KeyRef { key_id: id.into(), key: Vec::new() });
    let carried = |id: &str, b: u8| Some(KeyRef { key_id: id.into(), key: vec![b; 32] });
    let create =
        |name: &str, key| CreateVolumeRequest { name: name.into(), size: 1 << 20, limits: None, encryption: key };
    op.clone().create_volume(create("enc", by_id("k1"))).await.unwrap();
    let denied = |r: Result<_, tonic::Status>, what: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what}: allowed"));
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
        assert!(e.message().contains("key directory"), "{what}: {e:?}");
    };
    denied(ctl.clone().create_volume(create("enc2", by_id("k9"))).await.map(drop), "create by id");
    denied(
        ctl.clone().unlock_volume(UnlockVolumeRequest { name: "enc".into(), key: by_id("k1") }).await.map(drop),
        "unlock by id",
    );
    let rekey = |old, new, data_key| RekeyVolumeRequest { name: "enc".into(), old_key: old, new_key: new, data_key };
    denied(ctl.clone().rekey_volume(rekey(by_id("k1"), carried("k2", 2), false)).await.map(drop), "rekey by id");
    denied(ctl.clone().rekey_volume(rekey(None, None, true)).await.map(drop), "data key by id");
    denied(ctl.clone().rekey_volume(rekey(carried("k1", 7), by_id("k2"), false)).await.map(drop), "to a key by id");
    // A carried key that is not the volume's: refused by the volume, nothing changed.
    let wrong = ctl.clone().rekey_volume(rekey(carried("k1", 7), carried("k2", 2), false)).await.unwrap_err();
    assert_eq!(wrong.code(), Code::FailedPrecondition, "{wrong:?}");
    let v = op.clone().get_volume(GetVolumeRequest { name: "enc".into() }).await.unwrap().into_inner();
    assert_eq!(v.encryption.unwrap().key_id, "k1");
    let made = op.clone().get_volume(GetVolumeRequest { name: "enc2".into() }).await;
    assert_eq!(made.unwrap_err().code(), Code::NotFound);
}

/// A controller names as a replication peer only an endpoint whose certificate holds the
/// replication-peer role: this daemon's own certificate (`server`) holds none.
async fn controller_replicates_only_to_replication_peers(admin: &str, pki: &std::path::Path) {
    use ferrite_proto::ferrite::v1::{AddSyncReplicaRequest, EnableReplicationRequest, admin_client::AdminClient};
    let ctl = AdminClient::new(tls_channel(admin, pki, "ctl").await);
    let peer = format!("tcp://{admin}");
    let add = AddSyncReplicaRequest { volume: "enc".into(), peer: peer.clone(), witness: false };
    let enable = EnableReplicationRequest { volume: "enc".into(), peer, ..Default::default() };
    for got in
        [ctl.clone().add_sync_replica(add).await.map(drop), ctl.clone().enable_replication(enable).await.map(drop)]
    {
        let e = got.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("holds no replication-peer role"), "{e:?}");
    }
}

/// A fence of the clients' own address (all of loopback here) keeps out a replication peer, but
/// never the controller (it may run on, or share the address of, the node it fenced) nor an
/// operator.
async fn only_controllers_and_operators_pass_a_fence_of_their_address(d: &Daemon, admin: &str, pki: &std::path::Path) {
    use ferrite_proto::ferrite::v1::{ListVolumesRequest, admin_client::AdminClient};
    d.ok(&["fence", "add", "127.0.0.0/8"]);
    for who in ["ctl", "op"] {
        let mut c = AdminClient::new(tls_channel(admin, pki, who).await);
        c.list_volumes(ListVolumesRequest {}).await.unwrap_or_else(|e| panic!("{who} was kept out by the fence: {e}"));
    }
    assert!(closed_for(admin, pki, "peer").await, "a replication peer passed a fence of its address");
    d.ok(&["fence", "remove", "127.0.0.0/8"]);
    assert!(!closed_for(admin, pki, "peer").await, "the lifted fence still keeps the peer out");
}
