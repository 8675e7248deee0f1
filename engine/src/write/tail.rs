//! The open batch: small client writes are acknowledged once they are in memory and in the
//! maps, and reach the store together as one batch a moment later.
//!
//! ```text
//!  leader: write --> copy into the open batch, map it (state lock), ack
//!  `write_delay` after it opened, or when full --> sealed: the log moves past it, and it is
//!      handed to a flusher thread, which writes it (header + data, one write) while the
//!      leader fills the next one; up to [`FLIGHTS`] sealed batches are written at once
//!  flush, FUA, barrier, checkpoint, any other batch --> wait for that write; close the open one
//! ```
//! This is the volatile write cache the durability contract allows (DESIGN §1): an
//! acknowledged write may be lost in a power cut until a flush covers it, and a flush closes
//! the open batch before it syncs. A process crash loses none of it: the batches are built in
//! the tail file's shared mapping ([`super::tailfile`]), which the kernel keeps, and each is
//! whole there (its header saved) before any write in it is acknowledged. What it buys: a
//! write at queue depth 1 costs a copy instead of a device round trip, and batches grow to up
//! to [`MAX_BLOCKS`] blocks under one 4 KiB header, where a lone write used to cost a header
//! block of its own (half of its media bytes, and space the cleaner later has to win back).
//!
//! The batch's place in the log is fixed when it opens (nothing else is written until it
//! closes), so its blocks have pool addresses from the start and the maps can point at them.
//! Until a batch is written, reads of those addresses are served from its buffer
//! ([`read_runs`]): the unwritten batches are the open one and those in flight, and each is
//! taken down only after its write completed, under the slot lock.
//!
//! Batches in flight together may land in any order. That is no new state on the store: a
//! crash could always keep a later unsynced batch and lose an earlier one, and replay stops at
//! the first missing batch either way (what follows has the wrong sequence, or an older
//! generation once the log has moved on). A flush waits for every flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::ctx::{Ctx, FaultPoint};
use crate::error::{Error, Result};
use crate::format::{BatchHeader, Entry, EntryKind, block_crc};
use crate::io::{AlignedBuf, BLOCK};
use crate::state::{LogPos, finish_batch, map_entries};
use crate::write::Log;
use crate::write::req::Req;
use crate::write::room::reserve_room;
use crate::write::tailfile::TailBuf;

/// Most data blocks in an open batch (3 MiB); its header must also fit one block, which is the
/// tighter bound for small writes (about 144 of 4 KiB). Room for 24 writes of 128 KiB: one such
/// batch in flight keeps a sequential writer at queue depth 1 within reach of the device (with
/// 1 MiB batches, 128 KiB QD1 ran 14% slower, medians of three).
const MAX_BLOCKS: usize = 768;

/// Largest write that goes through the open batch (128 KiB); larger ones are written directly.
const MAX_WRITE_BLOCKS: usize = 32;

/// Sealed batches written at once, each by a flusher thread of its own: while one completes,
/// the next is already on the device. With one, the device drained between batches.
pub(crate) const FLIGHTS: usize = 2;

/// Batch buffers: the open batch and those in flight. Each is a slot of the tail file.
pub(crate) const SLOTS: usize = FLIGHTS + 1;

/// Blocks of a batch buffer: the header block and up to [`MAX_BLOCKS`] data blocks.
pub(crate) const BATCH_BLOCKS: usize = 1 + MAX_BLOCKS;

#[derive(Debug)]
struct OpenBatch {
    pos: LogPos,
    opened: Instant,
    /// Pool block of the first data block (right after the one header block).
    first_pba: u64,
    /// Data blocks it may take: bounded by [`MAX_BLOCKS`], the batch size limit and the room
    /// left in the head segment.
    capacity: usize,
    /// Everything appended so far; saved in `buf` before each acknowledgement.
    header: BatchHeader,
    /// Header block, then the data blocks appended so far.
    buf: TailBuf,
}

impl OpenBatch {
    fn blocks(&self) -> usize {
        self.header.crcs.len()
    }

    fn block(&self, pba: u64) -> Option<&[u8]> {
        buffered_block(&self.buf, self.first_pba, self.blocks(), pba)
    }

