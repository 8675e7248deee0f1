//! Network fencing: CIDR blocks whose clients the daemon refuses on its TCP listeners (NBD, and
//! the admin API when it listens on TCP), persisted in `<data-dir>/fences.json`. Fencing also cuts
//! the open connections from those blocks: every TCP client is registered with a duplicate of its
//! socket, and `shutdown(2)` through it ends the connection whichever task or thread serves it.
//!
//! Every fence records who made it (`operator`, or `controller` with the owner the controller
//! names, such as `controller/failover`): a maker lifts only its own mark, and a block stays
//! fenced while any mark remains. An operator lifts every mark.

use std::collections::{BTreeMap, BTreeSet};
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

use crate::base::state::RecordFile;

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

/// A fence as saved: its block and its makers. A bare string (files before makers were
/// recorded) has the maker [`UNRECORDED`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum Saved {
    Made { cidr: String, by: BTreeSet<String> },
    Legacy(String),
}

/// The maker of a fence from before makers were recorded: any controller lifts it, as any
/// controller could then.
const UNRECORDED: &str = "unrecorded";

/// Fenced blocks and who made each.
pub type FenceList = BTreeMap<Cidr, BTreeSet<String>>;

/// A change of the fence list, made by `maker`.
#[derive(Debug, Clone, Copy)]
pub enum Change<'a> {
    Fence(&'a [Cidr]),
    /// Removes `maker`'s marks; `all` removes every mark (an operator).
    Lift {
        cidrs: &'a [Cidr],
        all: bool,
    },
}

