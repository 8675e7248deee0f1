//! ControllerPublishVolume / ControllerUnpublishVolume: which node may use a volume. The daemon
//! serving the volume (its primary) keeps the publication (`PublishVolume`: an NBD export only
//! the node's identity, its node name, may open, or marked local when the node is the daemon's
//! own), so the controller stays stateless, a daemon restart keeps it, and unpublishing cuts the
//! node's connections.
//!
//! A volume is published only where its data is (a node holding a copy), unless its class made
//! it remote-access: its context says which (its PV, for a volume made before it did), not the
//! node's labels, which its kubelet writes.
//!
//! Every access mode this driver serves is single-node: a volume is published to one node at a
//! time. Publishing to a node that holds an in-sync copy of a replicated volume makes that copy
//! the primary first (data locality), when the volume is published nowhere; a node whose copy
//! is still rebuilding, or that holds none, reaches the primary through its relay.
//!
//! A node that relays is published on the volume's other copies too (standby publications,
//! read-only there while the copy is not the primary), and the publish context lists their NBD
//! listeners (`copies`): when a failover promotes one, the node is already allowed there and its
//! relay follows the primary by itself, holding its device's I/O meanwhile.

use std::collections::HashMap;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Code, Status};

use crate::shared::args::{check_capabilities, require};
use crate::shared::class::REMOTE_ACCESS;
use crate::shared::nodes::admin;
use crate::spec::controller::Controller;
use crate::{shared::copies, shared::ids};

