//! Lost nodes, all at once. A rack, a switch or a zone takes many nodes at the same moment: one
//! pass fences every lost node on the daemons that answer, reads their memberships once, and
//! promotes a copy of every volume whose primary was on any of them, [`FAN_OUT`] calls at a
//! time. A node's or a volume's error is its own (a log line and an Event) and the pass goes on.
//! A volume's release waits only for the fence on the daemons that hold it (`protect.rs`): a
//! silent bystander holds up nothing; a silent holder keeps that volume's pods where they are,
//! counted (`ferrite_failover_release_withheld`) and named in a `FenceIncomplete` Event, and the
//! fence is sent again every pass. A returning node's fence is lifted once a majority of the
//! daemons lifted it; those that did not answer are retried every pass until they do
//! ([`UNFENCE`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use ferrite_proto::ferrite::v1 as pb;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use tonic::Code;

use super::workload::Release;
use super::{FAN_OUT, FENCED, Failover, addresses, block, host, protect};
use crate::shared::nodes::admin;
use crate::shared::nodes::placements::recorded_on;

/// The annotation on a Node whose fence a majority of daemons lifted, while the rest (down or
/// unreachable then) still hold it: the blocks, lifted on them as they answer again.
pub const UNFENCE: &str = "failover.ferrite.dev/unfence";

/// Copies of one volume that answer, newest first: (generation, node, in sync).
type Copies = Vec<(u64, String, bool)>;

/// A lost node as this pass fences it.
struct Lost {
    node: Arc<Node>,
    why: String,
    /// Since when (not Ready, or its heartbeat's last renewal).
    since: Timestamp,
    /// Its addresses (the Node's and its daemon's), and their fence blocks.
    addrs: BTreeSet<String>,
    blocks: Vec<String>,
}

/// The addresses of `addrs` (node `name`'s) that another of the Nodes `all` lists too.
pub(super) fn shared(name: &str, addrs: &BTreeSet<String>, all: &[Arc<Node>]) -> BTreeSet<String> {
    let others: BTreeSet<String> = all.iter().filter(|n| n.name_any() != name).flat_map(|n| addresses(n)).collect();
    addrs.iter().filter(|a| others.iter().any(|o| ferrite_tls::same_name(o, a))).cloned().collect()
}

/// What failover fences for lost node `name`: its addresses (`addrs`, as its Node and the
/// directory say) and those the signer recorded as first issued to it (`owners`: address →
/// node), less those that are another node's: recorded as another's, or listed by another Node
/// and not recorded as this one's. Kubelets write their Nodes' addresses; the record is the
/// controller's, so a node listing a lost peer's address does not spare it, and a lost node
/// listing a live one's does not fence it. Returns (to fence, left out as another's).
pub(super) fn fenced_addresses(
    name: &str,
    mut addrs: BTreeSet<String>,
    all: &[Arc<Node>],
    owners: &BTreeMap<String, String>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let owner = |a: &str| owners.iter().find(|(r, _)| ferrite_tls::same_name(r, a)).map(|(_, o)| o.as_str());
    addrs.extend(owners.iter().filter(|(_, o)| *o == name).map(|(a, _)| a.clone()));
    let listed = shared(name, &addrs, all);
    let theirs: BTreeSet<String> = addrs
        .iter()
        .filter(|a| match owner(a) {
            Some(o) => o != name,
            None => listed.contains(*a),
        })
        .cloned()
        .collect();
    addrs.retain(|a| !theirs.contains(a));
    (addrs, theirs)
}

