//! CSI-Addons VolumeGroup on the engine's volume groups (the sets a group snapshot freezes at one
//! point of the log). A group lives on one node, like its volumes; its id is `<node>/<group>`. A
//! volume is in at most one group. Deleting a group never deletes volumes: a group that still has
//! members is refused (FailedPrecondition), so nothing is lost by accident.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use ferrite_proto::csi_addons::volumegroup as vg;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::shared::args::{no_parameters, paginate, require, volume_msg};
use crate::shared::ids;
use crate::shared::nodes::{NodeDirectory, admin};

/// The parameter naming the node of a group created without volumes.
const NODE_PARAMETER: &str = "node";

#[derive(Debug)]
pub struct VolumeGroups {
    pub nodes: Arc<dyn NodeDirectory>,
}

/// The one under any of `names` (a CSI name's engine names, see `ids::engine_names`).
async fn find(c: &mut AdminClient<Channel>, names: &[String]) -> Result<Option<pb::Group>, Status> {
    let all = c.list_groups(pb::ListGroupsRequest {}).await?.into_inner().groups;
    Ok(all.into_iter().find(|g| names.contains(&g.name)))
}

async fn message(c: &mut AdminClient<Channel>, node: &str, g: &pb::Group) -> Result<vg::VolumeGroup, Status> {
    let mut volumes = Vec::new();
    for v in &g.volumes {
        let v = c.get_volume(pb::GetVolumeRequest { name: v.clone() }).await?.into_inner();
        volumes.push(volume_msg(node, &v, None));
    }
    Ok(vg::VolumeGroup { volume_group_id: ids::make(node, &g.name), volume_group_context: HashMap::new(), volumes })
}

/// The node and engine names of `volume_ids`, which must all live on one node.
fn members(volume_ids: &[String]) -> Result<(Option<String>, Vec<String>), Status> {
    let mut node: Option<String> = None;
    let mut names = Vec::new();
    for id in volume_ids {
        let (n, name) = ids::parse(id).ok_or_else(|| Status::not_found(format!("volume {id:?} does not exist")))?;
        match &node {
            Some(first) if first != n => {
                return Err(Status::failed_precondition(format!(
                    "volumes of one group must live on one node: {id} is on {n}, not {first}"
                )));
            }
            _ => node = Some(n.to_owned()),
        }
        names.push(name.to_owned());
    }
    Ok((node, names))
}

/// The node, a client and the group a group id names; NotFound otherwise.
pub(crate) async fn locate(
    nodes: &dyn NodeDirectory,
    id: &str,
) -> Result<(String, AdminClient<Channel>, pb::Group), Status> {
    let not_found = || Status::not_found(format!("volume group {id:?} does not exist"));
    let (node, name) = ids::parse(id).ok_or_else(not_found)?;
    if nodes.admin_endpoint(node).is_none() {
        return Err(not_found());
    }
    let mut c = admin(nodes, node).await?;
    let g = find(&mut c, &[name.to_owned()]).await?.ok_or_else(not_found)?;
    Ok((node.to_owned(), c, g))
}

