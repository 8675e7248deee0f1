//! Catalog operations on an open pool, each an `impl Pool` block: `volumes` (create, open,
//! grow, list), `snapshot` (snapshots,
//! clones, deletion with merges), `group` (volume groups and crash-consistent group snapshots),
//! `scrub` (read and verify every live block), `encryption` (encrypted volumes, their keys), `rotation` (a volume re-encrypted under a new data key). They change layers inside log barriers and
//! commit with checkpoints.

pub(crate) mod encryption;
pub(crate) mod group;
pub(crate) mod rotation;
pub(crate) mod scrub;
pub(crate) mod snapshot;
pub(crate) mod volumes;
