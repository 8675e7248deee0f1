//! Volumes: create, list, show, grow, limit, delete, clone, defragment, and an encrypted
//! volume's unlock and rekey (its data-key rotation runs in `records/rotations.rs`).

use std::sync::Arc;

use ferrite_engine::{Image, QosLimits};
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::authz::{Caller, caller_of};
use crate::base::error::require;
use crate::base::rpc::status;
use crate::records::attachments::refuse_if_attached;
use crate::records::exports::refuse_if_exported;

use super::{AdminService, JobStream, stream_job};

pub(super) async fn defrag_volume(
    admin: &AdminService,
    req: Request<pb::DefragVolumeRequest>,
) -> Result<Response<JobStream<pb::DefragVolumeProgress>>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    let pool = Arc::clone(&admin.pool);
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

pub(super) async fn create_volume(
    admin: &AdminService,
    req: Request<pb::CreateVolumeRequest>,
) -> Result<Response<pb::Volume>, Status> {
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
            Some(admin.keys.kek(&k, true)?)
        }
        None => None,
    };
    let info = admin
        .engine(move |p| {
            let info = match &kek {
                Some(kek) => p.create_encrypted_volume(&r.name, r.size, kek)?,
                None => p.create_volume(&r.name, r.size)?,
            };
            if limits.is_unlimited() { Ok(info) } else { p.set_qos(&r.name, limits) }
        })
        .await?;
    tracing::info!(volume = %info.name, size = info.size, "volume created");
    Ok(Response::new(admin.volume_msg(info).await))
}

pub(super) async fn list_volumes(
    admin: &AdminService,
    _: Request<pb::ListVolumesRequest>,
) -> Result<Response<pb::ListVolumesResponse>, Status> {
    let infos = admin.engine(|p| Ok(p.volumes())).await?;
    let mut volumes = Vec::with_capacity(infos.len());
    for i in infos {
        volumes.push(admin.volume_msg(i).await);
    }
    Ok(Response::new(pb::ListVolumesResponse { volumes }))
}

pub(super) async fn get_volume(
    admin: &AdminService,
    req: Request<pb::GetVolumeRequest>,
) -> Result<Response<pb::Volume>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    let info = admin.engine(move |p| p.volume_info(&name)).await?;
    Ok(Response::new(admin.volume_msg(info).await))
}

pub(super) async fn grow_volume(
    admin: &AdminService,
    req: Request<pb::GrowVolumeRequest>,
) -> Result<Response<pb::Volume>, Status> {
    let r = req.into_inner();
    require("name", &r.name)?;
    // A synchronous volume's members grow first (refused on a member: grow the primary).
    admin.sync.grow(&r.name, r.new_size).await?;
    let info = admin.engine(move |p| p.grow_volume(&r.name, r.new_size)).await?;
    tracing::info!(volume = %info.name, size = info.size, "volume grown");
    let notes = admin.attachments.resize(&info.name, info.size).await;
    let mut msg = admin.volume_msg(info).await;
    msg.notes = notes;
    Ok(Response::new(msg))
}

pub(super) async fn set_volume_limits(
    admin: &AdminService,
    req: Request<pb::SetVolumeLimitsRequest>,
) -> Result<Response<pb::Volume>, Status> {
    let r = req.into_inner();
    require("name", &r.name)?;
    let limits = limits_of(r.limits);
    let info = admin.engine(move |p| p.set_qos(&r.name, limits)).await?;
    Ok(Response::new(admin.volume_msg(info).await))
}

pub(super) async fn delete_volume(
    admin: &AdminService,
    req: Request<pb::DeleteVolumeRequest>,
) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    if let Some(m) = admin.sync.records.get(&name) {
        return Err(Status::failed_precondition(format!(
            "volume {name:?} has synchronous members (generation {}, primary {}): remove them first \
             (ferrite replica remove on the primary)",
            m.generation, m.primary
        )));
    }
    if let Some(r) = admin.replication.relations.get(&name) {
        return Err(Status::failed_precondition(format!(
            "volume {name:?} is replicated ({} of {:?} on {}): disable its replication first",
            r.role.as_str(),
            r.remote,
            r.peer
        )));
    }
    // Held across the deletion so that nothing attaches or exports it meanwhile.
    let live = admin.attachments.lock().await;
    refuse_if_attached(&live, &format!("volume {name:?}"), |v| v == name)?;
    let records = admin.exports.lock().await;
    refuse_if_exported(&records, &format!("volume {name:?}"), |r| r.volume == name)?;
    let n = name.clone();
    admin.engine(move |p| p.delete_volume(&n)).await?;
    drop((records, live));
    tracing::info!(volume = %name, "volume deleted");
    Ok(Response::new(pb::DeleteVolumeResponse {}))
}

