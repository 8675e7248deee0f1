//! A backup's manifest (what it holds, chunk by offset) and a volume's index (its backups).

use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::target::FORMAT;
use crate::{Error, Result, Target};

/// Most an index may decompress to: some 40 000 backups of one volume (an update that would
/// pass it is refused: prune the volume's backups).
const MAX_INDEX: usize = 16 << 20;
/// Most a manifest may decompress to: 1 GiB, a 40 TiB volume at 4 MiB chunks (a backup whose
/// manifest would pass it is refused: a larger chunk size holds a larger volume).
pub(crate) const MAX_MANIFEST: usize = 1 << 30;
/// Most volumes a target lists (`backup list`, a prune's retention).
const MAX_VOLUMES: u64 = 100_000;

/// Most a manifest listing `chunks` chunks may decompress to: each is
/// `{"i":N,"id":"<64 hex>","len":N}` (~100 bytes), beside a few hundred bytes of the rest.
fn manifest_cap(chunks: u64) -> usize {
    usize::try_from(chunks.saturating_mul(160).saturating_add(64 << 10)).unwrap_or(usize::MAX).min(MAX_MANIFEST)
}

/// The snapshot a backup read, by what identifies it for good: its pool, its id there (ids are
/// never reused), its time and its nonce. A name is not enough: a snapshot deleted and made
/// again under the same name holds other data; nor are the pool and id: two pools copied from
/// one image (two nodes of one machine image) have the same uuid and hand out the same ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotIdentity {
    /// The pool's uuid.
    pub pool: String,
    pub id: u64,
    /// Unix seconds.
    pub created: u64,
    /// Drawn at random when the snapshot was taken; 0 in backups of earlier builds (then the
    /// snapshot cannot be told for sure and is never a base).
    #[serde(default)]
    pub nonce: u64,
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
    /// The target it was copied from (`backup copy`): a copy is the operator's, whatever its id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_from: Option<String>,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_from: Option<String>,
}

impl IndexEntry {
    /// Whether a CSI snapshot owns it: made for one (its id says so) on this target, not copied
    /// here. Only these may the controller delete, and only these does a retention prune keep
    /// unasked.
    pub fn csi_owned(&self) -> bool {
        crate::is_csi_id(&self.id) && self.copied_from.is_none()
    }
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

/// The volumes with backups on `target` (one LIST per 1000), at most [`MAX_VOLUMES`].
pub async fn list_volumes(target: &Target) -> Result<Vec<String>> {
    target.list_dirs("volumes", MAX_VOLUMES).await
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
                if !change(&mut index)? {
                    return Ok(None);
                }
                let data = serde_json::to_vec(&index).expect("serialises");
                if data.len() > MAX_INDEX {
                    return Err(Error::Invalid(format!(
                        "the index of volume {volume} on target {} would pass {} MiB ({} backups): prune them first",
                        target.name,
                        MAX_INDEX >> 20,
                        index.backups.len()
                    )));
                }
                Ok(Some(data))
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
    /// Backup `b` as its volume's index lists it (a manifest the index does not list is no
    /// backup yet, or no more).
    pub async fn load(target: &Target, b: &BackupRef) -> Result<Manifest> {
        let index = Index::load(target, &b.volume).await?;
        let listed = index.backups.iter().find(|e| e.id == b.id);
        let listed = listed.ok_or_else(|| Error::NotFound(format!("backup {b} is not on target {}", target.name)))?;
        Self::load_listed(target, b, listed).await
    }

    /// Backup `b`, at most as large as its index entry `listed` says.
    pub async fn load_listed(target: &Target, b: &BackupRef, listed: &IndexEntry) -> Result<Manifest> {
        Self::load_unlisted(target, b, manifest_cap(listed.chunks)).await
    }

    /// Backup `b`'s manifest, refused past `max` bytes of plaintext.
    pub(crate) async fn load_unlisted(target: &Target, b: &BackupRef, max: usize) -> Result<Manifest> {
        let path = manifest_path(b);
        let (data, _) = target.get_object(Kind::Manifest, &path, max).await.map_err(|e| {
            if e.is_not_found() { Error::NotFound(format!("backup {b} is not on target {}", target.name)) } else { e }
        })?;
        let m: Manifest = decode(target, &path, &data)?;
        if m.volume != b.volume || m.id != b.id {
            return Err(Error::corrupt(&target.name, path, format!("it is the manifest of {}/{}", m.volume, m.id)));
        }
        Ok(m)
    }

    /// Writes the manifest within `limit`, refused past what a reader accepts
    /// ([`MAX_MANIFEST`]).
    async fn store(&self, target: &Target, limit: std::time::Duration) -> Result<()> {
        let data = serde_json::to_vec(self).expect("serialises");
        if data.len() > MAX_MANIFEST.min(manifest_cap(self.chunks.len() as u64)) {
            return Err(Error::Invalid(format!(
                "backup {} lists {} chunks, more than one manifest holds: use a larger chunk-size",
                self.backup_ref(),
                self.chunks.len()
            )));
        }
        target.put_object_within(limit, Kind::Manifest, &manifest_path(&self.backup_ref()), data).await
    }

    /// Commits a backup (made or copied) that began at `started`: its manifest must be on the
    /// target before `started` + the target's grace (after that a prune may have deleted chunks
    /// it relies on, see `prune.rs`): refused once it has run for 0.9 x grace, and its manifest's
    /// PUT fails rather than land later. Then its entry in the volume's index.
    pub(crate) async fn commit(&self, target: &Target, started: std::time::Instant) -> Result<()> {
        let (b, grace, ran) = (self.backup_ref(), target.grace(), started.elapsed());
        if !grace.is_zero() && ran > grace.mul_f64(0.9) {
            return Err(Error::Conflict(format!(
                "backup {b} ran for {ran:?}, longer than 0.9 x target {}'s grace-s: a prune may have deleted chunks it relies on; run it again (what it sent is reused)",
                target.name
            )));
        }
        let left = if grace.is_zero() { std::time::Duration::MAX } else { grace - ran };
        self.store(target, left).await.map_err(|e| match e {
            Error::Answer { why, .. } if left < target.deadline() => Error::Conflict(format!(
                "backup {b}: its manifest was not stored before target {}'s grace-s ran out ({why}); run it again (what it sent is reused)",
                target.name
            )),
            e => e,
        })?;
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
            copied_from: self.copied_from.clone(),
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
