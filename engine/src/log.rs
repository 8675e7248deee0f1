//! The log writer: concurrent requests become batches, written by a leader.
//!
//! ```text
//!  callers --Req--> queue --> leader (the first caller to find no leader) takes up to a batch
//!                             --> header+data, one aligned write --> apply to maps (state lock)
//!                             --> ack (FUA / FLUSH: after sync); repeats until the queue is empty
//! ```
//! There is no writer thread: at queue depth 1 the caller writes its own batch with no thread
//! hand-off, and under load one caller leads while the others' requests pile up into the next
//! batch. Only one leader runs at a time, so batches keep a single order.
//! A write is acknowledged once its batch is on the store and in the maps, before it is
//! durable (a volatile write cache); FUA writes and flushes are acknowledged after a sync that
//! covers every batch written before them. A media error other than ENOSPC poisons the pool:
//! after it, a later flush could not honestly claim anything.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::format::{BatchHeader, Entry, EntryKind, block_crc};
use crate::io::{AlignedBuf, BLOCK};
use crate::pool::{Inner, State};
use crate::segments::SegState;

/// Whole blocks of data to write: a range of a shared buffer, so a write split into several
/// requests, or retried, is never copied again (the caller's buffer is copied once, into the
/// batch).
#[derive(Clone)]
pub(crate) struct Payload {
    buf: Arc<Vec<u8>>,
    range: Range<usize>,
}

impl Payload {
    pub fn new(buf: Vec<u8>) -> Self {
        let range = 0..buf.len();
        Self { buf: Arc::new(buf), range }
    }

    /// Bytes `r` of this payload.
    pub fn slice(&self, r: Range<usize>) -> Self {
        assert!(r.end <= self.range.len(), "slice within the payload");
        Self { buf: Arc::clone(&self.buf), range: self.range.start + r.start..self.range.start + r.end }
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

/// Completion callback of a request.
pub(crate) type Done = Box<dyn FnOnce(Result<()>) + Send>;

/// Work run by the leader between batches (see [`Req::Barrier`]).
pub(crate) type BarrierFn = Box<dyn FnOnce(&Inner) -> Result<()> + Send>;

/// A request to the writer. Writes name a volume; the leader maps it to the volume's head
/// layer when it builds the batch, so a snapshot (a barrier) cleanly splits writes queued
/// before it from those queued after.
pub(crate) enum Req {
    /// Map `data` (whole blocks) at `lba` of the volume's head.
    Write { volume: u64, lba: u64, data: Payload, fua: bool, done: Done },
    /// Unmap `blocks` blocks at `lba` of the volume's head.
    Unmap { volume: u64, lba: u64, blocks: u64, done: Done },
    /// Make everything acknowledged so far durable.
    Flush { done: Done },
    /// Run `run` on the leader with every earlier request applied and no later one started
    /// (catalog changes that restructure layers: snapshots, clones, deletions; cleaning).
    Barrier { run: BarrierFn, done: Done },
    /// Re-map `data` at `lba` of `layer` itself (the cleaner moving live blocks; only ever
    /// built on the leader, see [`write_moves`]).
    Move { layer: u64, lba: u64, data: Payload },
}

impl std::fmt::Debug for Req {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Req::Write { volume, lba, data, fua, .. } => {
                write!(f, "Write({volume}:{lba}+{}, fua={fua})", data.len())
            }
            Req::Unmap { volume, lba, blocks, .. } => write!(f, "Unmap({volume}:{lba}+{blocks})"),
            Req::Flush { .. } => f.write_str("Flush"),
            Req::Barrier { .. } => f.write_str("Barrier"),
            Req::Move { layer, lba, data } => write!(f, "Move({layer}:{lba}+{})", data.len()),
        }
    }
}

