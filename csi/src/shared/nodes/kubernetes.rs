//! The node directory from the Kubernetes API: the node DaemonSet's pods sit behind a headless
//! Service, Kubernetes' EndpointSlice controller lists each pod with its node name and address,
//! and this directory watches those slices (kube-rs reflector), so a node that joins, moves or
//! leaves is seen without a restart and nothing on the node side writes to the API.
//!
//! Each node maps to `tcp://<pod address>:<port named admin>`, and its daemon must prove the
//! node's name (`node_server_name`: the signer issues each node's certificate for its node), so
//! an entry whose address leads to another node's daemon fails. `server_name`, the Service's
//! DNS name every node certificate also carries, is for a daemon of no known node.
//!
//! An endpoint counts only when it is bound to its node ([`bound`]): its pod is a DaemonSet's
//! (a kubelet may create mirror pods, never a pod a DaemonSet owns), runs on the node the
//! endpoint names, and its address is one that Node lists (the daemon shares the host's
//! network). A kubelet's mirror pod labelled as a daemon, or an address of another node's, is
//! left out and logged.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use ferrite_proto::ClientTls;
use ferrite_tls::Reloading;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};

use super::placements::{self, Placements};
use super::{NodeDirectory, valid_node};

/// The EndpointSlice port that carries the daemons' admin API.
pub const ADMIN_PORT_NAME: &str = "admin";
/// How long startup waits for the first list of slices.
const FIRST_LIST: std::time::Duration = std::time::Duration::from_secs(30);

/// Node daemons found through the EndpointSlices of one Service; the cluster's Nodes (those
/// without a daemon hold no storage).
pub struct KubeNodes {
    store: Store<EndpointSlice>,
    all: Store<Node>,
    /// The pods of the Service's namespace (owner, node, mirror annotation only).
    pods: Store<Pod>,
    namespace: String,
    /// The endpoints left out, as last logged (each is logged once, when it appears).
    refused: Mutex<BTreeSet<String>>,
    tls: Option<Arc<Reloading<ClientTls>>>,
    server_name: Option<String>,
    watch: tokio::task::JoinHandle<()>,
    connections: super::Connections,
    placements: Placements,
}

impl std::fmt::Debug for KubeNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeNodes").field("nodes", &self.map()).field("server_name", &self.server_name).finish()
    }
}

