//! The context every part of the engine shares: the store, the metadata, the superblock and
//! options, the in-memory state behind its lock, read pins, counters, the pool's health, and
//! the wake-ups by which one part asks another for work (a checkpoint, a cleaning run) or
//! waits for it (space freed). It holds no part's handle: the write path's log, the cleaner
//! and readahead are passed explicitly to what needs them (see `pool.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::error::{Error, ErrorKind, Result};
use crate::format::Superblock;
use crate::io::{Backend, BackendKind};
use crate::map::segments::ReadPins;
use crate::meta::Meta;
use crate::state::State;

/// Tunables of an open pool. Geometry (segment size) is fixed when the pool is created.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Segment size for a new pool (default 32 MiB; a multiple of 4 KiB, at least 64 KiB).
    pub segment_size: u64,
    /// Free segments kept back from client writes so trims (and the cleaner) can always run
    /// (default 2).
    pub reserve_segments: usize,
    /// Most data bytes in one log batch (default 4 MiB; capped at half a segment).
    pub max_batch_bytes: usize,
    /// A checkpoint is taken at least this often while there are changes (default 5 s).
    pub checkpoint_interval: Duration,
    /// ... and after this many bytes of log (default 1 GiB), bounding recovery time.
    pub checkpoint_bytes: u64,
    /// Backend for file- and device-backed pools (default io_uring, falling back to syscalls).
    pub backend: BackendKind,
    /// Run the cleaner in the background when free space runs low (default on).
    pub background_cleaner: bool,
    /// Thin overcommit cap: the volumes' provisioned sizes may add up to at most this many
    /// times the pool's data area (None: no cap). Creating, growing or cloning past it fails
    /// with NoSpace.
    pub overcommit_ratio: Option<f64>,
    /// How long acknowledged small writes may wait in memory, gathered into one log batch,
    /// before they are written (default 1 ms). Flushes and FUA writes never wait; zero writes
    /// every batch before acknowledging it.
    pub write_delay: Duration,
    /// How often the background cleaner looks at free space (default 200 ms; the writer also
    /// wakes it when it takes a segment and few are left).
    pub cleaner_interval: Duration,
    /// Most bytes read ahead of a sequential reader (default 2 MiB; 0 turns readahead off).
    pub readahead: u64,
    /// The cleaner's moves go to a head of their own, apart from client writes (default on;
    /// off only to measure what the separation buys).
    pub cold_head: bool,
    /// Whether freed segments are given back to the store (default: only on a sparse file).
    pub discard: Discard,
    /// Once no client request has come for this long, the cleaner compacts mostly-dead
    /// segments ahead of need, so a later burst of writes finds free space instead of paying
    /// for cleaning (default 2 s; None: it cleans only when free space runs low).
    pub idle_cleaning: Option<Duration>,
}

/// Whether freed segments are discarded: holes punched in a pool file, BLKDISCARD on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Discard {
    /// Only where the pool is a sparse file (its filesystem gets the space back); a
    /// preallocated file and a device keep their blocks.
    #[default]
    Auto,
    /// Always: an SSD under a device pool learns which blocks it may erase ahead of time.
    On,
    /// Never.
    Off,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            segment_size: 32 << 20,
            reserve_segments: 2,
            max_batch_bytes: 4 << 20,
            checkpoint_interval: Duration::from_secs(5),
            checkpoint_bytes: 1 << 30,
            backend: BackendKind::Uring,
            background_cleaner: true,
            overcommit_ratio: None,
            cleaner_interval: Duration::from_millis(200),
            write_delay: Duration::from_millis(1),
            readahead: 2 << 20,
            cold_head: true,
            discard: Discard::Auto,
            idle_cleaning: Some(Duration::from_secs(2)),
        }
    }
}

/// Injection points for crash tests: when armed, the pool fails there as if the machine died.
/// Always compiled (an unarmed point costs one relaxed load, a few times per batch): a cargo
/// feature for them made test builds resolve the engine differently from `cargo build`, which
/// then rebuilt every crate above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// After the store is synced, before the checkpoint's metadata commit.
    CheckpointBeforeCommit,
    /// After the metadata commit, before freed segments are released.
    CheckpointAfterCommit,
    /// Before the open batch's write reaches the store (its writes were acknowledged).
    TailBeforeWrite,
    /// A new head segment taken, before its chain record is written.
    RoomBeforeChain,
    /// A cleaning step read its victim's blocks, before it moves them.
    CleanerBeforeMove,
}

/// A wake-up for a background thread: raised by anyone, or stopped for good.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    /// (stopped, raised)
    flags: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Signal {
    pub fn raise(&self) {
        self.flags.lock().1 = true;
        self.cv.notify_one();
    }

    pub fn stop(&self) {
        self.flags.lock().0 = true;
        self.cv.notify_one();
    }

    pub fn stopped(&self) -> bool {
        self.flags.lock().0
    }

    /// Waits until raised or `timeout` (not at all when `now`); true once stopped. Clears a raise.
    pub fn wait(&self, timeout: Duration, now: bool) -> bool {
        let mut f = self.flags.lock();
        if !f.0 && !f.1 && !now {
            self.cv.wait_for(&mut f, timeout);
        }
        f.1 = false;
        f.0
    }
}

/// Counts the checkpoints that freed segments; writes waiting for room sleep on it.
#[derive(Debug, Default)]
pub(crate) struct Freed {
    count: Mutex<u64>,
    cv: Condvar,
}

