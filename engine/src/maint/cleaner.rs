//! The cleaner: moves the live blocks out of mostly-dead segments so a checkpoint can free them.
//!
//! - **Victims**: cost-benefit — emptier and older segments first (see `victims.rs`); a segment
//!   above [`MAX_UTILISATION`] is not worth moving in the background.
//! - **Moves** go in steps of at most [`STEP_BLOCKS`]. A step reads its candidate blocks and
//!   checks their crcs *outside* any lock (the victim is pinned, so it cannot be freed and
//!   reused meanwhile, and a written log block never changes), then, as a log barrier, keeps
//!   only the blocks still mapped where they were (a foreground write may have replaced them)
//!   and writes them, in logical order (so a fragmented volume comes out sequential), to the
//!   cold head (`write/cold.rs`), apart from fresh client writes. Foreground writes wait only for that
//!   write; between steps they go on. Moves may use the reserve segments: they always give
//!   back more than they take.
//! - **Throttle**: while the background cleaner runs, client writes are paced by what its moves
//!   give back (`pace.rs`), so cleaning and writing share the disk evenly instead of writers
//!   running the pool dry and then all stalling until a victim is freed.
//! - Where live blocks are is found once per run (one pass over every layer's map, bucketed by
//!   segment; again every few victims in a long background run), not once per victim.
//! - **Crash safety** needs nothing new: a move is a normal batch, replayed like any other, and
//!   the victim is released only by a checkpoint taken after its last block moved.
//! - A block whose crc does not match is never moved (that would launder the corruption under a
//!   fresh checksum): the victim is skipped and the error reported.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::ctx::{Ctx, FaultPoint};
use crate::error::{Error, ErrorKind, Result};
use crate::format::block_crc;
use crate::io::BLOCK;
use crate::maint::checkpoint::checkpoint;
use crate::maint::pace::Pace;
use crate::maint::victims::pick_victim;
use crate::map::layers;
use crate::map::segments::{Pinned, SegState};
use crate::read::readahead::Readahead;
use crate::write::room::MakeRoom;
use crate::write::{Log, tail};

/// Blocks moved per barrier (512 KiB): foreground writes wait at most for one step's write.
pub const STEP_BLOCKS: u64 = 128;
/// A run checkpoints (freeing what it cleaned) at least after this many segments.
const CHECKPOINT_EVERY: u64 = 8;
/// Segments fuller than this are not cleaned in the background.
pub const MAX_UTILISATION: f64 = 0.9;
/// Segments fuller than this are not cleaned even by a write that found the pool full.
const INLINE_MAX_U: f64 = 0.95;
/// Segments fuller than this are not cleaned ahead of need while the pool is idle: each block
/// freed then costs at most three moved.
const IDLE_MAX_U: f64 = 0.75;

/// What one cleaning run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanReport {
    pub segments_cleaned: u64,
    pub blocks_moved: u64,
    /// Segments given back to the free list by the checkpoint that ended the run.
    pub segments_freed: u64,
}

/// Cumulative figures, for pool status.
#[derive(Debug, Default)]
pub(crate) struct CleanerStats {
    pub runs: std::sync::atomic::AtomicU64,
    pub segments_cleaned: std::sync::atomic::AtomicU64,
    pub blocks_moved: std::sync::atomic::AtomicU64,
    pub active: std::sync::atomic::AtomicBool,
}

/// The cleaner's own state (its wake-up is `ctx.wake.cleaner`, space it frees is announced by
/// the checkpoint on `ctx.wake.freed`, damaged segments are flagged in the segment table).
#[derive(Debug, Default)]
pub(crate) struct Cleaner {
    /// Serialises cleaning runs (background and on demand).
    pub running: Mutex<()>,
    /// Client writes pay for their room while the background cleaner runs.
    pub pace: Pace,
    pub stats: CleanerStats,
}

/// What the write path asks of the cleaner when the log head finds no free segment.
#[derive(Debug)]
pub(crate) struct Room {
    pub cleaner: Arc<Cleaner>,
    pub readahead: Arc<Readahead>,
}

impl MakeRoom for Room {
    fn checkpoint(&self, ctx: &Ctx, log: &Log) -> Result<()> {
        checkpoint(ctx, log, &self.readahead)
    }

