//! Taking a backup of a snapshot.
//!
//! Against the previous backup's snapshot, the chunks the changed ranges touch are read, every
//! other chunk's reference is the previous manifest's; with no usable previous backup (none, its
//! snapshot gone, another chunk size, or every `full-every`th backup) every allocated chunk is
//! read. A segment at a time (`segment.rs`): a segment in which nothing is read is the previous
//! backup's, unread; otherwise the previous one is read, then `concurrency` chunks at a time:
//! read the chunk, skip it if it is all zeros, name it, skip the upload if the target already
//! holds that name (the previous segment lists it, or a HEAD finds it: this is also how an
//! interrupted backup resumes: what it uploaded is found and not sent again), else compress,
//! seal and PUT, paced; then the segment. Last the manifest, then the volume's index.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use ferrite_engine::{Image, Pool, SnapshotInfo};
use futures_util::StreamExt;

use crate::codec::Kind;
use crate::manifest::{BackupRef, ChunkRef, Index, Manifest, SnapshotIdentity, chunk_path};
use crate::prune::Swept;
use crate::segment::SPAN;
use crate::target::FORMAT;
use crate::writers::Lease;
use crate::{Error, Pace, Result, Target, prune, quarantine};

/// What to back up.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub volume: String,
    /// A snapshot of `volume` on this pool.
    pub snapshot: String,
    /// The backup's id (unique per volume on the target; [`crate::new_id`] makes one from the time).
    pub id: String,
    /// Read every chunk even when an incremental is possible.
    pub full: bool,
}

/// How far a backup (or a restore, or a verify) has got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub chunks_total: u64,
    pub chunks_done: u64,
    pub bytes_total: u64,
    pub bytes_done: u64,
    /// Bytes sent to (or fetched from) the store.
    pub bytes_transferred: u64,
}

/// Backs up `opts.snapshot` to `target` and records it in the volume's index.
pub async fn create(
    target: &Target,
    pool: &Pool,
    opts: &CreateOptions,
    progress: &(dyn Fn(&Progress) + Sync),
) -> Result<Manifest> {
    let index = Index::load(target, &opts.volume).await?;
    create_after(target, pool, opts, &index, progress).await
}

/// [`create`], the volume's `index` on the target loaded already.
pub(crate) async fn create_after(
    target: &Target,
    pool: &Pool,
    opts: &CreateOptions,
    index: &Index,
    progress: &(dyn Fn(&Progress) + Sync),
) -> Result<Manifest> {
    crate::writers::with_lease(target, async |lease| create_leased(target, pool, opts, index, progress, lease).await)
        .await
}

