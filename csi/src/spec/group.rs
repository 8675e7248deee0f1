//! CSI GroupController: crash-consistent group snapshots on the engine's group snapshots (one
//! point of the log for every member). Members must live on one node. A set of volumes that is
//! exactly an existing group is snapshotted as that group; volumes in no group are grouped for
//! the moment of the snapshot (group snapshots outlive their group).

use std::collections::BTreeSet;
use std::sync::Arc;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::shared::args::{no_parameters, require};
use crate::shared::ids;
use crate::shared::nodes::{NodeDirectory, admin};
use crate::spec::snapshots::snapshot_msg;

#[derive(Debug)]
pub struct GroupController {
    pub nodes: Arc<dyn NodeDirectory>,
}

/// The one under any of `names` (a CSI name's engine names, see `ids::engine_names`).
async fn find(c: &mut AdminClient<Channel>, names: &[String]) -> Result<Option<pb::GroupSnapshot>, Status> {
    let all = c.list_group_snapshots(pb::ListGroupSnapshotsRequest { group: String::new() }).await?;
    Ok(all.into_inner().snapshots.into_iter().find(|g| names.contains(&g.name)))
}

async fn message(
    c: &mut AdminClient<Channel>,
    node: &str,
    g: &pb::GroupSnapshot,
) -> Result<csi::VolumeGroupSnapshot, Status> {
    let group_snapshot_id = ids::make(node, &g.name);
    let mut snapshots = Vec::new();
    for m in &g.members {
        let s = c.get_snapshot(pb::GetSnapshotRequest { name: m.snapshot.clone() }).await?.into_inner();
        snapshots.push(csi::Snapshot { group_snapshot_id: group_snapshot_id.clone(), ..snapshot_msg(node, &s) });
    }
    Ok(csi::VolumeGroupSnapshot {
        group_snapshot_id,
        snapshots,
        creation_time: Some(prost_types::Timestamp { seconds: i64::try_from(g.created_unix).unwrap_or(0), nanos: 0 }),
        ready_to_use: true,
    })
}

/// Refuses `snapshot_ids` (when given) that are not exactly the group snapshot's members.
fn check_members(node: &str, g: &pb::GroupSnapshot, snapshot_ids: &[String]) -> Result<(), Status> {
    if snapshot_ids.is_empty() {
        return Ok(());
    }
    let have: BTreeSet<String> = g.members.iter().map(|m| ids::make(node, &m.snapshot)).collect();
    let given: BTreeSet<String> = snapshot_ids.iter().cloned().collect();
    if have != given {
        return Err(Status::invalid_argument(format!("snapshot_ids do not match the group snapshot's {have:?}")));
    }
    Ok(())
}

impl GroupController {
    async fn locate(&self, id: &str) -> Result<Option<(String, AdminClient<Channel>, pb::GroupSnapshot)>, Status> {
        let Some((node, name)) = ids::parse(id) else { return Ok(None) };
        if self.nodes.admin_endpoint(node).is_none() {
            return Ok(None);
        }
        let mut c = admin(&*self.nodes, node).await?;
        Ok(find(&mut c, &[name.to_owned()]).await?.map(|g| (node.to_owned(), c, g)))
    }
}