    fn clean_one(&self, ctx: &Ctx, log: &Log) -> Result<bool> {
        clean_inline(ctx, log, &self.cleaner, &self.readahead)
    }

    fn cleaning(&self) -> bool {
        self.cleaner.stats.active.load(Ordering::Acquire)
    }
}

/// A run of live blocks: (layer, lba, pba, blocks).
pub(crate) type LiveRun = (u64, u64, u64, u64);

/// Live runs in each of `segs`, each list in (layer, lba) order: one pass over every map.
///
/// The pass takes the state lock a slice of the maps at a time, so batches (which need it to
/// apply) are not held up for a whole pass. No consistent view is needed: blocks are only ever
/// written at the log head, so a sealed segment's live blocks can only go away meanwhile; a run
/// missed (a layer merge moving entries across the pass) leaves the victim with live blocks
/// after cleaning, and a segment with any live block is never freed.
fn live_runs(ctx: &Ctx, segs: &BTreeSet<usize>) -> BTreeMap<usize, Vec<LiveRun>> {
    /// Map chunks per lock hold.
    const SLICE: u64 = 16;
    let layers: Vec<u64> = ctx.state.read().layers.keys().copied().collect();
    let mut out: BTreeMap<usize, Vec<LiveRun>> = BTreeMap::new();
    for layer in layers {
        let mut chunk = 0;
        loop {
            let st = ctx.state.read();
            let Some(l) = st.layers.get(&layer) else { break };
            let per = st.segs.blocks_per_seg;
            for (lba, pba, n) in l.map.runs_in_chunks(chunk..chunk + SLICE) {
                let mut at = pba;
                while at < pba + n {
                    let (seg, _) = st.segs.locate(at);
                    let end = (st.segs.pba(seg, 0) + per).min(pba + n);
                    if segs.contains(&seg) {
                        out.entry(seg).or_default().push((layer, lba + (at - pba), at, end - at));
                    }
                    at = end;
                }
            }
            chunk += SLICE;
            if chunk >= l.map.chunk_end() {
                break;
            }
        }
    }
    for v in out.values_mut() {
        v.sort_unstable();
    }
    out
}

/// Reads a step's candidates and checks their crcs; the caller pins their segment.
pub(crate) fn read_step(ctx: &Ctx, log: &Log, cands: &[LiveRun]) -> Result<Vec<(LiveRun, Vec<u8>)>> {
    let crcs: Vec<Vec<Option<u32>>> = {
        let st = ctx.state.read();
        cands.iter().map(|c| (c.2..c.2 + c.3).map(|b| st.segs.crc(b)).collect()).collect()
    };
    let runs: Vec<(u64, u64)> = cands.iter().map(|c| (c.2, c.3)).collect();
    let media = tail::read_runs(ctx, &log.tail, &runs).map_err(|e| Error::io("cleaner: reading live blocks", e))?;
    let mut out = Vec::with_capacity(cands.len());
    let mut at = 0;
    for (c, crcs) in cands.iter().zip(crcs) {
        let len = usize::try_from(c.3).expect("small") * BLOCK;
        let data = media[at..at + len].to_vec();
        for (i, (block, crc)) in data.chunks(BLOCK).zip(crcs).enumerate() {
            if crc != Some(block_crc(block)) {
                ctx.checksum_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!("cleaner: checksum mismatch at pool block {}; segment left in place", c.2 + i as u64),
                ));
            }
        }
        out.push((*c, data));
        at += len;
    }
    Ok(out)
}

/// On the leader: moves the read blocks that are still mapped where they were.
pub(crate) fn move_step(ctx: &Ctx, log: &Log, read: Vec<(LiveRun, Vec<u8>)>) -> Result<u64> {
    ctx.fault(FaultPoint::CleanerBeforeMove)?;
    let piece = usize::try_from(ctx.max_batch_blocks).expect("small") * BLOCK;
    let mut moves = Vec::new();
    let mut moved = 0;
    {
        let st = ctx.state.read();
        for ((layer, lba, pba, n), data) in read {
            for (at, _, k) in layers::still_mapped(&st.layers, layer, lba, pba, n) {
                let from = usize::try_from(at - lba).expect("small") * BLOCK;
                let bytes = &data[from..from + usize::try_from(k).expect("small") * BLOCK];
                for (i, chunk) in bytes.chunks(piece).enumerate() {
                    moves.push((layer, at + (i * piece / BLOCK) as u64, chunk.to_vec()));
                }
                moved += k;
            }
        }
    }
    crate::write::batch::write_moves(ctx, log, moves)?;
    Ok(moved)
}

