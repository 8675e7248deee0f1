//! The wire of synchronous replicas, measured: a primary's 4 KiB writes to a member and the
//! member's acks, over mutual TLS on loopback, (a) as one gRPC bidi stream (tonic, HTTP/2: what
//! `Mirror/Stream` is) and (b) as the daemon's framed wire (`ferrite_daemon::sync::wire`:
//! length-prefixed protobuf frames on a TLS stream of our own, its connect, its frame reader, its
//! ack writer that sends every ready ack in one write). The same messages (`MirrorMessage`,
//! `MirrorAck`), the same certificates, a runtime of two workers on each side as in two daemons.
//! No storage: only what the wire costs.
//!
//! "qd1": the round trip of one write at a time. "qd32": 32 writes in flight, time per write.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use ferrite_daemon::base::config::TlsFiles;
use ferrite_daemon::sync::ack_sink::AckSink;
use ferrite_daemon::sync::wire::{self, Frames};
use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::mirror_server::{Mirror, MirrorServer};
use ferrite_proto::ferrite::v1::{MirrorAck, MirrorMessage, MirrorWrite};
use ferrite_tls::TlsAcceptor;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

const QD: u64 = 32;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime")
}

/// A CA, the member's server certificate and the primary's client certificate, on disk.
struct Pki {
    _dir: tempfile::TempDir,
    server: Arc<rustls::ServerConfig>,
    grpc_client: Arc<rustls::ClientConfig>,
    /// The primary's files, as a daemon's configuration names them (the framed wire's connect).
    primary: TlsFiles,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca = ferrite_tls::certs::new_ca(1).expect("a CA");
    let write = |name: &str, pem: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).expect("written");
        p
    };
    let ca_pem = write("ca.pem", &ca.cert_pem);
    let mut files = Vec::new();
    for name in ["member", "primary"] {
        let c = ferrite_tls::certs::issue(&ca.key_pem, name, &["127.0.0.1".into()], 1).expect("issued");
        files.push((write(&format!("{name}.pem"), &c.cert_pem), write(&format!("{name}-key.pem"), &c.key_pem)));
    }
    let (m, p) = (&files[0], &files[1]);
    let server = ferrite_tls::server_config(&m.0, &m.1, Some(&ca_pem), &[b"h2", wire::ALPN]).expect("config");
    let grpc_client = ferrite_tls::client_config(&ca_pem, Some((&p.0, &p.1)), &[b"h2"]).expect("config");
    let primary = TlsFiles { cert: p.0.clone(), key: p.1.clone(), client_ca: Some(ca_pem), peer_name: None };
    Pki { server, grpc_client, primary, _dir: dir }
}

fn write_message(seq: u64) -> MirrorMessage {
    let data = prost::bytes::Bytes::from(vec![0xa5u8; 4096]);
    let crc = crc32c::crc32c(&data);
    MirrorMessage { seq, op: Some(Op::Write(MirrorWrite { offset: seq * 4096, data, fua: false, crc })) }
}

fn ack_of(msg: &MirrorMessage) -> MirrorAck {
    let ok = matches!(&msg.op, Some(Op::Write(w)) if crc32c::crc32c(&w.data) == w.crc);
    MirrorAck { seq: msg.seq, error: if ok { String::new() } else { "damaged".into() }, through: 0 }
}

// --- (a) gRPC --------------------------------------------------------------------------------

/// A TLS connection as tonic's server takes it.
struct Conn(tokio_rustls::server::TlsStream<TcpStream>);

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

struct Echo;

#[tonic::async_trait]
impl Mirror for Echo {
    async fn stream(&self, req: Request<Streaming<MirrorMessage>>) -> Result<Response<AckStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if tx.send(Ok(ack_of(&m))).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

type AckStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<MirrorAck, Status>> + Send>>;

async fn grpc_member(pki: &Pki) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bound");
    let addr = listener.local_addr().expect("an address");
    let acceptor = TlsAcceptor::from(Arc::clone(&pki.server));
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tcp.set_nodelay(true).expect("nodelay");
            let tls = acceptor.accept(tcp).await.expect("handshake");
            let _ = tx.send(Ok::<_, std::io::Error>(Conn(tls))).await;
        }
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(MirrorServer::new(Echo))
            .serve_with_incoming(tokio_stream::wrappers::ReceiverStream::new(rx)),
    );
    addr
}

