//! The admin gRPC service: it translates each RPC into calls on the pool (`Pool`), the exports
//! (`exports.rs`), the attachments (`attachments.rs`) and the fence list (`fence.rs`), which own
//! their records. Engine calls run on the blocking pool, so a slow catalog change never stalls
//! the runtime or the data path. Engine errors become gRPC statuses here and nowhere else.

use std::sync::Arc;

use ferrite_engine::{Image, Pool, QosLimits};
use ferrite_nbd::Server;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_server::Admin;
use tonic::{Request, Response, Status};

use crate::authz::{Caller, Role, caller_of};
use crate::base::config::Config;
use crate::base::rpc::{blocking, require, status};
use crate::records::attachments::{AttachRecord, Attachments, calls, choose_transport, refuse_if_attached};
use crate::records::exports::{ExportRecord, ExportTable, open_image, refuse_if_exported, snapshot_of};
use crate::records::fence::{Change, Cidr, FenceError, Fences};
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

/// A key named by its id alone is one of this daemon's key directory, which only an operator
/// uses; any other caller carries the key itself (a CSI request's secret), and so shows it holds
/// the volume's current key before it may open or rewrap it.
fn key_carried(caller: &Caller, key: Option<&pb::KeyRef>, field: &str) -> Result<(), Status> {
    if caller.is_operator() || key.is_some_and(|k| !k.key.is_empty()) {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "{caller} may not use the key directory: {field} must carry the key itself (only an operator names a key by id alone)"
    )))
}

/// The fence list as the API answers it.
fn fence_response(list: &crate::records::fence::FenceList, connections_cut: u64) -> pb::FenceResponse {
    pb::FenceResponse {
        cidrs: list.keys().map(ToString::to_string).collect(),
        connections_cut,
        fences: list
            .iter()
            .map(|(c, by)| pb::FencedBlock { cidr: c.to_string(), by: by.iter().cloned().collect() })
            .collect(),
    }
}

fn limits_msg(l: QosLimits) -> pb::VolumeLimits {
    pb::VolumeLimits {
        iops: l.iops,
        read_iops: l.read_iops,
        write_iops: l.write_iops,
        bps: l.bps,
        read_bps: l.read_bps,
        write_bps: l.write_bps,
        burst_ms: l.burst_ms,
    }
}

fn limits_of(l: Option<pb::VolumeLimits>) -> QosLimits {
    let l = l.unwrap_or_default();
    QosLimits {
        iops: l.iops,
        read_iops: l.read_iops,
        write_iops: l.write_iops,
        bps: l.bps,
        read_bps: l.read_bps,
        write_bps: l.write_bps,
        burst_ms: l.burst_ms,
    }
}

fn group_msg(g: ferrite_engine::GroupInfo) -> pb::Group {
    pb::Group { name: g.name, id: g.id, volumes: g.volumes, created_unix: g.created_unix }
}

fn group_snapshot_msg(g: ferrite_engine::GroupSnapshotInfo) -> pb::GroupSnapshot {
    pb::GroupSnapshot {
        name: g.name,
        id: g.id,
        group: g.group.unwrap_or_default(),
        members: g
            .snapshots
            .into_iter()
            .map(|(snapshot, volume)| pb::GroupSnapshotMember { snapshot, volume })
            .collect(),
        created_unix: g.created_unix,
    }
}

fn snapshot_msg(s: ferrite_engine::SnapshotInfo) -> pb::Snapshot {
    pb::Snapshot {
        name: s.name,
        id: s.id,
        volume: s.volume.unwrap_or_default(),
        volume_id: s.volume_id,
        size: s.size,
        created_unix: s.created_unix,
        layer_bytes: s.layer_bytes,
        reclaimable_on_delete: s.reclaimable_on_delete,
    }
}

