//! The pool: status, scrub, reclaim, the daemon's version, and the clients connected now.

use std::sync::Arc;

use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::base::rpc::status;

use super::{AdminService, JobStream, stream_job};

pub(super) async fn scrub_pool(
    admin: &AdminService,
    _: Request<pb::ScrubPoolRequest>,
) -> Result<Response<JobStream<pb::ScrubPoolProgress>>, Status> {
    let pool = Arc::clone(&admin.pool);
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

pub(super) async fn pool_status(
    admin: &AdminService,
    _: Request<pb::PoolStatusRequest>,
) -> Result<Response<pb::PoolStatusResponse>, Status> {
    let s = admin.engine(|p| Ok(p.stats())).await?;
    Ok(Response::new(pb::PoolStatusResponse {
        uuid: s.uuid.to_string(),
        path: admin.cfg.pool_path.display().to_string(),
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
        nbd_connections: admin.nbd.stats.connections_open.load(std::sync::atomic::Ordering::Relaxed),
        cleaner_active: s.cleaner_active,
        cleaner_runs: s.cleaner_runs,
        cleaner_segments_cleaned: s.cleaner_segments_cleaned,
        cleaner_bytes_moved: s.cleaner_bytes_moved,
        failed: s.failed,
        backing_free: backing_free(&admin.cfg.pool_path),
        provisionable: s.provision_cap.map(|cap| cap.saturating_sub(s.provisioned)),
        zone: admin.cfg.zone.clone(),
        region: admin.cfg.region.clone(),
    }))
}

pub(super) async fn version(
    admin: &AdminService,
    _: Request<pb::VersionRequest>,
) -> Result<Response<pb::VersionResponse>, Status> {
    use ferrite_engine::format::{FORMAT_VERSION, OLDEST_FORMAT};
    let upgraded_from = admin.engine(|p| Ok(p.recovery_report().upgraded_from.unwrap_or(0))).await?;
    Ok(Response::new(pb::VersionResponse {
        version: ferrite_proto::version::VERSION.into(),
        format_version: FORMAT_VERSION,
        oldest_format: OLDEST_FORMAT,
        upgraded_from,
    }))
}

pub(super) async fn reclaim_pool(
    admin: &AdminService,
    _: Request<pb::ReclaimPoolRequest>,
) -> Result<Response<pb::ReclaimPoolResponse>, Status> {
    let (before, r, after) = admin
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

pub(super) async fn list_clients(
    admin: &AdminService,
    _: Request<pb::ListClientsRequest>,
) -> Result<Response<pb::ListClientsResponse>, Status> {
    let clients = admin
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

/// Free bytes of the filesystem under a pool that is a regular file (None for a device, or
/// when the filesystem cannot say).
fn backing_free(pool: &std::path::Path) -> Option<u64> {
    if !std::fs::metadata(pool).ok()?.is_file() {
        return None;
    }
    let s = rustix::fs::statvfs(pool).ok()?;
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}
