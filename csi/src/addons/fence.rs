//! CSI-Addons NetworkFence: fencing is cluster-wide, so every daemon of the node directory gets
//! the same CIDR list; each persists it and enforces it on its TCP listeners (refusing new
//! clients, cutting open connections). A daemon that cannot be reached fails the call, which the
//! CO retries: a fence that holds on some nodes only is not a fence.

use std::collections::BTreeSet;
use std::sync::Arc;

use ferrite_proto::csi_addons::fence as pb_fence;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::shared::args::no_parameters;
use crate::shared::nodes::{NodeDirectory, admin};

#[derive(Debug)]
pub struct Fence {
    pub nodes: Arc<dyn NodeDirectory>,
}

/// The blocks of a request: at least one, each non-empty (the daemons check the syntax).
fn cidrs(list: Vec<pb_fence::Cidr>) -> Result<Vec<String>, Status> {
    if list.is_empty() {
        return Err(Status::invalid_argument("cidrs is required"));
    }
    let out: Vec<String> = list.into_iter().map(|c| c.cidr.trim().to_owned()).collect();
    if out.iter().any(String::is_empty) {
        return Err(Status::invalid_argument("every cidrs entry needs a cidr"));
    }
    Ok(out)
}

impl Fence {
    /// Fences (`Some(true)`), unfences (`Some(false)`) or lists (`None`) on every node's daemon;
    /// returns the union of the lists they report.
    async fn on_every_node(&self, cidrs: &[String], fence: Option<bool>) -> Result<BTreeSet<String>, Status> {
        let mut union = BTreeSet::new();
        for node in self.nodes.nodes() {
            let mut c = admin(&*self.nodes, &node).await?;
            let req = pb::FenceRequest { cidrs: cidrs.to_vec(), owner: "network-fence".into() };
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
