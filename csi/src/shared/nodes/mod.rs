//! Where each node's daemon answers. A volume id names its node, and this directory maps node
//! names to admin endpoints: a static file (standalone use) or, in Kubernetes, the node
//! Service's EndpointSlices ([`kubernetes`]), where the controller also records which nodes
//! hold each volume ([`placements`]).
//!
//! ```toml
//! without-storage = ["node-c"]        # nodes without a daemon, which volumes may be published to
//! [nodes]
//! node-a = "/run/ferrite/admin.sock"   # a Unix socket (a daemon on this machine)
//! node-b = "tcp://10.0.0.12:7070"      # a daemon's `admin-listen` address
//! ```

pub mod kubernetes;
pub mod placements;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferrite_proto::ClientTls;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use ferrite_proto::ferrite::v1::backups_client::BackupsClient;
use ferrite_tls::Reloading;
use serde::Deserialize;
use tonic::Status;
use tonic::transport::Channel;

/// The node → admin endpoint map the controller consults.
pub trait NodeDirectory: Send + Sync + std::fmt::Debug {
    /// Every node, in a stable order (pagination depends on it).
    fn nodes(&self) -> Vec<String>;
    /// The admin endpoint of `node` (a Unix socket path or `tcp://host:port`), if the node is known.
    fn admin_endpoint(&self, node: &str) -> Option<String>;
    /// Whether `node` exists: a node with a daemon, or one that holds no storage (its node
    /// plugin reaches the volumes published to it from the nodes serving them).
    fn is_node(&self, node: &str) -> bool {
        self.admin_endpoint(node).is_some()
    }
    /// How to reach `tcp://` endpoints: None connects in plaintext (a daemon with
    /// `insecure-admin-listen`).
    fn tls(&self) -> Option<Arc<ClientTls>>;
    /// The name the daemons' certificates carry, when it is not the endpoint's host.
    fn server_name(&self) -> Option<String> {
        None
    }
    /// The name `node`'s daemon must prove: its own where the directory binds each entry to
    /// its node (in Kubernetes the signer names every node's certificate for its node, so an
    /// address listed for one node that leads to another's daemon fails the handshake), else
    /// the shared one.
    fn node_server_name(&self, _node: &str) -> Option<String> {
        self.server_name()
    }
    /// The zone of `node` as the directory records it, for placing copies; None: as the node's
    /// daemon reports it (a directory the operator wrote).
    fn zone(&self, _node: &str) -> Option<String> {
        None
    }
    /// The connections this directory keeps for reuse (None: a connection per call).
    fn connections(&self) -> Option<&Connections> {
        None
    }
    /// The controller's record of where volumes live ([`placements`]); None: a directory the
    /// operator wrote, whose daemons are all the operator's and trusted.
    fn placements(&self) -> Option<&placements::Placements> {
        None
    }
    /// The addresses a fence must not take whole: each node's and the pod networks. Here, the
    /// hosts of the daemons' TCP endpoints; in Kubernetes the Nodes' own too.
    fn network(&self) -> Network {
        let mut net = Network::default();
        net.add_endpoints(self.nodes().into_iter().filter_map(|n| self.admin_endpoint(&n).map(|at| (n, at))));
        net
    }
}

/// Kubernetes' well-known topology labels, reported as segments where the node has them.
pub const ZONE_KEY: &str = "topology.kubernetes.io/zone";
pub const REGION_KEY: &str = "topology.kubernetes.io/region";

/// The cluster's addresses as a fence sees them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Network {
    /// Node name → its addresses.
    pub nodes: BTreeMap<String, BTreeSet<IpAddr>>,
    /// The pod networks (each Node's `spec.podCIDRs`).
    pub pods: BTreeSet<ipnet::IpNet>,
}

impl Network {
    /// Adds the host of each node's TCP admin endpoint (node, endpoint) to its addresses.
    pub fn add_endpoints(&mut self, endpoints: impl IntoIterator<Item = (String, String)>) {
        for (node, at) in endpoints {
            if let Some(ip) = endpoint_ip(&at) {
                self.nodes.entry(node).or_default().insert(ip);
            }
        }
    }
}

