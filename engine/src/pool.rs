//! The pool: opening and creating, the catalog of volumes, space accounting, shutdown.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};

use crate::error::{Error, ErrorKind, Result, invalid};
use crate::format::{DATA_START, FORMAT_VERSION, Superblock};
use crate::io::{AlignedBuf, BLOCK, Backend, BackendKind, SyncFileBackend, UringBackend};
use crate::maint::checkpoint::CheckpointCtl;
use crate::maint::cleaner::{CleanReport, CleanerCtl};
use crate::map::segments::{ReadPins, SegState};
use crate::meta::{CheckpointRecord, Meta};
use crate::read::readahead::Readahead;
use crate::recovery::RecoveryReport;
use crate::state::State;
use crate::write::queue::LogQueue;
use crate::write::req::Req;

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
        }
    }
}

/// Space and log state of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    pub uuid: uuid::Uuid,
    /// Bytes of data area (segments) in the pool.
    pub size: u64,
    /// Bytes of log in segments that are not free (the open segment counted as far as written).
    pub used: u64,
    /// Bytes of free segments usable by client writes (the reserve excluded).
    pub free: u64,
    /// Bytes of blocks some volume maps.
    pub live: u64,
    /// Bytes in sealed segments that nothing maps: what a cleaner can give back.
    pub reclaimable: u64,
    pub segment_size: u64,
    pub segments: u64,
    pub segments_free: u64,
    pub volumes: usize,
    /// Next batch sequence number and the current generation (pool opens).
    pub log_seq: u64,
    pub generation: u64,
    /// Bytes clients wrote, and bytes the log wrote to media (headers included).
    pub client_bytes_written: u64,
    pub media_bytes_written: u64,
    /// The cleaner: running now, runs so far, segments cleaned and bytes it moved (since open).
    pub cleaner_active: bool,
    pub cleaner_runs: u64,
    pub cleaner_segments_cleaned: u64,
    pub cleaner_bytes_moved: u64,
    /// Bytes read ahead for sequential readers, and bytes reads took from what was read ahead.
    pub readahead_bytes: u64,
    pub readahead_hit_bytes: u64,
}

/// Injection points for crash tests: when armed, the pool fails there as if the machine died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// After the store is synced, before the checkpoint's metadata commit.
    CheckpointBeforeCommit,
    /// After the metadata commit, before freed segments are released.
    CheckpointAfterCommit,
}

pub(crate) struct Inner {
    pub backend: Arc<dyn Backend>,
    pub meta: Meta,
    pub sb: Superblock,
    pub opts: PoolOptions,
    pub state: RwLock<State>,
    pub pins: ReadPins,
    /// Serialises catalog changes with checkpoints.
    pub meta_lock: Mutex<()>,
    pub log: LogQueue,
    pub failed: AtomicBool,
    pub closed: AtomicBool,
    pub stripes: Box<[Mutex<()>]>,
    pub ckpt: CheckpointCtl,
    pub cleaner: CleanerCtl,
    pub faults: Mutex<Vec<FaultPoint>>,
    pub client_bytes: AtomicU64,
    pub media_bytes: AtomicU64,
    pub max_batch_blocks: u64,
    pub recovery: RecoveryReport,
    pub readahead: Readahead,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("uuid", &self.sb.uuid).finish_non_exhaustive()
    }
}

impl Inner {
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
    pub fn fault(&self, point: FaultPoint) -> Result<()> {
        if self.faults.lock().contains(&point) {
            let e = Error::new(ErrorKind::Io, format!("injected fault at {point:?}"));
            self.poison(&e);
            return Err(e);
        }
        Ok(())
    }

    /// Hands a request to the log (see `log.rs`); if the pool is closed, completes it with an
    /// error.
    pub fn send(&self, req: Req) -> Result<()> {
        self.send_all(vec![req])
    }

    /// As [`Inner::send`] for several requests, which may then share a batch.
    pub fn send_all(&self, reqs: Vec<Req>) -> Result<()> {
        crate::write::queue::submit(self, reqs).map_err(|unsent| {
            let e = closed();
            unsent.into_iter().for_each(|r| r.fail(&e));
            e
        })
    }
}

fn closed() -> Error {
    Error::new(ErrorKind::Closed, "pool is closed")
}