    fn fits(&self, blocks: usize) -> bool {
        let total = self.blocks() + blocks;
        total <= self.capacity && BatchHeader::blocks_for(self.header.entries.len() + 1, total) == 1
    }
}

/// A sealed batch: in the log and the maps, its header encoded, not yet on the store.
#[derive(Debug)]
struct Sealed {
    pos: LogPos,
    first_pba: u64,
    blocks: usize,
    /// Bytes to write: the header block and the data blocks.
    len: u64,
    buf: TailBuf,
}

impl Sealed {
    fn block(&self, pba: u64) -> Option<&[u8]> {
        buffered_block(&self.buf, self.first_pba, self.blocks, pba)
    }
}

/// Block `pba` of a batch buffer (header block, then `blocks` data blocks from pool block
/// `first_pba`), if the batch holds it.
fn buffered_block(buf: &[u8], first_pba: u64, blocks: usize, pba: u64) -> Option<&[u8]> {
    let i = usize::try_from(pba.checked_sub(first_pba)?).ok().filter(|&i| i < blocks)?;
    Some(&buf[(1 + i) * BLOCK..(2 + i) * BLOCK])
}

/// A sealed batch handed to the flushers.
#[derive(Debug)]
struct Flight {
    /// Shared with the flusher writing it while the lock is let go.
    sealed: Arc<Sealed>,
    /// Its entry in [`Tail::flights`].
    range: usize,
    /// A flusher has taken it.
    writing: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Slot {
    batch: Option<OpenBatch>,
    /// Sealed batches not yet written, at most [`FLIGHTS`].
    flights: Vec<Flight>,
    /// Buffers no batch holds: [`SLOTS`] in all, the open batch and the flights holding the rest.
    spares: Vec<TailBuf>,
    stop: bool,
}

impl Slot {
    /// Gives a batch's buffer back once the batch is written (or was empty).
    fn recycle(&mut self, buf: TailBuf) {
        self.spares.push(buf);
    }
}

/// Pool blocks `[lo, hi)` of an unwritten batch (`lo == hi`: none), readable without a lock.
#[derive(Debug, Default)]
struct Range {
    lo: AtomicU64,
    hi: AtomicU64,
}

impl Range {
    fn set(&self, lo: u64, hi: u64) {
        self.lo.store(lo, Ordering::Release);
        self.hi.store(hi, Ordering::Release);
    }

    fn overlaps(&self, runs: &[(u64, u64)]) -> bool {
        let (lo, hi) = (self.lo.load(Ordering::Acquire), self.hi.load(Ordering::Acquire));
        runs.iter().any(|&(p, n)| p < hi && p + n > lo)
    }
}

/// The open batch, those in flight, and what reads need to find them without the lock.
#[derive(Debug, Default)]
pub(crate) struct Tail {
    slot: Mutex<Slot>,
    /// Wakes the flushers (a batch opened or was sealed, or stop) and those waiting for a
    /// flight to land.
    cv: Condvar,
    /// Blocks of the open batch: its `hi` grows before each block is mapped. A sealed batch's
    /// range is set in `flights` before it is cleared here, and cleared there after the write,
    /// so a reader that found a block in the maps and in no range (loading `open` first) reads
    /// it from the store.
    open: Range,
    flights: [Range; FLIGHTS],
}

impl Tail {
    /// The tail over the tail file's buffers ([`SLOTS`] of [`BATCH_BLOCKS`] blocks).
    pub fn new(bufs: Vec<TailBuf>) -> Self {
        debug_assert_eq!(bufs.len(), SLOTS);
        let tail = Self::default();
        tail.slot.lock().spares = bufs;
        tail
    }

