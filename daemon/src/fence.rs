//! Network fencing: CIDR blocks whose clients the daemon refuses on its TCP listeners (NBD, and
//! the admin API when it listens on TCP), persisted in `<data-dir>/fences.json`. Fencing also cuts
//! the open connections from those blocks: every TCP client is registered with a duplicate of its
//! socket, and `shutdown(2)` through it ends the connection whichever task or thread serves it.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::os::fd::AsFd;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use ipnet::IpNet;
use tokio::net::TcpStream;

use crate::state::RecordFile;

/// An IPv4 or IPv6 block (`ipnet`); host bits are cleared, so `10.1.2.3/8` is `10.0.0.0/8`, and
/// a bare address is its own /32 or /128.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr(IpNet);

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4 client on a dual-stack socket shows as ::ffff:a.b.c.d.
        self.0.contains(&ip.to_canonical())
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let net = s.parse::<IpNet>().or_else(|_| s.parse::<IpAddr>().map(IpNet::from));
        net.map(|n| Self(n.trunc()))
            .map_err(|_| format!("{s:?} is not a CIDR block (like 10.0.0.0/8, 192.0.2.7 or fd00::/64)"))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A TCP client as `ListClients` shows it.
#[derive(Debug, Clone)]
pub struct ClientInfo {
    pub id: u64,
    pub peer: SocketAddr,
    pub listener: &'static str,
    pub since_unix: u64,
}

#[derive(Debug)]
struct Client {
    info: ClientInfo,
    /// A duplicate of the connection's socket, to cut it.
    socket: std::net::TcpStream,
}

#[derive(Debug)]
pub struct Fences {
    file: RecordFile,
    cidrs: Mutex<Vec<Cidr>>,
    clients: Mutex<BTreeMap<u64, Client>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Fences {
    pub fn load(data_dir: &Path) -> anyhow::Result<Arc<Self>> {
        let file = RecordFile::new(data_dir, "fences");
        let saved: Vec<String> = file.load()?;
        let cidrs = saved
            .iter()
            .map(|s| s.parse())
            .collect::<Result<Vec<Cidr>, _>>()
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.path().display()))?;
        if !cidrs.is_empty() {
            tracing::info!(fenced = ?saved, "network fences restored");
        }
        Ok(Arc::new(Self { file, cidrs: Mutex::new(cidrs), clients: Mutex::default(), next_id: AtomicU64::new(1) }))
    }

    pub fn is_fenced(&self, ip: IpAddr) -> bool {
        lock(&self.cidrs).iter().any(|c| c.contains(ip))
    }

    /// Registers a new TCP client; None (and the caller drops the connection) when it is fenced.
    pub fn admit(self: &Arc<Self>, peer: SocketAddr, stream: &TcpStream, listener: &'static str) -> Option<Admission> {
        if self.is_fenced(peer.ip()) {
            tracing::warn!(%peer, listener, "connection refused: the address is fenced");
            return None;
        }
        let socket = match stream.as_fd().try_clone_to_owned() {
            Ok(fd) => std::net::TcpStream::from(fd),
            Err(e) => {
                tracing::error!(%peer, error = %e, "cannot register the connection for fencing; refusing it");
                return None;
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let since_unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let info = ClientInfo { id, peer, listener, since_unix };
        lock(&self.clients).insert(id, Client { info, socket });
        Some(Admission { fences: Arc::clone(self), id })
    }

    /// Changes the fence list durably (the file first, then memory; nothing is written when
    /// nothing changes, as for a plain listing); cuts the open connections the list covers. Returns the list and how many connections were cut.
    pub fn update(&self, add: &[Cidr], remove: &[Cidr]) -> io::Result<(Vec<Cidr>, u64)> {
        let list = {
            let mut cidrs = lock(&self.cidrs);
            let mut next: Vec<Cidr> = cidrs.iter().filter(|c| !remove.contains(c)).copied().collect();
            next.extend(add.iter().filter(|c| !cidrs.contains(c)));
            next.sort();
            next.dedup();
            if next != *cidrs {
                let text: Vec<String> = next.iter().map(ToString::to_string).collect();
                self.file.save(&text)?;
                *cidrs = next.clone();
            }
            next
        };
        let mut cut = 0;
        for c in lock(&self.clients).values().filter(|c| list.iter().any(|f| f.contains(c.info.peer.ip()))) {
            let _ = c.socket.shutdown(Shutdown::Both);
            tracing::warn!(peer = %c.info.peer, listener = c.info.listener, "connection cut: the address is fenced");
            cut += 1;
        }
        Ok((list, cut))
    }

    pub fn clients(&self) -> Vec<ClientInfo> {
        lock(&self.clients).values().map(|c| c.info.clone()).collect()
    }
}

/// Held for as long as an admitted connection lives.
#[derive(Debug)]
pub struct Admission {
    fences: Arc<Fences>,
    id: u64,
}

impl Drop for Admission {
    fn drop(&mut self) {
        lock(&self.fences.clients).remove(&self.id);
    }
}

/// The NBD server asks the same registry about its TCP clients.
#[derive(Debug)]
pub struct NbdAdmission(pub Arc<Fences>);

impl ferrite_nbd::server::Admission for NbdAdmission {
    fn admit(&self, peer: SocketAddr, stream: &TcpStream) -> Option<Box<dyn Send + Sync>> {
        self.0.admit(peer, stream, "nbd").map(|a| Box::new(a) as Box<dyn Send + Sync>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_normalise_and_match() {
        let c: Cidr = "10.1.2.3/8".parse().unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert!(c.contains("10.200.0.1".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.9.9.9".parse().unwrap()), "IPv4-mapped clients are IPv4 clients");
        let one: Cidr = "127.0.0.9".parse().unwrap();
        assert_eq!(one.to_string(), "127.0.0.9/32");
        assert!(one.contains("127.0.0.9".parse().unwrap()) && !one.contains("127.0.0.10".parse().unwrap()));
        let v6: Cidr = "fd00::1/64".parse().unwrap();
        assert_eq!(v6.to_string(), "fd00::/64");
        assert!(v6.contains("fd00::abcd".parse().unwrap()) && !v6.contains("10.0.0.1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        for bad in ["", "10.0.0.0/33", "fd00::/129", "10.0.0/8", "host/8", "10.0.0.0/-1", "10.0.0.0/"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn fences_persist_refuse_and_cut() {
        let dir = std::env::temp_dir().join(format!("ferrite-fence-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = Fences::load(&dir).unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server_side, peer) = l.accept().await.unwrap();
        let adm = f.admit(peer, &server_side, "nbd").unwrap();
        assert_eq!(f.clients().len(), 1);
        let (list, cut) = f.update(&["127.0.0.0/8".parse().unwrap()], &[]).unwrap();
        assert_eq!((list.len(), cut), (1, 1));
        // The client sees its connection end.
        let mut buf = [0u8; 1];
        let n = tokio::io::AsyncReadExt::read(&mut { client }, &mut buf).await.unwrap_or(0);
        assert_eq!(n, 0);
        assert!(f.admit(peer, &server_side, "nbd").is_none(), "a fenced address is refused");
        drop(adm);
        assert!(f.clients().is_empty());
        // Persisted: a new registry (the next daemon) has it; unfencing removes it.
        let again = Fences::load(&dir).unwrap();
        assert_eq!(again.update(&[], &[]).unwrap().0, list);
        again.update(&[], &list).unwrap();
        assert!(Fences::load(&dir).unwrap().update(&[], &[]).unwrap().0.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