#[tonic::async_trait]
impl csi::group_controller_server::GroupController for GroupController {
    async fn group_controller_get_capabilities(
        &self,
        _: Request<csi::GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::GroupControllerGetCapabilitiesResponse>, Status> {
        use csi::group_controller_service_capability::{Rpc, Type, rpc};
        let rpc = Rpc { r#type: rpc::Type::CreateDeleteGetVolumeGroupSnapshot as i32 };
        let cap = csi::GroupControllerServiceCapability { r#type: Some(Type::Rpc(rpc)) };
        Ok(Response::new(csi::GroupControllerGetCapabilitiesResponse { capabilities: vec![cap] }))
    }

    async fn create_volume_group_snapshot(
        &self,
        req: Request<csi::CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::CreateVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        if r.source_volume_ids.is_empty() {
            return Err(Status::invalid_argument("source_volume_ids is required"));
        }
        no_parameters(&r.parameters)?;
        let mut node = None;
        let mut volumes = BTreeSet::new();
        for id in &r.source_volume_ids {
            // Where each is served now (a replicated volume's primary).
            let (n, _, v) = crate::shared::copies::volume(&*self.nodes, id).await?;
            if node.as_ref().is_some_and(|x| *x != n) {
                return Err(Status::failed_precondition("volumes on different nodes cannot be snapshotted together"));
            }
            node = Some(n);
            volumes.insert(v.name);
        }
        let node = node.expect("at least one volume");
        let node = node.as_str();
        let name = ids::engine_name(&r.name);
        let mut c = admin(&*self.nodes, node).await?;
        if let Some(g) = find(&mut c, &ids::engine_names(&r.name)).await? {
            let members: BTreeSet<String> = g.members.iter().map(|m| m.volume.clone()).collect();
            if members != volumes {
                return Err(Status::already_exists(format!("group snapshot {:?} exists for other volumes", r.name)));
            }
            return Ok(Response::new(csi::CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(message(&mut c, node, &g).await?),
            }));
        }
        let groups = c.list_groups(pb::ListGroupsRequest {}).await?.into_inner().groups;
        let exact = groups.iter().find(|g| g.volumes.iter().cloned().collect::<BTreeSet<_>>() == volumes);
        let (group, transient) = match exact {
            Some(g) => (g.name.clone(), false),
            None => {
                if let Some(g) = groups.iter().find(|g| g.volumes.iter().any(|v| volumes.contains(v))) {
                    return Err(Status::failed_precondition(format!(
                        "some of these volumes belong to group {:?} with other members; snapshot that whole group",
                        g.name
                    )));
                }
                // (A digest: the snapshot name may already use all 128 characters.)
                let group = ids::engine_name(&format!("group of {name}"));
                let req = pb::CreateGroupRequest { name: group.clone(), volumes: volumes.iter().cloned().collect() };
                c.create_group(req).await?;
                (group, true)
            }
        };
        let made = c.create_group_snapshot(pb::CreateGroupSnapshotRequest { group: group.clone(), name }).await;
        if transient && let Err(e) = c.delete_group(pb::DeleteGroupRequest { name: group.clone() }).await {
            tracing::warn!(group, error = %e.message(), "cannot delete the group made for a group snapshot");
        }
        let g = made?.into_inner();
        tracing::info!(name = %r.name, members = g.members.len(), "CSI group snapshot created");
        Ok(Response::new(csi::CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(message(&mut c, node, &g).await?),
        }))
    }

    async fn delete_volume_group_snapshot(
        &self,
        req: Request<csi::DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::DeleteVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        require("group_snapshot_id", &r.group_snapshot_id)?;
        if let Some((node, mut c, g)) = self.locate(&r.group_snapshot_id).await? {
            check_members(&node, &g, &r.snapshot_ids)?;
            match c.delete_group_snapshot(pb::DeleteGroupSnapshotRequest { name: g.name }).await {
                Ok(_) => {}
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => return Err(s),
            }
        }
        Ok(Response::new(csi::DeleteVolumeGroupSnapshotResponse {}))
    }

    async fn get_volume_group_snapshot(
        &self,
        req: Request<csi::GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::GetVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        require("group_snapshot_id", &r.group_snapshot_id)?;
        let (node, mut c, g) = self
            .locate(&r.group_snapshot_id)
            .await?
            .ok_or_else(|| Status::not_found(format!("group snapshot {:?} does not exist", r.group_snapshot_id)))?;
        check_members(&node, &g, &r.snapshot_ids)?;
        Ok(Response::new(csi::GetVolumeGroupSnapshotResponse {
            group_snapshot: Some(message(&mut c, &node, &g).await?),
        }))
    }
}
