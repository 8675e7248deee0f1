//! `ferrite csi`: the CSI driver (`ferrite_csi`), with what its start needs from the command
//! line: the cluster's certificates, the webhook's and the signer's, and on a node without
//! storage the attachment-only server (`ferrite_daemon::serve::attach_only`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use ferrite_daemon::base::config;
use ferrite_daemon::serve::attach_only;

use crate::args::Globals;

#[derive(clap::Args)]
pub struct Args {
    /// controller (volumes on any node of the directory), node (this node's daemon), or all.
    #[arg(long, value_enum, default_value = "all")]
    pub mode: CsiMode,
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
    #[arg(long, default_value = ferrite_csi::heartbeat::NAMESPACE)]
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
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum CsiMode {
    Controller,
    Node,
    All,
}

pub fn run(a: &Args, g: &Globals) -> Result<()> {
    super::init_logging("info");
    let rt = super::runtime();
    let cluster = cluster_certs_options(g, a.cluster_certs, &a.signer_ca, a.node_service.as_deref())?;
    if let Some(o) = &cluster {
        rt.block_on(ferrite_csi::certs::cluster::make(o)).context("the cluster's certificates")?;
    }
    let opts = options(a, g)?;
    let attach_only = matches!(a.mode, CsiMode::Node).then(|| attach_only::Options {
        socket: g.admin_socket(),
        state_dir: a.attach_state_dir.clone(),
        tls: config::TlsFiles {
            cert: a.node_tls_dir.join("tls.crt"),
            key: a.node_tls_dir.join("tls.key"),
            client_ca: Some(a.node_tls_dir.join("ca.crt")),
            peer_name: a.admin_server_name.clone(),
        },
        hold: config::DEFAULT_DEVICE_HOLD,
        request_timeout: config::DEFAULT_NBD_DEVICE_TIMEOUT,
    });
    let (node, no_storage, storage_label) = (opts.node_id.clone(), a.no_storage, a.storage_label.as_deref());
    rt.block_on(async move {
        if let Some(o) = cluster {
            ferrite_csi::certs::cluster::keep(o);
        }
        let storage = match storage_label {
            _ if no_storage => false,
            Some(label) => holds_storage(&node, label).await?,
            None => true,
        };
        let serving = match attach_only {
            Some(o) if !storage => Some(attach_only::start(o).await?),
            _ => None,
        };
        let served = ferrite_csi::serve(opts, super::shutdown_signal()).await;
        if let Some(s) = serving {
            s.stop().await;
        }
        served
    })
}

/// The driver's options: the arguments, and the TLS configurations they name.
fn options(a: &Args, g: &Globals) -> Result<ferrite_csi::Options> {
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
    let (admin_tls, webhook, signer) = (admin_tls(g)?, webhook(a, g)?, signer(a)?);
    let node_id = if node_id.is_empty() { super::hostname() } else { node_id.clone() };
    Ok(ferrite_csi::Options {
        mode: match mode {
            CsiMode::Controller => ferrite_csi::Mode::Controller,
            CsiMode::Node => ferrite_csi::Mode::Node,
            CsiMode::All => ferrite_csi::Mode::All,
        },
        endpoint: endpoint.clone(),
        addons_endpoint: addons_endpoint.clone(),
        node_id,
        admin_socket: g.admin_socket(),
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
    })
}

/// The admin API's client TLS. The driver runs for months: its certificate follows its files.
fn admin_tls(g: &Globals) -> Result<Option<Arc<ferrite_tls::Reloading<ferrite_tls::rustls::ClientConfig>>>> {
    let Some((ca, identity)) = g.tls_files()? else { return Ok(None) };
    Ok(Some(Arc::new(ferrite_proto::admin_tls_reloading(ca, identity)?)))
}

/// The drain guard's address and TLS (the --tls-* certificate).
fn webhook(a: &Args, g: &Globals) -> Result<Option<(std::net::SocketAddr, Arc<ferrite_tls::ServerTls>)>> {
    Ok(match (&a.webhook_listen, g.identity()) {
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
fn signer(a: &Args) -> Result<Option<ferrite_csi::certs::signer::Signer>> {
    Ok(match (&a.signer_ca, a.node_service.as_deref().and_then(|s| s.split_once('/')), &a.admin_server_name) {
        (None, _, _) => None,
        (Some(ca), Some((ns, _)), Some(service)) => Some(ferrite_csi::certs::signer::Signer {
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
fn cluster_certs_options(
    g: &Globals,
    on: bool,
    signer_ca: &Option<PathBuf>,
    node_service: Option<&str>,
) -> anyhow::Result<Option<ferrite_csi::certs::cluster::Options>> {
    if !on {
        return Ok(None);
    }
    let (Some(ca_dir), Some(tls_ca), Some(tls_cert), Some(tls_key)) = (signer_ca, &g.tls_ca, &g.tls_cert, &g.tls_key)
    else {
        anyhow::bail!("--cluster-certs writes --signer-ca, --tls-ca, --tls-cert and --tls-key: give all four");
    };
    let namespace = node_service.and_then(|s| s.split_once('/')).map(|(ns, _)| ns.to_owned());
    let namespace = namespace.ok_or_else(|| anyhow::anyhow!("--cluster-certs needs --node-service NAMESPACE/NAME"))?;
    Ok(Some(ferrite_csi::certs::cluster::Options {
        service: format!("ferrite-controller.{namespace}.svc"),
        namespace,
        ca_dir: ca_dir.clone(),
        tls_ca: tls_ca.clone(),
        tls_cert: tls_cert.clone(),
        tls_key: tls_key.clone(),
    }))
}

/// Whether Node `node` is a storage node: its `label` is "true" (a daemon runs there).
async fn holds_storage(node: &str, label: &str) -> anyhow::Result<bool> {
    let (_, labels) = ferrite_csi::nodes::kubernetes::node_annotations(node).await?;
    Ok(labels.get(label).is_some_and(|v| v == "true"))
}
