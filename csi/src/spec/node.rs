//! CSI Node: this node's volumes as block devices (ublk where the kernel has it, else the kernel
//! NBD client; the local daemon attaches them, or on a node without storage the node plugin's
//! own attachment service on the same socket), formatted if blank and mounted at the staging
//! path, then bind-mounted at each publish target (or, for raw block, the device node bound onto
//! a file). Stateless like the controller: the daemon's attachment list says which device a volume
//! has, and the mount table says what is staged or published where.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::shared::args::{REGION_KEY, TOPOLOGY_KEY, ZONE_KEY, check_capabilities, require};
use crate::shared::host;
use crate::shared::ids;
use crate::shared::nodes::{self, NodeDirectory};
use ferrite_proto::busy::Busy;

use csi::volume_capability::access_mode::Mode;

#[derive(Debug, Clone)]
pub struct Node {
    pub node_id: String,
    pub nodes: Arc<dyn NodeDirectory>,
    /// What AttachVolume is asked for: auto, ublk or nbd.
    pub transport: String,
    pub max_volumes: i64,
    pub busy: Busy,
}

fn internal(what: &str) -> impl Fn(std::io::Error) -> Status + '_ {
    move |e| Status::internal(format!("{what}: {e}"))
}

/// Another node's volume as its publish context gives it.
struct Remote {
    /// The primary's NBD listener, host:port.
    address: String,
    /// The export granted to this node.
    export: String,
    /// The NBD listeners of the volume's other copies, where its relay follows a failover.
    copies: Vec<String>,
}

/// A filesystem volume's type and mount flags.
struct Fs {
    kind: String,
    flags: Vec<String>,
}

/// The one capability a Node call carries, checked: a filesystem (None: raw block), and its
/// access mode.
fn capability(cap: Option<&csi::VolumeCapability>) -> Result<(Option<Fs>, Mode), Status> {
    let cap = cap.ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
    check_capabilities(std::slice::from_ref(cap)).map_err(Status::invalid_argument)?;
    let mode = cap.access_mode.as_ref().and_then(|m| Mode::try_from(m.mode).ok()).unwrap_or(Mode::Unknown);
    Ok(match &cap.access_type {
        Some(csi::volume_capability::AccessType::Mount(m)) => {
            let kind = if m.fs_type.is_empty() { "ext4".to_owned() } else { m.fs_type.clone() };
            (Some(Fs { kind, flags: m.mount_flags.clone() }), mode)
        }
        _ => (None, mode),
    })
}