impl Req {
    /// Completes the request with an error.
    pub(crate) fn fail(self, e: &Error) {
        let done = match self {
            Req::Write { done, .. } | Req::Unmap { done, .. } | Req::Flush { done } | Req::Barrier { done, .. } => done,
            Req::Move { .. } => return, // nobody waits on a move; the cleaner sees the batch fail
        };
        done(Err(clone_err(e)));
    }

    pub(crate) fn data_blocks(&self) -> u64 {
        match self {
            Req::Write { data, .. } | Req::Move { data, .. } => (data.len() / BLOCK) as u64,
            _ => 0,
        }
    }
}

/// A position in the log: the next batch's sequence number and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogPos {
    pub seq: u64,
    pub seg: usize,
    pub off: u64,
}

const MAX_ENTRIES: usize = 512;

/// The request queue and the leader's baton (which also holds the reusable batch buffer).
#[derive(Debug)]
pub(crate) struct LogQueue {
    queue: Mutex<Queue>,
    /// The open batch small writes go into (see `tail.rs`).
    pub tail: crate::tail::Tail,
    /// Held by the thread writing batches. A buffer reused across batches avoids an mmap and
    /// page faults per large batch.
    leader: Mutex<AlignedBuf>,
}

#[derive(Debug, Default)]
struct Queue {
    reqs: VecDeque<Req>,
    closed: bool,
}

impl Default for LogQueue {
    fn default() -> Self {
        Self { queue: Mutex::default(), tail: crate::tail::Tail::default(), leader: Mutex::new(AlignedBuf::new(BLOCK)) }
    }
}

impl LogQueue {
    /// Refuses new requests and waits for the current leader to finish.
    pub fn close(&self) {
        self.queue.lock().closed = true;
        drop(self.leader.lock());
    }
}

/// Hands requests to the log: queues them all (so they can share a batch) and, if no other
/// thread is leading, leads until the queue is empty. On return a request may or may not have
/// completed; its callback says when. If the log is closed, the requests not queued come back.
pub(crate) fn submit(inner: &Inner, reqs: Vec<Req>) -> Result<(), Vec<Req>> {
    {
        let mut q = inner.log.queue.lock();
        if q.closed {
            return Err(reqs);
        }
        q.reqs.extend(reqs);
    }
    loop {
        let Some(mut scratch) = inner.log.leader.try_lock() else {
            // The leader takes our requests with its next batches (it only stops on an empty queue).
            return Ok(());
        };
        loop {
            let reqs = take_batch(inner);
            if reqs.is_empty() {
                break;
            }
            process(inner, reqs, &mut scratch);
        }
        drop(scratch);
        // A request queued between our last look and letting go would have seen us leading.
        if inner.log.queue.lock().reqs.is_empty() {
            return Ok(());
        }
    }
}

/// Takes the next batch off the queue: as many requests as fit one batch.
fn take_batch(inner: &Inner) -> Vec<Req> {
    // Fill what is left of the head segment before moving on, so segments end with little
    // unused space; a request that does not fit there starts a new segment.
    let room = head_room_blocks(inner);
    let mut q = inner.log.queue.lock();
    let Some(first) = q.reqs.front() else { return Vec::new() };
    let limit = if first.data_blocks() <= room { room.min(inner.max_batch_blocks) } else { inner.max_batch_blocks };
    let mut reqs = Vec::new();
    let mut blocks = 0;
    while let Some(r) = q.reqs.front() {
        let barrier = matches!(r, Req::Barrier { .. });
        if !reqs.is_empty() && (barrier || reqs.len() == MAX_ENTRIES || blocks + r.data_blocks() > limit) {
            break;
        }
        if barrier {
            // Alone in its batch.
            reqs.push(q.reqs.pop_front().expect("front exists"));
            break;
        }
        blocks += r.data_blocks();
        reqs.push(q.reqs.pop_front().expect("front exists"));
    }
    reqs
}

