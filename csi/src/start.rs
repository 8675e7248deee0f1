//! `ferrite csi`'s start: its command line, the driver's [`Options`] built from it (the admin
//! API's client TLS, the drain guard's listener and certificate, the node certificates'
//! signer), the cluster's certificates (made before they are read), and whether this node holds
//! storage. The `ferrite` binary adds what only it can serve: on a node without storage, the
//! attachment-only server of the daemon's library.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;

use crate::{Mode, Options};

/// A certificate and its key.
pub type Identity<'a> = (&'a Path, &'a Path);

#[derive(Debug, clap::Args)]
pub struct Args {
    /// controller (volumes on any node of the directory), node (this node's daemon), or all.
    #[arg(long, value_enum, default_value = "all")]
    pub mode: Mode,
    /// The CSI endpoint (Unix socket) the container orchestrator connects to.
    #[arg(long, env = "CSI_ENDPOINT")]
    pub endpoint: PathBuf,
    /// The CSI-Addons endpoint (Unix socket): ReclaimSpace, NetworkFence, VolumeGroup.
    #[arg(long, env = "CSI_ADDONS_ENDPOINT")]
    pub addons_endpoint: Option<PathBuf>,
    /// This node's name (its topology value `topology.ferrite.dev/node`).
    #[arg(long, env = "FERRITE_NODE_ID", default_value = "")]
    pub node_id: String,
    /// TOML file mapping node names to their daemons' admin endpoints: a socket path or
    /// `tcp://host:port` (controller mode).
    #[arg(long)]
    pub node_directory: Option<PathBuf>,
    /// Find the node daemons through the Kubernetes API instead: the EndpointSlices of this
    /// Service (`namespace/name`, port `admin`), e.g. `ferrite/ferrite-node` (controller mode).
    #[arg(long, env = "FERRITE_NODE_SERVICE", conflicts_with = "node_directory")]
    pub node_service: Option<String>,
    /// The name every daemon's certificate carries, when it is not the host of its endpoint
    /// (in Kubernetes: the node Service's DNS name, e.g. `ferrite-node.ferrite.svc`).
    #[arg(long, env = "FERRITE_ADMIN_SERVER_NAME")]
    pub admin_server_name: Option<String>,
    /// How the node attaches volumes: auto (ublk where the kernel has it, else kernel NBD), ublk, nbd.
    #[arg(long, default_value = "auto", value_parser = ["auto", "ublk", "nbd"])]
    pub attach_transport: String,
    /// The most volumes this node takes (reported by NodeGetInfo).
    #[arg(long, default_value_t = 128)]
    pub max_volumes: i64,
    /// Controller mode with --node-service: seconds a Node may be not Ready, its daemon
    /// unreachable, before its replicated volumes fail over to another copy (the node is
    /// fenced first, then the pods using its volumes move); 0: never. Not Ready
    /// already means no heartbeat for the node-monitor grace period (40-50 s).
    #[arg(long, default_value_t = 20)]
    pub failover_after: u64,
    /// The namespace of the nodes' storage heartbeats (`ferrite heartbeat`): failover also
    /// takes a node whose Lease expired, its daemon unreachable or its pool failed, for lost.
    #[arg(long, default_value = crate::kube::heartbeat::NAMESPACE)]
    pub node_lease_namespace: String,
    /// Controller mode with failover: serve the drain guard, the admission webhook that
    /// refuses a Node's cordon when it would leave a replicated volume without a majority,
    /// on this address (HTTPS with --tls-cert, which must name the controller Service).
    #[arg(long)]
    pub webhook_listen: Option<std::net::SocketAddr>,
    /// Failover also taints a fenced node that is not Ready `node.kubernetes.io/out-of-service`
    /// (NoExecute): Kubernetes then deletes all its pods and detaches every driver's volumes
    /// (non-graceful node shutdown). Kubernetes documents that taint as one to set once the
    /// node is known to be off: turn it on only where a lost node is (IPMI fencing). Off (the
    /// default), failover deletes only the pods using our volumes and our VolumeAttachments.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub out_of_service_taint: bool,
    /// Controller mode with --node-service: sign the nodes' certificate requests (signer
    /// `ferrite.dev/node`) with the CA in this directory (ca.crt, ca.key: the Secret
    /// ferrite-ca). Only the token of a pod of --signer-account gets a certificate, for its own node's names.
    #[arg(long)]
    pub signer_ca: Option<PathBuf>,
    /// The ServiceAccounts (in the node Service's namespace) whose pods the signer issues
    /// their node's certificate to: the daemons', and the node plugins' (nodes without storage
    /// reach volumes with it).
    #[arg(long, default_value = "ferrite-daemon,ferrite-node", value_delimiter = ',')]
    pub signer_account: Vec<String>,
    /// Controller mode in Kubernetes: make the cluster CA (Secret ferrite-ca) and this
    /// controller's certificate (Secret ferrite-controller-tls) where they are absent, renew
    /// the certificate, write both to --signer-ca and the --tls-* files before reading them,
    /// and set the drain guard's caBundle to the CA. An operator's own CA in ferrite-ca is used.
    #[arg(long, requires_all = ["signer_ca", "node_service"])]
    pub cluster_certs: bool,
    /// Node mode in Kubernetes: the Node label that marks a storage node (its value
    /// "true"). Without it no daemon runs on the node, and the plugin attaches the volumes
    /// its pods use from other nodes itself (on the admin socket's path).
    #[arg(long)]
    pub storage_label: Option<String>,
    /// Node mode: this node holds no storage (no daemon runs here), as --storage-label
    /// finds out in Kubernetes.
    #[arg(long, conflicts_with = "storage_label")]
    pub no_storage: bool,
    /// On a node without storage: the node's certificate (tls.crt, tls.key, ca.crt), its
    /// identity to the nodes whose volumes it reaches.
    #[arg(long, default_value = "/etc/ferrite/tls")]
    pub node_tls_dir: PathBuf,
    /// On a node without storage: where its attachments are recorded (a tmpfs: they live as
    /// long as the kernel's devices).
    #[arg(long, default_value = "/run/ferrite/plugin")]
    pub attach_state_dir: PathBuf,
    /// The longest lifetime the signer gives a node certificate, in days.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=365))]
    pub signer_max_days: u64,
    /// A peer asynchronous replication may push to (repeatable): NAME=tcp://host:port (a
    /// daemon elsewhere, over mutual TLS), NAME=/path/to/admin.sock, or NAME=node:NODE (a node
    /// of the directory). A VolumeReplicationClass names one (`peer: NAME`); none listed:
    /// replication is refused.
    #[arg(long = "replication-peer", value_name = "NAME=ENDPOINT")]
    pub replication_peers: Vec<String>,
}

