//! Ferrite volumes as Linux block devices through ublk (libublk): `/dev/ublkbN` per attached
//! volume, one queue thread and ring per hardware queue, requests served by the engine.
//!
//! - [`handler`]: one request against the engine, kernel-free (unit tests, bench).
//! - [`queue`]: a queue thread and its worker pool.
//! - [`device`]: attach, recover (USER_RECOVERY), resize, detach.
//! - [`features`]: what the running driver can do, probed once.
//! - [`hold`]: the bound on how long a device waits for its daemon (the watchdog).

pub mod device;
pub mod features;
pub mod handler;
pub mod hold;
mod queue;

pub use device::{Device, Options, block_path};
pub use features::{Features, available};
pub use handler::{Op, Request};
