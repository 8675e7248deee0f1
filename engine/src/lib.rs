//! Ferrite's engine: a log-structured extent store of thin volumes.
//!
//! The crate is cut into bands; each uses only the bands below it (`tests/layout.rs` checks
//! every `crate::` path), so there is no import cycle and a file's imports say what it may
//! touch. Top down:
//!
//! ```text
//!  ops/      catalog operations, `impl Pool`: volumes, snapshots and clones, groups, scrub
//!  volume    the I/O handle: byte ranges -> block requests to the log, reads through read/
//!  pool      lifecycle: open (recovery, then the parts), the background threads, stats, close
//!  recovery  load the checkpoint, replay the log after it (policy: truncate at the first bad batch)
//!  maint/    background work: checkpoint, cleaner (+ victims, pace); room for the write path
//!  read/     resolve ranges through the layer chain, gather from memory, read the store, readahead
//!  write/    the log: queue + group-commit leader, the open batch (tail, built in the tail file),
//!            batches, room at the head
//!  ctx       the shared context: store, metadata, state lock, pins, health, counters, wake-ups
//!  state     the in-memory state and the one place a batch is applied (write path and recovery)
//!  gate      a volume's write gate: read-only volumes, and waiting out the writes in flight
//!  mirror    the hook for synchronous replicas: where a volume's client writes also go
//!  fill      the hook for a volume filled while it serves (an instant restore)
//!  qos       a volume's limits (IOPS, bandwidth; token buckets): requests over them wait
//!  keys      data keys of encrypted layers: wrapped in the catalog, open once a volume is unlocked
//!  meta      RocksDB: catalog, map chunks, crc tables, checkpoint record, segment chain
//!  map/      extent maps, layer views and chains, the segment table: pure, in memory
//!  format    superblock and batch header: pure encode/decode
//!  io/       the Backend trait: io_uring, pread/pwrite, memory, crash simulator
//!  batch     a thread's batch of sends (mirror frames, NBD replies): one write at its end
//! ```
//!
//! One 4 KiB write, top down: `Volume::write` -> `Log::send_all` (`write/queue.rs`): the first
//! caller with no leader leads -> a small write goes into the open batch (`write/tail.rs`:
//! copied, mapped through `state::map_entries`, acknowledged; a flusher thread writes the
//! batch a moment later), a large one into a batch of its own (`write/batch.rs`), both at a
//! place `write/room.rs` reserved (asking `maint` for room through `MakeRoom` only when no
//! segment is free). One read: `Volume::read` -> `read::resolve` (the head's view, under the state
//! read lock; segments pinned) -> `read::readahead::gather` (readahead windows, the unwritten
//! tail) -> the store -> `read::resolve::fill` (crc of every block).
//!
//! Invariants:
//! - every batch has a unique, gap-free sequence number within a generation, and replay accepts
//!   only the exact next one, so a pool always recovers to a prefix of its log;
//! - a flush is acknowledged only after a store sync that covers every batch before it;
//! - a write is acknowledged only once the kernel holds it (the store, or the tail file's shared
//!   mapping), so a process crash loses nothing acknowledged;
//! - a segment is reused only after a durable checkpoint no longer refers to it (see
//!   `maint/checkpoint.rs`), and never while a read holds a pin on it;
//! - the engine knows no transport: errors carry an [`ErrorKind`] and an errno.

#![forbid(unsafe_op_in_unsafe_fn)]

mod batch;
mod ctx;
mod error;
mod fill;
pub mod format;
mod gate;
pub mod io;
mod keys;
mod maint;
mod map;
mod meta;
mod mirror;
mod ops;
mod pool;
mod qos;
mod read;
mod recovery;
mod rng;
mod state;
mod volume;
mod write;

#[doc(hidden)]
pub use batch::{Batch, Push};
pub use ctx::FaultPoint;
pub use ctx::{Discard, PoolOptions};
pub use error::{Error, ErrorKind, Result};
pub use fill::{Access, Fill};
pub use maint::cleaner::CleanReport;
pub use maint::defrag::{DefragProgress, DefragReport};
pub use mirror::{Mirror, MirrorOp, Pending, RangeGuard, RangeLocks, WriteDone};
pub use ops::encryption::Encryption;
pub use ops::group::{GroupInfo, GroupSnapshotInfo};
pub use ops::rotation::RotationProgress;
pub use ops::scrub::{Damage, ScrubProgress, ScrubReport};
pub use ops::snapshot::{Image, SnapshotInfo};
pub use ops::volumes::VolumeInfo;
pub use pool::{Pool, PoolStats};
pub use qos::{IoKind, QosLimits, QosStats};
pub use read::reads::Reads;
pub use recovery::RecoveryReport;
pub use volume::{Volume, ZERO_DATA_SLICE};
/// The tail file's name in a pool's metadata directory.
pub use write::tailfile::FILE_NAME as TAIL_FILE;