/// The `--tls-*` files of the command line: the CA the daemons' certificates are checked
/// against, and this driver's certificate and key.
#[derive(Debug, Clone, Copy, Default)]
pub struct TlsFiles<'a> {
    pub ca: Option<&'a Path>,
    pub cert: Option<&'a Path>,
    pub key: Option<&'a Path>,
}

impl TlsFiles<'_> {
    fn identity(&self) -> Option<Identity<'_>> {
        self.cert.zip(self.key)
    }
}

/// The driver's options: the arguments, and the TLS configurations they name. `admin_tls` is
/// the CA and the identity the admin API is reached with (`--tls-*`, checked by the caller).
pub fn options(
    a: &Args,
    admin_tls: Option<(&Path, Option<Identity<'_>>)>,
    tls: TlsFiles<'_>,
    admin_socket: PathBuf,
) -> Result<Options> {
    let Args {
        mode,
        endpoint,
        addons_endpoint,
        node_id,
        node_directory,
        node_service,
        admin_server_name,
        attach_transport,
        max_volumes,
        failover_after,
        node_lease_namespace,
        out_of_service_taint,
        ..
    } = a;
    let admin_tls = match admin_tls {
        Some((ca, identity)) => Some(Arc::new(ferrite_proto::admin_tls_reloading(ca, identity)?)),
        None => None,
    };
    let (webhook, signer) = (webhook(a, tls)?, signer(a)?);
    let node_id = if node_id.is_empty() { hostname() } else { node_id.clone() };
    Ok(Options {
        mode: *mode,
        endpoint: endpoint.clone(),
        addons_endpoint: addons_endpoint.clone(),
        node_id,
        admin_socket,
        node_directory: node_directory.clone(),
        node_service: node_service.clone(),
        admin_server_name: admin_server_name.clone(),
        transport: attach_transport.clone(),
        max_volumes: *max_volumes,
        admin_tls,
        failover_after: (*failover_after > 0).then(|| std::time::Duration::from_secs(*failover_after)),
        node_lease_namespace: node_lease_namespace.clone(),
        out_of_service_taint: *out_of_service_taint,
        webhook,
        signer,
        replication_peers: crate::addons::replication::parse_peers(&a.replication_peers).map_err(anyhow::Error::msg)?,
    })
}

/// The drain guard's address and TLS (the --tls-* certificate).
fn webhook(a: &Args, tls: TlsFiles<'_>) -> Result<Option<(std::net::SocketAddr, Arc<ferrite_tls::ServerTls>)>> {
    Ok(match (&a.webhook_listen, tls.identity()) {
        (None, _) => None,
        (Some(_), None) => {
            anyhow::bail!("--webhook-listen needs --tls-cert and --tls-key");
        }
        (Some(at), Some((cert, key))) => match ferrite_tls::reload::server(cert, key, None, &[b"http/1.1"]) {
            Ok(tls) => Some((*at, Arc::new(tls))),
            Err(e) => anyhow::bail!("the webhook's certificate: {e}"),
        },
    })
}

/// The node certificates' signer, with --signer-ca.
fn signer(a: &Args) -> Result<Option<crate::kube::certs::signer::Signer>> {
    Ok(match (&a.signer_ca, a.node_service.as_deref().and_then(|s| s.split_once('/')), &a.admin_server_name) {
        (None, _, _) => None,
        (Some(ca), Some((ns, _)), Some(service)) => Some(crate::kube::certs::signer::Signer {
            ca_dir: ca.clone(),
            namespace: ns.to_owned(),
            accounts: a.signer_account.clone(),
            service: service.clone(),
            max_lifetime: std::time::Duration::from_secs(a.signer_max_days * 86_400),
        }),
        (Some(_), _, _) => {
            anyhow::bail!(
                "--signer-ca needs --node-service (the daemons' namespace) and --admin-server-name (the name their certificates carry)"
            );
        }
    })
}

/// Where `--cluster-certs` writes: the signer's directory and the --tls-* files, which it
/// needs; the controller Service in the node Service's namespace.
pub fn cluster_certs(a: &Args, tls: TlsFiles<'_>) -> Result<Option<crate::kube::certs::cluster::Options>> {
    if !a.cluster_certs {
        return Ok(None);
    }
    let (Some(ca_dir), Some(tls_ca), Some(tls_cert), Some(tls_key)) = (&a.signer_ca, tls.ca, tls.cert, tls.key) else {
        anyhow::bail!("--cluster-certs writes --signer-ca, --tls-ca, --tls-cert and --tls-key: give all four");
    };
    let namespace = a.node_service.as_deref().and_then(|s| s.split_once('/')).map(|(ns, _)| ns.to_owned());
    let namespace = namespace.ok_or_else(|| anyhow::anyhow!("--cluster-certs needs --node-service NAMESPACE/NAME"))?;
    Ok(Some(crate::kube::certs::cluster::Options {
        service: format!("ferrite-controller.{namespace}.svc"),
        namespace,
        ca_dir: ca_dir.clone(),
        tls_ca: tls_ca.to_owned(),
        tls_cert: tls_cert.to_owned(),
        tls_key: tls_key.to_owned(),
    }))
}

/// Whether this node (`node`) holds storage: not with --no-storage; with --storage-label,
/// whether its Node carries that label as "true" (a daemon runs there); else it does.
pub async fn holds_storage(a: &Args, node: &str) -> Result<bool> {
    Ok(match a.storage_label.as_deref() {
        _ if a.no_storage => false,
        Some(label) => {
            let (_, labels) = crate::shared::nodes::kubernetes::node_annotations(node).await?;
            labels.get(label).is_some_and(|v| v == "true")
        }
        None => true,
    })
}

/// This machine's name, lower case (the node id by default).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_lowercase()).unwrap_or_default()
}
