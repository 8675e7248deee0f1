//! CSI-Addons NetworkFence: fencing is cluster-wide, so every daemon of the node directory gets
//! the same CIDR list; each persists it and enforces it on its TCP listeners (refusing new
//! clients, cutting open connections). A daemon that cannot be reached fails the call, which the
//! CO retries: a fence that holds on some nodes only is not a fence. A fence takes one node's
//! clients at most ([`allowed`]): whoever reaches this endpoint cannot fence the cluster.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use ferrite_proto::csi_addons::fence as pb_fence;
use ferrite_proto::ferrite::v1 as pb;
use ipnet::IpNet;
use tonic::{Request, Response, Status};

use crate::shared::args::no_parameters;
use crate::shared::nodes::{Network, NodeDirectory, admin};

#[derive(Debug)]
pub struct Fence {
    pub nodes: Arc<dyn NodeDirectory>,
}

/// The widest block a fence takes (256 addresses): a node's own addresses need no more.
const WIDEST_V4: u8 = 24;
const WIDEST_V6: u8 = 120;

/// The blocks of a request: at least one, each an address or a block (`ipnet`).
fn cidrs(list: Vec<pb_fence::Cidr>) -> Result<Vec<IpNet>, Status> {
    if list.is_empty() {
        return Err(Status::invalid_argument("cidrs is required"));
    }
    list.into_iter()
        .map(|c| {
            let s = c.cidr.trim();
            s.parse::<IpNet>().or_else(|_| s.parse::<IpAddr>().map(IpNet::from)).map(|n| n.trunc()).map_err(|_| {
                Status::invalid_argument(format!("cidrs: {s:?} is not an IP address or a block such as 10.1.2.3/32"))
            })
        })
        .collect()
}

/// Refuses a block that would fence more than one node's clients: wider than
/// `WIDEST_V4`/`WIDEST_V6`, overlapping a pod network (every pod of a node, the controller's
/// among them), or covering the addresses of more than one node. A CO fences a lost node by
/// its own addresses (GetFenceClients lists them one by one); a wider fence, from a mistake or
/// a caller that should not fence at all, would cut every node's clients.
fn allowed(block: &IpNet, net: &Network) -> Result<(), String> {
    let widest = if block.addr().is_ipv4() { WIDEST_V4 } else { WIDEST_V6 };
    if block.prefix_len() < widest {
        return Err(format!("{block} is wider than /{widest}: fence a node's own addresses"));
    }
    if let Some(pods) = net.pods.iter().find(|p| p.contains(block) || block.contains(*p)) {
        return Err(format!("{block} covers the pod network {pods}"));
    }
    let covered: Vec<&str> =
        net.nodes.iter().filter(|(_, ips)| ips.iter().any(|ip| block.contains(ip))).map(|(n, _)| n.as_str()).collect();
    if covered.len() > 1 {
        return Err(format!("{block} covers the addresses of nodes {}: a fence takes one node", covered.join(", ")));
    }
    Ok(())
}

impl Fence {
    /// Fences (`Some(true)`), unfences (`Some(false)`) or lists (`None`) on every node's daemon;
    /// returns the union of the lists they report.
    async fn on_every_node(&self, cidrs: &[IpNet], fence: Option<bool>) -> Result<BTreeSet<String>, Status> {
        let mut union = BTreeSet::new();
        let cidrs: Vec<String> = cidrs.iter().map(IpNet::to_string).collect();
        for node in self.nodes.nodes() {
            let mut c = admin(&*self.nodes, &node).await?;
            let req = pb::FenceRequest { cidrs: cidrs.clone(), owner: "network-fence".into() };
            let r = match fence {
                Some(true) => c.fence_networks(req).await,
                Some(false) => c.unfence_networks(req).await,
                None => c.list_fences(pb::ListFencesRequest {}).await,
            }
            .map_err(|s| Status::new(s.code(), format!("node {node}: {}", s.message())))?
            .into_inner();
            if fence.is_some() {
                tracing::info!(node, fenced = ?fence, cidrs = ?cidrs, connections_cut = r.connections_cut, "fence list changed");
            }
            union.extend(r.cidrs);
        }
        Ok(union)
    }
}

