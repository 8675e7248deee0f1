//! Defragmentation: rewrites a volume's scattered blocks in logical order, so that a sequential
//! reader gets large contiguous reads again.
//!
//! Random writes leave a volume's blocks where the log head was when each was written: a
//! 128 KiB read of such a region becomes dozens of 4 KiB media reads. A pass walks the volume in
//! windows of [`WINDOW_BLOCKS`], resolves each through the layer chain as a reader would, and
//! rewrites the window if its mapped blocks lie in runs shorter than [`GOOD_RUN_BLOCKS`] on
//! average. It is the cleaner's machinery: the window's blocks are read (and their checksums
//! checked) with their segments pinned, then moved as a log barrier — only the blocks still
//! mapped where they were — to the cold head, in logical order, each in the layer that owns it,
//! so snapshots keep sharing them. Blocks written since the pass started, or still in the
//! client head segment, are hot: they are likely to be written again soon, and stay where they
//! are (blocks in cold segments are not: the cleaner put them there). The old copies are dead space the cleaner reclaims; a checkpoint ends the pass.

use std::collections::BTreeSet;

use crate::ctx::Ctx;
use crate::error::{Error, ErrorKind, Result};
use crate::io::BLOCK;
use crate::maint::checkpoint::checkpoint;
use crate::maint::cleaner::{Cleaner, LiveRun, move_step, read_step};
use crate::map::segments::Pinned;
use crate::read::readahead::Readahead;
use crate::state::{State, Target};
use crate::write::Log;

/// Logical blocks looked at, and rewritten, at a time (1 MiB).
pub const WINDOW_BLOCKS: u64 = 256;
/// A window whose mapped blocks lie in runs at least this long on average (128 KiB) is left alone.
pub const GOOD_RUN_BLOCKS: u64 = 32;

/// Progress of a pass, reported after every window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DefragProgress {
    pub done_bytes: u64,
    pub total_bytes: u64,
    pub moved_bytes: u64,
}

/// What a pass did, and the volume's layout before and after it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DefragReport {
    /// Bytes the volume maps (holes excluded).
    pub mapped_bytes: u64,
    pub moved_bytes: u64,
    pub windows_rewritten: u64,
    /// Runs of consecutive pool blocks a full sequential read of the volume needs, before and after.
    pub runs_before: u64,
    pub runs_after: u64,
}

/// Volume `id`'s head layer and size.
fn head(st: &State, id: u64, name: &str) -> Result<(u64, u64)> {
    st.head_of(Target::Volume(id)).ok_or_else(|| crate::read::resolve::gone(name))
}

/// (layer, lba, pba, blocks) of each mapped run of `[lba, lba + blocks)` of volume `id`, each
/// in the layer that owns it.
fn resolve_window(st: &State, id: u64, name: &str, lba: u64, blocks: u64) -> Result<Vec<LiveRun>> {
    let (layer, _) = head(st, id, name)?;
    Ok(st
        .layers
        .resolve(layer, lba, blocks)
        .into_iter()
        .filter_map(|r| Some((r.layer, r.lba, r.pba?, r.blocks)))
        .collect())
}

/// Runs of consecutive pool blocks a sequential read of volume `id` needs, and its mapped blocks.
pub(crate) fn layout(ctx: &Ctx, id: u64, name: &str) -> Result<(u64, u64)> {
    let st = ctx.state.read();
    let size = head(&st, id, name)?.1;
    let runs = resolve_window(&st, id, name, 0, size / BLOCK as u64)?;
    Ok((media_runs(&runs), runs.iter().map(|r| r.3).sum()))
}

/// Media reads (runs of consecutive pool blocks) the mapped runs of a window need, in order.
fn media_runs(runs: &[LiveRun]) -> u64 {
    let mut count = 0;
    let mut end = None;
    for &(_, _, pba, n) in runs {
        if end != Some(pba) {
            count += 1;
        }
        end = Some(pba + n);
    }
    count
}

/// One pass over volume `id`; see the module doc.
pub(crate) fn defrag(
    ctx: &Ctx,
    log: &Log,
    cleaner: &Cleaner,
    ra: &Readahead,
    id: u64,
    name: &str,
    mut progress: impl FnMut(DefragProgress),
) -> Result<DefragReport> {
    // One mover at a time: a cleaning run and a pass would take turns at the cold head.
    let _one = cleaner.running.lock();
    let (runs_before, mapped) = layout(ctx, id, name)?;
    let (size, since) = {
        let st = ctx.state.read();
        (head(&st, id, name)?.1, st.applied.seq)
    };
    let total = size / BLOCK as u64;
    let mut report = DefragReport { mapped_bytes: mapped * BLOCK as u64, runs_before, ..DefragReport::default() };
    let mut lba = 0;
    while lba < total {
        ctx.check_open()?;
        let n = WINDOW_BLOCKS.min(total - lba);
        // Resolved and pinned under one lock hold: a segment pinned cannot be freed and reused
        // before its blocks are read (what was overwritten meanwhile, the move step drops).
        let mut pinned = Pinned::new(&ctx.pins);
        let cold: Vec<LiveRun> = {
            let st = ctx.state.read();
            let hot = |pba: u64| {
                let seg = st.segs.locate(pba).0;
                let s = &st.segs.segs[seg];
                seg == st.applied.seg || (s.last_seq >= since && !s.cold)
            };
            let cold: Vec<LiveRun> = resolve_window(&st, id, name, lba, n)?.into_iter().filter(|r| !hot(r.2)).collect();
            let segs: BTreeSet<usize> = cold.iter().map(|r| st.segs.locate(r.2).0).collect();
            segs.into_iter().for_each(|s| pinned.pin(s));
            cold
        };
        let blocks: u64 = cold.iter().map(|r| r.3).sum();
        let runs = media_runs(&cold);
        if runs > 1 && blocks < runs * GOOD_RUN_BLOCKS {
            let read = read_step(ctx, log, &cold).map_err(|e| {
                if e.kind() == ErrorKind::Corrupt {
                    Error::new(ErrorKind::Corrupt, format!("defrag of {name:?}: {e}; run `ferrite pool scrub`"))
                } else {
                    e
                }
            })?;
            let moved = log.barrier(ctx, move |ctx, log| move_step(ctx, log, read))?;
            cleaner.stats.blocks_moved.fetch_add(moved, std::sync::atomic::Ordering::Relaxed);
            report.moved_bytes += moved * BLOCK as u64;
            report.windows_rewritten += 1;
        }
        lba += n;
        progress(DefragProgress { done_bytes: lba * BLOCK as u64, total_bytes: size, moved_bytes: report.moved_bytes });
    }
    if report.moved_bytes > 0 {
        checkpoint(ctx, log, ra)?;
    }
    report.runs_after = layout(ctx, id, name)?.0;
    Ok(report)
}
