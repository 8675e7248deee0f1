//! A volume's write gate: every client write enters it, and closing it (making the volume
//! read-only) waits for the writes already inside. So once [`WriteGate::close`] returns, every
//! write that will ever be acknowledged is in the log, and a snapshot taken then holds them all:
//! what a demoted replication primary relies on for its final delta.
//!
//! The gate also holds the volume's [`Mirror`], if it has synchronous replicas: every handle
//! that writes through the gate sees a mirror set or cleared at once, and its [`Fill`] while a
//! restore fills it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use parking_lot::RwLock;

use crate::fill::Fill;
use crate::mirror::{Mirror, RangeLocks};

#[derive(Debug, Default)]
pub(crate) struct WriteGate {
    closed: AtomicBool,
    inside: AtomicU64,
    mirror: RwLock<Option<Arc<dyn Mirror>>>,
    fill: RwLock<Option<Arc<dyn Fill>>>,
    /// Overlapping writes of a mirrored volume (or one whose data key is being replaced), one
    /// at a time.
    pub ranges: RangeLocks,
    /// Held (shared) by every client request while it runs; a data-key rotation takes it
    /// alone to start, so no request encrypted with the old key lands in the new key's layer.
    pub rekey: RwLock<()>,
    /// A data-key rotation is copying blocks: client requests take their range's lock.
    pub rekeying: AtomicBool,
}

/// A write inside the gate; leaving drops it.
#[derive(Debug)]
pub(crate) struct Inside(Arc<WriteGate>);

impl Drop for Inside {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, SeqCst);
    }
}

/// Blocks of a mirrored volume held by a write that another thread finishes; dropping it frees
/// them (the owned form of [`crate::mirror::RangeGuard`]).
#[derive(Debug)]
pub(crate) struct HeldRange(Arc<WriteGate>, (u64, u64));

impl Drop for HeldRange {
    fn drop(&mut self) {
        self.0.ranges.unlock(self.1);
    }
}

impl WriteGate {
    /// Holds blocks [first, end) unless a request in flight holds one of them.
    pub fn try_hold(self: &Arc<Self>, first: u64, end: u64) -> Option<HeldRange> {
        self.ranges.try_hold(first, end).then(|| HeldRange(Arc::clone(self), (first, end)))
    }

    pub fn new(closed: bool) -> Arc<Self> {
        Arc::new(Self { closed: AtomicBool::new(closed), ..Self::default() })
    }

    pub fn mirror(&self) -> Option<Arc<dyn Mirror>> {
        self.mirror.read().clone()
    }

    pub fn set_mirror(&self, mirror: Option<Arc<dyn Mirror>>) {
        *self.mirror.write() = mirror;
    }

    pub fn fill(&self) -> Option<Arc<dyn Fill>> {
        self.fill.read().clone()
    }

    pub fn set_fill(&self, fill: Option<Arc<dyn Fill>>) {
        *self.fill.write() = fill;
    }

    /// Lets a write in; None while the gate is closed.
    pub fn enter(self: &Arc<Self>) -> Option<Inside> {
        // Announce first, then look: with `close` storing first and then looking (both SeqCst),
        // either the writer sees the gate closed or `close` sees the writer inside.
        self.inside.fetch_add(1, SeqCst);
        let inside = Inside(Arc::clone(self));
        (!self.closed.load(SeqCst)).then_some(inside)
    }

    /// Whether client requests must lock their ranges (a rotation is copying blocks).
    pub fn is_rekeying(&self) -> bool {
        self.rekeying.load(SeqCst)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(SeqCst)
    }

    /// Closes the gate and waits until no write is inside. Writes are bounded (a write waits at
    /// most for the cleaner's patience), so this ends.
    pub fn close(&self) {
        self.closed.store(true, SeqCst);
        while self.inside.load(SeqCst) != 0 {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    pub fn open(&self) {
        self.closed.store(false, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_waits_for_writes_inside_and_refuses_new_ones() {
        let g = WriteGate::new(false);
        let w = g.enter().expect("open");
        let closer = {
            let g = Arc::clone(&g);
            std::thread::spawn(move || g.close())
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!closer.is_finished(), "close returned with a write inside");
        assert!(g.enter().is_none(), "a write entered a closing gate");
        drop(w);
        closer.join().unwrap();
        assert!(g.is_closed() && g.enter().is_none());
        g.open();
        assert!(g.enter().is_some());
    }
}