impl Freed {
    pub fn space_freed(&self) {
        *self.count.lock() += 1;
        self.cv.notify_all();
    }

    /// How many times space has been freed so far (pass it to [`Self::wait`]).
    pub fn count(&self) -> u64 {
        *self.count.lock()
    }

    /// Waits until space is freed after `seen` (see [`Self::count`]), or `timeout`.
    pub fn wait(&self, seen: u64, timeout: Duration) {
        let mut n = self.count.lock();
        if *n == seen {
            self.cv.wait_for(&mut n, timeout);
        }
    }
}

/// How parts ask one another for work.
#[derive(Debug, Default)]
pub(crate) struct Wakes {
    /// Take a checkpoint soon (log volume, segments to release).
    pub checkpoint: Signal,
    /// Free space is low: the background cleaner should look.
    pub cleaner: Signal,
    /// A checkpoint freed segments.
    pub freed: Freed,
}

pub(crate) struct Ctx {
    pub backend: Arc<dyn Backend>,
    pub meta: Meta,
    pub sb: Superblock,
    pub opts: PoolOptions,
    pub state: RwLock<State>,
    pub pins: ReadPins,
    /// Serialises catalog changes with checkpoints.
    pub meta_lock: Mutex<()>,
    pub failed: AtomicBool,
    pub closed: AtomicBool,
    /// Per-block locks of partial-block writes (read-modify-write of their edges).
    pub stripes: Box<[Mutex<()>]>,
    /// Armed fault points (tests only); `faults_armed` says whether to look.
    pub faults: Mutex<Vec<FaultPoint>>,
    pub faults_armed: AtomicBool,
    pub client_bytes: AtomicU64,
    pub media_bytes: AtomicU64,
    /// Client requests so far (reads, writes, trims): the pool is idle while it stands still.
    pub client_ops: AtomicU64,
    /// Blocks read whose checksum did not match (reads and the cleaner; each failed with Corrupt).
    pub checksum_errors: AtomicU64,
    /// Most data blocks in one batch.
    pub max_batch_blocks: u64,
    /// Freed segments are discarded (see [`Discard`]).
    pub discard_freed: bool,
    pub wake: Wakes,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("uuid", &self.sb.uuid).finish_non_exhaustive()
    }
}

impl Ctx {
    pub fn new(backend: Arc<dyn Backend>, meta: Meta, sb: Superblock, opts: PoolOptions, state: State) -> Self {
        let max_batch_blocks = (opts.max_batch_bytes.min(usize::try_from(sb.segment_size / 2).unwrap_or(usize::MAX))
            / crate::io::BLOCK)
            .max(1) as u64;
        let discard_freed = match opts.discard {
            Discard::Auto => backend.sparse(),
            Discard::On => true,
            Discard::Off => false,
        };
        Self {
            discard_freed,
            backend,
            meta,
            sb,
            state: RwLock::new(state),
            pins: ReadPins::new(sb.segment_count),
            meta_lock: Mutex::new(()),
            failed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            stripes: (0..256).map(|_| Mutex::new(())).collect(),
            faults: Mutex::new(Vec::new()),
            faults_armed: AtomicBool::new(false),
            client_bytes: AtomicU64::new(0),
            media_bytes: AtomicU64::new(0),
            client_ops: AtomicU64::new(0),
            checksum_errors: AtomicU64::new(0),
            max_batch_blocks,
            wake: Wakes::default(),
            opts,
        }
    }

    pub fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(closed());
        }
        if self.failed.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Closed, "pool stopped after a media failure; reopen it to recover"));
        }
        Ok(())
    }

    pub fn poison(&self, why: &Error) {
        if !self.failed.swap(true, Ordering::AcqRel) {
            tracing::error!(error = %why, "pool failed; every further write is refused until it is reopened");
        }
    }

    /// Fails (and poisons the pool) if `point` is armed.
    #[inline]
    pub fn fault(&self, point: FaultPoint) -> Result<()> {
        if self.faults_armed.load(Ordering::Relaxed) && self.faults.lock().contains(&point) {
            let e = Error::new(ErrorKind::Io, format!("injected fault at {point:?}"));
            self.poison(&e);
            return Err(e);
        }
        Ok(())
    }

    /// Syncs the store so that everything written so far is durable; a failure poisons the pool.
    pub fn sync_store(&self) -> Result<()> {
        // The chain records of segment moves are part of what a sync promises: without them,
        // recovery would not find the batches written in the new segments.
        let r = self
            .backend
            .sync()
            .map_err(|e| Error::io("syncing the pool store", e))
            .and_then(|()| self.meta.sync_chain());
        r.inspect_err(|e| self.poison(e))
    }

    /// Free segments below which the background cleaner runs: two above the reserve. Kept small
    /// and independent of pool size: every segment held free is one the dead space cannot use,
    /// which raises the live fraction of the victims and with it write amplification (on a
    /// 1 GiB pool of 4 MiB segments at 80% full, each segment held costs about 0.1 of it);
    /// pacing, not a large free pool, is what keeps writes going while the cleaner catches up.
    pub fn low_water(&self) -> u64 {
        self.opts.reserve_segments as u64 + 2
    }
}

pub(crate) fn closed() -> Error {
    Error::new(ErrorKind::Closed, "pool is closed")
}
