//! The daemon library's error: a kind a caller acts on, and a message a person reads. The rooms
//! below the services return it; a service answers it as a gRPC status (`rpc.rs`, the one place
//! a kind becomes a code). A kind is stable; a message may be reworded at any time.

use ferrite_engine::ErrorKind;

/// What went wrong, as a caller tells it apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The request is wrong: a field, a name, a size.
    Invalid,
    NotFound,
    AlreadyExists,
    /// Past the end of a volume, or a size it cannot take.
    OutOfRange,
    /// Not in this state: a role, a fence, an attachment or export in the way, a locked key.
    Refused,
    /// Another operation holds what this one needs: try again after it.
    Busy,
    /// A peer, the pool or a device is away for now.
    Unavailable,
    /// Out of space, or over a limit.
    Exhausted,
    /// The caller (or a peer, for us) may not do it.
    Denied,
    /// It took longer than it may.
    TimedOut,
    /// Data is damaged.
    Corrupt,
    /// This build or this machine does not do it.
    Unsupported,
    /// A fault of the daemon or the system under it (an I/O error, a failed task).
    Internal,
}

/// An error of the daemon library.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: Kind,
    message: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Kind::Invalid, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Kind::NotFound, message)
    }

    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::new(Kind::AlreadyExists, message)
    }

    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(Kind::Refused, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Kind::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Kind::Internal, message)
    }

    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(Kind::Busy, message)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The engine's kinds as the daemon's (the one place this mapping lives).
impl From<ferrite_engine::Error> for Error {
    fn from(e: ferrite_engine::Error) -> Self {
        let kind = match e.kind() {
            ErrorKind::NotFound => Kind::NotFound,
            ErrorKind::AlreadyExists => Kind::AlreadyExists,
            ErrorKind::InvalidArgument => Kind::Invalid,
            ErrorKind::OutOfRange => Kind::OutOfRange,
            ErrorKind::NoSpace => Kind::Exhausted,
            ErrorKind::Closed | ErrorKind::Busy => Kind::Unavailable,
            ErrorKind::Corrupt => Kind::Corrupt,
            ErrorKind::Unsupported => Kind::Unsupported,
            ErrorKind::ReadOnly | ErrorKind::Locked => Kind::Refused,
            _ => Kind::Internal,
        };
        Self::new(kind, e.to_string())
    }
}

/// Runs an engine call on the blocking pool.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> ferrite_engine::Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::internal(format!("engine task failed: {e}")))?
        .map_err(Error::from)
}

/// A required string field.
pub fn require(field: &str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(format!("{field} is required")));
    }
    Ok(())
}