impl Drop for KubeNodes {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl KubeNodes {
    /// Watches the slices of `service` ("namespace/name") with the client configuration kube-rs
    /// infers (KUBECONFIG, else the pod's service account), and waits for the first list.
    pub async fn watch(
        service: &str,
        tls: Option<Arc<Reloading<ClientTls>>>,
        server_name: Option<String>,
    ) -> anyhow::Result<Self> {
        let (ns, name) = service
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
            .with_context(|| format!("node service {service:?}: expected NAMESPACE/NAME"))?;
        let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
        let api = kube::Api::<EndpointSlice>::namespaced(client.clone(), ns);
        let config = watcher::Config::default().labels(&format!("kubernetes.io/service-name={name}"));
        let (store, writer) = reflector::store();
        let slices = reflector::reflector(writer, watcher(api, config)).default_backoff();
        let (all, writer) = reflector::store();
        let nodes = kube::Api::<Node>::all(client.clone());
        // Kept: names, addresses and pod networks; not the image lists and field owners.
        let nodes = watcher(nodes, watcher::Config::default()).modify(|n| {
            n.metadata.managed_fields = None;
            if let Some(s) = n.status.as_mut() {
                s.images = None;
            }
        });
        let nodes = reflector::reflector(writer, nodes).default_backoff();
        let (pods, writer) = reflector::store();
        let pod_api = kube::Api::<Pod>::namespaced(client.clone(), ns);
        let pod_watch = watcher(pod_api, watcher::Config::default()).modify(strip_pod);
        let pod_watch = reflector::reflector(writer, pod_watch).default_backoff();
        let (records, writer) = reflector::store();
        let record_api = kube::Api::<ConfigMap>::namespaced(client, ns);
        let config = watcher::Config::default().labels(placements::LABEL);
        let record_watch = watcher(record_api.clone(), config).modify(|c| c.metadata.managed_fields = None);
        let record_watch = reflector::reflector(writer, record_watch).default_backoff();
        let service = service.to_owned();
        let watch = tokio::spawn(async move {
            let mut slices = std::pin::pin!(slices);
            let mut nodes = std::pin::pin!(nodes);
            let mut pod_watch = std::pin::pin!(pod_watch);
            let mut record_watch = std::pin::pin!(record_watch);
            loop {
                let (what, ev) = tokio::select! {
                    Some(ev) = slices.next() => ("the node service's EndpointSlices", ev.map(drop)),
                    Some(ev) = nodes.next() => ("the Nodes", ev.map(drop)),
                    Some(ev) = pod_watch.next() => ("the pods of the node service's namespace", ev.map(drop)),
                    Some(ev) = record_watch.next() => ("the placement records", ev.map(drop)),
                    else => return,
                };
                if let Err(e) = ev {
                    tracing::warn!(%service, "watching {what}: {e}");
                }
            }
        });
        let ready = async {
            store.wait_until_ready().await?;
            pods.wait_until_ready().await?;
            records.wait_until_ready().await?;
            all.wait_until_ready().await
        };
        tokio::time::timeout(FIRST_LIST, ready)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "no EndpointSlice, Pod, ConfigMap or Node list from the Kubernetes API within {FIRST_LIST:?}"
                )
            })?
            .context("the EndpointSlice, Pod, ConfigMap or Node watch ended")?;
        let (namespace, refused) = (ns.to_owned(), Mutex::default());
        let connections = super::Connections::default();
        let placements = Placements::new(record_api, records);
        Ok(Self { store, all, pods, namespace, refused, tls, server_name, watch, connections, placements })
    }

    /// Node name → admin endpoint, of the endpoints bound to their nodes; logs each one left out
    /// once.
    fn map(&self) -> BTreeMap<String, String> {
        let pod = |name: &str| self.pods.get(&reflector::ObjectRef::new(name).within(&self.namespace));
        let restricted = self.all.state().iter().any(|n| labelled(n, RESTRICTED_STORAGE).is_some());
        let ips = |node: &str| {
            let n = self.all.get(&reflector::ObjectRef::new(node));
            if restricted && n.as_deref().and_then(|n| labelled(n, RESTRICTED_STORAGE)) != Some("true") {
                return Err(format!("Node {node} is not labelled {RESTRICTED_STORAGE}=true"));
            }
            Ok(n.map(|n| node_ips(&n)).unwrap_or_default())
        };
        let (map, refused) = endpoints(&self.store.state(), pod, ips);
        let mut logged = self.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for why in refused.difference(&logged) {
            tracing::warn!("an endpoint of the node Service is not taken as a node's daemon: {why}");
        }
        *logged = refused;
        map
    }
}

impl NodeDirectory for KubeNodes {
    fn nodes(&self) -> Vec<String> {
        self.map().into_keys().collect()
    }

    fn admin_endpoint(&self, node: &str) -> Option<String> {
        self.map().remove(node)
    }

    fn is_node(&self, node: &str) -> bool {
        self.all.get(&reflector::ObjectRef::new(node)).is_some() || self.admin_endpoint(node).is_some()
    }

    fn tls(&self) -> Option<Arc<ClientTls>> {
        self.tls.as_ref().map(|t| t.current())
    }

    fn server_name(&self) -> Option<String> {
        self.server_name.clone()
    }

    /// The node's own name: every node certificate the signer issues names its node (and the
    /// node Service, which [`Self::server_name`] is, for a daemon of no known node).
    fn node_server_name(&self, node: &str) -> Option<String> {
        Some(node.to_owned())
    }

    fn connections(&self) -> Option<&super::Connections> {
        Some(&self.connections)
    }

    fn zone(&self, node: &str) -> Option<String> {
        Some(zone(&self.all.state(), node))
    }

    fn placements(&self) -> Option<&Placements> {
        Some(&self.placements)
    }

    fn network(&self) -> super::Network {
        let mut net = network(&self.all.state());
        net.add_endpoints(self.map());
        net
    }
}

