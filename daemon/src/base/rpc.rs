//! Where the daemon's errors meet gRPC: an error as a status (the one place a kind becomes a
//! code), a peer's status as an error, and the services' streamed answers. Engine calls on the
//! blocking pool and field checks are `error.rs`'s.

use tonic::Status;

use super::error::{Error, Kind};

/// A streamed answer (the generated servers' boxed stream).
pub type Stream<M> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<M, Status>> + Send + 'static>>;

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let code = match e.kind() {
            Kind::Invalid => tonic::Code::InvalidArgument,
            Kind::NotFound => tonic::Code::NotFound,
            Kind::AlreadyExists => tonic::Code::AlreadyExists,
            Kind::OutOfRange => tonic::Code::OutOfRange,
            Kind::Refused => tonic::Code::FailedPrecondition,
            Kind::Busy => tonic::Code::Aborted,
            Kind::Unavailable => tonic::Code::Unavailable,
            Kind::Exhausted => tonic::Code::ResourceExhausted,
            Kind::Denied => tonic::Code::PermissionDenied,
            Kind::TimedOut => tonic::Code::DeadlineExceeded,
            Kind::Corrupt => tonic::Code::DataLoss,
            Kind::Unsupported => tonic::Code::Unimplemented,
            Kind::Internal => tonic::Code::Internal,
        };
        Status::new(code, e.message())
    }
}

/// A status as the daemon's error: what a peer answered, or the authorization policy refused.
/// Every kind comes back as the code it came from; the codes the daemon never sends as its own
/// (a transport's failure, a cancelled call) are the peer's being away for now.
impl From<Status> for Error {
    fn from(s: Status) -> Error {
        use tonic::Code;
        let kind = match s.code() {
            Code::InvalidArgument => Kind::Invalid,
            Code::NotFound => Kind::NotFound,
            Code::AlreadyExists => Kind::AlreadyExists,
            Code::OutOfRange => Kind::OutOfRange,
            Code::FailedPrecondition => Kind::Refused,
            Code::Aborted => Kind::Busy,
            Code::ResourceExhausted => Kind::Exhausted,
            Code::PermissionDenied | Code::Unauthenticated => Kind::Denied,
            Code::DeadlineExceeded => Kind::TimedOut,
            Code::DataLoss => Kind::Corrupt,
            Code::Unimplemented => Kind::Unsupported,
            Code::Internal => Kind::Internal,
            Code::Ok | Code::Cancelled | Code::Unknown | Code::Unavailable => Kind::Unavailable,
        };
        Error::new(kind, s.message())
    }
}

/// An engine error as a gRPC status.
pub fn status(e: ferrite_engine::Error) -> Status {
    Error::from(e).into()
}

/// A peer's error, saying which peer.
pub fn at_peer(peer: &str) -> impl Fn(Status) -> Error + '_ {
    move |s| {
        let e = Error::from(s);
        Error::new(e.kind(), format!("peer {peer}: {}", e.message()))
    }
}
