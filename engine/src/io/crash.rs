//! The crash-simulating backend.
//!
//! It keeps two images: what readers see now, and what has been made durable by `sync`. Writes
//! since the last sync are remembered in order. [`CrashBackend::crash`] freezes the store (every
//! later I/O fails, as on a machine that lost power) and [`CrashBackend::restart`] builds the
//! post-crash image: the durable one plus an arbitrary subset of the unsynced writes, where a
//! multi-block write may keep only some of its blocks (a torn write). The choice is driven by a
//! seed, so a failing case replays exactly.

use std::io;

use parking_lot::Mutex;

use super::{BLOCK, Backend, check_request};
use crate::rng::Rng;

/// What happens to unsynced writes in a simulated crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// Each unsynced write is kept, dropped, or torn (some of its blocks kept), at random.
    Random(u64),
    /// Every unsynced write is lost.
    DropAll,
    /// Every unsynced write survives.
    KeepAll,
}

#[derive(Debug)]
struct State {
    current: Vec<u8>,
    durable: Vec<u8>,
    unsynced: Vec<(u64, Vec<u8>)>,
    crashed: bool,
    reads: u64,
    writes: u64,
    syncs: u64,
    discards: u64,
    fail_after_writes: Option<u64>,
}

/// Operation counts of a [`CrashBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoCounters {
    pub reads: u64,
    pub writes: u64,
    pub syncs: u64,
    pub discards: u64,
}

/// An in-memory store that can lose its unsynced writes the way a real disk does.
#[derive(Debug)]
pub struct CrashBackend {
    state: Mutex<State>,
    len: u64,
}

fn crashed() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "simulated crash: the store is gone")
}

impl CrashBackend {
    /// A zero-filled store of `len` bytes.
    pub fn new(len: u64) -> Self {
        let n = usize::try_from(len).expect("in-memory store fits the address space");
        let state = State {
            current: vec![0; n],
            durable: vec![0; n],
            unsynced: Vec::new(),
            crashed: false,
            reads: 0,
            writes: 0,
            syncs: 0,
            discards: 0,
            fail_after_writes: None,
        };
        Self { state: Mutex::new(state), len }
    }

    /// Simulates power loss now: every later read, write and sync fails until [`Self::restart`].
    pub fn crash(&self) {
        self.state.lock().crashed = true;
    }

    /// Crashes automatically once `n` more writes have completed (a fault injection point).
    pub fn crash_after_writes(&self, n: u64) {
        let mut s = self.state.lock();
        s.fail_after_writes = Some(s.writes + n);
    }

    /// Builds the post-crash image from the durable one and a subset of the unsynced writes, and
    /// makes the store usable again. Returns how many unsynced writes were dropped or torn.
    pub fn restart(&self, mode: CrashMode) -> usize {
        let mut s = self.state.lock();
        let mut image = s.durable.clone();
        let mut rng = Rng::new(match mode {
            CrashMode::Random(seed) => seed,
            _ => 0,
        });
        let mut damaged = 0;
        for (off, data) in std::mem::take(&mut s.unsynced) {
            let off = usize::try_from(off).expect("offset within the store");
            let keep_all = match mode {
                CrashMode::KeepAll => true,
                CrashMode::DropAll => false,
                CrashMode::Random(_) => match rng.below(3) {
                    0 => true,
                    1 => false,
                    _ => {
                        // Torn: each block independently kept or lost.
                        for (i, block) in data.chunks(BLOCK).enumerate() {
                            if rng.below(2) == 0 {
                                let at = off + i * BLOCK;
                                image[at..at + block.len()].copy_from_slice(block);
                            }
                        }
                        damaged += 1;
                        continue;
                    }
                },
            };
            if keep_all {
                image[off..off + data.len()].copy_from_slice(&data);
            } else {
                damaged += 1;
            }
        }
        s.current = image.clone();
        s.durable = image;
        s.crashed = false;
        s.fail_after_writes = None;
        damaged
    }

    /// Number of completed reads, writes and syncs so far.
    pub fn counters(&self) -> IoCounters {
        let s = self.state.lock();
        IoCounters { reads: s.reads, writes: s.writes, syncs: s.syncs, discards: s.discards }
    }

    /// Overwrites bytes of the current and durable images directly (simulated media corruption).
    pub fn corrupt(&self, offset: u64, bytes: &[u8]) {
        let mut s = self.state.lock();
        let off = usize::try_from(offset).expect("offset within the store");
        s.current[off..off + bytes.len()].copy_from_slice(bytes);
        s.durable[off..off + bytes.len()].copy_from_slice(bytes);
    }
}

impl Backend for CrashBackend {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_request(buf.len(), offset, self.len, buf.as_ptr())?;
        let mut s = self.state.lock();
        if s.crashed {
            return Err(crashed());
        }
        s.reads += 1;
        let off = usize::try_from(offset).expect("checked against the length");
        buf.copy_from_slice(&s.current[off..off + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_request(buf.len(), offset, self.len, buf.as_ptr())?;
        let mut s = self.state.lock();
        if s.crashed {
            return Err(crashed());
        }
        if s.fail_after_writes.is_some_and(|n| s.writes >= n) {
            s.crashed = true;
            return Err(crashed());
        }
        let off = usize::try_from(offset).expect("checked against the length");
        s.current[off..off + buf.len()].copy_from_slice(buf);
        s.unsynced.push((offset, buf.to_vec()));
        s.writes += 1;
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut s = self.state.lock();
        if s.crashed {
            return Err(crashed());
        }
        for (off, data) in std::mem::take(&mut s.unsynced) {
            let off = usize::try_from(off).expect("offset within the store");
            s.durable[off..off + data.len()].copy_from_slice(&data);
        }
        s.syncs += 1;
        Ok(())
    }

    /// Like a device that drops discarded blocks at once (an SSD after TRIM): the range reads as
    /// zeros from now on, crash or not. Unsynced writes into it stay unsynced writes.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut s = self.state.lock();
        if s.crashed {
            return Err(crashed());
        }
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "discard past the end of the store"));
        }
        let at = usize::try_from(offset).expect("offset within the store");
        let n = usize::try_from(len).expect("length within the store");
        s.current[at..at + n].fill(0);
        s.durable[at..at + n].fill(0);
        s.discards += 1;
        Ok(())
    }
}
