//! Listeners: Unix sockets and TCP, one task per connection.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::export::Exports;
use crate::handshake::negotiate;
use crate::transmission::{Socket, serve};

/// Counters a metrics endpoint reads.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_total: AtomicU64,
    pub connections_open: AtomicU64,
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
}

impl Server {
    pub fn new(exports: Arc<Exports>) -> Self {
        Self { exports, stats: Arc::default(), admission: None }
    }

    /// Serves one accepted connection to its end; errors are logged, never propagated, so one
    /// bad client cannot affect another.
    pub async fn connection<S>(&self, stream: S, peer: String)
    where
        S: IntoBlocking,
    {
        self.stats.connections_total.fetch_add(1, Ordering::Relaxed);
        self.stats.connections_open.fetch_add(1, Ordering::Relaxed);
        let r = run(stream, &self.exports).await;
        self.stats.connections_open.fetch_sub(1, Ordering::Relaxed);
        match r {
            Ok(()) => tracing::debug!(%peer, "NBD connection closed"),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => tracing::debug!(%peer, "NBD client went away"),
            Err(e) => tracing::info!(%peer, error = %e, "NBD connection ended with an error"),
        }
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
        loop {
            let (stream, _) = listener.accept().await?;
            let me = Arc::clone(&self);
            tokio::spawn(async move { me.connection(stream, "unix".into()).await });
        }
    }

    /// Accepts on a bound TCP listener until the task is dropped.
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        loop {
            let (stream, peer) = listener.accept().await?;
            let admitted = match &self.admission {
                Some(a) => match a.admit(peer, &stream) {
                    Some(registration) => Some(registration),
                    None => continue, // refused: dropping the stream closes it
                },
                None => None,
            };
            let _ = stream.set_nodelay(true);
            let me = Arc::clone(&self);
            tokio::spawn(async move {
                me.connection(stream, peer.to_string()).await;
                drop(admitted);
            });
        }
    }
}

/// A socket negotiated on the reactor and then served by blocking threads.
pub trait IntoBlocking: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Blocking: Socket + 'static;
    fn into_blocking(self) -> io::Result<Self::Blocking>;
}

impl IntoBlocking for UnixStream {
    type Blocking = std::os::unix::net::UnixStream;
    fn into_blocking(self) -> io::Result<Self::Blocking> {
        let s = self.into_std()?;
        s.set_nonblocking(false)?;
        Ok(s)
    }
}

impl IntoBlocking for TcpStream {
    type Blocking = std::net::TcpStream;
    fn into_blocking(self) -> io::Result<Self::Blocking> {
        let s = self.into_std()?;
        s.set_nonblocking(false)?;
        Ok(s)
    }
}

async fn run<S: IntoBlocking>(mut stream: S, exports: &Exports) -> io::Result<()> {
    let Some(session) = negotiate(&mut stream, exports).await? else { return Ok(()) };
    tracing::debug!(export = %session.export.name, structured = session.structured, "NBD transmission starts");
    let sock = stream.into_blocking()?;
    tokio::task::spawn_blocking(move || serve(&sock, &session)).await.map_err(io::Error::other)?
}
