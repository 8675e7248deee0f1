//! A backup's manifest (what it holds, chunk by offset) and a volume's index (its backups).

use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::segment::{SPAN, SegmentRef};
use crate::target::FORMAT;
use crate::{Error, Result, Target};

/// Most an index may decompress to: some 40 000 backups of one volume (an update that would
/// pass it is refused: prune the volume's backups).
const MAX_INDEX: usize = 16 << 20;
/// Most a manifest may decompress to: 1 GiB, a 40 TiB volume at 4 MiB chunks in an inline
/// manifest of format 1 (a segmented one lists a 1 PiB volume in ~2 MiB).
pub(crate) const MAX_MANIFEST: usize = 1 << 30;
/// Most volumes a target lists (`backup list`, a prune's retention).
const MAX_VOLUMES: u64 = 100_000;

/// Most a manifest listing `chunks` chunks may decompress to: inline each is
/// `{"i":N,"id":"<64 hex>","len":N}` (~100 bytes), beside a few hundred bytes of the rest (a
/// segment, ~130 bytes, lists one chunk at least).
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

/// One backup. Self-contained: its segments list every non-zero chunk (an incremental lists
/// its predecessor's segments where no chunk changed), so a restore reads one manifest and its
/// segments, and nothing else of other backups.
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
    /// The non-zero chunks, a segment of [`SPAN`] positions at a time, in order (`segment.rs`);
    /// absent ones read as zeros.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<SegmentRef>,
    /// The non-zero chunks, inline, in a manifest of format 1 (an earlier build).
    #[serde(default, rename = "chunks", skip_serializing_if = "Vec::is_empty")]
    pub inline: Vec<ChunkRef>,
    /// What this backup read and uploaded (for `backup show` and the bench).
    pub read_bytes: u64,
    pub uploaded_bytes: u64,
    pub new_chunks: u64,
    /// The target it was copied from (`backup copy`): a copy is the operator's, whatever its id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_from: Option<String>,
    /// The commit attempt that wrote it (random hex): each attempt stores its manifest under a
    /// name of its own (`ID@ATTEMPT`), and the index entry names the one that committed, so a
    /// prune tells an interrupted attempt's leftover from a backup by evidence, not by age.
    /// Absent in backups of earlier builds (stored as `ID`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
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
    /// The attempt whose manifest is this backup ([`Manifest::attempt`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
}

impl IndexEntry {
    /// The name of its manifest under `volumes/VOLUME/backups/`.
    pub fn manifest_name(&self) -> String {
        manifest_name(&self.id, self.attempt.as_deref())
    }

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
    /// Manifests of deleted backups (their names under `backups/`) that may still be on the
    /// target: the evidence on which a prune deletes them. A prune forgets a name once the
    /// manifest is gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deleted: Vec<String>,
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

/// Where the manifest named `name` ([`manifest_name`]) of a backup of `volume` is.
pub fn manifest_path(volume: &str, name: &str) -> String {
    format!("volumes/{volume}/backups/{name}")
}

/// The name of the manifest of backup `id` as attempt `attempt` stored it: `ID@ATTEMPT` (`@`
/// is in no id), or `ID` for a backup of an earlier build.
pub fn manifest_name(id: &str, attempt: Option<&str>) -> String {
    match attempt {
        Some(a) => format!("{id}@{a}"),
        None => id.to_owned(),
    }
}

/// A manifest's name split into its backup's id and its attempt, if it is one.
pub(crate) fn parse_manifest_name(name: &str) -> Option<(&str, Option<&str>)> {
    let (id, attempt) = match name.split_once('@') {
        Some((id, a)) => (id, Some(a)),
        None => (name, None),
    };
    let hex = |a: &str| a.len() == 16 && a.bytes().all(|b| b.is_ascii_hexdigit());
    (valid_component(id) && attempt.is_none_or(hex)).then_some((id, attempt))
}

/// A new attempt id.
pub(crate) fn new_attempt() -> String {
    crate::codec::hex(&crate::codec::random::<8>())
}

pub fn chunk_path(id: &str) -> String {
    format!("chunks/{}/{id}", &id[..2])
}

/// The volumes with backups on `target` (one LIST per 1000), at most [`MAX_VOLUMES`].
pub async fn list_volumes(target: &Target) -> Result<Vec<String>> {
    target.list_dirs("volumes", MAX_VOLUMES).await
}

impl Index {
    /// Puts its backups in their order: oldest first (ids tell apart those of one second).
    pub(crate) fn order(&mut self) {
        self.backups.sort_by(|x, y| (x.created, &x.id).cmp(&(y.created, &y.id)));
    }

