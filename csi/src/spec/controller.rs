//! CSI Controller over the daemons' admin APIs. Stateless: a volume id is `<node>/<volume>`, and
//! the node directory says where each node's daemon answers. Required fields are checked first
//! (InvalidArgument); daemon statuses keep their codes.

use std::sync::Arc;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::shared::args::{
    TOPOLOGY_KEY, check_capabilities, no_parameters, paginate, require, topology, unread_header, volume_msg,
};
use crate::shared::class::Class;
use crate::shared::nodes::placements::Placed;
use crate::shared::nodes::{NodeDirectory, admin, scan};
use crate::{shared::copies, shared::ids};

/// Size of a volume created without a capacity range.
const DEFAULT_SIZE: u64 = 1 << 30;
const BLOCK: u64 = 4096;

pub struct Controller {
    pub nodes: Arc<dyn NodeDirectory>,
    /// Operations in flight, by volume id or CSI name (shared with the node service).
    pub busy: ferrite_proto::busy::Busy,
    /// Most volumes published to one node (what NodeGetInfo reports).
    pub max_volumes: i64,
    /// The Kubernetes API, where the directory is the cluster's: what a volume made before its
    /// context said whether it is remote-access is looked up in its PV (`shared::pvs`).
    pub kube: Option<kube::Client>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller").field("nodes", &self.nodes).field("kube", &self.kube.is_some()).finish()
    }
}

/// The size to create or grow to for a capacity range: `required` rounded up to whole blocks,
/// within `limit`. OutOfRange when the range cannot be met.
fn size_for(range: Option<&csi::CapacityRange>, default: u64) -> Result<u64, Status> {
    let Some(r) = range else { return Ok(default) };
    let (req, lim) = (u64::try_from(r.required_bytes), u64::try_from(r.limit_bytes));
    let (Ok(req), Ok(lim)) = (req, lim) else {
        return Err(Status::out_of_range("capacity_range bytes must not be negative"));
    };
    if req == 0 && lim == 0 {
        return Ok(default);
    }
    let want = if req == 0 { default.min(lim / BLOCK * BLOCK) } else { req.div_ceil(BLOCK) * BLOCK };
    if want == 0 || (lim != 0 && want > lim) {
        return Err(Status::out_of_range(format!(
            "no size in whole 4 KiB blocks fits required {req} and limit {lim} bytes"
        )));
    }
    Ok(want)
}

/// What one node's pool can give a new volume: the free bytes it can write (bounded by the
/// filesystem under a file pool), and the size it may still provision (None: no overcommit cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Room {
    free: u64,
    provisionable: Option<u64>,
}

impl Room {
    fn of(s: &pb::PoolStatusResponse) -> Self {
        Self { free: s.free.min(s.backing_free.unwrap_or(u64::MAX)), provisionable: s.provisionable }
    }
}

/// GetCapacity's answer for a class of `copies` copies over `pools` (the nodes that answered),
/// at node `at` if the topology names one: (available bytes, largest volume when a cap applies).
/// One copy: that node's room, or the sum over the nodes. Several: every copy needs room on its
/// own node, so the `copies`-th largest room counts (with `at` among them); two copies need a
/// third node for their witness.
fn capacity(pools: &[(String, Room)], at: Option<&str>, copies: usize) -> (u64, Option<u64>) {
    let cap = |rooms: &[Room]| rooms.iter().filter_map(|r| r.provisionable).min();
    if copies == 1 {
        let rooms: Vec<Room> = pools.iter().filter(|(n, _)| at.is_none_or(|a| a == n)).map(|(_, r)| *r).collect();
        return (rooms.iter().fold(0u64, |sum, r| sum.saturating_add(r.free)), cap(&rooms));
    }
    let mut rooms: Vec<Room> = pools.iter().filter(|(n, _)| at.is_none_or(|a| a != n)).map(|(_, r)| *r).collect();
    rooms.sort_by_key(|r| std::cmp::Reverse(r.free));
    let mut chosen: Vec<Room> =
        at.and_then(|a| pools.iter().find(|(n, _)| n == a)).map(|(_, r)| *r).into_iter().collect();
    let witness = usize::from(copies == 2);
    if chosen.len() + rooms.len() < copies + witness || (at.is_some() && chosen.is_empty()) {
        return (0, None);
    }
    chosen.extend(rooms.into_iter().take(copies - chosen.len()));
    (chosen.iter().map(|r| r.free).min().unwrap_or(0), cap(&chosen))
}