/// Data blocks a batch can still carry in the head segment, keeping room for the largest header.
fn head_room_blocks(inner: &Inner) -> u64 {
    let st = inner.state.read();
    let head = st.applied;
    if st.segs.segs[head.seg].state != SegState::Open {
        return 0;
    }
    let header = BatchHeader::blocks_for(MAX_ENTRIES, usize::try_from(inner.max_batch_blocks).unwrap_or(usize::MAX));
    ((inner.sb.segment_size - head.off) / BLOCK as u64).saturating_sub(header as u64)
}

fn process(inner: &Inner, reqs: Vec<Req>, scratch: &mut AlignedBuf) {
    if let Err(e) = inner.check_open() {
        return fail_all(reqs, &e);
    }
    if let [Req::Barrier { .. }] = reqs.as_slice() {
        let Some(Req::Barrier { run, done }) = reqs.into_iter().next() else { unreachable!("matched above") };
        // The barrier sees every earlier write on the store, not only in the maps.
        return done(crate::tail::close(inner).and_then(|()| run(inner)));
    }
    let mut acks: Vec<(Done, Result<()>)> = Vec::new();
    let mut after_sync: Vec<Done> = Vec::new();
    let mut batch: Vec<Req> = Vec::new();
    let mut need_sync = false;
    for r in reqs {
        match r {
            Req::Flush { done } => {
                need_sync = true;
                after_sync.push(done);
            }
            r => batch.push(r),
        }
    }
    let outcomes = if !batch.is_empty() && batch.iter().all(|r| crate::tail::takes(inner, r)) {
        crate::tail::append(inner, batch)
    } else {
        write_direct(inner, batch, scratch)
    };
    for (r, result) in outcomes {
        let (done, fua) = match r {
            Req::Write { done, fua, .. } => (done, fua),
            Req::Unmap { done, .. } => (done, false),
            Req::Flush { .. } | Req::Barrier { .. } | Req::Move { .. } => {
                unreachable!("flushes were split out, barriers go alone, moves never queue")
            }
        };
        match (result, fua) {
            (Ok(()), true) => {
                need_sync = true;
                after_sync.push(done);
            }
            (result, _) => acks.push((done, result)),
        }
    }
    for (done, r) in acks {
        done(r);
    }
    if need_sync {
        let r = inner.check_open().and_then(|()| crate::tail::close(inner)).and_then(|()| inner.sync_store());
        for done in after_sync {
            done(r.as_ref().map(|_| ()).map_err(clone_err));
        }
    }
}

/// Writes `batch` as a batch of its own (after the open batch, which is closed first).
fn write_direct(inner: &Inner, mut batch: Vec<Req>, scratch: &mut AlignedBuf) -> Vec<(Req, Result<()>)> {
    if batch.is_empty() {
        return Vec::new();
    }
    if let Err(e) = crate::tail::close(inner) {
        return batch.into_iter().map(|r| (r, Err(clone_err(&e)))).collect();
    }
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut result = write_batch(inner, &batch, scratch);
    if result.as_ref().is_err_and(|e| e.kind() == ErrorKind::NoSpace) {
        // Full: trims may still go (into the reserve) so that space can come back.
        let (unmaps, writes): (Vec<Req>, Vec<Req>) = batch.into_iter().partition(|r| matches!(r, Req::Unmap { .. }));
        let e = result.expect_err("checked above");
        outcomes.extend(writes.into_iter().map(|r| (r, Err(clone_err(&e)))));
        batch = unmaps;
        result = if batch.is_empty() { Ok(()) } else { write_batch(inner, &batch, scratch) };
    }
    outcomes.extend(batch.into_iter().map(|r| {
        let res = result.as_ref().map(|_| ()).map_err(clone_err);
        (r, res)
    }));
    outcomes
}

pub(crate) fn clone_err(e: &Error) -> Error {
    Error::new(e.kind(), e.to_string())
}

fn fail_all(reqs: Vec<Req>, e: &Error) {
    for r in reqs {
        r.fail(e);
    }
}