    fn empty(volume: &str) -> Index {
        Index { format: FORMAT, volume: volume.to_owned(), ..Index::default() }
    }

    /// The volume's index; an empty one when it has none on this target.
    pub async fn load(target: &Target, volume: &str) -> Result<Index> {
        Ok(Self::load_if_any(target, volume).await?.unwrap_or_else(|| Self::empty(volume)))
    }

    /// The volume's index, None when the target has none.
    pub(crate) async fn load_if_any(target: &Target, volume: &str) -> Result<Option<Index>> {
        match target.get_object(Kind::Index, &index_path(volume), MAX_INDEX).await {
            Ok((data, _)) => Self::decode(target, volume, &data).map(Some),
            Err(e) if e.is_not_found() => Ok(None),
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
                    None => Self::empty(volume),
                };
                if !change(&mut index)? {
                    return Ok(None);
                }
                // The oldest evidence goes first: a manifest it named comes back as a backup.
                let over = index.deleted.len().saturating_sub(MAX_DELETED);
                index.deleted.drain(..over);
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

/// Most names of deleted manifests an index keeps (a prune forgets them as it deletes them).
const MAX_DELETED: usize = 10_000;

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
        let m = Self::load_named(target, &b.volume, &listed.manifest_name(), manifest_cap(listed.chunks)).await;
        m.map_err(|e| {
            if e.is_not_found() { Error::NotFound(format!("backup {b} is not on target {}", target.name)) } else { e }
        })
    }

    /// The manifest named `name` of a backup of `volume`, refused past `max` bytes of
    /// plaintext, or when it is not what its name says or breaks [`Manifest::check`].
    pub(crate) async fn load_named(target: &Target, volume: &str, name: &str, max: usize) -> Result<Manifest> {
        let path = manifest_path(volume, name);
        let (data, _) = target.get_object(Kind::Manifest, &path, max).await?;
        let m: Manifest = decode(target, &path, &data)?;
        if m.volume != volume || m.name() != name {
            return Err(Error::corrupt(&target.name, path, format!("it is the manifest {}/{}", m.volume, m.name())));
        }
        m.check().map_err(|why| Error::corrupt(&target.name, path, why))?;
        Ok(m)
    }

    /// A digest of what it says (SHA-256 of its JSON, hex): a restore's record keeps it, so
    /// that a resumed restore applies its record of chunks done to the same chunk list.
    pub fn digest(&self) -> String {
        let json = serde_json::to_vec(self).expect("serialises");
        crate::codec::hex(ring::digest::digest(&ring::digest::SHA256, &json).as_ref())
    }

    /// Its name under `volumes/VOLUME/backups/`.
    pub fn name(&self) -> String {
        manifest_name(&self.id, self.attempt.as_deref())
    }

    /// What every reader relies on: a chunk size a target may have, a size whose chunks can be
    /// counted, and segments (or chunks, inline) in strictly increasing order inside it, each
    /// with a chunk name, a segment's chunks within its span and a chunk no longer than its place
    /// (a manifest sealed by a target's key was checked when it was made; a keyless store can
    /// hand out any). Segments are checked as they are read (`segment::decode`).
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let chunk = self.chunk_size;
        if !(crate::MIN_CHUNK..=crate::MAX_CHUNK).contains(&chunk) || !chunk.is_multiple_of(4096) {
            return Err(format!("its chunk size {chunk} is not 1-4 MiB in whole 4 KiB blocks"));
        }
        if self.size > MAX_SIZE {
            return Err(format!("its size {} is past {MAX_SIZE} bytes", self.size));
        }
        if !self.segments.is_empty() && !self.inline.is_empty() {
            return Err("it lists chunks both inline and in segments".into());
        }
        let count = self.size.div_ceil(chunk);
        let mut next = 0;
        for s in &self.segments {
            if s.first < next || !s.first.is_multiple_of(SPAN) || s.first >= count {
                return Err(format!("its segment at chunk {} is out of order or past its {count} chunks", s.first));
            }
            next = s.first + SPAN;
            if s.chunks == 0 || u64::from(s.chunks) > SPAN || s.bytes > u64::from(s.chunks) * chunk || !is_name(&s.id) {
                return Err(format!("its segment at chunk {} is not one a backup writes", s.first));
            }
        }
        let mut next = 0;
        for c in &self.inline {
            if c.i < next {
                return Err(format!("chunk {} is out of order", c.i));
            }
            next = c.i + 1;
            check_place(c, chunk, self.size)?;
        }
        Ok(())
    }

