//! The admin gRPC service: it translates each RPC into calls on the pool (`Pool`), the exports
//! (`exports.rs`), the attachments (`attachments.rs`) and the fence list (`fence.rs`), which own
//! their records. One file per concern answers its RPCs (volumes, snapshots, groups, replication,
//! exports, devices, fences, pool); this file holds the service, what they share, and the table
//! that routes each RPC to its file. Engine calls run on the blocking pool, so a slow catalog
//! change never stalls the runtime or the data path. Engine errors become gRPC statuses here and
//! nowhere else.

use std::sync::Arc;

use ferrite_engine::Pool;
use ferrite_nbd::Server;
use ferrite_proto::ferrite::v1 as pb;

use tonic::{Request, Response, Status};

use crate::base::config::Config;
use crate::base::error::blocking;
use crate::records::attachments::Attachments;
use crate::records::exports::ExportTable;
use crate::records::fence::Fences;
use crate::replica::Replication;

/// The admin service: the pool, and what this daemon serves from it.
#[derive(Debug)]
pub struct AdminService {
    pub pool: Arc<Pool>,
    pub nbd: Arc<Server>,
    pub cfg: Config,
    pub exports: Arc<ExportTable>,
    /// Devices attached on this node (shared with the daemon, which freezes them on exit).
    pub attachments: Arc<Attachments>,
    /// Fenced networks and the TCP clients they apply to.
    pub fences: Arc<Fences>,
    pub replication: Arc<Replication>,
    pub sync: Arc<crate::sync::SyncHub>,
    pub keys: crate::records::keys::KeyDir,
    pub rotations: Arc<crate::records::rotations::Rotations>,
    pub policy: Arc<crate::authz::Policy>,
}

impl AdminService {
    /// Runs an engine call on the blocking pool.
    async fn engine<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Pool) -> Result<T, ferrite_engine::Error> + Send + 'static,
    ) -> Result<T, Status> {
        let pool = Arc::clone(&self.pool);
        Ok(blocking(move || f(&pool)).await?)
    }

    /// The NBD TCP listener's address (empty without one).
    fn nbd_tcp(&self) -> String {
        self.cfg.nbd_listen.map(|a| a.to_string()).unwrap_or_default()
    }
}

mod devices;
mod exports;
mod fences;
mod groups;
mod pool;
mod replication;
mod snapshots;
mod volumes;

/// The service's trait impl is this table: each RPC is answered by the function of its name in
/// the file of its concern (`volumes.rs`, `snapshots.rs`, ...), which a missing one fails to build.
macro_rules! answered_by_concerns {
    ($($concern:ident::$rpc:ident($req:ty) -> $resp:ty;)*) => {
        #[tonic::async_trait]
        impl ferrite_proto::ferrite::v1::admin_server::Admin for AdminService {
            $(async fn $rpc(&self, req: Request<$req>) -> Result<Response<$resp>, Status> {
                $concern::$rpc(self, req).await
            })*
        }
    };
}