/// [`create_after`] under the writer's `lease`.
async fn create_leased(
    target: &Target,
    pool: &Pool,
    opts: &CreateOptions,
    index: &Index,
    progress: &(dyn Fn(&Progress) + Sync),
    lease: &Lease,
) -> Result<Manifest> {
    let this = BackupRef { volume: opts.volume.clone(), id: opts.id.clone() };
    // Read after the lease and before anything else: chunks a prune condemned since are
    // uploaded again (prune.rs).
    let swept = prune::load_swept(target).await?;
    // Chunks a verify found bad: read again even where the previous backup lists them.
    let quarantined = quarantine::load(target).await?;
    if index.backups.iter().any(|b| b.id == opts.id) {
        return Err(Error::Conflict(format!("backup {this} already exists on target {}", target.name)));
    }
    let info = pool.snapshot_info(&opts.snapshot)?;
    if info.volume.as_deref() != Some(opts.volume.as_str()) {
        return Err(Error::Invalid(format!(
            "snapshot {:?} is not a snapshot of volume {:?}",
            opts.snapshot, opts.volume
        )));
    }
    let snap = pool.open_snapshot(&opts.snapshot)?;
    let encrypted = snap.is_encrypted()?;
    if encrypted && !target.is_sealed() {
        return Err(Error::Invalid(format!(
            "volume {:?} is encrypted and target {} has no key-file: its backup would hold plaintext",
            opts.volume, target.name
        )));
    }
    let chunk = target.chunk_size();
    let count = info.size.div_ceil(chunk);

    let source =
        SnapshotIdentity { pool: pool.uuid().to_string(), id: info.id, created: info.created_unix, nonce: info.nonce };

    // The previous backup, if an incremental can build on it: its snapshot must be this one or
    // an earlier one of the same volume, on this pool, by identity (not by name).
    let full_every = u64::from(target.config.full_every.unwrap_or(30).max(1));
    let since_full = index.backups.iter().rev().take_while(|b| !b.full).count() as u64;
    let mut previous = None;
    let mut full_reason = None;
    if let Some(last) = index.backups.last() {
        let b = BackupRef { volume: opts.volume.clone(), id: last.id.clone() };
        let m = match Manifest::load_listed(target, &b, last).await {
            Err(e) if e.is_not_found() => None,
            m => Some(m?),
        };
        let base = if opts.full {
            Err("a full backup was asked for".to_owned())
        } else if since_full + 1 >= full_every {
            Err(format!("every {full_every}th backup is full (the target's full-every)"))
        } else if let Some(why) = lock_wants_full(target, index, swept.locked_at) {
            Err(why)
        } else if let Some(m) = m {
            base_snapshot(pool, &info, &source, &m, chunk).map(|name| (m, name))
        } else {
            Err(format!("the previous backup ({b}) was deleted meanwhile"))
        };
        match base {
            Ok(base) => previous = Some(base),
            Err(why) => full_reason = Some(why),
        }
    }
    let base = previous.as_ref().map(|(_, base)| base.as_str());
    let ranges = match pool.changed_ranges(Image::Snapshot(&opts.snapshot), base) {
        Err(e) if e.kind() == ferrite_engine::ErrorKind::InvalidArgument && previous.is_some() => {
            full_reason = Some(format!("the previous backup's snapshot is no ancestor of this one: {e}"));
            previous = None;
            pool.changed_ranges(Image::Snapshot(&opts.snapshot), None)?
        }
        ranges => ranges?,
    };
    let previous = previous.map(|(m, _)| m);
    if let Some(why) = &full_reason {
        tracing::info!(target = %target.name, backup = %this, why, "this backup reads the whole volume");
    }
    let reading = Reading::new(ranges, chunk, info.size, previous.as_ref().map(|m| m.size));

    let mut done = reading.total(count);
    progress(&done);
    let pace = Arc::new(Pace::new(target.config.bandwidth));
    let swept = Arc::new(swept);
    let (mut segments, mut uploaded, mut new_chunks) = (Vec::new(), 0, 0);
    let (mut again, mut again_segments) = (Vec::new(), Vec::new());
    // A segment at a time: its previous version, the chunks to read in it, then the segment.
    for n in 0..count.div_ceil(SPAN) {
        let span = n * SPAN..count.min((n + 1) * SPAN);
        let mut read = reading.positions(span.clone());
        let mut reused = previous.as_ref().and_then(|m| m.segment(n));
        // A segment none of whose chunks changed is the previous backup's, unread.
        if let Some(seg) =
            reused.filter(|s| read.is_empty() && quarantined.is_empty() && !swept.condemned.contains(&s.id))
        {
            segments.push(seg.clone());
            continue;
        }
        let before = match &previous {
            Some(m) => match m.chunks_of_segment(target, n).await {
                Ok(before) => before,
                // Missing or damaged (a verify quarantines a bad one): its span is read whole.
                Err(Error::Corrupt { what, why, .. }) => {
                    tracing::warn!(target = %target.name, backup = %this, segment = %what, why,
                        "a segment of the previous backup is unreadable: its span is read whole");
                    let allocated = pool.changed_ranges(Image::Snapshot(&opts.snapshot), None)?;
                    let whole = Reading::new(allocated, chunk, info.size, None);
                    reused = None;
                    for i in whole.positions(span.clone()) {
                        if read.insert(i) {
                            done.chunks_total += 1;
                            done.bytes_total += chunk.min(info.size - i * chunk);
                        }
                    }
                    Vec::new()
                }
                Err(e) => return Err(e),
            },
            None => Vec::new(),
        };
        // Chunks a verify found bad are read again.
        for c in before.iter().filter(|c| quarantined.contains(&c.id)) {
            if read.insert(c.i) {
                done.chunks_total += 1;
                done.bytes_total += chunk.min(info.size - c.i * chunk);
            }
        }
        let mut refs: Vec<ChunkRef> = before.iter().filter(|c| !read.contains(&c.i)).cloned().collect();
        // Names the previous manifest lists are on the target (a prune keeps what a manifest lists).
        let known: HashSet<String> = before.into_iter().map(|c| c.id).filter(|id| !quarantined.contains(id)).collect();
        let shared = Arc::new((known, Arc::clone(&swept), parking_lot::Mutex::new(HashSet::new())));
        let mut results = futures_util::stream::iter(read)
            .map(|i| {
                let (target, snap, pace, shared) = (target.clone(), snap.clone(), pace.clone(), shared.clone());
                let len = chunk.min(info.size - i * chunk);
                async move {
                    back_up_chunk(&target, snap, i * chunk, len, &pace, &shared.2, &shared.0, &shared.1)
                        .await
                        .map(|r| (i, len, r))
                }
            })
            .buffer_unordered(target.concurrency());
        while let Some(r) = results.next().await {
            let (i, len, stored) = r?;
            if let Some((id, bytes)) = stored {
                uploaded += bytes;
                new_chunks += u64::from(bytes > 0);
                if bytes > 0 && swept.condemned.contains(&id) {
                    again.push((i, len, id.clone()));
                }
                refs.push(ChunkRef { i, id, len: u32::try_from(len).expect("chunks are at most 4 MiB") });
            }
            done.chunks_done += 1;
            done.bytes_done += len;
            done.bytes_transferred = uploaded;
            progress(&done);
        }
        drop(results);
        if refs.is_empty() {
            continue;
        }
        refs.sort_by_key(|c| c.i);
        let stored = crate::segment::store(target, span.start, &refs, reused, &swept, &pace).await?;
        uploaded += stored.uploaded;
        again_segments.extend(stored.again.map(|data| (stored.seg.id.clone(), data)));
        segments.push(stored.seg);
    }

    let manifest = Manifest {
        format: FORMAT,
        volume: opts.volume.clone(),
        id: opts.id.clone(),
        snapshot: opts.snapshot.clone(),
        source: Some(source),
        created: info.created_unix,
        size: info.size,
        chunk_size: chunk,
        previous: previous.as_ref().map(|m| m.id.clone()),
        full: previous.is_none(),
        full_reason,
        encrypted_volume: encrypted,
        segments,
        inline: Vec::new(),
        read_bytes: done.bytes_total,
        uploaded_bytes: uploaded,
        new_chunks,
        copied_from: None,
        attempt: Some(lease.attempt().to_owned()),
    };
    manifest.commit(target, lease).await?;
    // A prune's HEAD and DELETE of a condemned chunk are two requests: one this backup uploaded
    // again in between is gone. Its manifest is listed now, so a later prune keeps it: upload it
    // once more.
    for (i, len, id) in again {
        let path = chunk_path(&id);
        if target.head(&path).await?.is_none() {
            tracing::warn!(target = %target.name, backup = %this, chunk = %id,
                "a chunk uploaded again was swept by a prune meanwhile: uploading it once more");
            let read = read_chunk(target, snap.clone(), i * chunk, len).await?;
            let (_, buf) = read.expect("it held data when it was read");
            upload(target, &path, buf, &pace).await?;
        }
    }
    crate::segment::store_again(target, again_segments, &pace).await?;
    Ok(manifest)
}

