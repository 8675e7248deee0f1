//! Copies replaced by themselves. A replicated volume's member whose node is gone (its Node
//! deleted) or whose daemon has not answered for the class's `replace-after` is replaced: a new
//! copy (or witness) on another node first, rebuilt by the primary, then the lost member
//! removed. Each step is one membership change that a majority of the old and the new members
//! records, as the daemons require of any change: with four members while the new copy
//! rebuilds, three must answer, the three that do. One change per volume and pass: the next
//! pass sees its outcome (a copy still rebuilding is waited for).
//!
//! The PV's node affinity then follows the copies. A PV's affinity is immutable unless the
//! cluster runs the `MutablePVNodeAffinity` feature (alpha in Kubernetes 1.35), so where a patch
//! is refused the PV is re-created under the same name with the same claim, as LINSTOR's
//! affinity controller does: its reclaim policy set to Retain first (deleting the object never
//! deletes the volume), the object deleted and its finalizers cleared, then created again with
//! the new affinity and its own policy. The claim keeps its binding (the PV controller binds a
//! PV whose claimRef names the claim's uid), attachments name the PV by name.
//!
//! A replaced copy whose node comes back still holds the membership it was removed from: the
//! primary sends it the current one (it forgets the old), and the copy is deleted.
//!
//! The controller keeps no state but when it first saw each member lost: after a restart (or a
//! new leader) the delay starts over, which only ever makes a replacement later.
//!
//! A sweep runs in a task of its own beside the failover passes (a loss is acted on while copies
//! are being replaced), one at a time, and takes at most [`STEPS`] steps, [`AT_ONCE`] at a time:
//! after a zone's outage past `replace-after`, hundreds of volumes need a step each, at tens of
//! seconds a step. The next sweep starts after the last volume this one stepped.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferrite_proto::ferrite::v1 as pb;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolume, VolumeNodeAffinity,
};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;

use super::Failover;
use crate::shared::args::TOPOLOGY_KEY;
use crate::shared::class::{Class, REPLACE_AFTER, Spread};
use crate::shared::copies::{self, node_of};
use crate::shared::nodes::admin;
use crate::shared::nodes::placements::confirmed;

/// The annotation that keeps a PV's own reclaim policy while it is re-created.
const RECLAIM: &str = "ferrite.dev/reclaim-policy";

/// When each (volume, member endpoint) was first seen lost.
pub(super) type LostSince = Mutex<BTreeMap<(String, String), Instant>>;

/// Most membership steps one sweep takes, and how many at once.
const STEPS: usize = 16;
const AT_ONCE: usize = 4;

/// One membership change, or a reason to wait.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    AddCopy,
    AddWitness,
    Remove(String),
    /// A member is joining or rebuilding: its outcome first.
    Wait,
}

/// What `view` (a primary's) needs next, given the members `lost` past the class's delay and
/// the `copies` the class asks for (two get a witness too). None: nothing is lost.
fn plan(view: &pb::SyncVolume, lost: &BTreeSet<String>, copies: usize) -> Option<Step> {
    if lost.is_empty() {
        return None;
    }
    let kept: Vec<&pb::SyncMember> = view.members.iter().filter(|m| !lost.contains(&m.endpoint)).collect();
    if kept.iter().any(|m| !matches!(m.state.as_str(), "primary" | "in-sync" | "witness")) {
        return Some(Step::Wait);
    }
    let data = kept.iter().filter(|m| m.state != "witness").count();
    let witness = kept.iter().any(|m| m.state == "witness");
    Some(if data < copies {
        Step::AddCopy
    } else if copies == 2 && !witness {
        Step::AddWitness
    } else {
        Step::Remove(lost.iter().next().cloned().unwrap_or_default())
    })
}

/// The nodes a PV's affinity names (the values of our topology key).
fn affinity_nodes(pv: &PersistentVolume) -> BTreeSet<String> {
    let terms = pv.spec.as_ref().and_then(|s| s.node_affinity.as_ref()).and_then(|a| a.required.as_ref());
    terms
        .iter()
        .flat_map(|r| &r.node_selector_terms)
        .flat_map(|t| t.match_expressions.iter().flatten())
        .filter(|e| e.key == TOPOLOGY_KEY)
        .flat_map(|e| e.values.iter().flatten().cloned())
        .collect()
}