/// Builds, writes and applies one batch. Fails the whole batch with NoSpace if no segment can
/// take it; an unmap-only batch may use the reserve.
fn write_batch(inner: &Inner, reqs: &[Req], scratch: &mut AlignedBuf) -> Result<()> {
    let mut entries = Vec::with_capacity(reqs.len());
    let mut data_blocks = 0usize;
    // A volume deleted meanwhile maps to layer 0, which never exists: replay and apply skip it.
    let heads: Vec<u64> = {
        let st = inner.state.read();
        let head = |v: &u64| st.volumes.get(v).map_or(0, |e| e.rec.layer);
        reqs.iter()
            .map(|r| match r {
                Req::Write { volume, .. } | Req::Unmap { volume, .. } => head(volume),
                Req::Move { layer, .. } => *layer,
                _ => 0,
            })
            .collect()
    };
    for (r, &layer) in reqs.iter().zip(&heads) {
        match r {
            Req::Write { lba, data, .. } | Req::Move { lba, data, .. } => {
                let blocks = u32::try_from(data.len() / BLOCK).expect("requests are split below 4 GiB");
                entries.push(Entry { layer, lba: *lba, blocks, kind: EntryKind::Data });
                data_blocks += data.len() / BLOCK;
            }
            Req::Unmap { lba, blocks, .. } => {
                let mut done = 0;
                while done < *blocks {
                    let n = (*blocks - done).min(u64::from(u32::MAX));
                    let n32 = u32::try_from(n).expect("bounded");
                    entries.push(Entry { layer, lba: lba + done, blocks: n32, kind: EntryKind::Unmap });
                    done += n;
                }
            }
            Req::Flush { .. } | Req::Barrier { .. } => {}
        }
    }
    let hb = BatchHeader::blocks_for(entries.len(), data_blocks);
    let len = (hb + data_blocks) * BLOCK;
    if scratch.len() < len {
        *scratch = AlignedBuf::new(len);
    }
    // Every byte of buf[..len] is written below: the header (zero-padded by encode_into) and data.
    let buf = &mut scratch[..len];
    let mut crcs = Vec::with_capacity(data_blocks);
    let mut at = hb * BLOCK;
    for r in reqs {
        if let Req::Write { data, .. } | Req::Move { data, .. } = r {
            buf[at..at + data.len()].copy_from_slice(data);
            crcs.extend(data.chunks(BLOCK).map(block_crc));
            at += data.len();
        }
    }
    // Unmap-only batches and the cleaner's moves may use the reserve: both give space back.
    let may_use_reserve = reqs.iter().all(|r| matches!(r, Req::Unmap { .. } | Req::Move { .. }));
    let pos = reserve_room(inner, buf.len() as u64, may_use_reserve)?;
    let header = BatchHeader {
        seq: pos.seq,
        generation: inner.state.read().generation,
        uuid_tag: inner.sb.uuid_tag(),
        entries,
        crcs,
    };
    header.encode_into(&mut buf[..hb * BLOCK]);
    let buf = &*buf;
    let offset = inner.sb.segment_offset(pos.seg, pos.off);
    if let Err(e) = inner.backend.write_at(buf, offset) {
        let e = Error::io(format!("writing log batch {} at segment {} offset {}", pos.seq, pos.seg, pos.off), e);
        // ENOSPC from the filesystem under a sparse file: nothing was acknowledged, the head does
        // not move, and the next batch overwrites whatever part of this one landed.
        if e.kind() != ErrorKind::NoSpace {
            inner.poison(&e);
        }
        return Err(e);
    }
    inner.media_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
    let client: usize = reqs.iter().map(|r| if let Req::Write { data, .. } = r { data.len() } else { 0 }).sum();
    inner.client_bytes.fetch_add(client as u64, Ordering::Relaxed);
    let mut st = inner.state.write();
    apply(&mut st, &header, pos);
    if st.log_bytes_since_ckpt >= inner.opts.checkpoint_bytes {
        inner.ckpt.request();
    }
    Ok(())
}

