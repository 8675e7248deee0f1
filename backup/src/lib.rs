//! Backups that leave the cluster: a volume's snapshot cut into fixed-size chunks, each named
//! by a keyed hash of its contents (identical chunks are stored once per target), compressed
//! with zstd and sealed with AES-256-GCM when the target has a key, in an object store (S3 or
//! a directory). One manifest per backup lists the chunks by offset, in segments that backups
//! share; one index per volume lists its backups. Incremental backups read only the chunks the changed ranges since the previous
//! backup's snapshot touch.
//!
//! The target's layout (all under its prefix):
//! - `ferrite-backup.json`: the target's marker (format, key check, grace, object lock), plain
//!   JSON;
//! - `chunks/<2 hex>/<64 hex>`: chunks, named by HMAC-SHA256 of their plaintext, and the
//!   segments of manifests (chunks too: `segment.rs`);
//! - `volumes/<volume>/index`: the volume's backups, oldest first, and the manifests of deleted
//!   ones not yet removed;
//! - `volumes/<volume>/backups/<id>@<attempt>`: one manifest per backup, named by the commit
//!   attempt that wrote it (`<id>` alone from earlier builds);
//! - `gc/condemned`: chunks the last prune found unreferenced (see `prune.rs`); `gc/locking`: how
//!   far an extension of the object lock got; `gc/clock`: written to read the store's clock;
//! - `gc/writers/<attempt>`: the leases of the backups and copies running (`writers.rs`);
//! - `gc/quarantined` and `quarantine/<64 hex>`: chunks a verify found bad (`quarantine.rs`).
//!
//! Every object but the marker is an envelope (`codec.rs`): a header with the format version,
//! then zstd, then AES-256-GCM bound to the object's name.

mod bases;
mod bounded;
mod clock;
mod codec;
mod config;
mod copy;
mod create;
mod error;
mod instant;
mod manifest;
mod object_lock;
mod pace;
mod prune;
mod quarantine;
mod restore;
mod schedule;
mod segment;
mod signed;
mod target;
mod writers;

pub use bases::{Plan, Planned, plan};
pub use clock::{new_id, now_unix};
pub use config::{LockMode, TargetConfig, TargetKind};
pub use copy::copy;
pub use create::{CreateOptions, Progress, create};
pub use error::{Error, Result};
pub use instant::{Filling, Save, Saved};
pub use manifest::{BackupRef, ChunkRef, Index, IndexEntry, Manifest, SnapshotIdentity, list_volumes, valid_component};
pub use pace::Pace;
pub use prune::{PruneReport, Retention, Sweep, delete, prune};
pub use restore::{VerifyReport, export, verify};
pub use schedule::{Found, schedule_verifies};
pub use segment::{SPAN as SEGMENT_SPAN, SegmentRef};
pub use target::{Counters, Target, key_fingerprint};

/// Whether `id` is one the CSI driver gives the backup of a snapshot (`csi.<snapshot name>`, or
/// `csi-<digest>` for a name the engine does not take): the only backups the controller may
/// delete.
pub fn is_csi_id(id: &str) -> bool {
    id.starts_with("csi.") || id.starts_with("csi-")
}

/// The snapshot a backup of `volume` to `target` takes by itself (and keeps as the base of the
/// next incremental to that target).
pub fn auto_snapshot(volume: &str, target: &str, id: &str) -> String {
    format!("{volume}.backup.{target}.{id}")
}

/// Chunk sizes a target may use: 1-4 MiB, a whole number of 4 KiB blocks.
pub const MIN_CHUNK: u64 = 1 << 20;
pub const MAX_CHUNK: u64 = 4 << 20;
/// The default: 4 MiB (see ARCHITECTURE "Backups" for the measurement behind it).
pub const DEFAULT_CHUNK: u64 = 4 << 20;