    /// How many non-zero chunks it lists, and their plaintext bytes.
    pub fn chunk_count(&self) -> u64 {
        self.segments.iter().map(|s| u64::from(s.chunks)).sum::<u64>() + self.inline.len() as u64
    }

    pub fn chunk_bytes(&self) -> u64 {
        let inline: u64 = self.inline.iter().map(|c| u64::from(c.len)).sum();
        self.segments.iter().map(|s| s.bytes).sum::<u64>() + inline
    }

    /// The numbers of the segments it lists chunks in (position / [`SPAN`]), in order.
    pub(crate) fn segment_numbers(&self) -> Vec<u64> {
        let mut numbers: Vec<u64> = self.segments.iter().map(|s| s.first / SPAN).collect();
        numbers.extend(self.inline.iter().map(|c| c.i / SPAN));
        numbers.dedup();
        numbers
    }

    /// Its segment `n` (positions from `n` x [`SPAN`]), if it lists one there.
    pub(crate) fn segment(&self, n: u64) -> Option<&SegmentRef> {
        let at = self.segments.binary_search_by_key(&(n * SPAN), |s| s.first).ok()?;
        Some(&self.segments[at])
    }

    /// The chunks it lists at positions `n` x [`SPAN`] .. (`n` + 1) x [`SPAN`]: one segment read.
    pub(crate) async fn chunks_of_segment(&self, target: &Target, n: u64) -> Result<Vec<ChunkRef>> {
        if !self.inline.is_empty() {
            let at = |i: u64| self.inline.partition_point(|c| c.i < i);
            return Ok(self.inline[at(n * SPAN)..at((n + 1) * SPAN)].to_vec());
        }
        match self.segment(n) {
            Some(seg) => crate::segment::load(target, seg, self.chunk_size, self.size).await,
            None => Ok(Vec::new()),
        }
    }

    /// Every chunk it lists, in order: every segment read (~110 bytes a chunk in memory).
    pub async fn chunk_list(&self, target: &Target) -> Result<Vec<ChunkRef>> {
        let mut all = self.inline.clone();
        for seg in &self.segments {
            all.extend(crate::segment::load(target, seg, self.chunk_size, self.size).await?);
        }
        Ok(all)
    }

    /// Writes the manifest within `limit` (segmented, it is always smaller than a reader
    /// accepts).
    async fn store(&self, target: &Target, limit: std::time::Duration) -> Result<()> {
        let data = serde_json::to_vec(self).expect("serialises");
        assert!(data.len() <= manifest_cap(self.chunk_count()), "a segmented manifest holds any volume");
        let path = manifest_path(&self.volume, &self.name());
        target.put_object_within(limit, Kind::Manifest, &path, data).await
    }

    /// Commits a backup (made or copied) whose writer holds `lease`: its manifest must be on
    /// the target before the lease's start + the target's grace, on the store's clock (after
    /// that a prune may have deleted chunks it relies on, see `prune.rs`): refused once it has
    /// run for 0.9 x grace, and its manifest's PUT fails rather than land later. Then its entry
    /// in the volume's index. A commit that loses to another attempt of the same backup takes
    /// its own manifest away.
    pub(crate) async fn commit(&self, target: &Target, lease: &crate::writers::Lease) -> Result<()> {
        let (b, grace) = (self.backup_ref(), target.grace());
        let ran = lease.ran(target).await?;
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
        let listed = Index::update(target, &self.volume, |index| {
            if index.backups.iter().any(|e| e.id == self.id) {
                return Err(Error::Conflict(format!(
                    "backup {b} was made on target {} by another call at the same time",
                    target.name
                )));
            }
            index.backups.push(self.entry());
            index.order();
            Ok(true)
        })
        .await;
        if let Err(Error::Conflict(_)) = &listed {
            // The index names the other attempt: this manifest is a leftover by evidence.
            target.delete(&manifest_path(&self.volume, &self.name())).await?;
        }
        listed
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
            chunks: self.chunk_count(),
            bytes: self.chunk_bytes(),
            uploaded_bytes: self.uploaded_bytes,
            copied_from: self.copied_from.clone(),
            attempt: self.attempt.clone(),
        }
    }
}

/// What every reader relies on of chunk `c` of a manifest of `chunk` byte chunks and `size`
/// bytes: a place inside the volume, at most as long as that place, and a chunk name.
pub(crate) fn check_place(c: &ChunkRef, chunk: u64, size: u64) -> std::result::Result<(), String> {
    if c.i >= size.div_ceil(chunk) {
        return Err(format!("chunk {} is past the volume's {} chunks", c.i, size.div_ceil(chunk)));
    }
    // Restores write a chunk's bytes at its place: never past it.
    if c.len == 0 || u64::from(c.len) > chunk.min(size - c.i * chunk) {
        return Err(format!("chunk {} says {} bytes, more than its place holds", c.i, c.len));
    }
    if !is_name(&c.id) {
        return Err(format!("chunk {} has no chunk name ({:?})", c.i, c.id));
    }
    Ok(())
}