/// The affinity of a volume served on `nodes`, as the provisioner writes it from CreateVolume's
/// accessible topology: one term per node.
fn affinity(nodes: &BTreeSet<String>) -> VolumeNodeAffinity {
    let term = |n: &String| NodeSelectorTerm {
        match_expressions: Some(vec![NodeSelectorRequirement {
            key: TOPOLOGY_KEY.to_owned(),
            operator: "In".to_owned(),
            values: Some(vec![n.clone()]),
        }]),
        match_fields: None,
    };
    VolumeNodeAffinity { required: Some(NodeSelector { node_selector_terms: nodes.iter().map(term).collect() }) }
}

/// A replicated PV of ours: its volume and its class.
fn replicated(pv: &PersistentVolume, driver: &str) -> Option<(String, Class)> {
    let csi = pv.spec.as_ref()?.csi.as_ref().filter(|c| c.driver == driver)?;
    let (_, name) = crate::shared::ids::parse(&csi.volume_handle)?;
    let attrs: std::collections::HashMap<String, String> =
        csi.volume_attributes.clone().unwrap_or_default().into_iter().collect();
    let class = Class::from_context(&attrs)?;
    (class.replicas > 1).then(|| (name.to_owned(), class))
}

/// Keeps the first `max` of `items` by name (`name_of`) after `from`, wrapping around, and
/// moves `from` to the last kept: successive sweeps go round every volume that needs a step.
fn budget<T>(items: &mut Vec<T>, from: &mut String, max: usize, name_of: impl Fn(&T) -> &String) {
    items.sort_by(|a, b| {
        let (a, b) = (name_of(a), name_of(b));
        (a <= &*from, a).cmp(&(b <= &*from, b))
    });
    items.truncate(max);
    if let Some(last) = items.last() {
        from.clone_from(name_of(last));
    }
}

impl Failover {
    /// One look at every replicated PV, with every daemon's memberships (`views`).
    pub(super) async fn replace(&self, views: &[(String, Vec<pb::SyncVolume>)]) -> anyhow::Result<()> {
        self.resume_moves().await;
        let answered: BTreeSet<&str> = views.iter().map(|(n, _)| n.as_str()).collect();
        // Each volume's primary that takes writes, the newest generation's, with a majority of
        // its recorded members behind it where the volume has a record.
        let records = self.dir.placements();
        let mut by_volume: BTreeMap<&str, Vec<(&str, &pb::SyncVolume)>> = BTreeMap::new();
        for (node, v) in views.iter().flat_map(|(n, vs)| vs.iter().map(move |v| (n.as_str(), v))) {
            by_volume.entry(&v.volume).or_default().push((node, v));
        }
        let backed = |node: &str, v: &pb::SyncVolume| match records.and_then(|r| r.get(&v.volume)) {
            Some(placed) => {
                confirmed(&placed, node, v, by_volume.get(v.volume.as_str()).into_iter().flatten().copied())
            }
            None => true,
        };
        let mut primaries: BTreeMap<&str, (&str, &pb::SyncVolume)> = BTreeMap::new();
        for (node, v) in views.iter().flat_map(|(n, vs)| vs.iter().map(move |v| (n, v))) {
            if v.role == "primary" && v.refused.is_empty() && backed(node, v) {
                let newer = primaries.get(v.volume.as_str()).is_none_or(|(_, p)| v.generation > p.generation);
                if newer {
                    primaries.insert(&v.volume, (node, v));
                }
            }
        }
        let now = Instant::now();
        let mut seen = BTreeSet::new();
        // Nodes in maintenance (cordoned, drained, or annotated): their copies wait longer.
        let maintenance: BTreeMap<String, Duration> = self
            .node_store
            .state()
            .iter()
            .filter_map(|n| Some((n.name_any(), super::maintenance::in_maintenance(n)?)))
            .collect();
        let mut steps = Vec::new();
        for pv in self.volume_store.state() {
            let Some((name, class)) = replicated(&pv, &self.driver) else { continue };
            let Some((node, view)) = primaries.get(name.as_str()).copied() else { continue };
            let mut lost = BTreeSet::new();
            for m in view.members.iter().filter(|m| m.endpoint != view.primary) {
                let up = node_of(&*self.dir, &m.endpoint).is_some_and(|n| answered.contains(n.as_str()));
                if up {
                    continue;
                }
                let key = (name.clone(), m.endpoint.clone());
                let since = *self.lost_since.lock().expect("not poisoned").entry(key.clone()).or_insert(now);
                seen.insert(key);
                let bound = node_of(&*self.dir, &m.endpoint).and_then(|n| maintenance.get(&n).copied());
                if class.replace_after.is_some_and(|a| now.duration_since(since) >= a.max(bound.unwrap_or_default())) {
                    lost.insert(m.endpoint.clone());
                }
            }
            match plan(view, &lost, class.replicas) {
                None => {
                    if let Err(e) = self.follow(&pv, view).await {
                        tracing::warn!(volume = %name, "the PV's affinity following its copies: {e:#}");
                    }
                }
                Some(Step::Wait) => {}
                Some(step) => steps.push((name, node, view, (step, lost, class.zone_spread))),
            }
        }
        self.lost_since.lock().expect("not poisoned").retain(|k, _| seen.contains(k));
        {
            let mut from = self.replaced_up_to.lock().expect("not poisoned");
            budget(&mut steps, &mut from, STEPS, |s| &s.0);
        }
        futures_util::stream::iter(steps)
            .for_each_concurrent(AT_ONCE, |(name, node, view, (step, lost, spread))| async move {
                if let Err(e) = self.step(&name, node, view, (step, &lost, spread)).await {
                    tracing::warn!(volume = %name, "replacing a lost copy: {e:#}");
                }
            })
            .await;
        // Copies the current membership no longer has (replaced while their node was away).
        let mut stale = Vec::new();
        for (node, vs) in views {
            let Some(me) = self.dir.admin_endpoint(node) else { continue };
            for v in vs {
                let Some((primary, current)) = primaries.get(v.volume.as_str()) else { continue };
                let member = current.members.iter().any(|m| m.endpoint == me);
                if node != primary && v.generation < current.generation && !member {
                    stale.push(((*primary).to_owned(), node.clone(), me.clone(), v.volume.clone()));
                }
            }
        }
        for (primary, node, me, volume) in stale {
            if let Err(e) = self.forget(&primary, &node, &me, &volume).await {
                tracing::warn!(volume, node, "deleting a copy that was replaced: {e:#}");
            }
        }
        Ok(())
    }

