//! The exports a server offers: a name, a volume handle, and whether writes are allowed; and
//! the connections serving each, so that removing an export cuts them.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ferrite_engine::Volume;
use ipnet::IpNet;
use parking_lot::{Mutex, RwLock};

use crate::metrics::ExportMetrics;

/// Who may open an export over TCP: clients from a network, or clients whose verified
/// certificate names an identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allow {
    Net(IpNet),
    Identity(String),
    /// `local`: no TCP client at all (the Unix socket only), as for the exports that attach
    /// volumes on this node.
    Local,
}

impl FromStr for Allow {
    type Err = String;
    /// `10.0.0.0/8`, `192.0.2.7`, `fd00::/64`, an identity (a DNS name such as `node-a`), or
    /// `local`.
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "local" {
            return Ok(Self::Local);
        }
        if let Ok(net) = s.parse::<IpNet>() {
            return Ok(Self::Net(net.trunc()));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Self::Net(IpNet::from(ip)));
        }
        match ferrite_tls::ServerName::try_from(s) {
            Ok(ferrite_tls::ServerName::DnsName(_)) => Ok(Self::Identity(s.to_string())),
            _ => Err(format!("{s:?} is neither a CIDR block (10.0.0.0/8), an address, nor an identity (a DNS name)")),
        }
    }
}

impl fmt::Display for Allow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Net(n) => write!(f, "{n}"),
            Self::Identity(i) => f.write_str(i),
            Self::Local => f.write_str("local"),
        }
    }
}

/// One export: a volume under a name.
#[derive(Debug)]
pub struct Export {
    pub name: String,
    pub volume: Volume,
    /// Exported read-only; see [`Export::is_read_only`] for what a client gets.
    pub read_only: bool,
    pub description: String,
    /// Empty: every client that reaches the listener (and passes its TLS policy). Otherwise a
    /// TCP client must match an entry. Unix-socket clients are local: the socket's permissions
    /// decide.
    pub allow: Vec<Allow>,
    /// An identity on the allow list is admitted only if it also holds the listener's role (an
    /// export a controller made); otherwise the name alone admits it (an operator's own list).
    pub names_need_role: bool,
    pub metrics: ExportMetrics,
    /// Duplicates of the sockets of the connections in transmission on this export (to cut
    /// them), or None once the export was removed.
    connections: Mutex<Option<BTreeMap<u64, OwnedFd>>>,
    next_connection: AtomicU64,
}

impl Export {
    /// Read-only for clients now: exported so, or the volume is (a snapshot, or a volume made
    /// read-only since, e.g. a demoted replication primary). Asked per connection and request.
    pub fn is_read_only(&self) -> bool {
        self.read_only || self.volume.is_read_only()
    }

    pub fn new(name: impl Into<String>, volume: Volume, read_only: bool, description: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            volume,
            read_only,
            description: description.into(),
            allow: Vec::new(),
            names_need_role: false,
            metrics: ExportMetrics::default(),
            connections: Mutex::new(Some(BTreeMap::new())),
            next_connection: AtomicU64::new(0),
        }
    }

    /// Restricts who may open the export; with `names_need_role`, see the field.
    #[must_use]
    pub fn with_allow(mut self, allow: Vec<Allow>, names_need_role: bool) -> Self {
        self.allow = allow;
        self.names_need_role = names_need_role;
        self
    }

    /// Whether a client (its address, None on a Unix socket; its verified certificate) may
    /// open this export. A certificate whose identity lacks the listener's role (`role`) is
    /// refused unless the allow list names it (and the export does not need the role of names
    /// too); the rest is judged by the list's entries (an empty list: every client).
    pub fn permits(
        &self,
        ip: Option<IpAddr>,
        cert: Option<&ferrite_tls::CertificateDer<'_>>,
        role: Option<&crate::tls::RoleCheck>,
    ) -> bool {
        let Some(ip) = ip.map(|ip| ip.to_canonical()) else { return true };
        let named = |id: &str| cert.is_some_and(|c| ferrite_tls::names(c, id));
        // Looked up only when the allow list alone does not decide.
        let has_role = || match (cert, role) {
            (Some(cert), Some(role)) => role(cert),
            _ => true,
        };
        if !self.names_need_role && self.allow.iter().any(|a| matches!(a, Allow::Identity(id) if named(id))) {
            return true;
        }
        has_role()
            && (self.allow.is_empty()
                || self.allow.iter().any(|a| match a {
                    Allow::Net(n) => n.contains(&ip),
                    Allow::Identity(id) => named(id),
                    Allow::Local => false,
                }))
    }

    /// Registers a connection about to serve this export; None once the export was removed
    /// (the connection must end). The registration lasts as long as the returned value.
    pub fn register(self: &Arc<Self>, socket: BorrowedFd<'_>) -> std::io::Result<Option<Registration>> {
        let dup = socket.try_clone_to_owned()?;
        let mut conns = self.connections.lock();
        let Some(conns) = conns.as_mut() else { return Ok(None) };
        let id = self.next_connection.fetch_add(1, Ordering::Relaxed);
        conns.insert(id, dup);
        Ok(Some(Registration { export: Arc::clone(self), id }))
    }

    /// Connections serving this export now.
    pub fn connection_count(&self) -> usize {
        self.connections.lock().as_ref().map_or(0, BTreeMap::len)
    }

    /// Refuses new connections and cuts the open ones: each sees its socket shut down, finishes
    /// the requests it already took (no acknowledged write is lost) and ends. Returns how many
    /// were cut.
    fn close(&self) -> usize {
        let Some(conns) = self.connections.lock().take() else { return 0 };
        for fd in conns.values() {
            // A duplicate this map owns, so its number cannot have been reused for another file.
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
        conns.len()
    }
}

