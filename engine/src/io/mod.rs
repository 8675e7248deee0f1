//! I/O backends: one small trait, four implementations.
//!
//! ```text
//!            +-----------------+
//!  engine -> | dyn Backend     | read_at / read_many / write_at / sync
//!            +-----------------+
//!              |      |      |        \
//!         io_uring  pread  memory   crash-simulating (memory + lost unsynced writes)
//! ```
//!
//! Contract, checked by the conformance suite in `tests/backend_conformance.rs`:
//! - offsets and lengths handed to a backend are multiples of [`BLOCK`] and buffers are
//!   [`BLOCK`]-aligned ([`AlignedBuf`]), so O_DIRECT backends never see a misaligned request;
//! - a completed `write_at` is visible to every later `read_at`, but survives a crash only once a
//!   later `sync` has completed;
//! - errors are `io::Error`s; the engine adds context at its edge.

mod aligned;
mod crash;
mod file;
mod memory;
pub(crate) mod probe;
mod uring;

use std::fmt;
use std::io;

pub use aligned::AlignedBuf;
pub use crash::{CrashBackend, CrashMode, IoCounters};
pub use file::SyncFileBackend;
pub(crate) use file::in_memory;
pub use memory::MemoryBackend;
pub use probe::{holds_pool, probe};
pub use uring::UringBackend;

/// The engine's block size and the alignment of every backend request.
pub const BLOCK: usize = 4096;

/// Reads started on a caller's own asynchronous I/O, such as an io_uring it also uses for its
/// sockets (cloud-hypervisor's `AsyncIo`, reduced to what the engine needs): the engine says
/// what to read where ([`AsyncIo::read_at`]), or which descriptor to wait for
/// ([`AsyncIo::poll_readable`]: a readahead window still being read), the caller starts it and
/// later reports its completion (bytes read, a poll's events, or -errno) with the same
/// `user_data`.
///
/// The engine's promise: `buf` is valid for `len` bytes and touched by nobody else, and `fd`
/// stays open, until that completion has been reported; the caller's: it reports every
/// operation it was given, and keeps their owner (a [`crate::Reads`]) until then.
pub trait AsyncIo {
    fn read_at(&mut self, fd: std::os::fd::RawFd, buf: *mut u8, len: usize, offset: u64, user_data: u64);
    fn poll_readable(&mut self, fd: std::os::fd::RawFd, user_data: u64);
}

/// One read of a batch handed to [`Backend::read_many`].
#[derive(Debug)]
pub struct ReadOp<'a> {
    /// Byte offset on the store, a multiple of [`BLOCK`].
    pub offset: u64,
    /// Destination, [`BLOCK`]-aligned, a multiple of [`BLOCK`] long.
    pub buf: &'a mut [u8],
}

/// A byte-addressed backing store: a file, a block device, memory, or a crash simulator.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Size of the store in bytes.
    fn len(&self) -> u64;

    /// True for an empty store (never the case for a usable pool).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// The file descriptor reads may be issued against directly (O_DIRECT, at the same offsets),
    /// for callers that submit them on their own io_uring; None for stores that are not a file,
    /// and for a file in memory (tmpfs), whose reads are copies best done on the spot.
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    /// True when the store is memory (tmpfs, or the in-memory backend): a read is a copy that
    /// never waits for a device, so a caller may do it where it would not block on one.
    fn in_memory(&self) -> bool {
        false
    }

    /// Reads several ranges; backends that can keep many requests in flight override this.
    fn read_many(&self, ops: &mut [ReadOp<'_>]) -> io::Result<()> {
        ops.iter_mut().try_for_each(|op| self.read_at(op.buf, op.offset))
    }

    /// Writes all of `buf` at `offset`. Not durable until a later [`Backend::sync`] completes.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;

    /// Writes pieces, each at its offset, as one write whose parts may complete in any order
    /// (a crash may keep any subset). The next piece is asked for only once the previous one is
    /// on its way, so a caller that prepares pieces as they are asked for (copying,
    /// checksumming) overlaps that work with the device's; backends that keep requests in
    /// flight override this. Returns once every piece has completed.
    fn write_pieces(&self, pieces: &mut dyn Iterator<Item = (&[u8], u64)>) -> io::Result<()> {
        for (buf, offset) in pieces {
            self.write_at(buf, offset)?;
        }
        Ok(())
    }

    /// Makes every completed write durable.
    fn sync(&self) -> io::Result<()>;

    /// Reserves space for a range about to be written (so a full filesystem under a sparse
    /// pool file fails here, cleanly, rather than in the middle of a batch). Best effort.
    fn allocate(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    /// Tells the store a range is no longer needed: a hole punched in a file, BLKDISCARD on a
    /// device. Best effort.
    fn discard(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    /// A file not fully allocated when it was opened (created sparse): freed segments are given
    /// back to its filesystem by default. A preallocated file (or a device) keeps its blocks, so
    /// that later writes do not pay for allocating them again.
    fn sparse(&self) -> bool {
        false
    }
}

/// Which backend a file- or device-backed pool uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// io_uring with O_DIRECT, falling back to [`BackendKind::Sync`] where io_uring is unavailable.
    #[default]
    Uring,
    /// pread/pwrite with O_DIRECT.
    Sync,
}

/// Checks a request against the backend contract.
pub(crate) fn check_request(len: usize, offset: u64, store_len: u64, ptr: *const u8) -> io::Result<()> {
    let aligned =
        len.is_multiple_of(BLOCK) && offset.is_multiple_of(BLOCK as u64) && (ptr as usize).is_multiple_of(BLOCK);
    if !aligned {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "unaligned backend request"));
    }
    if offset.checked_add(len as u64).is_none_or(|end| end > store_len) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "backend request past the end of the store"));
    }
    Ok(())
}

/// Store reads of whole-block runs into `buf`: each `(pool block, blocks, first slot in buf)`
/// of `todo` (slots ascending) as one operation.
fn read_ops<'a>(buf: &'a mut [u8], todo: &[(u64, u64, usize)]) -> Vec<ReadOp<'a>> {
    let mut ops = Vec::with_capacity(todo.len());
    let mut rest = buf;
    let mut at = 0;
    for &(pba, n, slot) in todo {
        let n = usize::try_from(n).expect("a read fits memory");
        let (_, from) = rest.split_at_mut((slot - at) * BLOCK);
        let (head, tail) = from.split_at_mut(n * BLOCK);
        ops.push(ReadOp { offset: pba * BLOCK as u64, buf: head });
        rest = tail;
        at = slot + n;
    }
    ops
}

/// Reads `todo` (as [`read_ops`]) from the store into `buf`, all in flight at once.
pub(crate) fn read_into(backend: &dyn Backend, buf: &mut [u8], todo: &[(u64, u64, usize)]) -> io::Result<()> {
    if todo.is_empty() {
        return Ok(());
    }
    backend.read_many(&mut read_ops(buf, todo))
}