    /// Stops the flusher threads once the batches in flight are written (the final checkpoint
    /// closes the open one).
    pub fn stop(&self) {
        self.slot.lock().stop = true;
        self.cv.notify_all();
    }
}

fn blocks_of(r: &Req) -> usize {
    usize::try_from(r.data_blocks()).expect("small")
}

/// Whether `r` may go into the open batch.
pub(crate) fn takes(ctx: &Ctx, r: &Req) -> bool {
    matches!(r, Req::Write { data, .. } if data.len() / BLOCK <= MAX_WRITE_BLOCKS) && !ctx.opts.write_delay.is_zero()
}

/// On the leader: puts every request (all of them [`takes`]) into the open batch, sealing full
/// ones and opening new ones as needed. Returns each request with its outcome; writes that
/// found no room (the pool is full) fail with `NoSpace`.
pub(crate) fn append(ctx: &Ctx, log: &Log, reqs: Vec<Req>) -> Vec<(Req, Result<()>)> {
    let tail = &log.tail;
    let mut out = Vec::with_capacity(reqs.len());
    let mut reqs = reqs.into_iter().peekable();
    while let Some(first) = reqs.peek() {
        let need = blocks_of(first);
        let mut slot = tail.slot.lock();
        if !slot.batch.as_ref().is_some_and(|b| b.fits(need)) {
            let sealed = if slot.stop { close_locked(ctx, tail, &mut slot) } else { hand_off(ctx, tail, &mut slot) };
            drop(slot);
            if let Err(e) = sealed.and_then(|()| open(ctx, log, need)) {
                out.extend(reqs.map(|r| (r, Err(crate::error::clone_err(&e)))));
                break;
            }
            continue;
        }
        let Slot { batch: Some(b), .. } = &mut *slot else { unreachable!("checked above") };
        let mut st = ctx.state.write();
        while let Some(r) = reqs.next_if(|r| b.fits(blocks_of(r))) {
            let Req::Write { volume, lba, data, .. } = &r else { unreachable!("only writes are taken") };
            let blocks = u32::try_from(data.len() / BLOCK).expect("small");
            // A volume deleted meanwhile maps to layer 0, which never exists: skipped on apply and replay.
            let layer = st.volumes.get(volume).map_or(0, |e| e.rec.layer);
            let pba = b.first_pba + b.blocks() as u64;
            let at = (1 + b.blocks()) * BLOCK;
            b.buf[at..at + data.len()].copy_from_slice(data);
            let first_crc = b.blocks();
            b.header.crcs.extend(data.chunks(BLOCK).map(block_crc));
            let entry = Entry { layer, lba: *lba, blocks, kind: EntryKind::Data };
            tail.open.hi.store(pba + u64::from(blocks), Ordering::Release);
            map_entries(&mut st, std::slice::from_ref(&entry), pba, &b.header.crcs[first_crc..]);
            b.header.entries.push(entry);
            ctx.client_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
            out.push((r, Ok(())));
        }
        drop(st);
        // Before any of them is acknowledged: the batch in the tail file holds them all.
        b.buf.save_header(&b.header);
        if !b.fits(1) {
            tail.cv.notify_all(); // the flusher sends a full batch at once
        }
    }
    out
}

/// Opens a batch at the log head with room for at least `need` data blocks. Called without
/// the slot lock: finding room may take a checkpoint, which closes the open batch itself.
fn open(ctx: &Ctx, log: &Log, need: usize) -> Result<()> {
    let pos = reserve_room(ctx, log, ((1 + need) * BLOCK) as u64, false)?;
    let room = usize::try_from((ctx.sb.segment_size - pos.off) / BLOCK as u64).expect("small") - 1;
    let max = usize::try_from(ctx.max_batch_blocks).expect("small");
    let capacity = room.min(MAX_BLOCKS).min(max).max(need);
    let (first_pba, generation) = {
        let st = ctx.state.read();
        (st.segs.pba(pos.seg, pos.off / BLOCK as u64 + 1), st.generation)
    };
    let tail = &log.tail;
    let mut slot = tail.slot.lock();
    debug_assert!(slot.batch.is_none(), "only the leader opens batches, after sealing the last");
    let mut buf = slot.spares.pop().expect("a buffer for the open batch: the flights hold the others");
    buf.start(pos, generation);
    tail.open.set(first_pba, first_pba);
    let header =
        BatchHeader { seq: pos.seq, generation, uuid_tag: ctx.sb.uuid_tag(), entries: Vec::new(), crcs: Vec::new() };
    slot.batch = Some(OpenBatch { pos, opened: Instant::now(), first_pba, capacity, header, buf });
    tail.cv.notify_all();
    Ok(())
}

/// Writes the open batch, if any, after the one in flight, and moves the log past it.
pub(crate) fn close(ctx: &Ctx, log: &Log) -> Result<()> {
    close_locked(ctx, &log.tail, &mut log.tail.slot.lock())
}

/// Closes the open batch and returns with the slot still locked (and so no batch unwritten):
/// a checkpoint holds it while it captures the maps, which then point only at written blocks.
pub(crate) fn close_and_hold<'a>(ctx: &Ctx, log: &'a Log) -> Result<MutexGuard<'a, Slot>> {
    let mut slot = log.tail.slot.lock();
    close_locked(ctx, &log.tail, &mut slot)?;
    Ok(slot)
}

