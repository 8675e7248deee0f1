//! `ferrite`: the front door of the block storage daemon (`ferrite_daemon`). Each command runs
//! a program (`program/`: the daemon, the CSI driver, ...) or is a client of a running daemon
//! (`cli/`: one file per command group); this file only parses and dispatches.

mod args;
mod cli;
mod out;
mod program;

use anyhow::Result;
use clap::{Parser, Subcommand};

use args::Globals;
use cli::pool::PoolCmd;

#[derive(Parser)]
#[command(name = "ferrite", version, about = "Ferrite block storage: daemon and command-line client")]
struct Cli {
    #[command(flatten)]
    globals: Globals,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon in the foreground.
    Daemon(program::daemon::Args),
    /// Run the CSI driver (CSI 1.12) over the daemons' admin API.
    Csi(program::csi::Args),
    /// Have this node's certificate issued by the cluster (the CertificateSigningRequest API,
    /// signer `ferrite.dev/node`: the controller with --signer-ca) unless the one in --dir names
    /// the node's current addresses and is not due for renewal; with --renew, keep renewing it.
    /// The daemon pod's init container and its node-cert container.
    NodeCert(program::node_cert::Args),
    /// Renew this node's storage Lease (`ferrite-node-<node>`) for as long as the daemon at
    /// --admin-socket answers with a healthy pool: the daemon pod's heartbeat container, which
    /// the failover loop watches to see a silent daemon on a Ready node.
    Heartbeat(program::heartbeat::Args),
    /// Manage volumes.
    #[command(subcommand)]
    Volume(cli::volume::VolumeCmd),
    /// Manage snapshots.
    #[command(subcommand)]
    Snapshot(cli::snapshot::SnapshotCmd),
    /// Replicate volumes to peer daemons.
    #[command(subcommand)]
    Replica(cli::replica::ReplicaCmd),
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
    Group(cli::group::GroupCmd),
    /// Manage NBD exports.
    #[command(subcommand)]
    Export(cli::export::ExportCmd),
    /// Backups to the object stores (targets) the daemon's config names, and restores.
    #[command(subcommand)]
    Backup(cli::backup::BackupCmd),
    /// Attach a volume (or `volume@snapshot`, read-only) as a block device on this machine:
    /// ublk (/dev/ublkbN) where the kernel has it, else the kernel NBD client (/dev/nbdN) over the
    /// daemon's Unix socket. The daemon owns the device; needs root. Prints the device.
    Attach(cli::device::AttachArgs),
    /// Detach a device made by `ferrite attach` (by device path or volume name).
    Detach { device: String },
    /// Give the device of another node's volume (`attach --remote`) that volume's current size,
    /// after its node grew it.
    Refresh { device: String },
    /// List the devices attached by the daemon.
    Attachments,
    /// Network fencing: refuse (and cut) TCP clients from CIDR blocks on the NBD and admin listeners.
    #[command(subcommand)]
    Fence(cli::fence::FenceCmd),
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
    Certs(program::certs::Args),
}

fn main() {
    let Cli { globals: g, cmd } = Cli::parse();
    let done = match &cmd {
        Cmd::Daemon(a) => program::daemon::run(a),
        Cmd::Certs(a) => program::certs::run(a),
        Cmd::Pool(PoolCmd::Format(a)) => program::pool_format::run(a),
        Cmd::Pool(PoolCmd::Node(a)) => program::node_pool::run(a),
        Cmd::Watchdog => program::watchdog::run(&g.admin_socket()),
        Cmd::Heartbeat(a) => program::heartbeat::run(a, &g.admin_socket()),
        Cmd::NodeCert(a) => program::node_cert::run(a),
        Cmd::Csi(a) => program::csi::run(a, &g),
        _ => {
            program::init_logging("warn");
            quiet_on_closed_pipe();
            program::runtime().block_on(client(&g, cmd))
        }
    };
    if let Err(e) = done {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
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

/// A client command: one call (or a few) of the daemon's admin API, printed.
async fn client(g: &Globals, cmd: Cmd) -> Result<()> {
    let (endpoint, out, tls) = (g.endpoint(), g.output, g.client_tls()?);
    if let Cmd::Backup(b) = &cmd
        && let Some(done) = cli::backup::local(b, out).await
    {
        return done;
    }
    if let Cmd::Backup(b) = cmd {
        let channel = cli::channel(&endpoint, tls).await?;
        return cli::backup::run(ferrite_proto::ferrite::v1::backups_client::BackupsClient::new(channel), b, out).await;
    }
    let c = &mut cli::connect(&endpoint, tls).await?;
    match cmd {
        Cmd::Volume(v) => cli::volume::run(c, out, v).await,
        Cmd::Clone { source, name } => cli::volume::clone(c, out, source, name).await,
        Cmd::Snapshot(s) => cli::snapshot::run(c, out, s).await,
        Cmd::Replica(r) => cli::replica::run(c, out, r).await,
        Cmd::Group(gc) => cli::group::run(c, out, gc).await,
        Cmd::Export(e) => cli::export::run(c, out, e).await,
        Cmd::Attach(a) => cli::device::attach(c, out, a).await,
        Cmd::Detach { device } => cli::device::detach(c, out, device).await,
        Cmd::Refresh { device } => cli::device::refresh(c, out, device).await,
        Cmd::Attachments => cli::device::list(c, out).await,
        Cmd::Fence(f) => cli::fence::run(c, out, f).await,
        Cmd::Clients => cli::fence::clients(c, out).await,
        Cmd::Version => cli::version::run(c, out).await,
        Cmd::Pool(p) => cli::pool::run(c, out, p).await,
        Cmd::Daemon(_) | Cmd::Csi(_) | Cmd::Heartbeat(_) | Cmd::NodeCert(_) | Cmd::Watchdog | Cmd::Certs(_) => {
            unreachable!("programs: run by main")
        }
        Cmd::Backup(_) => unreachable!("answered above"),
    }
}