#[derive(Debug)]
pub struct Fences {
    file: RecordFile,
    cidrs: Mutex<FenceList>,
    clients: Mutex<BTreeMap<u64, Client>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Fences {
    pub fn load(data_dir: &Path) -> anyhow::Result<Arc<Self>> {
        let file = RecordFile::new(data_dir, "fences");
        let saved: Vec<Saved> = file.load()?;
        let mut cidrs = FenceList::new();
        for s in saved {
            let (cidr, by) = match s {
                Saved::Made { cidr, by } => (cidr, by),
                Saved::Legacy(cidr) => (cidr, BTreeSet::from([UNRECORDED.to_owned()])),
            };
            let c: Cidr = cidr.parse().map_err(|e| anyhow::anyhow!("{}: {e}", file.path().display()))?;
            cidrs.entry(c).or_default().extend(by);
        }
        if !cidrs.is_empty() {
            tracing::info!(fenced = ?cidrs, "network fences restored");
        }
        Ok(Arc::new(Self { file, cidrs: Mutex::new(cidrs), clients: Mutex::default(), next_id: AtomicU64::new(1) }))
    }

    pub fn is_fenced(&self, ip: IpAddr) -> bool {
        lock(&self.cidrs).keys().any(|c| c.contains(ip))
    }

    /// Registers a new TCP client; None (and the caller drops the connection) when it is fenced.
    pub fn admit(self: &Arc<Self>, peer: SocketAddr, stream: &TcpStream, listener: &'static str) -> Option<Admission> {
        if self.is_fenced(peer.ip()) {
            tracing::warn!(%peer, listener, "connection refused: the address is fenced");
            return None;
        }
        self.register(peer, stream, listener)
    }

    /// Registers a new TCP client, fenced or not (a listener that decides on a fenced client
    /// once it knows who it is); None when its socket cannot be registered.
    pub fn register(
        self: &Arc<Self>,
        peer: SocketAddr,
        stream: &TcpStream,
        listener: &'static str,
    ) -> Option<Admission> {
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
    /// nothing changes, as for a plain listing) and cuts the open connections it covers. Lifting
    /// a block that holds no mark of `maker` is refused (naming who made it). Returns the list
    /// and how many connections were cut.
    pub fn update(&self, change: Change<'_>, maker: &str) -> Result<(FenceList, u64), FenceError> {
        let list = {
            let mut cidrs = lock(&self.cidrs);
            let mut next = cidrs.clone();
            match change {
                Change::Fence(add) => {
                    for c in add {
                        next.entry(*c).or_default().insert(maker.to_owned());
                    }
                }
                Change::Lift { cidrs: lift, all } => {
                    for c in lift {
                        let Some(by) = next.get_mut(c) else { continue };
                        let unrecorded = maker.starts_with("controller") && by.remove(UNRECORDED);
                        if !all && !by.remove(maker) && !unrecorded {
                            let made: Vec<&str> = by.iter().map(String::as_str).collect();
                            return Err(FenceError::NotYours { cidr: *c, by: made.join(", ") });
                        }
                        if all || by.is_empty() {
                            next.remove(c);
                        }
                    }
                }
            }
            if next != *cidrs {
                let saved: Vec<Saved> =
                    next.iter().map(|(c, by)| Saved::Made { cidr: c.to_string(), by: by.clone() }).collect();
                self.file.save(&saved).map_err(FenceError::Save)?;
                *cidrs = next.clone();
            }
            next
        };
        let mut cut = 0;
        for c in lock(&self.clients).values().filter(|c| list.keys().any(|f| f.contains(c.info.peer.ip()))) {
            let _ = c.socket.shutdown(Shutdown::Both);
            tracing::warn!(peer = %c.info.peer, listener = c.info.listener, "connection cut: the address is fenced");
            cut += 1;
        }
        Ok((list, cut))
    }

    pub fn list(&self) -> FenceList {
        lock(&self.cidrs).clone()
    }

    pub fn clients(&self) -> Vec<ClientInfo> {
        lock(&self.clients).values().map(|c| c.info.clone()).collect()
    }
}

/// The maker of a fence: `operator`, or `controller` with the job the controller names (`owner`,
/// lowercase letters, digits and '-', at most 63).
pub fn maker(operator: bool, owner: &str) -> Result<String, String> {
    let ok = owner.len() <= 63
        && !owner.starts_with('-')
        && owner.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !ok {
        return Err(format!("owner {owner:?} is not a name (lowercase letters, digits and '-', at most 63)"));
    }
    let role = if operator { "operator" } else { "controller" };
    Ok(if owner.is_empty() { role.to_owned() } else { format!("{role}/{owner}") })
}

/// Why a fence list change failed.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("{cidr} was fenced by {by}, not by the caller: only its makers (or an operator) lift it")]
    NotYours { cidr: Cidr, by: String },
    #[error("saving the fence list (nothing changed): {0}")]
    Save(io::Error),
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
        let lo: Cidr = "127.0.0.0/8".parse().unwrap();
        let (list, cut) = f.update(Change::Fence(&[lo]), "controller").unwrap();
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
        assert_eq!(again.list(), list);
        again.update(Change::Lift { cidrs: &[lo], all: false }, "controller").unwrap();
        assert!(Fences::load(&dir).unwrap().list().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_maker_lifts_only_its_own_mark() {
        let dir = tempfile::tempdir().unwrap();
        let f = Fences::load(dir.path()).unwrap();
        let net: Cidr = "10.0.0.0/8".parse().unwrap();
        f.update(Change::Fence(&[net]), "operator").unwrap();
        let lift = Change::Lift { cidrs: &[net], all: false };
        let e = f.update(lift, "controller/failover").unwrap_err();
        assert!(e.to_string().contains("fenced by operator"), "{e}");
        f.update(Change::Fence(&[net]), "controller/failover").unwrap();
        // The failover's lift leaves the operator's fence in place.
        let (list, _) = f.update(lift, "controller/failover").unwrap();
        assert_eq!(list[&net], BTreeSet::from(["operator".to_owned()]));
        f.update(Change::Fence(&[net]), "controller").unwrap();
        assert!(f.update(Change::Lift { cidrs: &[net], all: true }, "operator").unwrap().0.is_empty());
        // A block that is not fenced lifts as a no-op (the call is idempotent).
        assert!(f.update(lift, "controller").unwrap().0.is_empty());
    }

    #[test]
    fn fences_saved_before_makers_were_recorded_are_lifted_by_any_controller() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("fences.json"), r#"["10.1.0.0/16"]"#).unwrap();
        let f = Fences::load(dir.path()).unwrap();
        let net: Cidr = "10.1.0.0/16".parse().unwrap();
        assert_eq!(f.list()[&net], BTreeSet::from([UNRECORDED.to_owned()]));
        assert!(f.update(Change::Lift { cidrs: &[net], all: false }, "controller/failover").unwrap().0.is_empty());
    }
}
