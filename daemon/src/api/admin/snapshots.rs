//! Snapshots of one volume, and the blocks two of them differ in (changed ranges).

use std::sync::Arc;

use ferrite_engine::Image;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::base::error::require;
use crate::records::attachments::refuse_if_attached;
use crate::records::exports::{refuse_if_exported, snapshot_of};

use super::AdminService;

pub(super) async fn create_snapshot(
    admin: &AdminService,
    req: Request<pb::CreateSnapshotRequest>,
) -> Result<Response<pb::Snapshot>, Status> {
    let r = req.into_inner();
    require("volume", &r.volume)?;
    require("name", &r.name)?;
    // A synchronous volume's snapshot is taken on every copy, at one point of its writes.
    if let Some(primary) = admin.sync.primary(&r.volume) {
        let pool = Arc::clone(&admin.pool);
        let s = tokio::task::spawn_blocking(move || primary.snapshot(&pool, &r.name))
            .await
            .map_err(|e| Status::internal(format!("snapshot task failed: {e}")))??;
        return Ok(Response::new(snapshot_msg(s)));
    }
    if let Some(m) = admin.sync.records.get(&r.volume) {
        return Err(Status::failed_precondition(format!(
            "volume {:?} is a synchronous copy here: snapshot it on its primary, {}",
            r.volume, m.primary
        )));
    }
    let s = admin.engine(move |p| p.create_snapshot(&r.volume, &r.name)).await?;
    Ok(Response::new(snapshot_msg(s)))
}

pub(super) async fn list_snapshots(
    admin: &AdminService,
    req: Request<pb::ListSnapshotsRequest>,
) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
    let vol = req.into_inner().volume;
    let list = admin.engine(move |p| p.snapshots(Some(vol.as_str()).filter(|v| !v.is_empty()))).await?;
    Ok(Response::new(pb::ListSnapshotsResponse { snapshots: list.into_iter().map(snapshot_msg).collect() }))
}

pub(super) async fn get_snapshot(
    admin: &AdminService,
    req: Request<pb::GetSnapshotRequest>,
) -> Result<Response<pb::Snapshot>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    let s = admin.engine(move |p| p.snapshot_info(&name)).await?;
    Ok(Response::new(snapshot_msg(s)))
}

pub(super) async fn delete_snapshot(
    admin: &AdminService,
    req: Request<pb::DeleteSnapshotRequest>,
) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    // Held across the deletion so no export of it can start meanwhile.
    let live = admin.attachments.lock().await;
    refuse_if_attached(&live, &format!("snapshot {name:?}"), |v| snapshot_of(v) == Some(name.as_str()))?;
    let records = admin.exports.lock().await;
    refuse_if_exported(&records, &format!("snapshot {name:?}"), |r| r.snapshot() == Some(name.as_str()))?;
    let n = name.clone();
    admin.engine(move |p| p.delete_snapshot(&n)).await?;
    drop((records, live));
    Ok(Response::new(pb::DeleteSnapshotResponse {}))
}

pub(super) async fn changed_ranges(
    admin: &AdminService,
    req: Request<pb::ChangedRangesRequest>,
) -> Result<Response<pb::ChangedRangesResponse>, Status> {
    use pb::changed_ranges_request::Image as I;
    let r = req.into_inner();
    let image = r.image.ok_or_else(|| Status::invalid_argument("image (volume or snapshot) is required"))?;
    let since = r.since;
    let ranges = admin
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
