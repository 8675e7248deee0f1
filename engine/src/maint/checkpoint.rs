//! Checkpoints: the extent maps and crc tables changed since the last one, written to RocksDB
//! together with the log position they cover.
//!
//! Order matters and is the whole durability argument:
//! 1. write the open batch (see `tail.rs`), then capture (under the state lock, with no batch
//!    open) the dirty chunks, dirty crc tables, the applied position,
//!    and the sealed segments nothing maps any more;
//! 2. sync the store, so every batch the captured maps point into is durable;
//! 3. commit the capture in one synchronous RocksDB write;
//! 4. only then release the captured empty segments for reuse: the durable checkpoint no longer
//!    refers to them and replay starts after them.

use std::time::Duration;

use crate::ctx::{Ctx, FaultPoint};
use crate::error::{Error, Result};
use crate::map::segments::SegState;
use crate::meta::{CatalogOp, CheckpointRecord, CheckpointWrite};
use crate::read::readahead::Readahead;
use crate::write::{Log, tail};

/// Background checkpoints: every interval while something changed, or when asked
/// (`ctx.wake.checkpoint`), until that wake-up is stopped.
pub(crate) fn checkpointer_loop(ctx: &Ctx, log: &Log, ra: &Readahead) {
    let interval = ctx.opts.checkpoint_interval.max(Duration::from_millis(10));
    while !ctx.wake.checkpoint.wait(interval, false) {
        let changed = {
            let st = ctx.state.read();
            st.log_bytes_since_ckpt > 0 || !st.dirty_chunks.is_empty()
        };
        if changed
            && ctx.check_open().is_ok()
            && let Err(e) = checkpoint(ctx, log, ra)
        {
            tracing::warn!(error = %e, "background checkpoint failed");
        }
    }
}

/// Takes a checkpoint (see the module doc for the order of steps).
pub(crate) fn checkpoint(ctx: &Ctx, log: &Log, ra: &Readahead) -> Result<()> {
    let _m = ctx.meta_lock.lock();
    checkpoint_locked(ctx, log, ra, Vec::new())
}

/// Takes a checkpoint that also commits `catalog` atomically; the caller holds `meta_lock`.
/// Used by catalog changes that rewrite maps (merging or dropping layers), so that replay
/// never has to cross one.
pub(crate) fn checkpoint_locked(ctx: &Ctx, log: &Log, ra: &Readahead, catalog: Vec<CatalogOp>) -> Result<()> {
    ctx.check_open()?;
    let (mut write, candidates) = {
        let _tail = tail::close_and_hold(ctx, log)?;
        capture(ctx)
    };
    write.catalog = catalog;
    if let Err(e) = ctx.backend.sync() {
        let e = Error::io("syncing the pool store for a checkpoint", e);
        ctx.poison(&e);
        return Err(e);
    }
    ctx.fault(FaultPoint::CheckpointBeforeCommit)?;
    if let Err(e) = ctx.meta.write_checkpoint(write) {
        ctx.poison(&e);
        return Err(e);
    }
    ctx.fault(FaultPoint::CheckpointAfterCommit)?;
    release(ctx, ra, &candidates);
    Ok(())
}

fn capture(ctx: &Ctx) -> (CheckpointWrite, Vec<usize>) {
    let mut st = ctx.state.write();
    let st = &mut *st;
    let mut w = CheckpointWrite::default();
    for (layer, c) in std::mem::take(&mut st.dirty_chunks) {
        let chunk = st.layers.get(&layer).and_then(|l| l.map.chunk(c)).map(|ch| ch.encode());
        w.chunks.push(((layer, c), chunk));
    }
    for seg in std::mem::take(&mut st.freed_crc_tables) {
        w.crcs.push((seg, None));
    }
    for (i, s) in st.segs.segs.iter_mut().enumerate() {
        if s.crc_dirty {
            s.crc_dirty = false;
            if let Some(t) = &s.crcs {
                let bytes = t.iter().flat_map(|c| c.to_le_bytes()).collect();
                w.crcs.push((i as u64, Some(bytes)));
            }
        }
    }
    let pos = st.applied;
    let cold = st.cold.map(|c| (c.seg as u64, c.off));
    w.record =
        Some(CheckpointRecord { seq: pos.seq, seg: pos.seg as u64, off: pos.off, generation: st.generation, cold });
    st.log_bytes_since_ckpt = 0;
    let candidates = st
        .segs
        .segs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.state == SegState::Sealed && s.live == 0 && s.last_seq < pos.seq)
        .map(|(i, _)| i)
        .collect();
    (w, candidates)
}

/// Frees captured empty segments that are still empty and have no reader in flight. A
/// sealed segment with no live block cannot gain one (only the head is written and nothing
/// maps into it), so it can be discarded outside the lock before it is marked free.
fn release(ctx: &Ctx, ra: &Readahead, candidates: &[usize]) {
    let ready: Vec<(usize, u64)> = {
        let st = ctx.state.read();
        candidates
            .iter()
            .filter(|&&i| {
                let s = &st.segs.segs[i];
                s.state == SegState::Sealed && s.live == 0 && !ctx.pins.any(i)
            })
            .map(|&i| (i, ctx.sb.segment_offset(i, 0)))
            .collect()
    };
    // Give the space back to the filesystem or the device (see `Discard`); best effort.
    for &(i, off) in ready.iter().filter(|_| ctx.discard_freed) {
        if let Err(e) = ctx.backend.discard(off, ctx.sb.segment_size) {
            tracing::debug!(segment = i, error = %e, "discarding a freed segment failed");
        }
    }
    ra.forget_segments(&ready.iter().map(|&(i, _)| i).collect::<Vec<_>>());
    let mut st = ctx.state.write();
    for (i, _) in ready {
        let s = &mut st.segs.segs[i];
        s.state = SegState::Free;
        s.crcs = None;
        s.crc_dirty = false;
        s.damaged = false;
        st.freed_crc_tables.insert(i as u64);
    }
    drop(st);
    ctx.wake.freed.space_freed();
}
