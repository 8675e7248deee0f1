//! `ferrite replica hand-over`: the daemon pod's preStop hook. When the pod is stopped on
//! purpose (a rolling upgrade, a drain), its heartbeat marks the node's Lease as stopping and the
//! failover loop hands this daemon's unpublished primaries over to in-sync copies on other
//! nodes; this waits until that is done, so that no such volume is left without a primary while
//! the daemon restarts. A volume published here stays: its device is served by this daemon and
//! the kernel holds its I/O through the restart (ublk user recovery).
//!
//! The wait ends early when no primary moved for `idle` (no controller is handing over: failover
//! off, or no copy can take it), and at `timeout` in any case; it always succeeds, since the
//! kubelet stops the pod whatever a preStop hook answers.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::hand_over;

use crate::cli::{Admin, rpc_error};

/// The primaries the failover loop may hand over from here ([`hand_over::movable`]).
async fn movable(c: &mut Admin) -> anyhow::Result<BTreeSet<String>> {
    let held = c.list_sync_replicas(pb::ListReplicationsRequest::default()).await.map_err(rpc_error)?.into_inner();
    let published = c.list_publications(pb::ListPublicationsRequest {}).await.map_err(rpc_error)?.into_inner();
    Ok(hand_over::movable(&held.volumes, &published.publications).into_iter().map(|(v, _)| v.volume.clone()).collect())
}

/// Waits until the primaries [`movable`] lists are handed over, or none moved for `idle`, or
/// `timeout` passed; says which stayed.
pub async fn wait(c: &mut Admin, timeout: Duration, idle: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut left = movable(c).await?;
    let first = left.len();
    let mut moved_at = start;
    eprintln!("hand-over: {first} unpublished primary(ies) with an in-sync copy elsewhere");
    while !left.is_empty() {
        let why = if start.elapsed() >= timeout {
            format!("not all handed over within {timeout:?}")
        } else if moved_at.elapsed() >= idle {
            format!("none handed over for {idle:?} (is failover on?)")
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = movable(c).await?;
            if now.len() < left.len() {
                moved_at = Instant::now();
            }
            left = now;
            continue;
        };
        let names: Vec<&str> = left.iter().map(String::as_str).collect();
        eprintln!("hand-over: {why}; the primary stays here for {}", names.join(", "));
        return Ok(());
    }
    eprintln!("hand-over: {first} handed over in {:.1?}", start.elapsed());
    Ok(())
}