impl Controller {
    /// The node for a new volume: the first preferred, else the first requisite topology naming a
    /// known node, else of the nodes that answered (`free`, each one's free space) the one with
    /// the most. A volume accessible from every node (`remote`) asked for on nodes that hold no
    /// storage goes where the most free space is: those nodes reach it remotely.
    fn place(
        &self,
        req: Option<&csi::TopologyRequirement>,
        free: Vec<(String, u64)>,
        remote: bool,
    ) -> Result<String, Status> {
        if let Some(r) = req {
            let named: Vec<&str> = r
                .preferred
                .iter()
                .chain(&r.requisite)
                .filter_map(|t| t.segments.get(TOPOLOGY_KEY).map(String::as_str))
                .collect();
            let storage_less = |n: &&str| self.nodes.is_node(n) && self.nodes.admin_endpoint(n).is_none();
            let anywhere = remote && named.iter().all(storage_less);
            if !named.is_empty() && !anywhere {
                let known = self.nodes.nodes();
                return named.iter().find(|n| known.iter().any(|k| k == *n)).map(|n| (*n).to_owned()).ok_or_else(
                    || Status::resource_exhausted(format!("no known node among the required topologies {named:?}")),
                );
            }
        }
        // The most free space; of equals, the first in the directory's order.
        let best = free.into_iter().rev().max_by_key(|(_, free)| *free);
        best.map(|(n, _)| n).ok_or_else(|| Status::unavailable("no node's daemon answers"))
    }

    /// What CreateVolume needs from every node, in one scan (a node that does not answer is
    /// skipped: a lost node never stops provisioning): the volume under any of `names` (a CSI
    /// name's engine names) with the node serving it (a replicated volume's primary), and the
    /// free space of each node that answered.
    async fn survey(&self, names: &[String]) -> Result<(Option<(String, pb::Volume)>, Vec<(String, u64)>), Status> {
        let found = scan(&*self.nodes, self.nodes.nodes(), |_, mut c| async move {
            let free = c.pool_status(pb::PoolStatusRequest {}).await?.into_inner().free;
            for name in names {
                match c.get_volume(pb::GetVolumeRequest { name: name.clone() }).await {
                    Ok(_) => return Ok((Some(name.clone()), free)),
                    Err(s) if s.code() == Code::NotFound => {}
                    Err(s) => return Err(s),
                }
            }
            Ok((None, free))
        })
        .await?;
        // Where the controller records placements, a volume counts only on a node recorded for
        // it: a daemon's claim to hold a name makes no volume of ours, and that node takes no
        // new one of the name. Nor does a node at its share of the copies.
        let records = self.nodes.placements();
        let ours = |node: &str, name: &str| records.is_none_or(|r| r.get(name).is_some_and(|p| p.holds(node)));
        let full = copies::over_share(&*self.nodes);
        let mut free = Vec::new();
        let mut held = None;
        for (node, (name, room)) in found.answers {
            match name {
                Some(name) if ours(&node, &name) => held = held.or(Some((node, name))),
                Some(name) => tracing::warn!(node, volume = name, "a node holds a volume it was never given: ignored"),
                None if !full.contains(&node) => free.push((node, room)),
                None => {}
            }
        }
        match held {
            Some((node, name)) => {
                let (node, _, v, _) = copies::primary(&*self.nodes, &node, &name).await?;
                Ok((Some((node, v)), free))
            }
            None => Ok((None, free)),
        }
    }

