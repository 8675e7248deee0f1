//! What callers hand the log: requests, their payloads and completion callbacks.

use std::ops::Range;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::ctx::Ctx;
use crate::error::{Error, Result, clone_err};
use crate::io::BLOCK;
use crate::write::Log;

/// Whole blocks of data to write: a range of a buffer, so a write split into several requests,
/// or retried, is never copied again (the data is copied once, into the batch).
#[derive(Clone)]
pub(crate) struct Payload {
    bytes: Bytes,
    range: Range<usize>,
}

#[derive(Clone)]
enum Bytes {
    Owned(Arc<Vec<u8>>),
    /// A caller's buffer, lent for as long as it waits for its requests (see [`Payload::lent`]).
    Lent {
        ptr: *const u8,
        len: usize,
    },
}

// SAFETY: a lent buffer is only ever read, as a shared `&[u8]` (which is Send and Sync) would
// be, and `Payload::lent`'s contract keeps it alive and unchanged while it is read.
unsafe impl Send for Payload {}
// SAFETY: as for Send: shared access only reads.
unsafe impl Sync for Payload {}

impl Payload {
    pub fn new(buf: Vec<u8>) -> Self {
        let range = 0..buf.len();
        Self { bytes: Bytes::Owned(Arc::new(buf)), range }
    }

    /// A payload that reads `data` in place, with no copy.
    ///
    /// # Safety
    /// `data` must stay alive and unchanged until the done callback of every request holding
    /// this payload (or a slice of it) has run. The log never reads a request's data after its
    /// callback, so a caller that waits for all of them (a [`Waiter`]) may lend its buffer.
    pub unsafe fn lent(data: &[u8]) -> Self {
        Self { bytes: Bytes::Lent { ptr: data.as_ptr(), len: data.len() }, range: 0..data.len() }
    }

    /// Bytes `r` of this payload.
    pub fn slice(&self, r: Range<usize>) -> Self {
        assert!(r.end <= self.range.len(), "slice within the payload");
        Self { bytes: self.bytes.clone(), range: self.range.start + r.start..self.range.start + r.end }
    }

    /// Its length, without touching the bytes (a lent buffer may be gone once the request completed).
    pub fn len(&self) -> usize {
        self.range.len()
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Owned(buf) => &buf[self.range.clone()],
            // SAFETY: `lent`'s contract: the buffer is alive and unchanged until the request's
            // callback, and only the log reads it, before that callback.
            Bytes::Lent { ptr, len } => unsafe { &std::slice::from_raw_parts(*ptr, *len)[self.range.clone()] },
        }
    }
}

/// Completion callback of a request.
pub(crate) type Done = Box<dyn FnOnce(Result<()>) + Send>;

/// Work run by the leader between batches (see [`Req::Barrier`]).
pub(crate) type BarrierFn = Box<dyn FnOnce(&Ctx, &Log) -> Result<()> + Send>;

/// A request to the writer. Writes name a volume; the leader maps it to the volume's head
/// layer when it builds the batch, so a snapshot (a barrier) cleanly splits writes queued
/// before it from those queued after.
pub(crate) enum Req {
    /// Map `data` (whole blocks) at `lba` of the volume's head. `data` is not read after `done`
    /// ran (it may be a caller's lent buffer, see [`Payload::lent`]).
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

/// Counts outstanding requests and keeps the first error.
pub(crate) struct Waiter {
    left: Mutex<(usize, Option<Error>)>,
    cv: Condvar,
}

impl Waiter {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self { left: Mutex::new((0, None)), cv: Condvar::new() })
    }

    pub(crate) fn add(self: &Arc<Self>) -> Box<dyn FnOnce(Result<()>) + Send> {
        self.left.lock().0 += 1;
        let me = Arc::clone(self);
        Box::new(move |r| {
            let mut g = me.left.lock();
            g.0 -= 1;
            if let Err(e) = r {
                g.1.get_or_insert(e);
            }
            if g.0 == 0 {
                me.cv.notify_all();
            }
        })
    }

    pub(crate) fn wait(&self) -> Result<()> {
        let mut g = self.left.lock();
        while g.0 > 0 {
            self.cv.wait(&mut g);
        }
        g.1.take().map_or(Ok(()), Err)
    }
}
