//! Deleting backups, retention, and removing the chunks no backup lists any more.
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
//! Last-Modified saves them), and refuses to commit once it has run for 0.9 x grace. A backup
//! that relied on a chunk without seeing it condemned therefore started before the
//! condemnation and commits before condemnation + grace, which is before step 2 may run: its
//! manifest is there to be marked. With `grace` zero (`prune --grace-s 0`: nothing else uses
//! the target), unreferenced chunks go at once.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::manifest::{BackupRef, Index, IndexEntry, Manifest, manifest_path};
use crate::target::FORMAT;
use crate::{Error, Result, Target};

const CONDEMNED: &str = "gc/condemned";
/// Most chunks the condemned list holds, those carried from the last prune included (the rest
/// wait for the next prune): ~80 bytes each, it stays well below [`MAX_CONDEMNED`], which every
/// backup reads (and which lists of earlier builds, uncapped, may reach).
const CONDEMN_AT_MOST: usize = 200_000;
const MAX_CONDEMNED: usize = 32 << 20;
/// Most objects under `volumes/` (manifests and indexes) a prune lists.
const MAX_VOLUME_OBJECTS: u64 = 10_000_000;
/// Most chunks a prune lists: 200 TiB of distinct data at 4 MiB chunks.
const MAX_CHUNKS: u64 = 50_000_000;
/// Most a manifest its index does not list may decompress to when a prune reads it (a backup
/// being committed: its chunks are kept): a volume of ~2.5 TiB of data at 4 MiB chunks. A
/// larger one stops the sweep until its backup has committed.
const MAX_UNLISTED: usize = 64 << 20;
const CLOCK: &str = "gc/clock";

#[derive(Debug, Default, Serialize, Deserialize)]
struct Condemned {
    format: u32,
    /// Chunk name -> condemned since (unix seconds, the store's clock); None: since this list
    /// was written (its Last-Modified).
    chunks: BTreeMap<String, Option<i64>>,
    /// Under an object lock: when a prune last extended the lock of every object it kept
    /// (unix seconds, the store's clock), to that time plus the lock's days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    locked_at: Option<i64>,
}

/// What the last prune left: condemned chunks with the time each was condemned, and
/// [`Condemned::locked_at`].
async fn load(target: &Target) -> Result<(BTreeMap<String, i64>, Option<i64>)> {
    match target.get_object(Kind::Condemned, CONDEMNED, MAX_CONDEMNED).await {
        Ok((data, meta)) => {
            let list: Condemned = crate::manifest::decode(target, CONDEMNED, &data)?;
            let written = meta.last_modified.timestamp();
            let chunks = list.chunks.into_iter().map(|(id, since)| (id, since.unwrap_or(written))).collect();
            Ok((chunks, list.locked_at))
        }
        Err(e) if e.is_not_found() => Ok((BTreeMap::new(), None)),
        Err(e) => Err(e),
    }
}

/// What a backup (or a copy) needs of the last prune.
pub(crate) struct Swept {
    /// The chunks it condemned: a backup uploads these again.
    pub condemned: HashSet<String>,
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
}

/// Deletes one backup (its manifest and its index entry). Its chunks go with a later prune.
pub async fn delete(target: &Target, b: &BackupRef) -> Result<()> {
    // The index first: a manifest left by a crash here is only kept (marked), never listed.
    let mut listed = false;
    Index::update(target, &b.volume, |index| {
        let before = index.backups.len();
        index.backups.retain(|e| e.id != b.id);
        listed = index.backups.len() != before;
        Ok(listed)
    })
    .await?;
    if !listed && target.head(&manifest_path(b)).await?.is_none() {
        return Err(Error::NotFound(format!("backup {b} is not on target {}", target.name)));
    }
    target.delete(&manifest_path(b)).await
}

/// Applies `retention` to every volume's backups (if given), then marks the chunks every
/// manifest on the target lists and sweeps the others as the module comment says.
pub async fn prune(target: &Target, retention: Option<&Retention>, grace: Duration) -> Result<PruneReport> {
    let mut report = PruneReport::default();
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
    // The store's time now: write an object and read its Last-Modified.
    target.put(CLOCK, bytes::Bytes::new()).await?;
    let now = target
        .head(CLOCK)
        .await?
        .map(|m| m.last_modified.timestamp())
        .ok_or_else(|| Error::corrupt(&target.name, CLOCK, "vanished"))?;
    let grace_s = i64::try_from(grace.as_secs()).unwrap_or(i64::MAX);
    let referenced = mark(target, now, grace_s, &mut report).await?;
    report.chunks_referenced = referenced.len() as u64;
    crate::quarantine::retain(target, |id| referenced.contains(&key(id))).await?;

    // Sweep, as the chunks are listed.
    let (previous, locked_at) = load(target).await?;
    // Room for chunks condemned now beside those carried over: the list never outgrows its cap.
    let room = CONDEMN_AT_MOST.saturating_sub(previous.len());
    let (mut next, mut fresh) = (Condemned { format: FORMAT, chunks: BTreeMap::new(), locked_at }, 0);
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
            // uploaded it anew since the listing, and its manifest will list it.
            let now = target.head(object.location.as_ref()).await?;
            due = now.is_some_and(|m| m.last_modified.timestamp() < since);
        }
        if due {
            target.delete(object.location.as_ref()).await?;
            report.chunks_deleted += 1;
            report.bytes_deleted += object.size;
        } else if since.is_some() && next.chunks.len() < CONDEMN_AT_MOST {
            next.chunks.insert(id, since);
        } else if since.is_none() && fresh < room {
            fresh += 1;
            next.chunks.insert(id, None);
        }
    }
    report.chunks_condemned = next.chunks.len() as u64;
    if let Some(lock) = target.object_lock() {
        // Every kept object is locked until `now` + days at least, once a quarter of the lock.
        if locked_at.is_none_or(|at| lock.is_stale(at, now)) {
            let until = lock.until(u64::try_from(now).unwrap_or(0));
            report.locks_extended = extend_locks(target, &next, until).await?;
            next.locked_at = Some(now);
        }
    }
    if let Some(lock) = target.object_lock().filter(|_| report.chunks_deleted > 0) {
        tracing::info!(
            target = %target.name,
            chunks = report.chunks_deleted,
            "deleted chunks are hidden behind delete markers; the bucket's object lock keeps their versions \
             up to {} days (a lifecycle rule on noncurrent versions frees them after)",
            lock.days
        );
    }
    target.put_object(Kind::Condemned, CONDEMNED, serde_json::to_vec(&next).expect("serialises")).await?;
    Ok(report)
}

