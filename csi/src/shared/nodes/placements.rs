//! The controller's record of where each volume lives: one ConfigMap per volume in the
//! controller's namespace, which only the controller's account writes (`ferrite-volume-<name>`,
//! labelled [`LABEL`]). It is written before a daemon is asked to hold a copy (CreateVolume,
//! every copy or witness added) and after one is let go, so it always names every node that
//! may hold one. What a daemon says counts only where this record agrees: a volume "found" on
//! a node it does not name is no volume of ours, and a copy that calls itself primary is taken
//! only when a majority of the recorded members confirm its generation ([`confirmed`]). Root on
//! one node can then lie only about that node's own copies.
//!
//! A volume made before the record (0.2) has none: the first time its primary is found (with
//! a majority of its own members' word) it is recorded as found, once, and logged.

use std::collections::BTreeMap;
use std::time::Duration;

use ferrite_proto::ferrite::v1 as pb;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use sha2::{Digest, Sha256};
use tonic::Status;

/// The label of every placement record (the records the directory watches).
pub const LABEL: &str = "storage.ferrite.dev/placement";
const PREFIX: &str = "ferrite-volume";

/// Where a volume's copies are: its data copies (the first made first) and its witness.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    pub copies: Vec<String>,
    pub witness: Option<String>,
}

impl Placed {
    pub fn members(&self) -> impl Iterator<Item = &str> {
        self.copies.iter().chain(&self.witness).map(String::as_str)
    }

    /// Whether `node` holds a member (a copy or the witness).
    pub fn holds(&self, node: &str) -> bool {
        self.members().any(|m| m == node)
    }

    /// Adds `node` as a copy, or as the witness.
    pub fn add(&mut self, node: &str, witness: bool) {
        if witness {
            self.witness = Some(node.to_owned());
        } else if !self.copies.iter().any(|c| c == node) {
            self.copies.push(node.to_owned());
        }
    }

    pub fn remove(&mut self, node: &str) {
        self.copies.retain(|c| c != node);
        if self.witness.as_deref() == Some(node) {
            self.witness = None;
        }
    }

    fn from_data(data: &BTreeMap<String, String>) -> Self {
        let list = |k: &str| data.get(k).into_iter().flat_map(|v| v.split(',')).filter(|n| !n.is_empty());
        Self { copies: list("copies").map(str::to_owned).collect(), witness: list("witness").next().map(str::to_owned) }
    }

    fn data(&self, volume: &str) -> BTreeMap<String, String> {
        let mut d =
            BTreeMap::from([("volume".to_owned(), volume.to_owned()), ("copies".to_owned(), self.copies.join(","))]);
        d.extend(self.witness.clone().map(|w| ("witness".to_owned(), w)));
        d
    }
}

/// The record's object name: readable where the volume's name is a DNS label (`pvc-<uuid>`),
/// else a digest; a digest's name holds a `.`, a readable one never, so the two never meet.
pub fn object_name(volume: &str) -> String {
    let label = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    if volume.len() <= 200 && volume.chars().all(label) && !volume.ends_with('-') {
        format!("{PREFIX}-{volume}")
    } else {
        let d = Sha256::digest(volume.as_bytes());
        format!("{PREFIX}.{}", d[..16].iter().map(|b| format!("{b:02x}")).collect::<String>())
    }
}

/// Whether `claim` (node `node`'s view of the volume, as its primary) is confirmed by a
/// majority of `placed`'s members: the claimant itself, if recorded, and each member whose
/// view (`views`: node → its view) names the same primary at the same generation. A claimant
/// the record does not name is never confirmed; a record of one member is its own majority.
pub fn confirmed<'a>(
    placed: &Placed,
    node: &str,
    claim: &pb::SyncVolume,
    views: impl IntoIterator<Item = (&'a str, &'a pb::SyncVolume)>,
) -> bool {
    if !placed.holds(node) {
        return false;
    }
    let agree = |v: &pb::SyncVolume| v.primary == claim.primary && v.generation == claim.generation;
    let mut yes: Vec<&str> = vec![node];
    for (other, v) in views {
        if other != node && placed.holds(other) && agree(v) && !yes.contains(&other) {
            yes.push(other);
        }
    }
    yes.len() * 2 > placed.members().count()
}