/// Under an object lock, why this backup must read everything (and so HEAD, and extend, every
/// chunk it references): no prune has extended the chunks' lock for the lock's refresh
/// (`locked_at`), and the last full backup is older than that too (`object_lock.rs`).
fn lock_wants_full(target: &Target, index: &Index, locked_at: Option<i64>) -> Option<String> {
    let lock = target.object_lock()?;
    let refresh = lock.refresh().as_secs();
    let extended = locked_at.and_then(|at| u64::try_from(at).ok()).unwrap_or(0);
    let last_full = index.backups.iter().rev().find(|b| b.full).map_or(0, |b| b.created);
    let age = crate::now_unix().saturating_sub(last_full.max(extended));
    (age > refresh).then(|| {
        format!(
            "the target's object lock ({} days) needs its chunks' lock extended every {} hours, by a prune or a \
             full backup (the last was {} hours ago)",
            lock.days,
            refresh / 3600,
            age / 3600
        )
    })
}

/// The name the snapshot backup `m` read has on `pool` now, if a backup of snapshot `info`
/// (`source`) can build on it; else why not.
fn base_snapshot(
    pool: &Pool,
    info: &SnapshotInfo,
    source: &SnapshotIdentity,
    m: &Manifest,
    chunk: u64,
) -> std::result::Result<String, String> {
    let Some(was) = &m.source else {
        return Err(format!("the previous backup ({}) does not record which snapshot it read", m.id));
    };
    if was.pool != source.pool {
        return Err(format!("the previous backup ({}) was taken on another pool ({})", m.id, was.pool));
    }
    if was.id > source.id {
        return Err(format!("the previous backup ({}) read a later snapshot than this one", m.id));
    }
    if m.chunk_size != chunk || m.size > info.size {
        return Err(format!("the previous backup ({}) has another chunk size or a larger volume", m.id));
    }
    if was.nonce == 0 {
        return Err(format!("the previous backup ({}) does not record its snapshot's nonce (an earlier build)", m.id));
    }
    let snapshots = pool.snapshots(None).map_err(|e| e.to_string())?;
    let base = snapshots.into_iter().find(|s| s.id == was.id && s.volume_id == info.volume_id);
    let base = base.ok_or_else(|| format!("the snapshot the previous backup ({}) read is gone", m.id))?;
    if (base.created_unix, base.nonce) != (was.created, was.nonce) {
        return Err(format!(
            "the previous backup ({}) read another snapshot {} of this pool's uuid (a pool copied from the same \
             image, or restored from a copy): its data is not this pool's",
            m.id, was.id
        ));
    }
    Ok(base.name)
}

