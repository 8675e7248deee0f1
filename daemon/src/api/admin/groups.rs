//! Volume groups and their crash-consistent group snapshots (and clones of those).

use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::base::error::require;
use crate::records::attachments::refuse_if_attached;
use crate::records::exports::{refuse_if_exported, snapshot_of};

use super::AdminService;

pub(super) async fn create_group(
    admin: &AdminService,
    req: Request<pb::CreateGroupRequest>,
) -> Result<Response<pb::Group>, Status> {
    let r = req.into_inner();
    require("name", &r.name)?;
    let g = admin
        .engine(move |p| p.create_group(&r.name, &r.volumes.iter().map(String::as_str).collect::<Vec<_>>()))
        .await?;
    Ok(Response::new(group_msg(g)))
}

pub(super) async fn update_group(
    admin: &AdminService,
    req: Request<pb::UpdateGroupRequest>,
) -> Result<Response<pb::Group>, Status> {
    let r = req.into_inner();
    require("name", &r.name)?;
    let g = admin
        .engine(move |p| {
            let add: Vec<&str> = r.add.iter().map(String::as_str).collect();
            let remove: Vec<&str> = r.remove.iter().map(String::as_str).collect();
            p.update_group(&r.name, &add, &remove)
        })
        .await?;
    Ok(Response::new(group_msg(g)))
}

pub(super) async fn delete_group(
    admin: &AdminService,
    req: Request<pb::DeleteGroupRequest>,
) -> Result<Response<pb::DeleteGroupResponse>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    admin.engine(move |p| p.delete_group(&name)).await?;
    Ok(Response::new(pb::DeleteGroupResponse {}))
}

pub(super) async fn list_groups(
    admin: &AdminService,
    _: Request<pb::ListGroupsRequest>,
) -> Result<Response<pb::ListGroupsResponse>, Status> {
    let groups = admin.engine(|p| Ok(p.groups())).await?;
    Ok(Response::new(pb::ListGroupsResponse { groups: groups.into_iter().map(group_msg).collect() }))
}

pub(super) async fn create_group_snapshot(
    admin: &AdminService,
    req: Request<pb::CreateGroupSnapshotRequest>,
) -> Result<Response<pb::GroupSnapshot>, Status> {
    let r = req.into_inner();
    require("group", &r.group)?;
    require("name", &r.name)?;
    let g = admin.engine(move |p| p.create_group_snapshot(&r.group, &r.name)).await?;
    Ok(Response::new(group_snapshot_msg(g)))
}

pub(super) async fn list_group_snapshots(
    admin: &AdminService,
    req: Request<pb::ListGroupSnapshotsRequest>,
) -> Result<Response<pb::ListGroupSnapshotsResponse>, Status> {
    let group = req.into_inner().group;
    let list = admin.engine(move |p| p.group_snapshots(Some(group.as_str()).filter(|g| !g.is_empty()))).await?;
    Ok(Response::new(pb::ListGroupSnapshotsResponse { snapshots: list.into_iter().map(group_snapshot_msg).collect() }))
}

pub(super) async fn delete_group_snapshot(
    admin: &AdminService,
    req: Request<pb::DeleteGroupSnapshotRequest>,
) -> Result<Response<pb::DeleteGroupSnapshotResponse>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    let prefix = format!("{name}.");
    let live = admin.attachments.lock().await;
    refuse_if_attached(&live, &format!("a member of group snapshot {name:?}"), |v| {
        snapshot_of(v).is_some_and(|s| s.starts_with(&prefix))
    })?;
    let records = admin.exports.lock().await;
    refuse_if_exported(&records, &format!("a member of group snapshot {name:?}"), |r| {
        r.snapshot().is_some_and(|s| s.starts_with(&prefix))
    })?;
    admin.engine(move |p| p.delete_group_snapshot(&name)).await?;
    drop((records, live));
    Ok(Response::new(pb::DeleteGroupSnapshotResponse {}))
}

pub(super) async fn clone_group_snapshot(
    admin: &AdminService,
    req: Request<pb::CloneGroupSnapshotRequest>,
) -> Result<Response<pb::Group>, Status> {
    let r = req.into_inner();
    require("name", &r.name)?;
    require("new_group", &r.new_group)?;
    let g = admin.engine(move |p| p.clone_group_snapshot(&r.name, &r.new_group)).await?;
    Ok(Response::new(group_msg(g)))
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
