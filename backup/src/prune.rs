//! Deleting backups, retention, and removing the chunks no backup lists any more.
//!
//! Nothing is deleted for want of evidence. A manifest goes only when its volume's index says
//! so: the index names it as deleted (`Index::deleted`, written by [`delete`] before the
//! manifest is removed), or names another attempt of the same backup (each commit attempt
//! stores its manifest under a name of its own, `ID@ATTEMPT`). A manifest no index lists is a
//! backup being committed, or one whose index lost it (a lost update, a deleted or hidden
//! index): its chunks are kept, and once it is older than the grace it is listed in its index
//! again (the index is rebuilt from the manifests, which describe themselves) and reported.
//!
//! The sweep must not delete a chunk a running backup is about to list: that backup may have
//! found the chunk on the target (a HEAD, or its previous manifest) and skipped the upload,
//! just before a delete left the chunk unreferenced. So a chunk is deleted in two steps, as
//! Proxmox Backup Server does with atime, here with the store's own clock:
//! 1. a prune that finds a chunk unreferenced *condemns* it: `gc/condemned` lists it with the
//!    time of that list (the store's Last-Modified of the list object);
//! 2. a later prune deletes it only if it is still unreferenced, was condemned at least
//!    `grace` ago, and was last written before it was condemned.
//!
//! A backup reads the condemned list first and uploads condemned chunks again (a fresh
//! Last-Modified saves them), refuses to commit once it has run for 0.9 x grace on the store's
//! clock (`writers.rs`), and checks after its commit that the chunks it uploaded again are
//! still there (a prune's HEAD and DELETE are two requests). A backup that relied on a chunk
//! without seeing it condemned therefore started before the condemnation and commits before
//! condemnation + grace, which is before step 2 may run: its manifest is there to be marked.
//! The grace is the target's (its marker's), one for every writer; a prune goes below it only
//! when told that no backup runs (`Sweep::no_writers`), which the writers' leases must confirm.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use futures_util::TryStreamExt;
use serde::Deserialize;

use crate::codec::Kind;
use crate::manifest::{BackupRef, Index, IndexEntry, Manifest, manifest_path, parse_manifest_name};
use crate::{Error, Result, Target};

const CONDEMNED: &str = "gc/condemned";
/// Most chunks the condemned list holds, those carried from the last prune included (the rest
/// wait for the next prune): 40 bytes each (8 MB at most, which every backup reads), some
/// 800 GB of 4 MiB chunks deleted a prune.
const CONDEMN_AT_MOST: usize = 200_000;
/// Most its object may decompress to (lists of earlier builds, in JSON, uncapped, may reach it).
const MAX_CONDEMNED: usize = 32 << 20;
/// Most objects under `volumes/` (manifests and indexes) a prune lists.
pub(crate) const MAX_VOLUME_OBJECTS: u64 = 10_000_000;
/// Most chunks a prune lists: 200 TiB of distinct data at 4 MiB chunks.
pub(crate) const MAX_CHUNKS: u64 = 50_000_000;
/// Most a manifest its index does not list may decompress to when a prune reads it (a backup
/// being committed: its chunks are kept): an inline one of format 1 (~2.5 TiB of data at 4 MiB
/// chunks), or a segmented one of any size. A larger one stops the sweep until its backup has
/// committed.
const MAX_UNLISTED: usize = 64 << 20;

/// The list a prune leaves in `gc/condemned`, binary: `FRCD`, version (1), `locked_at` (i64 LE,
/// [`NONE`] for none), a count (u32 LE), then per chunk its name (32 bytes) and since when it is
/// condemned (i64 LE, [`NONE`]: since the list was written). Lists of earlier builds are JSON.
#[derive(Debug, Default)]
struct Condemned {
    /// Chunk name -> condemned since (unix seconds, the store's clock); None: since this list
    /// was written (its Last-Modified).
    chunks: BTreeMap<String, Option<i64>>,
    /// Under an object lock: when a prune last extended the lock of every object it kept
    /// (unix seconds, the store's clock), to that time plus the lock's days.
    locked_at: Option<i64>,
}