/// The publications a daemon keeps.
async fn publications(
    c: &mut ferrite_proto::ferrite::v1::admin_client::AdminClient<tonic::transport::Channel>,
) -> Result<Vec<pb::Publication>, Status> {
    Ok(c.list_publications(pb::ListPublicationsRequest {}).await?.into_inner().publications)
}

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
        if !self.nodes.is_node(&r.node_id) {
            return Err(Status::not_found(format!("node {:?} is not known", r.node_id)));
        }
        let (node, name) = ids::parse(&r.volume_id)
            .ok_or_else(|| Status::not_found(format!("volume {:?} does not exist", r.volume_id)))?;
        let (mut primary, mut c, vol, view) = copies::primary(&*self.nodes, node, name).await?;
        let holders = view.as_ref().map_or_else(|| vec![primary.clone()], |v| copies::nodes_of(&*self.nodes, v));
        if !holders.contains(&r.node_id) && !self.remote_access(&r.volume_id, &r.volume_context).await? {
            return Err(Status::failed_precondition(format!(
                "volume {:?} is accessible only on the nodes holding its copies ({}): node {} holds none, and \
                 the volume is not remote-access (a class with {REMOTE_ACCESS}: \"true\")",
                r.volume_id,
                holders.join(", "),
                r.node_id
            )));
        }
        // The primary serves an encrypted volume only with its key open; its copies get the key
        // too, so that the one promoted (here for locality, or when the primary's node is lost)
        // serves at once.
        crate::shared::keys::unlock(&mut c, &vol, &r.secrets, "ControllerPublishVolume").await?;
        if let Some(v) = view.as_ref().filter(|_| vol.encryption.is_some()) {
            crate::shared::keys::unlock_copies(&*self.nodes, v, &vol, &r.secrets).await;
        }
        let held = publications(&mut c).await?;
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
            let copies = self.standbys(&primary, view.as_ref(), name, &r.node_id, r.readonly).await;
            return Ok(self.context(&primary, p, &copies));
        }
        self.check_attach_limit(&r.node_id).await?;
        // Data locality: the node's in-sync copy becomes the primary. A copy still rebuilding
        // is not waited for: the node reaches the primary through its relay, as a node without
        // a copy does, until a later publication finds its copy in sync.
        let copy = view.as_ref().filter(|_| r.node_id != primary).and_then(|v| {
            let ep = self.nodes.admin_endpoint(&r.node_id)?;
            v.members.iter().find(|m| m.endpoint == ep && m.state != "witness")
        });
        if let Some(m) = copy.filter(|m| m.state != "in-sync") {
            tracing::info!(volume = name, node = %r.node_id, state = %m.state,
                "the copy there is not in sync: published from the primary, through the relay");
        }
        if copy.is_some_and(|m| m.state == "in-sync") {
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
        let copies = self.standbys(&primary, view.as_ref(), name, &r.node_id, r.readonly).await;
        tracing::info!(volume_id = %r.volume_id, node = %r.node_id, primary = %primary, ?copies, "CSI volume published");
        Ok(self.context(&primary, &p, &copies))
    }

    /// Whether volume `id` is accessible from every node: its context says (CreateVolume writes
    /// it), or, for a volume made before it did, its PV (one without node affinity). Outside
    /// Kubernetes such a volume is not.
    async fn remote_access(&self, id: &str, context: &HashMap<String, String>) -> Result<bool, Status> {
        if let Some(v) = context.get(REMOTE_ACCESS) {
            return Ok(v == "true");
        }
        let Some(client) = &self.kube else { return Ok(false) };
        let pv = crate::shared::pvs::remote_access(client, crate::spec::identity::DRIVER_NAME, id)
            .await
            .map_err(|e| Status::unavailable(format!("reading the PersistentVolume of {id:?}: {e}")))?;
        Ok(pv == Some(true))
    }

    /// Publishes `volume` to `node` on each copy but the primary's and the node's own, for a node
    /// that relays; returns their NBD listeners. A copy that does not answer or refuses is left
    /// out (logged): the node's relay cannot follow the primary there.
    async fn standbys(
        &self,
        primary: &str,
        view: Option<&pb::SyncVolume>,
        volume: &str,
        node: &str,
        read_only: bool,
    ) -> Vec<String> {
        let Some(v) = view.filter(|_| primary != node) else { return Vec::new() };
        let others: Vec<String> =
            copies::nodes_of(&*self.nodes, v).into_iter().filter(|n| n != primary && n != node).collect();
        let req =
            pb::PublishVolumeRequest { volume: volume.to_owned(), node: node.to_owned(), local: false, read_only };
        let scan = crate::shared::nodes::scan(&*self.nodes, others, |on, mut c| {
            let req = req.clone();
            async move {
                match c.publish_volume(req).await {
                    Ok(p) => {
                        Ok(Some(reachable(&p.into_inner().tcp_address, self.nodes.admin_endpoint(&on).as_deref())))
                    }
                    Err(e) => {
                        tracing::warn!(volume, node, on, error = %e.message(), "no standby publication on this copy");
                        Ok(None)
                    }
                }
            }
        })
        .await;
        scan.map(|s| s.answers.into_iter().filter_map(|(_, a)| a).filter(|a| !a.is_empty()).collect())
            .unwrap_or_default()
    }

    /// What NodeStage learns: where the volume is served, and how another node reaches it (the
    /// NBD listener's address, with the primary's own address where it listens on all; the
    /// standby copies' listeners, comma-separated).
    fn context(&self, primary: &str, p: &pb::Publication, copies: &[String]) -> HashMap<String, String> {
        let mut c =
            HashMap::from([("primary".to_owned(), primary.to_owned()), ("export".to_owned(), p.export.clone())]);
        if !p.tcp_address.is_empty() {
            c.insert("nbd".to_owned(), reachable(&p.tcp_address, self.nodes.admin_endpoint(primary).as_deref()));
        }
        if !copies.is_empty() {
            c.insert("copies".to_owned(), copies.join(","));
        }
        c
    }

    /// ResourceExhausted when `node` already has as many volumes published as NodeGetInfo says
    /// it takes. A daemon that does not answer (within the scan's time) is not counted: its
    /// volumes cannot be used until it is back or they fail over, and refusing every publish
    /// meanwhile would keep the failed-over ones from their pods.
    async fn check_attach_limit(&self, node: &str) -> Result<(), Status> {
        let held = crate::shared::nodes::scan(&*self.nodes, self.nodes.nodes(), |d, mut c| async move {
            let held = publications(&mut c).await?;
            Ok(held.into_iter().filter(|p| granted_to(p, &d) == node).map(|p| p.volume).collect::<Vec<_>>())
        })
        .await?;
        // A volume counts once, though its copies hold standby publications to the node too.
        let volumes: std::collections::BTreeSet<&String> = held.answers.iter().flat_map(|(_, v)| v).collect();
        let n = i64::try_from(volumes.len()).unwrap_or(i64::MAX);
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
        let (primary, mut c, _, view) = match copies::primary(&*self.nodes, node, name).await {
            Ok(found) => found,
            Err(s) if s.code() == Code::NotFound => return Ok(()),
            Err(s) => return Err(s),
        };
        self.unpublish_on(&mut c, &primary, name, &r.node_id).await?;
        // A copy that was the primary before a failover may still hold a publication to the
        // node (a daemon that steps down ends its own; one that was down then did not). A copy
        // that does not answer is skipped (logged).
        let others = view.iter().flat_map(|v| copies::nodes_of(&*self.nodes, v)).filter(|n| *n != primary).collect();
        let node = r.node_id.as_str();
        crate::shared::nodes::scan(&*self.nodes, others, |other, mut c| async move {
            self.unpublish_on(&mut c, &other, name, node).await
        })
        .await?;
        Ok(())
    }

    /// Ends the publication of `volume` on `on`'s daemon if it grants it to `node`.
    async fn unpublish_on(
        &self,
        c: &mut pb::admin_client::AdminClient<tonic::transport::Channel>,
        on: &str,
        volume: &str,
        node: &str,
    ) -> Result<(), Status> {
        let held = publications(c).await?;
        if held.iter().any(|p| p.volume == volume && granted_to(p, on) == node) {
            c.unpublish_volume(pb::UnpublishVolumeRequest { volume: volume.to_owned() }).await?;
            tracing::info!(volume, node, on, "CSI volume unpublished");
        }
        Ok(())
    }
}

/// `addr` (a listener's `host:port`) as other nodes reach it: an unspecified host (0.0.0.0,
/// [::]) becomes the host of `admin` (the daemon's `tcp://host:port` admin endpoint).
fn reachable(addr: &str, admin: Option<&str>) -> String {
    let Ok(sa) = addr.parse::<std::net::SocketAddr>() else { return addr.to_owned() };
    let host = admin.and_then(|a| a.strip_prefix("tcp://")).and_then(|a| a.rsplit_once(':')).map(|(h, _)| h);
    match host {
        Some(h) if sa.ip().is_unspecified() => format!("{h}:{}", sa.port()),
        _ => addr.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::reachable;

    #[test]
    fn listeners_on_every_address_are_reached_at_the_node() {
        assert_eq!(reachable("0.0.0.0:10809", Some("tcp://10.0.0.5:7070")), "10.0.0.5:10809");
        assert_eq!(reachable("[::]:10809", Some("tcp://[fd00::5]:7070")), "[fd00::5]:10809");
        assert_eq!(reachable("10.0.0.9:10809", Some("tcp://10.0.0.5:7070")), "10.0.0.9:10809");
        assert_eq!(reachable("0.0.0.0:10809", Some("/run/ferrite/admin.sock")), "0.0.0.0:10809");
    }
}