/// Whether `id` is a chunk's name: 64 lowercase hex digits.
fn is_name(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Largest volume a manifest may describe: 1 PiB (4 MiB chunks: 2^28 of them).
const MAX_SIZE: u64 = 1 << 50;

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
    fn a_manifest_is_checked_against_what_readers_rely_on() {
        let chunk = |i: u64, len| ChunkRef { i, id: format!("{:02x}", i % 256).repeat(32), len };
        let m = Manifest {
            format: FORMAT,
            volume: "v".into(),
            id: "b".into(),
            snapshot: "s".into(),
            source: None,
            created: 0,
            size: 2 * crate::MIN_CHUNK + 4096,
            chunk_size: crate::MIN_CHUNK,
            previous: None,
            full: true,
            full_reason: None,
            encrypted_volume: false,
            segments: Vec::new(),
            inline: vec![chunk(0, 1 << 20), chunk(2, 4096)],
            read_bytes: 0,
            uploaded_bytes: 0,
            new_chunks: 0,
            copied_from: None,
            attempt: None,
        };
        assert_eq!(m.check(), Ok(()));
        let bad = [
            Manifest { chunk_size: 0, ..m.clone() },
            Manifest { chunk_size: 4097, ..m.clone() },
            Manifest { size: u64::MAX, ..m.clone() },
            Manifest { inline: vec![chunk(2, 4096), chunk(0, 1 << 20)], ..m.clone() },
            Manifest { inline: vec![chunk(0, 1 << 20), chunk(0, 1 << 20)], ..m.clone() },
            Manifest { inline: vec![chunk(3, 4096)], ..m.clone() },
            Manifest { inline: vec![chunk(2, 1 << 20)], ..m.clone() },
            Manifest { inline: vec![ChunkRef { id: "ab".into(), ..chunk(0, 1 << 20) }], ..m.clone() },
        ];
        for b in bad {
            assert!(b.check().is_err(), "{b:?}");
        }
        // Segmented: in order, each inside the volume, at a span's start, with a name.
        let seg = |first, chunks| SegmentRef { first, id: "ab".repeat(32), chunks, bytes: 4096 };
        let big = Manifest { size: 3 * SPAN * crate::MIN_CHUNK, inline: Vec::new(), ..m.clone() };
        assert_eq!(Manifest { segments: vec![seg(0, 1), seg(2 * SPAN, 1)], ..big.clone() }.check(), Ok(()));
        let bad = [
            vec![seg(SPAN, 1), seg(0, 1)],
            vec![seg(0, 1), seg(0, 1)],
            vec![seg(1, 1)],
            vec![seg(3 * SPAN, 1)],
            vec![seg(0, 0)],
            vec![SegmentRef { bytes: crate::MIN_CHUNK + 1, ..seg(0, 1) }],
            vec![SegmentRef { id: "AB".repeat(32), ..seg(0, 1) }],
        ];
        for segments in bad {
            assert!(Manifest { segments: segments.clone(), ..big.clone() }.check().is_err(), "{segments:?}");
        }
        let both = Manifest { segments: vec![seg(0, 1)], inline: m.inline.clone(), ..big };
        assert!(both.check().is_err());
    }

    #[test]
    fn backup_names() {
        let b: BackupRef = "vol-1/20261128T101500Z".parse().unwrap();
        assert_eq!(b.to_string(), "vol-1/20261128T101500Z");
        assert_eq!(manifest_path(&b.volume, &b.id), "volumes/vol-1/backups/20261128T101500Z");
        assert_eq!(manifest_name("x.1", Some("00ff00ff00ff00ff")), "x.1@00ff00ff00ff00ff");
        assert_eq!(parse_manifest_name("x.1@00ff00ff00ff00ff"), Some(("x.1", Some("00ff00ff00ff00ff"))));
        assert_eq!(parse_manifest_name("x.1"), Some(("x.1", None)));
        for bad in ["x@1", "x@00ff00ff00ff00fg", "@00ff00ff00ff00ff", ".x", "x@a@00ff00ff00ff00ff"] {
            assert_eq!(parse_manifest_name(bad), None, "{bad}");
        }
        for bad in ["vol", "/x", "v/", "v/../x", "../v/x", "v/x/y", "v/.x"] {
            assert!(bad.parse::<BackupRef>().is_err(), "{bad}");
        }
    }
}