/// Whether `node`'s word on `volume` counts: the record names it, or the volume has none (made
/// before records, or a directory without them).
pub fn recorded_on(records: Option<&Placements>, node: &str, volume: &str) -> bool {
    records.and_then(|r| r.get(volume)).is_none_or(|p| p.holds(node))
}

/// How many of the recorded copies a node may hold, given `counts` (copies per node) over
/// `nodes` daemons: twice the mean and 16 more. A node that claims more free space than it has
/// takes new copies until it holds that many, then the others do.
pub fn share_cap(counts: &BTreeMap<String, usize>, nodes: usize) -> usize {
    let total: usize = counts.values().sum();
    2 * total.div_ceil(nodes.max(1)) + 16
}

/// The records, as the directory watches them, and how to write them.
pub struct Placements {
    api: Api<ConfigMap>,
    store: Store<ConfigMap>,
}

/// How long a write waits to see itself in the watched records (the next read relies on it).
const SEEN_WITHIN: Duration = Duration::from_secs(5);

impl Placements {
    pub fn new(api: Api<ConfigMap>, store: Store<ConfigMap>) -> Self {
        Self { api, store }
    }

    fn data_of(cm: &ConfigMap, volume: &str) -> Option<Placed> {
        let data = cm.data.as_ref()?;
        (data.get("volume").map(String::as_str) == Some(volume)).then(|| Placed::from_data(data))
    }

    /// Where `volume` lives, as recorded (None: no record).
    pub fn get(&self, volume: &str) -> Option<Placed> {
        let at = ObjectRef::new(&object_name(volume)).within(self.api_namespace());
        Self::data_of(&*self.store.get(&at)?, volume)
    }

    fn api_namespace(&self) -> &str {
        self.api.namespace().unwrap_or_default()
    }

    /// Recorded copies per node.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for cm in self.store.state() {
            let placed = cm.data.as_ref().map(Placed::from_data).unwrap_or_default();
            for c in placed.copies {
                *counts.entry(c).or_default() += 1;
            }
        }
        counts
    }

    /// Changes `volume`'s record with `change` (starting from an empty one), writing it at the
    /// version read (a conflict reads again), and deleting it when no member is left; returns
    /// once the watch shows it. Unavailable when the API refuses.
    pub async fn update(&self, volume: &str, change: impl Fn(&mut Placed)) -> Result<Placed, Status> {
        let name = object_name(volume);
        let failed = |e: kube::Error| Status::unavailable(format!("recording where volume {volume:?} lives: {e}"));
        for _ in 0..5 {
            let old = self.api.get_opt(&name).await.map_err(failed)?;
            let mut placed = old.as_ref().and_then(|c| Self::data_of(c, volume)).unwrap_or_default();
            let before = placed.clone();
            change(&mut placed);
            if old.is_some() && placed == before {
                return Ok(placed);
            }
            let written = match old {
                Some(_) if placed.members().next().is_none() => {
                    match self.api.delete(&name, &DeleteParams::default()).await {
                        Ok(_) => Ok(None),
                        Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
                        Err(e) => Err(e),
                    }
                }
                None if placed.members().next().is_none() => return Ok(placed),
                Some(mut cm) => {
                    cm.data = Some(placed.data(volume));
                    self.api.replace(&name, &PostParams::default(), &cm).await.map(Some)
                }
                None => {
                    let cm = ConfigMap {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            labels: Some([(LABEL.to_owned(), "true".to_owned())].into()),
                            ..Default::default()
                        },
                        data: Some(placed.data(volume)),
                        ..Default::default()
                    };
                    self.api.create(&PostParams::default(), &cm).await.map(Some)
                }
            };
            match written {
                Ok(cm) => {
                    self.seen(&name, cm.and_then(|c| c.metadata.resource_version)).await;
                    return Ok(placed);
                }
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(failed(e)),
            }
        }
        Err(Status::aborted(format!("recording where volume {volume:?} lives: changed meanwhile, five times")))
    }

    /// Waits until the watched records show `name` at `version` (None: gone).
    async fn seen(&self, name: &str, version: Option<String>) {
        let at = ObjectRef::new(name).within(self.api_namespace());
        let shown = || {
            let cm = self.store.get(&at);
            match &version {
                None => cm.is_none(),
                Some(v) => cm.is_some_and(|c| c.metadata.resource_version.as_ref() == Some(v)),
            }
        };
        let wait = async {
            while !shown() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        if tokio::time::timeout(SEEN_WITHIN, wait).await.is_err() {
            tracing::warn!(record = name, "a placement record written is not in the watch after {SEEN_WITHIN:?}");
        }
    }
}

