//! `ferrite`: the block storage daemon (`ferrite daemon`) and its command-line client.

mod backup_cli;
mod cli;
mod hand_over;
mod node_pool;
mod pool_format;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use cli::{Output, connect, rpc_error};
use ferrite_daemon::base::{config, size};
use ferrite_daemon::serve::{attach_only, daemon};
use ferrite_proto::ferrite::v1 as pb;
use size::parse_size;

#[derive(Parser)]
#[command(name = "ferrite", version, about = "Ferrite block storage: daemon and command-line client")]
struct Cli {
    /// The daemon's admin socket (default: <data dir>/admin.sock).
    #[arg(long, global = true, env = "FERRITE_ADMIN_SOCKET")]
    admin_socket: Option<PathBuf>,
    /// Reach the daemon's admin API over TCP instead (its `admin-listen`, HOST:PORT), with mutual
    /// TLS (--tls-ca, --tls-cert, --tls-key).
    #[arg(long, global = true, env = "FERRITE_ADMIN_TCP")]
    admin_tcp: Option<String>,
    /// CA certificate (PEM) the daemons' certificates are checked against (admin over TCP, and
    /// `ferrite csi` to tcp:// nodes).
    #[arg(long, global = true, env = "FERRITE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM) for mutual TLS.
    #[arg(long, global = true, env = "FERRITE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, global = true, env = "FERRITE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Output format of client commands.
    #[arg(long, short, global = true, value_enum, default_value = "table")]
    output: Output,
    #[command(subcommand)]
    cmd: Cmd,
}