    /// Deletes the copy of `volume` on `node` (at `endpoint`) that is no member any more: its
    /// primary tells it first, so that it forgets the membership it still holds.
    async fn forget(&self, primary: &str, node: &str, endpoint: &str, volume: &str) -> anyhow::Result<()> {
        self.leading().await?;
        let r = pb::RemoveSyncReplicaRequest { volume: volume.to_owned(), peer: endpoint.to_owned() };
        admin(&*self.dir, primary).await?.remove_sync_replica(r).await?;
        crate::shared::copies::delete_copy(&mut admin(&*self.dir, node).await?, volume).await?;
        let note = format!("the copy on {node} had been replaced while its node was away: deleted");
        tracing::warn!(volume, "{note}");
        self.event(volume, None, EventType::Normal, "CopyReplaced", "Replace", note).await;
        Ok(())
    }

    /// Takes one step of a replacement on the primary (`node`) of `volume` whose `lost` members
    /// are being replaced, spread as its class asks.
    async fn step(
        &self,
        volume: &str,
        node: &str,
        view: &pb::SyncVolume,
        (step, lost, spread): (Step, &BTreeSet<String>, Spread),
    ) -> anyhow::Result<()> {
        self.leading().await?;
        let mut c = admin(&*self.dir, node).await?;
        let note = match step {
            Step::AddCopy | Step::AddWitness => {
                let witness = step == Step::AddWitness;
                let at = |m: &pb::SyncMember| node_of(&*self.dir, &m.endpoint);
                let holding: Vec<String> = view.members.iter().filter_map(at).collect();
                let mut candidates = copies::candidates(&*self.dir, &holding, volume).await;
                // The zones of the members that stay (the lost ones' are free again).
                let kept: Vec<String> =
                    view.members.iter().filter(|m| !lost.contains(&m.endpoint)).filter_map(at).collect();
                let mut zones = copies::zones_of(&*self.dir, &kept).await;
                let to = match copies::pick(&mut candidates, &mut zones, spread, witness) {
                    Ok(to) => to,
                    Err(why) => {
                        tracing::warn!(volume, witness, "a member is lost and no other node can take its place: {why}");
                        return Ok(());
                    }
                };
                copies::add_member(&*self.dir, &mut c, volume, &to, witness).await?;
                let what = if witness { "a witness" } else { "a copy" };
                format!(
                    "a member has been unreachable past {REPLACE_AFTER}: {what} added on {to}, rebuilt from the primary on {node}"
                )
            }
            Step::Remove(endpoint) => {
                let r = pb::RemoveSyncReplicaRequest { volume: volume.to_owned(), peer: endpoint.clone() };
                c.remove_sync_replica(r).await?;
                // The record keeps the nodes of the members that stay (a lost node the
                // directory no longer knows has none).
                let stay: Vec<String> = view
                    .members
                    .iter()
                    .filter(|m| m.endpoint != endpoint)
                    .filter_map(|m| node_of(&*self.dir, &m.endpoint))
                    .collect();
                copies::record(&*self.dir, volume, |p| {
                    p.copies.retain(|n| stay.contains(n));
                    p.witness = p.witness.take().filter(|w| stay.contains(w));
                })
                .await?;
                format!("the lost member {endpoint} was replaced and removed from the volume's members")
            }
            Step::Wait => return Ok(()),
        };
        tracing::warn!(volume, "{note}");
        self.event(volume, None, EventType::Normal, "CopyReplaced", "Replace", note).await;
        Ok(())
    }