const MAGIC: &[u8; 4] = b"FRCD";
const NONE: i64 = i64::MIN;

impl Condemned {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(17 + 40 * self.chunks.len());
        out.extend_from_slice(MAGIC);
        out.push(1);
        out.extend_from_slice(&self.locked_at.unwrap_or(NONE).to_le_bytes());
        out.extend_from_slice(&u32::try_from(self.chunks.len()).expect("capped").to_le_bytes());
        for (id, since) in &self.chunks {
            out.extend_from_slice(&crate::codec::unhex(id).expect("chunk names are hex"));
            out.extend_from_slice(&since.unwrap_or(NONE).to_le_bytes());
        }
        out
    }

    /// The list in `data`; why not.
    fn decode(data: &[u8]) -> std::result::Result<Condemned, String> {
        #[derive(Deserialize)]
        struct Json {
            chunks: BTreeMap<String, Option<i64>>,
            #[serde(default)]
            locked_at: Option<i64>,
        }
        if data.first() == Some(&b'{') {
            let list: Json = serde_json::from_slice(data).map_err(|e| e.to_string())?;
            return Ok(Condemned { chunks: list.chunks, locked_at: list.locked_at });
        }
        let Some((head, body)) = data.split_at_checked(17) else { return Err("it is cut short".into()) };
        if &head[..4] != MAGIC || head[4] != 1 {
            return Err("it is no condemned list (or one of a newer build)".into());
        }
        let at = |b: &[u8]| Some(i64::from_le_bytes(b.try_into().expect("8 bytes"))).filter(|&t| t != NONE);
        let count = u32::from_le_bytes(head[13..17].try_into().expect("4 bytes")) as usize;
        if body.len() != 40 * count {
            return Err("its length is not its count's".into());
        }
        let chunks = body.chunks_exact(40).map(|e| (crate::codec::hex(&e[..32]), at(&e[32..]))).collect();
        Ok(Condemned { chunks, locked_at: at(&head[5..13]) })
    }
}

/// What the last prune left: condemned chunks with the time each was condemned, and
/// [`Condemned::locked_at`].
async fn load(target: &Target) -> Result<(BTreeMap<String, i64>, Option<i64>)> {
    match target.get_object(Kind::Condemned, CONDEMNED, MAX_CONDEMNED).await {
        Ok((data, meta)) => {
            let list = Condemned::decode(&data).map_err(|why| Error::corrupt(&target.name, CONDEMNED, why))?;
            let written = meta.last_modified.timestamp();
            let chunks = list.chunks.into_iter().map(|(id, since)| (id, since.unwrap_or(written))).collect();
            Ok((chunks, list.locked_at))
        }
        Err(e) if e.is_not_found() => Ok((BTreeMap::new(), None)),
        Err(e) => Err(e),
    }
}

/// Chunk names as their 32 bytes (a third of their hex's memory).
#[derive(Debug, Default)]
pub(crate) struct ChunkSet(HashSet<[u8; 32]>);

impl ChunkSet {
    pub fn contains(&self, id: &str) -> bool {
        binary(id).is_some_and(|b| self.0.contains(&b))
    }
}

impl<S: AsRef<str>> FromIterator<S> for ChunkSet {
    fn from_iter<I: IntoIterator<Item = S>>(ids: I) -> Self {
        ChunkSet(ids.into_iter().filter_map(|id| binary(id.as_ref())).collect())
    }
}

fn binary(id: &str) -> Option<[u8; 32]> {
    crate::codec::unhex(id)?.try_into().ok()
}

/// What a backup (or a copy) needs of the last prune.
pub(crate) struct Swept {
    /// The chunks it condemned: a backup uploads these again.
    pub condemned: ChunkSet,
    /// Under an object lock, when it extended the lock of every chunk it kept.
    pub locked_at: Option<i64>,
}

