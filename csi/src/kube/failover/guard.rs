//! The drain guard: asked by the API server (`webhook.rs`) before a Node is cordoned, the first
//! step of every `kubectl drain`, it refuses when taking that node would leave some replicated
//! volume without a majority of copies that take writes, and names the volume.
//!
//! Why the cordon and not an eviction: drain does not evict DaemonSet pods, and the daemons
//! are one, so neither a PodDisruptionBudget on them nor an eviction webhook ever sees a drain
//! of a node that runs no application pod; the cordon is the one step every drain takes, and
//! it says which node is going.
//!
//! A copy counts while it is the primary, in sync or a witness, on a node that is Ready,
//! schedulable and not fenced; the node being cordoned is going. The cordon is refused when
//! the copies that stay are fewer than a majority although the ones there now are not: taking
//! the node is what breaks it. A volume already short of a majority is a warning, not a
//! refusal (cordoning cannot make it worse, and the node may be on its way to a repair). The
//! annotation [`OVERRIDE`] on the Node lets an operator take it anyway.

use std::collections::BTreeMap;

use ferrite_proto::ferrite::v1 as pb;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use serde_json::Value;

use super::maintenance::usable;
use super::{FENCED, host, ready};
use crate::kube::webhook::Answer;
use crate::shared::nodes::scan;

/// Set to "true" on a Node before cordoning it to take it whatever the guard says.
pub const OVERRIDE: &str = "drain-guard.ferrite.dev/allow";

fn unschedulable(n: &Node) -> bool {
    n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false)
}

/// A volume that taking the node would leave short: how many copies stay, how many it needs,
/// and the nodes of the counted copies that are not staying (with why).
#[derive(Debug, PartialEq)]
struct Short<'a> {
    volume: &'a str,
    stay: usize,
    need: usize,
    of: usize,
    away: Vec<String>,
    /// False: already short before this cordon.
    broken_by_it: bool,
}

/// Where a daemon lives: its node's name and, if it is not usable now, why.
type Placement = BTreeMap<String, (String, Option<&'static str>)>;

/// The volumes that taking node `going` would leave without a majority. `at` maps a member's
/// host to its node and why that node is not usable (None: usable).
fn short_of_majority<'a>(going: &str, volumes: &'a [pb::SyncVolume], at: &Placement) -> Vec<Short<'a>> {
    let mut out = Vec::new();
    for v in volumes {
        let counted = v.members.iter().filter(|m| matches!(m.state.as_str(), "primary" | "in-sync" | "witness"));
        let (mut stay, mut here, mut away) = (0, 0, Vec::new());
        for m in counted {
            match at.get(host(&m.endpoint)) {
                Some((node, _)) if node == going => here += 1,
                Some((_, None)) => stay += 1,
                Some((node, Some(why))) => away.push(format!("{node} ({why})")),
                None => away.push(format!("{} (not a node the controller knows)", host(&m.endpoint))),
            }
        }
        let need = v.members.len() / 2 + 1;
        if here > 0 && stay < need {
            let broken_by_it = stay + here >= need;
            out.push(Short { volume: &v.volume, stay, need, of: v.members.len(), away, broken_by_it });
        }
    }
    out
}

/// One view per volume: its primary's where it answered (the newest generation if two claim
/// it), else the newest a copy holds.
fn newest(answers: Vec<(String, Vec<pb::SyncVolume>)>) -> Vec<pb::SyncVolume> {
    let mut by_volume: BTreeMap<String, pb::SyncVolume> = BTreeMap::new();
    for v in answers.into_iter().flat_map(|(_, vs)| vs) {
        let rank = |v: &pb::SyncVolume| (v.role == "primary", v.generation);
        match by_volume.get(&v.volume) {
            Some(held) if rank(held) >= rank(&v) => {}
            _ => {
                by_volume.insert(v.volume.clone(), v);
            }
        }
    }
    by_volume.into_values().collect()
}

impl super::Failover {
    /// Judges an admission request for a Node update: only a cordon is looked at.
    pub(super) async fn review_cordon(&self, request: &Value) -> Answer {
        let node = |k: &str| serde_json::from_value::<Node>(request[k].clone()).ok();
        let (Some(new), Some(old)) = (node("object"), node("oldObject")) else { return Answer::allow() };
        if request["operation"] != "UPDATE" || !unschedulable(&new) || unschedulable(&old) {
            return Answer::allow();
        }
        let name = new.name_any();
        if new.annotations().get(OVERRIDE).is_some_and(|v| v == "true") {
            let warning =
                format!("ferrite drain guard: overridden by {OVERRIDE}=true on {name}; no volume was checked");
            return Answer { allowed: true, warnings: vec![warning], ..Answer::default() };
        }
        let views = scan(&*self.dir, self.dir.nodes(), |_, mut c| async move {
            Ok(c.list_sync_replicas(pb::ListReplicationsRequest::default()).await?.into_inner().volumes)
        })
        .await;
        let views = match views {
            Ok(v) => v,
            // As the webhook's failurePolicy does when the controller is away: let it through.
            Err(e) => {
                let warning = format!("ferrite drain guard: could not read the volumes ({}): not checked", e.message());
                return Answer { allowed: true, warnings: vec![warning], ..Answer::default() };
            }
        };
        let mut warnings: Vec<String> = views
            .silent
            .iter()
            .map(|(n, why)| format!("ferrite drain guard: the daemon of {n} did not answer ({why}); its volumes were judged from their copies"))
            .collect();
        let mut at = Placement::new();
        for n in self.node_store.state() {
            let Some(endpoint) = self.dir.admin_endpoint(&n.name_any()) else { continue };
            let fenced = self.recorded(&n.name_any(), FENCED).is_some();
            let why = if usable(&n, fenced) {
                None
            } else if fenced {
                Some("fenced")
            } else if !ready(&n) {
                Some("not Ready")
            } else {
                Some("cordoned")
            };
            at.insert(host(&endpoint).to_owned(), (n.name_any(), why));
        }
        let volumes = newest(views.answers);
        let mut refusals = Vec::new();
        for s in short_of_majority(&name, &volumes, &at) {
            let away = if s.away.is_empty() { String::new() } else { format!("; away: {}", s.away.join(", ")) };
            let what = format!(
                "replicated volume {} would have {} of its {} copies left taking writes, and it needs {}{away}",
                self.describe(s.volume),
                s.stay,
                s.of,
                s.need
            );
            if s.broken_by_it {
                refusals.push(what);
            } else {
                warnings.push(format!("ferrite drain guard: {what} (already so before this cordon)"));
            }
        }
        if refusals.is_empty() {
            return Answer { allowed: true, warnings, ..Answer::default() };
        }
        let message = format!(
            "ferrite drain guard: taking node {name} now would stop writes: {}. Bring the other copies' nodes back \
             (uncordon, repair) first, or annotate the node {OVERRIDE}=true to take it anyway",
            refusals.join("; ")
        );
        tracing::warn!(node = %name, "cordon refused: {message}");
        Answer { allowed: false, message, warnings }
    }