/// What a backup reads: the chunks that the changed (or allocated) `ranges` touch, and those
/// past the previous backup's size (`old_size`: a grown volume), its last one included when it
/// was short.
struct Reading {
    ranges: Vec<(u64, u64)>,
    chunk: u64,
    size: u64,
    old_size: Option<u64>,
}

impl Reading {
    fn new(mut ranges: Vec<(u64, u64)>, chunk: u64, size: u64, old_size: Option<u64>) -> Reading {
        ranges.sort_unstable();
        Reading { ranges, chunk, size, old_size }
    }

    /// The positions to read in `span`.
    fn positions(&self, span: std::ops::Range<u64>) -> BTreeSet<u64> {
        let chunk = self.chunk;
        let (lo, hi) = (span.start * chunk, span.end * chunk);
        let from = self.ranges.partition_point(|&(offset, len)| offset + len <= lo);
        let mut read = BTreeSet::new();
        for &(offset, len) in self.ranges[from..].iter().take_while(|(offset, _)| *offset < hi) {
            let (first, last) = (offset.max(lo) / chunk, (offset + len).min(hi).div_ceil(chunk));
            read.extend(first..last);
        }
        if let Some(old) = self.old_size {
            let grown = old.div_ceil(chunk) - u64::from(!old.is_multiple_of(chunk));
            read.extend(grown.max(span.start)..span.end);
        }
        read
    }

    /// The chunks and bytes to read in all (`count` positions), besides quarantined ones.
    fn total(&self, count: u64) -> Progress {
        let mut total = Progress::default();
        for n in 0..count.div_ceil(SPAN) {
            for i in self.positions(n * SPAN..count.min((n + 1) * SPAN)) {
                total.chunks_total += 1;
                total.bytes_total += self.chunk.min(self.size - i * self.chunk);
            }
        }
        total
    }
}

/// Reads one chunk and stores it unless the target has it. Returns its name and the bytes
/// uploaded (0 when it was there), or None when it reads as zeros.
#[allow(clippy::too_many_arguments)]
async fn back_up_chunk(
    target: &Target,
    snap: ferrite_engine::Volume,
    offset: u64,
    len: u64,
    pace: &Pace,
    sent: &parking_lot::Mutex<HashSet<String>>,
    known: &HashSet<String>,
    swept: &Swept,
) -> Result<Option<(String, u64)>> {
    let Some((id, buf)) = read_chunk(target, snap, offset, len).await? else { return Ok(None) };
    let path = chunk_path(&id);
    let fresh = !swept.condemned.contains(&id);
    if (fresh && known.contains(&id)) || !sent.lock().insert(id.clone()) {
        return Ok(Some((id, 0)));
    }
    if fresh && target.holds_fresh(&path, swept.locked_at).await? {
        return Ok(Some((id, 0)));
    }
    let bytes = upload(target, &path, buf, pace).await?;
    Ok(Some((id, bytes)))
}

/// The chunk at `offset` of `snap` and its name on `target`, or None when it reads as zeros.
async fn read_chunk(
    target: &Target,
    snap: ferrite_engine::Volume,
    offset: u64,
    len: u64,
) -> Result<Option<(String, Vec<u8>)>> {
    let codec = target.codec.clone();
    let read = tokio::task::spawn_blocking(move || -> Result<Option<(String, Vec<u8>)>> {
        let mut buf = vec![0u8; usize::try_from(len).expect("chunks are at most 4 MiB")];
        snap.read(offset, &mut buf)?;
        if buf.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        Ok(Some((codec.chunk_id(&buf), buf)))
    });
    read.await.expect("reading a chunk does not panic")
}

/// Seals `plain` and stores it at `path`, paced; the bytes sent.
pub(crate) async fn upload(target: &Target, path: &str, plain: Vec<u8>, pace: &Pace) -> Result<u64> {
    let codec = target.codec.clone();
    let name = path.to_owned();
    let sealed = tokio::task::spawn_blocking(move || codec.seal(Kind::Chunk, &name, &plain))
        .await
        .expect("sealing does not panic");
    let bytes = sealed.len() as u64;
    pace.admit(bytes).await;
    target.put(path, sealed.into()).await?;
    Ok(bytes)
}
