//! ControllerPublishVolume / ControllerUnpublishVolume: which node may use a volume. The daemon
//! serving the volume (its primary) keeps the publication (`PublishVolume`: an NBD export only
//! the node's identity, its node name, may open, or marked local when the node is the daemon's
//! own), so the controller stays stateless, a daemon restart keeps it, and unpublishing cuts the
//! node's connections.
//!
//! Every access mode this driver serves is single-node: a volume is published to one node at a
//! time. Publishing to a node that holds an in-sync copy of a replicated volume makes that copy
//! the primary first (data locality), when the volume is published nowhere.

use std::collections::HashMap;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Code, Status};

use crate::args::{check_capabilities, require};
use crate::controller::Controller;
use crate::nodes::admin;
use crate::{copies, ids};

/// The node a publication on the daemon of node `on` grants its volume to.
fn granted_to(p: &pb::Publication, on: &str) -> String {
    if p.local { on.to_owned() } else { p.node.clone() }
}

impl Controller {
    pub(crate) async fn publish(
        &self,
        r: csi::ControllerPublishVolumeRequest,
    ) -> Result<HashMap<String, String>, Status> {
        require("volume_id", &r.volume_id)?;
        require("node_id", &r.node_id)?;
        let cap = r.volume_capability.ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        check_capabilities(std::slice::from_ref(&cap)).map_err(Status::invalid_argument)?;
        let _busy = self.busy.begin(&r.volume_id)?;
        if self.nodes.admin_endpoint(&r.node_id).is_none() {
            return Err(Status::not_found(format!("node {:?} is not known", r.node_id)));
        }
        let (node, name) = ids::parse(&r.volume_id)
            .ok_or_else(|| Status::not_found(format!("volume {:?} does not exist", r.volume_id)))?;
        let (mut primary, mut c, _, view) = copies::primary(&*self.nodes, node, name).await?;
        let held = c.list_publications(pb::ListPublicationsRequest {}).await?.into_inner().publications;
        if let Some(p) = held.iter().find(|p| p.volume == name) {
            if granted_to(p, &primary) != r.node_id {
                return Err(Status::failed_precondition(format!(
                    "volume {:?} is published to {}; its access mode allows one node at a time",
                    r.volume_id,
                    granted_to(p, &primary)
                )));
            }
            if p.read_only != r.readonly {
                return Err(Status::already_exists(format!(
                    "volume {:?} is published to {} with readonly {}, not {}",
                    r.volume_id, r.node_id, p.read_only, r.readonly
                )));
            }
            return Ok(context(&primary, p));
        }
        self.check_attach_limit(&r.node_id).await?;
        // Data locality: the node's in-sync copy becomes the primary.
        if let Some(v) = &view
            && r.node_id != primary
            && let Some(ep) = self.nodes.admin_endpoint(&r.node_id)
            && v.members.iter().any(|m| m.endpoint == ep && m.state == "in-sync")
        {
            let mut there = admin(&*self.nodes, &r.node_id).await?;
            let req = pb::PromoteReplicationRequest { volume: name.to_owned(), force: false };
            there.promote_sync_replica(req).await?;
            tracing::info!(volume = name, from = %primary, to = %r.node_id, "primary moved to the publishing node");
            (primary, c) = (r.node_id.clone(), there);
        }
        let local = primary == r.node_id;
        let req = pb::PublishVolumeRequest {
            volume: name.to_owned(),
            node: if local { String::new() } else { r.node_id.clone() },
            local,
            read_only: r.readonly,
        };
        let p = c.publish_volume(req).await?.into_inner();
        tracing::info!(volume_id = %r.volume_id, node = %r.node_id, primary = %primary, "CSI volume published");
        Ok(context(&primary, &p))
    }

    /// ResourceExhausted when `node` already has as many volumes published as NodeGetInfo says
    /// it takes.
    async fn check_attach_limit(&self, node: &str) -> Result<(), Status> {
        let mut n = 0i64;
        for d in self.nodes.nodes() {
            let mut c = admin(&*self.nodes, &d).await?;
            let held = c.list_publications(pb::ListPublicationsRequest {}).await?.into_inner().publications;
            let here = held.iter().filter(|p| granted_to(p, &d) == node).count();
            n = n.saturating_add(i64::try_from(here).unwrap_or(i64::MAX));
        }
        if n >= self.max_volumes {
            return Err(Status::resource_exhausted(format!(
                "node {node} has {n} volumes published, the most it takes ({})",
                self.max_volumes
            )));
        }
        Ok(())
    }

    pub(crate) async fn unpublish(&self, r: csi::ControllerUnpublishVolumeRequest) -> Result<(), Status> {
        require("volume_id", &r.volume_id)?;
        require("node_id", &r.node_id)?;
        let _busy = self.busy.begin(&r.volume_id)?;
        // A volume or node that is gone is unpublished from it.
        let Some((node, name)) = ids::parse(&r.volume_id) else { return Ok(()) };
        if self.nodes.admin_endpoint(node).is_none() {
            return Ok(());
        }
        let (primary, mut c, _, _) = match copies::primary(&*self.nodes, node, name).await {
            Ok(found) => found,
            Err(s) if s.code() == Code::NotFound => return Ok(()),
            Err(s) => return Err(s),
        };
        let held = c.list_publications(pb::ListPublicationsRequest {}).await?.into_inner().publications;
        if held.iter().any(|p| p.volume == name && granted_to(p, &primary) == r.node_id) {
            c.unpublish_volume(pb::UnpublishVolumeRequest { volume: name.to_owned() }).await?;
            tracing::info!(volume_id = %r.volume_id, node = %r.node_id, "CSI volume unpublished");
        }
        Ok(())
    }
}

/// What NodeStage learns: where the volume is served, and how to reach it from elsewhere.
fn context(primary: &str, p: &pb::Publication) -> HashMap<String, String> {
    let mut c = HashMap::from([("primary".to_owned(), primary.to_owned()), ("export".to_owned(), p.export.clone())]);
    if !p.tcp_address.is_empty() {
        c.insert("nbd".to_owned(), p.tcp_address.clone());
    }
    c
}
