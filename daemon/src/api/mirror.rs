//! The `Mirror` service's gRPC face: the calls a primary makes on its members (the sync stream
//! over gRPC, memberships, rebuilds), translated into `sync::serve::MirrorService`'s. Primaries
//! stream over the framed connection (`sync/wire.rs`); the gRPC stream runs the same code.

use ferrite_proto::ferrite::v1::{
    Membership, MembershipRequest, MirrorAck, MirrorMessage, RebuildMessage, RebuildReply, RecordReply, mirror_server,
};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::authz::caller_of;
use crate::base::error::Error;
use crate::sync::ack_sink::AckSink;
use crate::sync::serve::{Inbound, MirrorService, STREAM_ACKS};

/// A gRPC stream's requests, as the member's stream reads them.
struct Requests(Streaming<MirrorMessage>);

impl Inbound for Requests {
    async fn message(&mut self) -> Result<Option<MirrorMessage>, String> {
        self.0.message().await.map_err(|e| e.message().to_owned())
    }

    fn ready(&self) -> bool {
        false
    }
}

#[tonic::async_trait]
impl mirror_server::Mirror for MirrorService {
    async fn stream(
        &self,
        req: Request<Streaming<MirrorMessage>>,
    ) -> Result<Response<crate::base::rpc::Stream<MirrorAck>>, Status> {
        let caller = caller_of(&req)?;
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_ACKS);
        MirrorService::stream(self, &caller, Requests(req.into_inner()), AckSink::Stream(tx)).await?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(|a| a.map_err(Status::from)))))
    }

    async fn record(&self, req: Request<Membership>) -> Result<Response<RecordReply>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(MirrorService::record(self, &caller, req.get_ref()).await?))
    }

    async fn get(&self, req: Request<MembershipRequest>) -> Result<Response<Membership>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(MirrorService::get(self, &caller, &req.get_ref().volume).await))
    }

    async fn rebuild(&self, req: Request<Streaming<RebuildMessage>>) -> Result<Response<RebuildReply>, Status> {
        let caller = caller_of(&req)?;
        let pieces = req.into_inner().map(|m| m.map_err(Error::from));
        Ok(Response::new(MirrorService::rebuild(self, &caller, pieces).await?))
    }
}
