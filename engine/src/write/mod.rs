//! The write path: everything that puts bytes in the log. `req` is what callers hand it,
//! `queue` the request queue and its group-commit leader, `tail` the open batch that small
//! writes are acknowledged from (and its flusher threads), `tailfile` the shared file mapping its
//! buffers live in (what a process crash leaves to recovery), `batch` the encoding and writing of
//! one batch (and of the cleaner's moves), `room` the space a batch takes at the log head, `cold` the cleaner's own head (moved blocks).
//! Uses the context (`ctx.rs`), the state, the maps and the store below it, and asks
//! background work for room only through [`room::MakeRoom`]. Anything that writes to the log goes
//! through [`Log`]: sequence numbers, chain records and the apply order all assume
//! one leader at a time.

pub(crate) mod batch;
pub(crate) mod cold;
pub(crate) mod queue;
pub(crate) mod req;
pub(crate) mod room;
pub(crate) mod tail;
pub(crate) mod tailfile;

pub(crate) use queue::Log;
