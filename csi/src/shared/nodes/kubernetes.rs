//! The node directory from the Kubernetes API: the node DaemonSet's pods sit behind a headless
//! Service, Kubernetes' EndpointSlice controller lists each pod with its node name and address,
//! and this directory watches those slices (kube-rs reflector), so a node that joins, moves or
//! leaves is seen without a restart and nothing on the node side writes to the API.
//!
//! Each node maps to `tcp://<pod address>:<port named admin>`, and its daemon must prove the
//! node's name (`node_server_name`: the signer issues each node's certificate for its node), so
//! an entry whose address leads to another node's daemon fails. `server_name`, the Service's
//! DNS name every node certificate also carries, is for a daemon of no known node.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context;
use ferrite_proto::ClientTls;
use ferrite_tls::Reloading;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};

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
    tls: Option<Arc<Reloading<ClientTls>>>,
    server_name: Option<String>,
    watch: tokio::task::JoinHandle<()>,
    connections: super::Connections,
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
        let nodes = kube::Api::<Node>::all(client);
        // Kept: names, addresses and pod networks; not the image lists and field owners.
        let nodes = watcher(nodes, watcher::Config::default()).modify(|n| {
            n.metadata.managed_fields = None;
            if let Some(s) = n.status.as_mut() {
                s.images = None;
            }
        });
        let nodes = reflector::reflector(writer, nodes).default_backoff();
        let service = service.to_owned();
        let watch = tokio::spawn(async move {
            let mut slices = std::pin::pin!(slices);
            let mut nodes = std::pin::pin!(nodes);
            loop {
                let (what, ev) = tokio::select! {
                    Some(ev) = slices.next() => ("the node service's EndpointSlices", ev.map(drop)),
                    Some(ev) = nodes.next() => ("the Nodes", ev.map(drop)),
                    else => return,
                };
                if let Err(e) = ev {
                    tracing::warn!(%service, "watching {what}: {e}");
                }
            }
        });
        let ready = async {
            store.wait_until_ready().await?;
            all.wait_until_ready().await
        };
        tokio::time::timeout(FIRST_LIST, ready)
            .await
            .map_err(|_| {
                anyhow::anyhow!("no EndpointSlice or Node list from the Kubernetes API within {FIRST_LIST:?}")
            })?
            .context("the EndpointSlice or Node watch ended")?;
        Ok(Self { store, all, tls, server_name, watch, connections: super::Connections::default() })
    }

    fn map(&self) -> BTreeMap<String, String> {
        endpoints(&self.store.state())
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
        let addresses = n.status.iter().flat_map(|s| s.addresses.iter().flatten());
        let ips = addresses
            .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
            .filter_map(|a| a.address.parse::<std::net::IpAddr>().ok());
        net.nodes.entry(name).or_default().extend(ips.map(|ip| ip.to_canonical()));
        let spec = n.spec.iter();
        let cidrs = spec.flat_map(|s| s.pod_cidrs.iter().flatten().chain(s.pod_cidr.as_ref()));
        net.pods.extend(cidrs.filter_map(|c| c.parse::<ipnet::IpNet>().ok()).map(|c| c.trunc()));
    }
    net
}

/// Node name → admin endpoint over all slices. A node with several endpoints (a rolling update)
/// takes a ready one before a serving one before any other, so the old pod is left as it stops.
fn endpoints(slices: &[Arc<EndpointSlice>]) -> BTreeMap<String, String> {
    let mut best: BTreeMap<String, (u8, String)> = BTreeMap::new();
    for s in slices {
        let port = s.ports.iter().flatten().find(|p| p.name.as_deref() == Some(ADMIN_PORT_NAME)).and_then(|p| p.port);
        let Some(port) = port else { continue };
        for e in &s.endpoints {
            let (Some(node), Some(addr)) = (e.node_name.as_deref(), e.addresses.first()) else { continue };
            if !valid_node(node) {
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
    best.into_iter().map(|(n, (_, at))| (n, at)).collect()
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
        let m = endpoints(&slices);
        assert_eq!(m.get("node-a").unwrap(), "tcp://10.0.0.1:7070");
        assert_eq!(m.get("node-b").unwrap(), "tcp://10.0.0.3:7070");
        assert_eq!(m.get("node-c").unwrap(), "tcp://10.0.0.4:7070", "a node not ready yet is still listed");
        assert_eq!(m.get("node-d").unwrap(), "tcp://[fd00::4]:7070");
        assert_eq!(m.len(), 4, "{m:?}");
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