pub(crate) async fn load_swept(target: &Target) -> Result<Swept> {
    let (chunks, locked_at) = load(target).await?;
    Ok(Swept { condemned: chunks.into_keys().collect(), locked_at })
}

/// Which backups of a volume a retention policy keeps (besides the newest, always kept).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retention {
    pub keep_last: u32,
    /// The newest backup of each of the last N days (UTC) that have one.
    pub keep_daily: u32,
    /// The newest backup of each of the last N weeks (Monday to Sunday, UTC) that have one.
    pub keep_weekly: u32,
    /// The newest backup of each of the last N calendar months (UTC) that have one.
    pub keep_monthly: u32,
    /// The newest backup of each of the last N calendar years (UTC) that have one.
    pub keep_yearly: u32,
    /// Apply the policy to the backups the CSI driver made for VolumeSnapshots too (by default
    /// they are kept: their VolumeSnapshotContent deletes them).
    pub include_csi: bool,
}

impl Retention {
    /// Whether the policy says anything (else a prune deletes no backup).
    pub fn is_set(&self) -> bool {
        *self != Retention { include_csi: self.include_csi, ..Retention::default() }
    }

    /// The ids to keep of `backups` (any order): the policy's choice among those it applies to,
    /// and every backup a CSI snapshot owns unless `include_csi`.
    pub fn keep(&self, backups: &[IndexEntry]) -> HashSet<String> {
        let (owned, mut newest): (Vec<&IndexEntry>, Vec<&IndexEntry>) =
            backups.iter().partition(|b| !self.include_csi && b.csi_owned());
        newest.sort_by(|a, b| (b.created, &b.id).cmp(&(a.created, &a.id)));
        let mut keep: HashSet<String> = owned.iter().map(|b| b.id.clone()).collect();
        keep.extend(newest.iter().take(self.keep_last.max(1) as usize).map(|b| b.id.clone()));
        // Periods by days since the epoch; the epoch was a Thursday, so weeks start on Mondays at +3.
        let month = |d: u64| {
            let (y, m, _) = crate::clock::civil(d);
            y * 12 + m
        };
        let periods: [(u32, &dyn Fn(u64) -> u64); 4] = [
            (self.keep_daily, &|d| d),
            (self.keep_weekly, &|d| (d + 3) / 7),
            (self.keep_monthly, &month),
            (self.keep_yearly, &|d| crate::clock::civil(d).0),
        ];
        for (n, period) in periods {
            let mut seen = HashSet::new();
            for b in &newest {
                if seen.len() == n as usize {
                    break;
                }
                if seen.insert(period(b.created / 86_400)) {
                    keep.insert(b.id.clone());
                }
            }
        }
        keep
    }
}

/// What a prune did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PruneReport {
    pub backups_deleted: Vec<String>,
    pub manifests: u64,
    pub chunks_referenced: u64,
    pub chunks_deleted: u64,
    pub bytes_deleted: u64,
    /// Unreferenced chunks left for a later prune (younger than the grace).
    pub chunks_condemned: u64,
    /// Objects whose object lock this prune extended (chunks, manifests, indexes).
    pub locks_extended: u64,
    /// Manifests deleted on their index's word: deleted backups', and leftovers of attempts
    /// another attempt of the same backup superseded.
    pub manifests_deleted: u64,
    /// Backups (`VOLUME/ID`) whose manifest no index listed, listed again.
    pub backups_recovered: Vec<String>,
    /// Volumes whose index was missing, rebuilt from their manifests.
    pub indexes_rebuilt: Vec<String>,
    /// Under an object lock: since when every object the target keeps is locked for the lock's
    /// days (unix seconds, the store's clock).
    pub locked_at: Option<i64>,
}