pub(super) async fn clone_volume(
    admin: &AdminService,
    req: Request<pb::CloneVolumeRequest>,
) -> Result<Response<pb::Volume>, Status> {
    let r = req.into_inner();
    require("name", &r.name)?;
    let source = r.source.ok_or_else(|| Status::invalid_argument("source (snapshot or volume) is required"))?;
    let name = r.name;
    let info = admin
        .engine(move |p| match &source {
            pb::clone_volume_request::Source::Snapshot(s) => p.clone_volume(Image::Snapshot(s), &name),
            pb::clone_volume_request::Source::Volume(v) => p.clone_volume(Image::Volume(v), &name),
        })
        .await?;
    Ok(Response::new(admin.volume_msg(info).await))
}

pub(super) async fn unlock_volume(
    admin: &AdminService,
    req: Request<pb::UnlockVolumeRequest>,
) -> Result<Response<pb::Volume>, Status> {
    let caller = caller_of(&req)?;
    let r = req.into_inner();
    require("name", &r.name)?;
    key_carried(&caller, r.key.as_ref(), "key")?;
    let given = match r.key.filter(|k| !k.key.is_empty()) {
        Some(k) => Some(admin.keys.kek(&k, false)?),
        None => None,
    };
    let keys = admin.keys.clone();
    let name = r.name.clone();
    let info = admin
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
    admin.exports.revive(&r.name).await;
    admin.rotations.resume(&r.name);
    match info {
        Some(info) => Ok(Response::new(admin.volume_msg(info).await)),
        // A snapshot: what it is, unlocked.
        None => Ok(Response::new(pb::Volume {
            name: r.name,
            encryption: Some(pb::VolumeEncryption { unlocked: true, ..Default::default() }),
            ..Default::default()
        })),
    }
}

pub(super) async fn rekey_volume(
    admin: &AdminService,
    req: Request<pb::RekeyVolumeRequest>,
) -> Result<Response<pb::Volume>, Status> {
    let caller = caller_of(&req)?;
    let r = req.into_inner();
    require("name", &r.name)?;
    key_carried(&caller, r.old_key.as_ref(), "old_key")?;
    if !r.data_key {
        key_carried(&caller, r.new_key.as_ref(), "new_key")?;
    }
    admin.refuse_if_member(&r.name)?;
    let old = match r.old_key.filter(|k| !k.key.is_empty()) {
        Some(k) => Some(admin.keys.kek(&k, false)?),
        None => None,
    };
    if r.data_key {
        let name = r.name.clone();
        let info = admin.engine(move |p| p.volume_info(&name)).await?;
        let enc = info
            .encryption
            .as_ref()
            .ok_or_else(|| Status::failed_precondition(format!("volume {:?} is not encrypted", r.name)))?;
        let kek = match old {
            Some(k) => k,
            None => admin.keys.kek(&pb::KeyRef { key_id: enc.key_id.clone(), key: Vec::new() }, false)?,
        };
        admin.rotations.start(&r.name, kek).await?;
        let name = r.name.clone();
        let info = admin.engine(move |p| p.volume_info(&name)).await?;
        tracing::info!(volume = %info.name, "data key rotation started");
        return Ok(Response::new(admin.volume_msg(info).await));
    }
    let mut new = r.new_key.unwrap_or_default();
    if new.key_id.is_empty() && new.key.is_empty() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        new.key_id = format!("{}-{}", r.name, now.as_secs());
    }
    let new = admin.keys.kek(&new, true)?;
    let keys = admin.keys.clone();
    let name = r.name;
    let info = admin
        .engine(move |p| {
            p.rewrap_volume(&name, keys.lookup(old.as_ref()), &new)?;
            p.volume_info(&name)
        })
        .await?;
    admin.sync.rewrapped(&info.name).await?;
    tracing::info!(volume = %info.name, "volume rekeyed");
    Ok(Response::new(admin.volume_msg(info).await))
}

impl AdminService {
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