#[tonic::async_trait]
impl pb_fence::fence_controller_server::FenceController for Fence {
    async fn fence_cluster_network(
        &self,
        req: Request<pb_fence::FenceClusterNetworkRequest>,
    ) -> Result<Response<pb_fence::FenceClusterNetworkResponse>, Status> {
        let r = req.into_inner();
        let list = cidrs(r.cidrs)?;
        no_parameters(&r.parameters)?;
        let net = self.nodes.network();
        if let Some(why) = list.iter().find_map(|b| allowed(b, &net).err()) {
            tracing::warn!(cidrs = ?list, "fence refused: {why}");
            return Err(Status::invalid_argument(format!("fence refused: {why}")));
        }
        self.on_every_node(&list, Some(true)).await?;
        Ok(Response::new(pb_fence::FenceClusterNetworkResponse {}))
    }

    async fn unfence_cluster_network(
        &self,
        req: Request<pb_fence::UnfenceClusterNetworkRequest>,
    ) -> Result<Response<pb_fence::UnfenceClusterNetworkResponse>, Status> {
        let r = req.into_inner();
        let list = cidrs(r.cidrs)?;
        no_parameters(&r.parameters)?;
        self.on_every_node(&list, Some(false)).await?;
        Ok(Response::new(pb_fence::UnfenceClusterNetworkResponse {}))
    }

    async fn list_cluster_fence(
        &self,
        req: Request<pb_fence::ListClusterFenceRequest>,
    ) -> Result<Response<pb_fence::ListClusterFenceResponse>, Status> {
        no_parameters(&req.get_ref().parameters)?;
        let list = self.on_every_node(&[], None).await?;
        Ok(Response::new(pb_fence::ListClusterFenceResponse {
            cidrs: list.into_iter().map(|cidr| pb_fence::Cidr { cidr }).collect(),
        }))
    }

    /// The clients connected to the daemons over TCP, one per address (its id): the blocks a CO
    /// would fence to cut them off.
    async fn get_fence_clients(
        &self,
        req: Request<pb_fence::GetFenceClientsRequest>,
    ) -> Result<Response<pb_fence::GetFenceClientsResponse>, Status> {
        no_parameters(&req.get_ref().parameters)?;
        let mut addresses = BTreeSet::new();
        for node in self.nodes.nodes() {
            let mut c = admin(&*self.nodes, &node).await?;
            for client in c.list_clients(pb::ListClientsRequest {}).await?.into_inner().clients {
                if let Ok(a) = client.address.parse::<std::net::SocketAddr>() {
                    addresses.insert(a.ip().to_canonical());
                }
            }
        }
        let clients = addresses
            .into_iter()
            .map(|ip| pb_fence::ClientDetails {
                id: ip.to_string(),
                addresses: vec![pb_fence::Cidr { cidr: format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 }) }],
            })
            .collect();
        Ok(Response::new(pb_fence::GetFenceClientsResponse { clients }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net() -> Network {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        Network {
            nodes: [
                ("a".to_owned(), [ip("192.168.1.10"), ip("fd00::10")].into()),
                ("b".to_owned(), [ip("192.168.1.11")].into()),
                ("c".to_owned(), [ip("192.168.2.12")].into()),
            ]
            .into(),
            pods: ["10.244.0.0/24".parse().unwrap(), "10.244.1.0/24".parse().unwrap()].into(),
        }
    }

    fn check(block: &str) -> Result<(), String> {
        let b = cidrs(vec![pb_fence::Cidr { cidr: block.into() }]).map_err(|s| s.message().to_owned())?;
        allowed(&b[0], &net())
    }

    #[test]
    fn a_fence_takes_one_node_at_most() {
        for ok in ["192.168.1.10", "192.168.1.10/32", "192.168.2.0/24", "198.51.100.0/24", "fd00::10/128", "fd00::/120"]
        {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("0.0.0.0/0", "wider than /24"),
            ("192.168.0.0/16", "wider than /24"),
            ("::/0", "wider than /120"),
            ("192.168.1.0/24", "nodes a, b"),
            ("192.168.1.10/31", "nodes a, b"),
            ("10.244.1.7", "pod network 10.244.1.0/24"),
            ("10.244.0.0/24", "pod network 10.244.0.0/24"),
            ("10.244.1.9/30", "pod network"),
            ("300.1.1.1/8", "not an IP address"),
            ("10.0.0.0/40", "not an IP address"),
        ] {
            let e = check(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
