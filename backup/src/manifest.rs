//! A backup's manifest (what it holds, chunk by offset) and a volume's index (its backups).

use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::target::FORMAT;
use crate::{Error, Result, Target};

/// Most an index may decompress to: some 40 000 backups of one volume.
const MAX_INDEX: usize = 16 << 20;
/// Most a manifest may decompress to when its index does not say how many chunks it lists (a
/// backup being committed): 1 GiB, a 40 TiB volume at 4 MiB chunks.
pub(crate) const MAX_MANIFEST: usize = 1 << 30;

/// Most a manifest listing `chunks` chunks may decompress to: each is
/// `{"i":N,"id":"<64 hex>","len":N}` (~100 bytes), beside a few hundred bytes of the rest.
fn manifest_cap(chunks: u64) -> usize {
    usize::try_from(chunks.saturating_mul(160).saturating_add(64 << 10)).unwrap_or(usize::MAX).min(MAX_MANIFEST)
}

/// The snapshot a backup read, by what identifies it for good: its pool, its id there (ids are
/// never reused) and its time. A name is not enough: a snapshot deleted and made again under
/// the same name holds other data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotIdentity {
    /// The pool's uuid.
    pub pool: String,
    pub id: u64,
    /// Unix seconds.
    pub created: u64,
}

/// One chunk of a backup: its index (offset / chunk size), name and plaintext length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub i: u64,
    pub id: String,
    pub len: u32,
}

/// One backup. Self-contained: it lists every non-zero chunk (an incremental copies the
/// references of the chunks it did not read from its predecessor), so a restore reads one
/// manifest and nothing else.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub volume: String,
    pub id: String,
    /// The snapshot it was taken from (its name on the daemon that took it).
    pub snapshot: String,
    /// That snapshot for good; absent in backups made by earlier builds (never a base).
    #[serde(default)]
    pub source: Option<SnapshotIdentity>,
    /// The point in time it holds: its snapshot's time (unix seconds).
    pub created: u64,
    pub size: u64,
    pub chunk_size: u64,
    /// The backup it is incremental to, if any.
    pub previous: Option<String>,
    /// Whether every chunk was read (not only the changed ones).
    pub full: bool,
    /// Why it read every chunk although an earlier backup exists.
    #[serde(default)]
    pub full_reason: Option<String>,
    /// Whether the volume was encrypted (restores make an encrypted volume).
    pub encrypted_volume: bool,
    /// Non-zero chunks in offset order; absent ones read as zeros.
    pub chunks: Vec<ChunkRef>,
    /// What this backup read and uploaded (for `backup show` and the bench).
    pub read_bytes: u64,
    pub uploaded_bytes: u64,
    pub new_chunks: u64,
}

/// A backup as its volume's index lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    pub id: String,
    pub snapshot: String,
    #[serde(default)]
    pub source: Option<SnapshotIdentity>,
    pub created: u64,
    pub size: u64,
    pub full: bool,
    pub previous: Option<String>,
    /// Non-zero chunks and their plaintext bytes.
    pub chunks: u64,
    pub bytes: u64,
    pub uploaded_bytes: u64,
}

/// A volume's backups, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    pub format: u32,
    pub volume: String,
    pub backups: Vec<IndexEntry>,
}

/// A backup's name on its target: `VOLUME/ID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupRef {
    pub volume: String,
    pub id: String,
}

impl std::str::FromStr for BackupRef {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Invalid(format!("invalid backup name {s:?}: use VOLUME/ID (as `backup list` shows)"));
        let (volume, id) = s.split_once('/').ok_or_else(bad)?;
        if !valid_component(volume) || !valid_component(id) {
            return Err(bad());
        }
        Ok(BackupRef { volume: volume.to_owned(), id: id.to_owned() })
    }
}

impl std::fmt::Display for BackupRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.volume, self.id)
    }
}