/// Waits until at most `left` batches are in flight. One may have failed (and poisoned the
/// pool): then nothing after it may claim success.
fn land_flights(ctx: &Ctx, tail: &Tail, slot: &mut MutexGuard<'_, Slot>, left: usize) -> Result<()> {
    while slot.flights.len() > left {
        tail.cv.wait(slot);
    }
    ctx.check_open()
}

fn close_locked(ctx: &Ctx, tail: &Tail, slot: &mut MutexGuard<'_, Slot>) -> Result<()> {
    land_flights(ctx, tail, slot, 0)?;
    let Some(sealed) = take_sealed(ctx, tail, slot) else { return Ok(()) };
    let result = write(ctx, &sealed);
    // Only now (the batch is on the store, or the pool is poisoned) may readers stop looking here.
    tail.open.set(0, 0);
    slot.recycle(sealed.buf);
    result
}

/// Seals the open batch, if any, and hands it to the flushers, once fewer than [`FLIGHTS`] are
/// in flight.
fn hand_off(ctx: &Ctx, tail: &Tail, slot: &mut MutexGuard<'_, Slot>) -> Result<()> {
    if slot.batch.as_ref().is_none_or(|b| b.header.entries.is_empty()) {
        take_sealed(ctx, tail, slot); // nothing to wait for: drops an empty batch
        return Ok(());
    }
    land_flights(ctx, tail, slot, FLIGHTS - 1)?;
    let Some(sealed) = take_sealed(ctx, tail, slot) else { return Ok(()) };
    let range =
        (0..FLIGHTS).find(|&i| slot.flights.iter().all(|f| f.range != i)).expect("fewer than FLIGHTS in flight");
    // In this order: see `Tail::open`.
    tail.flights[range].set(sealed.first_pba, sealed.first_pba + sealed.blocks as u64);
    tail.open.set(0, 0);
    slot.flights.push(Flight { sealed: Arc::new(sealed), range, writing: false });
    tail.cv.notify_all();
    Ok(())
}

/// Takes the open batch off the slot and seals it. An empty one (a checkpoint may close a
/// batch between its opening and its first write) takes no place in the log: it is dropped.
fn take_sealed(ctx: &Ctx, tail: &Tail, slot: &mut Slot) -> Option<Sealed> {
    let b = slot.batch.take()?;
    if b.header.entries.is_empty() {
        tail.open.set(0, 0);
        slot.recycle(b.buf);
        return None;
    }
    Some(seal(ctx, b))
}

/// Puts the batch's final header in place and moves the log past it: the next batch may open
/// behind it before it is written.
fn seal(ctx: &Ctx, b: OpenBatch) -> Sealed {
    let OpenBatch { pos, first_pba, header, mut buf, .. } = b;
    let mut st = ctx.state.write();
    debug_assert_eq!(header.header_blocks(), 1, "fits() keeps the header to one block");
    debug_assert_eq!(header.generation, st.generation, "the generation changes only when the pool opens");
    buf.seal_header(&header);
    let len = header.batch_len();
    finish_batch(&mut st, header.seq, pos, len);
    if st.log_bytes_since_ckpt >= ctx.opts.checkpoint_bytes {
        ctx.wake.checkpoint.raise();
    }
    Sealed { pos, first_pba, blocks: header.crcs.len(), len, buf }
}

fn write(ctx: &Ctx, b: &Sealed) -> Result<()> {
    ctx.fault(FaultPoint::TailBeforeWrite)?;
    let offset = ctx.sb.segment_offset(b.pos.seg, b.pos.off);
    if let Err(e) = ctx.backend.write_at(&b.buf[..usize::try_from(b.len).expect("small")], offset) {
        // Its writes were acknowledged: whatever the error, a later flush must not succeed.
        let e = Error::io(format!("writing log batch {} at segment {} offset {}", b.pos.seq, b.pos.seg, b.pos.off), e);
        ctx.poison(&e);
        return Err(e);
    }
    ctx.media_bytes.fetch_add(b.len, Ordering::Relaxed);
    Ok(())
}

