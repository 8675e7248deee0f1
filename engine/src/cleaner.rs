//! The cleaner: moves the live blocks out of mostly-dead segments so a checkpoint can free them.
//!
//! - **Victims** by cost-benefit (Rosenblum & Ousterhout): among sealed segments, the highest
//!   `(1 - u) * age / (1 + u)`, where `u` is the live fraction and `age` how many batches ago
//!   the segment was last written. Cold, mostly-dead segments go first; a segment above
//!   [`MAX_UTILISATION`] is never worth moving.
//! - **Moves** run in steps of at most [`STEP_BLOCKS`] as log barriers: inside one, the leader
//!   re-checks that each candidate block is still mapped where it was (a foreground write may
//!   have replaced it since), reads it, verifies its crc, and writes it to the log head as an
//!   ordinary batch naming its layer, in logical order (so a fragmented volume comes out
//!   sequential). Between steps foreground batches go on, which is the throttle. Moves may use
//!   the reserve segments: they always give back more than they take.
//! - **Crash safety** needs nothing new: a move is a normal batch, replayed like any other, and
//!   the victim is released only by a checkpoint taken after its last block moved.
//! - A block whose crc does not match is never moved (that would launder the corruption under a
//!   fresh checksum): the victim is skipped and the error reported.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, ErrorKind, Result};
use crate::extent_map::is_zero;
use crate::format::block_crc;
use crate::io::{AlignedBuf, BLOCK, ReadOp};
use crate::pool::Inner;
use crate::segments::SegState;

/// Blocks moved per barrier (1 MiB): foreground writes wait at most for one step.
pub const STEP_BLOCKS: u64 = 256;
/// Segments fuller than this are not cleaned in the background.
pub const MAX_UTILISATION: f64 = 0.9;

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

/// Wakes the background cleaner or stops it.
#[derive(Debug, Default)]
pub(crate) struct CleanerCtl {
    ctl: Mutex<(bool, bool)>, // (stop, wanted)
    cv: Condvar,
    /// Serialises cleaning runs (background and on demand).
    pub running: Mutex<()>,
    pub stats: CleanerStats,
}

impl CleanerCtl {
    pub fn kick(&self) {
        self.ctl.lock().1 = true;
        self.cv.notify_one();
    }

    pub fn stop(&self) {
        self.ctl.lock().0 = true;
        self.cv.notify_one();
    }

    fn stopping(&self) -> bool {
        self.ctl.lock().0
    }
}

