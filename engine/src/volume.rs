//! I/O on one volume: byte-granular reads and writes over the block-granular log and maps.
//!
//! Reads resolve blocks under the state lock, then read media outside it (segments they touch
//! are pinned against reuse until the read is done), verifying every block's crc32c. Writes are
//! split into batch-sized requests; a write that does not cover whole blocks reads the partial
//! edge blocks and writes them back whole, holding a per-block stripe lock so two partial writes
//! to one block never lose each other's bytes.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, MutexGuard};

use crate::error::{Error, ErrorKind, Result};
use crate::fill::Access;
use crate::gate::{Inside, WriteGate};
use crate::io::BLOCK;
use crate::map::segments::Pinned;
use crate::mirror::{MirrorOp, WriteDone};
use crate::pool::Inner;
use crate::qos::{IoKind, Qos};
use crate::read::readahead::{Streams, note_read};
use crate::read::reads::Reads;
use crate::read::resolve::{Resolved, check_within, gone, resolve};
use crate::state::{State, Target};
use crate::write::req::{Payload, Req, Waiter};

const B: u64 = BLOCK as u64;
/// Zeroes [`Volume::write_zero_data`] writes per call (the buffer it needs).
pub const ZERO_DATA_SLICE: u64 = 1 << 20;
/// How long a write waits for the cleaner to make room before it gives up with ENOSPC.
const NO_SPACE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// A request that touches part of a block, as whole-block parts `(offset, len, data, fua)`:
/// data parts (the blocks as they are after the request) and zeroed whole blocks. None for a
/// request of whole blocks, a trim (it only ever drops whole blocks) and a flush.
fn whole_block_parts(op: MirrorOp<'_>) -> Option<Vec<(u64, u64, bool, bool)>> {
    let (offset, len, zero, fua) = match op {
        MirrorOp::Write { offset, data, fua } => (offset, data.len() as u64, false, fua),
        MirrorOp::Zero { offset, len, fua } => (offset, len, true, fua),
        MirrorOp::Trim { .. } | MirrorOp::Flush => return None,
    };
    let (start, end) = (offset / B * B, (offset + len).div_ceil(B) * B);
    if (start, end) == (offset, offset + len) || len == 0 {
        return None;
    }
    if !zero {
        return Some(vec![(start, end - start, true, fua)]);
    }
    let (inner_start, inner_end) = (offset.div_ceil(B) * B, (offset + len) / B * B);
    if inner_end <= inner_start {
        return Some(vec![(start, end - start, true, fua)]);
    }
    let mut parts = Vec::with_capacity(3);
    if start < inner_start {
        parts.push((start, B, true, fua));
    }
    parts.push((inner_start, inner_end - inner_start, false, fua));
    if inner_end < end {
        parts.push((inner_end, B, true, fua));
    }
    Some(parts)
}

/// A handle for I/O on one volume or snapshot. Cheap to clone; fails with NotFound once the
/// volume is deleted and with Closed once the pool is closed. It does not keep the pool open.
#[derive(Debug, Clone)]
pub struct Volume {
    inner: Weak<Inner>,
    target: Target,
    name: String,
    /// The volume's write gate; None for a snapshot, and for a handle that writes past it
    /// ([`Volume::past_read_only`]).
    gate: Option<Arc<WriteGate>>,
    /// The volume's limits; None where the gate is (the owner's own I/O is not limited).
    qos: Option<Arc<Qos>>,
    /// The caller waits out [`Volume::reserve`] itself ([`Volume::caller_paces`]).
    caller_paces: bool,
    /// Reads and writes blocks as the pool holds them ([`Volume::ciphertext`]).
    raw: bool,
    /// Sequential streams of this handle and its clones, for readahead.
    pub(crate) streams: Arc<Mutex<Streams>>,
}

