//! `ferrite csi`: the CSI 1.12 driver over the daemons' admin API, in rooms by what they serve:
//!
//! - [`shared`]: what every service uses: the node directory ([`shared::nodes`]: a static file, or
//!   the Kubernetes API's EndpointSlices), volume ids `<node>/<volume>` so the controller keeps no
//!   state ([`shared::ids`]), argument and StorageClass checks, per-volume QoS limits
//!   ([`shared::qos`]), where a replicated volume's copies are ([`shared::copies`]), the keys of
//!   encrypted volumes, and snapshots that are backups off the cluster.
//! - [`spec`]: the CSI services: identity; the controller (volumes created from nothing, a
//!   snapshot or a volume, placed by topology `topology.ferrite.dev/node`; snapshots; publish);
//!   group snapshots; SnapshotMetadata (allocated and changed ranges, for backups); the node
//!   (stage, publish, expand, stats).
//! - [`addons`]: the CSI-Addons services on their own endpoint: ReclaimSpace, NetworkFence,
//!   VolumeGroup, Replication, EncryptionKeyRotation.
//! - [`kube`]: the control loops over the Kubernetes API: failover of replicated volumes off a
//!   lost node, the storage heartbeat, the Lease, the drain guard's webhook, the cluster's
//!   certificates.
//! - [`start`]: what `ferrite csi` runs before it serves; `ferrite_proto::busy`: one operation
//!   per volume at a time (Aborted for the second).
//!
//! `spec` and `kube` do not use each other, and no room uses one above it (`tests/layout.rs`).

pub mod addons;
pub mod kube;
pub mod shared;
pub mod spec;
pub mod start;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use ferrite_proto::csi::v1 as csi;
use tokio_stream::wrappers::UnixListenerStream;

use crate::shared::nodes::{NodeDirectory, StaticNodes};

/// Which CSI services this process serves (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Controller,
    Node,
    All,
}

#[derive(Debug, Clone)]
pub struct Options {
    pub mode: Mode,
    /// The CSI endpoint (a Unix socket path).
    pub endpoint: PathBuf,
    /// The CSI-Addons endpoint (a Unix socket path), if served.
    pub addons_endpoint: Option<PathBuf>,
    /// This node's name (node and all modes).
    pub node_id: String,
    /// The local daemon's admin socket (node and all modes).
    pub admin_socket: PathBuf,
    /// The node directory file (controller mode; in all mode it defaults to this node alone).
    pub node_directory: Option<PathBuf>,
    /// Or the node Service (`namespace/name`) whose EndpointSlices list the node daemons.
    pub node_service: Option<String>,
    /// The name the daemons' certificates carry, when it is not the endpoint's host.
    pub admin_server_name: Option<String>,
    /// How the node attaches volumes: auto (ublk if the kernel has it, else NBD), ublk or nbd.
    pub transport: String,
    /// What NodeGetInfo reports as the most volumes this node takes, and the most the
    /// controller publishes to one node.
    pub max_volumes: i64,
    /// TLS for `tcp://` admin endpoints: the CA of the daemons' certificates and this driver's
    /// client certificate (the daemons require mutual TLS).
    pub admin_tls: Option<Arc<ferrite_tls::Reloading<ferrite_proto::ClientTls>>>,
    /// Controller mode with the Kubernetes node directory: fail replicated volumes over from a
    /// node not Ready for this long whose daemon does not answer (None: never).
    pub failover_after: Option<std::time::Duration>,
    /// Where the nodes' storage heartbeats (Leases) are.
    pub node_lease_namespace: String,
    /// Failover taints a fenced node out-of-service (else it deletes its VolumeAttachments).
    pub out_of_service_taint: bool,
    /// Where the drain guard's admission webhook listens, and its TLS (controller mode with
    /// failover).
    pub webhook: Option<(std::net::SocketAddr, Arc<ferrite_tls::ServerTls>)>,
    /// Controller mode: sign the nodes' certificate requests.
    pub signer: Option<kube::certs::signer::Signer>,
    /// Controller mode: the peers replication may push to, by name (`--replication-peer`).
    pub replication_peers: std::collections::BTreeMap<String, String>,
}

impl Options {
    async fn directory(&self) -> anyhow::Result<Arc<dyn NodeDirectory>> {
        if !shared::nodes::valid_node(&self.node_id) && self.mode != Mode::Controller {
            anyhow::bail!("node id {:?} is not a valid node name (lowercase letters, digits, '-', '.')", self.node_id);
        }
        let (tls, name) = (self.admin_tls.clone(), self.admin_server_name.clone());
        Ok(match (&self.node_directory, &self.node_service, self.mode) {
            (Some(_), Some(_), _) => anyhow::bail!("--node-directory and --node-service exclude each other"),
            (Some(p), None, _) => Arc::new(StaticNodes::load(p)?.with_tls(tls, name)),
            (None, Some(s), _) => Arc::new(shared::nodes::kubernetes::KubeNodes::watch(s, tls, name).await?),
            (None, None, Mode::Controller) => anyhow::bail!("controller mode needs --node-directory or --node-service"),
            (None, None, _) => Arc::new(StaticNodes::single(&self.node_id, &self.admin_socket)),
        })
    }
}

fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("{} is in use by a running process", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))
}

