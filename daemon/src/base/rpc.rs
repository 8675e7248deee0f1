//! What every gRPC service of the daemon shares: engine errors as gRPC statuses (the one place
//! this mapping lives), engine calls on the blocking pool, and field checks. Below the services
//! (admin, replication, attachments, exports), so none of them imports another for these.

use ferrite_engine::ErrorKind;
use tonic::Status;

/// A streamed answer (the generated servers' boxed stream).
pub type Stream<M> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<M, Status>> + Send + 'static>>;

/// Maps an engine error to a gRPC status (the one place this happens).
pub fn status(e: ferrite_engine::Error) -> Status {
    let msg = e.to_string();
    match e.kind() {
        ErrorKind::NotFound => Status::not_found(msg),
        ErrorKind::AlreadyExists => Status::already_exists(msg),
        ErrorKind::InvalidArgument => Status::invalid_argument(msg),
        ErrorKind::OutOfRange => Status::out_of_range(msg),
        ErrorKind::NoSpace => Status::resource_exhausted(msg),
        ErrorKind::Closed | ErrorKind::Busy => Status::unavailable(msg),
        ErrorKind::Corrupt => Status::data_loss(msg),
        ErrorKind::Unsupported => Status::unimplemented(msg),
        ErrorKind::ReadOnly | ErrorKind::Locked => Status::failed_precondition(msg),
        _ => Status::internal(msg),
    }
}

/// Runs an engine call on the blocking pool, its error as a gRPC status.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ferrite_engine::Error> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("engine task failed: {e}")))?
        .map_err(status)
}

/// A required string field.
pub fn require(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(())
}