impl Volume {
    pub(crate) fn new(
        inner: Weak<Inner>,
        target: Target,
        name: String,
        limits: Option<(Arc<WriteGate>, Arc<Qos>)>,
    ) -> Self {
        let (gate, qos) = limits.unzip();
        Self { inner, target, name, gate, qos, caller_paces: false, raw: false, streams: Arc::default() }
    }

    /// True for a snapshot's handle, and for a volume made read-only ([`Pool::set_read_only`]):
    /// their writes fail with [`ErrorKind::ReadOnly`] (EROFS).
    ///
    /// [`Pool::set_read_only`]: crate::Pool::set_read_only
    pub fn is_read_only(&self) -> bool {
        match self.target {
            Target::Snapshot(_) => true,
            Target::Volume(_) => self.gate.as_ref().is_some_and(|g| g.is_closed()),
        }
    }

    /// This handle, writing whether or not the volume is read-only: for the pool's owner
    /// applying data of its own (a replication delta to a replica), never for clients.
    #[must_use]
    pub fn past_read_only(mut self) -> Self {
        self.gate = None;
        self.qos = None;
        self
    }

    /// This handle, reading and writing an encrypted volume's blocks as the pool holds them
    /// (ciphertext, no key needed; the same as any handle's for a plaintext volume): what
    /// replication ships, so a replica never needs the key. Writes must be whole blocks.
    #[must_use]
    pub fn ciphertext(mut self) -> Self {
        self.raw = true;
        self
    }

    /// This handle, for a caller that waits out the volume's limits itself: it asks
    /// [`Volume::reserve`] before each request and delays it without holding a thread others
    /// need (an event loop). Other handles wait inside each I/O call.
    #[must_use]
    pub fn caller_paces(mut self) -> Self {
        self.caller_paces = true;
        self
    }

    /// Takes one request's place under the volume's limits (a trim or write-zeroes is a write of
    /// 0 bytes): how long it must wait before it runs. Zero for an unlimited volume.
    pub fn reserve(&self, kind: IoKind, bytes: u64) -> std::time::Duration {
        self.qos.as_ref().map_or(std::time::Duration::ZERO, |q| q.reserve(kind, bytes))
    }

    /// Waits out the limits, unless the caller does ([`Volume::caller_paces`]).
    fn pace(&self, kind: IoKind, bytes: u64) {
        if self.caller_paces {
            return;
        }
        let wait = self.reserve(kind, bytes);
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }

    /// Brings [offset, offset+len) to its content first if a restore is filling the volume
    /// ([`crate::Fill`]).
    fn filled(&self, offset: u64, len: u64) -> Result<()> {
        self.filled_for(offset, len, Access::Read)
    }

    fn filled_for(&self, offset: u64, len: u64, access: Access) -> Result<()> {
        match self.gate.as_ref().and_then(|g| g.fill()) {
            Some(f) => f.fill(offset, len, access),
            None => Ok(()),
        }
    }

    /// The parts of [offset, offset+len) a restore has not filled yet (none without one): an
    /// allocation query reports them as data without fetching them.
    fn unfilled(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64)>> {
        match self.gate.as_ref().and_then(|g| g.fill()) {
            Some(f) => f.pending(offset, len),
            None => Ok(Vec::new()),
        }
    }

    /// Admits one client write (held until it is acknowledged), or refuses it.
    fn enter(&self) -> Result<Option<Inside>> {
        self.writable()?;
        match &self.gate {
            None => Ok(None),
            Some(g) => g
                .enter()
                .map(Some)
                .ok_or_else(|| Error::new(ErrorKind::ReadOnly, format!("volume {:?} is read-only", self.name))),
        }
    }

    /// The layer reads start from, and the size, as of now.
    fn head(&self, st: &State) -> Result<(u64, u64)> {
        st.head_of(self.target).ok_or_else(|| gone(&self.name))
    }

