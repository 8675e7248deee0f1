//! The pool: opening and creating, the catalog of volumes, space accounting, shutdown.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::ctx::{Ctx, PoolOptions};
use crate::error::{Error, ErrorKind, Result, invalid};
use crate::format::{DATA_START, FORMAT_VERSION, SUPER_COPY_AT, Superblock};
use crate::io::{AlignedBuf, BLOCK, Backend, BackendKind, SyncFileBackend, UringBackend};
use crate::maint::checkpoint::{self, checkpointer_loop};
use crate::maint::cleaner::{self, CleanReport, Cleaner, Room, cleaner_loop};
use crate::map::segments::SegState;
use crate::meta::{CatalogOp, CheckpointRecord, Meta};
use crate::read::readahead::{self, Readahead, readahead_loop};
use crate::recovery::RecoveryReport;
use crate::write::Log;
use crate::write::tail::{self, FLIGHTS, flusher_loop};
use crate::write::tailfile::TailFile;

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
    /// Bytes the volumes provision (their sizes), and the most they may under the thin
    /// overcommit cap (None: no cap).
    pub provisioned: u64,
    pub provision_cap: Option<u64>,
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
    /// The pool stopped after a media failure: it refuses writes until it is reopened.
    pub failed: bool,
    /// Blocks read (by clients or the cleaner) whose checksum did not match, since open.
    pub checksum_errors: u64,
    /// Bytes read ahead for sequential readers, and bytes reads took from what was read ahead.
    pub readahead_bytes: u64,
    pub readahead_hit_bytes: u64,
    /// The segment client writes go to, and the one the cleaner's moves go to (if open).
    pub head_segment: u64,
    pub cold_segment: Option<u64>,
}

/// The open pool's parts: the shared context and the handles of the write path, the cleaner
/// and readahead. Each background thread gets only the parts it uses; the catalog operations
/// (`ops/`) and volume handles reach everything through this. Derefs to the context.
pub(crate) struct Inner {
    pub ctx: Arc<Ctx>,
    pub log: Arc<Log>,
    pub cleaner: Arc<Cleaner>,
    pub readahead: Arc<Readahead>,
    pub recovery: RecoveryReport,
}

impl std::ops::Deref for Inner {
    type Target = Ctx;
    fn deref(&self) -> &Ctx {
        &self.ctx
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.ctx.fmt(f)
    }
}

impl Inner {
    /// The most bytes the volumes may provision (None: no thin overcommit cap).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // a ratio >= 1; `as` saturates
    pub(crate) fn overcommit_cap(&self) -> Option<u64> {
        let ratio = self.opts.overcommit_ratio?;
        Some(((self.sb.segment_size * self.sb.segment_count) as f64 * ratio) as u64)
    }

    /// Runs `f` on the log's leader with every earlier write applied and no later one started;
    /// `f` gets these parts again (barriers restructure layers and commit with checkpoints).
    pub fn barrier<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Inner) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = Arc::clone(self);
        self.log.barrier(&self.ctx, move |_, _| f(&me))
    }

    /// Takes a checkpoint now.
    pub fn checkpoint(&self) -> Result<()> {
        checkpoint::checkpoint(&self.ctx, &self.log, &self.readahead)
    }

    /// Takes a checkpoint that commits `catalog` with it; the caller holds `meta_lock`.
    pub fn checkpoint_locked(&self, catalog: Vec<CatalogOp>) -> Result<()> {
        checkpoint::checkpoint_locked(&self.ctx, &self.log, &self.readahead, catalog)
    }

    /// Commits a restructuring catalog change (merged or dropped layers) with a checkpoint; a
    /// failure leaves memory ahead of the store, so it poisons the pool (reopening recovers the
    /// durable state).
    pub fn commit_restructure(&self, ops: Vec<CatalogOp>) -> Result<()> {
        self.checkpoint_locked(ops).inspect_err(|e| self.poison(e))
    }
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
    use std::io::ErrorKind as ErrorKind2;
    let ctx = || format!("opening pool store {}", path.display());
    // A store in memory is read and written with plain copies (see `io::file::in_memory`).
    if kind == BackendKind::Uring && !crate::io::in_memory(path) {
        match UringBackend::open(path) {
            Ok(b) => return Ok(Arc::new(b)),
            // The store itself cannot be opened: the fallback could not either.
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind2::NotFound | ErrorKind2::ResourceBusy | ErrorKind2::PermissionDenied
                ) =>
            {
                return Err(Error::io(ctx(), e));
            }
            Err(e) => tracing::warn!(error = %e, "io_uring unavailable, using pread/pwrite"),
        }
    }
    Ok(Arc::new(SyncFileBackend::open(path).map_err(|e| Error::io(ctx(), e))?))
}