/// A connection's place in its export's list; dropping it leaves the list.
#[derive(Debug)]
pub struct Registration {
    export: Arc<Export>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(conns) = self.export.connections.lock().as_mut() {
            conns.remove(&self.id);
        }
    }
}

/// The set of exports, shared by every listener and changed by the admin API at run time.
#[derive(Debug, Default)]
pub struct Exports {
    map: RwLock<BTreeMap<String, Arc<Export>>>,
}

impl Exports {
    /// Adds (or replaces) an export; connections to one it replaces are cut.
    pub fn add(&self, export: Export) -> Arc<Export> {
        let e = Arc::new(export);
        if let Some(old) = self.map.write().insert(e.name.clone(), Arc::clone(&e)) {
            old.close();
        }
        e
    }

    /// Removes an export by name and cuts its connections; returns how many were cut, or None
    /// if there was no such export.
    pub fn remove(&self, name: &str) -> Option<usize> {
        let removed = self.map.write().remove(name);
        removed.map(|e| e.close())
    }

    /// Before the pool closes (the daemon exits): every export refuses new connections and cuts
    /// its open ones, whose clients see the connection end, not an error, for what they had in
    /// flight (a kernel client re-sends it to the next daemon). Returns how many were cut.
    pub fn close_all(&self) -> usize {
        self.map.read().values().map(|e| e.close()).sum()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Export>> {
        self.map.read().get(name).cloned()
    }

    /// Every export, by name.
    pub fn list(&self) -> Vec<Arc<Export>> {
        self.map.read().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_entries_parse() {
        assert_eq!("10.1.2.3/8".parse::<Allow>().unwrap().to_string(), "10.0.0.0/8");
        assert_eq!("192.0.2.7".parse::<Allow>().unwrap().to_string(), "192.0.2.7/32");
        assert_eq!("fd00::1/64".parse::<Allow>().unwrap().to_string(), "fd00::/64");
        assert_eq!("node-a".parse::<Allow>().unwrap(), Allow::Identity("node-a".into()));
        assert_eq!("local".parse::<Allow>().unwrap(), Allow::Local);
        for bad in ["", "10.0.0.0/33", "two words", "-x"] {
            assert!(bad.parse::<Allow>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_local_export_admits_no_tcp_client() {
        let pool_dir = tempfile::tempdir().unwrap();
        let opts = ferrite_engine::PoolOptions { segment_size: 1 << 20, ..Default::default() };
        let store = Arc::new(ferrite_engine::io::MemoryBackend::new(64 << 20));
        let pool = ferrite_engine::Pool::create_on(store, &pool_dir.path().join("meta"), opts).unwrap();
        pool.create_volume("v", 1 << 20).unwrap();
        let e = Export::new("v", pool.open_volume("v").unwrap(), false, "").with_allow(vec![Allow::Local], false);
        assert!(e.permits(None, None, None), "the Unix socket is local");
        assert!(!e.permits(Some("127.0.0.1".parse().unwrap()), None, None), "TCP from loopback is still TCP");
        let open = Export::new("w", pool.open_volume("v").unwrap(), false, "");
        assert!(open.permits(Some("192.0.2.1".parse().unwrap()), None, None));
    }
}
