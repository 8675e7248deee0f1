//! The daemon's own TCP listeners (the admin API, the metrics endpoint). Every client passes the
//! fence list, takes one of the listener's `max-connections` slots (past them it is closed on
//! arrival), and, where the listener has TLS, completes its TLS handshake (a client certificate
//! too, under mutual TLS) within the handshake timeout. Behind a [`Gate`] (the admin listener),
//! a certificate whose identity holds no role is closed right after its handshake, each
//! identity holds at most its share of the slots, so one identity cannot keep the others out,
//! and a client from a fenced address passes only as a controller or an operator: a fence of a
//! lost node never locks out the controller that runs there (or shares its address). A
//! failed accept (EMFILE, ...) is logged and retried with backoff: a listener never ends because
//! of load.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use ferrite_tls::{ServerTls, Stream};
use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::authz::{PeerInfo, Role};
use crate::base::config::Limits;
use crate::records::fence::{Admission, Fences};

/// What a connection reads from its socket at once (a TLS session asks for 4 KiB at a time).
const READ_BUFFER: usize = 32 << 10;

/// Counters of one listener.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Closed on arrival: the listener was at its connection limit.
    pub refused: AtomicU64,
    /// Failed or timed-out TLS handshakes.
    pub handshake_failures: AtomicU64,
    /// Closed after the handshake: the certificate's identity holds no role for the listener
    /// ([`Gate`]).
    pub no_role: AtomicU64,
    /// Closed after the handshake: the identity held its share of the slots ([`Gate`]).
    pub identity_full: AtomicU64,
}

/// Who may hold a connection of a listener with client certificates: identities with a role
/// (one of `roles`, where given), each at most `per_identity` connections at a time.
#[derive(Debug)]
pub struct Gate {
    policy: Arc<crate::authz::Policy>,
    roles: Option<&'static [Role]>,
    per_identity: usize,
    /// Slots by identity label (configured identities only: bounded).
    held: std::sync::Mutex<std::collections::HashMap<String, Arc<Semaphore>>>,
}

impl Gate {
    pub fn new(policy: Arc<crate::authz::Policy>, roles: Option<&'static [Role]>, max_connections: usize) -> Self {
        Self { policy, roles, per_identity: max_connections.div_ceil(2), held: Default::default() }
    }

    /// Whether the holder of `names` passes a fence of its address: a controller or an operator.
    fn passes_fences(&self, names: &[String]) -> bool {
        self.policy.caller(names).acts_as(Role::Controller)
    }

    /// A slot for the holder of `names`, or why it is closed.
    fn admit(&self, names: &[String], stats: &ListenerStats) -> Result<OwnedSemaphorePermit, String> {
        let caller = self.policy.caller(names);
        let fits = self.roles.is_none_or(|need| need.iter().any(|r| caller.roles.contains(r)));
        if caller.roles.is_empty() || !fits {
            stats.no_role.fetch_add(1, Ordering::Relaxed);
            return Err(format!("{caller} holds no role for this listener"));
        }
        let slots = Arc::clone(
            self.held
                .lock()
                .expect("not poisoned")
                .entry(caller.label.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.per_identity))),
        );
        slots.try_acquire_owned().map_err(|_| {
            stats.identity_full.fetch_add(1, Ordering::Relaxed);
            format!("{caller} holds {} connections already", self.per_identity)
        })
    }
}

/// An admitted connection, holding its fence registration and its connection slot.
#[derive(Debug)]
pub struct Guarded {
    /// Read through a buffer: a TLS session asks the socket for 4 KiB at a time.
    stream: Stream<BufReader<TcpStream>>,
    info: PeerInfo,
    _admission: Admission,
    _slot: OwnedSemaphorePermit,
    _identity: Option<OwnedSemaphorePermit>,
}

impl Guarded {
    pub fn peer(&self) -> SocketAddr {
        self.info.remote
    }

    pub fn info(&self) -> &PeerInfo {
        &self.info
    }

    /// The application protocol its TLS handshake chose (ALPN).
    pub fn alpn(&self) -> Option<&[u8]> {
        self.stream.alpn()
    }
}

/// Accepts on `listener` for ever; admitted (and, with `tls`, handshaken) connections come out
/// of the returned channel.
pub fn accept(
    listener: TcpListener,
    name: &'static str,
    fences: Arc<Fences>,
    limits: &Limits,
    tls: Option<Arc<ServerTls>>,
    gate: Option<Arc<Gate>>,
    stats: Arc<ListenerStats>,
) -> mpsc::Receiver<Guarded> {
    let (tx, rx) = mpsc::channel(16);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let handshake_timeout = limits.handshake_timeout;
    tokio::spawn(async move {
        let mut backoff = Duration::ZERO;
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                    tracing::warn!(listener = name, error = %e, retry_in = ?backoff, "accept failed");
                    tokio::time::sleep(backoff).await;
                    continue;
                }
            };
            backoff = Duration::ZERO;
            // Behind a gate, with TLS, a fenced client is judged once its certificate is known.
            let deferred = gate.is_some() && tls.is_some() && fences.is_fenced(peer.ip());
            let admitted =
                if deferred { fences.register(peer, &stream, name) } else { fences.admit(peer, &stream, name) };
            let Some(admission) = admitted else { continue };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(listener = name, %peer, "client refused: connection limit");
                continue;
            };
            let _ = stream.set_nodelay(true);
            let (tx, tls, gate, stats) = (tx.clone(), tls.clone(), gate.clone(), Arc::clone(&stats));
            tokio::spawn(async move {
                let mut stream = Stream::Plain(BufReader::with_capacity(READ_BUFFER, stream));
                if let Some(acceptor) = &tls {
                    match tokio::time::timeout(handshake_timeout, stream.start_tls(acceptor)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            stats.handshake_failures.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(listener = name, %peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            stats.handshake_failures.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(listener = name, %peer, "client cut: no TLS handshake within the timeout");
                            return;
                        }
                    }
                }
                let names = stream.peer_certificate().map(ferrite_tls::identities).unwrap_or_default();
                if deferred && !gate.as_ref().is_some_and(|g| g.passes_fences(&names)) {
                    tracing::warn!(listener = name, %peer, "connection refused: the address is fenced");
                    return;
                }
                let identity = match gate.filter(|_| tls.is_some()).map(|g| g.admit(&names, &stats)) {
                    None => None,
                    Some(Ok(permit)) => Some(permit),
                    Some(Err(why)) => {
                        tracing::info!(listener = name, %peer, why, "client closed after its handshake");
                        return;
                    }
                };
                let info = PeerInfo { remote: peer, names };
                let _ =
                    tx.send(Guarded { stream, info, _admission: admission, _slot: slot, _identity: identity }).await;
            });
        }
    });
    rx
}

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for Guarded {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
