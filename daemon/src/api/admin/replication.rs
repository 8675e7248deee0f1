//! Replication: asynchronous replicas (`replica/`) and synchronous ones (`sync/`), their roles and
//! promotion. A controller may only replicate to a peer whose certificate holds the
//! replication-peer role here (`peer_holds_role`).

use ferrite_engine::Image;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::authz::{Caller, Role, caller_of};
use crate::base::error::require;

use super::AdminService;

pub(super) async fn enable_replication(
    admin: &AdminService,
    req: Request<pb::EnableReplicationRequest>,
) -> Result<Response<pb::Replication>, Status> {
    let caller = caller_of(&req)?;
    let r = req.into_inner();
    require("volume", &r.volume)?;
    admin.peer_holds_role(&caller, &r.peer, "EnableReplication").await?;
    let enabled =
        admin.replication.enable(&r.volume, &r.peer, &r.replica, r.interval_secs, r.group, r.snapshots).await?;
    Ok(Response::new(enabled))
}

pub(super) async fn disable_replication(
    admin: &AdminService,
    req: Request<pb::ReplicationRequest>,
) -> Result<Response<pb::Replication>, Status> {
    Ok(Response::new(admin.replication.disable(&req.into_inner().volume).await?))
}

pub(super) async fn sync_replication(
    admin: &AdminService,
    req: Request<pb::ReplicationRequest>,
) -> Result<Response<pb::SyncReplicationResponse>, Status> {
    Ok(Response::new(admin.replication.sync(&req.into_inner().volume).await?))
}

pub(super) async fn demote_replication(
    admin: &AdminService,
    req: Request<pb::ReplicationRequest>,
) -> Result<Response<pb::Replication>, Status> {
    Ok(Response::new(admin.replication.demote(&req.into_inner().volume).await?))
}

pub(super) async fn promote_replication(
    admin: &AdminService,
    req: Request<pb::PromoteReplicationRequest>,
) -> Result<Response<pb::Replication>, Status> {
    let r = req.into_inner();
    let promoted = admin.replication.promote(&r.volume, r.force).await?;
    admin.open_promoted(&r.volume).await;
    Ok(Response::new(promoted))
}

pub(super) async fn resync_replication(
    admin: &AdminService,
    req: Request<pb::ReplicationRequest>,
) -> Result<Response<pb::Replication>, Status> {
    Ok(Response::new(admin.replication.resync(&req.into_inner().volume).await?))
}

pub(super) async fn list_replications(
    admin: &AdminService,
    req: Request<pb::ListReplicationsRequest>,
) -> Result<Response<pb::ListReplicationsResponse>, Status> {
    let replications = admin.replication.list(&req.into_inner().volume)?;
    Ok(Response::new(pb::ListReplicationsResponse { replications }))
}

pub(super) async fn add_sync_replica(
    admin: &AdminService,
    req: Request<pb::AddSyncReplicaRequest>,
) -> Result<Response<pb::SyncVolume>, Status> {
    let caller = caller_of(&req)?;
    let r = req.into_inner();
    require("volume", &r.volume)?;
    require("peer", &r.peer)?;
    admin.peer_holds_role(&caller, &r.peer, "AddSyncReplica").await?;
    admin.refuse_if_rotating(&r.volume)?;
    Ok(Response::new(admin.sync.add(&r.volume, &r.peer, r.witness).await?))
}

pub(super) async fn remove_sync_replica(
    admin: &AdminService,
    req: Request<pb::RemoveSyncReplicaRequest>,
) -> Result<Response<pb::SyncVolume>, Status> {
    let r = req.into_inner();
    require("volume", &r.volume)?;
    require("peer", &r.peer)?;
    Ok(Response::new(admin.sync.remove(&r.volume, &r.peer).await?))
}

pub(super) async fn promote_sync_replica(
    admin: &AdminService,
    req: Request<pb::PromoteReplicationRequest>,
) -> Result<Response<pb::SyncVolume>, Status> {
    let r = req.into_inner();
    require("volume", &r.volume)?;
    let promoted = admin.sync.promote(&r.volume, r.force).await?;
    admin.open_promoted(&r.volume).await;
    Ok(Response::new(promoted))
}

pub(super) async fn list_sync_replicas(
    admin: &AdminService,
    req: Request<pb::ListReplicationsRequest>,
) -> Result<Response<pb::ListSyncReplicasResponse>, Status> {
    let v = req.into_inner().volume;
    let volumes = admin.sync.list((!v.is_empty()).then_some(v.as_str()));
    Ok(Response::new(pb::ListSyncReplicasResponse { volumes }))
}

impl AdminService {
    /// Refuses a peer endpoint (for `call`) whose certificate's identity holds no
    /// `replication-peer` role here, unless the caller is an operator: a controller replicates
    /// only to replication peers. The certificate is the one the endpoint presents now.
    async fn peer_holds_role(&self, caller: &Caller, endpoint: &str, call: &str) -> Result<(), Status> {
        if caller.is_operator() {
            return Ok(());
        }
        let probe = crate::sync::wire::connect(self.cfg.tls.as_ref(), endpoint);
        let conn = match tokio::time::timeout(self.sync.timeout.max(std::time::Duration::from_secs(5)), probe).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidInput => {
                return Err(Status::invalid_argument(format!("peer {endpoint:?}: {e}")));
            }
            Ok(Err(e)) => return Err(Status::unavailable(format!("peer {endpoint:?}: {e}"))),
            Err(_) => return Err(Status::unavailable(format!("peer {endpoint:?} did not complete a TLS handshake"))),
        };
        let cert = conn.get_ref().1.peer_certificates().and_then(|c| c.first());
        let names = cert.map(ferrite_tls::identities).unwrap_or_default();
        if self.policy.caller(&names).roles.contains(&Role::ReplicationPeer) {
            return Ok(());
        }
        let why = format!("peer {endpoint:?} (certificate [{}]) holds no replication-peer role here", names.join(", "));
        Err(self.policy.refuse(caller, &format!("/ferrite.v1.Admin/{call}"), &why))
    }

    /// Refuses synchronous replicas of a volume whose data-key rotation is unfinished: members
    /// hold one data key's ciphertext, and the rotation's copies are not mirrored.
    fn refuse_if_rotating(&self, volume: &str) -> Result<(), Status> {
        match self.rotations.job(volume) {
            Some(_) => Err(Status::failed_precondition(format!(
                "volume {volume:?} has an unfinished data-key rotation: add synchronous replicas once it is done \
                 (ferrite volume show {volume})"
            ))),
            None => Ok(()),
        }
    }

    /// Opens a promoted replica of an encrypted volume with its key from the key directory,
    /// where it is there; else it stays locked until `ferrite volume unlock` (or a CSI publish
    /// with the key) opens it.
    async fn open_promoted(&self, volume: &str) {
        let (keys, name) = (self.keys.clone(), volume.to_owned());
        let opened = self
            .engine(move |p| match p.volume_info(&name)?.encryption {
                Some(e) if !e.unlocked => p.unlock(Image::Volume(&name), keys.lookup(None)).map(|()| true),
                _ => Ok(false),
            })
            .await;
        match opened {
            Ok(true) => self.exports.revive(volume).await,
            Ok(false) => {}
            Err(e) => tracing::warn!(volume, "promoted, and stays locked: {}", e.message()),
        }
    }
}