/// Extends the lock of every object the target keeps (chunks not in `next`'s condemned list,
/// manifests, indexes, the marker) until `until`; how many. A chunk written since the prune
/// began is listed too: extending it is harmless.
async fn extend_locks(target: &Target, next: &Condemned, until: u64) -> Result<u64> {
    let extended = std::sync::atomic::AtomicU64::new(0);
    let extend = |path: String| {
        let extended = &extended;
        async move {
            target.extend_lock(&path, until).await?;
            extended.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok::<_, Error>(())
        }
    };
    extend(crate::target::MARKER.to_owned()).await?;
    let kept = |object: object_store::ObjectMeta| {
        let condemned = object.location.filename().is_some_and(|id| next.chunks.contains_key(id));
        (!condemned).then(|| object.location.to_string())
    };
    for (prefix, max) in [("volumes", MAX_VOLUME_OBJECTS), ("chunks", MAX_CHUNKS)] {
        target
            .list_stream(prefix, max)
            .try_filter_map(|object| std::future::ready(Ok(kept(object))))
            .try_for_each_concurrent(target.concurrency(), extend)
            .await?;
    }
    Ok(extended.into_inner())
}

/// A chunk's name as the mark keeps it: its first 64 bits (names are uniform). Two names that
/// share them only keep an unreferenced chunk one prune longer (~5e-14 per chunk at a million
/// referenced): the mark costs ~20 bytes per referenced chunk, not ~100.
fn key(id: &str) -> u64 {
    id.get(..16).and_then(|h| u64::from_str_radix(h, 16).ok()).unwrap_or(0)
}

/// Mark: the chunks every manifest under `volumes/` lists, in its index or not (one being
/// committed is not yet), as the objects are listed, with one index in memory at a time. A
/// manifest no index lists and older than the grace is no backup being committed: a crash's
/// leftover, it is deleted.
async fn mark(target: &Target, now: i64, grace_s: i64, report: &mut PruneReport) -> Result<HashSet<u64>> {
    let mut referenced = HashSet::new();
    let mut index: Option<Index> = None;
    let mut objects = target.list_stream("volumes", MAX_VOLUME_OBJECTS);
    while let Some(object) = objects.try_next().await? {
        let parts: Vec<&str> = object.location.as_ref().split('/').collect();
        let ["volumes", volume, "backups", id] = parts[..] else { continue };
        if index.as_ref().is_none_or(|i| i.volume != volume) {
            index = Some(Index::load(target, volume).await?);
        }
        let listed = index.as_ref().and_then(|i| i.backups.iter().find(|e| e.id == id));
        let b = BackupRef { volume: volume.to_owned(), id: id.to_owned() };
        let loaded = match listed {
            Some(e) => Manifest::load_listed(target, &b, e).await,
            None if object.last_modified.timestamp().saturating_add(grace_s) <= now => {
                tracing::info!(target = %target.name, backup = %b, "deleting a manifest no index lists (left by an interrupted backup or delete)");
                target.delete(&manifest_path(&b)).await?;
                continue;
            }
            None => Manifest::load_unlisted(target, &b, MAX_UNLISTED).await.map_err(|e| {
                if matches!(e, Error::Answer { .. }) {
                    Error::Conflict(format!(
                        "backup {b} is being committed on target {} and its manifest is larger than a prune reads \
                         while it is ({e}): prune again once it has committed",
                        target.name
                    ))
                } else {
                    e
                }
            }),
        };
        let m = match loaded {
            // Deleted since it was listed (`delete` takes the index entry first): nothing to keep.
            Err(e) if e.is_not_found() => continue,
            m => m?,
        };
        report.manifests += 1;
        referenced.extend(m.chunks.iter().map(|c| key(&c.id)));
    }
    Ok(referenced)
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
        }
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