    /// Gives the volume on `node` its `n` copies (a replicated class): its id names no node, it
    /// is accessible where each copy is (publishing it to one of them moves the primary there),
    /// or everywhere with `remoteAccess`,
    /// and its context lists them, with what failover needs of the class (`failover/replace.rs`):
    /// how many copies, and when a lost one is replaced (seconds, 0 never).
    async fn copies(
        &self,
        node: &str,
        mut volume: csi::Volume,
        name: &str,
        class: &Class,
    ) -> Result<csi::Volume, Status> {
        if class.replicas > 1 {
            let at = copies::ensure(&*self.nodes, node, name, class.replicas, class.zone_spread).await?;
            volume.volume_id = ids::make(ids::ANY, name);
            volume.accessible_topology = at.iter().map(|n| topology(n)).collect();
            let context = std::iter::once(("copies", at.join(","))).chain(class.context());
            volume.volume_context.extend(context.map(|(k, v)| (k.to_owned(), v)));
        }
        // Accessible from every node: no topology, so the PV has no node affinity. The context
        // says which, for ControllerPublish (a node holding no copy gets only a remote-access
        // volume); its PV is the controller's to write (the admission policy `ferrite-controller-pvs`).
        if class.remote_access {
            volume.accessible_topology.clear();
        }
        volume.volume_context.insert(crate::shared::class::REMOTE_ACCESS.to_owned(), class.remote_access.to_string());
        Ok(volume)
    }

    /// Records `node` as the one node of new volume `name`, before its daemon is asked to make
    /// it (a retry that finds it there then knows it for ours).
    async fn record(&self, name: &str, node: &str) -> Result<(), Status> {
        copies::record(&*self.nodes, name, |p| *p = Placed { copies: vec![node.to_owned()], witness: None }).await
    }

    async fn get(&self, volume_id: &str) -> Result<(String, pb::Volume), Status> {
        let (node, _, v) = crate::shared::copies::volume(&*self.nodes, volume_id).await?;
        Ok((node, v))
    }
}

/// A volume made from a source (a clone, a restore) brought to the request: grown to `size` if
/// its source was smaller, and given the class's `limits`.
async fn fit(
    c: &mut AdminClient<Channel>,
    mut v: pb::Volume,
    size: u64,
    limits: pb::VolumeLimits,
) -> Result<pb::Volume, Status> {
    if v.size < size {
        v = c.grow_volume(pb::GrowVolumeRequest { name: v.name.clone(), new_size: size }).await?.into_inner();
    }
    if limits != pb::VolumeLimits::default() {
        v = c
            .set_volume_limits(pb::SetVolumeLimitsRequest { name: v.name.clone(), limits: Some(limits) })
            .await?
            .into_inner();
    }
    Ok(v)
}

