//! A backup's manifest (what it holds, chunk by offset) and a volume's index (its backups).

use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::target::FORMAT;
use crate::{Error, Result, Target};

/// Most a manifest or an index may decompress to (a 64 TiB volume at 1 MiB chunks lists 64 Mi
/// chunks at ~90 bytes each: bigger than this; such volumes want 4 MiB chunks).
const MAX_META: usize = 1 << 30;

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
    /// The snapshot it was taken from (on the daemon that took it).
    pub snapshot: String,
    /// Unix seconds.
    pub created: u64,
    pub size: u64,
    pub chunk_size: u64,
    /// The backup it is incremental to, if any.
    pub previous: Option<String>,
    /// Whether every chunk was read (not only the changed ones).
    pub full: bool,
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
        let path = index_path(volume);
        match target.get_object(Kind::Index, &path, MAX_META).await {
            Ok((data, _)) => {
                let index: Index = decode(target, &path, &data)?;
                if index.volume != volume {
                    return Err(Error::corrupt(&target.name, path, format!("it is the index of {:?}", index.volume)));
                }
                Ok(index)
            }
            Err(e) if e.is_not_found() => Ok(Index { format: FORMAT, volume: volume.to_owned(), backups: Vec::new() }),
            Err(e) => Err(e),
        }
    }

    pub async fn store(&self, target: &Target) -> Result<()> {
        target.put_object(Kind::Index, &index_path(&self.volume), serde_json::to_vec(self).expect("serialises")).await
    }
}

impl Manifest {
    pub async fn load(target: &Target, b: &BackupRef) -> Result<Manifest> {
        let path = manifest_path(b);
        let (data, _) = target.get_object(Kind::Manifest, &path, MAX_META).await.map_err(|e| {
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

    pub fn backup_ref(&self) -> BackupRef {
        BackupRef { volume: self.volume.clone(), id: self.id.clone() }
    }

    pub fn entry(&self) -> IndexEntry {
        IndexEntry {
            id: self.id.clone(),
            snapshot: self.snapshot.clone(),
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

/// Decodes a manifest or index, refusing a newer format by name before anything else.
fn decode<T: serde::de::DeserializeOwned>(target: &Target, path: &str, data: &[u8]) -> Result<T> {
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