/// The IP of a `tcp://IP:port` endpoint (None for a socket path or a host name).
pub fn endpoint_ip(endpoint: &str) -> Option<IpAddr> {
    let at = endpoint.strip_prefix("tcp://")?;
    at.parse::<std::net::SocketAddr>().ok().map(|a| a.ip().to_canonical())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct File {
    #[serde(default)]
    without_storage: Vec<String>,
    nodes: BTreeMap<String, String>,
}

/// A directory read once from a TOML file.
#[derive(Debug, Clone, Default)]
pub struct StaticNodes {
    nodes: BTreeMap<String, String>,
    without_storage: Vec<String>,
    tls: Option<Arc<Reloading<ClientTls>>>,
    server_name: Option<String>,
    connections: Connections,
}

impl StaticNodes {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading node directory {}", path.display()))?;
        let f: File = toml::from_str(&text).with_context(|| format!("parsing node directory {}", path.display()))?;
        if let Some(bad) = f.nodes.keys().chain(&f.without_storage).find(|n| !valid_node(n)) {
            anyhow::bail!("node directory {}: invalid node name {bad:?}", path.display());
        }
        Ok(Self { nodes: f.nodes, without_storage: f.without_storage, ..Self::default() })
    }

    /// One node (node mode, or `--mode all` without a directory).
    pub fn single(node: &str, admin_socket: &Path) -> Self {
        Self { nodes: BTreeMap::from([(node.to_owned(), admin_socket.display().to_string())]), ..Self::default() }
    }

    #[must_use]
    pub fn with_tls(mut self, tls: Option<Arc<Reloading<ClientTls>>>, server_name: Option<String>) -> Self {
        self.tls = tls;
        self.server_name = server_name;
        self
    }
}

impl NodeDirectory for StaticNodes {
    fn nodes(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }

    fn admin_endpoint(&self, node: &str) -> Option<String> {
        self.nodes.get(node).cloned()
    }

    fn is_node(&self, node: &str) -> bool {
        self.nodes.contains_key(node) || self.without_storage.iter().any(|n| n == node)
    }

    fn tls(&self) -> Option<Arc<ClientTls>> {
        self.tls.as_ref().map(|t| t.current())
    }

    fn server_name(&self) -> Option<String> {
        self.server_name.clone()
    }

    fn connections(&self) -> Option<&Connections> {
        Some(&self.connections)
    }
}