    /// The volume id writes go to; an error for a snapshot.
    fn writable(&self) -> Result<u64> {
        match self.target {
            Target::Volume(id) => Ok(id),
            Target::Snapshot(_) => {
                Err(Error::new(ErrorKind::ReadOnly, format!("snapshot {:?} is read-only", self.name)))
            }
        }
    }

    fn pool(&self) -> Result<Arc<Inner>> {
        self.inner.upgrade().ok_or_else(crate::ctx::closed)
    }

    /// The volume's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether a write may have to wait now: the volume is mirrored (a write waits for its
    /// members), or the cleaner is running and writes are paced against it (or the pool is
    /// closed). A server that would hold other requests back while a write runs asks first.
    pub fn writes_may_wait(&self) -> bool {
        self.is_mirrored() || self.pool().map_or(true, |inner| inner.cleaner.pace.is_on())
    }

    /// Whether the pool's store is memory (see [`crate::io::Backend::in_memory`]): a read then
    /// never waits for a device, and a server may run it where it would not block on one.
    pub fn store_in_memory(&self) -> bool {
        self.pool().is_ok_and(|inner| inner.ctx.backend.in_memory())
    }

    /// Current size in bytes.
    pub fn size(&self) -> Result<u64> {
        self.size_in(&*self.pool()?)
    }

    fn size_in(&self, inner: &Inner) -> Result<u64> {
        Ok(self.head(&inner.state.read())?.1)
    }

    fn check_range(&self, inner: &Inner, offset: u64, len: u64) -> Result<()> {
        check_within(&self.name, self.size_in(inner)?, offset, len)
    }

