//! What can go wrong with a backup, in terms a user can act on.

/// A backup error. The daemon maps each variant to a gRPC status.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object store refused or failed a request (after its retries).
    #[error("backup target {target}: {op} {path}: {source}")]
    Store {
        target: String,
        op: &'static str,
        path: String,
        #[source]
        source: Box<object_store::Error>,
    },
    /// The store's answer broke a bound: larger than the object can be, cut short, too slow.
    #[error("backup target {target}: {op} {path}: {why}")]
    Answer { target: String, op: &'static str, path: String, why: String },
    /// An object is not what its name says (a damaged or substituted chunk, manifest or index).
    #[error("backup target {target}: {what} is corrupt: {why}")]
    Corrupt { target: String, what: String, why: String },
    /// An object was written by a newer Ferrite.
    #[error(
        "backup target {target}: {what} has format {found}; this Ferrite reads up to format {supported}: upgrade it"
    )]
    Newer { target: String, what: String, found: u32, supported: u32 },
    /// The target's key is missing, wrong, or given to a target created without one.
    #[error("backup target {target}: {msg}")]
    Key { target: String, msg: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    /// Another operation on the target would make this one unsafe (see `prune.rs`).
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Engine(#[from] ferrite_engine::Error),
}

impl Error {
    pub(crate) fn store(
        target: &str,
        op: &'static str,
        path: &object_store::path::Path,
        source: object_store::Error,
    ) -> Self {
        Error::Store { target: target.to_owned(), op, path: path.to_string(), source: Box::new(source) }
    }

    pub(crate) fn answer(target: &str, op: &'static str, path: &object_store::path::Path, why: String) -> Self {
        Error::Answer { target: target.to_owned(), op, path: path.to_string(), why }
    }

    pub(crate) fn corrupt(target: &str, what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::Corrupt { target: target.to_owned(), what: what.into(), why: why.into() }
    }

    /// True when the store failed or answered out of bounds: a fault that may pass.
    pub fn is_store_fault(&self) -> bool {
        matches!(self, Error::Store { .. } | Error::Answer { .. })
    }

    /// True when the store answered "not found" (an absent object, not a failure).
    pub fn is_not_found(&self) -> bool {
        match self {
            Error::NotFound(_) => true,
            Error::Store { source, .. } => matches!(**source, object_store::Error::NotFound { .. }),
            _ => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