/// An open pool. Dropping it shuts it down cleanly (as [`Pool::close`], errors logged).
#[derive(Debug)]
pub struct Pool {
    pub(crate) inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

pub(crate) fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn open_backend(path: &Path, kind: BackendKind) -> Result<Arc<dyn Backend>> {
    let ctx = || format!("opening pool store {}", path.display());
    if kind == BackendKind::Uring {
        match UringBackend::open(path) {
            Ok(b) => return Ok(Arc::new(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Error::io(ctx(), e)),
            Err(e) => tracing::warn!(error = %e, "io_uring unavailable, using pread/pwrite"),
        }
    }
    Ok(Arc::new(SyncFileBackend::open(path).map_err(|e| Error::io(ctx(), e))?))
}

impl Pool {
    /// Creates a new file-backed pool of `size` bytes (a sparse file) and opens it. Refuses to
    /// touch an existing file. `path` may also name a block device, whose size is used.
    pub fn create(path: &Path, meta_dir: &Path, size: u64, opts: PoolOptions) -> Result<Pool> {
        let is_device = std::fs::metadata(path).map(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_block_device()
        });
        match is_device {
            Ok(true) => {}
            Ok(false) => {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("{} exists; refusing to overwrite it with a new pool", path.display()),
                ));
            }
            Err(_) => {
                // Volume data is the daemon's alone: the file is created private (0600).
                let f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                    .map_err(|e| Error::io(format!("creating pool file {}", path.display()), e))?;
                f.set_len(size).map_err(|e| Error::io(format!("sizing pool file {}", path.display()), e))?;
            }
        }
        let backend = open_backend(path, opts.backend)?;
        Self::create_on(backend, meta_dir, opts)
    }

    /// Opens an existing file- or device-backed pool.
    pub fn open(path: &Path, meta_dir: &Path, opts: PoolOptions) -> Result<Pool> {
        let backend = open_backend(path, opts.backend)?;
        Self::open_on(backend, meta_dir, opts)
    }

    /// Formats `backend` as a new pool with its metadata in `meta_dir`, and opens it.
    pub fn create_on(backend: Arc<dyn Backend>, meta_dir: &Path, opts: PoolOptions) -> Result<Pool> {
        let seg = opts.segment_size;
        crate::format::check_geometry(seg, 1).map_err(invalid)?;
        let count = (backend.len().saturating_sub(DATA_START) / seg).min(crate::format::MAX_POOL_BYTES / seg);
        let min = opts.reserve_segments as u64 + 2;
        if count < min {
            return Err(invalid(format!(
                "store of {} bytes is too small: it holds {count} segments of {seg} bytes, and a pool needs at least {min}",
                backend.len()
            )));
        }
        let sb = Superblock {
            version: FORMAT_VERSION,
            uuid: uuid::Uuid::new_v4().into_bytes(),
            segment_size: seg,
            segment_count: count,
            created_unix: now_unix(),
        };
        let first = CheckpointRecord { seq: 1, seg: 0, off: 0, generation: 1 };
        Meta::create(meta_dir, &sb.uuid, first)?;
        let mut block = AlignedBuf::new(BLOCK);
        block.copy_from_slice(&sb.encode());
        backend.write_at(&block, 0).map_err(|e| Error::io("writing the superblock", e))?;
        backend.sync().map_err(|e| Error::io("syncing the superblock", e))?;
        Self::open_on(backend, meta_dir, opts)
    }

    /// Opens the pool on `backend`: verifies the superblock, loads the last checkpoint, replays
    /// the log after it and writes a fresh checkpoint. Nothing is written before the superblock
    /// and metadata have been verified.
    pub fn open_on(backend: Arc<dyn Backend>, meta_dir: &Path, opts: PoolOptions) -> Result<Pool> {
        if backend.len() < DATA_START {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("store is {} bytes, too small to hold a Ferrite pool", backend.len()),
            ));
        }
        let mut block = AlignedBuf::new(BLOCK);
        backend.read_at(&mut block, 0).map_err(|e| Error::io("reading the superblock", e))?;
        let sb = Superblock::decode(&block)?;
        if backend.len() < sb.required_len() {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "pool store is truncated: the superblock describes {} bytes but the store has {}",
                    sb.required_len(),
                    backend.len()
                ),
            ));
        }
        let meta = Meta::open(meta_dir)?;
        if meta.uuid()?.as_deref() != Some(&sb.uuid[..]) {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("metadata store {} belongs to another pool (uuid mismatch)", meta_dir.display()),
            ));
        }
        let (state, report) = crate::recovery::recover(&meta, backend.as_ref(), &sb)?;
        let max_batch_blocks = (opts.max_batch_bytes.min(usize::try_from(sb.segment_size / 2).unwrap_or(usize::MAX))
            / BLOCK)
            .max(1) as u64;
        let inner = Arc::new(Inner {
            backend,
            meta,
            sb,
            state: RwLock::new(state),
            pins: ReadPins::new(sb.segment_count),
            meta_lock: Mutex::new(()),
            log: LogQueue::default(),
            failed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            stripes: (0..256).map(|_| Mutex::new(())).collect(),
            ckpt: CheckpointCtl::default(),
            cleaner: CleanerCtl::default(),
            faults: Mutex::new(Vec::new()),
            client_bytes: AtomicU64::new(0),
            media_bytes: AtomicU64::new(0),
            max_batch_blocks,
            recovery: report,
            readahead: Readahead::default(),
            opts,
        });
        // A fresh checkpoint before any write: replayed state becomes durable, stale chain
        // records go, and the new generation fences off anything a crash left past the end.
        inner.checkpoint()?;
        inner.meta.clear_chain()?;
        let spawn = |name: &str, what: &str, run: fn(&Arc<Inner>)| {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || run(&inner))
                .map_err(|e| Error::io(format!("starting the {what} thread"), e))
        };
        let mut threads = vec![spawn("ferrite-ckpt", "checkpoint", crate::maint::checkpoint::checkpointer_loop)?];
        if !inner.opts.write_delay.is_zero() {
            threads.push(spawn("ferrite-flush", "log flusher", crate::write::tail::flusher_loop)?);
        }
        if inner.opts.background_cleaner {
            threads.push(spawn("ferrite-cleaner", "cleaner", crate::maint::cleaner::cleaner_loop)?);
        }
        if inner.opts.readahead > 0 {
            for _ in 0..crate::read::readahead::THREADS {
                threads.push(spawn("ferrite-readahead", "readahead", crate::read::readahead::readahead_loop)?);
            }
        }
        Ok(Pool { inner, threads: Mutex::new(threads) })
    }

    /// What recovery found when this pool was opened.
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.inner.recovery
    }

    /// Makes every acknowledged write durable.
    pub fn flush(&self) -> Result<()> {
        crate::volume::flush(&self.inner)
    }

    /// Takes a checkpoint now.
    pub fn checkpoint(&self) -> Result<()> {
        self.inner.checkpoint()
    }

    /// Runs the cleaner now: moves live data out of every segment with dead space worth taking
    /// back (live fraction up to 95%) and frees those segments. Blocks until done.
    pub fn reclaim(&self) -> Result<CleanReport> {
        self.inner.check_open()?;
        self.inner.clean(0.95, false, |_, _| true)
    }

    /// Arms a fault injection point (crash tests).
    pub fn inject_fault(&self, point: FaultPoint) {
        self.inner.faults.lock().push(point);
    }

    /// Space, log and traffic figures.
    pub fn stats(&self) -> PoolStats {
        let inner = &self.inner;
        let st = inner.state.read();
        let seg = inner.sb.segment_size;
        let free_segs = st.segs.count(SegState::Free) as u64;
        let reclaimable: u64 =
            st.segs.segs.iter().filter(|s| s.state == SegState::Sealed).map(|s| seg - s.live * BLOCK as u64).sum();
        // The open head segment counts only as far as it is written.
        let head = &st.segs.segs[st.applied.seg];
        let head_unwritten = if head.state == SegState::Open { seg - st.applied.off } else { 0 };
        PoolStats {
            uuid: uuid::Uuid::from_bytes(inner.sb.uuid),
            size: seg * inner.sb.segment_count,
            used: (inner.sb.segment_count - free_segs) * seg - head_unwritten,
            free: free_segs.saturating_sub(inner.opts.reserve_segments as u64) * seg,
            live: st.segs.live_blocks() * BLOCK as u64,
            reclaimable,
            segment_size: seg,
            segments: inner.sb.segment_count,
            segments_free: free_segs,
            volumes: st.volumes.len(),
            log_seq: st.applied.seq,
            generation: st.generation,
            client_bytes_written: inner.client_bytes.load(Ordering::Relaxed),
            media_bytes_written: inner.media_bytes.load(Ordering::Relaxed),
            cleaner_active: inner.cleaner.stats.active.load(Ordering::Relaxed),
            cleaner_runs: inner.cleaner.stats.runs.load(Ordering::Relaxed),
            cleaner_segments_cleaned: inner.cleaner.stats.segments_cleaned.load(Ordering::Relaxed),
            cleaner_bytes_moved: inner.cleaner.stats.blocks_moved.load(Ordering::Relaxed) * BLOCK as u64,
            readahead_bytes: inner.readahead.read_bytes.load(Ordering::Relaxed),
            readahead_hit_bytes: inner.readahead.hit_bytes.load(Ordering::Relaxed),
        }
    }

    /// Drains the log, takes a final checkpoint and stops the pool's threads.
    pub fn close(self) -> Result<()> {
        self.shutdown()
    }

    /// As [`Pool::close`], for a pool shared behind an `Arc`: every later call fails with
    /// `Closed`. Calling it again does nothing.
    pub fn shutdown(&self) -> Result<()> {
        let threads = std::mem::take(&mut *self.threads.lock());
        if threads.is_empty() {
            return Ok(());
        }
        self.inner.cleaner.stop();
        // A cleaning run in progress finishes its step (it holds `running`) before the log closes.
        drop(self.inner.cleaner.running.lock());
        self.inner.log.close();
        self.inner.log.tail.stop();
        self.inner.ckpt.stop();
        self.inner.readahead.stop();
        for t in threads {
            let _ = t.join();
        }
        if self.inner.failed.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Closed, "pool had failed; closed without a final checkpoint"));
        }
        let r = self.inner.checkpoint();
        self.inner.closed.store(true, Ordering::Release);
        r
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::debug!(error = %e, "pool closed with an error");
        }
    }
}
