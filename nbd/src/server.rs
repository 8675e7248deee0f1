//! Listeners: Unix sockets and TCP. Each connection negotiates on the runtime (bounded by the
//! handshake timeout), then is served by a thread of its own, outside the runtime's blocking
//! pool, so NBD clients never take threads the admin API needs. A listener never ends because
//! of load: failed accepts (EMFILE, ENOMEM, ...) are logged and retried with backoff, and past
//! `max_connections` new clients are closed as they arrive.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::event_loop;
use crate::export::Exports;
use crate::handshake::{Client, Session, negotiate};
use crate::limits::Limits;
use crate::socket::Socket;
use crate::tls::{Stream, Tls, TlsSocket};

/// Counters a metrics endpoint reads.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_total: AtomicU64,
    pub connections_open: AtomicU64,
    /// Clients closed on arrival because their listener was at its connection limit.
    pub connections_refused: AtomicU64,
    /// Clients cut because they did not finish the handshake in time.
    pub handshake_timeouts: AtomicU64,
    /// Failed accept() calls (retried).
    pub accept_errors: AtomicU64,
}

/// Decides whether a TCP client may connect (network fencing). What it returns is kept for as
/// long as the connection lives (a registration, say).
pub trait Admission: Send + Sync + std::fmt::Debug {
    fn admit(&self, peer: SocketAddr, stream: &TcpStream) -> Option<Box<dyn Send + Sync>>;
}

/// An NBD server over a set of exports.
#[derive(Debug, Default)]
pub struct Server {
    pub exports: Arc<Exports>,
    pub stats: Arc<ServerStats>,
    /// Asked about every TCP client; None admits everyone.
    pub admission: Option<Arc<dyn Admission>>,
    pub limits: Limits,
    /// TLS on TCP listeners (Unix sockets are local and always plaintext).
    pub tls: Tls,
}

/// A listening socket of either kind; a client's address is None on a Unix socket.
trait Listener: Send + Sync + 'static {
    type Stream: IntoBlocking;
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, Option<SocketAddr>)>> + Send;
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    async fn accept(&self) -> io::Result<(UnixStream, Option<SocketAddr>)> {
        Ok((UnixListener::accept(self).await?.0, None))
    }
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    async fn accept(&self) -> io::Result<(TcpStream, Option<SocketAddr>)> {
        let (s, peer) = TcpListener::accept(self).await?;
        Ok((s, Some(peer)))
    }
}

impl Server {
    pub fn new(exports: Arc<Exports>) -> Self {
        Self { exports, ..Self::default() }
    }

