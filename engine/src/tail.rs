//! The open batch: small client writes are acknowledged once they are in memory and in the
//! maps, and reach the store together as one batch a moment later.
//!
//! ```text
//!  leader: write --> copy into the open batch, map it (state lock), ack
//!  flusher thread: `write_delay` after the batch opened --> close: header + data, one write
//!  flush, FUA, barrier, checkpoint, a write that does not fit, any other batch --> close first
//! ```
//! This is the volatile write cache the durability contract allows (DESIGN §1): an
//! acknowledged write may be lost in a crash until a flush covers it, and a flush closes the
//! open batch before it syncs. What it buys: a write at queue depth 1 costs a copy instead of a
//! device round trip, and batches grow to up to [`MAX_BLOCKS`] blocks under one 4 KiB header,
//! where a lone write used to cost a header block of its own (half of its media bytes, and
//! space the cleaner later has to win back).
//!
//! The batch's place in the log is fixed when it opens (nothing else is written until it
//! closes), so its blocks have pool addresses from the start and the maps can point at them.
//! Until the batch is written, reads of those addresses are served from its buffer
//! ([`read_runs`]); it is taken down only after its write completed, under the same lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::format::{BatchHeader, Entry, EntryKind, block_crc};
use crate::io::{AlignedBuf, BLOCK};
use crate::log::{LogPos, Req, finish_batch, map_entries, reserve_room};
use crate::pool::Inner;

/// Most data blocks in an open batch (1 MiB); its header must also fit one block.
const MAX_BLOCKS: usize = 256;

/// Largest write that goes through the open batch (128 KiB); larger ones are written directly.
const MAX_WRITE_BLOCKS: usize = 32;

#[derive(Debug)]
struct OpenBatch {
    pos: LogPos,
    opened: Instant,
    /// Pool block of the first data block (right after the one header block).
    first_pba: u64,
    /// Data blocks it may take: bounded by [`MAX_BLOCKS`], the batch size limit and the room
    /// left in the head segment.
    capacity: usize,
    entries: Vec<Entry>,
    crcs: Vec<u32>,
    /// Header block, then the data blocks appended so far.
    buf: AlignedBuf,
}

impl OpenBatch {
    fn blocks(&self) -> usize {
        self.crcs.len()
    }

    fn fits(&self, blocks: usize) -> bool {
        let total = self.blocks() + blocks;
        total <= self.capacity && BatchHeader::blocks_for(self.entries.len() + 1, total) == 1
    }
}

#[derive(Debug, Default)]
pub(crate) struct Slot {
    batch: Option<OpenBatch>,
    /// The last batch's buffer, reused (a fresh 1 MiB buffer per batch would cost page faults).
    spare: Option<AlignedBuf>,
    stop: bool,
}

/// The open batch and what reads need to find it without taking its lock.
#[derive(Debug, Default)]
pub(crate) struct Tail {
    slot: Mutex<Slot>,
    /// Wakes the flusher when a batch opens, or to stop.
    cv: Condvar,
    /// Pool blocks `[lo, hi)` held by the open batch (`lo == hi`: none). Set before a block is
    /// mapped and cleared after the batch is written, so a reader that found a block in the
    /// maps and not in this range reads it from the store.
    lo: AtomicU64,
    hi: AtomicU64,
}

impl Tail {
    /// Stops the flusher thread (the final checkpoint closes the open batch).
    pub fn stop(&self) {
        self.slot.lock().stop = true;
        self.cv.notify_all();
    }
}

fn blocks_of(r: &Req) -> usize {
    usize::try_from(r.data_blocks()).expect("small")
}

/// Whether `r` may go into the open batch.
pub(crate) fn takes(inner: &Inner, r: &Req) -> bool {
    matches!(r, Req::Write { data, .. } if data.len() / BLOCK <= MAX_WRITE_BLOCKS) && !inner.opts.write_delay.is_zero()
}