/// Serves until `shutdown` resolves.
pub async fn serve(opts: Options, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let dir = opts.directory().await?;
    let listener = bind(&opts.endpoint)?;
    let addons_listener = opts.addons_endpoint.as_deref().map(bind).transpose()?;
    let controller = opts.mode != Mode::Node;
    // One operation per volume at a time, across the controller and node services.
    let busy = ferrite_proto::busy::Busy::default();
    let node = (opts.mode != Mode::Controller).then(|| spec::node::Node {
        node_id: opts.node_id.clone(),
        nodes: Arc::clone(&dir),
        transport: opts.transport.clone(),
        max_volumes: opts.max_volumes,
        busy: busy.clone(),
    });
    if let (true, Some(_), Some(after)) = (controller, &opts.node_service, opts.failover_after) {
        let lease_namespace = &opts.node_lease_namespace;
        let taint = opts.out_of_service_taint;
        let metrics = Arc::new(kube::failover::Metrics::default());
        let guard = kube::failover::start(
            Arc::clone(&dir),
            spec::identity::DRIVER_NAME,
            after,
            lease_namespace,
            taint,
            Arc::clone(&metrics),
        )
        .await?;
        if let Some((at, tls)) = &opts.webhook {
            let listener = tokio::net::TcpListener::bind(at).await.with_context(|| format!("binding {at}"))?;
            tracing::info!(%at, "the drain guard's admission webhook is on");
            tokio::spawn(kube::webhook::serve(listener, Arc::clone(tls), guard, metrics));
        }
    } else if opts.webhook.is_some() {
        anyhow::bail!(
            "--webhook-listen serves the drain guard, which needs controller mode, --node-service and failover"
        );
    }
    let signer = match (&opts.signer, controller) {
        (None, _) => None,
        (Some(s), true) => Some(kube::certs::signer::start(s.clone()).await?),
        (Some(_), false) => anyhow::bail!("--signer-ca needs controller mode"),
    };
    if node.is_some() {
        // The daemon may be away (restarting, or for good): its ublk devices' hold ends here.
        ferrite_ublk::hold::spawn(ferrite_ublk::hold::path(&opts.admin_socket))?;
    }
    // The controller reads PVs where the directory is the cluster's (`shared::pvs`).
    let kube_client = match (controller, &opts.node_service) {
        (true, Some(_)) => Some(::kube::Client::try_default().await.context("connecting to the Kubernetes API")?),
        _ => None,
    };
    let identity = spec::identity::Identity { controller };
    let router = tonic::transport::Server::builder()
        .add_service(csi::identity_server::IdentityServer::new(identity))
        .add_optional_service(controller.then(|| {
            csi::controller_server::ControllerServer::new(spec::controller::Controller {
                nodes: Arc::clone(&dir),
                busy: busy.clone(),
                max_volumes: opts.max_volumes,
                kube: kube_client.clone(),
            })
        }))
        .add_optional_service(controller.then(|| {
            csi::group_controller_server::GroupControllerServer::new(spec::group::GroupController {
                nodes: Arc::clone(&dir),
            })
        }))
        .add_optional_service(controller.then(|| {
            csi::snapshot_metadata_server::SnapshotMetadataServer::new(spec::metadata::SnapshotMetadata {
                nodes: Arc::clone(&dir),
            })
        }))
        .add_optional_service(node.clone().map(csi::node_server::NodeServer::new));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let addons = addons_listener.map(|l| {
        use ferrite_proto::csi_addons::{
            encryptionkeyrotation as ek, fence as f, identity as i, reclaimspace as r, replication as rp,
            volumegroup as v,
        };
        let identity = addons::identity::AddonsIdentity { controller, node: node.is_some() };
        tonic::transport::Server::builder()
            .add_service(i::identity_server::IdentityServer::new(identity))
            .add_optional_service(controller.then(|| {
                r::reclaim_space_controller_server::ReclaimSpaceControllerServer::new(
                    addons::reclaim::ReclaimController { nodes: Arc::clone(&dir) },
                )
            }))
            .add_optional_service(controller.then(|| {
                f::fence_controller_server::FenceControllerServer::new(addons::fence::Fence { nodes: Arc::clone(&dir) })
            }))
            .add_optional_service(controller.then(|| {
                v::controller_server::ControllerServer::new(addons::volume_group::VolumeGroups {
                    nodes: Arc::clone(&dir),
                })
            }))
            .add_optional_service(controller.then(|| {
                rp::controller_server::ControllerServer::new(addons::replication::Replication {
                    nodes: Arc::clone(&dir),
                    busy: busy.clone(),
                    peers: opts.replication_peers.clone(),
                })
            }))
            .add_optional_service((controller || node.is_some()).then(|| {
                ek::encryption_key_rotation_controller_server::EncryptionKeyRotationControllerServer::new(
                    addons::key_rotation::KeyRotation { nodes: Arc::clone(&dir), busy: busy.clone() },
                )
            }))
            .add_optional_service(node.map(r::reclaim_space_node_server::ReclaimSpaceNodeServer::new))
            .serve_with_incoming_shutdown(UnixListenerStream::new(l), until(stopped.clone()))
    });
    tracing::info!(endpoint = %opts.endpoint.display(), addons = ?opts.addons_endpoint, mode = ?opts.mode,
        node = %opts.node_id, "CSI driver ready");
    let main = router.serve_with_incoming_shutdown(UnixListenerStream::new(listener), until(stopped));
    let signal = async move {
        shutdown.await;
        let _ = stop.send(true);
        Ok(())
    };
    let served = match addons {
        Some(a) => tokio::try_join!(main, a, signal).map(drop),
        None => tokio::try_join!(main, signal).map(drop),
    };
    if let Some(s) = signer {
        s.abort();
    }
    let _ = std::fs::remove_file(&opts.endpoint);
    if let Some(p) = &opts.addons_endpoint {
        let _ = std::fs::remove_file(p);
    }
    served.context("CSI server")
}