impl Node {
    /// The engine name of a volume this node serves; NotFound for any other id. A volume id
    /// names the node the volume was made on; a replicated volume's primary may have moved
    /// since, to this node: the publish context says so (NodeStage, NodePublish), or this
    /// node's daemon, which holds it as a synchronous primary.
    pub(crate) async fn local<'a>(
        &self,
        volume_id: &'a str,
        publish_context: Option<&HashMap<String, String>>,
    ) -> Result<&'a str, Status> {
        let (node, name) =
            ids::parse(volume_id).ok_or_else(|| Status::not_found(format!("no volume {volume_id:?}")))?;
        let serving = publish_context.and_then(|c| c.get("primary")).map_or(node, String::as_str);
        if serving == self.node_id {
            return Ok(name);
        }
        if publish_context.is_none_or(|c| !c.contains_key("primary")) {
            let req = pb::ListReplicationsRequest { volume: name.to_owned() };
            let held = self.admin().await?.list_sync_replicas(req).await?.into_inner().volumes;
            if held.iter().any(|v| v.volume == name && v.role == "primary") {
                return Ok(name);
            }
        }
        Err(Status::not_found(format!(
            "volume {volume_id} is served by node {serving}, not by this node ({})",
            self.node_id
        )))
    }

    /// Where NodeStage gets a volume: this node's daemon (the engine name), or, when the publish
    /// context names another primary, that primary's NBD listener and the export granted to
    /// this node, relayed by this node's daemon.
    async fn source<'a>(
        &self,
        volume_id: &'a str,
        context: &HashMap<String, String>,
    ) -> Result<(&'a str, Option<Remote>), Status> {
        let (_, name) = ids::parse(volume_id).ok_or_else(|| Status::not_found(format!("no volume {volume_id:?}")))?;
        match context.get("primary") {
            Some(primary) if *primary != self.node_id => match (context.get("nbd"), context.get("export")) {
                (Some(address), Some(export)) => {
                    let copies = context.get("copies").map(|c| c.split(',').map(str::to_owned).collect());
                    let (address, export) = (address.clone(), export.clone());
                    Ok((name, Some(Remote { address, export, copies: copies.unwrap_or_default() })))
                }
                _ => Err(Status::failed_precondition(format!(
                    "volume {volume_id} is served by node {primary}, and its publish context gives no NBD \
                     listener for this node (is nbd-listen set on {primary}'s daemon?)"
                ))),
            },
            _ => Ok((self.local(volume_id, Some(context)).await?, None)),
        }
    }

    /// A volume known here without a publish context (NodeUnstage, NodeUnpublish, stats,
    /// expansion): one this node's daemon attached (another node's volume included, with its
    /// attachment), else a volume this node serves.
    async fn here<'a>(&self, volume_id: &'a str) -> Result<(&'a str, Option<pb::Attachment>), Status> {
        let (_, name) = ids::parse(volume_id).ok_or_else(|| Status::not_found(format!("no volume {volume_id:?}")))?;
        if let Some(a) = Self::attachment(&mut self.admin().await?, name).await? {
            return Ok((name, Some(a)));
        }
        Ok((self.local(volume_id, None).await?, None))
    }

    /// [`Self::here`] for NodeUnstage and NodeUnpublish: a volume served elsewhere and not
    /// attached here is not staged here, which their repeats must answer with success.
    async fn here_or_gone(&self, volume_id: &str) -> Result<Option<pb::Attachment>, Status> {
        match self.here(volume_id).await {
            Ok((_, a)) => Ok(a),
            Err(e) if e.code() == Code::NotFound && ids::parse(volume_id).is_some() => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(crate) async fn admin(&self) -> Result<AdminClient<Channel>, Status> {
        nodes::admin(&*self.nodes, &self.node_id).await
    }

    pub(crate) async fn attachment(c: &mut AdminClient<Channel>, name: &str) -> Result<Option<pb::Attachment>, Status> {
        let all = c.list_attachments(pb::ListAttachmentsRequest {}).await?.into_inner();
        Ok(all.attachments.into_iter().find(|a| a.volume == name))
    }

    /// The device of a staged volume; FailedPrecondition when it is not staged.
    pub(crate) async fn staged_device(c: &mut AdminClient<Channel>, name: &str) -> Result<PathBuf, Status> {
        match Self::attachment(c, name).await? {
            Some(a) => Ok(PathBuf::from(a.device)),
            None => Err(Status::failed_precondition(format!("volume {name} is not staged on this node"))),
        }
    }
}

pub(crate) fn mounted_at(path: &Path) -> Result<Option<host::Mount>, Status> {
    host::mounted_at(path).map_err(internal("reading the mount table"))
}

pub(crate) fn shows(m: &host::Mount, device: &Path) -> Result<bool, Status> {
    host::shows_device(m, device).map_err(internal("checking the device"))
}

/// Creates a publish target: a directory for mounts, an empty file for a device node bind.
fn create_target(target: &Path, block: bool) -> Result<(), Status> {
    let made = if block {
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(target).map(drop)
    } else {
        std::fs::create_dir_all(target)
    };
    made.map_err(|e| Status::internal(format!("creating target {}: {e}", target.display())))
}

/// Removes a publish target (a directory or a file); absent is fine.
fn remove_target(target: &Path) -> Result<(), Status> {
    let removed = match std::fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => std::fs::remove_dir(target),
        Ok(_) => std::fs::remove_file(target),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    removed.map_err(|e| Status::internal(format!("removing target {}: {e}", target.display())))
}

/// The mounts that show `device` (its filesystem, or binds of its node), except one at `except`.
pub(crate) fn other_users(device: &Path, except: Option<&Path>) -> Result<Vec<host::Mount>, Status> {
    let mut users = Vec::new();
    for m in host::mounts().map_err(internal("reading the mount table"))? {
        if Some(m.target.as_path()) != except && shows(&m, device)? {
            users.push(m);
        }
    }
    Ok(users)
}

/// A read-only bind of a device node does not stop writes through it (the mount flag covers
/// files, not devices), so a read-only raw block publish makes the device itself read-only; a
/// device is then read-only for all its publishes or for none.
async fn set_device_read_only(device: &Path, target: &Path, read_only: bool) -> Result<(), Status> {
    let others = other_users(device, Some(target))?;
    if let Some(m) = others.iter().find(|m| m.read_only != read_only) {
        return Err(Status::failed_precondition(format!(
            "{} is published {} at {}; a raw block volume is read-only for all its publishes or none",
            device.display(),
            if m.read_only { "read-only" } else { "read-write" },
            m.target.display()
        )));
    }
    host::run("blockdev", &[if read_only { "--setro" } else { "--setrw" }, &device.to_string_lossy()]).await.map(drop)
}

#[tonic::async_trait]
impl csi::node_server::Node for Node {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let r = request.into_inner();
        require("volume_id", &r.volume_id)?;
        require("staging_target_path", &r.staging_target_path)?;
        let (mount, mode) = capability(r.volume_capability.as_ref())?;
        let read_only = mode == Mode::SingleNodeReaderOnly;
        let (name, remote) = self.source(&r.volume_id, &r.publish_context).await?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let mut c = self.admin().await?;
        if remote.is_none() {
            let v = c.get_volume(pb::GetVolumeRequest { name: name.into() }).await?.into_inner();
            crate::shared::keys::unlock(&mut c, &v, &r.secrets, "NodeStageVolume").await?;
        }
        let device = match Self::attachment(&mut c, name).await? {
            Some(a) => PathBuf::from(a.device),
            None => {
                let req = match remote {
                    None => pb::AttachVolumeRequest {
                        volume: name.into(),
                        transport: self.transport.clone(),
                        ..Default::default()
                    },
                    Some(Remote { address, export, copies }) => pb::AttachVolumeRequest {
                        volume: name.into(),
                        transport: "nbd".into(),
                        remote: address,
                        export,
                        copies,
                        ..Default::default()
                    },
                };
                let a = c.attach_volume(req).await?.into_inner();
                tracing::info!(volume = %r.volume_id, device = %a.device, transport = %a.transport, "volume attached");
                PathBuf::from(a.device)
            }
        };
        let Some(Fs { kind: fs, flags }) = mount else {
            return Ok(Response::new(csi::NodeStageVolumeResponse {})); // raw block: the device is the stage
        };
        let staging = Path::new(&r.staging_target_path);
        if let Some(m) = mounted_at(staging)? {
            if shows(&m, &device)? && m.fs_type == fs {
                return Ok(Response::new(csi::NodeStageVolumeResponse {}));
            }
            return Err(Status::already_exists(format!(
                "{} already has a {} mount that is not this volume's {fs}",
                staging.display(),
                m.fs_type
            )));
        }
        match host::content(&device).await? {
            None => {
                tracing::info!(volume = %r.volume_id, device = %device.display(), fs, "blank volume: formatting");
                host::mkfs(&device, &fs).await?;
            }
            Some(found) if found == fs => {}
            Some(found) => {
                return Err(Status::failed_precondition(format!(
                    "volume {} holds a {found} filesystem, not the {fs} the capability asks for",
                    r.volume_id
                )));
            }
        }
        std::fs::create_dir_all(staging).map_err(internal("creating the staging path"))?;
        host::mount(&device, staging, &fs, &flags, read_only).await?;
        // A volume expanded while it was not staged: its filesystem takes the new size now.
        if !read_only && let Err(e) = host::grow(&fs, &device, staging).await {
            tracing::warn!(volume = %r.volume_id, error = %e.message(), "could not grow the filesystem at stage");
        }
        tracing::info!(volume = %r.volume_id, staging = %staging.display(), fs, "volume staged");
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let r = request.into_inner();
        require("volume_id", &r.volume_id)?;
        require("staging_target_path", &r.staging_target_path)?;
        let attachment = self.here_or_gone(&r.volume_id).await?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let staging = Path::new(&r.staging_target_path);
        let mut c = self.admin().await?;
        if let Some(a) = &attachment {
            let users: Vec<PathBuf> =
                other_users(Path::new(&a.device), Some(staging))?.into_iter().map(|m| m.target).collect();
            if !users.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "volume {} is still published at {users:?}; unpublish it first",
                    r.volume_id
                )));
            }
        }
        host::unmount_all(staging).await?;
        if let Some(a) = attachment {
            match c.detach_volume(pb::DetachVolumeRequest { device: a.device.clone() }).await {
                Ok(_) => tracing::info!(volume = %r.volume_id, device = %a.device, "volume detached"),
                Err(e) if e.code() == Code::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let r = request.into_inner();
        require("volume_id", &r.volume_id)?;
        require("staging_target_path", &r.staging_target_path)?;
        require("target_path", &r.target_path)?;
        let (mount, mode) = capability(r.volume_capability.as_ref())?;
        let read_only = r.readonly || mode == Mode::SingleNodeReaderOnly;
        let (name, _) = self.source(&r.volume_id, &r.publish_context).await?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let device = Self::staged_device(&mut self.admin().await?, name).await?;
        let (target, staging) = (Path::new(&r.target_path), Path::new(&r.staging_target_path));
        let source = match &mount {
            None => device.clone(),
            Some(_) => {
                let staged = mounted_at(staging)?;
                match staged {
                    Some(m) if shows(&m, &device)? => {}
                    _ => {
                        return Err(Status::failed_precondition(format!(
                            "volume {} is not staged at {}",
                            r.volume_id,
                            staging.display()
                        )));
                    }
                }
                staging.to_path_buf()
            }
        };
        if let Some(m) = mounted_at(target)? {
            if shows(&m, &device)? && m.read_only == read_only {
                return Ok(Response::new(csi::NodePublishVolumeResponse {}));
            }
            return Err(Status::already_exists(format!(
                "{} is already published with other settings (read-only {}, another volume or access type)",
                target.display(),
                m.read_only
            )));
        }
        // SINGLE_NODE_SINGLE_WRITER: one target at a time (the staging mount is not a target).
        if mode == Mode::SingleNodeSingleWriter
            && let Some(m) = other_users(&device, Some(target))?.into_iter().find(|m| m.target != staging)
        {
            return Err(Status::failed_precondition(format!(
                "volume {} is SINGLE_NODE_SINGLE_WRITER and already published at {}",
                r.volume_id,
                m.target.display()
            )));
        }
        if mount.is_none() {
            set_device_read_only(&device, target, read_only).await?;
        }
        let made = !target.exists();
        create_target(target, mount.is_none())?;
        if let Err(e) = host::bind(&source, target, read_only).await {
            // Leave nothing behind that the CO did not make.
            if made {
                let _ = remove_target(target);
            }
            return Err(e);
        }
        tracing::info!(volume = %r.volume_id, target = %target.display(), read_only, "volume published");
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let r = request.into_inner();
        require("volume_id", &r.volume_id)?;
        require("target_path", &r.target_path)?;
        self.here_or_gone(&r.volume_id).await?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let target = Path::new(&r.target_path);
        let shown = mounted_at(target)?;
        host::unmount_all(target).await?;
        // The target goes first, so a failure below leaves no target behind (a device left
        // read-only is set as asked by its next publish).
        remove_target(target)?;
        // The last publish of a read-only raw block device gives the device its writability back.
        if let Some(m) = shown.filter(|m| m.fs_type == "devtmpfs" && m.read_only) {
            let device = Path::new("/dev").join(m.root.strip_prefix("/").unwrap_or(&m.root));
            if other_users(&device, Some(target))?.is_empty() {
                host::run("blockdev", &["--setrw", &device.to_string_lossy()]).await?;
            }
        }
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        use csi::volume_usage::Unit;
        let r = request.into_inner();
        require("volume_id", &r.volume_id)?;
        require("volume_path", &r.volume_path)?;
        let (name, attachment) = self.here(&r.volume_id).await?;
        let path = Path::new(&r.volume_path);
        let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Status::not_found(format!("{} does not exist", path.display())),
            _ => Status::internal(format!("{}: {e}", path.display())),
        })?;
        // A copy held here: its membership says whether the volume takes writes.
        let mut copies = None;
        if attachment.as_ref().is_none_or(|a| a.remote.is_empty()) {
            let mut c = self.admin().await?;
            c.get_volume(pb::GetVolumeRequest { name: name.into() }).await?;
            copies = Some(crate::shared::copies::condition(crate::shared::copies::view(&mut c, name).await?.as_ref()));
        }
        let mounted = mounted_at(path)?;
        let problem = match (&attachment, &mounted) {
            (None, _) => Some("the volume is not attached to a block device".to_owned()),
            (Some(a), Some(m)) if !host::shows_device(m, Path::new(&a.device)).unwrap_or(false) => {
                Some(format!("{} does not show {}", path.display(), a.device))
            }
            (Some(_), None) => Some(format!("nothing is mounted at {}", path.display())),
            (Some(a), Some(_)) => match host::device_size(Path::new(&a.device)) {
                Ok(0) | Err(_) => Some(format!("{} has no capacity", a.device)),
                Ok(_) => None,
            },
        };
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let usage = if meta.is_dir() {
            let u = host::usage(path).map_err(internal("statvfs"))?;
            vec![
                csi::VolumeUsage {
                    available: as_i64(u.bytes_available),
                    total: as_i64(u.bytes_total),
                    used: as_i64(u.bytes_used),
                    unit: Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    available: as_i64(u.inodes_free),
                    total: as_i64(u.inodes_total),
                    used: as_i64(u.inodes_used),
                    unit: Unit::Inodes as i32,
                },
            ]
        } else {
            let total = attachment.as_ref().and_then(|a| host::device_size(Path::new(&a.device)).ok()).unwrap_or(0);
            vec![csi::VolumeUsage { available: 0, total: as_i64(total), used: 0, unit: Unit::Bytes as i32 }]
        };
        let problem = problem.or_else(|| copies.as_ref().filter(|c| c.abnormal).map(|c| c.message.clone()));
        let volume_condition = Some(csi::VolumeCondition {
            abnormal: problem.is_some(),
            message: problem.unwrap_or_else(|| match copies.filter(|c| c.message != "ok") {
                Some(c) => format!("attached and mounted; {}", c.message),
                None => "attached and mounted".into(),
            }),
        });
        Ok(Response::new(csi::NodeGetVolumeStatsResponse { usage, volume_condition }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let r = request.into_inner();
        require("volume_id", &r.volume_id)?;
        require("volume_path", &r.volume_path)?;
        let (name, attachment) = self.here(&r.volume_id).await?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let mut c = self.admin().await?;
        let required = r.capacity_range.as_ref().map_or(0, |c| u64::try_from(c.required_bytes).unwrap_or(0));
        let volume_size = match attachment.filter(|a| !a.remote.is_empty()) {
            // Another node grew the volume (ControllerExpandVolume): the device takes its new size.
            Some(a) if a.size < required => {
                c.resize_attachment(pb::ResizeAttachmentRequest { device: a.device }).await?.into_inner().size
            }
            Some(a) => a.size,
            None => c.get_volume(pb::GetVolumeRequest { name: name.into() }).await?.into_inner().size,
        };
        if required > volume_size {
            return Err(Status::failed_precondition(format!(
                "volume {} is {volume_size} bytes, less than the {required} asked for: ControllerExpandVolume first",
                r.volume_id
            )));
        }
        let device = Self::staged_device(&mut c, name).await?;
        let size = host::device_size(&device).map_err(internal("reading the device size"))?;
        if size < volume_size {
            return Err(Status::failed_precondition(format!(
                "{} still has {size} of the volume's {volume_size} bytes: this kernel cannot grow it online \
                 (ublk UPDATE_SIZE needs Linux 6.16); it takes the new size when it is staged again",
                device.display()
            )));
        }
        let path = Path::new(&r.volume_path);
        let mounted = mounted_at(path)?;
        if let Some(m) = mounted.filter(|m| m.fs_type != "devtmpfs") {
            host::grow(&m.fs_type, &device, path).await?;
            tracing::info!(volume = %r.volume_id, size, fs = %m.fs_type, "filesystem grown online");
        }
        Ok(Response::new(csi::NodeExpandVolumeResponse { capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX) }))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::rpc::Type;
        let capabilities = [
            Type::StageUnstageVolume,
            Type::GetVolumeStats,
            Type::ExpandVolume,
            Type::VolumeCondition,
            Type::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(|t| csi::NodeServiceCapability {
            r#type: Some(csi::node_service_capability::Type::Rpc(csi::node_service_capability::Rpc {
                r#type: t as i32,
            })),
        })
        .collect();
        Ok(Response::new(csi::NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        let mut segments: std::collections::HashMap<String, String> =
            [(TOPOLOGY_KEY.to_owned(), self.node_id.clone())].into();
        // The node's zone and region, as its daemon's configuration has them (from the Node's
        // labels): the scheduler then knows them as segments of the volumes' topology.
        let status = async { self.admin().await?.pool_status(pb::PoolStatusRequest {}).await };
        match tokio::time::timeout(std::time::Duration::from_secs(10), status).await {
            Ok(Ok(s)) => {
                let s = s.into_inner();
                for (key, v) in [(ZONE_KEY, s.zone), (REGION_KEY, s.region)] {
                    if !v.is_empty() {
                        segments.insert(key.to_owned(), v);
                    }
                }
            }
            _ => tracing::warn!("NodeGetInfo: the node's daemon did not answer; no zone or region reported"),
        }
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: self.max_volumes,
            accessible_topology: Some(csi::Topology { segments }),
        }))
    }
}