    /// An engine volume as a user knows it: its PersistentVolume and claim, where there is one.
    fn describe(&self, volume: &str) -> String {
        let pvs = self.volume_store.state();
        let pv = pvs.iter().find(|pv| {
            pv.spec.as_ref().and_then(|s| s.csi.as_ref()).is_some_and(|c| {
                c.driver == self.driver && crate::shared::ids::parse(&c.volume_handle).is_some_and(|(_, v)| v == volume)
            })
        });
        let Some(pv) = pv else { return volume.to_owned() };
        match pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) {
            Some(c) => format!(
                "{} (claim {}/{})",
                pv.name_any(),
                c.namespace.as_deref().unwrap_or_default(),
                c.name.as_deref().unwrap_or_default()
            ),
            None => pv.name_any(),
        }
    }
}

impl crate::kube::webhook::Review for super::Failover {
    fn review<'a>(&'a self, request: &'a Value) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send + 'a>> {
        Box::pin(self.review_cordon(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(name: &str, members: &[(&str, &str)]) -> pb::SyncVolume {
        pb::SyncVolume {
            volume: name.into(),
            role: "primary".into(),
            members: members
                .iter()
                .map(|(h, s)| pb::SyncMember {
                    endpoint: format!("tcp://{h}:7071"),
                    state: (*s).into(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn placement(nodes: &[(&str, &str, Option<&'static str>)]) -> Placement {
        nodes.iter().map(|(h, n, why)| ((*h).to_owned(), ((*n).to_owned(), *why))).collect()
    }

    #[test]
    fn refuses_only_the_cordon_that_breaks_a_majority() {
        let three = [("10.0.0.1", "primary"), ("10.0.0.2", "in-sync"), ("10.0.0.3", "in-sync")];
        let vols = [volume("v3", &three)];
        let all_up = placement(&[("10.0.0.1", "a", None), ("10.0.0.2", "b", None), ("10.0.0.3", "c", None)]);
        // One of three away: two stay, a majority.
        assert!(short_of_majority("b", &vols, &all_up).is_empty());
        // a is cordoned already: taking b leaves c alone.
        let a_gone =
            placement(&[("10.0.0.1", "a", Some("cordoned")), ("10.0.0.2", "b", None), ("10.0.0.3", "c", None)]);
        let s = short_of_majority("b", &vols, &a_gone);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].volume, s[0].stay, s[0].need, s[0].of, s[0].broken_by_it), ("v3", 1, 2, 3, true));
        assert_eq!(s[0].away, ["a (cordoned)"]);
        // A node that holds no counted copy takes nothing away.
        let rebuilding = [("10.0.0.1", "primary"), ("10.0.0.2", "rebuilding"), ("10.0.0.3", "in-sync")];
        assert!(short_of_majority("b", &[volume("r", &rebuilding)], &a_gone).is_empty());
        assert!(short_of_majority("d", &vols, &a_gone).is_empty());
        // Two copies need both: either node's cordon stops writes.
        let two = [volume("v2", &[("10.0.0.1", "primary"), ("10.0.0.2", "in-sync")])];
        assert_eq!(short_of_majority("a", &two, &all_up)[0].need, 2);
        // A witness counts toward the majority.
        let witnessed = [volume("w", &[("10.0.0.1", "primary"), ("10.0.0.2", "in-sync"), ("10.0.0.3", "witness")])];
        assert!(short_of_majority("a", &witnessed, &all_up).is_empty());
        // Already short before the cordon: reported, not broken by it.
        let both_gone = placement(&[
            ("10.0.0.1", "a", Some("not Ready")),
            ("10.0.0.2", "b", None),
            ("10.0.0.3", "c", Some("fenced")),
        ]);
        let s = short_of_majority("b", &vols, &both_gone);
        assert!(!s[0].broken_by_it && s[0].stay == 0);
    }

    #[test]
    fn keeps_the_primary_view_of_each_volume() {
        let mut replica = volume("v", &[("10.0.0.1", "primary")]);
        replica.role = "replica".into();
        replica.generation = 9;
        let mut old = volume("v", &[("10.0.0.1", "primary")]);
        old.generation = 3;
        let mut primary = volume("v", &[("10.0.0.2", "primary")]);
        primary.generation = 4;
        let got = newest(vec![("a".into(), vec![replica, old]), ("b".into(), vec![primary.clone()])]);
        assert_eq!(got, vec![primary]);
    }
}
