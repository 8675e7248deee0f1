//! Ferrite's engine: a log-structured extent store of thin volumes.
//!
//! ```text
//!   Volume::write ──► log queue + leader ──► one aligned write per batch ──► Backend
//!        │                    │ apply                                        (io_uring,
//!        │                    ▼                                               pread, memory,
//!   Volume::read ──► extent maps + crc tables (State, RwLock) ─► Backend      crash sim)
//!                             │ checkpoint (sync store, then RocksDB)
//!                             ▼
//!                      Meta (RocksDB): catalog, map chunks, crc tables, checkpoint, chain
//! ```
//!
//! Invariants:
//! - every batch has a unique, gap-free sequence number within a generation, and replay accepts
//!   only the exact next one, so a pool always recovers to a prefix of its log;
//! - a flush is acknowledged only after a store sync that covers every batch before it;
//! - a segment is reused only after a durable checkpoint no longer refers to it (see
//!   `checkpoint.rs`), and never while a read holds a pin on it;
//! - the engine knows no transport: errors carry an [`ErrorKind`] and an errno.

#![forbid(unsafe_op_in_unsafe_fn)]

mod ctx;
mod error;
pub mod format;
pub mod io;
mod maint;
mod map;
mod meta;
mod ops;
mod pool;
mod read;
mod recovery;
mod rng;
mod state;
mod volume;
mod write;

#[cfg(feature = "failpoints")]
pub use ctx::FaultPoint;
pub use ctx::PoolOptions;
pub use error::{Error, ErrorKind, Result};
pub use maint::cleaner::CleanReport;
pub use ops::group::{GroupInfo, GroupSnapshotInfo};
pub use ops::scrub::{Damage, ScrubProgress, ScrubReport};
pub use ops::snapshot::{Image, SnapshotInfo};
pub use ops::volumes::VolumeInfo;
pub use pool::{Pool, PoolStats};
pub use read::reads::Reads;
pub use recovery::RecoveryReport;
pub use volume::Volume;