    /// Reads `buf.len()` bytes at `offset`. Never-written ranges read as zeros without touching
    /// media; a checksum mismatch is an error naming the volume and offset, never data.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_sparse(offset, buf).map(drop)
    }

    /// As [`Volume::read`], and also returns the range's allocation as [`Volume::allocation`]
    /// does, from the same lookup (an NBD structured read needs both).
    pub fn read_sparse(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<(u64, bool)>> {
        self.read_sparse_many(&mut [(offset, buf)]).pop().expect("one outcome per range")
    }

    /// Reads several ranges as one: every range is resolved in one hold of the state lock and
    /// all their media blocks are read in one batch (one submission for the lot on io_uring).
    /// Each range gets its own outcome, with its allocation as [`Volume::read_sparse`] returns
    /// it; a media read error fails every range that had blocks to read.
    pub fn read_sparse_many(&self, parts: &mut [(u64, &mut [u8])]) -> Vec<Result<Vec<(u64, bool)>>> {
        let spans: Vec<(u64, usize)> = parts.iter().map(|(offset, buf)| (*offset, buf.len())).collect();
        let mut reads = match self.start_reads(&spans) {
            Ok(r) => r,
            Err(e) => return parts.iter().map(|_| Err(crate::error::clone_err(&e))).collect(),
        };
        let media = reads.read_media();
        reads.finish(media, &mut parts.iter_mut().map(|(_, buf)| &mut **buf).collect::<Vec<_>>())
    }

    /// Starts reading the ranges `(offset, length)` as [`Volume::read_sparse_many`] does, up to
    /// the store reads, which the caller does (see [`Reads`]). Fails as a whole only when the
    /// volume or the pool is gone, or its mirror refuses reads ([`crate::mirror::Mirror::admit_read`]);
    /// each range's own errors come from [`Reads::finish`].
    pub fn start_reads(&self, parts: &[(u64, usize)]) -> Result<Reads<'_>> {
        for &(offset, len) in parts {
            self.filled(offset, len as u64)?;
        }
        if let Some(mirror) = self.gate.as_ref().and_then(|g| g.mirror()) {
            mirror.admit_read()?;
        }
        if !self.caller_paces && self.qos.is_some() {
            let wait = parts.iter().map(|&(_, len)| self.reserve(IoKind::Read, len as u64)).max();
            if let Some(w) = wait.filter(|w| !w.is_zero()) {
                std::thread::sleep(w);
            }
        }
        let inner = self.pool()?;
        inner.ctx.client_ops.fetch_add(1, Ordering::Relaxed);
        for &(offset, len) in parts {
            note_read(&inner.ctx, &inner.readahead, &self.streams, self.target, &self.name, offset, len as u64);
        }
        let mut pins = Pinned::new(&inner.pins);
        let resolved: Vec<Result<Vec<Resolved>>> = {
            let st = inner.state.read();
            parts
                .iter()
                .map(|&(offset, len)| resolve(&st, self.target, &self.name, &mut pins, (offset, len as u64), self.raw))
                .collect()
        };
        let pinned = pins.into_held();
        let ctx = Arc::clone(&inner.ctx);
        Ok(Reads::new(&self.name, ctx, (&inner.readahead, &inner.log), parts, resolved, pinned))
    }

    /// Writes `data` at `offset`; acknowledged once in the log (not yet durable).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write_client(offset, data, false)
    }

    /// Writes `data` at `offset` and returns only once it is durable (FUA).
    pub fn write_fua(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write_client(offset, data, true)
    }

    fn write_client(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.filled(offset, data.len() as u64)?;
        self.pace(IoKind::Write, data.len() as u64);
        let _in = self.enter()?;
        let inner = &*self.pool()?;
        self.mirrored(inner, MirrorOp::Write { offset, data, fua }, || {
            self.write_in(inner, offset, Cow::Borrowed(data), fua)
        })
    }

    /// Starts a client write (not FUA) of a volume with synchronous replicas without waiting for
    /// them: written here, sent to the members, and `done` gets the outcome once every member
    /// answered, from the thread that reads their answers; no thread waits meanwhile. The same
    /// rules as [`Volume::write`] (an overlapping write waits for this one). Gives `done` back,
    /// untouched and with nothing written, when the write cannot start without waiting (the
    /// volume is not mirrored, an overlapping write is in flight, the mirror pauses, a member is
    /// rebuilt, the volume is encrypted or paced): the caller then calls [`Volume::write`]
    /// where it may block.
    pub fn start_write(&self, offset: u64, data: &[u8], done: WriteDone) -> std::result::Result<(), WriteDone> {
        let Some(gate) = self.gate.as_ref().filter(|g| !g.is_rekeying() && g.fill().is_none()) else {
            return Err(done);
        };
        let Some(mirror) = gate.mirror().filter(|m| !m.whole_blocks()) else { return Err(done) };
        let Ok(inner) = self.pool() else { return Err(done) };
        let limited = !self.caller_paces && self.qos.as_ref().is_some_and(|q| q.is_limited());
        if limited || inner.cleaner.pace.is_on() || !matches!(self.write_key(&inner), Ok(None)) {
            return Err(done);
        }
        let len = data.len() as u64;
        if self.check_range(&inner, offset, len).is_err() {
            return Err(done);
        }
        let Some(_running) = gate.rekey.try_read() else { return Err(done) };
        let Some(held) = gate.try_hold(offset / B, (offset + len).div_ceil(B)) else { return Err(done) };
        let admitted = match mirror.try_admit() {
            None => return Err(done),
            Some(Ok(a)) => a,
            Some(Err(e)) => {
                done(Err(e));
                return Ok(());
            }
        };
        // Unlimited: counted in the volume's rates, never waits.
        self.pace(IoKind::Write, len);
        let started = self.enter().and_then(|inside| {
            let pending = mirror.send(MirrorOp::Write { offset, data, fua: false })?;
            Ok((inside, pending))
        });
        let (inside, pending) = match started {
            Ok(s) => s,
            Err(e) => {
                done(Err(e));
                return Ok(());
            }
        };
        let here = self.write_in(&inner, offset, Cow::Borrowed(data), false);
        pending.then(Box::new(move |there| {
            drop((held, admitted, inside));
            done(here.and(there));
        }));
        Ok(())
    }

    /// Runs a client request here and, for a volume with synchronous replicas, on its members
    /// at the same time: done when both are. Overlapping requests wait for each other (see
    /// `mirror.rs`). A member refusing the request before it is sent refuses it here too.
    fn mirrored(&self, inner: &Inner, op: MirrorOp<'_>, local: impl FnOnce() -> Result<()>) -> Result<()> {
        let Some(gate) = self.gate.as_ref() else { return local() };
        let _running = gate.rekey.read();
        let mirror = gate.mirror();
        if mirror.is_none() && !gate.is_rekeying() {
            return local();
        }
        let _held = match op.range() {
            Some((offset, len)) => {
                self.check_range(inner, offset, len)?;
                Some(gate.ranges.lock(offset / B, (offset + len).div_ceil(B)))
            }
            None => None,
        };
        let Some(mirror) = mirror else { return local() };
        let _admitted = mirror.admit()?;
        // Members of an encrypted volume hold its ciphertext and no key: they get whole blocks
        // as this volume stores them.
        let key = match op {
            MirrorOp::Write { .. } | MirrorOp::Zero { .. } => self.write_key(inner)?,
            MirrorOp::Trim { .. } | MirrorOp::Flush => None,
        };
        if (mirror.whole_blocks() || key.is_some())
            && let Some(parts) = whole_block_parts(op)
        {
            // A member being rebuilt cannot merge a partial block with what it holds (the
            // block may not have arrived yet), nor can one without the key: it gets the whole
            // blocks as they are here.
            local()?;
            let raw = self.clone().ciphertext();
            let mut pending = Vec::with_capacity(parts.len());
            for (offset, len, data, fua) in parts {
                pending.push(if data {
                    let mut whole = vec![0u8; usize::try_from(len).expect("a few blocks")];
                    raw.read(offset, &mut whole)?;
                    mirror.send(MirrorOp::Write { offset, data: &whole, fua })?
                } else {
                    mirror.send(MirrorOp::Zero { offset, len, fua })?
                });
            }
            return pending.into_iter().try_for_each(|p| p.wait());
        }
        if let (Some(key), MirrorOp::Write { offset, data, fua }) = (key, op) {
            // Whole blocks: encrypted once, the same ciphertext here and on the members.
            let mut sealed = data.to_vec();
            key.encrypt(offset / B, &mut sealed);
            let pending = mirror.send(MirrorOp::Write { offset, data: &sealed, fua })?;
            let here = self.clone().ciphertext().write_in(inner, offset, Cow::Owned(sealed), fua);
            let there = pending.wait();
            return here.and(there);
        }
        let pending = mirror.send(op)?;
        let here = local();
        let there = pending.wait();
        here.and(there)
    }

    fn stripe(&self, inner: &Inner, lba: u64) -> usize {
        let key = match self.target {
            Target::Volume(id) | Target::Snapshot(id) => id,
        };
        let h = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ lba).wrapping_mul(0xff51_afd7_ed55_8ccd);
        usize::try_from(h >> 56).expect("8 bits") % inner.stripes.len()
    }

    /// Locks the stripes of the partial edge blocks of [offset, offset+len), in index order.
    fn lock_edges<'a>(&self, inner: &'a Inner, offset: u64, len: u64) -> Vec<MutexGuard<'a, ()>> {
        let end = offset + len;
        let mut idx = Vec::with_capacity(2);
        if !offset.is_multiple_of(B) || len < B {
            idx.push(self.stripe(inner, offset / B));
        }
        if !end.is_multiple_of(B) {
            idx.push(self.stripe(inner, (end - 1) / B));
        }
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| inner.stripes[i].lock()).collect()
    }

    /// A write admitted by [`Volume::enter`].
    fn write_in(&self, inner: &Inner, offset: u64, data: Cow<'_, [u8]>, fua: bool) -> Result<()> {
        self.check_range(inner, offset, data.len() as u64)?;
        inner.check_open()?;
        if data.is_empty() {
            return if fua { inner.log.flush(inner) } else { Ok(()) };
        }
        let len = data.len() as u64;
        let start = offset - offset % B;
        let end = (offset + len).div_ceil(B) * B;
        let key = match self.raw {
            false => self.write_key(inner)?,
            true if (start, end) != (offset, offset + len) => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("volume {:?}: a ciphertext write is of whole blocks", self.name),
                ));
            }
            true => None,
        };
        if start == offset && end == offset + len {
            let payload = match (data, key) {
                (data, Some(k)) => {
                    let mut v = data.into_owned();
                    k.encrypt(start / B, &mut v);
                    Payload::new(v)
                }
                (Cow::Owned(v), None) => Payload::new(v),
                // SAFETY: `submit_blocks` returns only once every request it sent completed,
                // and `data` outlives it.
                (Cow::Borrowed(d), None) => unsafe { Payload::lent(d) },
            };
            return self.submit_blocks(inner, start, payload, fua);
        }
        let _edges = self.lock_edges(inner, offset, len);
        let mut whole = vec![0u8; usize::try_from(end - start).expect("fits")];
        // Both edge blocks in one lookup and one media batch.
        let (head, rest) = whole.split_at_mut(BLOCK);
        let mut edges = vec![(start, head)];
        if let Some(at) = rest.len().checked_sub(BLOCK) {
            edges.push((end - B, &mut rest[at..]));
        }
        self.read_sparse_many(&mut edges).into_iter().try_for_each(|r| r.map(drop))?;
        let rel = usize::try_from(offset - start).expect("fits");
        whole[rel..rel + data.len()].copy_from_slice(&data);
        if let Some(k) = key {
            k.encrypt(start / B, &mut whole);
        }
        self.submit_blocks(inner, start, Payload::new(whole), fua)
    }

    /// The data key this volume's writes are encrypted with (None: plaintext), as of now: its
    /// head layer's. A handle of a locked volume fails here, before anything is written.
    fn write_key(&self, inner: &Inner) -> Result<Option<Arc<ferrite_crypt::DataKey>>> {
        let st = inner.state.read();
        let (head, _) = self.head(&st)?;
        crate::keys::open(&st.keys, st.layers.key_of(head), &self.name)
    }

    /// Sends whole blocks at block-aligned `offset` and waits for them. A pool that is full while
    /// dead space remains makes the write wait for the cleaner (woken when a checkpoint frees
    /// segments, up to [`NO_SPACE_PATIENCE`] in all) instead of failing: ENOSPC is for a pool with nothing to reclaim.
    /// Retrying is safe: the same blocks written again are the same write.
    fn submit_blocks(&self, inner: &Inner, offset: u64, data: Payload, fua: bool) -> Result<()> {
        inner.ctx.client_ops.fetch_add(1, Ordering::Relaxed);
        inner.cleaner.pace.pay((data.len() / BLOCK) as u64);
        let start = std::time::Instant::now();
        loop {
            let seen = inner.wake.freed.count();
            match self.submit_blocks_once(inner, offset, &data, fua) {
                Err(e)
                    if e.kind() == ErrorKind::NoSpace
                        && start.elapsed() < NO_SPACE_PATIENCE
                        && crate::maint::cleaner::worth_waiting(inner) =>
                {
                    inner.wake.cleaner.raise();
                    inner.wake.freed.wait(seen, std::time::Duration::from_millis(20));
                }
                r => return r,
            }
        }
    }

    fn submit_blocks_once(&self, inner: &Inner, offset: u64, data: &Payload, fua: bool) -> Result<()> {
        let volume = self.writable()?;
        let w = Waiter::new();
        // Requests of a quarter batch let the writer fill a segment's tail closely.
        let piece = usize::try_from(inner.max_batch_blocks.div_ceil(4)).expect("fits") * BLOCK;
        let reqs = (0..data.len())
            .step_by(piece)
            .map(|at| {
                let lba = offset / B + (at / BLOCK) as u64;
                Req::Write { volume, lba, data: data.slice(at..data.len().min(at + piece)), fua, done: w.add() }
            })
            .collect();
        let sent = inner.log.send_all(inner, reqs);
        let r = w.wait();
        sent.and(r)
    }

    /// Discards whole blocks inside [offset, offset+len): they read as zeros afterwards and their
    /// space becomes reclaimable. Partial blocks at the edges are left as they are.
    pub fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.filled_for(offset, len, Access::Trim)?;
        self.pace(IoKind::Write, 0);
        let inner = &*self.pool()?;
        let _in = self.enter()?;
        self.mirrored(inner, MirrorOp::Trim { offset, len }, || {
            self.check_range(inner, offset, len)?;
            let start = offset.div_ceil(B);
            let end = (offset + len) / B;
            if end <= start {
                return Ok(());
            }
            self.unmap(inner, start, end - start)
        })
    }

    /// Zeroes [offset, offset+len): whole blocks are unmapped (no space used), partial edge
    /// blocks are rewritten with zeros.
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.filled(offset, len)?;
        self.pace(IoKind::Write, 0);
        let inner = &*self.pool()?;
        let _in = self.enter()?;
        self.mirrored(inner, MirrorOp::Zero { offset, len, fua }, || self.zero_in(inner, offset, len, fua))
    }

    /// Zeroes [offset, offset+len) that stay allocated (NBD's NO_HOLE, a member applying its
    /// primary's): zero data, [`ZERO_DATA_SLICE`] at a time, so the memory is one slice whatever
    /// the length and other writes interleave between slices.
    pub fn write_zero_data(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        if self.raw && self.is_encrypted()? {
            // Zero bytes are no block's ciphertext: without the key, zeros are holes.
            return self.write_zeroes(offset, len, fua);
        }
        let zeros = vec![0u8; usize::try_from(len.min(ZERO_DATA_SLICE)).expect("bounded")];
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(zeros.len() as u64);
            self.write(at, &zeros[..usize::try_from(n).expect("bounded")])?;
            at += n;
        }
        if fua { self.flush() } else { Ok(()) }
    }

    fn zero_in(&self, inner: &Inner, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_range(inner, offset, len)?;
        let start = offset.div_ceil(B) * B;
        let end = (offset + len) / B * B;
        if end <= start {
            let zeros = vec![0u8; usize::try_from(len).expect("below one block")];
            return self.write_in(inner, offset, Cow::Owned(zeros), fua);
        }
        if offset < start {
            self.write_in(inner, offset, Cow::Owned(vec![0u8; usize::try_from(start - offset).expect("fits")]), false)?;
        }
        if end < offset + len {
            self.write_in(
                inner,
                end,
                Cow::Owned(vec![0u8; usize::try_from(offset + len - end).expect("fits")]),
                false,
            )?;
        }
        self.unmap(inner, start / B, (end - start) / B)?;
        if fua { inner.log.flush(inner) } else { Ok(()) }
    }

    fn unmap(&self, inner: &Inner, lba: u64, blocks: u64) -> Result<()> {
        inner.check_open()?;
        inner.ctx.client_ops.fetch_add(1, Ordering::Relaxed);
        let w = Waiter::new();
        inner.log.send(inner, Req::Unmap { volume: self.writable()?, lba, blocks, done: w.add() })?;
        w.wait()
    }

    /// Allocation of [offset, offset+len) as runs of (bytes, mapped), in order, at block
    /// granularity: what NBD `base:allocation` and changed-block queries report. No media I/O.
    pub fn allocation(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>> {
        self.runs_since(None, offset, len)
    }

    /// Where each block of [offset, offset+len) comes from, as runs of (bytes, depth): 0 where
    /// nothing in the chain holds it (it reads as zeros), 1 where this image's own layer does,
    /// 2 its parent's, and so on (what `qemu:allocation-depth` reports for a backing chain).
    /// No media I/O.
    pub fn allocation_depth(&self, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        let unfilled = self.unfilled(offset, len)?;
        let inner = self.pool()?;
        self.check_range(&inner, offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let (first, end) = (offset / B, (offset + len).div_ceil(B));
        let blocks: Vec<(u64, u64, u32)> = {
            let st = inner.state.read();
            let (head, _) = self.head(&st)?;
            let mut chain = Vec::new();
            let mut at = Some(head);
            while let Some(l) = at.filter(|l| st.layers.contains_key(l)) {
                chain.push(l);
                at = st.layers[&l].parent;
            }
            let depth = |layer: u64| {
                chain.iter().position(|&l| l == layer).map_or(0, |i| u32::try_from(i + 1).unwrap_or(u32::MAX))
            };
            st.layers.resolve(head, first, end - first).into_iter().map(|r| (r.lba, r.blocks, depth(r.layer))).collect()
        };
        let mut runs: Vec<(u64, u32)> = Vec::new();
        for (lba, n, d) in blocks {
            let (from, to) = ((lba * B).max(offset), ((lba + n) * B).min(offset + len));
            match runs.last_mut() {
                Some((bytes, last)) if *last == d => *bytes += to - from,
                _ => runs.push((to - from, d)),
            }
        }
        Ok(crate::fill::overlay(runs, offset, &unfilled, 1))
    }

    /// What changed in [offset, offset+len) since snapshot `since` (an earlier snapshot beneath
    /// this image) as runs of (bytes, changed), in order, at block granularity: what NBD's
    /// `ferrite:changed:` context reports. A block rewritten with equal bytes, or trimmed where
    /// it read as zeros, counts as changed; a block reported unchanged reads the same in both.
    /// No media I/O.
    pub fn changed(&self, since: &str, offset: u64, len: u64) -> Result<Vec<(u64, bool)>> {
        self.runs_since(Some(since), offset, len)
    }

    /// [offset, offset+len) as runs of (bytes, flagged): flagged where it changed since snapshot
    /// `since`, or with no `since` where it is allocated, the runs between them unflagged.
    fn runs_since(&self, since: Option<&str>, offset: u64, len: u64) -> Result<Vec<(u64, bool)>> {
        // An allocation query reports what is not restored yet as data, without fetching it.
        let unfilled = match since {
            None => self.unfilled(offset, len)?,
            Some(_) => self.filled(offset, len).map(|()| Vec::new())?,
        };
        let inner = self.pool()?;
        self.check_range(&inner, offset, len)?;
        let flagged = {
            let st = inner.state.read();
            let (head, size) = self.head(&st)?;
            crate::state::changed_in(&st, head, size, since, offset, len)?
        };
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut at = offset;
        for (o, n) in flagged {
            if o > at {
                runs.push((o - at, false));
            }
            runs.push((n, true));
            at = o + n;
        }
        if at < offset + len {
            runs.push((offset + len - at, false));
        }
        Ok(crate::fill::overlay(runs, offset, &unfilled, true))
    }

    /// Makes every write acknowledged so far (on any volume of the pool) durable, and on a
    /// mirrored volume's members every write they acknowledged.
    pub fn flush(&self) -> Result<()> {
        let inner = &*self.pool()?;
        self.mirrored(inner, MirrorOp::Flush, || inner.log.flush(inner))
    }

    /// Whether this volume's (or snapshot's) own blocks are encrypted.
    pub fn is_encrypted(&self) -> Result<bool> {
        let inner = self.pool()?;
        let st = inner.state.read();
        let (head, _) = self.head(&st)?;
        Ok(st.layers.key_of(head).is_some())
    }

    /// Whether client writes of this volume also go to synchronous replicas.
    pub fn is_mirrored(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.mirror().is_some())
    }
}