    /// Serves one accepted connection to its end; errors are logged, never propagated, so one
    /// bad client cannot affect another.
    pub async fn connection<S: IntoBlocking>(self: Arc<Self>, stream: S, addr: Option<SocketAddr>) {
        self.stats.connections_total.fetch_add(1, Ordering::Relaxed);
        self.stats.connections_open.fetch_add(1, Ordering::Relaxed);
        let peer = addr.map_or_else(|| "unix".to_string(), |a| a.to_string());
        let r = Arc::clone(&self).run(stream, addr).await;
        self.stats.connections_open.fetch_sub(1, Ordering::Relaxed);
        match r {
            Ok(()) => tracing::debug!(%peer, "NBD connection closed"),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => tracing::debug!(%peer, "NBD client went away"),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                self.stats.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%peer, "NBD client cut: no handshake within the timeout");
            }
            Err(e) => tracing::info!(%peer, error = %e, "NBD connection ended with an error"),
        }
    }

    async fn run<S: IntoBlocking>(self: Arc<Self>, stream: S, addr: Option<SocketAddr>) -> io::Result<()> {
        let plain = Tls::default();
        let client = Client { ip: addr.map(|a| a.ip()), tls: if addr.is_some() { &self.tls } else { &plain } };
        let mut stream = Stream::Plain(stream);
        // The whole handshake (the TLS one included) has one deadline.
        let negotiated =
            tokio::time::timeout(self.limits.handshake_timeout, negotiate(&mut stream, &self.exports, client));
        let session = match negotiated.await {
            Ok(r) => r?,
            Err(_) => return Err(io::ErrorKind::TimedOut.into()),
        };
        let Some(session) = session else { return Ok(()) };
        tracing::debug!(export = %session.export.name, structured = session.structured, tls = stream.is_tls(),
            "NBD transmission starts");
        let send_timeout = self.limits.send_timeout;
        match stream {
            Stream::Plain(s) => self.transmit(s.into_blocking(send_timeout)?, session).await,
            Stream::Tls(t) => {
                let (s, tls) = (*t).into_inner();
                self.transmit(TlsSocket::new(s.into_blocking(send_timeout)?, tls), session).await
            }
            Stream::Broken => Err(io::Error::new(io::ErrorKind::NotConnected, "the TLS handshake failed")),
        }
    }

    /// Serves transmission on a thread of its own, registered with its export (to be cut).
    async fn transmit<B: Socket + 'static>(self: Arc<Self>, sock: B, session: Session) -> io::Result<()> {
        let Some(registration) = session.export.register(sock.as_fd())? else {
            return Err(io::Error::new(io::ErrorKind::NotFound, "the export was stopped during the handshake"));
        };
        let (done, finished) = tokio::sync::oneshot::channel();
        let me = Arc::clone(&self);
        std::thread::Builder::new().name("nbd-conn".into()).spawn(move || {
            let r = event_loop::serve(&sock, &session, &me.limits, true);
            drop(registration);
            let _ = done.send(r);
        })?;
        finished.await.map_err(|_| io::Error::other("the NBD connection thread panicked"))?
    }

    /// Accepts on a Unix socket (replacing a stale socket file) until the task is dropped.
    pub async fn serve_unix(self: Arc<Self>, path: &Path) -> io::Result<()> {
        if path.exists() {
            std::fs::remove_file(path)?;
        }
        self.serve_unix_listener(UnixListener::bind(path)?).await
    }

    /// Accepts on a bound Unix listener until the task is dropped.
    pub async fn serve_unix_listener(self: Arc<Self>, listener: UnixListener) -> io::Result<()> {
        self.accept_loop(listener, |_| Some(None)).await
    }

    /// Accepts on a bound TCP listener until the task is dropped; fenced clients are refused.
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        let admission = self.admission.clone();
        self.accept_loop(listener, move |stream: &TcpStream| {
            let _ = stream.set_nodelay(true);
            match (&admission, stream.peer_addr()) {
                (None, _) => Some(None),
                (Some(a), Ok(peer)) => a.admit(peer, stream).map(Some),
                (Some(_), Err(_)) => None,
            }
        })
        .await
    }

    /// Accepts until the task is dropped. `admit` says whether a client may stay (and what to
    /// keep while it does).
    async fn accept_loop<L: Listener>(
        self: Arc<Self>,
        listener: L,
        admit: impl Fn(&L::Stream) -> Option<Option<Box<dyn Send + Sync>>> + Send,
    ) -> io::Result<()> {
        let slots = Arc::new(Semaphore::new(self.limits.max_connections));
        let mut backoff = Duration::ZERO;
        loop {
            let (stream, addr) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors or memory, or a connection reset before it was taken:
                    // wait a little (longer each time it repeats) and go on.
                    self.stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                    backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                    tracing::warn!(error = %e, retry_in = ?backoff, "accepting an NBD connection failed");
                    tokio::time::sleep(backoff).await;
                    continue;
                }
            };
            backoff = Duration::ZERO;
            let Some(kept) = admit(&stream) else { continue }; // refused: dropping closes it
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                self.stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = ?addr, limit = self.limits.max_connections, "NBD client refused: connection limit");
                continue;
            };
            let me = Arc::clone(&self);
            tokio::spawn(async move {
                me.connection(stream, addr).await;
                drop((kept, slot));
            });
        }
    }
}

/// A socket negotiated on the runtime and then served by a blocking thread.
pub trait IntoBlocking: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Blocking: Socket + 'static;
    /// The blocking socket; a reply that cannot be written for `send_timeout` fails.
    fn into_blocking(self, send_timeout: Duration) -> io::Result<Self::Blocking>;
}

impl IntoBlocking for UnixStream {
    type Blocking = std::os::unix::net::UnixStream;
    fn into_blocking(self, send_timeout: Duration) -> io::Result<Self::Blocking> {
        let s = self.into_std()?;
        s.set_nonblocking(false)?;
        s.set_write_timeout(Some(send_timeout))?;
        Ok(s)
    }
}

impl IntoBlocking for TcpStream {
    type Blocking = std::net::TcpStream;
    fn into_blocking(self, send_timeout: Duration) -> io::Result<Self::Blocking> {
        let s = self.into_std()?;
        s.set_nonblocking(false)?;
        s.set_write_timeout(Some(send_timeout))?;
        Ok(s)
    }
}
