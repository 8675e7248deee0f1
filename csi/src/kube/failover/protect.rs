//! Which volumes a fence protects. Releasing a lost node's workload (its pods deleted, its
//! attachments removed) and promoting a two-copy volume by force are safe once the lost node
//! can no longer write that volume anywhere: once every daemon holding the volume (its copies,
//! and the daemon that serves it to the lost node) refuses the lost node. Daemons that hold none
//! of it do not matter to it; waiting for every daemon made one silent bystander (a daemon
//! still in Init, one the controller cannot reach, one restarting) hold up every release.
//!
//! A volume none of whose holders outside the lost set is known (no daemon listing it answers,
//! and its PersistentVolume names no node) is protected once a majority of the daemons hold the
//! fence, as before.

use std::collections::{BTreeMap, BTreeSet};

use ferrite_proto::ferrite::v1 as pb;

use super::host;

/// How a fence round went: the daemons that hold it, and why each other one does not.
#[derive(Debug, Default)]
pub(super) struct Fenced {
    pub held: BTreeSet<String>,
    pub missing: BTreeMap<String, String>,
}

impl Fenced {
    /// Why the fence does not hold on each daemon it missed (none when it holds everywhere).
    pub fn refused(&self) -> Vec<String> {
        self.missing.iter().map(|(node, why)| format!("{node}: {why}")).collect()
    }

    /// Whether a majority of the daemons asked hold it.
    pub fn majority(&self) -> bool {
        self.held.len() * 2 > self.held.len() + self.missing.len()
    }
}

/// The daemons (node names) holding each volume: every daemon whose views list it, the
/// members those views name (`node_of` a member endpoint's host), and the node each
/// PersistentVolume's handle names (`homes`: volume, node).
pub(super) fn holders(
    views: &[(String, Vec<pb::SyncVolume>)],
    homes: impl IntoIterator<Item = (String, String)>,
    node_of: impl Fn(&str) -> Option<String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut holders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (node, volumes) in views {
        for v in volumes {
            let held = holders.entry(v.volume.clone()).or_default();
            held.insert(node.clone());
            held.extend(v.members.iter().filter_map(|m| node_of(host(&m.endpoint))));
            held.extend(node_of(host(&v.primary)));
        }
    }
    for (volume, node) in homes {
        holders.entry(volume).or_default().insert(node);
    }
    holders
}

/// The volumes whose release waits for the fence, each with the holders that lack it: a
/// holder outside `lost` does not hold it, or none is known and no majority of the daemons
/// asked holds it.
pub(super) fn withheld(
    holders: &BTreeMap<String, BTreeSet<String>>,
    lost: &BTreeSet<String>,
    fenced: &Fenced,
) -> BTreeMap<String, Vec<String>> {
    let majority = fenced.majority();
    let mut withheld = BTreeMap::new();
    for (volume, held) in holders {
        let others: Vec<&String> = held.iter().filter(|n| !lost.contains(*n)).collect();
        let lacking: Vec<String> = others.iter().filter(|n| !fenced.held.contains(**n)).map(|n| (*n).clone()).collect();
        if !lacking.is_empty() {
            withheld.insert(volume.clone(), lacking);
        } else if others.is_empty() && !majority {
            withheld.insert(volume.clone(), vec!["a majority of the daemons".to_owned()]);
        }
    }
    withheld
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(volume: &str, primary: &str, members: &[&str]) -> pb::SyncVolume {
        let members =
            members.iter().map(|m| pb::SyncMember { endpoint: format!("tcp://{m}:7070"), ..Default::default() });
        pb::SyncVolume {
            volume: volume.into(),
            primary: format!("tcp://{primary}:7070"),
            members: members.collect(),
            ..Default::default()
        }
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    /// Node `a` is lost; `c` (a member of v1) and `z` (a bystander) are silent.
    #[test]
    fn only_the_holders_of_a_volume_hold_up_its_release() {
        let node_of = |h: &str| h.strip_prefix("10.0.0.").map(str::to_owned);
        let views = vec![
            ("b".to_owned(), vec![view("v1", "10.0.0.a", &["10.0.0.a", "10.0.0.b", "10.0.0.c"])]),
            ("d".to_owned(), vec![view("v2", "10.0.0.a", &["10.0.0.a", "10.0.0.d"])]),
        ];
        // v3: served by e to the lost node (its PV names e); v4: only on the lost node.
        let homes = [("v3".to_owned(), "e".to_owned()), ("v4".to_owned(), "a".to_owned())];
        let holders = holders(&views, homes, node_of);
        assert_eq!(holders["v1"], set(&["a", "b", "c"]));
        assert_eq!(holders["v2"], set(&["a", "d"]));
        let lost = set(&["a"]);
        let fenced = Fenced {
            held: set(&["b", "d", "e", "f"]),
            missing: [("c".to_owned(), "no answer".to_owned()), ("z".to_owned(), "no answer".to_owned())].into(),
        };
        let withheld = withheld(&holders, &lost, &fenced);
        assert_eq!(withheld, [("v1".to_owned(), vec!["c".to_owned()])].into(), "z holds nothing: no wait for it");
        // Without a majority, a volume no live daemon is known to hold waits too.
        let missing = ["b", "c", "f", "z"].iter().map(|n| ((*n).to_owned(), "no answer".to_owned())).collect();
        let few = Fenced { held: set(&["d", "e"]), missing };
        let withheld = super::withheld(&holders, &lost, &few);
        assert!(withheld.contains_key("v4") && withheld.contains_key("v1") && !withheld.contains_key("v2"));
    }

    #[test]
    fn a_majority_is_more_than_half() {
        let round = |ok: usize, failed: usize| Fenced {
            held: (0..ok).map(|i| format!("ok{i}")).collect(),
            missing: (0..failed).map(|i| (format!("no{i}"), String::new())).collect(),
        };
        let majority = |ok, failed| round(ok, failed).majority();
        assert!(majority(1, 0) && majority(2, 1) && majority(5, 4));
        assert!(!majority(0, 0) && !majority(1, 1) && !majority(4, 5));
    }
}