impl Failover {
    /// The signer's record of which node each address was first issued to, of the Nodes in
    /// `all` (empty without a record, or when it cannot be read: the Nodes' own lists then).
    async fn address_owners(&self, all: &[Arc<Node>]) -> BTreeMap<String, String> {
        let record = match crate::kube::certs::addresses::read(&self.client, &self.namespace).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("failover: the signer's address record: {e:#}");
                None
            }
        };
        let exists = |n: &str| all.iter().any(|o| o.name_any() == n);
        crate::kube::certs::addresses::owners(record.as_ref(), exists)
    }

    /// Fences every node of `lost` (each with why it is lost) and promotes a copy of every
    /// volume whose primary was on one of them.
    pub(super) async fn fail_over(&self, lost: Vec<(Arc<Node>, String, Timestamp)>) {
        let names: BTreeSet<String> = lost.iter().map(|(n, ..)| n.name_any()).collect();
        let all = self.node_store.state();
        let owners = self.address_owners(&all).await;
        let mut nodes = Vec::new();
        for (node, why, since) in lost {
            let name = node.name_any();
            let mut addrs: BTreeSet<String> = addresses(&node).collect();
            if let Some(at) = self.dir.admin_endpoint(&name) {
                addrs.insert(host(&at).to_owned());
            }
            let (addrs, theirs) = fenced_addresses(&name, addrs, &all, &owners);
            if !theirs.is_empty() {
                let e = anyhow::anyhow!("addresses {theirs:?} of lost node {name} are other nodes' too: not fenced");
                self.failed(&node, &e).await;
            }
            let blocks: Vec<String> = addrs.iter().filter_map(|a| block(a)).collect();
            if blocks.is_empty() {
                let e = anyhow::anyhow!("node {name} is lost but has no address to fence: its volumes stay");
                self.failed(&node, &e).await;
                continue;
            }
            nodes.push(Lost { node, why, since, addrs, blocks });
        }
        // The annotations first: a fence whose author is not written down would never be lifted.
        let annotated = futures_util::stream::iter(nodes)
            .map(|l| async move {
                let name = l.node.name_any();
                if self.recorded(&name, FENCED).is_some_and(|b| b == l.blocks) {
                    return Some(l);
                }
                tracing::warn!(node = %name, fence = ?l.blocks, "node lost ({}): fencing it", l.why);
                let fenced = Some(l.blocks.join(","));
                match self.annotate(&name, &[(FENCED, fenced), (UNFENCE, None)]).await {
                    Ok(()) => {
                        self.metrics.nodes_lost.inc();
                        Some(l)
                    }
                    Err(e) => {
                        self.failed(&l.node, &e).await;
                        None
                    }
                }
            })
            .buffer_unordered(FAN_OUT);
        let nodes: Vec<Lost> = annotated.filter_map(|l| async { l }).collect().await;
        if nodes.is_empty() {
            return;
        }
        let blocks: Vec<String> = nodes.iter().flat_map(|l| l.blocks.iter().cloned()).collect();
        // The fence and the memberships at once: a silent daemon costs one wait, not two.
        let (round, views) = tokio::join!(self.fence(&names, &blocks, true, true), self.views(&names, true));
        if !round.missing.is_empty() {
            tracing::warn!(nodes = ?names, "the fence does not hold everywhere yet: {}", round.refused().join("; "));
        }
        // Volumes whose primary was on a lost node, with the copies that answer; and the volumes
        // served elsewhere already (promoted by an earlier pass).
        let mut volumes: BTreeMap<String, (usize, Copies)> = BTreeMap::new();
        // What the fence protects: each volume whose every holder outside the lost set has it.
        let by_host = self.by_host(&all);
        let holders = protect::holders(&views, self.homes(), |h| by_host.get(h).cloned());
        let withheld = protect::withheld(&holders, &names, &round);
        let withheld = &withheld;
        // Only the nodes recorded for a volume speak for it.
        let mine = |node: &str, v: &pb::SyncVolume| recorded_on(self.dir.placements(), node, &v.volume);
        let mut elsewhere: BTreeSet<String> = views
            .iter()
            .flat_map(|(n, vs)| vs.iter().filter(|v| v.role == "primary" && mine(n, v)))
            .map(|v| v.volume.clone())
            .collect();
        for (node, views) in views {
            let me = self.dir.admin_endpoint(&node).map(|e| host(&e).to_owned()).unwrap_or_default();
            for v in views.into_iter().filter(|v| v.role == "replica" && mine(&node, v)) {
                let Some(at) = nodes.iter().position(|l| l.addrs.contains(host(&v.primary))) else { continue };
                let in_sync = v.members.iter().any(|m| host(&m.endpoint) == me && m.state == "in-sync");
                volumes.entry(v.volume).or_insert_with(|| (at, Vec::new())).1.push((
                    v.generation,
                    node.clone(),
                    in_sync,
                ));
            }
        }
        let nodes = &nodes;
        let promoted: Vec<Option<String>> = futures_util::stream::iter(volumes)
            .map(|(volume, (at, mut copies))| async move {
                copies.sort_by(|a, b| b.cmp(a));
                let Lost { node, why, since, .. } = &nodes[at];
                let name = node.name_any();
                let promoted = self.promote(&volume, &copies, !withheld.contains_key(&volume)).await;
                let moved = promoted.is_ok();
                self.metrics.promoted(moved);
                if promoted.is_ok() {
                    self.metrics.recovery.observe(Timestamp::now().duration_since(*since).as_secs_f64().max(0.0));
                }
                let (kind, reason, note) = match promoted {
                    Ok((to, generation)) => (
                        EventType::Warning,
                        "FailedOver",
                        format!(
                            "node {name} was lost ({why}): fenced it and promoted the copy on {to} \
                             (generation {generation})"
                        ),
                    ),
                    Err(e) => (
                        EventType::Warning,
                        "FailoverPending",
                        format!("node {name} was lost, and no copy could be promoted yet: {e}"),
                    ),
                };
                tracing::warn!(volume, "{note}");
                self.event(&volume, Some(node), kind, reason, "Failover", note).await;
                moved.then_some(volume)
            })
            .buffer_unordered(FAN_OUT)
            .collect()
            .await;
        elsewhere.extend(promoted.into_iter().flatten());
        // The nodes can no longer write the volumes the fence protects: the pods using only those
        // may run elsewhere. The rest wait for the fence, retried every pass.
        let elsewhere = &elsewhere;
        let kept = &std::sync::atomic::AtomicUsize::new(0);
        futures_util::stream::iter(nodes)
            .for_each_concurrent(FAN_OUT, |l| async move {
                match self.release(&l.node, elsewhere, withheld).await {
                    Ok(n) => _ = kept.fetch_add(n, std::sync::atomic::Ordering::Relaxed),
                    Err(e) => self.failed(&l.node, &e).await,
                }
            })
            .await;
        let kept = kept.load(std::sync::atomic::Ordering::Relaxed);
        self.metrics.release_withheld.set(i64::try_from(kept).unwrap_or(i64::MAX));
    }

    /// Taints fenced node `node` (if not Ready), deletes its pods that use our volumes, and our
    /// VolumeAttachments to it unless the out-of-service taint has Kubernetes detach them. On a
    /// Ready node only those of the volumes served `elsewhere` now (`workload.rs`). Nothing of a
    /// volume whose fence does not hold yet (`withheld`): how many pods and attachments wait,
    /// with a Warning Event on the Node naming the daemons the fence waits for.
    async fn release(
        &self,
        node: &Node,
        elsewhere: &BTreeSet<String>,
        withheld: &BTreeMap<String, Vec<String>>,
    ) -> anyhow::Result<usize> {
        let name = node.name_any();
        let which = Release { ready: super::ready(node), moved: elsewhere, withheld };
        let out_of_service = self.taint(&name, true, withheld.is_empty()).await?;
        let mut kept = self.delete_pods(&name, which).await?;
        if !out_of_service {
            kept.extend(self.detach(&name, which).await?);
        }
        if !kept.is_empty() {
            let waits: BTreeSet<&String> = kept.iter().filter_map(|v| withheld.get(v)).flatten().collect();
            let e = anyhow::anyhow!(
                "node {name} is lost; its fence does not hold yet on {waits:?}, which hold its volumes {kept:?}: \
                 their pods and attachments stay until it does (retried every pass)"
            );
            self.fence_incomplete(node, &e).await;
        }
        Ok(kept.len())
    }

    /// Promotes the first copy the daemons accept; returns its node and generation. Without a
    /// majority (two copies), an in-sync copy is promoted by force, once the fence holds.
    pub(super) async fn promote(
        &self,
        volume: &str,
        copies: &[(u64, String, bool)],
        fenced: bool,
    ) -> Result<(String, u64), String> {
        let mut refused = Vec::new();
        for (_, node, in_sync) in copies {
            self.leading().await.map_err(|e| e.to_string())?;
            let mut c = admin(&*self.dir, node).await.map_err(|e| e.message().to_owned())?;
            let req = |force| pb::PromoteReplicationRequest { volume: volume.to_owned(), force };
            let done = match c.promote_sync_replica(req(false)).await {
                Err(e) if e.code() == Code::Unavailable && *in_sync && fenced => {
                    tracing::warn!(
                        volume,
                        node,
                        "no majority of the copies answers: the fenced old primary \
                        cannot take writes, promoting the in-sync copy by force"
                    );
                    c.promote_sync_replica(req(true)).await
                }
                other => other,
            };
            match done {
                Ok(v) => return Ok((node.clone(), v.into_inner().generation)),
                Err(e) => refused.push(format!("{node}: {}", e.message())),
            }
        }
        Err(refused.join("; "))
    }

    /// Lifts the fence of a node that came back once every membership it is in has it in sync
    /// (as the daemons' `views` of this pass say): on every daemon that answers, done when a
    /// majority did (the rest: [`UNFENCE`]).
    pub(super) async fn rejoin(&self, n: &Node, views: &[(String, Vec<pb::SyncVolume>)]) -> anyhow::Result<()> {
        let name = n.name_any();
        let blocks = self.recorded(&name, FENCED).unwrap_or_default();
        let hosts: BTreeSet<&str> = blocks.iter().map(|b| b.split_once('/').map_or(b.as_str(), |(h, _)| h)).collect();
        let me = BTreeSet::from([name.clone()]);
        let mut member_of = Vec::new();
        for (_, views) in views.iter().filter(|(node, _)| *node != name) {
            for v in views.iter().filter(|v| v.role == "primary") {
                let Some(m) = v.members.iter().find(|m| hosts.contains(host(&m.endpoint))) else { continue };
                if m.state != "in-sync" {
                    tracing::info!(node = %name, volume = %v.volume, state = %m.state, reason = %m.reason,
                        "returning node not in sync yet; fence kept");
                    return Ok(());
                }
                member_of.push(v.volume.clone());
            }
        }
        let round = self.fence(&me, &blocks, false, false).await;
        let refused = round.refused();
        if !round.majority() {
            anyhow::bail!("lifting the fence of {name}: a majority of the daemons did not: {}", refused.join("; "));
        }
        self.taint(&name, false, false).await?;
        let pending = (!refused.is_empty()).then(|| blocks.join(","));
        self.annotate(&name, &[(FENCED, None), (UNFENCE, pending)]).await?;
        tracing::info!(node = %name, volumes = ?member_of, still_fenced_on = ?refused, "returned node in sync everywhere: fence lifted");
        for volume in member_of {
            let note = format!(
                "node {name} came back, was rebuilt from what changed and is in sync again; its fence is lifted"
            );
            self.event(&volume, Some(n), EventType::Normal, "Rejoined", "Rebuild", note).await;
        }
        Ok(())
    }

    /// Lifts a returned node's fence on the daemons that missed it ([`UNFENCE`]).
    pub(super) async fn unfence_rest(&self, n: &Node) -> anyhow::Result<()> {
        let name = n.name_any();
        let blocks = self.recorded(&name, UNFENCE).unwrap_or_default();
        let round = self.fence(&BTreeSet::from([name.clone()]), &blocks, false, false).await;
        if round.missing.is_empty() {
            self.annotate(&name, &[(UNFENCE, None)]).await?;
            tracing::info!(node = %name, "the fence is lifted on every daemon");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_address_another_node_lists_is_not_this_nodes_to_fence() {
        use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeStatus};
        use std::sync::Arc;
        let node = |name: &str, ips: &[&str]| {
            let addresses = ips.iter().map(|a| NodeAddress { type_: "InternalIP".into(), address: (*a).into() });
            Arc::new(Node {
                metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
                status: Some(NodeStatus { addresses: Some(addresses.collect()), ..Default::default() }),
                ..Default::default()
            })
        };
        let all = [node("a", &["10.0.0.5", "10.0.0.6"]), node("b", &["10.0.0.6"])];
        let addrs: std::collections::BTreeSet<String> = ["10.0.0.5".to_owned(), "10.0.0.6".to_owned()].into();
        assert_eq!(super::shared("a", &addrs, &all), ["10.0.0.6".to_owned()].into());
        assert!(super::shared("b", &["10.0.0.6".to_owned()].into(), &all[1..]).is_empty());
        let set = |v: &[&str]| v.iter().map(|a| (*a).to_owned()).collect::<std::collections::BTreeSet<String>>();
        // Without the signer's record: what another Node lists is spared.
        let none = std::collections::BTreeMap::new();
        assert_eq!(super::fenced_addresses("a", addrs.clone(), &all, &none), (set(&["10.0.0.5"]), set(&["10.0.0.6"])));
        // The record says 10.0.0.6 was issued to a first: b listing it does not spare it, and an
        // address recorded for a but missing from its Node's list is fenced too.
        let owners =
            [("10.0.0.6", "a"), ("10.0.0.7", "a"), ("10.0.0.5", "b")].map(|(a, n)| (a.to_owned(), n.to_owned())).into();
        assert_eq!(
            super::fenced_addresses("a", addrs.clone(), &all, &owners),
            (set(&["10.0.0.6", "10.0.0.7"]), set(&["10.0.0.5"])),
            "10.0.0.5, recorded as b's, is never a's to fence"
        );
    }
}
