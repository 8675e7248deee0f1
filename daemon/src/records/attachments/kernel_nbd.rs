//! Kernel NBD devices that outlive their connection. Each device's connection is served by this
//! daemon: a socket pair whose other end this daemon's NBD server serves (a local volume), or a
//! relay over TLS to the node serving it (another node's volume). A keeper task per device
//! waits for its connection to end, and unless the device is being detached, opens a new one and
//! hands it to the kernel (`NBD_CMD_RECONFIGURE`), retrying for the hold time; meanwhile the
//! kernel holds the device's I/O (its dead-connection timeout is the same hold). A restarted
//! daemon does the same for every device its records name, so a daemon restart is a pause.
//!
//! A new connection is opened only after the old one's session has ended, and a session ends
//! only once every request it read has replied: a request the kernel re-sends on the new
//! connection never races its first copy inside this daemon.

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferrite_nbd::kernel::{self, Hold};
use ferrite_nbd::relay::blocking_or_end;
use tokio::task::JoinHandle;

use super::AttachRecord;
use crate::base::config::TlsFiles;
use crate::base::error::Error;

/// What every kernel NBD device of this daemon shares.
#[derive(Debug)]
pub struct Links {
    /// This daemon's NBD server (None: a node plugin attaching other nodes' volumes only).
    pub nbd: Option<Arc<ferrite_nbd::Server>>,
    pub tls: Option<TlsFiles>,
    /// How long a device waits for a new connection (`device-hold-s`).
    pub hold: Duration,
    /// A request unanswered this long is re-sent on the next connection (`nbd-device-timeout-s`).
    pub request_timeout: Duration,
}

/// A device just attached, the task serving its connection, and the kernel's end of it.
pub type Attached = (kernel::Attached, JoinHandle<()>, UnixStream);

/// A negotiated connection: the kernel's end, the export's size and flags, and the task that
/// serves (or relays) the other end until it closes.
type Opened = (UnixStream, u64, u16, JoinHandle<()>);

/// The backend identifier of `volume`'s device: the kernel checks it on every reconnect.
pub fn backend(volume: &str) -> String {
    format!("ferrite:{volume}")
}

impl Links {
    fn hold_for(&self, volume: &str) -> Hold {
        Hold { request_timeout: self.request_timeout, dead_connection: self.hold, backend: backend(volume) }
    }

    /// A new connection to this daemon's export `export`.
    async fn open_local(&self, export: &str) -> io::Result<Opened> {
        let Some(nbd) = &self.nbd else {
            return Err(io::Error::other(format!("{export} is a local volume, and this node holds no storage")));
        };
        let (kernel_end, ours) = UnixStream::pair()?;
        ours.set_nonblocking(true)?;
        let session = tokio::spawn(Arc::clone(nbd).connection(tokio::net::UnixStream::from_std(ours)?, None));
        let export = export.to_owned();
        let (k, size, flags) = blocking_or_end(&session, move || {
            let mut k = kernel_end;
            kernel::negotiate_blocking(&mut k, &export).map(|(size, flags)| (k, size, flags))
        })
        .await?;
        Ok((k, size, flags, session))
    }

    /// A new connection for `rec`'s device.
    async fn open(&self, rec: &AttachRecord) -> io::Result<Opened> {
        let Some(address) = &rec.remote else { return self.open_local(&rec.volume).await };
        let (cfg, name) =
            relay_tls(self.tls.as_ref(), address).map_err(|s| io::Error::other(s.message().to_owned()))?;
        ferrite_nbd::relay::open(cfg, name, address, rec.export.as_deref().unwrap_or_default()).await
    }

    /// Attaches `rec.volume` (`rec.export` of `rec.remote` for another node's volume) as the
    /// next free /dev/nbdN; returns it with the task that serves its connection.
    pub async fn attach(&self, rec: &AttachRecord) -> io::Result<Attached> {
        let (kernel_end, size, flags, session) = self.open(rec).await?;
        let hold = self.hold_for(&rec.volume);
        let (a, k) = blocking_or_end(&session, move || {
            kernel::connect(&kernel_end, size, flags, &hold).map(|a| (a, kernel_end))
        })
        .await?;
        Ok((a, session, k))
    }

    /// Hands `rec`'s live device a new connection from its remote, else from the first of its
    /// copies that serves it (a failover moved its primary there: `rec.remote` follows).
    async fn reconnect_any(&self, rec: &mut AttachRecord) -> io::Result<(JoinHandle<()>, UnixStream)> {
        let Some(current) = rec.remote.clone() else { return self.reconnect(rec).await };
        let mut errors = Vec::new();
        for address in std::iter::once(&current).chain(rec.copies.iter().filter(|c| **c != current)) {
            let mut at = rec.clone();
            at.remote = Some(address.clone());
            match self.reconnect(&at).await {
                Ok(done) => {
                    if *address != current {
                        tracing::warn!(device = %rec.device, volume = %rec.volume, from = %current, to = %address,
                            "the volume's primary moved: the device follows it");
                        rec.remote = Some(address.clone());
                    }
                    return Ok(done);
                }
                Err(e) => errors.push(format!("{address}: {e}")),
            }
        }
        Err(io::Error::other(errors.join("; ")))
    }

