//! What every gRPC service of the daemon shares: the daemon's errors as gRPC statuses (the one
//! place a kind becomes a code), engine calls on the blocking pool, and field checks. Below the
//! services (admin, replication, attachments, exports), so none of them imports another for these.

use tonic::Status;

use super::error::{Error, Kind};
pub use super::error::{blocking, require};

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
            Kind::NoSpace => tonic::Code::ResourceExhausted,
            Kind::Corrupt => tonic::Code::DataLoss,
            Kind::Unsupported => tonic::Code::Unimplemented,
            Kind::Internal => tonic::Code::Internal,
        };
        Status::new(code, e.message())
    }
}

/// An engine error as a gRPC status.
pub fn status(e: ferrite_engine::Error) -> Status {
    Error::from(e).into()
}