/// The Nodes' InternalIP and ExternalIP addresses and their pod networks.
fn network(nodes: &[Arc<Node>]) -> super::Network {
    let mut net = super::Network::default();
    for n in nodes {
        let Some(name) = n.metadata.name.clone() else { continue };
        net.nodes.entry(name).or_default().extend(node_ips(n));
        let spec = n.spec.iter();
        let cidrs = spec.flat_map(|s| s.pod_cidrs.iter().flatten().chain(s.pod_cidr.as_ref()));
        net.pods.extend(cidrs.filter_map(|c| c.parse::<ipnet::IpNet>().ok()).map(|c| c.trunc()));
    }
    net
}

/// The storage-node label a kubelet cannot write: once any Node has it, only the Nodes labelled
/// `"true"` are storage nodes (the directory takes no daemon elsewhere, and the signer names the
/// node Service in no other node's certificate).
pub const RESTRICTED_STORAGE: &str = "node-restriction.kubernetes.io/ferrite-storage";

/// The zone label a kubelet cannot write (NodeRestriction keeps `node-restriction.kubernetes.io/`
/// to the cluster's administrators).
pub const RESTRICTED_ZONE: &str = "node-restriction.kubernetes.io/ferrite-zone";

/// Node `node`'s zone for placing copies: its [`RESTRICTED_ZONE`] label once any Node has one
/// (then a Node without it is in zone ""), else its `topology.kubernetes.io/zone`, which its own
/// kubelet may write (docs/security.md).
fn zone(nodes: &[Arc<Node>], node: &str) -> String {
    let restricted = nodes.iter().any(|n| labelled(n, RESTRICTED_ZONE).is_some());
    let key = if restricted { RESTRICTED_ZONE } else { super::ZONE_KEY };
    let n = nodes.iter().find(|n| n.metadata.name.as_deref() == Some(node));
    n.and_then(|n| labelled(n, key)).unwrap_or_default().to_owned()
}

/// Node `n`'s label `key`.
fn labelled<'a>(n: &'a Node, key: &str) -> Option<&'a str> {
    n.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

/// A Node's InternalIP and ExternalIP addresses.
fn node_ips(n: &Node) -> BTreeSet<IpAddr> {
    let addresses = n.status.iter().flat_map(|s| s.addresses.iter().flatten());
    addresses
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical())
        .collect()
}

/// What the directory keeps of a pod: its name, controller, mirror annotation and node.
fn strip_pod(p: &mut Pod) {
    let mirror = p.metadata.annotations.as_ref().and_then(|a| a.get(MIRROR)).cloned();
    p.metadata.annotations = mirror.map(|m| BTreeMap::from([(MIRROR.to_owned(), m)]));
    p.metadata.labels = None;
    p.metadata.managed_fields = None;
    let node_name = p.spec.as_ref().and_then(|s| s.node_name.clone());
    p.spec = Some(k8s_openapi::api::core::v1::PodSpec { node_name, ..Default::default() });
    p.status = None;
}

/// The annotation a kubelet puts on the mirror pods of its static pods.
const MIRROR: &str = "kubernetes.io/config.mirror";

/// Whether endpoint `e` (on node `node`, at `addr`) is that node's daemon: its pod is owned by
/// a DaemonSet (NodeRestriction lets a kubelet create only mirror pods, owned by its Node) and
/// runs on `node`, and `addr` is one of the Node's addresses (`ips`: Err for a Node that is no
/// storage node). Err says why not.
fn bound(
    e: &Endpoint,
    node: &str,
    addr: &str,
    pod: impl Fn(&str) -> Option<Arc<Pod>>,
    ips: impl Fn(&str) -> Result<BTreeSet<IpAddr>, String>,
) -> Result<(), String> {
    let at = format!("{addr} (node {node})");
    let target = e.target_ref.as_ref().filter(|t| t.kind.as_deref() == Some("Pod"));
    let name = target.and_then(|t| t.name.as_deref()).ok_or_else(|| format!("{at}: names no pod"))?;
    let p = pod(name).ok_or_else(|| format!("{at}: pod {name} is not in the Service's namespace"))?;
    if p.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(MIRROR)) {
        return Err(format!("{at}: pod {name} is a kubelet's mirror pod"));
    }
    let owners = p.metadata.owner_references.iter().flatten();
    if !owners.filter(|o| o.controller == Some(true)).any(|o| o.kind == "DaemonSet" && o.api_version == "apps/v1") {
        return Err(format!("{at}: pod {name} is not a DaemonSet's"));
    }
    let runs_on = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if runs_on != Some(node) {
        return Err(format!("{at}: pod {name} runs on {}", runs_on.unwrap_or("no node")));
    }
    let ip = addr.parse::<IpAddr>().map_err(|_| format!("{at}: not an IP address"))?.to_canonical();
    if !ips(node).map_err(|why| format!("{at}: {why}"))?.contains(&ip) {
        return Err(format!("{at}: Node {node} does not list that address"));
    }
    Ok(())
}

