//! A node's storage heartbeat: the `heartbeat` container of the daemon's pod renews the Lease
//! `ferrite-node-<node>` (the API server's compare-and-swap, as the kubelet's node Leases do)
//! while, and only while, its daemon answers over the admin socket with a pool that has not
//! failed. A daemon that crash-loops, hangs or lost its pool device stops the renewals although
//! the kubelet keeps the Node Ready; the failover loop then handles the node as lost once the
//! Lease has expired and the daemon does not answer the controller either (`failover.rs`).
//!
//! A pod stopped on purpose (a rolling upgrade of the daemon, a drain) renews once more on its
//! way out with a longer duration, the restart grace: the new pod may take a while (an image
//! pull) before its daemon answers, and a planned restart is not a lost node. A daemon killed
//! or hung gets no such grace.
//!
//! The daemon itself holds no API credentials: the heartbeat is a container of the same pod,
//! so it ends with the pod (a lost node stops renewing as well), and its ServiceAccount may
//! touch Leases only.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use crate::kube::lease::Leadership;
use crate::shared::nodes::{StaticNodes, trouble};

/// Where the nodes' Leases live by default: a namespace of their own, so that the daemons'
/// right to renew Leases reaches none of the controller's.
pub const NAMESPACE: &str = "ferrite-node-lease";

/// The annotation of a node's Lease while its daemon pod stops on purpose (its value: since when).
pub const STOPPING: &str = "heartbeat.ferrite.dev/stopping";

/// The Lease of a node's storage heartbeat.
pub fn lease_name(node: &str) -> String {
    format!("ferrite-node-{node}")
}

/// How often and for how long the heartbeat renews.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Between renewals (and the time the daemon has to answer).
    pub every: Duration,
    /// After its last renewal the Lease counts as expired.
    pub duration: Duration,
    /// The duration of the last renewal when the pod is stopped on purpose.
    pub grace: Duration,
}

/// Renews node `node`'s Lease for as long as the daemon at `socket` is healthy, until
/// `shutdown`; then once more for the restart grace if the daemon was healthy.
pub async fn run(
    node: &str,
    namespace: &str,
    socket: &Path,
    t: Timing,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let Timing { every, duration, grace } = t;
    anyhow::ensure!(
        every < duration,
        "the renewal interval ({every:?}) must be shorter than the lease duration ({duration:?})"
    );
    let client = kube::Client::try_default().await.context("the Kubernetes API")?;
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let lease = Leadership::new(api.clone(), &lease_name(node), node, duration).with_note(STOPPING, None);
    let daemon = StaticNodes::single(node, socket);
    tracing::info!(node, lease = %lease_name(node), ?every, ?duration, ?grace, "storage heartbeat");
    let mut silent = false;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        match trouble(&daemon, node, every).await {
            None => match lease.hold().await {
                Ok(_) if silent => {
                    silent = false;
                    tracing::info!(node, "the daemon answers again: renewing the node's lease");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(node, "renewing the node's lease: {e:#}"),
            },
            Some(why) if !silent => {
                silent = true;
                tracing::warn!(node, "not renewing the node's lease: {why}");
            }
            Some(_) => {}
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = &mut shutdown => break,
        }
    }
    if !silent {
        let since = k8s_openapi::jiff::Timestamp::now().to_string();
        Leadership::new(api, &lease_name(node), node, grace).with_note(STOPPING, Some(since)).hold().await?;
        tracing::info!(node, ?grace, "stopping: the node's lease holds for the restart grace");
    }
    Ok(())
}