/// Node names as Kubernetes allows them (DNS subdomain), which also keeps them out of volume ids'
/// separator.
pub fn valid_node(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 63
        && n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// A connection to a daemon kept for the next call: one HTTP/2 connection, which tonic dials
/// again when it breaks (a restarted daemon is reconnected to on the next call; one that is
/// down answers that call Unavailable). It was made with this TLS config and server name: a
/// rotated certificate (a new config) gets a new connection.
#[derive(Debug)]
struct Kept {
    tls: Option<Arc<ClientTls>>,
    server_name: Option<String>,
    channel: Channel,
}

/// A directory's kept connections, by admin endpoint. Each directory has its own: a channel
/// works only on the runtime that made it, and a directory lives within one.
#[derive(Debug, Default, Clone)]
pub struct Connections(Arc<std::sync::Mutex<BTreeMap<String, Kept>>>);

/// Beyond this many endpoints (nodes that left, or came back elsewhere), the kept connections
/// are dropped and made again as they are used.
const MOST_KEPT: usize = 1024;

/// An admin client for `node`: NotFound for a node the directory does not know, Unavailable
/// when its daemon does not answer. Where the directory keeps connections, one is reused
/// across calls (no TCP and TLS handshake per call: a scan of fifty nodes would make fifty).
pub async fn admin(dir: &dyn NodeDirectory, node: &str) -> Result<AdminClient<Channel>, Status> {
    Ok(AdminClient::new(channel(dir, node).await?))
}

/// `node`'s daemon's Backups service (same connection as its admin API).
pub async fn backups(dir: &dyn NodeDirectory, node: &str) -> Result<BackupsClient<Channel>, Status> {
    Ok(BackupsClient::new(channel(dir, node).await?))
}

async fn channel(dir: &dyn NodeDirectory, node: &str) -> Result<Channel, Status> {
    let at = dir.admin_endpoint(node).ok_or_else(|| Status::not_found(format!("unknown node {node:?}")))?;
    let (tls, server_name) = (dir.tls(), dir.node_server_name(node));
    let ptr = |t: &Option<Arc<ClientTls>>| t.as_ref().map(Arc::as_ptr);
    let kept = dir.connections().map(|c| &c.0);
    if let Some(kept) = kept {
        let kept = kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(k) = kept.get(&at).filter(|k| k.server_name == server_name && ptr(&k.tls) == ptr(&tls)) {
            return Ok(k.channel.clone());
        }
    }
    let channel = ferrite_proto::connect_as(&at, tls.clone(), server_name.as_deref())
        .await
        .map_err(|e| Status::unavailable(format!("node {node}: daemon at {at} unreachable: {e}")))?;
    if let Some(kept) = kept {
        let mut kept = kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if kept.len() >= MOST_KEPT {
            kept.clear();
        }
        kept.insert(at, Kept { tls, server_name, channel: channel.clone() });
    }
    Ok(channel)
}

/// What is wrong with `node`'s daemon, if anything: it does not answer within `within` (or
/// answers with an error), or its pool failed. The failover loop asks it of every node it
/// judges, the storage heartbeat of its own daemon.
pub async fn trouble(dir: &dyn NodeDirectory, node: &str, within: Duration) -> Option<String> {
    let ask = async {
        let mut c = admin(dir, node).await?;
        c.pool_status(pb::PoolStatusRequest {}).await
    };
    match tokio::time::timeout(within, ask).await {
        Ok(Ok(s)) if s.get_ref().failed => Some("its pool failed".to_owned()),
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(format!("its daemon unreachable ({})", e.message())),
        Err(_) => Some(format!("its daemon unreachable (no answer within {within:?})")),
    }
}

/// How long each node has to answer a call that asks every node: one that does not answer in
/// time (powered off, partitioned) is skipped, so a lost node never stalls the controller.
pub const SCAN: Duration = Duration::from_secs(3);

/// What a scan of the nodes found: the answers in the directory's order, and the nodes that
/// did not answer within [`SCAN`] (or whose daemon was unreachable), with why.
#[derive(Debug)]
pub struct Scan<T> {
    pub answers: Vec<(String, T)>,
    pub silent: Vec<(String, String)>,
}

impl<T> Scan<T> {
    /// The silent nodes for a message or a response header ("" when none).
    pub fn silent_names(&self) -> String {
        self.silent.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(",")
    }
}

/// Asks every node of `nodes` at once with `f` (given the node and a client for it), each
/// within [`SCAN`]. A node that is unreachable or does not answer in time is skipped and
/// logged; any other error is the scan's error (an answer that says something is wrong).
pub async fn scan<T, F, Fut>(dir: &dyn NodeDirectory, nodes: Vec<String>, f: F) -> Result<Scan<T>, Status>
where
    F: Fn(String, AdminClient<Channel>) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    let f = &f;
    let calls = nodes.into_iter().map(|node| async move {
        let call = async {
            let c = admin(dir, &node).await?;
            f(node.clone(), c).await
        };
        let r = tokio::time::timeout(SCAN, call).await;
        (node, r)
    });
    let mut out = Scan { answers: Vec::new(), silent: Vec::new() };
    for (node, r) in futures_util::future::join_all(calls).await {
        match r {
            Ok(Ok(t)) => out.answers.push((node, t)),
            Ok(Err(s)) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                out.silent.push((node, s.message().to_owned()));
            }
            Ok(Err(s)) => return Err(s),
            Err(_) => out.silent.push((node, format!("no answer within {SCAN:?}"))),
        }
    }
    for (node, why) in &out.silent {
        tracing::warn!(node, why, "node skipped: its daemon does not answer");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_and_validates() {
        let dir = std::env::temp_dir().join(format!("ferrite-csi-nodes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("nodes.toml");
        std::fs::write(&p, "[nodes]\nnode-b = \"/b.sock\"\nnode-a = \"tcp://127.0.0.2:7070\"\n").unwrap();
        let n = StaticNodes::load(&p).unwrap();
        assert_eq!(n.nodes(), vec!["node-a", "node-b"]);
        assert_eq!(n.admin_endpoint("node-b").as_deref(), Some("/b.sock"));
        assert_eq!(n.admin_endpoint("node-a").as_deref(), Some("tcp://127.0.0.2:7070"));
        assert_eq!(n.admin_endpoint("node-c"), None);
        assert!(n.is_node("node-a") && !n.is_node("node-c"));
        // A node without storage exists (volumes are published to it) but is never asked.
        std::fs::write(&p, "without-storage = [\"node-c\"]\n[nodes]\nnode-a = \"/a.sock\"\n").unwrap();
        let n = StaticNodes::load(&p).unwrap();
        assert!(n.is_node("node-c") && n.admin_endpoint("node-c").is_none() && n.nodes() == ["node-a"]);
        std::fs::write(&p, "without-storage = [\"Bad/Node\"]\n[nodes]\n").unwrap();
        assert!(StaticNodes::load(&p).unwrap_err().to_string().contains("invalid node name"));
        std::fs::write(&p, "[nodes]\n\"Bad/Node\" = \"/x\"\n").unwrap();
        assert!(StaticNodes::load(&p).unwrap_err().to_string().contains("invalid node name"));
        std::fs::write(&p, "[nodez]\n").unwrap();
        assert!(StaticNodes::load(&p).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