/// Writes the cleaner's moves as batches; only on the leader (inside a barrier). Each move is
/// (layer, lba, whole blocks of data). Batches fill the head segment's tail before a new
/// segment is started, as client batches do, so moved data packs densely.
pub(crate) fn write_moves(inner: &Inner, moves: Vec<(u64, u64, Vec<u8>)>) -> Result<()> {
    let mut scratch = AlignedBuf::new(BLOCK);
    let mut queue: VecDeque<(u64, u64, Payload)> =
        moves.into_iter().map(|(layer, lba, data)| (layer, lba, Payload::new(data))).collect();
    while !queue.is_empty() {
        let room = head_room_blocks(inner);
        let limit = if room > 0 { room.min(inner.max_batch_blocks) } else { inner.max_batch_blocks };
        let mut batch: Vec<Req> = Vec::new();
        let mut blocks = 0;
        while let Some((layer, lba, data)) = queue.pop_front() {
            let n = (data.len() / BLOCK) as u64;
            if batch.len() == MAX_ENTRIES || blocks == limit {
                queue.push_front((layer, lba, data));
                break;
            }
            if blocks + n > limit {
                // Split: what fits goes now, the rest heads the next batch.
                let fit = usize::try_from(limit - blocks).expect("small") * BLOCK;
                queue.push_front((layer, lba + (limit - blocks), data.slice(fit..data.len())));
                batch.push(Req::Move { layer, lba, data: data.slice(0..fit) });
                break;
            }
            blocks += n;
            batch.push(Req::Move { layer, lba, data });
        }
        write_batch(inner, &batch, &mut scratch)?;
    }
    Ok(())
}

/// Applies a batch written (or replayed) at `pos` to the maps, crc tables and live counts, and
/// moves the applied position past it. Entries for layers that no longer exist are skipped.
pub(crate) fn apply(st: &mut State, h: &BatchHeader, pos: LogPos) {
    let hb = h.header_blocks() as u64;
    map_entries(st, &h.entries, st.segs.pba(pos.seg, pos.off / BLOCK as u64 + hb), &h.crcs);
    finish_batch(st, h.seq, pos, h.batch_len());
}

/// Maps `entries`, whose data blocks (with `crcs`) start at pool block `pba`.
pub(crate) fn map_entries(st: &mut State, entries: &[Entry], mut pba: u64, crcs: &[u32]) {
    if !crcs.is_empty() {
        st.segs.set_crcs(pba, crcs);
    }
    let mut freed = Vec::new();
    let State { layers, segs, dirty_chunks, .. } = st;
    for e in entries {
        let n = u64::from(e.blocks);
        let dirty = |c| {
            dirty_chunks.insert((e.layer, c));
        };
        match e.kind {
            EntryKind::Data => {
                if let Some(l) = layers.get_mut(&e.layer) {
                    l.map.set(e.lba, n, Some(pba), &mut freed, dirty);
                    segs.add_live(pba, n, true);
                }
                pba += n;
            }
            EntryKind::Unmap => crate::layers::unmap(layers, e.layer, e.lba, n, &mut freed, dirty),
        }
    }
    for (p, n) in freed {
        segs.add_live(p, n, false);
    }
}

/// Moves the applied position past batch `seq` of `len` bytes, written at `pos`.
pub(crate) fn finish_batch(st: &mut State, seq: u64, pos: LogPos, len: u64) {
    st.segs.segs[pos.seg].last_seq = seq;
    st.applied = LogPos { seq: seq + 1, seg: pos.seg, off: pos.off + len };
    st.log_bytes_since_ckpt += len;
}

