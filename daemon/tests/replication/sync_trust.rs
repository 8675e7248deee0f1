//! The membership rule of synchronous replicas, tried as an attacker and as a tester would,
//! between daemons in network namespaces over their real mutual-TLS admin listeners: a peer
//! holding only a `replication-peer` certificate cannot take over, grow or rekey a volume
//! through a membership, nor store an unbounded generation, nor more than its quota; a lying
//! member changes nothing; in-sync copies never differ after a failover, so a write that failed
//! to its client never reads back after two of them; and a primary without a majority for
//! longer than the ejection timeout serves no reads.

use crate::common;

use std::time::Duration;

use common::mirror::{membership, state_of, stream_write};
use common::nbd::{connect, read_image, request};
use common::netns::{Nics, Switch};
use common::{Daemon, pattern, until};
use ferrite_nbd::proto::{CMD_FLAG_FUA, CMD_WRITE};
use ferrite_proto::ferrite::v1::mirror_client::MirrorClient;

const MIB: u64 = 1 << 20;
const TIMEOUT: &str = "sync-timeout-ms = 1000";

fn cluster(n: usize, root: &std::path::Path, extra: &str) -> Option<(Switch, Vec<Daemon>)> {
    if !common::have("qemu-io") {
        return None;
    }
    let sw = Switch::new(n)?;
    let d = (0..n).map(|i| sw.daemon(i, root, &format!("{TIMEOUT}\n{extra}"))).collect();
    Some((sw, d))
}

/// A FUA write of `data` at `offset`: the NBD error (0: acknowledged).
fn fua_write(s: &mut std::os::unix::net::UnixStream, offset: u64, data: &[u8]) -> u32 {
    use std::io::{Read, Write};
    let len = u32::try_from(data.len()).unwrap();
    s.write_all(&request(CMD_WRITE, CMD_FLAG_FUA, 7, offset, len, data)).unwrap();
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply).unwrap();
    u32::from_be_bytes(reply[4..8].try_into().unwrap())
}