    /// Hands `rec`'s live device a new connection; returns its session and the kernel's end. A
    /// writable relayed device's export must still be served writable: a copy that is not the
    /// volume's primary serves it read-only.
    async fn reconnect(&self, rec: &AttachRecord) -> io::Result<(JoinHandle<()>, UnixStream)> {
        let (kernel_end, _, flags, session) = self.open(rec).await?;
        if rec.remote.is_some() && flags & ferrite_nbd::proto::TF_READ_ONLY != 0 && !rec.read_only {
            session.abort();
            let (at, export) = (rec.remote.as_deref().unwrap_or_default(), rec.export.as_deref().unwrap_or_default());
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{at} serves {export} read-only: it is not the volume's primary"),
            ));
        }
        let (index, backend) = (rec.index, backend(&rec.volume));
        let k = blocking_or_end(&session, move || kernel::reconnect(index, &kernel_end, &backend).map(|()| kernel_end))
            .await?;
        Ok((session, k))
    }

    /// Whether /dev/nbd<index> is still the device `rec` made (after a restart of this daemon).
    pub fn still_attached(rec: &AttachRecord) -> bool {
        kernel::backend(rec.index).as_deref() == Some(backend(&rec.volume).as_str())
    }

    /// Keeps `rec`'s device connected from now on; `session` serves its current connection (an
    /// ended one: reconnect at once), whose kernel end is `kernel_end`.
    pub fn keep(
        self: &Arc<Self>,
        rec: AttachRecord,
        session: JoinHandle<()>,
        kernel_end: Option<UnixStream>,
    ) -> Keeper {
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(std::sync::Mutex::new(kernel_end));
        let remote = Arc::new(std::sync::Mutex::new(rec.remote.clone()));
        let (links, stopped, conn, serving) =
            (Arc::clone(self), Arc::clone(&stop), Arc::clone(&current), Arc::clone(&remote));
        let mut rec = rec;
        let task = tokio::spawn(async move {
            let mut session = session;
            loop {
                let _ = (&mut session).await;
                if stopped.load(Ordering::Acquire) {
                    return;
                }
                let lost = Instant::now();
                tracing::warn!(device = %rec.device, volume = %rec.volume, "the device's connection ended; reconnecting");
                session = loop {
                    match links.reconnect_any(&mut rec).await {
                        Ok((s, k)) => {
                            *conn.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(k);
                            *serving.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = rec.remote.clone();
                            break s;
                        }
                        Err(e) if lost.elapsed() < links.hold => {
                            tracing::warn!(device = %rec.device, error = %e, "reconnect failed; retrying");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => {
                            tracing::error!(device = %rec.device, volume = %rec.volume, error = %e, hold = ?links.hold,
                                "no new connection within the hold time: the kernel fails the device's I/O");
                            return;
                        }
                    }
                    if stopped.load(Ordering::Acquire) {
                        return;
                    }
                };
                tracing::info!(device = %rec.device, volume = %rec.volume, paused_ms = lost.elapsed().as_millis(),
                    "kernel NBD device reconnected");
            }
        });
        Keeper { stop, task, current, remote }
    }
}

/// A device's keeper task.
#[derive(Debug)]
pub struct Keeper {
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
    /// The kernel's end of the current connection (a second descriptor of it), to cut it.
    current: Arc<std::sync::Mutex<Option<UnixStream>>>,
    /// The NBD listener a remote device is connected to now (it follows its primary).
    remote: Arc<std::sync::Mutex<Option<String>>>,
}

impl Keeper {
    /// The NBD listener the device is connected to now, for another node's volume.
    pub fn remote(&self) -> Option<String> {
        self.remote.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Before a detach: the connection's end is not to be repaired (`false` again if the detach
    /// failed).
    pub fn stopping(&self, yes: bool) {
        self.stop.store(yes, Ordering::Release);
    }

    /// Before this daemon exits: ends the connection, unrepaired, so the kernel holds the
    /// device's I/O for the next daemon. Requests it had sent are re-sent after the request
    /// timeout; none gets an error.
    pub fn cut(&self) {
        self.stopping(true);
        if let Some(k) = self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
            let _ = k.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The client TLS of a relay to `address`: this daemon's certificate, and the name the remote
/// daemon's must carry.
pub fn relay_tls(
    tls: Option<&TlsFiles>,
    address: &str,
) -> Result<(Arc<ferrite_tls::rustls::ClientConfig>, ferrite_tls::ServerName<'static>), Error> {
    let Some(TlsFiles { cert, key, client_ca: Some(ca), peer_name }) = tls else {
        return Err(Error::refused("reaching another node's volume needs tls-cert, tls-key and tls-client-ca"));
    };
    let bad = |e: std::io::Error| Error::refused(format!("TLS for {address}: {e}"));
    let cfg = ferrite_tls::client_config(ca, Some((cert, key)), &[]).map_err(bad)?;
    let name = ferrite_tls::server_name(peer_name.as_deref().unwrap_or(address)).map_err(bad)?;
    Ok((cfg, name))
}
