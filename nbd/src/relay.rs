//! Another server's export as a kernel NBD device, over TLS. The kernel client speaks plaintext
//! only, so we negotiate with the remote listener ourselves (greeting and `NBD_OPT_STARTTLS` in
//! the clear, the TLS handshake with our certificate, then `OPT_GO` inside TLS), hand the kernel
//! one end of a socket pair and relay between the other end and the TLS connection.
//!
//! ```text
//!  /dev/nbdN ─► kernel ─► socketpair ─► relay task (tokio) ─► TLS ─► remote NBD listener
//! ```
//! The relay ends when either side closes; a detach closes the kernel's end. A lost remote (a
//! restarted daemon, a dead node: TCP_USER_TIMEOUT and keepalives notice it in seconds even
//! while requests are outstanding) ends it too: the kernel holds the device's I/O, and the
//! daemon opens a new relay and hands it over ([`kernel::reconnect`]).

use std::io::{self, Write};
use std::net::ToSocketAddrs;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use ferrite_tls::ServerName;
use ferrite_tls::TlsConnector;
use ferrite_tls::rustls::ClientConfig;
use rustix::net::sockopt;
use tokio::task::JoinHandle;

use crate::kernel;
use crate::proto::{CMD_DISC, Request};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The whole negotiation, TLS included.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// A silent peer (a dead node, a cut link) is noticed after about idle + interval × count.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_COUNT: u32 = 3;
/// Data sent and not acknowledged for this long ends the connection (a peer gone mid-request,
/// which keepalives alone would not notice: they only probe an idle connection).
const USER_TIMEOUT_MS: u32 = 15_000;
/// Bytes buffered per direction: a few requests of the kernel's usual 128 KiB.
const RELAY_BUFFER: usize = 512 << 10;

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("{what} took longer than {HANDSHAKE_TIMEOUT:?}"))
}

/// The current size of `export` at `address` (after its server grew it), from a new handshake.
pub async fn export_size(
    tls: Arc<ClientConfig>,
    name: ServerName<'static>,
    address: &str,
    export: &str,
) -> io::Result<u64> {
    let (mut s, size, _, relay) = open(tls, name, address, export).await?;
    let disc = Request { flags: 0, kind: CMD_DISC, cookie: 0, offset: 0, length: 0 }.encode();
    tokio::task::spawn_blocking(move || s.write_all(&disc)).await.map_err(io::Error::other)??;
    // The server closes the connection on the disconnect, which ends the relay.
    if tokio::time::timeout(HANDSHAKE_TIMEOUT, relay).await.is_err() {
        tracing::warn!(address, "the NBD server did not close the connection after a disconnect");
    }
    Ok(size)
}

/// Negotiates `export` over TLS with a relay in place: returns the plaintext end, in the
/// transmission phase, with the export's size and transmission flags, and the relay task.
pub async fn open(
    tls: Arc<ClientConfig>,
    name: ServerName<'static>,
    address: &str,
    export: &str,
) -> io::Result<(UnixStream, u64, u16, JoinHandle<()>)> {
    let addr = address.to_owned();
    let plain = tokio::task::spawn_blocking(move || -> io::Result<std::net::TcpStream> {
        let target = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address")))?;
        let mut s = std::net::TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)
            .map_err(|e| io::Error::new(e.kind(), format!("connecting to {addr}: {e}")))?;
        s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        s.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        kernel::greet(&mut s)?;
        kernel::start_tls(&mut s)?;
        s.set_read_timeout(None)?;
        s.set_write_timeout(None)?;
        s.set_nodelay(true)?;
        sockopt::set_socket_keepalive(&s, true)?;
        sockopt::set_tcp_keepidle(&s, KEEPALIVE_IDLE)?;
        sockopt::set_tcp_keepintvl(&s, KEEPALIVE_INTERVAL)?;
        sockopt::set_tcp_keepcnt(&s, KEEPALIVE_COUNT)?;
        sockopt::set_tcp_user_timeout(&s, USER_TIMEOUT_MS)?;
        s.set_nonblocking(true)?;
        Ok(s)
    })
    .await
    .map_err(io::Error::other)??;
    let tcp = tokio::net::TcpStream::from_std(plain)?;
    let mut secure = tokio::time::timeout(HANDSHAKE_TIMEOUT, TlsConnector::from(tls).connect(name, tcp))
        .await
        .map_err(|_| timed_out("the TLS handshake"))?
        .map_err(|e| io::Error::new(e.kind(), format!("TLS with {address}: {e}")))?;
    let (kernel_end, relay_end) = UnixStream::pair()?;
    relay_end.set_nonblocking(true)?;
    let mut relay_end = tokio::net::UnixStream::from_std(relay_end)?;
    let peer = address.to_owned();
    let relay = tokio::spawn(async move {
        match tokio::io::copy_bidirectional_with_sizes(&mut relay_end, &mut secure, RELAY_BUFFER, RELAY_BUFFER).await {
            Ok(_) => tracing::debug!(peer, "NBD relay closed"),
            Err(e) => tracing::warn!(peer, error = %e, "NBD relay lost its connection"),
        }
    });
    let export = export.to_owned();
    let (s, size, flags) = blocking_or_end(&relay, move || {
        let mut s = kernel_end;
        s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let (size, flags) = kernel::go(&mut s, &export)?;
        s.set_read_timeout(None)?;
        Ok((s, size, flags))
    })
    .await?;
    Ok((s, size, flags, relay))
}

/// Runs `f` (a step on a connection: negotiating, handing it to the kernel) on a blocking
/// thread; if it fails, `session`, the task serving the connection's other end, ends too.
pub async fn blocking_or_end<T: Send + 'static>(
    session: &JoinHandle<()>,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let done = tokio::task::spawn_blocking(f).await.map_err(io::Error::other).and_then(|r| r);
    if done.is_err() {
        session.abort();
    }
    done
}