    /// Makes `pv`'s node affinity name the nodes of `view`'s copies, once they are all in sync.
    async fn follow(&self, pv: &PersistentVolume, view: &pb::SyncVolume) -> anyhow::Result<()> {
        if view.members.iter().any(|m| !matches!(m.state.as_str(), "primary" | "in-sync" | "witness")) {
            return Ok(());
        }
        // Only a PV bound to its claim: one deleted by anyone but an unfinished re-creation of
        // ours (its annotation) is never made again.
        let bound = pv.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
        let deleted = pv.metadata.deletion_timestamp.is_some() && !pv.annotations().contains_key(RECLAIM);
        if !bound || deleted {
            return Ok(());
        }
        let want: BTreeSet<String> = copies::nodes_of(&*self.dir, view).into_iter().collect();
        let have = affinity_nodes(pv);
        // A PV without our affinity (remote access) is left alone, as one whose copies some
        // node of the directory does not know yet.
        let members = view.members.iter().filter(|m| m.state != "witness").count();
        if have.is_empty() || want == have || want.len() != members {
            return Ok(());
        }
        let api: Api<PersistentVolume> = Api::all(self.client.clone());
        let name = pv.name_any();
        self.leading().await?;
        let patch = serde_json::json!({"spec": {"nodeAffinity": affinity(&want)}});
        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {}
            // Immutable here (no MutablePVNodeAffinity): the PV is made again.
            Err(kube::Error::Api(e)) if e.code == 422 => self.recreate(&api, pv, &want).await?,
            Err(e) => return Err(e.into()),
        }
        let note = format!(
            "the volume's copies are on {}: its node affinity follows them (was {})",
            want.iter().cloned().collect::<Vec<_>>().join(", "),
            have.into_iter().collect::<Vec<_>>().join(", ")
        );
        tracing::info!(pv = %name, "{note}");
        self.event(&view.volume, None, EventType::Normal, "AffinityUpdated", "Replace", note).await;
        Ok(())
    }

    /// Re-creates `pv` with the affinity of `nodes`; a PV left Retained by an interrupted
    /// re-creation gets its own policy back from the annotation.
    async fn recreate(
        &self,
        api: &Api<PersistentVolume>,
        pv: &PersistentVolume,
        nodes: &BTreeSet<String>,
    ) -> anyhow::Result<()> {
        let name = pv.name_any();
        let spec = pv.spec.clone().unwrap_or_default();
        let policy = pv
            .annotations()
            .get(RECLAIM)
            .cloned()
            .or_else(|| spec.persistent_volume_reclaim_policy.clone())
            .unwrap_or_else(|| "Delete".to_owned());
        let keep = serde_json::json!({
            "metadata": {"annotations": {RECLAIM: policy}},
            "spec": {"persistentVolumeReclaimPolicy": "Retain"},
        });
        self.leading().await?;
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&keep)).await?;
        let mut again = PersistentVolume::default();
        again.metadata.name = Some(name.clone());
        again.metadata.labels = pv.metadata.labels.clone();
        let mut annotations = pv.annotations().clone();
        annotations.remove(RECLAIM);
        again.metadata.annotations = Some(annotations);
        again.metadata.finalizers = pv.metadata.finalizers.clone();
        let mut spec = spec;
        spec.node_affinity = Some(affinity(nodes));
        spec.persistent_volume_reclaim_policy = Some(policy);
        if let Some(c) = spec.claim_ref.as_mut() {
            c.resource_version = None;
        }
        again.spec = Some(spec);
        // Recorded in the controller's namespace before the delete: a crash from here on is
        // finished by the next leader (pv_move.rs).
        self.move_pv(pv, again).await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sweeps_take_turns_round_the_volumes() {
        let names = |v: &[String]| v.join(",");
        let all: Vec<String> = ["a", "b", "c", "d", "e"].iter().map(|s| (*s).to_owned()).collect();
        let mut from = String::new();
        let mut steps = all.clone();
        super::budget(&mut steps, &mut from, 2, |s| s);
        assert_eq!((names(&steps), from.as_str()), ("a,b".to_owned(), "b"));
        let mut steps = all.clone();
        super::budget(&mut steps, &mut from, 2, |s| s);
        assert_eq!(names(&steps), "c,d");
        let mut steps = all.clone();
        super::budget(&mut steps, &mut from, 2, |s| s);
        assert_eq!(names(&steps), "e,a", "wraps round");
        // A volume done meanwhile is skipped; fewer than the budget: all of them.
        let mut steps = vec!["c".to_owned(), "b".to_owned()];
        super::budget(&mut steps, &mut from, 16, |s| s);
        assert_eq!(names(&steps), "b,c");
    }

    use super::*;

    fn member(endpoint: &str, state: &str) -> pb::SyncMember {
        pb::SyncMember { endpoint: endpoint.into(), state: state.into(), ..Default::default() }
    }

    fn view(members: &[(&str, &str)]) -> pb::SyncVolume {
        pb::SyncVolume {
            volume: "v".into(),
            role: "primary".into(),
            primary: "a".into(),
            members: members.iter().map(|(e, s)| member(e, s)).collect(),
            ..Default::default()
        }
    }

    fn lost(e: &[&str]) -> BTreeSet<String> {
        e.iter().map(|e| (*e).to_owned()).collect()
    }

    #[test]
    fn a_lost_copy_is_replaced_before_it_is_removed() {
        let three = view(&[("a", "primary"), ("b", "in-sync"), ("c", "ejected")]);
        assert_eq!(plan(&three, &lost(&[]), 3), None);
        assert_eq!(plan(&three, &lost(&["c"]), 3), Some(Step::AddCopy));
        let joining = view(&[("a", "primary"), ("b", "in-sync"), ("c", "ejected"), ("d", "ejected")]);
        assert_eq!(plan(&joining, &lost(&["c"]), 3), Some(Step::Wait), "the new copy rebuilds first");
        let rebuilding = view(&[("a", "primary"), ("b", "in-sync"), ("c", "ejected"), ("d", "rebuilding")]);
        assert_eq!(plan(&rebuilding, &lost(&["c"]), 3), Some(Step::Wait));
        let rebuilt = view(&[("a", "primary"), ("b", "in-sync"), ("c", "ejected"), ("d", "in-sync")]);
        assert_eq!(plan(&rebuilt, &lost(&["c"]), 3), Some(Step::Remove("c".into())));
    }

    #[test]
    fn two_copies_keep_their_witness() {
        let w = view(&[("a", "primary"), ("b", "in-sync"), ("w", "witness")]);
        assert_eq!(plan(&w, &lost(&["w"]), 2), Some(Step::AddWitness));
        assert_eq!(plan(&w, &lost(&["b"]), 2), Some(Step::AddCopy));
        let replaced = view(&[("a", "primary"), ("b", "in-sync"), ("w", "witness"), ("x", "witness")]);
        assert_eq!(plan(&replaced, &lost(&["w"]), 2), Some(Step::Remove("w".into())));
        // Both of the lost go, one per pass, once their places are taken.
        let both = view(&[("a", "primary"), ("b", "ejected"), ("w", "witness"), ("c", "in-sync"), ("x", "witness")]);
        assert_eq!(plan(&both, &lost(&["b", "w"]), 2), Some(Step::Remove("b".into())));
    }

    #[test]
    fn the_affinity_names_each_copy() {
        let nodes: BTreeSet<String> = ["node-a", "node-d"].map(str::to_owned).into();
        let pv = PersistentVolume {
            spec: Some(k8s_openapi::api::core::v1::PersistentVolumeSpec {
                node_affinity: Some(affinity(&nodes)),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(affinity_nodes(&pv), nodes);
        assert!(affinity_nodes(&PersistentVolume::default()).is_empty());
    }
}