/// How a prune treats backups that may be running elsewhere.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sweep {
    /// How long an unreferenced chunk stays condemned before it goes: at least the target's
    /// grace unless `no_writers`; None: the target's.
    pub grace: Option<Duration>,
    /// The operator says no backup or copy to the target runs anywhere: the grace may be
    /// shorter than the target's (zero: unreferenced chunks go at once). Refused while a
    /// writer's lease is alive.
    pub no_writers: bool,
}

/// Deletes one backup: its index entry (naming its manifest as deleted), then its manifest. Its
/// chunks go with a later prune.
pub async fn delete(target: &Target, b: &BackupRef) -> Result<()> {
    let mut name = None;
    Index::update(target, &b.volume, |index| {
        name = None;
        let Some(at) = index.backups.iter().position(|e| e.id == b.id) else { return Ok(false) };
        let n = index.backups.remove(at).manifest_name();
        index.deleted.push(n.clone());
        name = Some(n);
        Ok(true)
    })
    .await?;
    let name = name.ok_or_else(|| Error::NotFound(format!("backup {b} is not on target {}", target.name)))?;
    target.delete(&manifest_path(&b.volume, &name)).await
}

/// Applies `retention` to every volume's backups (if given), then marks the chunks every
/// manifest on the target lists and sweeps the others as the module comment says. Under an
/// object lock, the locks of what the target keeps are extended when due, even when the mark
/// or the sweep fails.
pub async fn prune(target: &Target, retention: Option<&Retention>, sweep: Sweep) -> Result<PruneReport> {
    let now = target.now().await?;
    let grace = sweep.grace.unwrap_or_else(|| target.grace());
    if grace < target.grace() {
        if !sweep.no_writers {
            return Err(Error::Invalid(format!(
                "a prune's grace ({}s) may not be shorter than target {}'s ({}s): every backup to it relies on \
                 that; only when no backup or copy to it runs anywhere (--no-writers) may it",
                grace.as_secs(),
                target.name,
                target.grace().as_secs()
            )));
        }
        let alive = crate::writers::alive(target, now).await?;
        if !alive.is_empty() {
            return Err(Error::Conflict(format!(
                "{} backups or copies to target {} hold a writer's lease (gc/writers/: {}): a prune with a shorter \
                 grace than the target's waits until they end (or their leases pass the grace)",
                alive.len(),
                target.name,
                alive.join(", ")
            )));
        }
    }
    let mut report = PruneReport::default();
    let swept = mark_and_sweep(target, retention, now, grace, &mut report).await;
    let (mut next, failed) = match swept {
        Ok(next) => (Some(next), None),
        Err(e) => (None, Some(e)),
    };
    let mut locked = Ok(());
    if let Some(lock) = target.object_lock() {
        // After a failed mark or sweep, the list the last prune left records the extension.
        let mut list = match next.take() {
            Some(list) => list,
            None => match load(target).await {
                Ok((previous, locked_at)) => {
                    let chunks = previous.into_iter().map(|(id, since)| (id, Some(since))).collect();
                    Condemned { chunks, locked_at }
                }
                // The store is gone for now: the first failure says why.
                Err(e) => return Err(failed.unwrap_or(e)),
            },
        };
        // Every object is locked until `now` + days at least, once a quarter of the lock.
        if list.locked_at.is_none_or(|at| lock.is_stale(at, now)) {
            match crate::object_lock::extend_all(target, lock, now).await {
                Ok((extended, since)) => {
                    report.locks_extended = extended;
                    list.locked_at = Some(since);
                }
                Err(e) => locked = Err(e),
            }
        }
        if failed.is_none() || report.locks_extended > 0 {
            next = Some(list);
        }
        if report.chunks_deleted > 0 {
            tracing::info!(
                target = %target.name,
                chunks = report.chunks_deleted,
                "deleted chunks are hidden behind delete markers; the bucket's object lock keeps their versions \
                 up to {} days (a lifecycle rule on noncurrent versions frees them after)",
                lock.days
            );
        }
    }
    if let Some(next) = &next {
        target.put_object(Kind::Condemned, CONDEMNED, next.encode()).await?;
        report.chunks_condemned = next.chunks.len() as u64;
        report.locked_at = next.locked_at;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    locked?;
    Ok(report)
}

/// Retention, mark and sweep: the condemned list the sweep leaves.
async fn mark_and_sweep(
    target: &Target,
    retention: Option<&Retention>,
    now: i64,
    grace: Duration,
    report: &mut PruneReport,
) -> Result<Condemned> {
    if let Some(policy) = retention {
        for volume in crate::manifest::list_volumes(target).await? {
            let index = Index::load(target, &volume).await?;
            let keep = policy.keep(&index.backups);
            for e in index.backups.iter().filter(|e| !keep.contains(&e.id)) {
                let b = BackupRef { volume: volume.clone(), id: e.id.clone() };
                delete(target, &b).await?;
                report.backups_deleted.push(b.to_string());
            }
        }
    }
    let grace_s = i64::try_from(grace.as_secs()).unwrap_or(i64::MAX);
    let referenced = mark(target, now, grace_s, report).await?;
    report.chunks_referenced = referenced.len() as u64;
    crate::quarantine::retain(target, |id| referenced.contains(&key(id))).await?;

    // Sweep, as the chunks are listed.
    let (previous, locked_at) = load(target).await?;
    let (mut next, mut fresh) = (BTreeMap::new(), Vec::new());
    let mut chunks = target.list_stream("chunks", MAX_CHUNKS);
    while let Some(object) = chunks.try_next().await? {
        let Some(id) = object.location.filename().map(str::to_owned) else { continue };
        if referenced.contains(&key(&id)) {
            continue;
        }
        let written = object.last_modified.timestamp();
        let since = previous.get(&id).copied().filter(|&since| written < since);
        let mut due = grace.is_zero() || since.is_some_and(|since| since.saturating_add(grace_s) <= now);
        if due && let Some(since) = since.filter(|_| !grace.is_zero()) {
            // Looked at again just before the delete: a backup that found it condemned may have
            // uploaded it anew since the listing, and its manifest will list it. The delete is
            // conditional on the version looked at (and the backup checks after its commit that
            // what it uploaded again is still there).
            let path = object.location.as_ref();
            due = match target.head(path).await? {
                Some(now) if now.last_modified.timestamp() < since => target.delete_if(path, &now).await?,
                _ => false,
            };
        } else if due {
            target.delete(object.location.as_ref()).await?;
        }
        if due {
            report.chunks_deleted += 1;
            report.bytes_deleted += object.size;
        } else if since.is_some() && next.len() < CONDEMN_AT_MOST {
            next.insert(id, since);
        } else if since.is_none() && fresh.len() < CONDEMN_AT_MOST {
            fresh.push(id);
        }
    }
    // Room for the newly condemned beside those carried over, counted after the deletions.
    let room = CONDEMN_AT_MOST.saturating_sub(next.len());
    next.extend(fresh.into_iter().take(room).map(|id| (id, None)));
    Ok(Condemned { chunks: next, locked_at })
}

/// A chunk's name as the mark keeps it: its first 64 bits (names are uniform). Two names that
/// share them only keep an unreferenced chunk one prune longer (~5e-14 per chunk at a million
/// referenced): the mark costs ~20 bytes per referenced chunk, not ~100.
fn key(id: &str) -> u64 {
    id.get(..16).and_then(|h| u64::from_str_radix(h, 16).ok()).unwrap_or(0)
}

/// Mark: the chunks every manifest under `volumes/` lists, in its index or not (one being
/// committed is not yet), a volume at a time as the objects are listed (their names and one
/// index in memory). `grace_s` is at least the target's (or no writer runs): an unlisted
/// manifest older than that is no backup being committed (`Manifest::commit`), and is listed
/// again.
async fn mark(target: &Target, now: i64, grace_s: i64, report: &mut PruneReport) -> Result<HashSet<u64>> {
    let mut referenced = Referenced::default();
    let mut volume: Option<(String, Vec<(String, i64)>)> = None;
    let mut objects = target.list_stream("volumes", MAX_VOLUME_OBJECTS);
    loop {
        let object = objects.try_next().await?;
        let parts: Option<Vec<&str>> = object.as_ref().map(|o| o.location.as_ref().split('/').collect());
        let (name, manifest) = match parts.as_deref() {
            Some(["volumes", v, "backups", m]) => (Some(*v), Some(*m)),
            Some(["volumes", v, ..]) => (Some(*v), None),
            Some(_) => continue,
            None => (None, None),
        };
        if volume.as_ref().is_some_and(|(v, _)| Some(v.as_str()) != name) {
            let (v, manifests) = volume.take().expect("checked");
            Marking { target, volume: &v, now, grace_s }.run(manifests, &mut referenced, report).await?;
        }
        let Some(name) = name else { return Ok(referenced.chunks) };
        let (_, manifests) = volume.get_or_insert_with(|| (name.to_owned(), Vec::new()));
        if let (Some(m), Some(o)) = (manifest, &object) {
            manifests.push((m.to_owned(), o.last_modified.timestamp()));
        }
    }
}

/// The mark of one volume's manifests.
struct Marking<'a> {
    target: &'a Target,
    volume: &'a str,
    now: i64,
    grace_s: i64,
}