/// A volume name or backup id as a path component: what volume names allow.
pub fn valid_component(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with(['.', '-'])
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

pub fn index_path(volume: &str) -> String {
    format!("volumes/{volume}/index")
}

pub fn manifest_path(b: &BackupRef) -> String {
    format!("volumes/{}/backups/{}", b.volume, b.id)
}

pub fn chunk_path(id: &str) -> String {
    format!("chunks/{}/{id}", &id[..2])
}

/// The volumes with backups on `target` (one LIST per 1000).
pub async fn list_volumes(target: &Target) -> Result<Vec<String>> {
    target.list_dirs("volumes").await
}

impl Index {
    /// The volume's index; an empty one when it has no backups on this target.
    pub async fn load(target: &Target, volume: &str) -> Result<Index> {
        match target.get_object(Kind::Index, &index_path(volume), MAX_INDEX).await {
            Ok((data, _)) => Self::decode(target, volume, &data),
            Err(e) if e.is_not_found() => Ok(Index { format: FORMAT, volume: volume.to_owned(), backups: Vec::new() }),
            Err(e) => Err(e),
        }
    }

    /// Changes the volume's index with `change` (which says whether it changed anything) and
    /// stores it conditionally ([`Target::update_object`]): two daemons updating one index at
    /// once lose neither update.
    pub async fn update(
        target: &Target,
        volume: &str,
        mut change: impl FnMut(&mut Index) -> Result<bool>,
    ) -> Result<()> {
        let path = index_path(volume);
        target
            .update_object(Kind::Index, &path, MAX_INDEX, |plain| {
                let mut index = match plain {
                    Some(data) => Self::decode(target, volume, &data)?,
                    None => Index { format: FORMAT, volume: volume.to_owned(), backups: Vec::new() },
                };
                Ok(change(&mut index)?.then(|| serde_json::to_vec(&index).expect("serialises")))
            })
            .await
    }

    fn decode(target: &Target, volume: &str, data: &[u8]) -> Result<Index> {
        let path = index_path(volume);
        let index: Index = decode(target, &path, data)?;
        if index.volume != volume {
            return Err(Error::corrupt(&target.name, path, format!("it is the index of {:?}", index.volume)));
        }
        Ok(index)
    }
}

impl Manifest {
    /// Backup `b`, at most as large as its volume's index says it is.
    pub async fn load(target: &Target, b: &BackupRef) -> Result<Manifest> {
        let index = Index::load(target, &b.volume).await?;
        Self::load_listed(target, b, index.backups.iter().find(|e| e.id == b.id)).await
    }

    /// Backup `b`, at most as large as its index entry `listed` says (when it has one).
    pub async fn load_listed(target: &Target, b: &BackupRef, listed: Option<&IndexEntry>) -> Result<Manifest> {
        let path = manifest_path(b);
        let max = listed.map_or(MAX_MANIFEST, |e| manifest_cap(e.chunks));
        let (data, _) = target.get_object(Kind::Manifest, &path, max).await.map_err(|e| {
            if e.is_not_found() { Error::NotFound(format!("backup {b} is not on target {}", target.name)) } else { e }
        })?;
        let m: Manifest = decode(target, &path, &data)?;
        if m.volume != b.volume || m.id != b.id {
            return Err(Error::corrupt(&target.name, path, format!("it is the manifest of {}/{}", m.volume, m.id)));
        }
        Ok(m)
    }

    pub async fn store(&self, target: &Target) -> Result<()> {
        target
            .put_object(
                Kind::Manifest,
                &manifest_path(&self.backup_ref()),
                serde_json::to_vec(self).expect("serialises"),
            )
            .await
    }

    /// Commits a backup (made or copied) that began at `started`: refused once it has run for
    /// 0.9 x the target's grace (a prune may have deleted chunks it relies on, see `prune.rs`),
    /// else the manifest, then its entry in the volume's index.
    pub(crate) async fn commit(&self, target: &Target, started: std::time::Instant) -> Result<()> {
        let (b, grace) = (self.backup_ref(), target.grace());
        if !grace.is_zero() && started.elapsed() > grace.mul_f64(0.9) {
            return Err(Error::Conflict(format!(
                "backup {b} ran for {:?}, longer than 0.9 x target {}'s grace-s: a prune may have deleted chunks it relies on; run it again (what it sent is reused)",
                started.elapsed(),
                target.name
            )));
        }
        self.store(target).await?;
        Index::update(target, &self.volume, |index| {
            if index.backups.iter().any(|e| e.id == self.id) {
                return Err(Error::Conflict(format!(
                    "backup {b} was made on target {} by another call at the same time",
                    target.name
                )));
            }
            index.backups.push(self.entry());
            index.backups.sort_by(|x, y| (x.created, &x.id).cmp(&(y.created, &y.id)));
            Ok(true)
        })
        .await
    }

    pub fn backup_ref(&self) -> BackupRef {
        BackupRef { volume: self.volume.clone(), id: self.id.clone() }
    }

    pub fn entry(&self) -> IndexEntry {
        IndexEntry {
            id: self.id.clone(),
            snapshot: self.snapshot.clone(),
            source: self.source.clone(),
            created: self.created,
            size: self.size,
            full: self.full,
            previous: self.previous.clone(),
            chunks: self.chunks.len() as u64,
            bytes: self.chunks.iter().map(|c| u64::from(c.len)).sum(),
            uploaded_bytes: self.uploaded_bytes,
        }
    }
}

/// Decodes a manifest, an index or a list of the target's, refusing a newer format by name
/// before anything else.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(target: &Target, path: &str, data: &[u8]) -> Result<T> {
    #[derive(Deserialize)]
    struct Versioned {
        format: u32,
    }
    let v: Versioned = serde_json::from_slice(data).map_err(|e| Error::corrupt(&target.name, path, e.to_string()))?;
    if v.format > FORMAT {
        return Err(Error::Newer {
            target: target.name.clone(),
            what: path.to_owned(),
            found: v.format,
            supported: FORMAT,
        });
    }
    serde_json::from_slice(data).map_err(|e| Error::corrupt(&target.name, path, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backup_names() {
        let b: BackupRef = "vol-1/20261128T101500Z".parse().unwrap();
        assert_eq!(b.to_string(), "vol-1/20261128T101500Z");
        assert_eq!(manifest_path(&b), "volumes/vol-1/backups/20261128T101500Z");
        for bad in ["vol", "/x", "v/", "v/../x", "../v/x", "v/x/y", "v/.x"] {
            assert!(bad.parse::<BackupRef>().is_err(), "{bad}");
        }
    }
}