/// Finds room for `len` bytes at the log head, opening a new segment if needed (recording the
/// move durably first). Returns where the batch goes.
pub(crate) fn reserve_room(inner: &Inner, len: u64, may_use_reserve: bool) -> Result<LogPos> {
    let seg_size = inner.sb.segment_size;
    // Once the cleaner's moves have dipped into the reserve, the head they opened is theirs:
    // client writes sharing it would spend the reserve a segment at a time until the cleaner
    // could not finish its victim (and nothing could ever free space again). They wait instead.
    // (Counting free segments is a scan: only done while the head came from the reserve.)
    let (head, head_is_open, reserve_dipped) = {
        let st = inner.state.read();
        let dipped = st.head_in_reserve && st.segs.count(SegState::Free) < inner.opts.reserve_segments;
        (st.applied, st.segs.segs[st.applied.seg].state == SegState::Open, dipped)
    };
    if head_is_open && head.off + len <= seg_size && (may_use_reserve || !reserve_dipped) {
        return Ok(head);
    }
    let reserve = if may_use_reserve { 0 } else { inner.opts.reserve_segments };
    let (mut seg, free_left) = {
        let mut st = inner.state.write();
        let seg = st.segs.take_free(reserve);
        (seg, st.segs.count(SegState::Free) as u64)
    };
    if free_left < crate::cleaner::low_water(inner) {
        inner.cleaner.kick();
    }
    if seg.is_none() && inner.state.read().segs.any_empty_sealed(&inner.pins) {
        // Empty segments are waiting for a checkpoint to release them.
        inner.checkpoint()?;
        seg = inner.state.write().segs.take_free(reserve);
    }
    // Out of space with dead space left: clean here, on the leader, rather than fail a write
    // the cleaner could make room for (its moves may use the reserve); each victim frees its
    // dead fraction, so it may take several. Not while the background cleaner runs: two
    // cleaners moving at once could together spend the whole reserve before either victim is
    // released, and the background one needs the leader for its moves. The write fails with
    // NoSpace instead, and the volume retries it once the cleaner has made room.
    let background_busy = inner.cleaner.stats.active.load(std::sync::atomic::Ordering::Acquire);
    if seg.is_none() && !may_use_reserve && inner.opts.background_cleaner && !background_busy {
        for _ in 0..64 {
            if !crate::cleaner::clean_inline(inner)? {
                break;
            }
            seg = inner.state.write().segs.take_free(reserve);
            if seg.is_some() {
                break;
            }
        }
    }
    let Some(seg) = seg else {
        inner.cleaner.kick();
        return Err(Error::new(ErrorKind::NoSpace, "pool is full: no free segment for new writes"));
    };
    // Inline cleaning wrote its moves as batches of their own, which may have moved the head
    // (into a fresh segment, with a later sequence number): continue from where it is now.
    let (head, head_is_open) = {
        let mut st = inner.state.write();
        let head = st.applied;
        let open = st.segs.segs[head.seg].state == SegState::Open;
        if head.seg != seg && open && head.off + len <= seg_size {
            st.segs.segs[seg].state = SegState::Free; // not needed after all
            return Ok(head);
        }
        (head, open)
    };
    let ready = inner
        .backend
        .allocate(inner.sb.segment_offset(seg, 0), seg_size)
        .map_err(|e| Error::io(format!("allocating segment {seg}"), e))
        .and_then(|()| inner.meta.put_chain(head.seq, seg as u64));
    let mut st = inner.state.write();
    if let Err(e) = ready {
        st.segs.segs[seg].state = SegState::Free;
        return Err(e);
    }
    debug_assert_eq!(st.applied, head, "only the leader moves the head");
    if head_is_open {
        st.segs.segs[head.seg].state = SegState::Sealed;
    }
    st.applied = LogPos { seq: head.seq, seg, off: 0 };
    st.head_in_reserve = st.segs.count(SegState::Free) < inner.opts.reserve_segments;
    Ok(st.applied)
}