#[tonic::async_trait]
impl vg::controller_server::Controller for VolumeGroups {
    async fn create_volume_group(
        &self,
        req: Request<vg::CreateVolumeGroupRequest>,
    ) -> Result<Response<vg::CreateVolumeGroupResponse>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        if let Some(k) = r.parameters.keys().find(|k| *k != NODE_PARAMETER) {
            return Err(Status::invalid_argument(format!("unknown parameter {k:?} (only {NODE_PARAMETER:?})")));
        }
        let (from_volumes, names) = members(&r.volume_ids)?;
        let node = match (from_volumes.as_ref(), r.parameters.get(NODE_PARAMETER)) {
            (Some(a), Some(b)) if a != b => {
                return Err(Status::invalid_argument(format!("the volumes live on {a}, not on node {b}")));
            }
            (Some(n), _) | (None, Some(n)) => n.clone(),
            (None, None) => match self.nodes.nodes().as_slice() {
                [only] => only.clone(),
                _ => return Err(Status::invalid_argument("a group without volumes needs parameters.node")),
            },
        };
        if self.nodes.admin_endpoint(&node).is_none() {
            return Err(Status::invalid_argument(format!("unknown node {node:?}")));
        }
        let group = ids::engine_name(&r.name);
        let mut c = admin(&*self.nodes, &node).await?;
        let g = match find(&mut c, &ids::engine_names(&r.name)).await? {
            Some(g) => {
                let (have, want): (BTreeSet<_>, BTreeSet<_>) = (g.volumes.iter().collect(), names.iter().collect());
                if have != want {
                    return Err(Status::already_exists(format!(
                        "volume group {} exists with other volumes ({:?})",
                        r.name, g.volumes
                    )));
                }
                g
            }
            None => {
                let g = c.create_group(pb::CreateGroupRequest { name: group, volumes: names }).await;
                // A volume already in another group: the engine's AlreadyExists is a precondition here.
                g.map_err(
                    |s| if s.code() == Code::AlreadyExists { Status::failed_precondition(s.message()) } else { s },
                )?
                .into_inner()
            }
        };
        tracing::info!(name = %r.name, group = %g.name, node, volumes = ?g.volumes, "volume group created");
        let volume_group = Some(message(&mut c, &node, &g).await?);
        Ok(Response::new(vg::CreateVolumeGroupResponse { volume_group }))
    }

    async fn modify_volume_group_membership(
        &self,
        req: Request<vg::ModifyVolumeGroupMembershipRequest>,
    ) -> Result<Response<vg::ModifyVolumeGroupMembershipResponse>, Status> {
        let r = req.into_inner();
        require("volume_group_id", &r.volume_group_id)?;
        no_parameters(&r.parameters)?;
        let (node, mut c, g) = locate(&*self.nodes, &r.volume_group_id).await?;
        let (vol_node, names) = members(&r.volume_ids)?;
        if vol_node.as_ref().is_some_and(|n| *n != node) {
            return Err(Status::invalid_argument(format!("the volumes do not live on the group's node {node}")));
        }
        let want: BTreeSet<&String> = names.iter().collect();
        let have: BTreeSet<&String> = g.volumes.iter().collect();
        let add: Vec<String> = want.difference(&have).map(|s| (*s).clone()).collect();
        let remove: Vec<String> = have.difference(&want).map(|s| (*s).clone()).collect();
        let g = if add.is_empty() && remove.is_empty() {
            g
        } else {
            let u = c.update_group(pb::UpdateGroupRequest { name: g.name.clone(), add, remove }).await;
            u.map_err(|s| if s.code() == Code::AlreadyExists { Status::failed_precondition(s.message()) } else { s })?
                .into_inner()
        };
        let volume_group = Some(message(&mut c, &node, &g).await?);
        Ok(Response::new(vg::ModifyVolumeGroupMembershipResponse { volume_group }))
    }

    async fn delete_volume_group(
        &self,
        req: Request<vg::DeleteVolumeGroupRequest>,
    ) -> Result<Response<vg::DeleteVolumeGroupResponse>, Status> {
        let id = req.into_inner().volume_group_id;
        require("volume_group_id", &id)?;
        let (_, mut c, g) = match locate(&*self.nodes, &id).await {
            Ok(found) => found,
            Err(s) if s.code() == Code::NotFound => return Ok(Response::new(vg::DeleteVolumeGroupResponse {})),
            Err(s) => return Err(s),
        };
        if !g.volumes.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume group {id} still has volumes {:?}: remove them first (deleting a group never deletes volumes)",
                g.volumes
            )));
        }
        match c.delete_group(pb::DeleteGroupRequest { name: g.name.clone() }).await {
            Ok(_) => tracing::info!(volume_group_id = %id, "volume group deleted"),
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(s),
        }
        Ok(Response::new(vg::DeleteVolumeGroupResponse {}))
    }

    async fn list_volume_groups(
        &self,
        req: Request<vg::ListVolumeGroupsRequest>,
    ) -> Result<Response<vg::ListVolumeGroupsResponse>, Status> {
        let r = req.into_inner();
        let mut all = Vec::new();
        for node in self.nodes.nodes() {
            let mut c = admin(&*self.nodes, &node).await?;
            let mut groups = c.list_groups(pb::ListGroupsRequest {}).await?.into_inner().groups;
            groups.sort_by(|a, b| a.name.cmp(&b.name));
            for g in groups {
                all.push(message(&mut c, &node, &g).await?);
            }
        }
        let (page, next_token) = paginate(all, r.max_entries, &r.starting_token)?;
        let entries =
            page.into_iter().map(|g| vg::list_volume_groups_response::Entry { volume_group: Some(g) }).collect();
        Ok(Response::new(vg::ListVolumeGroupsResponse { entries, next_token }))
    }

    async fn controller_get_volume_group(
        &self,
        req: Request<vg::ControllerGetVolumeGroupRequest>,
    ) -> Result<Response<vg::ControllerGetVolumeGroupResponse>, Status> {
        let id = req.into_inner().volume_group_id;
        require("volume_group_id", &id)?;
        let (node, mut c, g) = locate(&*self.nodes, &id).await?;
        let volume_group = Some(message(&mut c, &node, &g).await?);
        Ok(Response::new(vg::ControllerGetVolumeGroupResponse { volume_group }))
    }
}