/// `cands` cut into steps of at most [`STEP_BLOCKS`] blocks.
fn split_steps(cands: Vec<LiveRun>) -> Vec<Vec<LiveRun>> {
    let mut steps = Vec::new();
    let mut step = Vec::new();
    let mut blocks = 0;
    for (layer, lba, pba, n) in cands {
        let mut done = 0;
        while done < n {
            let k = (n - done).min(STEP_BLOCKS - blocks);
            step.push((layer, lba + done, pba + done, k));
            blocks += k;
            done += k;
            if blocks == STEP_BLOCKS {
                steps.push(std::mem::take(&mut step));
                blocks = 0;
            }
        }
    }
    if !step.is_empty() {
        steps.push(step);
    }
    steps
}

/// Moves every live block of `cands` (all in segment `seg`) out of it, a step at a time,
/// earning client writes their room as it goes (see `pace.rs`).
fn clean_segment(ctx: &Ctx, log: &Log, cleaner: &Cleaner, seg: usize, cands: Vec<LiveRun>) -> Result<u64> {
    let mut pinned = Pinned::new(&ctx.pins);
    pinned.pin(seg);
    let (per_seg, live) = {
        let st = ctx.state.read();
        (st.segs.blocks_per_seg as f64, st.segs.segs[seg].live.max(1) as f64)
    };
    let (low, reserve) = (ctx.low_water() as f64, ctx.opts.reserve_segments as f64);
    let steps = split_steps(cands);
    let mut moved = 0;
    let mut next = steps.first().map(|step| read_step(ctx, log, step)).transpose()?;
    for i in 0..steps.len() {
        let read = next.take().expect("each step is read before it is moved");
        // The next step is read while this one is moved: reads need no lock (the victim stays
        // pinned and written log blocks never change), so the disk is kept busy with both.
        let (n, ahead) = std::thread::scope(|s| {
            let ahead = steps.get(i + 1).map(|step| s.spawn(move || read_step(ctx, log, step)));
            let n = log.barrier(ctx, move |ctx, log| move_step(ctx, log, read));
            (n, ahead.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))))
        });
        let n = n?;
        next = ahead.transpose()?;
        moved += n;
        // Below the low-water mark, earn less than is given back (the lower free space is, the
        // less), so free space climbs back.
        let free = ctx.state.read().segs.count(SegState::Free) as f64;
        let share = ((free - reserve) / (low - reserve)).clamp(0.25, 1.0);
        cleaner.pace.earn(n as f64 * (per_seg - live) / live * share);
    }
    Ok(moved)
}