/// A read of `len` bytes at `offset`: the NBD error (0: served).
fn read(s: &mut std::os::unix::net::UnixStream, offset: u64, len: u32) -> u32 {
    use std::io::{Read, Write};
    s.write_all(&request(ferrite_nbd::proto::CMD_READ, 0, 8, offset, len, &[])).unwrap();
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply).unwrap();
    let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
    if error == 0 {
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).unwrap();
    }
    error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_cannot_take_over_grow_or_rekey_a_volume_through_a_membership() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, d)) = cluster(2, root.path(), "peer-quota = 3\npeer-space-percent = 50") else { return };
    let (e0, e1) = (sw.endpoint(0), sw.endpoint(1));
    let run = |args: &[&str]| {
        let (dir, args) = (d[0].dir.clone(), args.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        tokio::task::spawn_blocking(move || {
            let o = std::process::Command::new(common::BIN)
                .arg("--admin-socket")
                .arg(dir.join("admin.sock"))
                .args(&args)
                .output()
                .unwrap();
            assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        })
    };
    run(&["volume", "create", "plain2", "16M"]).await.unwrap();
    run(&["export", "nbd", "plain2"]).await.unwrap();
    let nbd = d[0].nbd();
    let wrote = tokio::task::spawn_blocking(move || fua_write(&mut connect(&nbd, "plain2"), 0, &pattern(9, 4096)));
    assert_eq!(wrote.await.unwrap(), 0);
    let before = d[0].json(&["volume", "show", "plain2"]);

    let mut as1 = MirrorClient::new(
        common::csi::tls_channel(&format!("{}:7070", sw.ip[0]), &root.path().join("pki"), "host-1").await,
    );
    // A first membership of a volume that exists here: refused whatever this daemon's role.
    for (g, mine) in [(1, "witness"), (2, "in-sync"), (3, "ejected")] {
        let take = membership("plain2", g, &e1, &[(&e1, "in-sync"), (&e0, mine)]);
        let e = as1.record(take).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{mine}: {e}");
        assert!(e.message().contains("never takes over"), "{e}");
    }
    let e = stream_write(&mut as1, "plain2", 2).await;
    assert_eq!(e.code(), tonic::Code::NotFound, "{e}");
    // Generations and sizes are bounded.
    for g in [u64::MAX, (1 << 40) + 1] {
        let e = as1.record(membership("fresh", g, &e1, &[(&e1, "in-sync"), (&e0, "in-sync")])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    }
    let mut huge = membership("fresh", 1, &e1, &[(&e1, "in-sync"), (&e0, "in-sync")]);
    huge.size = u64::MAX;
    assert_eq!(as1.record(huge).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    // A witness of a volume that does not exist here never turns into its copy.
    let ghost = membership("ghost", 1, &e1, &[(&e1, "in-sync"), (&e0, "witness")]);
    assert!(as1.record(ghost).await.unwrap().into_inner().stored);
    let r = as1.record(membership("ghost", 2, &e1, &[(&e1, "in-sync"), (&e0, "in-sync")])).await;
    assert!(!r.unwrap().into_inner().stored, "a witness became a copy");

    // A peer makes no copy past its share of the pool (peer-space-percent, 50 here).
    let pool = d[0].json(&["pool", "status"])["size"].as_u64().unwrap();
    let mut big = membership("big", 1, &e1, &[(&e1, "in-sync"), (&e0, "in-sync")]);
    big.size = (pool / 2 + (1 << 20)) & !((1 << 20) - 1);
    let e = as1.record(big).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    assert!(e.message().contains("peer-space-percent"), "{e}");

    // A peer makes at most peer-quota memberships here (ghost is one).
    for (i, name) in ["q1", "q2", "q3"].iter().enumerate() {
        let r = as1.record(membership(name, 1, &e1, &[(&e1, "in-sync"), (&e0, "witness")])).await;
        match i {
            2 => assert_eq!(r.unwrap_err().code(), tonic::Code::ResourceExhausted),
            _ => assert!(r.unwrap().into_inner().stored, "{name}"),
        }
    }

    let image = read_image(&d[0], "plain2", 16 * MIB);
    assert_eq!(&image[..4096], &pattern(9, 4096)[..], "the peer's writes landed in plain2");
    assert!(image[4096..].iter().all(|&b| b == 0), "plain2 changed");
    let after = d[0].json(&["volume", "show", "plain2"]);
    for field in ["size", "read_only", "encryption", "id"] {
        assert_eq!(after[field], before[field], "plain2's {field} changed");
    }
}

/// Block 0 holds 1 (acknowledged); host 0, the primary, is cut from host 1, and a write of 2
/// reaches host 2 only before host 0 is cut from host 2 too: the client gets an error. Host 1
/// is promoted (no force), then killed and host 2 promoted (no force): after each promotion the
/// in-sync copies read alike, and block 0 never reads 2.
#[test]
fn in_sync_copies_never_differ_after_a_failover() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, mut d)) = cluster(3, root.path(), "") else { return };
    let (e0, e1, e2) = (sw.endpoint(0), sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "v", "16M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    d[0].ok(&["export", "nbd", "v"]);
    let mut s0 = connect(&d[0].nbd(), "v");
    assert_eq!(fua_write(&mut s0, 0, &pattern(1, 4096)), 0);
    assert_eq!(fua_write(&mut s0, 65536, &pattern(7, 4096)), 0);

    sw.part(0, 1, true);
    let failed = std::thread::spawn(move || fua_write(&mut s0, 0, &pattern(2, 4096)));
    std::thread::sleep(Duration::from_millis(300));
    sw.part(0, 2, true);
    assert_ne!(failed.join().unwrap(), 0, "the write was acknowledged without a majority");
    // Without a majority for longer than the ejection timeout, the old primary serves no reads
    // either: the majority may move on without it.
    std::thread::sleep(Duration::from_millis(1500));
    assert_ne!(read(&mut connect(&d[0].nbd(), "v"), 0, 4096), 0, "an isolated primary served a read");

    let same = |a: &Daemon, b: &Daemon| read_image(a, "v", 16 * MIB) == read_image(b, "v", 16 * MIB);
    let p = d[1].json(&["replica", "promote", "v"]);
    assert_eq!(p["role"], "primary", "{p}");
    until("host 2 is reconciled with host 1", 60, || state_of(&d[1], "v", &e2) == "in-sync");
    let image = read_image(&d[1], "v", 16 * MIB);
    assert_eq!(&image[..4096], &pattern(1, 4096)[..], "the failed write reads back on the new primary");
    assert_eq!(&image[65536..65536 + 4096], &pattern(7, 4096)[..], "an acknowledged write was lost");
    assert!(same(&d[1], &d[2]), "in-sync copies differ after the first promotion");

    // The cuts heal: the old primary steps down and is brought to the new primary's content.
    sw.part(0, 1, false);
    sw.part(0, 2, false);
    until("the old primary is reconciled", 60, || state_of(&d[1], "v", &e0) == "in-sync");
    assert!(same(&d[1], &d[0]), "the old primary differs once in sync");

    d[1].crash();
    let p = d[2].json(&["replica", "promote", "v"]);
    assert_eq!(p["role"], "primary", "{p}");
    let image = read_image(&d[2], "v", 16 * MIB);
    assert_eq!(&image[..4096], &pattern(1, 4096)[..], "the failed write reappeared after the second failover");
    until("host 0 is reconciled with host 2", 60, || state_of(&d[2], "v", &e0) == "in-sync");
    assert!(same(&d[2], &d[0]), "in-sync copies differ after the second promotion");
    let g = p["generation"].as_u64().unwrap();
    assert!(g > 4, "generation {g}");
}