/// On the leader: puts every request (all of them [`takes`]) into the open batch, closing full
/// ones and opening new ones as needed. Returns each request with its outcome; writes that
/// found no room (the pool is full) fail with `NoSpace`.
pub(crate) fn append(inner: &Inner, reqs: Vec<Req>) -> Vec<(Req, Result<()>)> {
    let tail = &inner.log.tail;
    let mut out = Vec::with_capacity(reqs.len());
    let mut reqs = reqs.into_iter().peekable();
    while let Some(first) = reqs.peek() {
        let need = blocks_of(first);
        let mut slot = tail.slot.lock();
        if !slot.batch.as_ref().is_some_and(|b| b.fits(need)) {
            let closed = close_locked(inner, &mut slot);
            drop(slot);
            if let Err(e) = closed.and_then(|()| open(inner, need)) {
                out.extend(reqs.map(|r| (r, Err(crate::log::clone_err(&e)))));
                break;
            }
            continue;
        }
        let Slot { batch: Some(b), .. } = &mut *slot else { unreachable!("checked above") };
        let mut st = inner.state.write();
        while let Some(r) = reqs.next_if(|r| b.fits(blocks_of(r))) {
            let Req::Write { volume, lba, data, .. } = &r else { unreachable!("only writes are taken") };
            let blocks = u32::try_from(data.len() / BLOCK).expect("small");
            // A volume deleted meanwhile maps to layer 0, which never exists: skipped on apply and replay.
            let layer = st.volumes.get(volume).map_or(0, |e| e.rec.layer);
            let pba = b.first_pba + b.blocks() as u64;
            let at = (1 + b.blocks()) * BLOCK;
            b.buf[at..at + data.len()].copy_from_slice(data);
            let first_crc = b.crcs.len();
            b.crcs.extend(data.chunks(BLOCK).map(block_crc));
            let entry = Entry { layer, lba: *lba, blocks, kind: EntryKind::Data };
            tail.hi.store(pba + u64::from(blocks), Ordering::Release);
            map_entries(&mut st, std::slice::from_ref(&entry), pba, &b.crcs[first_crc..]);
            b.entries.push(entry);
            inner.client_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
            out.push((r, Ok(())));
        }
    }
    out
}

/// Opens a batch at the log head with room for at least `need` data blocks. Called without
/// the slot lock: finding room may take a checkpoint, which closes the open batch itself.
fn open(inner: &Inner, need: usize) -> Result<()> {
    let pos = reserve_room(inner, ((1 + need) * BLOCK) as u64, false)?;
    let room = usize::try_from((inner.sb.segment_size - pos.off) / BLOCK as u64).expect("small") - 1;
    let max = usize::try_from(inner.max_batch_blocks).expect("small");
    let capacity = room.min(MAX_BLOCKS).min(max).max(need);
    let first_pba = inner.state.read().segs.pba(pos.seg, pos.off / BLOCK as u64 + 1);
    let tail = &inner.log.tail;
    let mut slot = tail.slot.lock();
    debug_assert!(slot.batch.is_none(), "only the leader opens batches, after closing the last");
    let buf = slot.spare.take().unwrap_or_else(|| AlignedBuf::new((1 + MAX_BLOCKS) * BLOCK));
    tail.lo.store(first_pba, Ordering::Release);
    tail.hi.store(first_pba, Ordering::Release);
    slot.batch = Some(OpenBatch {
        pos,
        opened: Instant::now(),
        first_pba,
        capacity,
        entries: Vec::new(),
        crcs: Vec::new(),
        buf,
    });
    tail.cv.notify_all();
    Ok(())
}

/// Writes the open batch, if any, and moves the log past it.
pub(crate) fn close(inner: &Inner) -> Result<()> {
    close_locked(inner, &mut inner.log.tail.slot.lock())
}

/// Closes the open batch and returns with the slot still locked (and so no batch open): a
/// checkpoint holds it while it captures the maps, which then point only at written blocks.
pub(crate) fn close_and_hold(inner: &Inner) -> Result<MutexGuard<'_, Slot>> {
    let mut slot = inner.log.tail.slot.lock();
    close_locked(inner, &mut slot)?;
    Ok(slot)
}

fn close_locked(inner: &Inner, slot: &mut Slot) -> Result<()> {
    let Some(mut b) = slot.batch.take() else { return Ok(()) };
    let tail = &inner.log.tail;
    let result = if b.entries.is_empty() { Ok(()) } else { write(inner, &mut b) };
    // Only now (the batch is on the store, or the pool is poisoned) may readers stop looking here.
    tail.lo.store(0, Ordering::Release);
    tail.hi.store(0, Ordering::Release);
    slot.spare = Some(b.buf);
    result
}

