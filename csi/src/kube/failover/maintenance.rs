//! Planned maintenance: a cordoned node (`kubectl cordon`, the first step of `kubectl drain`)
//! hands the primaries it holds over to in-sync copies on schedulable nodes, without a fence.
//! The copy is promoted as the daemons' rule allows (an in-sync member of the newest
//! generation, with a majority), the old primary takes the new generation and is rebuilt as a
//! replica from what changed; no data moves but the marks. A volume still published (its pod
//! not evicted yet) is left until the drain has evicted the pod and the volume is detached, so
//! no writer loses its connection in the middle of a request; its next publication then goes
//! to the new primary.

use std::time::Duration;

use ferrite_proto::ferrite::v1 as pb;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::runtime::events::EventType;

use super::{ANSWER, FENCED, host, ready};
use crate::shared::nodes::admin;

/// Whether a node may take primaries: Ready, schedulable, not `fenced` (by our records).
pub(super) fn usable(n: &Node, fenced: bool) -> bool {
    let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    ready(n) && !cordoned && !fenced
}

/// The annotation that puts a node in maintenance without cordoning it; its value may say for
/// how long at most ("90m", "2h"; else [`MAINTENANCE_BOUND`]).
pub const MAINTENANCE: &str = "failover.ferrite.dev/maintenance";
/// How long a node in maintenance (cordoned, drained or annotated) may be away before its copies
/// are replaced: a kernel update or a firmware flash, not a dead board. LINSTOR waits 60 min
/// for a node it was told about; past this its copies are replaced as any lost node's.
pub const MAINTENANCE_BOUND: Duration = Duration::from_secs(60 * 60);

/// How long node `n`'s copies may be away while it is in maintenance; None when it is not.
pub(super) fn in_maintenance(n: &Node) -> Option<Duration> {
    let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    match n.annotations().get(MAINTENANCE) {
        Some(v) => Some(crate::shared::class::parse_duration(v).filter(|d| !d.is_zero()).unwrap_or(MAINTENANCE_BOUND)),
        None => cordoned.then_some(MAINTENANCE_BOUND),
    }
}

/// Whether node `n` is cordoned (and not `fenced`: a fenced node's volumes failed over already).
pub(super) fn cordoned(n: &Node, fenced: bool) -> bool {
    n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false) && !fenced
}

impl super::Failover {
    /// Hands the unpublished primaries on node `n`, which `why` ("is cordoned"), over to in-sync
    /// copies elsewhere.
    pub(super) async fn hand_over(&self, n: &Node, why: &str) -> anyhow::Result<()> {
        let name = n.name_any();
        let ask = async {
            let mut c = admin(&*self.dir, &name).await?;
            let held = c.list_sync_replicas(pb::ListReplicationsRequest::default()).await?.into_inner().volumes;
            let published = c.list_publications(pb::ListPublicationsRequest {}).await?.into_inner().publications;
            Ok::<_, tonic::Status>((held, published))
        };
        let (held, published) = tokio::time::timeout(ANSWER, ask)
            .await
            .map_err(|_| anyhow::anyhow!("handing over: the daemon of node {name} did not answer"))?
            .map_err(|e| anyhow::anyhow!("handing over from node {name}: {}", e.message()))?;
        // Where each usable node's daemon is (by host), to find the copies' nodes.
        let usable: Vec<(String, String)> = self
            .node_store
            .state()
            .iter()
            .filter(|n| usable(n, self.recorded(&n.name_any(), FENCED).is_some()))
            .filter_map(|n| Some((host(&self.dir.admin_endpoint(&n.name_any())?).to_owned(), n.name_any())))
            .collect();
        for (v, copies) in ferrite_proto::hand_over::movable(&held, &published) {
            let to = copies
                .iter()
                .filter_map(|m| usable.iter().find(|(h, _)| h == host(&m.endpoint)))
                .map(|(_, n)| n)
                .next();
            let Some(to) = to else {
                tracing::warn!(node = %name, volume = %v.volume, "{why}, but no in-sync copy is on a usable node");
                continue;
            };
            self.leading().await?;
            let promote = async {
                let mut c = admin(&*self.dir, to).await?;
                let req = pb::PromoteReplicationRequest { volume: v.volume.clone(), force: false };
                c.promote_sync_replica(req).await
            };
            match tokio::time::timeout(ANSWER, promote).await {
                Ok(Ok(r)) => {
                    let note = format!(
                        "node {name} {why}: handed the primary over to the in-sync copy on {to} \
                         (generation {}), without a fence",
                        r.get_ref().generation
                    );
                    tracing::info!(volume = %v.volume, "{note}");
                    self.event(&v.volume, Some(n), EventType::Normal, "HandedOver", "Promote", note).await;
                }
                Ok(Err(e)) => tracing::warn!(volume = %v.volume, to, "handing over: {}", e.message()),
                Err(_) => tracing::warn!(volume = %v.volume, to, "handing over: no answer within {ANSWER:?}"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSpec;

    #[test]
    fn a_cordoned_or_annotated_node_is_in_maintenance_for_a_bound() {
        let node = |cordoned: bool, note: Option<&str>| {
            let mut n = Node {
                spec: Some(NodeSpec { unschedulable: Some(cordoned), ..Default::default() }),
                ..Default::default()
            };
            if let Some(v) = note {
                n.annotations_mut().insert(MAINTENANCE.into(), v.into());
            }
            n
        };
        assert_eq!(in_maintenance(&node(false, None)), None);
        assert_eq!(in_maintenance(&node(true, None)), Some(MAINTENANCE_BOUND));
        assert_eq!(in_maintenance(&node(false, Some("2h"))), Some(Duration::from_secs(7200)));
        assert_eq!(in_maintenance(&node(true, Some("soon"))), Some(MAINTENANCE_BOUND), "unreadable: the bound");
    }
}
