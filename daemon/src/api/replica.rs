//! The `Replica` service's gRPC face: the calls a replication peer makes (where a replica
//! stands, a resync asked of the primary, a group's commit, a push), translated into
//! `replica::receive::ReplicaService`'s.

use ferrite_proto::ferrite::v1::{
    GroupCommitReply, GroupCommitRequest, PushMessage, PushReply, ReplicaPosition, ReplicaPositionRequest,
    ReplicaSyncReply, ReplicaSyncRequest, replica_server,
};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::authz::caller_of;
use crate::base::error::Error;
use crate::replica::receive::ReplicaService;

#[tonic::async_trait]
impl replica_server::Replica for ReplicaService {
    async fn position(&self, req: Request<ReplicaPositionRequest>) -> Result<Response<ReplicaPosition>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(ReplicaService::position(self, &caller, req.into_inner().replica).await?))
    }

    async fn sync(&self, req: Request<ReplicaSyncRequest>) -> Result<Response<ReplicaSyncReply>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(ReplicaService::sync(self, &caller, req.into_inner())?))
    }

    async fn group_commit(&self, req: Request<GroupCommitRequest>) -> Result<Response<GroupCommitReply>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(ReplicaService::group_commit(self, &caller, req.into_inner()).await?))
    }

    async fn push(&self, req: Request<Streaming<PushMessage>>) -> Result<Response<PushReply>, Status> {
        let caller = caller_of(&req)?;
        let pieces = Box::pin(req.into_inner().map(|m| m.map_err(Error::from)));
        Ok(Response::new(ReplicaService::push(self, caller, pieces).await?))
    }
}