fn write(inner: &Inner, b: &mut OpenBatch) -> Result<()> {
    let header = BatchHeader {
        seq: b.pos.seq,
        generation: inner.state.read().generation,
        uuid_tag: inner.sb.uuid_tag(),
        entries: std::mem::take(&mut b.entries),
        crcs: std::mem::take(&mut b.crcs),
    };
    debug_assert_eq!(header.header_blocks(), 1, "fits() keeps the header to one block");
    header.encode_into(&mut b.buf[..BLOCK]);
    let len = header.batch_len();
    let offset = inner.sb.segment_offset(b.pos.seg, b.pos.off);
    if let Err(e) = inner.backend.write_at(&b.buf[..usize::try_from(len).expect("small")], offset) {
        // Its writes were acknowledged: whatever the error, a later flush must not succeed.
        let e = Error::io(format!("writing log batch {} at segment {} offset {}", b.pos.seq, b.pos.seg, b.pos.off), e);
        inner.poison(&e);
        return Err(e);
    }
    inner.media_bytes.fetch_add(len, Ordering::Relaxed);
    let mut st = inner.state.write();
    finish_batch(&mut st, header.seq, b.pos, len);
    if st.log_bytes_since_ckpt >= inner.opts.checkpoint_bytes {
        inner.ckpt.request();
    }
    Ok(())
}

/// The flusher thread: closes each batch `write_delay` after it opened, unless something
/// closed it first.
pub(crate) fn flusher_loop(inner: &Arc<Inner>) {
    let tail = &inner.log.tail;
    let mut slot = tail.slot.lock();
    while !slot.stop {
        match slot.batch.as_ref().map(|b| b.opened + inner.opts.write_delay) {
            None => tail.cv.wait(&mut slot),
            Some(due) if Instant::now() < due => {
                tail.cv.wait_until(&mut slot, due);
            }
            Some(_) => {
                if let Err(e) = close_locked(inner, &mut slot) {
                    tracing::warn!(error = %e, "writing the open log batch failed");
                }
            }
        }
    }
}

/// Reads `runs` (pool block, count) into one buffer, as [`crate::io::read_runs`], taking the
/// blocks that are still in the open batch from its buffer.
pub(crate) fn read_runs(inner: &Inner, runs: &[(u64, u64)]) -> std::io::Result<AlignedBuf> {
    let tail = &inner.log.tail;
    let (lo, hi) = (tail.lo.load(Ordering::Acquire), tail.hi.load(Ordering::Acquire));
    if !runs.iter().any(|&(p, n)| p < hi && p + n > lo) {
        return crate::io::read_runs(inner.backend.as_ref(), runs);
    }
    let total: u64 = runs.iter().map(|r| r.1).sum();
    let mut out = AlignedBuf::new(usize::try_from(total).expect("a read fits memory") * BLOCK);
    // Blocks not in the batch: (pool block, count, slot in `out`).
    let mut rest: Vec<(u64, u64, usize)> = Vec::new();
    {
        let slot = tail.slot.lock();
        let mut at = 0;
        for &(p, n) in runs {
            for pba in p..p + n {
                let held = slot.batch.as_ref().filter(|b| pba >= b.first_pba && pba < b.first_pba + b.blocks() as u64);
                if let Some(b) = held {
                    let from = (1 + usize::try_from(pba - b.first_pba).expect("small")) * BLOCK;
                    out[at * BLOCK..(at + 1) * BLOCK].copy_from_slice(&b.buf[from..from + BLOCK]);
                } else {
                    match rest.last_mut() {
                        Some((q, k, s)) if *q + *k == pba && *s + usize::try_from(*k).expect("small") == at => *k += 1,
                        _ => rest.push((pba, 1, at)),
                    }
                }
                at += 1;
            }
        }
    }
    if !rest.is_empty() {
        let runs: Vec<(u64, u64)> = rest.iter().map(|&(p, k, _)| (p, k)).collect();
        let media = crate::io::read_runs(inner.backend.as_ref(), &runs)?;
        let mut from = 0;
        for (_, k, at) in rest {
            let len = usize::try_from(k).expect("small") * BLOCK;
            out[at * BLOCK..at * BLOCK + len].copy_from_slice(&media[from..from + len]);
            from += len;
        }
    }
    Ok(out)
}