impl Cli {
    /// The daemon's admin socket: --admin-socket, else `<default data dir>/admin.sock`.
    fn admin_socket(&self) -> PathBuf {
        self.admin_socket.clone().unwrap_or_else(|| config::default_data_dir().join("admin.sock"))
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon in the foreground.
    Daemon {
        /// TOML configuration file (every key optional; see the config docs).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Data directory (overrides the config file).
        #[arg(long, env = "FERRITE_DATA_DIR")]
        data_dir: Option<PathBuf>,
    },
    /// Run the CSI driver (CSI 1.12) over the daemons' admin API.
    Csi {
        /// controller (volumes on any node of the directory), node (this node's daemon), or all.
        #[arg(long, value_enum, default_value = "all")]
        mode: CsiMode,
        /// The CSI endpoint (Unix socket) the container orchestrator connects to.
        #[arg(long, env = "CSI_ENDPOINT")]
        endpoint: PathBuf,
        /// The CSI-Addons endpoint (Unix socket): ReclaimSpace, NetworkFence, VolumeGroup.
        #[arg(long, env = "CSI_ADDONS_ENDPOINT")]
        addons_endpoint: Option<PathBuf>,
        /// This node's name (its topology value `topology.ferrite.dev/node`).
        #[arg(long, env = "FERRITE_NODE_ID", default_value = "")]
        node_id: String,
        /// TOML file mapping node names to their daemons' admin endpoints: a socket path or
        /// `tcp://host:port` (controller mode).
        #[arg(long)]
        node_directory: Option<PathBuf>,
        /// Find the node daemons through the Kubernetes API instead: the EndpointSlices of this
        /// Service (`namespace/name`, port `admin`), e.g. `ferrite/ferrite-node` (controller mode).
        #[arg(long, env = "FERRITE_NODE_SERVICE", conflicts_with = "node_directory")]
        node_service: Option<String>,
        /// The name every daemon's certificate carries, when it is not the host of its endpoint
        /// (in Kubernetes: the node Service's DNS name, e.g. `ferrite-node.ferrite.svc`).
        #[arg(long, env = "FERRITE_ADMIN_SERVER_NAME")]
        admin_server_name: Option<String>,
        /// How the node attaches volumes: auto (ublk where the kernel has it, else kernel NBD), ublk, nbd.
        #[arg(long, default_value = "auto", value_parser = ["auto", "ublk", "nbd"])]
        attach_transport: String,
        /// The most volumes this node takes (reported by NodeGetInfo).
        #[arg(long, default_value_t = 128)]
        max_volumes: i64,
        /// Controller mode with --node-service: seconds a Node may be not Ready, its daemon
        /// unreachable, before its replicated volumes fail over to another copy (the node is
        /// fenced first, then the pods using its volumes move); 0: never. Not Ready
        /// already means no heartbeat for the node-monitor grace period (40-50 s).
        #[arg(long, default_value_t = 20)]
        failover_after: u64,
        /// The namespace of the nodes' storage heartbeats (`ferrite heartbeat`): failover also
        /// takes a node whose Lease expired, its daemon unreachable or its pool failed, for lost.
        #[arg(long, default_value = ferrite_csi::heartbeat::NAMESPACE)]
        node_lease_namespace: String,
        /// Controller mode with failover: serve the drain guard, the admission webhook that
        /// refuses a Node's cordon when it would leave a replicated volume without a majority,
        /// on this address (HTTPS with --tls-cert, which must name the controller Service).
        #[arg(long)]
        webhook_listen: Option<std::net::SocketAddr>,
        /// Failover also taints a fenced node that is not Ready `node.kubernetes.io/out-of-service`
        /// (NoExecute): Kubernetes then deletes all its pods and detaches every driver's volumes
        /// (non-graceful node shutdown). Kubernetes documents that taint as one to set once the
        /// node is known to be off: turn it on only where a lost node is (IPMI fencing). Off (the
        /// default), failover deletes only the pods using our volumes and our VolumeAttachments.
        #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
        out_of_service_taint: bool,
        /// Controller mode with --node-service: sign the nodes' certificate requests (signer
        /// `ferrite.dev/node`) with the CA in this directory (ca.crt, ca.key: the Secret
        /// ferrite-ca). Only the token of a pod of --signer-account gets a certificate, for its own node's names.
        #[arg(long)]
        signer_ca: Option<PathBuf>,
        /// The ServiceAccounts (in the node Service's namespace) whose pods the signer issues
        /// their node's certificate to: the daemons', and the node plugins' (nodes without storage
        /// reach volumes with it).
        #[arg(long, default_value = "ferrite-daemon,ferrite-node", value_delimiter = ',')]
        signer_account: Vec<String>,
        /// Controller mode in Kubernetes: make the cluster CA (Secret ferrite-ca) and this
        /// controller's certificate (Secret ferrite-controller-tls) where they are absent, renew
        /// the certificate, write both to --signer-ca and the --tls-* files before reading them,
        /// and set the drain guard's caBundle to the CA. An operator's own CA in ferrite-ca is used.
        #[arg(long, requires_all = ["signer_ca", "node_service"])]
        cluster_certs: bool,
        /// Node mode in Kubernetes: the Node label that marks a storage node (its value
        /// "true"). Without it no daemon runs on the node, and the plugin attaches the volumes
        /// its pods use from other nodes itself (on the admin socket's path).
        #[arg(long)]
        storage_label: Option<String>,
        /// Node mode: this node holds no storage (no daemon runs here), as --storage-label
        /// finds out in Kubernetes.
        #[arg(long, conflicts_with = "storage_label")]
        no_storage: bool,
        /// On a node without storage: the node's certificate (tls.crt, tls.key, ca.crt), its
        /// identity to the nodes whose volumes it reaches.
        #[arg(long, default_value = "/etc/ferrite/tls")]
        node_tls_dir: PathBuf,
        /// On a node without storage: where its attachments are recorded (a tmpfs: they live as
        /// long as the kernel's devices).
        #[arg(long, default_value = "/run/ferrite/plugin")]
        attach_state_dir: PathBuf,
        /// The longest lifetime the signer gives a node certificate, in days.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=365))]
        signer_max_days: u64,
    },
    /// Have this node's certificate issued by the cluster (the CertificateSigningRequest API,
    /// signer `ferrite.dev/node`: the controller with --signer-ca) unless the one in --dir names
    /// the node's current addresses and is not due for renewal; with --renew, keep renewing it.
    /// The daemon pod's init container and its node-cert container.
    NodeCert {
        /// This node's name.
        #[arg(long, env = "NODE_NAME")]
        node: String,
        /// Where tls.key (made here once, 0600), tls.crt and ca.crt are.
        #[arg(long, default_value = "/etc/ferrite/tls")]
        dir: PathBuf,
        /// The node Service's DNS name, which every node's certificate carries.
        #[arg(long, default_value = "ferrite-node.ferrite.svc")]
        service: String,
        /// The lifetime to ask for, in days (renewed two thirds into it).
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=365))]
        days: u64,
        /// Seconds to wait for the signer's answer.
        #[arg(long, default_value_t = 300)]
        wait: u64,
        /// Keep running: renew whenever due.
        #[arg(long)]
        renew: bool,
        /// With --renew: seconds between looks at the files (a missing or outdated certificate
        /// is replaced at the next look).
        #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
        check_every: u64,
    },
    /// Renew this node's storage Lease (`ferrite-node-<node>`) for as long as the daemon at
    /// --admin-socket answers with a healthy pool: the daemon pod's heartbeat container, which
    /// the failover loop watches to see a silent daemon on a Ready node.
    Heartbeat {
        /// This node's name.
        #[arg(long, env = "NODE_NAME")]
        node: String,
        /// The namespace of the nodes' Leases (the controller's --node-lease-namespace).
        #[arg(long, default_value = ferrite_csi::heartbeat::NAMESPACE)]
        namespace: String,
        /// Seconds between renewals (and the time the daemon has to answer).
        #[arg(long, default_value_t = 2)]
        every: u64,
        /// Seconds after its last renewal the Lease counts as expired.
        #[arg(long, default_value_t = 10)]
        lease_duration: u64,
        /// Seconds the Lease holds after the heartbeat is stopped on purpose (the pod deleted for
        /// an upgrade): a planned restart is not a lost node. Longer than the daemon pod's
        /// terminationGracePeriodSeconds (180) plus a start, so that a slow stop never turns an
        /// upgrade into a failover.
        #[arg(long, default_value_t = 300)]
        restart_grace: u64,
    },
    /// Manage volumes.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Manage snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Replicate volumes to peer daemons.
    #[command(subcommand)]
    Replica(ReplicaCmd),
    /// Create a writable volume from a snapshot (`ferrite clone db@nightly db-test`) or from a
    /// volume's current content (`ferrite clone db db-copy`).
    Clone {
        /// `volume@snapshot`, `snapshot`, or a volume name.
        source: String,
        /// Name of the new volume.
        name: String,
    },
    /// Manage volume groups and their crash-consistent group snapshots.
    #[command(subcommand)]
    Group(GroupCmd),
    /// Manage NBD exports.
    #[command(subcommand)]
    Export(ExportCmd),
    /// Backups to the object stores (targets) the daemon's config names, and restores.
    #[command(subcommand)]
    Backup(backup_cli::BackupCmd),
    /// Attach a volume (or `volume@snapshot`, read-only) as a block device on this machine:
    /// ublk (/dev/ublkbN) where the kernel has it, else the kernel NBD client (/dev/nbdN) over the
    /// daemon's Unix socket. The daemon owns the device; needs root. Prints the device.
    Attach {
        volume: String,
        /// auto, ublk or nbd.
        #[arg(long, default_value = "auto")]
        transport: String,
        /// ublk queues (default: the daemon's ublk-queues).
        #[arg(long, default_value_t = 0)]
        queues: u32,
        /// ublk queue depth (default: the daemon's ublk-depth).
        #[arg(long, default_value_t = 0)]
        depth: u32,
        /// Another daemon's NBD listener (host:port) serving the volume: attached with the kernel
        /// NBD client, relayed over TLS with this daemon's certificate. Needs --export.
        #[arg(long, requires = "export")]
        remote: Option<String>,
        /// The export the remote daemon granted to this node.
        #[arg(long, requires = "remote")]
        export: Option<String>,
        /// The NBD listener of another copy of the volume (host:port), where its primary may move
        /// in a failover: the device follows it there. Repeatable.
        #[arg(long = "copy", requires = "remote")]
        copies: Vec<String>,
    },
    /// Detach a device made by `ferrite attach` (by device path or volume name).
    Detach { device: String },
    /// Give the device of another node's volume (`attach --remote`) that volume's current size,
    /// after its node grew it.
    Refresh { device: String },
    /// List the devices attached by the daemon.
    Attachments,
    /// Network fencing: refuse (and cut) TCP clients from CIDR blocks on the NBD and admin listeners.
    #[command(subcommand)]
    Fence(FenceCmd),
    /// List the clients connected over TCP (NBD, admin).
    Clients,
    /// This CLI's version and the daemon's, with the pool formats it reads; fails where the two
    /// may not work together (the skew rule: docs/operations.md, "Upgrades").
    Version,
    /// Fails the ublk devices no daemon served within their hold (`device-hold-s`), so their I/O
    /// ends with EIO instead of waiting for ever; runs until killed. The CSI node plugin does this
    /// itself; run it beside a standalone daemon (it must outlive the daemon, e.g. its own unit).
    Watchdog,
    /// Pool information.
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Make TLS certificates for a test or a small cluster: a CA in DIR (ca.pem, ca-key.pem; made
    /// once, reused after) and NAME.pem / NAME-key.pem signed by it, valid as a server and as a
    /// client certificate for NAME and every SAN (DNS names, IP addresses).
    /// `ferrite certs /etc/ferrite node-a 10.0.0.5 --role replication-peer` for a daemon,
    /// `ferrite certs /etc/ferrite csi --role controller` for the CSI driver. What a certificate
    /// may do is bound to NAME in each daemon's `[roles]`: with --role, the line to add is printed.
    Certs {
        dir: PathBuf,
        name: String,
        sans: Vec<String>,
        /// A role for NAME (operator, controller, replication-peer, nbd-client, metrics); repeatable.
        #[arg(long = "role")]
        roles: Vec<String>,
        /// Validity in days (the CA, when made now: ten times as long).
        #[arg(long, default_value_t = 825, value_parser = clap::value_parser!(u32).range(1..=3650))]
        days: u32,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum CsiMode {
    Controller,
    Node,
    All,
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a thin volume, e.g. `ferrite volume create db 10G [--iops 5000 --bw 200M]`.
    Create {
        name: String,
        #[arg(value_parser = parse_size)]
        size: u64,
        #[command(flatten)]
        limits: cli::LimitArgs,
        /// Copies of the volume, this daemon's included: with --peer for each other one, kept
        /// in sync on every write (`replica add --sync`).
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// A daemon holding a synchronous replica (tcp://host:port); repeatable.
        #[arg(long = "peer")]
        peers: Vec<String>,
        /// A daemon voting in the volume's membership without holding data (tcp://host:port):
        /// with two copies, one side keeps writing when the other is lost.
        #[arg(long)]
        witness: Option<String>,
        /// Encrypt the volume (AES-256-XTS) with a data key of its own, wrapped by a
        /// key-encryption key from the daemon's key directory (--key, made there if missing).
        #[arg(long)]
        encrypt: bool,
        /// The key-encryption key's id (<key-dir>/<id>.key).
        #[arg(long, requires = "encrypt", default_value = "default")]
        key: String,
    },
    /// Open an encrypted volume (or snapshot) with its key from the daemon's key directory:
    /// what the daemon does at start for every volume whose key is there.
    Unlock { name: String },
    /// Wrap an encrypted volume's data key with a new key-encryption key, online, without
    /// rewriting data (--key: its id, made in the key directory if missing; default: a new
    /// key named after the volume and the time). The old key file may then be removed.
    ///
    /// With --data-key: replace the data key itself (one that may have leaked): every block is
    /// re-encrypted in the background, online; shows progress until done (--detach: returns at
    /// once; `volume show` shows it). Snapshots keep the old data key until deleted.
    Rekey {
        name: String,
        #[arg(long, conflicts_with = "data_key")]
        key: Option<String>,
        #[arg(long)]
        data_key: bool,
        #[arg(long, requires = "data_key")]
        detach: bool,
    },
    /// Change a volume's limits online: `ferrite volume set db --iops 5000 --bw 200M` (limits
    /// not named keep their value; 0 removes one).
    Set {
        name: String,
        #[command(flatten)]
        limits: cli::LimitArgs,
    },
    /// List volumes.
    List,
    /// Show one volume.
    Show { name: String },
    /// Grow a volume to a new size.
    Resize {
        name: String,
        #[arg(value_parser = parse_size)]
        size: u64,
    },
    /// Delete a volume and its data.
    Delete { name: String },
    /// Rewrite a volume's scattered blocks in logical order, so sequential reads are large
    /// contiguous reads again (after random writes); blocks being written now stay where they are.
    Defrag { name: String },
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Snapshot a volume: `ferrite snapshot create db nightly` (O(1), durable on return).
    Create { volume: String, name: String },
    /// List snapshots (of one volume if given).
    List { volume: Option<String> },
    /// Show one snapshot.
    Show { name: String },
    /// Delete a snapshot; clones and later snapshots keep what they need.
    Delete { name: String },
    /// Ranges of a volume (`db`) or snapshot (`db@nightly`) changed since an earlier snapshot
    /// (`--since`), or its allocated ranges without one.
    Diff {
        image: String,
        #[arg(long)]
        since: Option<String>,
    },
}

#[derive(Subcommand)]
enum ReplicaCmd {
    /// Replicate a volume to a peer daemon: a mirror snapshot every interval, and only what
    /// changed since the last one the peer holds crosses (the first sync: the allocated blocks).
    Enable {
        volume: String,
        /// The peer's admin endpoint: its admin socket path, or tcp://host:port (mutual TLS).
        peer: String,
        /// The replica volume's name on the peer (default: the volume's).
        #[arg(long = "as")]
        replica: Option<String>,
        /// Time between mirror snapshots: 30s, 5m, 1h; 0 pushes only on `replica sync`.
        #[arg(long, default_value = "1m", value_parser = ferrite_csi::replication::parse_interval)]
        interval: u64,
        /// VOLUME names a volume group: it replicates as one unit, each mirror point a group
        /// snapshot (members keep their names on the peer).
        #[arg(long)]
        group: bool,
        /// User snapshots that replicate too (taken on the primary, sent before the next mirror
        /// snapshot): a name, or a prefix ending in `*`. Repeatable.
        #[arg(long = "snapshot")]
        snapshots: Vec<String>,
    },
    /// Stop replicating a volume; a secondary becomes writable at its last complete mirror snapshot.
    Disable { volume: String },
    /// Push a volume to its peer now (or finish an interrupted transfer), with progress.
    Sync { volume: String },
    /// Replicated volumes: role, state, peer, last mirror snapshot, lag, transfer progress.
    Status { volume: Option<String> },
    /// Make a primary read-only and send its final delta; then the peer can be promoted.
    Demote { volume: String },
    /// Make a secondary writable. Without --force only once its primary is demoted and fully
    /// synced; with --force at its last complete mirror snapshot, whatever the primary's state.
    Promote {
        volume: String,
        #[arg(long)]
        force: bool,
    },
    /// On a secondary: drop what differs from the primary and take its delta (asks it now).
    Resync { volume: String },
    /// Add a synchronous replica (--sync: every write waits for it) or a witness (--witness:
    /// a vote in the membership, no data) of a volume whose primary is here.
    Add {
        volume: String,
        /// The member's admin endpoint, tcp://host:port (mutual TLS).
        peer: String,
        #[arg(long, required_unless_present = "witness")]
        sync: bool,
        #[arg(long, conflicts_with = "sync")]
        witness: bool,
    },
    /// Wait until the failover loop has handed this daemon's unpublished primaries over to
    /// in-sync copies elsewhere (the daemon pod's preStop hook, while the pod stops on purpose).
    HandOver {
        /// Seconds to wait at most.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        /// Stop waiting when no primary moved for this many seconds.
        #[arg(long, default_value_t = 10)]
        idle: u64,
    },
    /// Remove a synchronous replica or witness of a volume whose primary is here: writes stop
    /// waiting for it, and its copy stays there, read-only, until deleted.
    Remove {
        volume: String,
        /// The member's admin endpoint, as `replica status` lists it.
        peer: String,
    },
}

async fn replica_cmd(c: &mut cli::Admin, out: Output, cmd: ReplicaCmd) -> Result<()> {
    let one = |volume: String| pb::ReplicationRequest { volume };
    let r = match cmd {
        ReplicaCmd::Enable { volume, peer, replica, interval, group, snapshots } => {
            let replica = replica.unwrap_or_default();
            let req = pb::EnableReplicationRequest { volume, peer, replica, interval_secs: interval, group, snapshots };
            c.enable_replication(req).await
        }
        ReplicaCmd::Disable { volume } => c.disable_replication(one(volume)).await,
        ReplicaCmd::Demote { volume } => c.demote_replication(one(volume)).await,
        ReplicaCmd::Promote { volume, force } => {
            let req = pb::ListReplicationsRequest { volume: volume.clone() };
            if !c.list_sync_replicas(req).await.map_err(rpc_error)?.get_ref().volumes.is_empty() {
                let v = c.promote_sync_replica(pb::PromoteReplicationRequest { volume, force }).await;
                cli::print_sync_volumes(out, &[v.map_err(rpc_error)?.into_inner()]);
                return Ok(());
            }
            c.promote_replication(pb::PromoteReplicationRequest { volume, force }).await
        }
        ReplicaCmd::Add { volume, peer, sync: _, witness } => {
            let v = c.add_sync_replica(pb::AddSyncReplicaRequest { volume, peer, witness }).await;
            cli::print_sync_volumes(out, &[v.map_err(rpc_error)?.into_inner()]);
            return Ok(());
        }
        ReplicaCmd::Remove { volume, peer } => {
            let v = c.remove_sync_replica(pb::RemoveSyncReplicaRequest { volume, peer }).await;
            cli::print_sync_volumes(out, &[v.map_err(rpc_error)?.into_inner()]);
            return Ok(());
        }
        ReplicaCmd::Resync { volume } => c.resync_replication(one(volume)).await,
        ReplicaCmd::HandOver { timeout, idle } => {
            let secs = std::time::Duration::from_secs;
            return hand_over::wait(c, secs(timeout), secs(idle)).await;
        }
        ReplicaCmd::Status { volume } => {
            let req = pb::ListReplicationsRequest { volume: volume.unwrap_or_default() };
            let named = !req.volume.is_empty();
            let sync = c.list_sync_replicas(req.clone()).await.map_err(rpc_error)?.into_inner().volumes;
            if named && !sync.is_empty() {
                cli::print_sync_volumes(out, &sync);
                return Ok(());
            }
            let r = c.list_replications(req).await.map_err(rpc_error)?;
            let replications = &r.get_ref().replications;
            // One kind: that kind's table (or JSON); both: both tables.
            if !sync.is_empty() {
                cli::print_sync_volumes(out, &sync);
            }
            if sync.is_empty() || !replications.is_empty() {
                cli::print_replications(out, replications);
            }
            return Ok(());
        }
        ReplicaCmd::Sync { volume } => {
            let r =
                cli::with_progress(c, &volume, "replica sync", c.clone().sync_replication(one(volume.clone()))).await;
            cli::print_sync(out, r.map_err(rpc_error)?.get_ref());
            return Ok(());
        }
    };
    cli::print_replications(out, &[r.map_err(rpc_error)?.into_inner()]);
    Ok(())
}

#[derive(Subcommand)]
enum GroupCmd {
    /// Create a group: `ferrite group create app db log`.
    Create { name: String, volumes: Vec<String> },
    /// Add volumes to a group.
    Add {
        name: String,
        #[arg(required = true)]
        volumes: Vec<String>,
    },
    /// Remove volumes from a group.
    Remove {
        name: String,
        #[arg(required = true)]
        volumes: Vec<String>,
    },
    /// Delete a group (its volumes and group snapshots stay).
    Delete { name: String },
    /// List groups.
    List,
    /// Snapshot every member at one point in time: `ferrite group snapshot app nightly`
    /// (member snapshots are named nightly.<volume>).
    Snapshot { group: String, name: String },
    /// List group snapshots (of one group if given).
    Snapshots { group: Option<String> },
    /// Delete a group snapshot and its member snapshots.
    DeleteSnapshot { name: String },
    /// Clone every member of a group snapshot into a new group (volumes <new-group>.<volume>).
    Clone { snapshot: String, new_group: String },
}

#[derive(Subcommand)]
enum FenceCmd {
    /// Fence CIDR blocks (`10.0.0.0/8`, `192.0.2.7`): their clients are refused and cut off.
    Add { cidrs: Vec<String> },
    /// Lift fences.
    Remove { cidrs: Vec<String> },
    /// List fenced blocks.
    List,
}

#[derive(Subcommand)]
enum ExportCmd {
    /// Export a volume (or `volume@snapshot`, read-only) over NBD.
    Nbd {
        volume: String,
        /// Export name (default: the volume name).
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        read_only: bool,
        /// Who may open it over TCP: a CIDR block (10.0.0.0/8), an address, or a client
        /// certificate identity (a DNS name in its subjectAltName). Repeatable; none: anyone
        /// the listener admits.
        #[arg(long)]
        allow: Vec<String>,
    },
    /// List exports.
    List,
    /// Stop an export.
    Stop { name: String },
}

#[derive(Subcommand)]
enum PoolCmd {
    /// Make a new pool on a block device or a file (offline: the daemon must not be running),
    /// with its catalog in the configuration's meta-dir. Refuses a store holding a filesystem,
    /// a partition table, a volume manager or another pool unless --force, and one in use always.
    Format {
        /// The device or file (default: the configuration's pool-path).
        path: Option<PathBuf>,
        /// Size of a new pool file (default: pool-size); an existing file is grown to it.
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Write the whole file once, so first writes do not pay the filesystem's allocation
        /// (a file pool only; freed segments then keep their blocks).
        #[arg(long)]
        preallocate: bool,
        /// Format even if a filesystem, partition table or pool is found (its data is lost).
        #[arg(long)]
        force: bool,
        /// The daemon's TOML configuration (meta-dir, segment-size, pool-path, pool-size).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Data directory (overrides the config file).
        #[arg(long, env = "FERRITE_DATA_DIR")]
        data_dir: Option<PathBuf>,
    },
    /// For the data-path DaemonSet's init container: the pool this Kubernetes node's
    /// annotations name (pool.ferrite.dev/device; formatted only if blank and
    /// pool.ferrite.dev/format is "true"), written into the daemon's configuration.
    Node {
        /// This node's name.
        #[arg(long, env = "NODE_NAME")]
        node: String,
        /// The configuration every node shares.
        #[arg(long, short)]
        config: PathBuf,
        /// Where the daemon reads its configuration.
        #[arg(long)]
        out: PathBuf,
        /// The node's address: the configuration's TCP listeners on every address (0.0.0.0)
        /// listen on it alone.
        #[arg(long)]
        listen_ip: Option<std::net::IpAddr>,
    },
    /// Space, log, traffic and cleaner figures.
    Status,
    /// Run the cleaner now: move live data out of segments with dead space and free them.
    Reclaim,
    /// Read every live block and verify its checksum; lists damaged blocks with the volumes and
    /// snapshots that read them (exit code 1 if any).
    Scrub,
}

fn main() {
    let cli = Cli::parse();
    let filter = match &cli.cmd {
        Cmd::Daemon { config, data_dir } => match config::Config::load(config.as_deref(), data_dir.clone()) {
            Ok(cfg) => {
                init_logging(&cfg.log_level);
                return exit(runtime().block_on(daemon::run(cfg)));
            }
            Err(e) => return exit(Err(e)),
        },
        Cmd::Certs { dir, name, sans, roles, days } => return exit(cli::make_certs(dir, name, sans, roles, *days)),
        Cmd::Pool(PoolCmd::Format { path, size, preallocate, force, config, data_dir }) => {
            init_logging("warn");
            let req = pool_format::FormatRequest {
                path: path.clone(),
                size: *size,
                preallocate: *preallocate,
                force: *force,
            };
            return exit(
                config::Config::load(config.as_deref(), data_dir.clone())
                    .and_then(|cfg| pool_format::format(&cfg, &req)),
            );
        }
        Cmd::Pool(PoolCmd::Node { node, config, out, listen_ip }) => {
            init_logging("warn");
            return exit(node_pool::prepare(node, config, out, *listen_ip));
        }
        Cmd::Watchdog => {
            init_logging("info");
            let socket = cli.admin_socket();
            ferrite_ublk::hold::run(&ferrite_ublk::hold::path(&socket));
        }
        Cmd::Heartbeat { node, namespace, every, lease_duration, restart_grace } => {
            init_logging("info");
            let socket = cli.admin_socket();
            let secs = std::time::Duration::from_secs;
            let t = ferrite_csi::heartbeat::Timing {
                every: secs(*every),
                duration: secs(*lease_duration),
                grace: secs(*restart_grace),
            };
            let run = ferrite_csi::heartbeat::run(node, namespace, &socket, t, shutdown_signal());
            return exit(runtime().block_on(run));
        }
        Cmd::NodeCert { node, dir, service, days, wait, renew, check_every } => {
            init_logging("info");
            let secs = std::time::Duration::from_secs;
            let o = ferrite_csi::certs::request::Options {
                node: node.clone(),
                dir: dir.clone(),
                service: service.clone(),
                lifetime: secs(days * 86_400),
                wait: secs(*wait),
                check_every: secs(*check_every),
            };
            return exit(runtime().block_on(async {
                if *renew {
                    ferrite_csi::certs::request::renew(&o, shutdown_signal()).await;
                    return Ok(());
                }
                let h = ferrite_csi::certs::request::ensure(&o).await?;
                let what = if h.issued { "issued" } else { "already held" };
                println!(
                    "node {node}: certificate {what}, valid until {} (renewed from {})",
                    cli::format_time(h.not_after.unsigned_abs()),
                    cli::format_time(h.renew_at.unsigned_abs())
                );
                Ok(())
            }));
        }
        Cmd::Csi {
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
            webhook_listen,
            out_of_service_taint,
            signer_ca,
            signer_account,
            cluster_certs,
            signer_max_days,
            storage_label,
            no_storage,
            node_tls_dir,
            attach_state_dir,
        } => {
            init_logging("info");
            let rt = runtime();
            let cluster = match cluster_certs_options(&cli, *cluster_certs, signer_ca, node_service.as_deref()) {
                Ok(Some(o)) => match rt.block_on(ferrite_csi::certs::cluster::make(&o)) {
                    Ok(()) => Some(o),
                    Err(e) => return exit(Err(e.context("the cluster's certificates"))),
                },
                Ok(None) => None,
                Err(e) => return exit(Err(e)),
            };
            // The driver runs for months: its certificate follows its files.
            let admin_tls = match check_tls_args(&cli).and_then(|()| {
                let Some(ca) = &cli.tls_ca else { return Ok(None) };
                let identity = cli.tls_cert.as_deref().zip(cli.tls_key.as_deref());
                Ok(Some(std::sync::Arc::new(ferrite_proto::admin_tls_reloading(ca, identity)?)))
            }) {
                Ok(t) => t,
                Err(e) => return exit(Err(e)),
            };
            let webhook = match (webhook_listen, cli.tls_cert.as_deref().zip(cli.tls_key.as_deref())) {
                (None, _) => None,
                (Some(_), None) => {
                    return exit(Err(anyhow::anyhow!("--webhook-listen needs --tls-cert and --tls-key")));
                }
                (Some(at), Some((cert, key))) => match ferrite_tls::reload::server(cert, key, None, &[b"http/1.1"]) {
                    Ok(tls) => Some((*at, std::sync::Arc::new(tls))),
                    Err(e) => return exit(Err(anyhow::anyhow!("the webhook's certificate: {e}"))),
                },
            };
            let signer = match (signer_ca, node_service.as_deref().and_then(|s| s.split_once('/')), admin_server_name) {
                (None, _, _) => None,
                (Some(ca), Some((ns, _)), Some(service)) => Some(ferrite_csi::certs::signer::Signer {
                    ca_dir: ca.clone(),
                    namespace: ns.to_owned(),
                    accounts: signer_account.clone(),
                    service: service.clone(),
                    max_lifetime: std::time::Duration::from_secs(signer_max_days * 86_400),
                }),
                (Some(_), _, _) => {
                    return exit(Err(anyhow::anyhow!(
                        "--signer-ca needs --node-service (the daemons' namespace) and --admin-server-name (the name their certificates carry)"
                    )));
                }
            };
            let node_id = if node_id.is_empty() { hostname() } else { node_id.clone() };
            let opts = ferrite_csi::Options {
                mode: match mode {
                    CsiMode::Controller => ferrite_csi::Mode::Controller,
                    CsiMode::Node => ferrite_csi::Mode::Node,
                    CsiMode::All => ferrite_csi::Mode::All,
                },
                endpoint: endpoint.clone(),
                addons_endpoint: addons_endpoint.clone(),
                node_id,
                admin_socket: cli.admin_socket(),
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
            };
            let attach_only = matches!(mode, CsiMode::Node).then(|| attach_only::Options {
                socket: cli.admin_socket(),
                state_dir: attach_state_dir.clone(),
                tls: config::TlsFiles {
                    cert: node_tls_dir.join("tls.crt"),
                    key: node_tls_dir.join("tls.key"),
                    client_ca: Some(node_tls_dir.join("ca.crt")),
                    peer_name: admin_server_name.clone(),
                },
                hold: config::DEFAULT_DEVICE_HOLD,
                request_timeout: config::DEFAULT_NBD_DEVICE_TIMEOUT,
            });
            let (node, no_storage) = (opts.node_id.clone(), *no_storage);
            return exit(rt.block_on(async move {
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
                let served = ferrite_csi::serve(opts, shutdown_signal()).await;
                if let Some(s) = serving {
                    s.stop().await;
                }
                served
            }));
        }
        _ => "warn",
    };
    init_logging(filter);
    quiet_on_closed_pipe();
    exit(runtime().block_on(client(cli)));
}

/// Where `--cluster-certs` writes: the signer's directory and the --tls-* files, which it
/// needs; the controller Service in the node Service's namespace.
fn cluster_certs_options(
    cli: &Cli,
    on: bool,
    signer_ca: &Option<PathBuf>,
    node_service: Option<&str>,
) -> anyhow::Result<Option<ferrite_csi::certs::cluster::Options>> {
    if !on {
        return Ok(None);
    }
    let (Some(ca_dir), Some(tls_ca), Some(tls_cert), Some(tls_key)) =
        (signer_ca, &cli.tls_ca, &cli.tls_cert, &cli.tls_key)
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

/// A client command whose reader went away (`ferrite pool status | head -1`) ends quietly, as
/// Unix tools do, instead of with a panic: Rust ignores SIGPIPE (which the daemon and the driver
/// need ignored), so a print to a closed pipe panics with EPIPE.
fn quiet_on_closed_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info.payload().downcast_ref::<String>().map_or("", String::as_str);
        if msg.starts_with("failed printing to std") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info);
    }));
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_lowercase()).unwrap_or_default()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime")
}