impl AdminService {
    /// Runs an engine call on the blocking pool.
    async fn engine<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Pool) -> Result<T, ferrite_engine::Error> + Send + 'static,
    ) -> Result<T, Status> {
        let pool = Arc::clone(&self.pool);
        blocking(move || f(&pool)).await
    }

    /// The NBD TCP listener's address (empty without one).
    fn nbd_tcp(&self) -> String {
        self.cfg.nbd_listen.map(|a| a.to_string()).unwrap_or_default()
    }

    fn export_msg(&self, r: &ExportRecord) -> pb::Export {
        let sock = self.cfg.nbd_socket.display().to_string();
        let mut uris = vec![format!("nbd+unix:///{}?socket={sock}", r.name)];
        let tcp = self.nbd_tcp();
        if !tcp.is_empty() {
            let scheme = if self.cfg.nbd_tls == ferrite_nbd::tls::TlsMode::Require { "nbds" } else { "nbd" };
            uris.push(format!("{scheme}://{tcp}/{}", r.name));
        }
        pb::Export {
            name: r.name.clone(),
            volume: r.volume.clone(),
            read_only: r.read_only,
            unix_socket: sock,
            tcp_address: tcp,
            uris,
            allow: r.allow.clone(),
        }
    }

    fn attachment_msg(&self, r: &AttachRecord, detail: String) -> pb::Attachment {
        if r.remote.is_some() {
            return calls::remote_message(r, detail);
        }
        r.message(detail, open_image(&self.pool, &r.volume).and_then(|v| v.size()).unwrap_or(0))
    }

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

    /// Fences (`fence`) or lifts the blocks of `req` as `caller` (and the request's owner).
    fn change_fences(&self, caller: &Caller, req: &pb::FenceRequest, fence: bool) -> Result<pb::FenceResponse, Status> {
        let parsed =
            req.cidrs.iter().map(|c| c.parse()).collect::<Result<Vec<Cidr>, _>>().map_err(Status::invalid_argument)?;
        let maker = crate::records::fence::maker(caller.is_operator(), &req.owner).map_err(Status::invalid_argument)?;
        let change =
            if fence { Change::Fence(&parsed) } else { Change::Lift { cidrs: &parsed, all: caller.is_operator() } };
        let (list, cut) = self.fences.update(change, &maker).map_err(|e| match e {
            FenceError::NotYours { .. } => Status::permission_denied(e.to_string()),
            FenceError::Save(_) => Status::internal(e.to_string()),
        })?;
        tracing::info!(fenced = fence, cidrs = ?req.cidrs, maker, connections_cut = cut, "fence list changed");
        Ok(fence_response(&list, cut))
    }

    async fn volume_msg(&self, info: ferrite_engine::VolumeInfo) -> pb::Volume {
        let exports = self.exports.of_volume(&info.name).await;
        let stats = self.pool.qos_stats(&info.name).unwrap_or_default();
        let job = self.rotations.job(&info.name);
        pb::Volume {
            limits: Some(limits_msg(info.qos)),
            ops_per_sec: stats.ops_per_sec,
            bytes_per_sec: stats.bytes_per_sec,
            throttled_requests: stats.throttled_ops,
            throttled_seconds: stats.throttled_wait.as_secs_f64(),
            name: info.name,
            id: info.id,
            size: info.size,
            allocated: info.allocated,
            created_unix: info.created_unix,
            exports,
            exclusive: info.exclusive,
            chain_depth: info.chain_depth as u64,
            notes: Vec::new(),
            read_only: info.read_only,
            encryption: crate::records::keys::encryption_msg(info.encryption, job, &self.keys),
        }
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

    /// Refuses a rekey of a synchronous replica here: its primary's rekey reaches it.
    fn refuse_if_member(&self, volume: &str) -> Result<(), Status> {
        match self.sync.records.get(volume) {
            Some(m) if self.sync.primary(volume).is_none() => Err(Status::failed_precondition(format!(
                "volume {volume:?} is a synchronous replica here: rekey it on its primary, {}",
                m.primary
            ))),
            _ => Ok(()),
        }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn scrub_pool(
        &self,
        _: Request<pb::ScrubPoolRequest>,
    ) -> Result<Response<JobStream<pb::ScrubPoolProgress>>, Status> {
        let pool = Arc::clone(&self.pool);
        Ok(Response::new(stream_job(move |send| {
            let msg = |p: ferrite_engine::ScrubProgress| pb::ScrubPoolProgress {
                checked_bytes: p.checked_bytes,
                total_bytes: p.total_bytes,
                damaged_blocks: p.damaged_blocks,
                ..Default::default()
            };
            let r = pool.scrub(&mut |p| send(msg(p))).map_err(status)?;
            tracing::info!(checked = r.checked_bytes, damaged = r.damaged.len(), "scrub finished");
            Ok(pb::ScrubPoolProgress {
                checked_bytes: r.checked_bytes,
                total_bytes: r.checked_bytes,
                damaged_blocks: r.damaged.len() as u64,
                done: true,
                damaged: r
                    .damaged
                    .into_iter()
                    .map(|d| pb::DamagedBlock { offset: d.offset, pool_block: d.pool_block, images: d.images })
                    .collect(),
            })
        })))
    }

    async fn defrag_volume(
        &self,
        req: Request<pb::DefragVolumeRequest>,
    ) -> Result<Response<JobStream<pb::DefragVolumeProgress>>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        let pool = Arc::clone(&self.pool);
        Ok(Response::new(stream_job(move |send| {
            let msg = |p: ferrite_engine::DefragProgress| pb::DefragVolumeProgress {
                done_bytes: p.done_bytes,
                total_bytes: p.total_bytes,
                moved_bytes: p.moved_bytes,
                ..Default::default()
            };
            let r = pool.defrag_volume(&name, |p| send(msg(p))).map_err(status)?;
            tracing::info!(volume = %name, moved = r.moved_bytes, runs_before = r.runs_before,
                runs_after = r.runs_after, "defrag finished");
            Ok(pb::DefragVolumeProgress {
                done_bytes: r.mapped_bytes,
                total_bytes: r.mapped_bytes,
                moved_bytes: r.moved_bytes,
                done: true,
                runs_before: r.runs_before,
                runs_after: r.runs_after,
                mapped_bytes: r.mapped_bytes,
            })
        })))
    }

    async fn create_volume(&self, req: Request<pb::CreateVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        require("name", &r.name)?;
        if r.encryption.is_some() {
            key_carried(&caller, r.encryption.as_ref(), "encryption")?;
        }
        if r.size == 0 {
            return Err(Status::invalid_argument("size is required"));
        }
        let limits = limits_of(r.limits);
        let kek = match r.encryption {
            Some(mut k) => {
                if k.key_id.is_empty() && k.key.is_empty() {
                    k.key_id = crate::records::keys::DEFAULT_KEY.into();
                }
                Some(self.keys.kek(&k, true)?)
            }
            None => None,
        };
        let info = self
            .engine(move |p| {
                let info = match &kek {
                    Some(kek) => p.create_encrypted_volume(&r.name, r.size, kek)?,
                    None => p.create_volume(&r.name, r.size)?,
                };
                if limits.is_unlimited() { Ok(info) } else { p.set_qos(&r.name, limits) }
            })
            .await?;
        tracing::info!(volume = %info.name, size = info.size, "volume created");
        Ok(Response::new(self.volume_msg(info).await))
    }

    async fn list_volumes(
        &self,
        _: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let infos = self.engine(|p| Ok(p.volumes())).await?;
        let mut volumes = Vec::with_capacity(infos.len());
        for i in infos {
            volumes.push(self.volume_msg(i).await);
        }
        Ok(Response::new(pb::ListVolumesResponse { volumes }))
    }

    async fn get_volume(&self, req: Request<pb::GetVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        let info = self.engine(move |p| p.volume_info(&name)).await?;
        Ok(Response::new(self.volume_msg(info).await))
    }

    async fn grow_volume(&self, req: Request<pb::GrowVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        // A synchronous volume's members grow first (refused on a member: grow the primary).
        self.sync.grow(&r.name, r.new_size).await?;
        let info = self.engine(move |p| p.grow_volume(&r.name, r.new_size)).await?;
        tracing::info!(volume = %info.name, size = info.size, "volume grown");
        let notes = self.attachments.resize(&info.name, info.size).await;
        let mut msg = self.volume_msg(info).await;
        msg.notes = notes;
        Ok(Response::new(msg))
    }

    async fn set_volume_limits(
        &self,
        req: Request<pb::SetVolumeLimitsRequest>,
    ) -> Result<Response<pb::Volume>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        let limits = limits_of(r.limits);
        let info = self.engine(move |p| p.set_qos(&r.name, limits)).await?;
        Ok(Response::new(self.volume_msg(info).await))
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        if let Some(m) = self.sync.records.get(&name) {
            return Err(Status::failed_precondition(format!(
                "volume {name:?} has synchronous members (generation {}, primary {}): remove them first \
                 (ferrite replica remove on the primary)",
                m.generation, m.primary
            )));
        }
        if let Some(r) = self.replication.relations.get(&name) {
            return Err(Status::failed_precondition(format!(
                "volume {name:?} is replicated ({} of {:?} on {}): disable its replication first",
                r.role.as_str(),
                r.remote,
                r.peer
            )));
        }
        // Held across the deletion so that nothing attaches or exports it meanwhile.
        let live = self.attachments.lock().await;
        refuse_if_attached(&live, &format!("volume {name:?}"), |v| v == name)?;
        let records = self.exports.lock().await;
        refuse_if_exported(&records, &format!("volume {name:?}"), |r| r.volume == name)?;
        let n = name.clone();
        self.engine(move |p| p.delete_volume(&n)).await?;
        drop((records, live));
        tracing::info!(volume = %name, "volume deleted");
        Ok(Response::new(pb::DeleteVolumeResponse {}))
    }

    async fn clone_volume(&self, req: Request<pb::CloneVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        let source = r.source.ok_or_else(|| Status::invalid_argument("source (snapshot or volume) is required"))?;
        let name = r.name;
        let info = self
            .engine(move |p| match &source {
                pb::clone_volume_request::Source::Snapshot(s) => p.clone_volume(Image::Snapshot(s), &name),
                pb::clone_volume_request::Source::Volume(v) => p.clone_volume(Image::Volume(v), &name),
            })
            .await?;
        Ok(Response::new(self.volume_msg(info).await))
    }

    async fn unlock_volume(&self, req: Request<pb::UnlockVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        require("name", &r.name)?;
        key_carried(&caller, r.key.as_ref(), "key")?;
        let given = match r.key.filter(|k| !k.key.is_empty()) {
            Some(k) => Some(self.keys.kek(&k, false)?),
            None => None,
        };
        let keys = self.keys.clone();
        let name = r.name.clone();
        let info = self
            .engine(move |p| {
                let lookup = keys.lookup(given.as_ref());
                if p.volume_info(&name).is_ok() {
                    p.unlock(Image::Volume(&name), lookup)?;
                    p.volume_info(&name).map(Some)
                } else {
                    p.unlock(Image::Snapshot(&name), lookup).map(|()| None)
                }
            })
            .await?;
        self.exports.revive(&r.name).await;
        self.rotations.resume(&r.name);
        match info {
            Some(info) => Ok(Response::new(self.volume_msg(info).await)),
            // A snapshot: what it is, unlocked.
            None => Ok(Response::new(pb::Volume {
                name: r.name,
                encryption: Some(pb::VolumeEncryption { unlocked: true, ..Default::default() }),
                ..Default::default()
            })),
        }
    }

    async fn rekey_volume(&self, req: Request<pb::RekeyVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        require("name", &r.name)?;
        key_carried(&caller, r.old_key.as_ref(), "old_key")?;
        if !r.data_key {
            key_carried(&caller, r.new_key.as_ref(), "new_key")?;
        }
        self.refuse_if_member(&r.name)?;
        let old = match r.old_key.filter(|k| !k.key.is_empty()) {
            Some(k) => Some(self.keys.kek(&k, false)?),
            None => None,
        };
        if r.data_key {
            let name = r.name.clone();
            let info = self.engine(move |p| p.volume_info(&name)).await?;
            let enc = info
                .encryption
                .as_ref()
                .ok_or_else(|| Status::failed_precondition(format!("volume {:?} is not encrypted", r.name)))?;
            let kek = match old {
                Some(k) => k,
                None => self.keys.kek(&pb::KeyRef { key_id: enc.key_id.clone(), key: Vec::new() }, false)?,
            };
            self.rotations.start(&r.name, kek).await?;
            let name = r.name.clone();
            let info = self.engine(move |p| p.volume_info(&name)).await?;
            tracing::info!(volume = %info.name, "data key rotation started");
            return Ok(Response::new(self.volume_msg(info).await));
        }
        let mut new = r.new_key.unwrap_or_default();
        if new.key_id.is_empty() && new.key.is_empty() {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            new.key_id = format!("{}-{}", r.name, now.as_secs());
        }
        let new = self.keys.kek(&new, true)?;
        let keys = self.keys.clone();
        let name = r.name;
        let info = self
            .engine(move |p| {
                p.rewrap_volume(&name, keys.lookup(old.as_ref()), &new)?;
                p.volume_info(&name)
            })
            .await?;
        self.sync.rewrapped(&info.name).await?;
        tracing::info!(volume = %info.name, "volume rekeyed");
        Ok(Response::new(self.volume_msg(info).await))
    }

    async fn create_snapshot(&self, req: Request<pb::CreateSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        let r = req.into_inner();
        require("volume", &r.volume)?;
        require("name", &r.name)?;
        // A synchronous volume's snapshot is taken on every copy, at one point of its writes.
        if let Some(primary) = self.sync.primary(&r.volume) {
            let pool = Arc::clone(&self.pool);
            let s = tokio::task::spawn_blocking(move || primary.snapshot(&pool, &r.name))
                .await
                .map_err(|e| Status::internal(format!("snapshot task failed: {e}")))??;
            return Ok(Response::new(snapshot_msg(s)));
        }
        if let Some(m) = self.sync.records.get(&r.volume) {
            return Err(Status::failed_precondition(format!(
                "volume {:?} is a synchronous copy here: snapshot it on its primary, {}",
                r.volume, m.primary
            )));
        }
        let s = self.engine(move |p| p.create_snapshot(&r.volume, &r.name)).await?;
        Ok(Response::new(snapshot_msg(s)))
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let vol = req.into_inner().volume;
        let list = self.engine(move |p| p.snapshots(Some(vol.as_str()).filter(|v| !v.is_empty()))).await?;
        Ok(Response::new(pb::ListSnapshotsResponse { snapshots: list.into_iter().map(snapshot_msg).collect() }))
    }

    async fn get_snapshot(&self, req: Request<pb::GetSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        let s = self.engine(move |p| p.snapshot_info(&name)).await?;
        Ok(Response::new(snapshot_msg(s)))
    }

    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        // Held across the deletion so no export of it can start meanwhile.
        let live = self.attachments.lock().await;
        refuse_if_attached(&live, &format!("snapshot {name:?}"), |v| snapshot_of(v) == Some(name.as_str()))?;
        let records = self.exports.lock().await;
        refuse_if_exported(&records, &format!("snapshot {name:?}"), |r| r.snapshot() == Some(name.as_str()))?;
        let n = name.clone();
        self.engine(move |p| p.delete_snapshot(&n)).await?;
        drop((records, live));
        Ok(Response::new(pb::DeleteSnapshotResponse {}))
    }

    async fn changed_ranges(
        &self,
        req: Request<pb::ChangedRangesRequest>,
    ) -> Result<Response<pb::ChangedRangesResponse>, Status> {
        use pb::changed_ranges_request::Image as I;
        let r = req.into_inner();
        let image = r.image.ok_or_else(|| Status::invalid_argument("image (volume or snapshot) is required"))?;
        let since = r.since;
        let ranges = self
            .engine(move |p| {
                let since = Some(since.as_str()).filter(|s| !s.is_empty());
                match &image {
                    I::Volume(v) => p.changed_ranges(Image::Volume(v), since),
                    I::Snapshot(s) => p.changed_ranges(Image::Snapshot(s), since),
                }
            })
            .await?;
        let bytes = ranges.iter().map(|r| r.1).sum();
        let ranges = ranges.into_iter().map(|(offset, length)| pb::Range { offset, length }).collect();
        Ok(Response::new(pb::ChangedRangesResponse { ranges, bytes }))
    }

    async fn enable_replication(
        &self,
        req: Request<pb::EnableReplicationRequest>,
    ) -> Result<Response<pb::Replication>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        require("volume", &r.volume)?;
        self.peer_holds_role(&caller, &r.peer, "EnableReplication").await?;
        self.replication
            .enable(&r.volume, &r.peer, &r.replica, r.interval_secs, r.group, r.snapshots)
            .await
            .map(Response::new)
    }

    async fn disable_replication(
        &self,
        req: Request<pb::ReplicationRequest>,
    ) -> Result<Response<pb::Replication>, Status> {
        self.replication.disable(&req.into_inner().volume).await.map(Response::new)
    }

    async fn sync_replication(
        &self,
        req: Request<pb::ReplicationRequest>,
    ) -> Result<Response<pb::SyncReplicationResponse>, Status> {
        self.replication.sync(&req.into_inner().volume).await.map(Response::new)
    }

    async fn demote_replication(
        &self,
        req: Request<pb::ReplicationRequest>,
    ) -> Result<Response<pb::Replication>, Status> {
        self.replication.demote(&req.into_inner().volume).await.map(Response::new)
    }

    async fn promote_replication(
        &self,
        req: Request<pb::PromoteReplicationRequest>,
    ) -> Result<Response<pb::Replication>, Status> {
        let r = req.into_inner();
        let promoted = self.replication.promote(&r.volume, r.force).await?;
        self.open_promoted(&r.volume).await;
        Ok(Response::new(promoted))
    }

    async fn resync_replication(
        &self,
        req: Request<pb::ReplicationRequest>,
    ) -> Result<Response<pb::Replication>, Status> {
        self.replication.resync(&req.into_inner().volume).await.map(Response::new)
    }

    async fn list_replications(
        &self,
        req: Request<pb::ListReplicationsRequest>,
    ) -> Result<Response<pb::ListReplicationsResponse>, Status> {
        let replications = self.replication.list(&req.into_inner().volume)?;
        Ok(Response::new(pb::ListReplicationsResponse { replications }))
    }

    async fn add_sync_replica(
        &self,
        req: Request<pb::AddSyncReplicaRequest>,
    ) -> Result<Response<pb::SyncVolume>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        require("volume", &r.volume)?;
        require("peer", &r.peer)?;
        self.peer_holds_role(&caller, &r.peer, "AddSyncReplica").await?;
        self.refuse_if_rotating(&r.volume)?;
        self.sync.add(&r.volume, &r.peer, r.witness).await.map(Response::new)
    }

    async fn remove_sync_replica(
        &self,
        req: Request<pb::RemoveSyncReplicaRequest>,
    ) -> Result<Response<pb::SyncVolume>, Status> {
        let r = req.into_inner();
        require("volume", &r.volume)?;
        require("peer", &r.peer)?;
        self.sync.remove(&r.volume, &r.peer).await.map(Response::new)
    }

    async fn promote_sync_replica(
        &self,
        req: Request<pb::PromoteReplicationRequest>,
    ) -> Result<Response<pb::SyncVolume>, Status> {
        let r = req.into_inner();
        require("volume", &r.volume)?;
        let promoted = self.sync.promote(&r.volume, r.force).await?;
        self.open_promoted(&r.volume).await;
        Ok(Response::new(promoted))
    }

    async fn list_sync_replicas(
        &self,
        req: Request<pb::ListReplicationsRequest>,
    ) -> Result<Response<pb::ListSyncReplicasResponse>, Status> {
        let v = req.into_inner().volume;
        let volumes = self.sync.list((!v.is_empty()).then_some(v.as_str()));
        Ok(Response::new(pb::ListSyncReplicasResponse { volumes }))
    }

    async fn create_group(&self, req: Request<pb::CreateGroupRequest>) -> Result<Response<pb::Group>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        let g = self
            .engine(move |p| p.create_group(&r.name, &r.volumes.iter().map(String::as_str).collect::<Vec<_>>()))
            .await?;
        Ok(Response::new(group_msg(g)))
    }

    async fn update_group(&self, req: Request<pb::UpdateGroupRequest>) -> Result<Response<pb::Group>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        let g = self
            .engine(move |p| {
                let add: Vec<&str> = r.add.iter().map(String::as_str).collect();
                let remove: Vec<&str> = r.remove.iter().map(String::as_str).collect();
                p.update_group(&r.name, &add, &remove)
            })
            .await?;
        Ok(Response::new(group_msg(g)))
    }

    async fn delete_group(
        &self,
        req: Request<pb::DeleteGroupRequest>,
    ) -> Result<Response<pb::DeleteGroupResponse>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        self.engine(move |p| p.delete_group(&name)).await?;
        Ok(Response::new(pb::DeleteGroupResponse {}))
    }

    async fn list_groups(&self, _: Request<pb::ListGroupsRequest>) -> Result<Response<pb::ListGroupsResponse>, Status> {
        let groups = self.engine(|p| Ok(p.groups())).await?;
        Ok(Response::new(pb::ListGroupsResponse { groups: groups.into_iter().map(group_msg).collect() }))
    }

    async fn create_group_snapshot(
        &self,
        req: Request<pb::CreateGroupSnapshotRequest>,
    ) -> Result<Response<pb::GroupSnapshot>, Status> {
        let r = req.into_inner();
        require("group", &r.group)?;
        require("name", &r.name)?;
        let g = self.engine(move |p| p.create_group_snapshot(&r.group, &r.name)).await?;
        Ok(Response::new(group_snapshot_msg(g)))
    }

    async fn list_group_snapshots(
        &self,
        req: Request<pb::ListGroupSnapshotsRequest>,
    ) -> Result<Response<pb::ListGroupSnapshotsResponse>, Status> {
        let group = req.into_inner().group;
        let list = self.engine(move |p| p.group_snapshots(Some(group.as_str()).filter(|g| !g.is_empty()))).await?;
        Ok(Response::new(pb::ListGroupSnapshotsResponse {
            snapshots: list.into_iter().map(group_snapshot_msg).collect(),
        }))
    }

    async fn delete_group_snapshot(
        &self,
        req: Request<pb::DeleteGroupSnapshotRequest>,
    ) -> Result<Response<pb::DeleteGroupSnapshotResponse>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        let prefix = format!("{name}.");
        let live = self.attachments.lock().await;
        refuse_if_attached(&live, &format!("a member of group snapshot {name:?}"), |v| {
            snapshot_of(v).is_some_and(|s| s.starts_with(&prefix))
        })?;
        let records = self.exports.lock().await;
        refuse_if_exported(&records, &format!("a member of group snapshot {name:?}"), |r| {
            r.snapshot().is_some_and(|s| s.starts_with(&prefix))
        })?;
        self.engine(move |p| p.delete_group_snapshot(&name)).await?;
        drop((records, live));
        Ok(Response::new(pb::DeleteGroupSnapshotResponse {}))
    }

    async fn clone_group_snapshot(
        &self,
        req: Request<pb::CloneGroupSnapshotRequest>,
    ) -> Result<Response<pb::Group>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        require("new_group", &r.new_group)?;
        let g = self.engine(move |p| p.clone_group_snapshot(&r.name, &r.new_group)).await?;
        Ok(Response::new(group_msg(g)))
    }

    async fn start_export(&self, req: Request<pb::StartExportRequest>) -> Result<Response<pb::Export>, Status> {
        let r = req.into_inner();
        require("volume", &r.volume)?;
        let name = if r.name.is_empty() { r.volume.clone() } else { r.name.clone() };
        if name.len() > 4096 {
            return Err(Status::invalid_argument("export name longer than 4096 bytes"));
        }
        let read_only = r.read_only || r.volume.contains('@');
        let rec = ExportRecord { name, volume: r.volume, read_only, allow: r.allow };
        self.exports.ensure(&rec).await?;
        Ok(Response::new(self.export_msg(&rec)))
    }

    async fn stop_export(
        &self,
        req: Request<pb::StopExportRequest>,
    ) -> Result<Response<pb::StopExportResponse>, Status> {
        let name = req.into_inner().name;
        require("name", &name)?;
        self.exports.stop(&name).await?;
        Ok(Response::new(pb::StopExportResponse {}))
    }

    async fn list_exports(
        &self,
        _: Request<pb::ListExportsRequest>,
    ) -> Result<Response<pb::ListExportsResponse>, Status> {
        let records = self.exports.list().await;
        Ok(Response::new(pb::ListExportsResponse { exports: records.iter().map(|r| self.export_msg(r)).collect() }))
    }

    async fn pool_status(&self, _: Request<pb::PoolStatusRequest>) -> Result<Response<pb::PoolStatusResponse>, Status> {
        let s = self.engine(|p| Ok(p.stats())).await?;
        Ok(Response::new(pb::PoolStatusResponse {
            uuid: s.uuid.to_string(),
            path: self.cfg.pool_path.display().to_string(),
            size: s.size,
            used: s.used,
            free: s.free,
            live: s.live,
            reclaimable: s.reclaimable,
            segment_size: s.segment_size,
            segments: s.segments,
            segments_free: s.segments_free,
            volumes: s.volumes as u64,
            log_seq: s.log_seq,
            generation: s.generation,
            client_bytes_written: s.client_bytes_written,
            media_bytes_written: s.media_bytes_written,
            nbd_connections: self.nbd.stats.connections_open.load(std::sync::atomic::Ordering::Relaxed),
            cleaner_active: s.cleaner_active,
            cleaner_runs: s.cleaner_runs,
            cleaner_segments_cleaned: s.cleaner_segments_cleaned,
            cleaner_bytes_moved: s.cleaner_bytes_moved,
            failed: s.failed,
            backing_free: backing_free(&self.cfg.pool_path),
            provisionable: s.provision_cap.map(|cap| cap.saturating_sub(s.provisioned)),
            zone: self.cfg.zone.clone(),
            region: self.cfg.region.clone(),
        }))
    }

    async fn version(&self, _: Request<pb::VersionRequest>) -> Result<Response<pb::VersionResponse>, Status> {
        use ferrite_engine::format::{FORMAT_VERSION, OLDEST_FORMAT};
        let upgraded_from = self.engine(|p| Ok(p.recovery_report().upgraded_from.unwrap_or(0))).await?;
        Ok(Response::new(pb::VersionResponse {
            version: ferrite_proto::version::VERSION.into(),
            format_version: FORMAT_VERSION,
            oldest_format: OLDEST_FORMAT,
            upgraded_from,
        }))
    }

    async fn reclaim_pool(
        &self,
        _: Request<pb::ReclaimPoolRequest>,
    ) -> Result<Response<pb::ReclaimPoolResponse>, Status> {
        let (before, r, after) = self
            .engine(|p| {
                let before = p.stats();
                let r = p.reclaim()?;
                Ok((before, r, p.stats()))
            })
            .await?;
        tracing::info!(cleaned = r.segments_cleaned, freed = r.segments_freed, "reclaim ran");
        Ok(Response::new(pb::ReclaimPoolResponse {
            segments_cleaned: r.segments_cleaned,
            bytes_moved: r.blocks_moved * 4096,
            segments_freed: r.segments_freed,
            used_before: before.used,
            used_after: after.used,
            live: after.live,
        }))
    }

    async fn attach_volume(&self, req: Request<pb::AttachVolumeRequest>) -> Result<Response<pb::Attachment>, Status> {
        let r = req.into_inner();
        require("volume", &r.volume)?;
        if !r.remote.is_empty() {
            return Ok(Response::new(calls::attach_remote(&self.attachments, r).await?));
        }
        crate::records::keys::refuse_if_locked(&self.pool, &r.volume)?;
        let (transport, detail) = choose_transport(&r.transport)?;
        let mut opts = self.cfg.ublk;
        if r.queues != 0 {
            opts.queues = u16::try_from(r.queues).unwrap_or(u16::MAX);
        }
        if r.depth != 0 {
            opts.depth = u16::try_from(r.depth).unwrap_or(u16::MAX);
        }
        opts.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
        let rec = self.attachments.attach(&self.pool, &self.exports, &r.volume, transport, opts).await?;
        Ok(Response::new(self.attachment_msg(&rec, detail)))
    }

    async fn detach_volume(
        &self,
        req: Request<pb::DetachVolumeRequest>,
    ) -> Result<Response<pb::DetachVolumeResponse>, Status> {
        Ok(Response::new(calls::detach(&self.attachments, Some(&self.exports), req.into_inner()).await?))
    }

    async fn resize_attachment(
        &self,
        req: Request<pb::ResizeAttachmentRequest>,
    ) -> Result<Response<pb::Attachment>, Status> {
        Ok(Response::new(calls::resize(&self.attachments, req.into_inner()).await?))
    }

    async fn list_attachments(
        &self,
        _: Request<pb::ListAttachmentsRequest>,
    ) -> Result<Response<pb::ListAttachmentsResponse>, Status> {
        let list = self.attachments.list().await;
        let attachments = list.iter().map(|r| self.attachment_msg(r, String::new())).collect();
        Ok(Response::new(pb::ListAttachmentsResponse { attachments }))
    }

    async fn fence_networks(&self, req: Request<pb::FenceRequest>) -> Result<Response<pb::FenceResponse>, Status> {
        self.change_fences(&caller_of(&req)?, req.get_ref(), true).map(Response::new)
    }

    async fn unfence_networks(&self, req: Request<pb::FenceRequest>) -> Result<Response<pb::FenceResponse>, Status> {
        self.change_fences(&caller_of(&req)?, req.get_ref(), false).map(Response::new)
    }

    async fn list_fences(&self, _: Request<pb::ListFencesRequest>) -> Result<Response<pb::FenceResponse>, Status> {
        Ok(Response::new(fence_response(&self.fences.list(), 0)))
    }

    async fn publish_volume(
        &self,
        req: Request<pb::PublishVolumeRequest>,
    ) -> Result<Response<pb::Publication>, Status> {
        let r = req.into_inner();
        let allow = crate::records::publications::allow_of(&r)?;
        // A volume that does not exist is NotFound, not an export that fails later.
        let name = r.volume.clone();
        self.engine(move |p| p.volume_info(&name)).await?;
        crate::records::publications::publish(&self.exports, &r, allow, &self.nbd_tcp()).await.map(Response::new)
    }

    async fn unpublish_volume(
        &self,
        req: Request<pb::UnpublishVolumeRequest>,
    ) -> Result<Response<pb::UnpublishVolumeResponse>, Status> {
        crate::records::publications::unpublish(&self.exports, &req.into_inner().volume).await?;
        Ok(Response::new(pb::UnpublishVolumeResponse {}))
    }

    async fn list_publications(
        &self,
        _: Request<pb::ListPublicationsRequest>,
    ) -> Result<Response<pb::ListPublicationsResponse>, Status> {
        let tcp = self.nbd_tcp();
        let publications = crate::records::publications::list(&self.exports, &tcp).await;
        Ok(Response::new(pb::ListPublicationsResponse { publications }))
    }

    async fn list_clients(
        &self,
        _: Request<pb::ListClientsRequest>,
    ) -> Result<Response<pb::ListClientsResponse>, Status> {
        let clients = self
            .fences
            .clients()
            .into_iter()
            .map(|c| pb::Client {
                id: c.id,
                address: c.peer.to_string(),
                listener: c.listener.into(),
                connected_unix: c.since_unix,
            })
            .collect();
        Ok(Response::new(pb::ListClientsResponse { clients }))
    }
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

/// Free bytes of the filesystem under a pool that is a regular file (None for a device, or
/// when the filesystem cannot say).
fn backing_free(pool: &std::path::Path) -> Option<u64> {
    if !std::fs::metadata(pool).ok()?.is_file() {
        return None;
    }
    let s = rustix::fs::statvfs(pool).ok()?;
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}