answered_by_concerns! {
    volumes::defrag_volume(pb::DefragVolumeRequest) -> JobStream<pb::DefragVolumeProgress>;
    volumes::create_volume(pb::CreateVolumeRequest) -> pb::Volume;
    volumes::list_volumes(pb::ListVolumesRequest) -> pb::ListVolumesResponse;
    volumes::get_volume(pb::GetVolumeRequest) -> pb::Volume;
    volumes::grow_volume(pb::GrowVolumeRequest) -> pb::Volume;
    volumes::set_volume_limits(pb::SetVolumeLimitsRequest) -> pb::Volume;
    volumes::delete_volume(pb::DeleteVolumeRequest) -> pb::DeleteVolumeResponse;
    volumes::clone_volume(pb::CloneVolumeRequest) -> pb::Volume;
    volumes::unlock_volume(pb::UnlockVolumeRequest) -> pb::Volume;
    volumes::rekey_volume(pb::RekeyVolumeRequest) -> pb::Volume;
    snapshots::create_snapshot(pb::CreateSnapshotRequest) -> pb::Snapshot;
    snapshots::list_snapshots(pb::ListSnapshotsRequest) -> pb::ListSnapshotsResponse;
    snapshots::get_snapshot(pb::GetSnapshotRequest) -> pb::Snapshot;
    snapshots::delete_snapshot(pb::DeleteSnapshotRequest) -> pb::DeleteSnapshotResponse;
    snapshots::changed_ranges(pb::ChangedRangesRequest) -> pb::ChangedRangesResponse;
    groups::create_group(pb::CreateGroupRequest) -> pb::Group;
    groups::update_group(pb::UpdateGroupRequest) -> pb::Group;
    groups::delete_group(pb::DeleteGroupRequest) -> pb::DeleteGroupResponse;
    groups::list_groups(pb::ListGroupsRequest) -> pb::ListGroupsResponse;
    groups::create_group_snapshot(pb::CreateGroupSnapshotRequest) -> pb::GroupSnapshot;
    groups::list_group_snapshots(pb::ListGroupSnapshotsRequest) -> pb::ListGroupSnapshotsResponse;
    groups::delete_group_snapshot(pb::DeleteGroupSnapshotRequest) -> pb::DeleteGroupSnapshotResponse;
    groups::clone_group_snapshot(pb::CloneGroupSnapshotRequest) -> pb::Group;
    replication::enable_replication(pb::EnableReplicationRequest) -> pb::Replication;
    replication::disable_replication(pb::ReplicationRequest) -> pb::Replication;
    replication::sync_replication(pb::ReplicationRequest) -> pb::SyncReplicationResponse;
    replication::demote_replication(pb::ReplicationRequest) -> pb::Replication;
    replication::promote_replication(pb::PromoteReplicationRequest) -> pb::Replication;
    replication::resync_replication(pb::ReplicationRequest) -> pb::Replication;
    replication::list_replications(pb::ListReplicationsRequest) -> pb::ListReplicationsResponse;
    replication::add_sync_replica(pb::AddSyncReplicaRequest) -> pb::SyncVolume;
    replication::remove_sync_replica(pb::RemoveSyncReplicaRequest) -> pb::SyncVolume;
    replication::promote_sync_replica(pb::PromoteReplicationRequest) -> pb::SyncVolume;
    replication::list_sync_replicas(pb::ListReplicationsRequest) -> pb::ListSyncReplicasResponse;
    exports::start_export(pb::StartExportRequest) -> pb::Export;
    exports::stop_export(pb::StopExportRequest) -> pb::StopExportResponse;
    exports::list_exports(pb::ListExportsRequest) -> pb::ListExportsResponse;
    devices::attach_volume(pb::AttachVolumeRequest) -> pb::Attachment;
    devices::detach_volume(pb::DetachVolumeRequest) -> pb::DetachVolumeResponse;
    devices::resize_attachment(pb::ResizeAttachmentRequest) -> pb::Attachment;
    devices::list_attachments(pb::ListAttachmentsRequest) -> pb::ListAttachmentsResponse;
    devices::publish_volume(pb::PublishVolumeRequest) -> pb::Publication;
    devices::unpublish_volume(pb::UnpublishVolumeRequest) -> pb::UnpublishVolumeResponse;
    devices::list_publications(pb::ListPublicationsRequest) -> pb::ListPublicationsResponse;
    fences::fence_networks(pb::FenceRequest) -> pb::FenceResponse;
    fences::unfence_networks(pb::FenceRequest) -> pb::FenceResponse;
    fences::list_fences(pb::ListFencesRequest) -> pb::FenceResponse;
    pool::scrub_pool(pb::ScrubPoolRequest) -> JobStream<pb::ScrubPoolProgress>;
    pool::pool_status(pb::PoolStatusRequest) -> pb::PoolStatusResponse;
    pool::version(pb::VersionRequest) -> pb::VersionResponse;
    pool::reclaim_pool(pb::ReclaimPoolRequest) -> pb::ReclaimPoolResponse;
    pool::list_clients(pb::ListClientsRequest) -> pb::ListClientsResponse;
}

/// The stream of a long job's messages (see [`stream_job`]).
type JobStream<M> = crate::base::rpc::Stream<M>;

/// Runs a long blocking job and streams it: `job` gets a callback for progress messages (best
/// effort: a full channel, i.e. a slow client, skips one) and returns the final message (or the
/// error), which is always sent, last.
fn stream_job<M: Send + 'static>(
    job: impl FnOnce(&mut dyn FnMut(M)) -> Result<M, Status> + Send + 'static,
) -> JobStream<M> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::task::spawn_blocking(move || {
        let progress = tx.clone();
        let last = job(&mut |m| drop(progress.try_send(Ok(m))));
        let _ = tx.blocking_send(last);
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