/// The primary's end of a gRPC stream: sends go in, acks come out.
struct GrpcLink {
    tx: mpsc::UnboundedSender<MirrorMessage>,
    acks: Streaming<MirrorAck>,
}

impl GrpcLink {
    async fn open(pki: &Pki, addr: SocketAddr) -> Self {
        let channel = ferrite_proto::connect_as(&format!("tcp://{addr}"), Some(Arc::clone(&pki.grpc_client)), None)
            .await
            .expect("connected");
        let (tx, rx) = mpsc::unbounded_channel();
        let acks = ferrite_proto::ferrite::v1::mirror_client::MirrorClient::new(channel)
            .stream(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .expect("a stream")
            .into_inner();
        Self { tx, acks }
    }

    async fn run(&mut self, writes: u64, qd: u64) -> Duration {
        let t = Instant::now();
        let mut sent = 0;
        for _ in 0..qd.min(writes) {
            self.tx.send(write_message(sent)).expect("open");
            sent += 1;
        }
        for _ in 0..writes {
            let ack = self.acks.message().await.expect("an ack").expect("open");
            assert!(ack.error.is_empty());
            if sent < writes {
                self.tx.send(write_message(sent)).expect("open");
                sent += 1;
            }
        }
        t.elapsed()
    }
}

// --- (b) the daemon's framed wire -----------------------------------------------------------

async fn framed_member(pki: &Pki) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bound");
    let addr = listener.local_addr().expect("an address");
    let acceptor = TlsAcceptor::from(Arc::clone(&pki.server));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tcp.set_nodelay(true).expect("nodelay");
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let tls = acceptor.accept(tcp).await.expect("handshake");
                let (r, w) = tokio::io::split(tls);
                // As a member serves it: frames in and acks out on this task.
                let acks = AckSink::framed(w);
                let mut frames = Frames::<_, MirrorMessage>::new(r, None);
                while let Ok(Some(m)) = frames.next().await {
                    if !acks.send(ack_of(&m)).await || (!frames.has_frame() && !acks.flush()) {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// The primary's end of a framed connection.
struct FramedLink {
    acks: Frames<ReadHalf<wire::Connection>, MirrorAck>,
    w: WriteHalf<wire::Connection>,
    buf: Vec<u8>,
}

impl FramedLink {
    async fn open(pki: &Pki, addr: SocketAddr) -> Self {
        let conn = wire::connect(Some(&pki.primary), &format!("tcp://{addr}")).await.expect("connected");
        let (r, w) = tokio::io::split(conn);
        Self { acks: Frames::new(r, None), w, buf: Vec::new() }
    }

    /// Sends what was put since the last send, in one write (as the primary's sender does).
    async fn send(&mut self) {
        self.w.write_all(&self.buf).await.expect("written");
        self.w.flush().await.expect("flushed");
        self.buf.clear();
    }

    async fn run(&mut self, writes: u64, qd: u64) -> Duration {
        let t = Instant::now();
        let mut sent = 0;
        for _ in 0..qd.min(writes) {
            wire::put(&mut self.buf, &write_message(sent));
            sent += 1;
        }
        self.send().await;
        for _ in 0..writes {
            let ack = self.acks.next().await.expect("an ack").expect("open");
            assert!(ack.error.is_empty());
            if sent < writes {
                wire::put(&mut self.buf, &write_message(sent));
                self.send().await;
                sent += 1;
            }
        }
        t.elapsed()
    }
}

fn wire(c: &mut Criterion) {
    let member = runtime();
    let primary = runtime();
    let pki = pki();
    let grpc = member.block_on(grpc_member(&pki));
    let framed = member.block_on(framed_member(&pki));
    let mut g = primary.block_on(GrpcLink::open(&pki, grpc));
    let mut f = primary.block_on(FramedLink::open(&pki, framed));
    let mut group = c.benchmark_group("mirror_wire");
    for (name, qd) in [("qd1", 1), ("qd32", QD)] {
        group.bench_function(format!("grpc-{name}"), |b| {
            b.iter_custom(|iters| primary.block_on(g.run(iters, qd)));
        });
        group.bench_function(format!("framed-{name}"), |b| {
            b.iter_custom(|iters| primary.block_on(f.run(iters, qd)));
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(4));
    targets = wire
}
criterion_main!(benches);
