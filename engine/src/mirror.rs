//! Synchronous mirroring of a volume's client writes: the hook the daemon's synchronous replicas
//! plug into. Every client write of a mirrored volume goes to its [`Mirror`] as well as to the
//! log, and is acknowledged only when both have it; reads stay local. The engine knows no
//! transport: the daemon implements [`Mirror`] over its network stream.
//!
//! Overlapping writes of a mirrored volume run one after the other ([`RangeLocks`], at block
//! granularity, held until both copies answered). Two copies applying overlapping writes in
//! different orders would hold different data and neither would know; non-overlapping writes
//! commute, so only overlaps need an order, and a member applies what it receives in any order.

use parking_lot::{Condvar, Mutex};

use crate::error::Result;

/// A client request of a mirrored volume, as the members get it. Trims and zeroes travel as
/// such, never as zero data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorOp<'a> {
    Write {
        offset: u64,
        data: &'a [u8],
        fua: bool,
    },
    Trim {
        offset: u64,
        len: u64,
    },
    Zero {
        offset: u64,
        len: u64,
        fua: bool,
    },
    /// Makes every write the members acknowledged before it durable there.
    Flush,
}

impl MirrorOp<'_> {
    /// The bytes the request touches; None for a flush.
    pub fn range(&self) -> Option<(u64, u64)> {
        match *self {
            MirrorOp::Write { offset, data, .. } => Some((offset, data.len() as u64)),
            MirrorOp::Trim { offset, len } | MirrorOp::Zero { offset, len, .. } => Some((offset, len)),
            MirrorOp::Flush => None,
        }
    }
}

/// Where a mirrored volume's writes also go. Each client request is admitted first ([`Mirror::admit`]),
/// then asks [`Mirror::whole_blocks`], then is sent; a point the mirror takes between requests
/// (waiting for the admitted ones to end) sees each wholly before or wholly after it.
pub trait Mirror: Send + Sync + std::fmt::Debug {
    /// Counts a client request in flight until the returned value drops. An error refuses it
    /// before it runs locally (the volume may not accept writes now, e.g. its members lost their
    /// majority).
    fn admit(&self) -> Result<Box<dyn Send>> {
        Ok(Box::new(()))
    }

    /// As [`Mirror::admit`], for a caller that must not block: None when admitting the request
    /// would wait (a pause), and the caller then admits it where it may block.
    fn try_admit(&self) -> Option<Result<Box<dyn Send>>> {
        None
    }

    /// Whether the volume may serve reads now; an error fails them (a primary cut off from its
    /// members for too long: the majority may have moved on without it).
    fn admit_read(&self) -> Result<()> {
        Ok(())
    }

    /// Sends an admitted request to every member that must have it.
    fn send(&self, op: MirrorOp<'_>) -> Result<Box<dyn Pending>>;

    /// Whether every write and zeroing must reach the members as whole blocks (a member is
    /// being rebuilt). A request touching part of a block then runs here first, and the blocks
    /// it touched go to the members as they are afterwards. It changes only while no request is
    /// admitted.
    fn whole_blocks(&self) -> bool {
        false
    }
}

/// A request sent to the members, not yet answered by all of them.
pub trait Pending: Send + 'static {
    /// Waits until every member that must have the request answered (or was dropped from the
    /// members); an error fails the client's request.
    fn wait(self: Box<Self>) -> Result<()>;

    /// Calls `done` with what [`Pending::wait`] would return once it would return, without a
    /// thread waiting meanwhile where the mirror can (its answers' reader calls it; it must be
    /// quick). The default waits on a thread of its own.
    fn then(self: Box<Self>, done: Box<dyn FnOnce(Result<()>) + Send>) {
        std::thread::spawn(move || done(self.wait()));
    }
}

/// What a write started with [`crate::Volume::start_write`] reports its outcome to: called
/// once, on whichever thread finishes the write.
pub type WriteDone = Box<dyn FnOnce(Result<()>) + Send>;

/// Block ranges with a request in flight; a request overlapping one waits for it to end.
#[derive(Debug, Default)]
pub struct RangeLocks {
    held: Mutex<Vec<(u64, u64)>>,
    freed: Condvar,
}

/// A held range; dropping it lets overlapping requests run.
#[derive(Debug)]
pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    range: (u64, u64),
}

impl RangeLocks {
    /// Holds blocks [first, end) once no held range overlaps them.
    pub fn lock(&self, first: u64, end: u64) -> RangeGuard<'_> {
        let mut held = self.held.lock();
        while held.iter().any(|&(s, e)| s < end && first < e) {
            self.freed.wait(&mut held);
        }
        held.push((first, end));
        RangeGuard { locks: self, range: (first, end) }
    }

    /// Holds blocks [first, end) if no held range overlaps them; the caller frees them with
    /// [`RangeLocks::unlock`].
    pub(crate) fn try_hold(&self, first: u64, end: u64) -> bool {
        let mut held = self.held.lock();
        let free = !held.iter().any(|&(s, e)| s < end && first < e);
        if free {
            held.push((first, end));
        }
        free
    }

    pub(crate) fn unlock(&self, range: (u64, u64)) {
        let mut held = self.held.lock();
        if let Some(i) = held.iter().position(|r| *r == range) {
            held.swap_remove(i);
        }
        drop(held);
        self.freed.notify_all();
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks.unlock(self.range);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn overlapping_ranges_wait_and_disjoint_ones_do_not() {
        let l = Arc::new(RangeLocks::default());
        let a = l.lock(10, 20);
        // Disjoint: at once (touching ends do not overlap).
        drop(l.lock(20, 30));
        drop(l.lock(0, 10));
        let waiter = {
            let l = Arc::clone(&l);
            std::thread::spawn(move || drop(l.lock(15, 16)))
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(!waiter.is_finished(), "an overlapping range did not wait");
        drop(a);
        waiter.join().unwrap();
        assert!(l.held.lock().is_empty());
    }
}