/// A member that stores what it is sent, or, once told to lie, answers every Record and Get
/// with one membership of its choosing.
#[derive(Debug, Clone, Default)]
struct Liar {
    lie: std::sync::Arc<std::sync::Mutex<Option<ferrite_proto::ferrite::v1::Membership>>>,
    held: std::sync::Arc<std::sync::Mutex<ferrite_proto::ferrite::v1::Membership>>,
}

#[tonic::async_trait]
impl ferrite_proto::ferrite::v1::mirror_server::Mirror for Liar {
    async fn record(
        &self,
        req: tonic::Request<ferrite_proto::ferrite::v1::Membership>,
    ) -> Result<tonic::Response<ferrite_proto::ferrite::v1::RecordReply>, tonic::Status> {
        let reply = match self.lie.lock().unwrap().clone() {
            Some(lie) => ferrite_proto::ferrite::v1::RecordReply { stored: false, held: Some(lie) },
            None => {
                *self.held.lock().unwrap() = req.get_ref().clone();
                ferrite_proto::ferrite::v1::RecordReply { stored: true, held: Some(req.into_inner()) }
            }
        };
        Ok(tonic::Response::new(reply))
    }
    async fn get(
        &self,
        _: tonic::Request<ferrite_proto::ferrite::v1::MembershipRequest>,
    ) -> Result<tonic::Response<ferrite_proto::ferrite::v1::Membership>, tonic::Status> {
        let lie = self.lie.lock().unwrap().clone();
        Ok(tonic::Response::new(lie.unwrap_or_else(|| self.held.lock().unwrap().clone())))
    }
    async fn rebuild(
        &self,
        _: tonic::Request<tonic::Streaming<ferrite_proto::ferrite::v1::RebuildMessage>>,
    ) -> Result<tonic::Response<ferrite_proto::ferrite::v1::RebuildReply>, tonic::Status> {
        Err(tonic::Status::unavailable("a liar rebuilds nothing"))
    }
}

/// A TLS connection the liar's gRPC server takes.
struct Conn(ferrite_tls::tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for Conn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Conn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl Liar {
    /// Serves the Mirror service on `ip` with the certificate `name` of `pki` (a replication
    /// peer of the primary's); returns it and its endpoint.
    async fn start(pki: &std::path::Path, name: &str, ip: &str) -> (Self, String) {
        let p = |f: &str| pki.join(f);
        let cfg = ferrite_tls::server_config(
            &p(&format!("{name}.pem")),
            &p(&format!("{name}-key.pem")),
            Some(&p("ca.pem")),
            &[b"h2"],
        )
        .unwrap();
        let acceptor = ferrite_tls::TlsAcceptor::from(cfg);
        let listener = tokio::net::TcpListener::bind(format!("{ip}:0")).await.unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Conn>>(4);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    if let Ok(tls) = acceptor.accept(tcp).await {
                        let _ = tx.send(Ok(Conn(tls))).await;
                    }
                });
            }
        });
        let liar = Self::default();
        let svc = ferrite_proto::ferrite::v1::mirror_server::MirrorServer::new(liar.clone());
        let incoming = tokio_stream::wrappers::ReceiverStream::new(rx);
        tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming));
        (liar, endpoint)
    }

    /// Lies with `m` from now on; None: honest again.
    fn says(&self, m: Option<ferrite_proto::ferrite::v1::Membership>) {
        *self.lie.lock().unwrap() = m;
    }
}

