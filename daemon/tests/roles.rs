//! Who may call what, over real mutual TLS: every RPC of `admin.proto`, `replica.proto` and
//! `mirror.proto`, called with the certificate of each role (and of no role), is refused with
//! PermissionDenied exactly where the table below says so. The table is the spec: an RPC the
//! protos gain without a row here fails the test. Calls carry empty requests, so an allowed call
//! fails on its arguments (or does something harmless), never on its caller.

mod common;

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

    let mut all = rpcs("Admin", include_str!("../../proto/ferrite/v1/admin.proto"));
    all.extend(rpcs("Replica", include_str!("../../proto/ferrite/v1/replica.proto")));
    all.extend(rpcs("Mirror", include_str!("../../proto/ferrite/v1/mirror.proto")));
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