#[tonic::async_trait]
impl csi::controller_server::Controller for Controller {
    async fn create_volume(
        &self,
        req: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        require("name", &r.name)?;
        check_capabilities(&r.volume_capabilities).map_err(Status::invalid_argument)?;
        let class = Class::parse(&r.parameters)?;
        let (replicas, remote) = (class.replicas, class.remote_access);
        let encryption = match class.encrypted {
            true => Some(crate::shared::keys::required(&r.secrets, "CreateVolume")?),
            false => None,
        };
        if replicas > self.nodes.nodes().len() {
            return Err(Status::resource_exhausted(format!(
                "{replicas} copies need as many nodes; the directory knows {}",
                self.nodes.nodes().len()
            )));
        }
        let limits = crate::shared::qos::limits(&r.mutable_parameters)?;
        let _busy = self.busy.begin(&format!("volume name {}", r.name))?;
        let size = size_for(r.capacity_range.as_ref(), DEFAULT_SIZE)?;
        let name = ids::engine_name(&r.name);
        let (found, free) = self.survey(&ids::engine_names(&r.name)).await?;
        if let Some((node, mut v)) = found {
            let lim = r.capacity_range.as_ref().map_or(0, |c| u64::try_from(c.limit_bytes).unwrap_or(0));
            if v.size < size || (lim != 0 && v.size > lim) {
                return Err(Status::already_exists(format!(
                    "volume {:?} exists on {node} with {} bytes, incompatible with the request",
                    r.name, v.size
                )));
            }
            // A retry after a call that made the volume but not its limits or copies completes it.
            if v.limits.unwrap_or_default() != limits {
                let req = pb::SetVolumeLimitsRequest { name: v.name.clone(), limits: Some(limits) };
                v = admin(&*self.nodes, &node).await?.set_volume_limits(req).await?.into_inner();
            }
            let volume = self.copies(&node, volume_msg(&node, &v, r.volume_content_source), &v.name, &class).await?;
            return Ok(Response::new(csi::CreateVolumeResponse { volume: Some(volume) }));
        }
        let source = r.volume_content_source.clone();
        let from_backup = match source.as_ref().and_then(|s| s.r#type.as_ref()) {
            Some(csi::volume_content_source::Type::Snapshot(s)) if ids::parse_backup(&s.snapshot_id).is_some() => {
                Some(s.snapshot_id.clone())
            }
            _ => None,
        };
        if let Some(backup) = from_backup {
            // Restored where the topology asks (any node with the target), serving at once; a
            // replicated class's copies are added once the copy is done (retried until then).
            let node = self.place(r.accessibility_requirements.as_ref(), free, remote)?;
            self.record(&name, &node).await?;
            let v = crate::shared::backups::restore(&*self.nodes, &backup, &node, &name, encryption).await?;
            let v = fit(&mut admin(&*self.nodes, &node).await?, v, size, limits).await?;
            let volume = self.copies(&node, volume_msg(&node, &v, source), &v.name, &class).await?;
            return Ok(Response::new(csi::CreateVolumeResponse { volume: Some(volume) }));
        }
        let clone_of = match source.as_ref().and_then(|s| s.r#type.as_ref()) {
            None => None,
            Some(csi::volume_content_source::Type::Snapshot(s)) => {
                // A replicated volume's snapshot is on each copy: the holder the topology
                // prefers, else any.
                let named: Vec<&String> = r
                    .accessibility_requirements
                    .iter()
                    .flat_map(|t| t.preferred.iter().chain(&t.requisite))
                    .filter_map(|t| t.segments.get(TOPOLOGY_KEY))
                    .collect();
                let (mut at, _) = crate::shared::copies::holders(&*self.nodes, &s.snapshot_id).await?;
                at.sort_by_key(|(n, _)| named.iter().position(|x| *x == n).unwrap_or(usize::MAX));
                let (node, snap) = at
                    .into_iter()
                    .next()
                    .ok_or_else(|| Status::not_found(format!("snapshot {:?} does not exist", s.snapshot_id)))?;
                Some((node, pb::clone_volume_request::Source::Snapshot(snap.name)))
            }
            Some(csi::volume_content_source::Type::Volume(v)) => {
                // Where the source is served now (a replicated volume's primary).
                let (node, _, vol) = crate::shared::copies::volume(&*self.nodes, &v.volume_id).await?;
                Some((node, pb::clone_volume_request::Source::Volume(vol.name)))
            }
        };
        let (node, v) = match clone_of {
            // A clone lives where its source does, whatever the topology asked for.
            Some((node, src)) => {
                self.record(&name, &node).await?;
                let mut c = admin(&*self.nodes, &node).await?;
                let v = c.clone_volume(pb::CloneVolumeRequest { name, source: Some(src) }).await?.into_inner();
                (node, fit(&mut c, v, size, limits).await?)
            }
            None => {
                let node = self.place(r.accessibility_requirements.as_ref(), free, remote)?;
                self.record(&name, &node).await?;
                let mut c = admin(&*self.nodes, &node).await?;
                let req = pb::CreateVolumeRequest { name, size, limits: Some(limits), encryption };
                let v = c.create_volume(req).await?.into_inner();
                (node, v)
            }
        };
        tracing::info!(name = %r.name, volume_id = %ids::make(&node, &v.name), size = v.size, "CSI volume created");
        let volume = self.copies(&node, volume_msg(&node, &v, source), &v.name, &class).await?;
        Ok(Response::new(csi::CreateVolumeResponse { volume: Some(volume) }))
    }