/// A member that lies — its answers name another volume, or a later generation of the volume
/// with itself as primary and another member list — changes nothing on the primary: nothing it
/// says is stored, the primary never steps down on its word (as a joining peer, nor as a member
/// the primary asks again after a restart), and the other volume keeps taking writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_member_changes_nothing_on_the_primary() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("p");
    let (mut d, admin, _) = common::csi::tcp_node(&dir, "127.0.0.2");
    let pki = root.path().join("pki");
    common::csi::certs(&pki, "node-127-0-0-3", &["127.0.0.3"]);
    let (liar, at) = Liar::start(&pki, "node-127-0-0-3", "127.0.0.3").await;
    let me = format!("tcp://{admin}");
    for v in ["v", "w", "plain3"] {
        d.ok(&["volume", "create", v, "16M"]);
        d.ok(&["export", "nbd", v]);
    }
    let write = |d: &Daemon, volume: &'static str, seed: u64| {
        let nbd = d.nbd();
        tokio::task::spawn_blocking(move || fua_write(&mut connect(&nbd, volume), 0, &pattern(seed, 4096)))
    };
    let add = |d: &Daemon, volume: &str, how: &str| {
        let (sock, args) = (d.admin(), ["replica", "add", volume, &at, how].map(str::to_owned));
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(common::BIN).arg("--admin-socket").arg(sock).args(args).output().unwrap()
        })
    };
    let primary_here = |d: &Daemon, volume: &str, why: &str| {
        let s = d.json(&["replica", "status", volume]);
        assert_eq!((s["role"].as_str(), s["primary"].as_str()), (Some("primary"), Some(me.as_str())), "{why}: {s}");
        assert!(s["generation"].as_u64().unwrap() < 100, "{why}: {s}");
        assert_eq!(d.json(&["volume", "show", volume])["read_only"], false, "{why}");
        s
    };
    assert_eq!(write(&d, "v", 1).await.unwrap(), 0);
    // As a joining peer.
    let lies = [
        membership("plain3", 100, &at, &[(&at, "in-sync"), (&me, "in-sync")]),
        membership("v", 100, &at, &[(&at, "in-sync")]),
        membership("v", 1 << 39, &at, &[(&at, "in-sync"), (&me, "ejected")]),
    ];
    for lie in lies {
        liar.says(Some(lie.clone()));
        assert!(!add(&d, "v", "--sync").await.unwrap().status.success(), "{lie:?} was taken");
        assert_eq!(primary_here(&d, "v", &format!("{lie:?}"))["refused"], "", "{lie:?}");
    }
    assert_eq!(write(&d, "v", 2).await.unwrap(), 0);

    // As a member (a witness of w) the primary asks again after a restart: a later generation
    // naming itself, and no vote. The primary refuses writes without a majority, but stays the
    // primary, and takes writes again once the member answers truly.
    liar.says(None);
    let o = add(&d, "w", "--witness").await.unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    liar.says(Some(membership("w", 1 << 39, &at, &[(&at, "in-sync"), (&me, "ejected")])));
    assert!(d.stop().success(), "{}", d.log());
    let d = Daemon::start(&dir);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_ne!(primary_here(&d, "w", "a lying witness")["refused"], "", "no majority, no writes");
    liar.says(None);
    until("the primary takes writes again", 20, || d.json(&["replica", "status", "w"])["refused"] == "");
    primary_here(&d, "w", "an honest witness again");
    assert_eq!(write(&d, "w", 4).await.unwrap(), 0);
    // plain3 was never made a replica, and takes writes.
    assert_eq!(write(&d, "plain3", 3).await.unwrap(), 0);
    assert!(!d.cli(&["replica", "status", "plain3"]).status.success());
    assert_eq!(d.json(&["volume", "show", "plain3"])["read_only"], false);
}