/// Node name → admin endpoint over all slices, of the endpoints [`bound`] to their node, and
/// why each other one was left out. A node with several endpoints (a rolling update) takes a
/// ready one before a serving one before any other, so the old pod is left as it stops.
fn endpoints(
    slices: &[Arc<EndpointSlice>],
    pod: impl Fn(&str) -> Option<Arc<Pod>>,
    ips: impl Fn(&str) -> Result<BTreeSet<IpAddr>, String>,
) -> (BTreeMap<String, String>, BTreeSet<String>) {
    let mut best: BTreeMap<String, (u8, String)> = BTreeMap::new();
    let mut refused = BTreeSet::new();
    for s in slices {
        let port = s.ports.iter().flatten().find(|p| p.name.as_deref() == Some(ADMIN_PORT_NAME)).and_then(|p| p.port);
        let Some(port) = port else { continue };
        for e in &s.endpoints {
            let (Some(node), Some(addr)) = (e.node_name.as_deref(), e.addresses.first()) else { continue };
            if !valid_node(node) {
                continue;
            }
            if let Err(why) = bound(e, node, addr, &pod, &ips) {
                refused.insert(why);
                continue;
            }
            let c = e.conditions.as_ref();
            let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
            // Unset ready/serving mean "unknown", which the API says to read as true.
            let rank = match (c.and_then(|c| c.ready).unwrap_or(true), c.and_then(|c| c.serving).unwrap_or(true)) {
                _ if terminating => 0,
                (true, _) => 2,
                (false, true) => 1,
                (false, false) => 0,
            };
            let at = if s.address_type == "IPv6" {
                format!("tcp://[{addr}]:{port}")
            } else {
                format!("tcp://{addr}:{port}")
            };
            if best.get(node).is_none_or(|(r, _)| rank > *r) {
                best.insert(node.to_owned(), (rank, at));
            }
        }
    }
    (best.into_iter().map(|(n, (_, at))| (n, at)).collect(), refused)
}