impl Pool {
    /// Creates a new file-backed pool of `size` bytes (a sparse file) and opens it. Refuses to
    /// touch an existing file. `path` may also name a block device, whose size is used.
    pub fn create(path: &Path, meta_dir: &Path, size: u64, opts: PoolOptions) -> Result<Pool> {
        Self::create_file(path, size)?;
        Self::format(path, meta_dir, opts)
    }

    /// Creates the file of a new pool, sparse and private (0600), unless `path` is a block device.
    pub fn create_file(path: &Path, size: u64) -> Result<()> {
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
        Ok(())
    }

    /// Formats an existing file or block device as a new pool, with its metadata in `meta_dir`,
    /// and opens it. Whatever `path` held is overwritten: callers check first ([`crate::io::probe`]).
    pub fn format(path: &Path, meta_dir: &Path, opts: PoolOptions) -> Result<Pool> {
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
        let first = CheckpointRecord { seq: 1, seg: 0, off: 0, generation: 1, cold: None };
        Meta::create(meta_dir, &sb.uuid, first)?;
        write_superblock(backend.as_ref(), &sb, SUPER_COPY_AT)?;
        write_superblock(backend.as_ref(), &sb, 0)?;
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
        let (sb, stale) = read_superblock(backend.as_ref())?;
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
        let tail = TailFile::open(meta_dir, tail::SLOTS, tail::BATCH_BLOCKS)?;
        let (state, mut report) = crate::recovery::recover(&meta, backend.as_ref(), &sb, &tail)?;
        // Verified and recovered: now an older format is upgraded and a damaged copy rewritten,
        // the copy first, so that one valid superblock is on the store at every moment.
        let sb = if sb.version < FORMAT_VERSION || !stale.is_empty() {
            let current = Superblock { version: FORMAT_VERSION, ..sb };
            let mut at = stale;
            if sb.version < FORMAT_VERSION {
                at = vec![SUPER_COPY_AT, 0];
                report.upgraded_from = Some(sb.version);
                tracing::info!(from = sb.version, to = FORMAT_VERSION, "upgrading the pool's format in place");
            }
            for off in at {
                write_superblock(backend.as_ref(), &current, off)?;
            }
            current
        } else {
            sb
        };
        let ctx = Arc::new(Ctx::new(backend, meta, sb, opts, state));
        let cleaner = Arc::new(Cleaner::default());
        let readahead = Arc::new(Readahead::default());
        let room = Room { cleaner: Arc::clone(&cleaner), readahead: Arc::clone(&readahead) };
        let log = Arc::new(Log::new(Box::new(room), tail.bufs()));
        let inner = Arc::new(Inner { ctx, log, cleaner, readahead, recovery: report });
        // A fresh checkpoint before any write: replayed state becomes durable, stale chain
        // records go, and the new generation fences off anything a crash left past the end.
        inner.checkpoint()?;
        inner.meta.clear_chain()?;
        // Each background thread gets the parts it uses.
        let spawn = |name: &str, what: &str, run: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(run)
                .map_err(|e| Error::io(format!("starting the {what} thread"), e))
        };
        let (ctx, log, ra) = (&inner.ctx, &inner.log, &inner.readahead);
        let mut threads = Vec::new();
        {
            let (ctx, log, ra) = (Arc::clone(ctx), Arc::clone(log), Arc::clone(ra));
            threads.push(spawn("ferrite-ckpt", "checkpoint", Box::new(move || checkpointer_loop(&ctx, &log, &ra)))?);
        }
        if !ctx.opts.write_delay.is_zero() {
            for _ in 0..FLIGHTS {
                let (ctx, log) = (Arc::clone(ctx), Arc::clone(log));
                threads.push(spawn("ferrite-flush", "log flusher", Box::new(move || flusher_loop(&ctx, &log)))?);
            }
        }
        if ctx.opts.background_cleaner {
            let (ctx, log, ra, cleaner) =
                (Arc::clone(ctx), Arc::clone(log), Arc::clone(ra), Arc::clone(&inner.cleaner));
            threads.push(spawn(
                "ferrite-cleaner",
                "cleaner",
                Box::new(move || cleaner_loop(&ctx, &log, &cleaner, &ra)),
            )?);
        }
        if ctx.opts.readahead > 0 {
            for _ in 0..readahead::THREADS {
                let (ctx, log, ra) = (Arc::clone(ctx), Arc::clone(log), Arc::clone(ra));
                threads.push(spawn(
                    "ferrite-readahead",
                    "readahead",
                    Box::new(move || readahead_loop(&ctx, &ra, &log.tail)),
                )?);
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
        self.inner.log.flush(&self.inner.ctx)
    }

    /// Takes a checkpoint now.
    pub fn checkpoint(&self) -> Result<()> {
        self.inner.checkpoint()
    }

    /// Runs the cleaner now: moves live data out of every segment with dead space worth taking
    /// back (live fraction up to 95%) and frees those segments. Blocks until done.
    pub fn reclaim(&self) -> Result<CleanReport> {
        self.inner.check_open()?;
        let i = &self.inner;
        cleaner::clean(&i.ctx, &i.log, &i.cleaner, &i.readahead, 0.95, false, |_, _| true)
    }

    /// Arms a fault injection point (crash tests only).
    #[doc(hidden)]
    pub fn inject_fault(&self, point: crate::ctx::FaultPoint) {
        self.inner.faults.lock().push(point);
        self.inner.faults_armed.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The pool's uuid, chosen when it was created.
    pub fn uuid(&self) -> uuid::Uuid {
        uuid::Uuid::from_bytes(self.inner.sb.uuid)
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
        let cold_unwritten = st.cold.map_or(0, |c| seg - c.off);
        PoolStats {
            uuid: uuid::Uuid::from_bytes(inner.sb.uuid),
            size: seg * inner.sb.segment_count,
            used: (inner.sb.segment_count - free_segs) * seg - head_unwritten - cold_unwritten,
            free: free_segs.saturating_sub(inner.opts.reserve_segments as u64) * seg,
            live: st.segs.live_blocks() * BLOCK as u64,
            reclaimable,
            segment_size: seg,
            segments: inner.sb.segment_count,
            segments_free: free_segs,
            volumes: st.volumes.len(),
            provisioned: st.provisioned(),
            provision_cap: inner.overcommit_cap(),
            log_seq: st.applied.seq,
            generation: st.generation,
            client_bytes_written: inner.client_bytes.load(Ordering::Relaxed),
            media_bytes_written: inner.media_bytes.load(Ordering::Relaxed),
            cleaner_active: inner.cleaner.stats.active.load(Ordering::Relaxed),
            cleaner_runs: inner.cleaner.stats.runs.load(Ordering::Relaxed),
            cleaner_segments_cleaned: inner.cleaner.stats.segments_cleaned.load(Ordering::Relaxed),
            cleaner_bytes_moved: inner.cleaner.stats.blocks_moved.load(Ordering::Relaxed) * BLOCK as u64,
            failed: inner.ctx.failed.load(Ordering::Acquire),
            checksum_errors: inner.ctx.checksum_errors.load(Ordering::Relaxed),
            readahead_bytes: inner.readahead.read_bytes.load(Ordering::Relaxed),
            readahead_hit_bytes: inner.readahead.hit_bytes.load(Ordering::Relaxed),
            head_segment: st.applied.seg as u64,
            cold_segment: st.cold.map(|c| c.seg as u64),
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
        self.inner.wake.cleaner.stop();
        // A cleaning run in progress finishes its step (it holds `running`) before the log closes.
        drop(self.inner.cleaner.running.lock());
        self.inner.log.close();
        self.inner.log.tail.stop();
        self.inner.wake.checkpoint.stop();
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

/// Reads the superblock: the first block, or its copy (format 2+) where the first is damaged.
/// Returns it with the offsets of the copies to rewrite (damaged, or missing in a format 2 pool).
fn read_superblock(backend: &dyn Backend) -> Result<(Superblock, Vec<u64>)> {
    let read = |off: u64| -> Result<Superblock> {
        let mut block = AlignedBuf::new(BLOCK);
        backend.read_at(&mut block, off).map_err(|e| Error::io("reading the superblock", e))?;
        Superblock::decode(&block)
    };
    let copy = read(SUPER_COPY_AT).ok().filter(|c| c.version >= 2);
    match (read(0), copy) {
        (Ok(sb), Some(c)) if c == sb => Ok((sb, vec![])),
        (Ok(sb), _) if sb.version < 2 => Ok((sb, vec![])),
        (Ok(sb), _) => Ok((sb, vec![SUPER_COPY_AT])),
        // A newer format is refused as it is, never "repaired" from an older copy.
        (Err(e), _) if e.kind() == ErrorKind::Unsupported => Err(e),
        (Err(e), Some(c)) => {
            tracing::warn!(error = %e, "the superblock is damaged; using its copy and rewriting it");
            Ok((c, vec![0]))
        }
        (Err(e), None) => Err(e),
    }
}

/// Writes `sb` at `off` (the superblock or its copy) and syncs it.
fn write_superblock(backend: &dyn Backend, sb: &Superblock, off: u64) -> Result<()> {
    let mut block = AlignedBuf::new(BLOCK);
    block.copy_from_slice(&sb.encode());
    backend.write_at(&block, off).map_err(|e| Error::io("writing the superblock", e))?;
    backend.sync().map_err(|e| Error::io("syncing the superblock", e))
}
