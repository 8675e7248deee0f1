//! The wire of synchronous replicas, measured: a primary's 4 KiB writes to a member and the
//! member's acks, over mutual TLS on loopback, (a) as one gRPC bidi stream (tonic, HTTP/2: what
//! `Mirror/Stream` is) and (b) as length-prefixed protobuf frames on a TLS stream of our own, the
//! member reading and answering on one task and writing its acks in a batch when no more input is
//! waiting. The same messages (`MirrorMessage`, `MirrorAck`), the same certificates, a runtime of
//! two workers on each side as in two daemons. No storage: only what the wire costs.
//!
//! "qd1": the round trip of one write at a time. "qd32": 32 writes in flight, time per write.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::mirror_server::{Mirror, MirrorServer};
use ferrite_proto::ferrite::v1::{MirrorAck, MirrorMessage, MirrorWrite};
use ferrite_tls::{TlsAcceptor, TlsConnector};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter, ReadBuf};
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
    framed_client: Arc<rustls::ClientConfig>,
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
    let server = ferrite_tls::server_config(&m.0, &m.1, Some(&ca_pem), &[b"h2", b"ferrite-mirror"]).expect("config");
    let client = |alpn: &[u8]| ferrite_tls::client_config(&ca_pem, Some((&p.0, &p.1)), &[alpn]).expect("config");
    Pki { server, grpc_client: client(b"h2"), framed_client: client(b"ferrite-mirror"), _dir: dir }
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

// --- (b) framed TLS --------------------------------------------------------------------------

async fn read_frame<R: AsyncRead + Unpin, M: Message + Default>(r: &mut R) -> Option<M> {
    let len = r.read_u32().await.ok()?;
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf).await.ok()?;
    M::decode(buf.as_slice()).ok()
}

async fn write_frame<W: AsyncWrite + Unpin, M: Message>(w: &mut W, m: &M) {
    let body = m.encode_to_vec();
    w.write_u32(u32::try_from(body.len()).expect("small")).await.expect("written");
    w.write_all(&body).await.expect("written");
}

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
                let (mut r, mut w) = (BufReader::with_capacity(256 << 10, r), BufWriter::new(w));
                while let Some(m) = read_frame::<_, MirrorMessage>(&mut r).await {
                    write_frame(&mut w, &ack_of(&m)).await;
                    // Acks go out together once no further request is waiting here.
                    if r.buffer().is_empty() {
                        w.flush().await.expect("flushed");
                    }
                }
            });
        }
    });
    addr
}

struct FramedLink {
    r: BufReader<tokio::io::ReadHalf<tokio_rustls::client::TlsStream<TcpStream>>>,
    w: BufWriter<tokio::io::WriteHalf<tokio_rustls::client::TlsStream<TcpStream>>>,
}

impl FramedLink {
    async fn open(pki: &Pki, addr: SocketAddr) -> Self {
        let tcp = TcpStream::connect(addr).await.expect("connected");
        tcp.set_nodelay(true).expect("nodelay");
        let name = ferrite_tls::server_name("127.0.0.1").expect("a name");
        let tls = TlsConnector::from(Arc::clone(&pki.framed_client)).connect(name, tcp).await.expect("handshake");
        let (r, w) = tokio::io::split(tls);
        Self { r: BufReader::new(r), w: BufWriter::new(w) }
    }

    async fn run(&mut self, writes: u64, qd: u64) -> Duration {
        let t = Instant::now();
        let mut sent = 0;
        for _ in 0..qd.min(writes) {
            write_frame(&mut self.w, &write_message(sent)).await;
            sent += 1;
        }
        self.w.flush().await.expect("flushed");
        for _ in 0..writes {
            let ack: MirrorAck = read_frame(&mut self.r).await.expect("an ack");
            assert!(ack.error.is_empty());
            if sent < writes {
                write_frame(&mut self.w, &write_message(sent)).await;
                self.w.flush().await.expect("flushed");
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
