//! The engine's one public error type.
//!
//! Every error has a stable [`ErrorKind`], a short message with its context (volume, offset,
//! segment, operation) and an optional source. The data paths turn it into an errno with
//! [`Error::errno`]; the gRPC edge maps the kind to a status. Nothing here knows a transport.

use std::fmt;
use std::io;

/// What went wrong, stable across versions: callers match on this, never on messages.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A volume, pool or record does not exist.
    NotFound,
    /// A volume of that name (or a pool at that path) exists already.
    AlreadyExists,
    /// The request itself is malformed: a bad name, size, alignment or configuration.
    InvalidArgument,
    /// Offset or length reaches past the end of the volume.
    OutOfRange,
    /// The pool has no free space left for this write.
    NoSpace,
    /// The backing store failed an I/O.
    Io,
    /// On-media data or metadata failed verification (checksum, magic, version, consistency).
    Corrupt,
    /// The pool's format version or a requested feature is not supported by this build.
    Unsupported,
    /// The pool is shutting down, or was poisoned by an earlier media failure.
    Closed,
    /// A write to a snapshot, or to a volume made read-only.
    ReadOnly,
    /// I/O on an encrypted volume whose data key is not open (no key, or the wrong one).
    Locked,
    /// The volume is busy with work that must end first (a restore still filling it).
    Busy,
}

/// The engine's error: a kind, a message with context, and the underlying cause if any.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// Result alias used throughout the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` with a message that says what and where.
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Self { kind, msg: msg.into(), source: None }
    }

    /// An I/O error from the backing store, with context.
    pub fn io(msg: impl Into<String>, source: io::Error) -> Self {
        let kind = if source.raw_os_error() == Some(libc::ENOSPC) { ErrorKind::NoSpace } else { ErrorKind::Io };
        Self { kind, msg: msg.into(), source: Some(Box::new(source)) }
    }

    /// Attaches a cause.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The stable kind of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The errno a block data path (NBD, ublk) reports for this error.
    pub fn errno(&self) -> i32 {
        match self.kind {
            ErrorKind::NotFound => libc::ENOENT,
            ErrorKind::AlreadyExists => libc::EEXIST,
            ErrorKind::InvalidArgument | ErrorKind::OutOfRange => libc::EINVAL,
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Io | ErrorKind::Corrupt => libc::EIO,
            ErrorKind::Unsupported => libc::EOPNOTSUPP,
            ErrorKind::Closed => libc::ESHUTDOWN,
            ErrorKind::ReadOnly => libc::EROFS,
            ErrorKind::Locked => libc::ENOKEY,
            ErrorKind::Busy => libc::EBUSY,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<rocksdb::Error> for Error {
    fn from(e: rocksdb::Error) -> Self {
        Self::new(ErrorKind::Io, "metadata store (RocksDB) operation failed").with_source(e)
    }
}

/// Shorthand constructors used across the crate.
/// A copy of `e` (kind and message) for each of several waiters.
pub(crate) fn clone_err(e: &Error) -> Error {
    Error::new(e.kind(), e.to_string())
}

pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, msg)
}

pub(crate) fn corrupt(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_from_io_is_no_space() {
        let e = Error::io("write", io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(e.errno(), libc::ENOSPC);
        let e = Error::io("write", io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(e.errno(), libc::EIO);
    }

    #[test]
    fn message_does_not_repeat_source() {
        let e = Error::io("reading superblock", io::Error::other("boom"));
        assert_eq!(e.to_string(), "reading superblock");
        assert_eq!(std::error::Error::source(&e).unwrap().to_string(), "boom");
    }
}