/// What the mark found referenced: chunks by [`key`], and segments (which are chunks too) by
/// name, each read once whatever the number of manifests that list it.
#[derive(Default)]
struct Referenced {
    chunks: HashSet<u64>,
    segments: HashSet<String>,
}

impl Marking<'_> {
    /// Marks what manifest `m` lists: its chunks, and its segments and theirs.
    async fn mark_manifest(&self, m: &Manifest, referenced: &mut Referenced) -> Result<()> {
        referenced.chunks.extend(m.inline.iter().map(|c| key(&c.id)));
        for seg in &m.segments {
            if referenced.segments.insert(seg.id.clone()) {
                referenced.chunks.insert(key(&seg.id));
                // A segment missing or damaged hides which chunks its backup needs: the prune
                // stops rather than take them for unreferenced.
                let read = crate::segment::load(self.target, seg, m.chunk_size, m.size).await;
                let chunks = read.map_err(|e| match e {
                    Error::Corrupt { target, why, .. } => Error::Corrupt {
                        target,
                        what: format!("segment {} of backup {}", seg.id, m.backup_ref()),
                        why: format!(
                            "{why}; the prune stops and deletes nothing (`backup verify` that backup, and delete it \
                             if it is lost)"
                        ),
                    },
                    e => e,
                })?;
                referenced.chunks.extend(chunks.iter().map(|c| key(&c.id)));
            }
        }
        Ok(())
    }

    /// Marks what `manifests` (names and Last-Modified) list; deletes those the index says are
    /// gone; lists again those it lost; forgets the deleted names no longer on the target.
    async fn run(
        &self,
        manifests: Vec<(String, i64)>,
        referenced: &mut Referenced,
        report: &mut PruneReport,
    ) -> Result<()> {
        let (target, volume) = (self.target, self.volume);
        let found = Index::load_if_any(target, volume).await?;
        let missing = found.is_none() && !manifests.is_empty();
        let index = found.unwrap_or_default();
        let listed: HashMap<String, &IndexEntry> = index.backups.iter().map(|e| (e.manifest_name(), e)).collect();
        let ids: HashSet<&str> = index.backups.iter().map(|e| e.id.as_str()).collect();
        let deleted: HashSet<&str> = index.deleted.iter().map(String::as_str).collect();
        let (mut recovered, mut gone) = (Vec::new(), HashSet::new());
        for (name, written) in &manifests {
            let b = |id: &str| BackupRef { volume: volume.to_owned(), id: id.to_owned() };
            if let Some(e) = listed.get(name) {
                match Manifest::load_listed(target, &b(&e.id), e).await {
                    // Deleted since it was listed (`delete` takes the index entry first).
                    Err(e) if e.is_not_found() => {}
                    m => self.mark_manifest(&m?, referenced).await?,
                }
                report.manifests += 1;
                continue;
            }
            let Some((id, _)) = parse_manifest_name(name) else {
                tracing::warn!(target = %target.name, volume, object = %name, "not a manifest's name: left alone");
                continue;
            };
            if deleted.contains(name.as_str()) || ids.contains(id) {
                tracing::info!(target = %target.name, volume, manifest = %name,
                    "deleting a manifest its index names as deleted or superseded by another attempt");
                target.delete(&manifest_path(volume, name)).await?;
                gone.insert(name);
                report.manifests_deleted += 1;
                continue;
            }
            // No evidence: a backup being committed, or one its index lost. What it lists is kept.
            let m = match Manifest::load_named(target, volume, name, MAX_UNLISTED).await {
                Err(e) if e.is_not_found() => continue,
                Err(e @ Error::Answer { .. }) => {
                    return Err(Error::Conflict(format!(
                        "manifest {volume}/{name} on target {} is not listed by its index and larger than a prune \
                         reads while it is ({e}): prune again once its backup has committed",
                        target.name
                    )));
                }
                m => m?,
            };
            report.manifests += 1;
            self.mark_manifest(&m, referenced).await?;
            if written.saturating_add(self.grace_s) <= self.now {
                recovered.push(m.entry());
            }
        }
        // The deleted names this prune saw gone, or took away itself, are evidence no more.
        let on_target: HashSet<&str> = manifests.iter().map(|(n, _)| n.as_str()).collect();
        let forget: HashSet<String> =
            index.deleted.iter().filter(|n| !on_target.contains(n.as_str()) || gone.contains(*n)).cloned().collect();
        if recovered.is_empty() && forget.is_empty() {
            return Ok(());
        }
        let mut added = Vec::new();
        Index::update(target, volume, |index| {
            let before = index.deleted.len();
            index.deleted.retain(|n| !forget.contains(n));
            added.clear();
            for e in &recovered {
                let named = index.deleted.contains(&e.manifest_name());
                if !named && !index.backups.iter().any(|b| b.id == e.id) {
                    index.backups.push(e.clone());
                    added.push(e.id.clone());
                }
            }
            index.order();
            Ok(!added.is_empty() || index.deleted.len() != before)
        })
        .await?;
        if !added.is_empty() {
            tracing::warn!(target = %target.name, volume, backups = ?added, index_missing = missing,
                "backups whose index had lost them are listed again (their manifests describe them)");
            report.backups_recovered.extend(added.iter().map(|id| format!("{volume}/{id}")));
            if missing {
                report.indexes_rebuilt.push(volume.to_owned());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, created: u64) -> IndexEntry {
        IndexEntry {
            id: id.into(),
            snapshot: String::new(),
            source: None,
            created,
            size: 0,
            full: false,
            previous: None,
            chunks: 0,
            bytes: 0,
            uploaded_bytes: 0,
            copied_from: None,
            attempt: None,
        }
    }

    #[test]
    fn the_condemned_list_round_trips_and_reads_the_json_of_earlier_builds() {
        let (a, b) = ("ab".repeat(32), "0f".repeat(32));
        let list = Condemned { chunks: BTreeMap::from([(a.clone(), Some(7)), (b.clone(), None)]), locked_at: Some(-3) };
        let data = list.encode();
        assert_eq!(data.len(), 17 + 2 * 40, "40 bytes a chunk");
        let back = Condemned::decode(&data).unwrap();
        assert_eq!((back.chunks, back.locked_at), (list.chunks.clone(), list.locked_at));
        let json = format!(r#"{{"format":1,"chunks":{{"{a}":7,"{b}":null}},"locked_at":-3}}"#);
        let old = Condemned::decode(json.as_bytes()).unwrap();
        assert_eq!((old.chunks, old.locked_at), (list.chunks, list.locked_at));
        for bad in [&data[..data.len() - 1], &data[..10], &[b"FRCD\x02", &data[5..]].concat()] {
            assert!(Condemned::decode(bad).is_err());
        }
        let set: ChunkSet = [&a].into_iter().collect();
        assert!(set.contains(&a) && !set.contains(&b) && !set.contains("not a name"));
    }

    #[test]
    fn retention_keeps_what_it_says() {
        const DAY: u64 = 86_400;
        // Two backups a day for 20 days, from Monday 2026-11-02 (day 20759).
        let start = 20_759 * DAY;
        let all: Vec<IndexEntry> =
            (0..40).map(|n| entry(&format!("b{n:02}"), start + n / 2 * DAY + n % 2 * 3600)).collect();
        let ids = |r: &Retention| {
            let mut v: Vec<String> = r.keep(&all).into_iter().collect();
            v.sort();
            v
        };
        assert_eq!(ids(&Retention::default()), ["b39"], "the newest is always kept");
        assert_eq!(ids(&Retention { keep_last: 3, ..Retention::default() }), ["b37", "b38", "b39"]);
        // The newest of each of the last 3 days.
        assert_eq!(ids(&Retention { keep_daily: 3, ..Retention::default() }), ["b35", "b37", "b39"]);
        // Days 0-6, 7-13, 14-19: the newest of each week.
        assert_eq!(ids(&Retention { keep_weekly: 5, ..Retention::default() }), ["b13", "b27", "b39"]);
    }

    #[test]
    fn backups_of_csi_snapshots_are_kept_unless_included() {
        let mut all: Vec<IndexEntry> = (0..4).map(|n| entry(&format!("b{n}"), 1000 + n)).collect();
        all.push(entry("csi.snap-1", 1));
        let mut copy = entry("csi.snap-2", 2);
        copy.copied_from = Some("primary".into());
        all.push(copy);
        let ids = |r: &Retention| {
            let mut v: Vec<String> = r.keep(&all).into_iter().collect();
            v.sort();
            v
        };
        let last = Retention { keep_last: 1, ..Retention::default() };
        assert_eq!(ids(&last), ["b3", "csi.snap-1"], "a CSI snapshot's is kept; a copy of one is the operator's");
        assert_eq!(ids(&Retention { include_csi: true, ..last.clone() }), ["b3"]);
        assert!(!Retention { include_csi: true, ..Retention::default() }.is_set(), "include-csi alone keeps all");
        assert!(last.is_set());
    }

    #[test]
    fn monthly_and_yearly_keep_the_newest_of_each_calendar_period() {
        const DAY: u64 = 86_400;
        // One backup on the 1st and one on the 20th of every month from 2024-01 to 2026-12.
        let mut all = Vec::new();
        for year in 2024..=2026u64 {
            for month in 1..=12u64 {
                for day in [1, 20] {
                    let days = (0..40_000).find(|&d| crate::clock::civil(d) == (year, month, day)).unwrap();
                    all.push(entry(&format!("{year}-{month:02}-{day:02}"), days * DAY + 3600));
                }
            }
        }
        let ids = |r: &Retention| {
            let mut v: Vec<String> = r.keep(&all).into_iter().collect();
            v.sort();
            v
        };
        assert_eq!(
            ids(&Retention { keep_monthly: 3, ..Retention::default() }),
            ["2026-10-20", "2026-11-20", "2026-12-20"]
        );
        assert_eq!(
            ids(&Retention { keep_yearly: 5, ..Retention::default() }),
            ["2024-12-20", "2025-12-20", "2026-12-20"],
            "the newest of each year there is"
        );
        // Leap day and year ends map to their calendar month.
        assert_eq!(crate::clock::civil(19_782), (2024, 2, 29));
        assert_eq!(crate::clock::civil(20_818), (2026, 12, 31));
    }
}
