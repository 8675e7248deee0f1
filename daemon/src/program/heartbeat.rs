//! `ferrite heartbeat`: this node's storage Lease, renewed while its daemon answers.

use std::path::Path;

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// This node's name.
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    /// The namespace of the nodes' Leases (the controller's --node-lease-namespace).
    #[arg(long, default_value = ferrite_csi::kube::heartbeat::NAMESPACE)]
    pub namespace: String,
    /// Seconds between renewals (and the time the daemon has to answer).
    #[arg(long, default_value_t = 2)]
    pub every: u64,
    /// Seconds after its last renewal the Lease counts as expired.
    #[arg(long, default_value_t = 10)]
    pub lease_duration: u64,
    /// Seconds the Lease holds after the heartbeat is stopped on purpose (the pod deleted for
    /// an upgrade): a planned restart is not a lost node. Longer than the daemon pod's
    /// terminationGracePeriodSeconds (180) plus a start, so that a slow stop never turns an
    /// upgrade into a failover.
    #[arg(long, default_value_t = 300)]
    pub restart_grace: u64,
}

pub fn run(a: &Args, socket: &Path) -> Result<()> {
    super::init_logging("info");
    let Args { node, namespace, every, lease_duration, restart_grace } = a;
    let secs = std::time::Duration::from_secs;
    let t = ferrite_csi::kube::heartbeat::Timing {
        every: secs(*every),
        duration: secs(*lease_duration),
        grace: secs(*restart_grace),
    };
    let run = ferrite_csi::kube::heartbeat::run(node, namespace, socket, t, super::shutdown_signal());
    super::runtime().block_on(run)
}