impl std::fmt::Debug for Placements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placements").field("records", &self.store.state().len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(copies: &[&str], witness: Option<&str>) -> Placed {
        Placed { copies: copies.iter().map(|c| (*c).to_owned()).collect(), witness: witness.map(str::to_owned) }
    }

    fn view(primary: &str, generation: u64) -> pb::SyncVolume {
        pb::SyncVolume { primary: primary.into(), generation, ..Default::default() }
    }

    #[test]
    fn records_round_trip_and_name_every_volume() {
        let p = placed(&["a", "b"], Some("c"));
        assert_eq!(Placed::from_data(&p.data("v")), p);
        let q = placed(&["a"], None);
        assert_eq!(Placed::from_data(&q.data("v")), q);
        assert_eq!(object_name("pvc-0a1b"), "ferrite-volume-pvc-0a1b");
        let digest = object_name("Vol_1");
        assert!(digest.starts_with("ferrite-volume.") && digest.len() == 15 + 32, "{digest}");
        assert_ne!(object_name("vol_1"), digest);
        let mut r = Placed::default();
        r.add("a", false);
        r.add("a", false);
        r.add("w", true);
        assert_eq!(r, placed(&["a"], Some("w")));
        r.remove("w");
        r.remove("a");
        assert_eq!(r.members().count(), 0);
    }

    #[test]
    fn a_primary_counts_with_a_majority_of_the_recorded_members() {
        let rec = placed(&["a", "b"], Some("w"));
        let p = view("tcp://a", 7);
        let (b, w, stale, other) = (view("tcp://a", 7), view("tcp://a", 7), view("tcp://a", 6), view("tcp://x", 7));
        assert!(confirmed(&rec, "a", &p, [("b", &b)]), "a and b of 3");
        assert!(confirmed(&rec, "a", &p, [("w", &w)]), "a and its witness of 3");
        assert!(!confirmed(&rec, "a", &p, []), "a alone of 3");
        assert!(!confirmed(&rec, "a", &p, [("b", &stale), ("w", &other)]), "members that disagree");
        // A node the record does not name: never, whoever agrees (its own helpers included).
        assert!(!confirmed(&rec, "x", &p, [("b", &b), ("w", &w), ("y", &b)]));
        // Votes from unrecorded nodes or the claimant twice do not count.
        assert!(!confirmed(&rec, "a", &p, [("y", &b), ("z", &b), ("a", &b)]));
        // While a lost copy is replaced: four members, three must agree.
        let four = placed(&["a", "lost", "new"], Some("w"));
        assert!(!confirmed(&four, "a", &p, [("w", &w)]));
        assert!(confirmed(&four, "a", &p, [("w", &w), ("new", &b)]));
        assert!(confirmed(&placed(&["a"], None), "a", &p, []), "a local volume");
    }

    #[test]
    fn a_node_takes_new_copies_up_to_twice_the_mean() {
        let counts: BTreeMap<String, usize> = [("a".to_owned(), 40), ("b".to_owned(), 20)].into();
        assert_eq!(share_cap(&counts, 3), 2 * 20 + 16);
        assert_eq!(share_cap(&BTreeMap::new(), 0), 16, "an empty cluster");
    }
}
