//! The hook for a volume filled while it serves (an instant restore): before any client request
//! touches a range, the volume's [`Fill`] makes sure the range holds its data. The engine
//! knows nothing of where the data comes from; the daemon implements [`Fill`] over a backup.

use crate::error::Result;

/// Brings ranges of a volume to their final content before client requests touch them.
///
/// Called from the thread running a client request (a read, a write, a trim, an allocation
/// query), before the request does anything, with the range it covers; it may block (fetching
/// the data). Once `fill` returned Ok for a range, the range's content there is durable: a
/// later write to it must never be undone by the filler, even after a crash. An error fails the
/// client's request (EIO), nothing else.
pub trait Fill: Send + Sync + std::fmt::Debug {
    fn fill(&self, offset: u64, len: u64) -> Result<()>;
}
