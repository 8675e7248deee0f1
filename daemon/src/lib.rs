//! The Ferrite daemon as a library: everything `ferrite daemon` serves, in rooms that only use
//! the rooms before them (`tests/layout.rs` keeps it so), lowest first:
//!
//! - [`authz`]: who may do what: roles, identities, the policy every listener enforces.
//! - [`base`]: what every room shares: sizes, the configuration, the JSON state files, the
//!   gRPC helpers (engine errors as statuses, blocking calls, field checks).
//! - [`records`]: what the daemon keeps beside the pool, each in its own state file or job:
//!   exports, publications, attachments, fences, restores, rotations, key-encryption keys.
//! - [`net`]: the listeners (limits, fences, TLS), Unix sockets, the gRPC server settings.
//! - [`replica`], [`sync`]: asynchronous and synchronous replication between daemons.
//! - [`api`]: the services' gRPC faces: admin, backups, metrics, and the replication peers'
//!   (replica, mirror). None imports another. `records`, `replica` and `sync` return the
//!   library's own error (`base::error`, a status only by `base::rpc`); statuses are the
//!   services' and the gRPC layers' (`authz`, `net`).
//! - [`serve`]: the assembly that opens the pool and serves all of them (`ferrite daemon`), and
//!   the attachment-only server of a node plugin on a node without storage.
//!
//! The `ferrite` binary (`main.rs`) is the front door: the command line, its client, and the
//! programs it starts. It uses this library; the library knows neither clap nor the CSI driver.

pub mod api;
pub mod authz;
pub mod base;
pub mod net;
pub mod records;
pub mod replica;
pub mod serve;
pub mod sync;
