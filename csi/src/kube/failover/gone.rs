//! Nodes gone for good. A deleted Node (hardware replaced, re-provisioned under a new name,
//! `kubectl delete node`) leaves the Node store and the directory, so no pass over the Nodes
//! looks at it again. Its primaries are found from the other side: a copy whose membership
//! names a primary at an address that no Node and no daemon in the directory has. Once that
//! primary does not answer either, it is handled as a lost node's: its address is fenced on
//! every daemon and a copy promoted, by the same rules. A Node that later shows up with an
//! address we fenced and without our record (the machine re-registered, or fenced by a release
//! that kept the record on the Node alone) gets one, so that the usual rejoin lifts the fence
//! once its copies are rebuilt. The daemons
//! run on the host network (deploy/), so a daemon's address is its Node's: a restarted daemon
//! keeps it, and is never taken for a gone one.

use std::collections::{BTreeMap, BTreeSet};

use ferrite_proto::ferrite::v1 as pb;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::runtime::events::EventType;

use super::{ANSWER, FENCE_OWNER, FENCED, Failover, addresses, block, host};
use crate::shared::nodes::admin;
use crate::shared::nodes::placements::recorded_on;

/// Copies of one volume that answer: (generation, node, in sync).
type Copies = Vec<(u64, String, bool)>;

impl Failover {
    pub(super) async fn gone(&self, views: &[(String, Vec<pb::SyncVolume>)]) -> anyhow::Result<()> {
        let nodes = self.node_store.state();
        // The addresses of the Nodes, and of the daemons on them (the directory may list a
        // deleted Node's daemon for a while: its pod outlives the Node until it is collected).
        let mut known: BTreeSet<String> = nodes.iter().flat_map(|n| addresses(n).collect::<Vec<_>>()).collect();
        let names: BTreeSet<String> = nodes.iter().map(|n| n.name_any()).collect();
        let endpoints =
            self.dir.nodes().into_iter().filter(|n| names.contains(n)).filter_map(|n| self.dir.admin_endpoint(&n));
        known.extend(endpoints.map(|e| host(&e).to_owned()));
        let by_host = self.by_host(&nodes);
        // Primary endpoint → volume → its copies.
        let mut orphans: BTreeMap<String, BTreeMap<String, Copies>> = BTreeMap::new();
        for (node, views) in views {
            let me = self.dir.admin_endpoint(node).map(|e| host(&e).to_owned()).unwrap_or_default();
            let mine = |v: &&pb::SyncVolume| recorded_on(self.dir.placements(), node, &v.volume);
            for v in views.iter().filter(mine).filter(|v| v.role == "replica" && !known.contains(host(&v.primary))) {
                let in_sync = v.members.iter().any(|m| host(&m.endpoint) == me && m.state == "in-sync");
                let copies = orphans.entry(v.primary.clone()).or_default().entry(v.volume.clone()).or_default();
                copies.push((v.generation, node.clone(), in_sync));
            }
        }
        let holders = super::protect::holders(views, [], |h| by_host.get(h).cloned());
        for (primary, volumes) in orphans {
            if self.answers(&primary).await {
                continue; // a daemon the directory does not list yet
            }
            let Some(fence) = block(host(&primary)) else { continue };
            tracing::warn!(
                primary,
                fence,
                "the primary of {} volumes is on no known node and silent: fencing it",
                volumes.len()
            );
            let round = self.fence(&BTreeSet::new(), std::slice::from_ref(&fence), true, false).await;
            if !round.missing.is_empty() {
                tracing::warn!(primary, "the fence does not hold everywhere yet: {}", round.refused().join("; "));
            }
            // What the fence protects: a volume whose every holder has it (protect.rs).
            let withheld = super::protect::withheld(&holders, &BTreeSet::new(), &round);
            for (volume, mut copies) in volumes {
                copies.sort_by(|a, b| b.cmp(a));
                let fenced = !withheld.contains_key(&volume);
                let (kind, reason, note) = match self.promote(&volume, &copies, fenced).await {
                    Ok((to, generation)) => (
                        EventType::Warning,
                        "FailedOver",
                        format!(
                            "the primary's node ({primary}) is gone (no Node has its address): fenced it and promoted \
                             the copy on {to} (generation {generation})"
                        ),
                    ),
                    Err(e) => (
                        EventType::Warning,
                        "FailoverPending",
                        format!("the primary's node ({primary}) is gone, and no copy could be promoted yet: {e}"),
                    ),
                };
                tracing::warn!(volume, "{note}");
                self.event(&volume, None, kind, reason, "Failover", note).await;
            }
        }
        self.adopt(&nodes).await
    }

    /// Whether the daemon at `endpoint` answers, though the directory does not list it.
    async fn answers(&self, endpoint: &str) -> bool {
        let ask = async {
            let ch =
                ferrite_proto::connect_as(endpoint, self.dir.tls(), self.dir.server_name().as_deref()).await.ok()?;
            pb::admin_client::AdminClient::new(ch).pool_status(pb::PoolStatusRequest {}).await.ok()
        };
        tokio::time::timeout(ANSWER, ask).await.ok().flatten().is_some()
    }

    /// Records (and annotates) the Nodes that have an address failover fenced but no record of
    /// ours. The fences are read from the first daemon that answers (every one holds the same).
    async fn adopt(&self, nodes: &[std::sync::Arc<Node>]) -> anyhow::Result<()> {
        let mut fences = None;
        for node in self.dir.nodes() {
            let ask = async { admin(&*self.dir, &node).await?.list_fences(pb::ListFencesRequest {}).await };
            if let Ok(Ok(r)) = tokio::time::timeout(ANSWER, ask).await {
                fences = Some(r.into_inner().fences);
                break;
            }
        }
        let ours = format!("/{FENCE_OWNER}");
        let by_us: BTreeSet<String> =
            fences.into_iter().flatten().filter(|f| f.by.iter().any(|b| b.ends_with(&ours))).map(|f| f.cidr).collect();
        // A block recorded for another Node that exists, or an address another Node lists, is
        // not this one's to adopt: its kubelet may have written it into its status.
        let names: BTreeSet<String> = nodes.iter().map(|n| n.name_any()).collect();
        let recorded = self.recorded_blocks();
        for n in nodes.iter().filter(|n| self.recorded(&n.name_any(), FENCED).is_none()) {
            let name = n.name_any();
            let mine: BTreeSet<String> = addresses(n).collect();
            let shared = super::lost::shared(&name, &mine, nodes);
            let theirs =
                |b: &String| recorded.iter().any(|(r, owner)| r == b && *owner != name && names.contains(owner));
            let blocks: Vec<String> = mine
                .iter()
                .filter(|a| !shared.contains(*a))
                .filter_map(|a| block(a))
                .filter(|b| by_us.contains(b) && !theirs(b))
                .collect();
            if !blocks.is_empty() {
                tracing::warn!(node = %n.name_any(), ?blocks, "a node came back at addresses failover fenced: adopting the fence");
                self.annotate(&n.name_any(), &[(FENCED, Some(blocks.join(",")))]).await?;
            }
        }
        Ok(())
    }
}
