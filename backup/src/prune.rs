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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::manifest::{BackupRef, Index, IndexEntry, Manifest, manifest_path};
use crate::target::FORMAT;
use crate::{Error, Result, Target};

const CONDEMNED: &str = "gc/condemned";
/// Most chunks one prune condemns (the rest wait for the next prune): the list stays below
/// [`MAX_CONDEMNED`], which every backup reads.
const CONDEMN_AT_MOST: usize = 200_000;
const MAX_CONDEMNED: usize = 32 << 20;
/// Most manifests a target may hold (a prune lists them all).
const MAX_MANIFESTS: usize = 10_000_000;
const CLOCK: &str = "gc/clock";

#[derive(Debug, Default, Serialize, Deserialize)]
struct Condemned {
    format: u32,
    /// Chunk name -> condemned since (unix seconds, the store's clock); None: since this list
    /// was written (its Last-Modified).
    chunks: BTreeMap<String, Option<i64>>,
}

async fn load(target: &Target) -> Result<BTreeMap<String, i64>> {
    match target.get_object(Kind::Condemned, CONDEMNED, MAX_CONDEMNED).await {
        Ok((data, meta)) => {
            let list: Condemned = crate::manifest::decode(target, CONDEMNED, &data)?;
            let written = meta.last_modified.timestamp();
            Ok(list.chunks.into_iter().map(|(id, since)| (id, since.unwrap_or(written))).collect())
        }
        Err(e) if e.is_not_found() => Ok(BTreeMap::new()),
        Err(e) => Err(e),
    }
}

/// The chunks the last prune condemned (a backup uploads these again).
pub(crate) async fn load_condemned(target: &Target) -> Result<HashSet<String>> {
    Ok(load(target).await?.into_keys().collect())
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
}

impl Retention {
    /// The ids to keep of `backups` (any order).
    pub fn keep(&self, backups: &[IndexEntry]) -> HashSet<String> {
        let mut newest: Vec<&IndexEntry> = backups.iter().collect();
        newest.sort_by(|a, b| (b.created, &b.id).cmp(&(a.created, &a.id)));
        let mut keep: HashSet<String> =
            newest.iter().take(self.keep_last.max(1) as usize).map(|b| b.id.clone()).collect();
        // Periods by days since the epoch; the epoch was a Thursday, so weeks start on Mondays at +3.
        let month = |d: u64| {
            let (y, m, _) = crate::create::civil(d);
            y * 12 + m
        };
        let periods: [(u32, &dyn Fn(u64) -> u64); 4] = [
            (self.keep_daily, &|d| d),
            (self.keep_weekly, &|d| (d + 3) / 7),
            (self.keep_monthly, &month),
            (self.keep_yearly, &|d| crate::create::civil(d).0),
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
        for volume in target.list_dirs("volumes").await? {
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

    // Mark: every manifest under volumes/, in an index or not (one being committed is not yet).
    let mut referenced = HashSet::new();
    let mut indexes: HashMap<String, Index> = HashMap::new();
    for object in target.list("volumes", MAX_MANIFESTS).await? {
        let parts: Vec<&str> = object.location.as_ref().split('/').collect();
        if let ["volumes", volume, "backups", id] = parts[..] {
            if !indexes.contains_key(volume) {
                indexes.insert(volume.to_owned(), Index::load(target, volume).await?);
            }
            let listed = indexes[volume].backups.iter().find(|e| e.id == id);
            let b = BackupRef { volume: volume.to_owned(), id: id.to_owned() };
            let m = Manifest::load_listed(target, &b, listed).await?;
            report.manifests += 1;
            referenced.extend(m.chunks.into_iter().map(|c| c.id));
        }
    }
    report.chunks_referenced = referenced.len() as u64;
    crate::quarantine::retain(target, |id| referenced.contains(id)).await?;

    // Sweep, as the chunks are listed.
    let previous = load(target).await?;
    let grace_s = i64::try_from(grace.as_secs()).unwrap_or(i64::MAX);
    let mut next = Condemned { format: FORMAT, chunks: BTreeMap::new() };
    let mut chunks = target.list_stream("chunks");
    while let Some(object) = chunks.try_next().await? {
        let Some(id) = object.location.filename().map(str::to_owned) else { continue };
        if referenced.contains(&id) {
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
        } else if since.is_some() || next.chunks.len() < CONDEMN_AT_MOST {
            next.chunks.insert(id, since);
        }
    }
    report.chunks_condemned = next.chunks.len() as u64;
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
    fn monthly_and_yearly_keep_the_newest_of_each_calendar_period() {
        const DAY: u64 = 86_400;
        // One backup on the 1st and one on the 20th of every month from 2024-01 to 2026-12.
        let mut all = Vec::new();
        for year in 2024..=2026u64 {
            for month in 1..=12u64 {
                for day in [1, 20] {
                    let days = (0..40_000).find(|&d| crate::create::civil(d) == (year, month, day)).unwrap();
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
        assert_eq!(crate::create::civil(19_782), (2024, 2, 29));
        assert_eq!(crate::create::civil(20_818), (2026, 12, 31));
    }
}