/// Cleans victims while `more()` says so and good victims remain; ends with a checkpoint
/// that frees the cleaned segments. A `background` run only asks the checkpoint thread for
/// its checkpoints and does not wait for them (paced writers are waiting on its moves
/// meanwhile; its report then counts no segments freed), and it looks for victims again
/// every few, so a long run also sees the segments sealed since it started.
pub(crate) fn clean(
    ctx: &Ctx,
    log: &Log,
    cleaner: &Cleaner,
    ra: &Readahead,
    max_u: f64,
    background: bool,
    mut more: impl FnMut(&Ctx, &CleanReport) -> bool,
) -> Result<CleanReport> {
    let _one = cleaner.running.lock();
    let stats = &cleaner.stats;
    stats.active.store(true, Ordering::Relaxed);
    stats.runs.fetch_add(1, Ordering::Relaxed);
    let free_before = ctx.state.read().segs.count(SegState::Free) as u64;
    let mut report = CleanReport::default();
    // An on-demand run only takes segments sealed when it starts: the ones its moves fill
    // are never its victims (with small batches their headers would make them look worth
    // cleaning, and a run until no victim is left could go on moving the same blocks round).
    // A background run stops at a free-space mark, and must keep seeing new segments.
    let (mut eligible, mut live) = (BTreeSet::new(), BTreeMap::new());
    let mut result = Ok(());
    let mut picked = 0u64;
    while !ctx.wake.cleaner.stopped() && more(ctx, &report) {
        if picked == 0 || (background && picked.is_multiple_of(CHECKPOINT_EVERY)) {
            if background {
                // The pass earns nothing itself: credit in advance keeps paced writers going
                // meanwhile (the low-water feedback takes back what it overspends).
                cleaner.pace.earn(ctx.state.read().segs.blocks_per_seg as f64 / 2.0);
            }
            eligible = ctx.state.read().segs.sealed();
            live = live_runs(ctx, &eligible);
        }
        picked += 1;
        let Some(seg) = victim(ctx, max_u, &eligible) else { break };
        eligible.remove(&seg);
        match clean_segment(ctx, log, cleaner, seg, live.remove(&seg).unwrap_or_default()) {
            Ok(n) => {
                report.segments_cleaned += 1;
                report.blocks_moved += n;
                stats.segments_cleaned.fetch_add(1, Ordering::Relaxed);
                stats.blocks_moved.fetch_add(n, Ordering::Relaxed);
                // Cleaned segments come free only with a checkpoint: ask for one often enough
                // that writers are not left waiting for the end of a long run.
                let free = ctx.state.read().segs.count(SegState::Free) as u64;
                if report.segments_cleaned % CHECKPOINT_EVERY == 0 || free < ctx.low_water() {
                    ctx.wake.checkpoint.raise();
                }
            }
            Err(e) if e.kind() == ErrorKind::Corrupt => {
                tracing::error!(segment = seg, error = %e, "cleaner skipped a damaged segment");
                ctx.state.write().segs.segs[seg].damaged = true;
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let ckpt = if report.segments_cleaned > 0 && !background { checkpoint(ctx, log, ra) } else { Ok(()) };
    stats.active.store(false, Ordering::Relaxed);
    result?;
    ckpt?;
    let free_after = ctx.state.read().segs.count(SegState::Free) as u64;
    report.segments_freed = free_after.saturating_sub(free_before);
    Ok(report)
}

/// The victim among `eligible` for a run taking segments up to `max_u` live (see `victims.rs`).
fn victim(ctx: &Ctx, max_u: f64, eligible: &BTreeSet<usize>) -> Option<usize> {
    let st = ctx.state.read();
    pick_victim(&st.segs, st.applied.seq, max_u, eligible, |i| ctx.pins.any(i))
}

/// On the leader, out of space: cleans the best victim (up to [`INLINE_MAX_U`] live) directly, without
/// barriers (nothing else writes while the leader is here), and checkpoints so it comes free.
/// Returns false once no victim is left (a damaged one is set aside and counts as tried).
fn clean_inline(ctx: &Ctx, log: &Log, cleaner: &Cleaner, ra: &Readahead) -> Result<bool> {
    let eligible = ctx.state.read().segs.sealed();
    let Some(seg) = victim(ctx, INLINE_MAX_U, &eligible) else { return Ok(false) };
    let cands = live_runs(ctx, &BTreeSet::from([seg])).remove(&seg).unwrap_or_default();
    let mut pinned = Pinned::new(&ctx.pins);
    pinned.pin(seg);
    for step in cands.chunks(64) {
        let read = match read_step(ctx, log, step) {
            Ok(r) => r,
            // A damaged victim is left alone (and not chosen again); the caller tries the next.
            Err(e) if e.kind() == ErrorKind::Corrupt => {
                tracing::error!(segment = seg, error = %e, "cleaner skipped a damaged segment");
                ctx.state.write().segs.segs[seg].damaged = true;
                return Ok(true);
            }
            Err(e) => return Err(e),
        };
        let n = move_step(ctx, log, read)?;
        cleaner.stats.blocks_moved.fetch_add(n, Ordering::Relaxed);
    }
    drop(pinned);
    cleaner.stats.segments_cleaned.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(segment = seg, "cleaned a segment in the write path (pool was full)");
    checkpoint(ctx, log, ra)?;
    Ok(true)
}

/// Whether a write that found the pool full should wait for the cleaner rather than fail: the
/// background cleaner is on, and the segments a cleaner would take (at most [`INLINE_MAX_U`]
/// live) hold at least a segment's worth of dead space between them.
pub(crate) fn worth_waiting(ctx: &Ctx) -> bool {
    if !ctx.opts.background_cleaner || ctx.check_open().is_err() {
        return false;
    }
    let st = ctx.state.read();
    let per = st.segs.blocks_per_seg;
    let dead: u64 = st
        .segs
        .segs
        .iter()
        .filter(|s| s.state == SegState::Sealed && s.live as f64 <= per as f64 * INLINE_MAX_U)
        .map(|s| per - s.live)
        .sum();
    dead >= per
}

/// Background cleaning: whenever free space runs low (checked every interval or when kicked),
/// clean until twice the low-water mark is free or no victim is worth it, with client writes
/// paced meanwhile.
pub(crate) fn cleaner_loop(ctx: &Ctx, log: &Log, cleaner: &Cleaner, ra: &Readahead) {
    let interval = ctx.opts.cleaner_interval.max(Duration::from_millis(10));
    let pace = &cleaner.pace;
    let mut pacing = false;
    let mut idle = Idle { ops: u64::MAX, since: Instant::now(), cleaned: false };
    loop {
        if ctx.wake.cleaner.wait(interval, pacing) {
            pace.stop();
            return;
        }
        let free = |c: &Ctx| c.state.read().segs.count(SegState::Free) as u64;
        let low = ctx.low_water();
        let enough = if pacing { 2 * low } else { low };
        // A checkpoint alone frees wholly dead segments (only worth taking if there are some).
        let done = ctx.check_open().is_err()
            || free(ctx) >= enough
            || (ctx.state.read().segs.any_empty_sealed(&ctx.pins)
                && checkpoint(ctx, log, ra).is_ok()
                && free(ctx) >= enough);
        if done {
            pace.stop();
            pacing = false;
            if idle.due(ctx) {
                idle.cleaned = clean_idle(ctx, log, cleaner, ra, idle.ops);
            }
            continue;
        }
        if !pacing {
            pace.start(ctx.state.read().segs.blocks_per_seg);
            pacing = true;
        }
        let run =
            clean(ctx, log, cleaner, ra, MAX_UTILISATION, true, |c, _| free(c) < 2 * low && c.check_open().is_ok());
        match run {
            Ok(r) if r.segments_cleaned > 0 => {
                tracing::debug!(cleaned = r.segments_cleaned, moved_blocks = r.blocks_moved, "cleaner ran");
            }
            Ok(_) => {
                pace.stop();
                pacing = false;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cleaner run failed");
                pace.stop();
                pacing = false;
            }
        }
    }
}

/// The pool's idleness as the cleaner loop samples it (see [`PoolOptions::idle_cleaning`]).
///
/// [`PoolOptions::idle_cleaning`]: crate::PoolOptions::idle_cleaning
struct Idle {
    /// `ctx.client_ops` when last sampled, and since when it has stood still.
    ops: u64,
    since: Instant,
    /// An idle run finished (no victim left) since the last client request: nothing to do
    /// until the next one.
    cleaned: bool,
}

impl Idle {
    /// Whether an idle run is due now.
    fn due(&mut self, ctx: &Ctx) -> bool {
        let ops = ctx.client_ops.load(Ordering::Relaxed);
        if ops != self.ops {
            *self = Self { ops, since: Instant::now(), cleaned: false };
        }
        ctx.opts.idle_cleaning.is_some_and(|after| !self.cleaned && self.since.elapsed() >= after)
    }
}

/// Cleans victims up to [`IDLE_MAX_U`] live while no client request comes (`ops` is the
/// request count it started at), then checkpoints so they come free. True when it ran out of
/// victims rather than being interrupted.
fn clean_idle(ctx: &Ctx, log: &Log, cleaner: &Cleaner, ra: &Readahead, ops: u64) -> bool {
    let quiet = |c: &Ctx| c.client_ops.load(Ordering::Relaxed) == ops && c.check_open().is_ok();
    match clean(ctx, log, cleaner, ra, IDLE_MAX_U, false, |c, _| quiet(c)) {
        Ok(r) => {
            if r.segments_cleaned > 0 {
                tracing::debug!(cleaned = r.segments_cleaned, moved_blocks = r.blocks_moved, "cleaned while idle");
            }
            quiet(ctx)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cleaning while idle failed");
            true // not again until clients come and go
        }
    }
}