/// A flusher thread (there are [`FLIGHTS`]): writes a sealed batch nobody is writing yet, and
/// seals the open one `write_delay` after it opened unless something closed it first.
pub(crate) fn flusher_loop(ctx: &Ctx, log: &Log) {
    let tail = &log.tail;
    let mut slot = tail.slot.lock();
    loop {
        if let Some(f) = slot.flights.iter_mut().find(|f| !f.writing) {
            f.writing = true;
            let sealed = Arc::clone(&f.sealed);
            let result = MutexGuard::unlocked(&mut slot, || write(ctx, &sealed));
            if let Err(e) = result {
                tracing::warn!(error = %e, "writing a log batch failed");
            }
            let at =
                slot.flights.iter().position(|f| Arc::ptr_eq(&f.sealed, &sealed)).expect("only its writer lands it");
            let range = slot.flights.swap_remove(at).range;
            tail.flights[range].set(0, 0);
            if let Some(s) = Arc::into_inner(sealed) {
                slot.recycle(s.buf);
            }
            tail.cv.notify_all();
            continue;
        }
        if slot.stop {
            return;
        }
        // A full batch goes at once: the next write would only wait for it.
        match slot.batch.as_ref().map(|b| (b.opened + ctx.opts.write_delay, !b.fits(1))) {
            None => tail.cv.wait(&mut slot),
            Some((due, false)) if Instant::now() < due => {
                tail.cv.wait_until(&mut slot, due);
            }
            // Every flight taken: a landing wakes us (sealing now would only wait for it).
            Some(_) if slot.flights.len() == FLIGHTS => tail.cv.wait(&mut slot),
            Some(_) => {
                if let Err(e) = hand_off(ctx, tail, &mut slot) {
                    tracing::warn!(error = %e, "sealing the open log batch failed");
                    // Poisoned: the batch stays open; nothing will write it, and waiting for
                    // the next event is all that is left.
                    tail.cv.wait(&mut slot);
                }
            }
        }
    }
}

/// Reads `runs` (pool block, count) into one buffer, back to back, taking the blocks that are
/// still in the open or a sealed batch from their buffers.
pub(crate) fn read_runs(ctx: &Ctx, tail: &Tail, runs: &[(u64, u64)]) -> std::io::Result<AlignedBuf> {
    let (mut buf, todo) = gather(tail, runs);
    crate::io::read_into(ctx.backend.as_ref(), &mut buf, &todo)?;
    Ok(buf)
}

/// The first half of [`read_runs`]: a buffer for `runs` with the blocks still in the open or
/// a sealed batch copied in, and the store reads that complete it: (pool block, blocks, first
/// slot in the buffer).
pub(crate) fn gather(tail: &Tail, runs: &[(u64, u64)]) -> (AlignedBuf, Vec<(u64, u64, usize)>) {
    let total: u64 = runs.iter().map(|r| r.1).sum();
    let mut out = AlignedBuf::new(usize::try_from(total).expect("a read fits memory") * BLOCK);
    let mut todo: Vec<(u64, u64, usize)> = Vec::with_capacity(runs.len());
    // `open` first: see `Tail::open`.
    if !tail.open.overlaps(runs) && !tail.flights.iter().any(|f| f.overlaps(runs)) {
        let mut at = 0;
        for &(p, n) in runs {
            todo.push((p, n, at));
            at += usize::try_from(n).expect("a read fits memory");
        }
        return (out, todo);
    }
    let slot = tail.slot.lock();
    let mut at = 0;
    for &(p, n) in runs {
        for pba in p..p + n {
            let held = slot.batch.as_ref().and_then(|b| b.block(pba));
            if let Some(block) = held.or_else(|| slot.flights.iter().find_map(|f| f.sealed.block(pba))) {
                out[at * BLOCK..(at + 1) * BLOCK].copy_from_slice(block);
            } else {
                match todo.last_mut() {
                    Some((q, k, s)) if *q + *k == pba && *s + usize::try_from(*k).expect("small") == at => *k += 1,
                    _ => todo.push((pba, 1, at)),
                }
            }
            at += 1;
        }
    }
    drop(slot);
    (out, todo)
}
