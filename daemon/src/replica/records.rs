//! What replication keeps on disk: each replicated volume's relation to its peer
//! (`replication.json`) and the resume points of unfinished incoming transfers
//! (`replica-transfers.json`), both replaced atomically and privately (`state::RecordFile`).

use std::path::Path;
use std::sync::Mutex;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::base::error::Error;
use crate::base::state::RecordFile;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Writable here; pushes mirror snapshots to the peer.
    Primary,
    /// Read-only here; takes the peer's pushes.
    Secondary,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Primary => "primary",
            Role::Secondary => "secondary",
        }
    }
}

/// A replicated volume and its peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Relation {
    pub volume: String,
    pub role: Role,
    /// The peer daemon's admin endpoint (a socket path or tcp://host:port).
    pub peer: String,
    /// The volume's name on the peer.
    pub remote: String,
    /// Mirror snapshots of this relation are `<prefix><unix ms>`, on both sides.
    pub prefix: String,
    /// Seconds between mirror snapshots on the primary; 0: only on request.
    pub interval_secs: u64,
    /// Demoted, and the final delta has not reached the peer yet.
    #[serde(default)]
    pub handover: bool,
    /// The newest mirror snapshot (for a group: group mirror point) both sides hold.
    #[serde(default)]
    pub synced: String,
    /// `volume` names a volume group replicated as one unit.
    #[serde(default)]
    pub group: bool,
    /// A group's members, as of its last complete point.
    #[serde(default)]
    pub members: Vec<String>,
    /// User snapshots of the volume that replicate too: names, or prefixes ending in `*`.
    #[serde(default)]
    pub snapshots: Vec<String>,
    /// Raised by every promotion, before the volume turns writable; a push made under a lower
    /// epoch is refused, so a primary that was failed over can never overwrite its successor.
    #[serde(default)]
    pub epoch: u64,
}

impl Relation {
    /// Whether snapshot `name` of the volume crosses to the peer: a mirror snapshot, or a user
    /// snapshot the settings name.
    pub fn carries(&self, name: &str) -> bool {
        name.starts_with(&self.prefix)
            || self.snapshots.iter().any(|p| match p.strip_suffix('*') {
                Some(start) => name.starts_with(start),
                None => name == p,
            })
    }

    /// Whether the relation made snapshot `name`: a mirror snapshot `<prefix><unix ms>`, with
    /// `.<member>` after it for a group's member snapshot. A name that merely starts with the
    /// prefix is someone else's, and pruning never deletes it.
    pub fn made(&self, name: &str, member: Option<&str>) -> bool {
        let point = match member {
            Some(m) => name.strip_suffix(m).and_then(|s| s.strip_suffix('.')),
            None => Some(name),
        };
        point.is_some_and(|p| self.taken_ms(p).is_some())
    }

    /// When mirror snapshot `name` of this relation was taken (Unix ms), if it is one.
    pub fn taken_ms(&self, name: &str) -> Option<u64> {
        name.strip_prefix(&self.prefix)?.parse().ok()
    }
}

/// An unfinished incoming transfer: what it brings, over what, and where it resumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingRecord {
    pub replica: String,
    pub snapshot: String,
    pub base: String,
    pub resume: u64,
}

/// A record kept by a unique name.
pub trait Keyed {
    fn key(&self) -> &str;
}

impl Keyed for Relation {
    fn key(&self) -> &str {
        &self.volume
    }
}

impl Keyed for PendingRecord {
    fn key(&self) -> &str {
        &self.replica
    }
}

/// A list of records, in memory and on disk; every change is durable before it returns.
#[derive(Debug)]
pub struct Records<T> {
    file: RecordFile,
    items: Mutex<Vec<T>>,
    /// Counts changes: a reader that checked a record may skip checking again until it moves.
    changes: std::sync::atomic::AtomicU64,
}

impl<T: Keyed + Clone + Serialize + DeserializeOwned> Records<T> {
    pub fn load(data_dir: &Path, name: &str) -> anyhow::Result<Self> {
        let file = RecordFile::new(data_dir, name);
        let items = Mutex::new(file.load()?);
        Ok(Self { file, items, changes: Default::default() })
    }

    /// Moves on every change (before the changed record can be read).
    pub fn changes(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn get(&self, key: &str) -> Option<T> {
        self.items.lock().expect("not poisoned").iter().find(|r| r.key() == key).cloned()
    }

    pub fn all(&self) -> Vec<T> {
        self.items.lock().expect("not poisoned").clone()
    }

    /// Replaces the record of `key` with `record` (None: forgets it), durably.
    pub fn set(&self, key: &str, record: Option<T>) -> Result<(), Error> {
        let mut items = self.items.lock().expect("not poisoned");
        let before = items.clone();
        items.retain(|r| r.key() != key);
        items.extend(record);
        self.changes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.file.save(&items).map_err(|e| {
            *items = before;
            Error::internal(format!("saving {}: {e}", self.file.path().display()))
        })
    }

    pub fn put(&self, record: T) -> Result<(), Error> {
        let key = record.key().to_owned();
        self.set(&key, Some(record))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relations_persist_and_name_their_mirror_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let r = Relation {
            volume: "v".into(),
            role: Role::Primary,
            peer: "/p.sock".into(),
            remote: "r".into(),
            prefix: "v.mirror.".into(),
            interval_secs: 60,
            handover: false,
            synced: String::new(),
            group: false,
            members: Vec::new(),
            snapshots: vec!["nightly-*".into(), "weekly".into()],
            epoch: 3,
        };
        let list = Records::<Relation>::load(dir.path(), "replication").unwrap();
        list.put(r.clone()).unwrap();
        list.put(Relation { role: Role::Secondary, ..r.clone() }).unwrap();
        let again = Records::<Relation>::load(dir.path(), "replication").unwrap();
        assert_eq!(again.all().len(), 1);
        assert_eq!(again.get("v").unwrap().role, Role::Secondary);
        assert_eq!(again.get("v").unwrap().epoch, 3, "the epoch is durable");
        assert_eq!(r.taken_ms("v.mirror.1700000000123"), Some(1_700_000_000_123));
        assert_eq!(r.taken_ms("v.snap"), None);
        assert!(r.made("v.mirror.17", None) && r.made("v.mirror.17.db", Some("db")));
        for (name, member) in [("v.mirror.nightly", None), ("v.mirror.17.db", None), ("v.mirror.17.db", Some("web"))] {
            assert!(!r.made(name, member), "{name} is not the relation's own");
        }
        for (name, carried) in
            [("v.mirror.1", true), ("nightly-3", true), ("weekly", true), ("weekly-2", false), ("x", false)]
        {
            assert_eq!(r.carries(name), carried, "{name}");
        }
        again.set("v", None).unwrap();
        assert!(Records::<Relation>::load(dir.path(), "replication").unwrap().get("v").is_none());
    }
}