    async fn delete_volume(
        &self,
        req: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let id = req.into_inner().volume_id;
        require("volume_id", &id)?;
        let _busy = self.busy.begin(&id)?;
        // An id we never made names nothing: deleting it succeeds. The id's node may be gone:
        // the copies elsewhere are found and deleted all the same.
        if let Some((node, name)) = ids::parse(&id) {
            copies::delete(&*self.nodes, node, name).await?;
            tracing::info!(volume_id = %id, "CSI volume deleted");
        }
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = req.into_inner();
        require("volume_id", &r.volume_id)?;
        if r.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities is required"));
        }
        self.get(&r.volume_id).await?;
        let resp = match check_capabilities(&r.volume_capabilities)
            .and_then(|()| no_parameters(&r.parameters).map_err(|s| s.message().to_owned()))
        {
            Ok(()) => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                    volume_context: r.volume_context,
                    volume_capabilities: r.volume_capabilities,
                    parameters: r.parameters,
                    mutable_parameters: r.mutable_parameters,
                }),
                message: String::new(),
            },
            Err(why) => csi::ValidateVolumeCapabilitiesResponse { confirmed: None, message: why },
        };
        Ok(Response::new(resp))
    }

    async fn list_volumes(
        &self,
        req: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        let r = req.into_inner();
        // Every answering node's volumes in (node, name) order: the token is an index into that
        // order. A replicated volume is listed once, where its primary is. The nodes that did
        // not answer are named in the response's `ferrite-unread-nodes` header.
        let listed = scan(&*self.nodes, self.nodes.nodes(), |node, mut c| async move {
            let sync = c.list_sync_replicas(pb::ListReplicationsRequest::default()).await?.into_inner().volumes;
            let role = |name: &str| sync.iter().find(|s| s.volume == name).map(|s| s.role.as_str());
            let mut vols = c.list_volumes(pb::ListVolumesRequest {}).await?.into_inner().volumes;
            vols.retain(|v| role(&v.name).is_none_or(|r| r == "primary"));
            vols.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(vols
                .into_iter()
                .map(|v| {
                    let mut m = volume_msg(&node, &v, None);
                    if role(&v.name).is_some() {
                        m.volume_id = ids::make(ids::ANY, &v.name);
                    }
                    m
                })
                .collect::<Vec<_>>())
        })
        .await?;
        let unread = listed.silent_names();
        let all: Vec<_> = listed.answers.into_iter().flat_map(|(_, v)| v).collect();
        let (page, next_token) = paginate(all, r.max_entries, &r.starting_token)?;
        let entries =
            page.into_iter().map(|v| csi::list_volumes_response::Entry { volume: Some(v), status: None }).collect();
        Ok(unread_header(Response::new(csi::ListVolumesResponse { entries, next_token }), &unread))
    }

    async fn get_capacity(
        &self,
        req: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        let r = req.into_inner();
        if !r.volume_capabilities.is_empty() && check_capabilities(&r.volume_capabilities).is_err() {
            return Ok(Response::new(csi::GetCapacityResponse::default()));
        }
        let class = Class::parse(&r.parameters)?;
        let copies = class.replicas;
        let mut at = r.accessible_topology.as_ref().and_then(|t| t.segments.get(TOPOLOGY_KEY));
        let mut one_pool = false;
        if at.is_some_and(|n| self.nodes.admin_endpoint(n).is_none()) {
            // A node without storage: nothing for a class whose volumes are local, but a
            // remote-access volume asked for there goes where `place` puts it (the most free
            // space; the node reaches it over the network), so the scheduler may pick the node.
            if !(class.remote_access && self.nodes.is_node(at.expect("checked"))) {
                return Ok(Response::new(csi::GetCapacityResponse::default()));
            }
            at = None;
            one_pool = copies == 1;
        }
        // A replicated class's copies go to other nodes too: every node is asked.
        let nodes = match at {
            Some(n) if copies == 1 => vec![n.clone()],
            _ => self.nodes.nodes(),
        };
        let pools = scan(&*self.nodes, nodes, |_, mut c| async move {
            Ok(c.pool_status(pb::PoolStatusRequest {}).await?.into_inner())
        })
        .await?;
        let mut pools: Vec<(String, Room)> = pools.answers.into_iter().map(|(n, s)| (n, Room::of(&s))).collect();
        if one_pool {
            // One copy, in the one pool with the most room: not the sum of every pool.
            pools.sort_by_key(|(_, r)| std::cmp::Reverse(r.free));
            pools.truncate(1);
        }
        let (available, most) = capacity(&pools, at.map(String::as_str), copies);
        Ok(Response::new(csi::GetCapacityResponse {
            available_capacity: i64::try_from(available).unwrap_or(i64::MAX),
            maximum_volume_size: most.map(|m| i64::try_from(m).unwrap_or(i64::MAX)),
            minimum_volume_size: Some(i64::try_from(BLOCK).unwrap_or(0)),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::rpc::Type;
        let capabilities = [
            Type::CreateDeleteVolume,
            Type::PublishUnpublishVolume,
            Type::PublishReadonly,
            Type::ListVolumes,
            Type::GetCapacity,
            Type::ExpandVolume,
            Type::GetVolume,
            Type::ModifyVolume,
            Type::CloneVolume,
            Type::CreateDeleteSnapshot,
            Type::ListSnapshots,
            Type::GetSnapshot,
        ]
        .into_iter()
        .map(|t| csi::ControllerServiceCapability {
            r#type: Some(csi::controller_service_capability::Type::Rpc(csi::controller_service_capability::Rpc {
                r#type: t as i32,
            })),
        })
        .collect();
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse { capabilities }))
    }

    async fn controller_publish_volume(
        &self,
        req: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let publish_context = self.publish(req.into_inner()).await?;
        Ok(Response::new(csi::ControllerPublishVolumeResponse { publish_context }))
    }

    async fn controller_unpublish_volume(
        &self,
        req: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        self.unpublish(req.into_inner()).await?;
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }

    async fn controller_expand_volume(
        &self,
        req: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        require("volume_id", &r.volume_id)?;
        let range = r.capacity_range.as_ref().ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let (node, v) = self.get(&r.volume_id).await?;
        let size = size_for(Some(range), v.size)?;
        let v = if size > v.size {
            let mut c = admin(&*self.nodes, &node).await?;
            c.grow_volume(pb::GrowVolumeRequest { name: v.name.clone(), new_size: size }).await?.into_inner()
        } else {
            v // already as large: expansion is idempotent, shrinking is never done
        };
        let block = matches!(
            r.volume_capability.as_ref().and_then(|c| c.access_type.as_ref()),
            Some(csi::volume_capability::AccessType::Block(_))
        );
        Ok(Response::new(csi::ControllerExpandVolumeResponse {
            capacity_bytes: i64::try_from(v.size).unwrap_or(i64::MAX),
            node_expansion_required: !block,
        }))
    }

    async fn create_snapshot(
        &self,
        req: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let snapshot = self.create_snapshot_impl(req.into_inner()).await?;
        Ok(Response::new(csi::CreateSnapshotResponse { snapshot: Some(snapshot) }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        self.delete_snapshot_impl(&req.into_inner().snapshot_id).await?;
        Ok(Response::new(csi::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        Ok(Response::new(self.list_snapshots_impl(req.into_inner()).await?))
    }

    async fn get_snapshot(
        &self,
        req: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        let snapshot = self.get_snapshot_impl(&req.into_inner().snapshot_id).await?;
        Ok(Response::new(csi::GetSnapshotResponse { snapshot: Some(snapshot) }))
    }

    /// Replaces the volume's limits with those `mutable_parameters` name (online; a key left
    /// out is no limit), so the same parameters twice change nothing.
    async fn controller_modify_volume(
        &self,
        req: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        let r = req.into_inner();
        require("volume_id", &r.volume_id)?;
        let limits = crate::shared::qos::limits(&r.mutable_parameters)?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let (node, name) = ids::parse(&r.volume_id)
            .ok_or_else(|| Status::not_found(format!("volume {:?} does not exist", r.volume_id)))?;
        let (node, _, v, view) = copies::primary(&*self.nodes, node, name).await?;
        // Every copy keeps the limits, so a promoted one enforces them too.
        let at = view.map_or_else(|| vec![node.clone()], |view| copies::nodes_of(&*self.nodes, &view));
        for n in at {
            let req = pb::SetVolumeLimitsRequest { name: v.name.clone(), limits: Some(limits) };
            admin(&*self.nodes, &n).await?.set_volume_limits(req).await?;
        }
        tracing::info!(volume_id = %r.volume_id, ?limits, "CSI volume modified");
        Ok(Response::new(csi::ControllerModifyVolumeResponse {}))
    }

    async fn controller_get_volume(
        &self,
        req: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let id = req.into_inner().volume_id;
        require("volume_id", &id)?;
        let not_found = || Status::not_found(format!("volume {id:?} does not exist"));
        let (hint, name) = crate::shared::ids::parse(&id).ok_or_else(not_found)?;
        let (node, _, v, sync) = crate::shared::copies::primary(&*self.nodes, hint, name).await?;
        let mut volume = volume_msg(&node, &v, None);
        volume.volume_id = id;
        // The limits in force, as the mutable parameters that set them.
        volume.volume_context = crate::shared::qos::parameters(&v.limits.unwrap_or_default());
        Ok(Response::new(csi::ControllerGetVolumeResponse {
            volume: Some(volume),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: Vec::new(),
                volume_condition: Some(crate::shared::copies::condition(sync.as_ref())),
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn range(req: i64, lim: i64) -> csi::CapacityRange {
        csi::CapacityRange { required_bytes: req, limit_bytes: lim }
    }

    #[test]
    fn capacity_counts_what_each_copy_can_get() {
        let room = |free, provisionable| Room { free, provisionable };
        let pools: Vec<(String, Room)> = [("a", room(100, None)), ("b", room(40, Some(30))), ("c", room(70, None))]
            .into_iter()
            .map(|(n, r)| (n.to_owned(), r))
            .collect();
        assert_eq!(capacity(&pools, None, 1), (210, Some(30)));
        assert_eq!(capacity(&pools, Some("a"), 1), (100, None));
        assert_eq!(capacity(&pools, Some("b"), 1), (40, Some(30)));
        // Three copies: the smallest room of three nodes; two: the second largest, a third node
        // answering for the witness.
        assert_eq!(capacity(&pools, None, 3), (40, Some(30)));
        assert_eq!(capacity(&pools, None, 2), (70, None));
        assert_eq!(capacity(&pools, Some("b"), 2), (40, Some(30)));
        assert_eq!(capacity(&pools[..2], None, 2), (0, None), "no node for the witness");
        assert_eq!(capacity(&pools, Some("z"), 2), (0, None));
        assert_eq!(capacity(&pools[..2], None, 3), (0, None));
    }

    #[test]
    fn sizes_from_capacity_ranges() {
        assert_eq!(size_for(None, DEFAULT_SIZE).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&range(0, 0)), DEFAULT_SIZE).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&range(1, 0)), DEFAULT_SIZE).unwrap(), 4096);
        assert_eq!(size_for(Some(&range(10_000, 12_288)), DEFAULT_SIZE).unwrap(), 12_288);
        assert_eq!(size_for(Some(&range(0, 8192)), DEFAULT_SIZE).unwrap(), 8192);
        for bad in [range(10_000, 10_000), range(-1, 0), range(0, 100)] {
            assert_eq!(size_for(Some(&bad), DEFAULT_SIZE).unwrap_err().code(), Code::OutOfRange);
        }
    }

    #[test]
    fn capabilities_we_serve() {
        use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
        let cap = |mode: Mode, t: Option<AccessType>| csi::VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: t,
        };
        let mount = |fs: &str| Some(AccessType::Mount(MountVolume { fs_type: fs.into(), ..Default::default() }));
        let block = Some(AccessType::Block(BlockVolume {}));
        assert!(check_capabilities(&[cap(Mode::SingleNodeWriter, block.clone())]).is_ok());
        assert!(check_capabilities(&[cap(Mode::SingleNodeReaderOnly, mount("xfs"))]).is_ok());
        assert!(check_capabilities(&[cap(Mode::MultiNodeMultiWriter, block.clone())]).is_err());
        assert!(check_capabilities(&[cap(Mode::SingleNodeWriter, mount("btrfs"))]).is_err());
        assert!(check_capabilities(&[cap(Mode::SingleNodeWriter, None)]).is_err());
        assert!(check_capabilities(&[]).is_err());
        assert!(no_parameters(&HashMap::from([("csi.storage.k8s.io/pvc/name".into(), "x".into())])).is_ok());
        assert!(no_parameters(&HashMap::from([("replicas".into(), "3".into())])).is_ok());
        assert!(no_parameters(&HashMap::from([("replicas".into(), "9".into())])).is_err());
        assert!(no_parameters(&HashMap::from([("color".into(), "blue".into())])).is_err());
    }
}