/// The victim with the best cost-benefit among the `eligible` segments at most `max_u` live.
fn pick_victim(inner: &Inner, max_u: f64, eligible: &BTreeSet<usize>) -> Option<usize> {
    let st = inner.state.read();
    let per_seg = st.segs.blocks_per_seg as f64;
    let now = st.applied.seq;
    st.segs
        .segs
        .iter()
        .enumerate()
        .filter(|(i, s)| s.state == SegState::Sealed && eligible.contains(i))
        .filter_map(|(i, s)| {
            let u = s.live as f64 / per_seg;
            if u > max_u {
                return None;
            }
            let age = now.saturating_sub(s.last_seq).max(1) as f64;
            Some((i, (1.0 - u) * age / (1.0 + u)))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

/// Live runs in segment `seg` as (layer, lba, pba, blocks), in (layer, lba) order.
fn live_runs(inner: &Inner, seg: usize) -> Vec<(u64, u64, u64, u64)> {
    let st = inner.state.read();
    let lo = st.segs.pba(seg, 0);
    let hi = lo + st.segs.blocks_per_seg;
    let mut out = Vec::new();
    for (&layer, l) in &st.layers {
        for (lba, pba, n) in l.map.runs() {
            let (a, b) = (pba.max(lo), (pba + n).min(hi));
            if a < b {
                out.push((layer, lba + (a - pba), a, b - a));
            }
        }
    }
    out.sort_unstable();
    out
}

/// One step, on the leader: moves the candidates that are still mapped where they were.
fn move_step(inner: &Inner, cands: &[(u64, u64, u64, u64)]) -> Result<u64> {
    // Re-check under the lock: keep the parts still mapped to the same physical blocks.
    let mut runs: Vec<(u64, u64, u64, u64, Vec<u32>)> = Vec::new();
    {
        let st = inner.state.read();
        for &(layer, lba, pba, n) in cands {
            let Some(l) = st.layers.get(&layer) else { continue };
            for (at, p, k) in l.map.entries_in(lba, n) {
                if !is_zero(p) && p == pba + (at - lba) {
                    let crcs = (p..p + k).map(|b| st.segs.crc(b).unwrap_or(0)).collect();
                    runs.push((layer, at, p, k, crcs));
                }
            }
        }
    }
    let total: u64 = runs.iter().map(|r| r.3).sum();
    if total == 0 {
        return Ok(0);
    }
    let mut media = AlignedBuf::new(usize::try_from(total).expect("step is small") * BLOCK);
    {
        let mut rest: &mut [u8] = &mut media;
        let mut ops = Vec::with_capacity(runs.len());
        for r in &runs {
            let (head, tail) = rest.split_at_mut(usize::try_from(r.3).expect("small") * BLOCK);
            ops.push(ReadOp { offset: r.2 * BLOCK as u64, buf: head });
            rest = tail;
        }
        inner.backend.read_many(&mut ops).map_err(|e| Error::io("cleaner: reading live blocks", e))?;
    }
    let mut moves = Vec::with_capacity(runs.len());
    let mut at = 0;
    for (layer, lba, pba, n, crcs) in runs {
        let len = usize::try_from(n).expect("small") * BLOCK;
        let data = media[at..at + len].to_vec();
        for (i, (block, crc)) in data.chunks(BLOCK).zip(&crcs).enumerate() {
            if block_crc(block) != *crc {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!("cleaner: checksum mismatch at pool block {}; segment left in place", pba + i as u64),
                ));
            }
        }
        // Moves are split to fit one batch.
        let piece = usize::try_from(inner.max_batch_blocks).expect("small") * BLOCK;
        for (k, chunk) in data.chunks(piece).enumerate() {
            moves.push((layer, lba + (k * piece / BLOCK) as u64, chunk.to_vec()));
        }
        at += len;
    }
    crate::log::write_moves(inner, moves)?;
    Ok(total)
}

impl Inner {
    /// Moves every live block out of `seg`, a step at a time.
    fn clean_segment(self: &Arc<Self>, seg: usize) -> Result<u64> {
        let cands = live_runs(self, seg);
        let mut moved = 0;
        let mut step: Vec<(u64, u64, u64, u64)> = Vec::new();
        let mut blocks = 0;
        let mut flush = |step: Vec<(u64, u64, u64, u64)>| -> Result<()> {
            moved += self.barrier(move |inner| move_step(inner, &step))?;
            Ok(())
        };
        for (layer, lba, pba, n) in cands {
            let mut done = 0;
            while done < n {
                let k = (n - done).min(STEP_BLOCKS - blocks);
                step.push((layer, lba + done, pba + done, k));
                blocks += k;
                done += k;
                if blocks == STEP_BLOCKS {
                    flush(std::mem::take(&mut step))?;
                    blocks = 0;
                }
            }
        }
        if !step.is_empty() {
            flush(step)?;
        }
        Ok(moved)
    }

    /// Cleans victims while `more()` says so and good victims remain; ends with a checkpoint
    /// that frees the cleaned segments.
    pub(crate) fn clean(
        self: &Arc<Self>,
        max_u: f64,
        mut more: impl FnMut(&Inner, &CleanReport) -> bool,
    ) -> Result<CleanReport> {
        let _one = self.cleaner.running.lock();
        let stats = &self.cleaner.stats;
        stats.active.store(true, Ordering::Relaxed);
        stats.runs.fetch_add(1, Ordering::Relaxed);
        let free_before = self.state.read().segs.count(SegState::Free) as u64;
        let mut report = CleanReport::default();
        // Only segments sealed when the run starts: the ones the moves fill are never victims of
        // the same run (with small batches their headers would make them look worth cleaning).
        let mut eligible: BTreeSet<usize> = {
            let st = self.state.read();
            st.segs.segs.iter().enumerate().filter(|(_, s)| s.state == SegState::Sealed).map(|(i, _)| i).collect()
        };
        let mut result = Ok(());
        while !self.cleaner.stopping() && more(self, &report) {
            let Some(seg) = pick_victim(self, max_u, &eligible) else { break };
            eligible.remove(&seg);
            match self.clean_segment(seg) {
                Ok(n) => {
                    report.segments_cleaned += 1;
                    report.blocks_moved += n;
                    stats.segments_cleaned.fetch_add(1, Ordering::Relaxed);
                    stats.blocks_moved.fetch_add(n, Ordering::Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::Corrupt => {
                    tracing::error!(segment = seg, error = %e, "cleaner skipped a damaged segment");
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let ckpt = if report.segments_cleaned > 0 { self.checkpoint() } else { Ok(()) };
        stats.active.store(false, Ordering::Relaxed);
        result?;
        ckpt?;
        let free_after = self.state.read().segs.count(SegState::Free) as u64;
        report.segments_freed = free_after.saturating_sub(free_before);
        Ok(report)
    }
}

/// Free segments (beyond the reserve) below which the background cleaner runs.
fn low_water(inner: &Inner) -> u64 {
    (inner.sb.segment_count / 10).max(inner.opts.reserve_segments as u64 + 2)
}

/// Background cleaning: whenever free space runs low (checked every interval or when kicked),
/// clean until twice the low-water mark is free or no victim is worth it.
pub(crate) fn cleaner_loop(inner: &Arc<Inner>) {
    let interval = inner.opts.cleaner_interval.max(Duration::from_millis(10));
    loop {
        {
            let mut c = inner.cleaner.ctl.lock();
            if !c.0 && !c.1 {
                inner.cleaner.cv.wait_for(&mut c, interval);
            }
            if c.0 {
                return;
            }
            c.1 = false;
        }
        let free = |i: &Inner| i.state.read().segs.count(SegState::Free) as u64;
        let low = low_water(inner);
        if inner.check_open().is_err() || free(inner) >= low {
            continue;
        }
        // A checkpoint alone may free wholly dead segments.
        if inner.checkpoint().is_ok() && free(inner) >= low {
            continue;
        }
        match inner.clean(MAX_UTILISATION, |i, _| free(i) < 2 * low && i.check_open().is_ok()) {
            Ok(r) if r.segments_cleaned > 0 => {
                tracing::info!(
                    cleaned = r.segments_cleaned,
                    moved_blocks = r.blocks_moved,
                    freed = r.segments_freed,
                    "cleaner ran"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cleaner run failed"),
        }
    }
}