/// Logs to stderr, with colour only when it is a terminal (never escape codes in a log file).
fn init_logging(default: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERRITE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn exit(r: Result<()>) {
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The TLS client config the global --tls-* options describe.
fn check_tls_args(cli: &Cli) -> Result<()> {
    anyhow::ensure!(
        cli.tls_ca.is_some() || cli.tls_cert.is_none(),
        "--tls-cert needs --tls-ca (the CA the daemon's certificate is checked against)"
    );
    Ok(())
}

fn client_tls(cli: &Cli) -> Result<Option<std::sync::Arc<ferrite_proto::ClientTls>>> {
    check_tls_args(cli)?;
    let Some(ca) = &cli.tls_ca else { return Ok(None) };
    let identity = cli.tls_cert.as_deref().zip(cli.tls_key.as_deref());
    Ok(Some(ferrite_proto::admin_tls(ca, identity)?))
}

async fn client(cli: Cli) -> Result<()> {
    let endpoint = match &cli.admin_tcp {
        Some(addr) => format!("tcp://{addr}"),
        None => cli.admin_socket().display().to_string(),
    };
    let out = cli.output;
    let tls = client_tls(&cli)?;
    if let Cmd::Backup(b) = &cli.cmd
        && let Some(done) = backup_cli::local(b, out).await
    {
        return done;
    }
    if let Cmd::Backup(b) = cli.cmd {
        let channel = ferrite_proto::connect(&endpoint, tls)
            .await
            .with_context(|| format!("cannot reach the ferrite daemon at {endpoint} (is it running?)"))?;
        return backup_cli::run(ferrite_proto::ferrite::v1::backups_client::BackupsClient::new(channel), b, out).await;
    }
    let mut c = connect(&endpoint, tls).await?;
    match cli.cmd {
        Cmd::Daemon { .. }
        | Cmd::Csi { .. }
        | Cmd::Heartbeat { .. }
        | Cmd::NodeCert { .. }
        | Cmd::Watchdog
        | Cmd::Certs { .. }
        | Cmd::Backup(_)
        | Cmd::Pool(PoolCmd::Format { .. } | PoolCmd::Node { .. }) => {
            unreachable!("handled in main")
        }
        Cmd::Volume(v) => match v {
            VolumeCmd::Create { name, size, limits, replicas, peers, witness, encrypt, key } => {
                anyhow::ensure!(
                    replicas == peers.len() + 1,
                    "--replicas {replicas} needs {} --peer (this daemon holds one copy)",
                    replicas.saturating_sub(1)
                );
                let limits = Some(limits.over(pb::VolumeLimits::default()));
                let encryption = encrypt.then(|| pb::KeyRef { key_id: key, key: Vec::new() });
                let req = pb::CreateVolumeRequest { name: name.clone(), size, limits, encryption };
                let v = c.create_volume(req).await.map_err(rpc_error)?;
                let members = peers.into_iter().map(|p| (p, false)).chain(witness.map(|w| (w, true)));
                let mut last = None;
                for (peer, witness) in members {
                    let req = pb::AddSyncReplicaRequest { volume: name.clone(), peer: peer.clone(), witness };
                    let r = c.add_sync_replica(req).await.map_err(rpc_error);
                    last = Some(r.with_context(|| format!("volume {name} was created; adding {peer} failed"))?);
                }
                match last {
                    Some(s) => cli::print_sync_volumes(out, &[s.into_inner()]),
                    None => cli::print_volume(out, v.get_ref()),
                }
            }
            VolumeCmd::Set { name, limits } => {
                anyhow::ensure!(!limits.is_empty(), "name at least one limit (--iops, --bw, ... ; 0 removes one)");
                let now = c.get_volume(pb::GetVolumeRequest { name: name.clone() }).await.map_err(rpc_error)?;
                let limits = Some(limits.over(now.into_inner().limits.unwrap_or_default()));
                let v = c.set_volume_limits(pb::SetVolumeLimitsRequest { name, limits }).await.map_err(rpc_error)?;
                cli::print_volume(out, v.get_ref());
            }
            VolumeCmd::Unlock { name } => {
                let v = c.unlock_volume(pb::UnlockVolumeRequest { name, key: None }).await.map_err(rpc_error)?;
                cli::print_volume(out, v.get_ref());
            }
            VolumeCmd::Rekey { name, key, data_key, detach } => {
                let new_key = key.map(|key_id| pb::KeyRef { key_id, key: Vec::new() });
                let req = pb::RekeyVolumeRequest { name: name.clone(), old_key: None, new_key, data_key };
                let mut v = c.rekey_volume(req).await.map_err(rpc_error)?.into_inner();
                if data_key && !detach {
                    v = cli::wait_for_rotation(&mut c, &name).await?;
                }
                cli::print_volume(out, &v);
            }
            VolumeCmd::List => {
                let r = c.list_volumes(pb::ListVolumesRequest {}).await.map_err(rpc_error)?;
                cli::print_volumes(out, &r.get_ref().volumes);
            }
            VolumeCmd::Show { name } => {
                let v = c.get_volume(pb::GetVolumeRequest { name }).await.map_err(rpc_error)?;
                cli::print_volume(out, v.get_ref());
            }
            VolumeCmd::Resize { name, size } => {
                let v = c.grow_volume(pb::GrowVolumeRequest { name, new_size: size }).await.map_err(rpc_error)?;
                cli::print_volume(out, v.get_ref());
            }
            VolumeCmd::Delete { name } => {
                c.delete_volume(pb::DeleteVolumeRequest { name: name.clone() }).await.map_err(rpc_error)?;
                cli::print_done(out, "deleted volume", &name);
            }
            VolumeCmd::Defrag { name } => {
                let req = pb::DefragVolumeRequest { name: name.clone() };
                let stream = c.defrag_volume(req).await.map_err(rpc_error)?.into_inner();
                let r = cli::follow(stream, "defrag", out, |p| (p.done_bytes, p.total_bytes, p.done)).await?;
                cli::print_defrag(out, &name, &r);
            }
        },
        Cmd::Snapshot(sc) => match sc {
            SnapshotCmd::Create { volume, name } => {
                let s = c.create_snapshot(pb::CreateSnapshotRequest { volume, name }).await.map_err(rpc_error)?;
                cli::print_snapshot(out, s.get_ref());
            }
            SnapshotCmd::List { volume } => {
                let req = pb::ListSnapshotsRequest { volume: volume.unwrap_or_default() };
                let r = c.list_snapshots(req).await.map_err(rpc_error)?;
                cli::print_snapshots(out, &r.get_ref().snapshots);
            }
            SnapshotCmd::Show { name } => {
                let s = c.get_snapshot(pb::GetSnapshotRequest { name }).await.map_err(rpc_error)?;
                cli::print_snapshot(out, s.get_ref());
            }
            SnapshotCmd::Delete { name } => {
                c.delete_snapshot(pb::DeleteSnapshotRequest { name: name.clone() }).await.map_err(rpc_error)?;
                cli::print_done(out, "deleted snapshot", &name);
            }
            SnapshotCmd::Diff { image, since } => {
                use pb::changed_ranges_request::Image;
                let image = match image.split_once('@') {
                    Some((_, snap)) => Image::Snapshot(snap.to_owned()),
                    None => Image::Volume(image),
                };
                let req = pb::ChangedRangesRequest { image: Some(image), since: since.unwrap_or_default() };
                let r = c.changed_ranges(req).await.map_err(rpc_error)?;
                cli::print_ranges(out, r.get_ref());
            }
        },
        Cmd::Replica(cmd) => replica_cmd(&mut c, out, cmd).await?,
        Cmd::Clone { source, name } => {
            use pb::clone_volume_request::Source;
            let source = match source.split_once('@') {
                Some((_, snap)) => Source::Snapshot(snap.to_owned()),
                None => {
                    // A bare name is a snapshot if one is called that, else a volume.
                    let snap = c.get_snapshot(pb::GetSnapshotRequest { name: source.clone() }).await;
                    if snap.is_ok() { Source::Snapshot(source) } else { Source::Volume(source) }
                }
            };
            let v = c.clone_volume(pb::CloneVolumeRequest { name, source: Some(source) }).await.map_err(rpc_error)?;
            cli::print_volume(out, v.get_ref());
        }
        Cmd::Group(g) => match g {
            GroupCmd::Create { name, volumes } => {
                let r = c.create_group(pb::CreateGroupRequest { name, volumes }).await.map_err(rpc_error)?;
                cli::print_groups(out, std::slice::from_ref(r.get_ref()));
            }
            GroupCmd::Add { name, volumes } => {
                let req = pb::UpdateGroupRequest { name, add: volumes, remove: Vec::new() };
                let r = c.update_group(req).await.map_err(rpc_error)?;
                cli::print_groups(out, std::slice::from_ref(r.get_ref()));
            }
            GroupCmd::Remove { name, volumes } => {
                let req = pb::UpdateGroupRequest { name, add: Vec::new(), remove: volumes };
                let r = c.update_group(req).await.map_err(rpc_error)?;
                cli::print_groups(out, std::slice::from_ref(r.get_ref()));
            }
            GroupCmd::Delete { name } => {
                c.delete_group(pb::DeleteGroupRequest { name: name.clone() }).await.map_err(rpc_error)?;
                cli::print_done(out, "deleted group", &name);
            }
            GroupCmd::List => {
                let r = c.list_groups(pb::ListGroupsRequest {}).await.map_err(rpc_error)?;
                cli::print_groups(out, &r.get_ref().groups);
            }
            GroupCmd::Snapshot { group, name } => {
                let req = pb::CreateGroupSnapshotRequest { group, name };
                let r = c.create_group_snapshot(req).await.map_err(rpc_error)?;
                cli::print_group_snapshots(out, std::slice::from_ref(r.get_ref()));
            }
            GroupCmd::Snapshots { group } => {
                let req = pb::ListGroupSnapshotsRequest { group: group.unwrap_or_default() };
                let r = c.list_group_snapshots(req).await.map_err(rpc_error)?;
                cli::print_group_snapshots(out, &r.get_ref().snapshots);
            }
            GroupCmd::DeleteSnapshot { name } => {
                let req = pb::DeleteGroupSnapshotRequest { name: name.clone() };
                c.delete_group_snapshot(req).await.map_err(rpc_error)?;
                cli::print_done(out, "deleted group snapshot", &name);
            }
            GroupCmd::Clone { snapshot, new_group } => {
                let req = pb::CloneGroupSnapshotRequest { name: snapshot, new_group };
                let r = c.clone_group_snapshot(req).await.map_err(rpc_error)?;
                cli::print_groups(out, std::slice::from_ref(r.get_ref()));
            }
        },
        Cmd::Attach { volume, transport, queues, depth, remote, export, copies } => {
            let (remote, export) = (remote.unwrap_or_default(), export.unwrap_or_default());
            let req = pb::AttachVolumeRequest { volume, transport, queues, depth, remote, export, copies };
            let a = c.attach_volume(req).await.map_err(rpc_error)?;
            cli::print_attachment(out, a.get_ref());
        }
        Cmd::Detach { device } => {
            c.detach_volume(pb::DetachVolumeRequest { device: device.clone() }).await.map_err(rpc_error)?;
            cli::print_done(out, "detached", &device);
        }
        Cmd::Refresh { device } => {
            let a = c.resize_attachment(pb::ResizeAttachmentRequest { device }).await.map_err(rpc_error)?;
            cli::print_attachment(out, a.get_ref());
        }
        Cmd::Attachments => {
            let r = c.list_attachments(pb::ListAttachmentsRequest {}).await.map_err(rpc_error)?;
            cli::print_attachments(out, &r.get_ref().attachments);
        }
        Cmd::Fence(f) => {
            let r = match f {
                FenceCmd::Add { cidrs } => c.fence_networks(pb::FenceRequest { cidrs, owner: String::new() }).await,
                FenceCmd::Remove { cidrs } => {
                    c.unfence_networks(pb::FenceRequest { cidrs, owner: String::new() }).await
                }
                FenceCmd::List => c.list_fences(pb::ListFencesRequest {}).await,
            };
            cli::print_fences(out, r.map_err(rpc_error)?.get_ref());
        }
        Cmd::Version => {
            let r = c.version(pb::VersionRequest {}).await.map_err(rpc_error)?;
            cli::print_version(out, r.get_ref());
        }
        Cmd::Clients => {
            let r = c.list_clients(pb::ListClientsRequest {}).await.map_err(rpc_error)?;
            cli::print_clients(out, &r.get_ref().clients);
        }
        Cmd::Export(e) => match e {
            ExportCmd::Nbd { volume, name, read_only, allow } => {
                let req = pb::StartExportRequest { volume, name: name.unwrap_or_default(), read_only, allow };
                let e = c.start_export(req).await.map_err(rpc_error)?;
                cli::print_export(out, e.get_ref());
            }
            ExportCmd::List => {
                let r = c.list_exports(pb::ListExportsRequest {}).await.map_err(rpc_error)?;
                cli::print_exports(out, &r.get_ref().exports);
            }
            ExportCmd::Stop { name } => {
                c.stop_export(pb::StopExportRequest { name: name.clone() }).await.map_err(rpc_error)?;
                cli::print_done(out, "stopped export", &name);
            }
        },
        Cmd::Pool(PoolCmd::Status) => {
            let s = c.pool_status(pb::PoolStatusRequest {}).await.map_err(rpc_error)?;
            cli::print_pool(out, s.get_ref());
            // The daemon's readiness probe runs this: a failed pool takes the node out of service.
            anyhow::ensure!(!s.get_ref().failed, "the pool stopped after a media failure; restart the daemon");
        }
        Cmd::Pool(PoolCmd::Scrub) => {
            let stream = c.scrub_pool(pb::ScrubPoolRequest {}).await.map_err(rpc_error)?.into_inner();
            let r = cli::follow(stream, "scrub", out, |p| (p.checked_bytes, p.total_bytes, p.done)).await?;
            cli::print_scrub(out, &r);
            if r.damaged_blocks > 0 {
                anyhow::bail!("scrub found {} damaged blocks", r.damaged_blocks);
            }
        }
        Cmd::Pool(PoolCmd::Reclaim) => {
            if out == Output::Table {
                eprintln!("reclaiming: cleaning segments with dead space...");
            }
            let r = c.reclaim_pool(pb::ReclaimPoolRequest {}).await.map_err(rpc_error)?;
            cli::print_reclaim(out, r.get_ref());
        }
    }
    Ok(())
}
