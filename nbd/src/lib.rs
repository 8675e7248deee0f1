//! Ferrite's NBD server: fixed newstyle negotiation, simple and structured replies,
//! `base:allocation` block status, multi-conn, over engine volumes.
//!
//! ```text
//!  listener (unix/tcp) ─► connection task ─► negotiate() ─► Session ─► serve(): one event loop
//!                                                                  thread per connection (socket
//!                                                                  and store reads on one
//!                                                                  io_uring), helper threads for
//!                                                                  requests that may wait long
//! ```
//! Invariants: nothing a client sends can panic the server or touch an export it did not
//! negotiate; a write reaches the engine only with its whole payload; a flush covers every write
//! acknowledged on any connection (the engine's flush is pool-wide), which is what
//! `NBD_FLAG_CAN_MULTI_CONN` promises.

pub mod event_loop;
pub mod export;
pub mod fuzzing;
pub mod handshake;
pub mod inbox;
pub mod kernel;
pub mod limits;
pub mod metrics;
mod outbox;
pub mod proto;
pub mod relay;
pub mod server;
pub mod socket;
pub mod tls;
pub mod transmission;

pub use export::{Export, Exports};
pub use limits::Limits;
pub use server::{Server, ServerStats};