/// The annotations of Node `name` (the data-path daemon's init container reads which device
/// holds the node's pool), with the client configuration kube-rs infers.
pub async fn node_annotations(name: &str) -> anyhow::Result<(BTreeMap<String, String>, BTreeMap<String, String>)> {
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
    let api = kube::Api::<k8s_openapi::api::core::v1::Node>::all(client);
    let node = api.get(name).await.with_context(|| format!("reading Node {name}"))?;
    Ok((node.metadata.annotations.unwrap_or_default(), node.metadata.labels.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn ep(node: &str, addr: &str, ready: Option<bool>, terminating: bool) -> Endpoint {
        Endpoint {
            addresses: vec![addr.into()],
            node_name: Some(node.into()),
            conditions: Some(EndpointConditions { ready, serving: ready, terminating: Some(terminating) }),
            target_ref: Some(k8s_openapi::api::core::v1::ObjectReference {
                kind: Some("Pod".into()),
                name: Some(format!("daemon-{addr}")),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn slice(kind: &str, port: Option<(&str, i32)>, eps: Vec<Endpoint>) -> Arc<EndpointSlice> {
        Arc::new(EndpointSlice {
            address_type: kind.into(),
            endpoints: eps,
            ports: port.map(|(n, p)| vec![EndpointPort { name: Some(n.into()), port: Some(p), ..Default::default() }]),
            ..Default::default()
        })
    }

    /// A pod on `node` owned by a controller of `kind`, a mirror pod when `mirror`.
    fn pod(node: &str, kind: &str, mirror: bool) -> Arc<Pod> {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let owner = OwnerReference {
            api_version: if kind == "Node" { "v1" } else { "apps/v1" }.into(),
            kind: kind.into(),
            name: "ferrite-daemon".into(),
            controller: Some(true),
            ..Default::default()
        };
        let mut p = Pod {
            metadata: kube::api::ObjectMeta {
                owner_references: Some(vec![owner]),
                annotations: mirror.then(|| BTreeMap::from([(MIRROR.to_owned(), "x".to_owned())])),
                labels: Some(BTreeMap::from([("app".to_owned(), "x".to_owned())])),
                ..Default::default()
            },
            spec: Some(k8s_openapi::api::core::v1::PodSpec { node_name: Some(node.into()), ..Default::default() }),
            ..Default::default()
        };
        strip_pod(&mut p);
        Arc::new(p)
    }

    /// Every endpoint's pod a DaemonSet's on its node, every address its node's.
    fn bound_to_their_nodes(slices: &[Arc<EndpointSlice>]) -> BTreeMap<String, String> {
        let on = |name: &str| -> Option<String> {
            let addr = name.strip_prefix("daemon-")?;
            slices.iter().flat_map(|s| &s.endpoints).find(|e| e.addresses[0] == addr)?.node_name.clone()
        };
        let ips = |node: &str| -> Result<BTreeSet<IpAddr>, String> {
            let eps = slices.iter().flat_map(|s| &s.endpoints).filter(|e| e.node_name.as_deref() == Some(node));
            Ok(eps.map(|e| e.addresses[0].parse().unwrap()).collect())
        };
        let (map, refused) = endpoints(slices, |name| on(name).map(|n| pod(&n, "DaemonSet", false)), ips);
        assert!(refused.is_empty(), "{refused:?}");
        map
    }

    #[test]
    fn maps_nodes_to_admin_endpoints() {
        let slices = vec![
            slice(
                "IPv4",
                Some(("admin", 7070)),
                vec![
                    ep("node-a", "10.0.0.1", Some(true), false),
                    // A rolling update: the old pod terminates, the new one is ready.
                    ep("node-b", "10.0.0.2", Some(true), true),
                    ep("node-b", "10.0.0.3", Some(true), false),
                    ep("node-c", "10.0.0.4", Some(false), false),
                    ep("Bad_Node", "10.0.0.5", Some(true), false),
                ],
            ),
            slice("IPv6", Some(("admin", 7070)), vec![ep("node-d", "fd00::4", None, false)]),
            slice("IPv4", Some(("metrics", 9090)), vec![ep("node-e", "10.0.0.6", Some(true), false)]),
            slice("IPv4", None, vec![ep("node-f", "10.0.0.7", Some(true), false)]),
        ];
        let m = bound_to_their_nodes(&slices);
        assert_eq!(m.get("node-a").unwrap(), "tcp://10.0.0.1:7070");
        assert_eq!(m.get("node-b").unwrap(), "tcp://10.0.0.3:7070");
        assert_eq!(m.get("node-c").unwrap(), "tcp://10.0.0.4:7070", "a node not ready yet is still listed");
        assert_eq!(m.get("node-d").unwrap(), "tcp://[fd00::4]:7070");
        assert_eq!(m.len(), 4, "{m:?}");
    }

    /// What a kubelet can write (a mirror pod with the daemon's labels, its Node's addresses)
    /// does not make an entry for another node, nor one for itself from a pod that is not the
    /// DaemonSet's.
    #[test]
    fn an_endpoint_counts_only_bound_to_its_node() {
        let mut no_pod = ep("node-g", "10.0.0.8", Some(true), false);
        no_pod.target_ref = None;
        let slices = vec![slice(
            "IPv4",
            Some(("admin", 7070)),
            vec![
                ep("node-a", "10.0.0.1", Some(true), false),
                ep("node-b", "10.0.0.2", Some(true), false),
                ep("node-c", "10.0.0.3", Some(true), false),
                ep("node-d", "10.0.0.4", Some(true), false),
                ep("node-e", "10.0.0.5", Some(true), false),
                ep("node-f", "10.0.0.6", Some(true), false),
                ep("node-h", "10.0.0.9", Some(true), false),
                no_pod,
            ],
        )];
        let pods = |name: &str| match name {
            "daemon-10.0.0.1" => Some(pod("node-a", "DaemonSet", false)),
            "daemon-10.0.0.2" => Some(pod("node-b", "Node", true)),
            "daemon-10.0.0.3" => Some(pod("node-c", "ReplicaSet", false)),
            "daemon-10.0.0.4" => Some(pod("node-a", "DaemonSet", false)),
            "daemon-10.0.0.5" => Some(pod("node-e", "DaemonSet", false)),
            "daemon-10.0.0.9" => Some(pod("node-h", "DaemonSet", false)),
            _ => None,
        };
        // node-e lists node-a's address, not its own pod's; node-h is no storage node.
        let ips = |node: &str| -> Result<BTreeSet<IpAddr>, String> {
            let ip = match node {
                "node-e" => "10.0.0.1",
                "node-h" => return Err("not a storage node".into()),
                n => &format!("10.0.0.{}", n.as_bytes()[5] - b'a' + 1),
            };
            Ok(BTreeSet::from([ip.parse().unwrap()]))
        };
        let (m, refused) = endpoints(&slices, pods, ips);
        assert_eq!(m, BTreeMap::from([("node-a".to_owned(), "tcp://10.0.0.1:7070".to_owned())]));
        let why: Vec<&str> = refused.iter().map(String::as_str).collect();
        assert_eq!(
            why,
            [
                "10.0.0.2 (node node-b): pod daemon-10.0.0.2 is a kubelet's mirror pod",
                "10.0.0.3 (node node-c): pod daemon-10.0.0.3 is not a DaemonSet's",
                "10.0.0.4 (node node-d): pod daemon-10.0.0.4 runs on node-a",
                "10.0.0.5 (node node-e): Node node-e does not list that address",
                "10.0.0.6 (node node-f): pod daemon-10.0.0.6 is not in the Service's namespace",
                "10.0.0.8 (node node-g): names no pod",
                "10.0.0.9 (node node-h): not a storage node",
            ]
        );
    }

    #[test]
    fn zones_come_from_the_restricted_label_once_any_node_has_it() {
        let node = |name: &str, labels: &[(&str, &str)]| {
            let labels = labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            Arc::new(Node {
                metadata: kube::api::ObjectMeta { name: Some(name.into()), labels: Some(labels), ..Default::default() },
                ..Default::default()
            })
        };
        let z = crate::shared::nodes::ZONE_KEY;
        let open = [node("a", &[(z, "z1")]), node("b", &[(z, "z2")])];
        assert_eq!((zone(&open, "a"), zone(&open, "b"), zone(&open, "gone")), ("z1".into(), "z2".into(), "".into()));
        // Once the administrator labels a node, a kubelet's own zone label counts no more.
        let guarded = [node("a", &[(z, "z1"), (RESTRICTED_ZONE, "r1")]), node("b", &[(z, "z9")])];
        assert_eq!((zone(&guarded, "a"), zone(&guarded, "b")), ("r1".into(), "".into()));
    }

    #[test]
    fn a_nodes_network_is_its_addresses_and_pod_networks() {
        use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};
        let node = |name: &str, addresses: &[(&str, &str)], pods: &[&str]| {
            Arc::new(Node {
                metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
                spec: Some(NodeSpec {
                    pod_cidrs: Some(pods.iter().map(|p| (*p).into()).collect()),
                    ..Default::default()
                }),
                status: Some(NodeStatus {
                    addresses: Some(
                        addresses
                            .iter()
                            .map(|(t, a)| NodeAddress { type_: (*t).into(), address: (*a).into() })
                            .collect(),
                    ),
                    ..Default::default()
                }),
            })
        };
        let n = network(&[
            node(
                "a",
                &[("InternalIP", "10.0.0.1"), ("Hostname", "a"), ("ExternalIP", "2001:db8::1")],
                &["10.244.0.0/24"],
            ),
            node(
                "b",
                &[("InternalIP", "::ffff:10.0.0.2"), ("InternalDNS", "b.local")],
                &["10.244.1.1/24", "fd00::/64"],
            ),
        ]);
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert_eq!(n.nodes["a"], [ip("10.0.0.1"), ip("2001:db8::1")].into());
        assert_eq!(n.nodes["b"], [ip("10.0.0.2")].into(), "mapped IPv4 read as IPv4");
        let pods: Vec<String> = n.pods.iter().map(ToString::to_string).collect();
        assert_eq!(pods, ["10.244.0.0/24", "10.244.1.0/24", "fd00::/64"]);
    }
}
