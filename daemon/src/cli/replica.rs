//! `ferrite replica ...`: asynchronous replication to a peer, synchronous replicas and
//! witnesses, and the daemon pod's preStop hand-over.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::hand_over;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, rpc_error, table};
use ferrite_daemon::base::size::format_size;

#[derive(clap::Subcommand)]
pub enum ReplicaCmd {
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
        #[arg(long, default_value = "1m", value_parser = ferrite_csi::addons::replication::parse_interval)]
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

pub async fn run(c: &mut crate::cli::Admin, out: Output, cmd: ReplicaCmd) -> Result<()> {
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
                print_sync_volumes(out, &[v.map_err(rpc_error)?.into_inner()]);
                return Ok(());
            }
            c.promote_replication(pb::PromoteReplicationRequest { volume, force }).await
        }
        ReplicaCmd::Add { volume, peer, sync: _, witness } => {
            let v = c.add_sync_replica(pb::AddSyncReplicaRequest { volume, peer, witness }).await;
            print_sync_volumes(out, &[v.map_err(rpc_error)?.into_inner()]);
            return Ok(());
        }
        ReplicaCmd::Remove { volume, peer } => {
            let v = c.remove_sync_replica(pb::RemoveSyncReplicaRequest { volume, peer }).await;
            print_sync_volumes(out, &[v.map_err(rpc_error)?.into_inner()]);
            return Ok(());
        }
        ReplicaCmd::Resync { volume } => c.resync_replication(one(volume)).await,
        ReplicaCmd::HandOver { timeout, idle } => {
            let secs = std::time::Duration::from_secs;
            return wait_for_hand_over(c, secs(timeout), secs(idle)).await;
        }
        ReplicaCmd::Status { volume } => {
            let req = pb::ListReplicationsRequest { volume: volume.unwrap_or_default() };
            let named = !req.volume.is_empty();
            let sync = c.list_sync_replicas(req.clone()).await.map_err(rpc_error)?.into_inner().volumes;
            if named && !sync.is_empty() {
                print_sync_volumes(out, &sync);
                return Ok(());
            }
            let r = c.list_replications(req).await.map_err(rpc_error)?;
            let replications = &r.get_ref().replications;
            // One kind: that kind's table (or JSON); both: both tables.
            if !sync.is_empty() {
                print_sync_volumes(out, &sync);
            }
            if sync.is_empty() || !replications.is_empty() {
                print_replications(out, replications);
            }
            return Ok(());
        }
        ReplicaCmd::Sync { volume } => {
            let r =
                crate::cli::with_progress(c, &volume, "replica sync", c.clone().sync_replication(one(volume.clone())))
                    .await;
            print_sync(out, r.map_err(rpc_error)?.get_ref());
            return Ok(());
        }
    };
    print_replications(out, &[r.map_err(rpc_error)?.into_inner()]);
    Ok(())
}

pub fn print_sync(out: Output, r: &pb::SyncReplicationResponse) {
    match out {
        Output::Json => println!(
            "{}",
            json!({ "snapshot": r.snapshot, "base": r.base, "data_bytes": r.data_bytes, "resumed": r.resumed })
        ),
        Output::Table => {
            let over = if r.base.is_empty() { "a first sync".to_owned() } else { format!("over {}", r.base) };
            let how = if r.resumed { ", finishing an interrupted transfer" } else { "" };
            println!("replica at {} ({over}{how}): {} of data sent", r.snapshot, format_size(r.data_bytes));
        }
    }
}

fn replication_json(r: &pb::Replication) -> serde_json::Value {
    json!({"volume": r.volume, "role": r.role, "peer": r.peer, "remote": r.remote,
           "interval_secs": r.interval_secs, "state": r.state, "error": r.error,
           "last_snapshot": r.last_snapshot, "last_snapshot_unix_ms": r.last_snapshot_unix_ms,
           "last_sync_seconds": r.last_sync_seconds, "last_sync_bytes": r.last_sync_bytes,
           "lag_seconds": r.lag_seconds, "bytes_done": r.bytes_done, "bytes_left": r.bytes_left,
           "bytes_per_second": r.bytes_per_second, "handover": r.handover, "resynced": r.resynced,
           "group": r.group, "members": r.members, "snapshots": r.snapshots})
}

pub fn print_replications(out: Output, list: &[pb::Replication]) {
    match out {
        Output::Json if list.len() == 1 => println!("{}", replication_json(&list[0])),
        Output::Json => println!("{}", serde_json::Value::Array(list.iter().map(replication_json).collect())),
        Output::Table => {
            let rows = list
                .iter()
                .map(|r| {
                    let state = match (r.state.as_str(), r.handover) {
                        ("syncing", _) => format!("syncing {} left", format_size(r.bytes_left)),
                        (s, true) => format!("{s}, final delta pending"),
                        (s, false) => s.to_owned(),
                    };
                    let every =
                        if r.interval_secs == 0 { "on request".into() } else { format!("{}s", r.interval_secs) };
                    let lag = if r.last_snapshot.is_empty() { "-".into() } else { format!("{:.1}s", r.lag_seconds) };
                    let name = if r.group {
                        format!("{} (group: {})", r.volume, r.members.join(", "))
                    } else {
                        r.volume.clone()
                    };
                    vec![name, r.role.clone(), format!("{}:{}", r.peer, r.remote), state, lag, every]
                })
                .collect();
            println!("{}", table(&["VOLUME", "ROLE", "PEER:VOLUME", "STATE", "LAG", "INTERVAL"], rows));
            for r in list.iter().filter(|r| !r.error.is_empty()) {
                println!("{}: {}", r.volume, r.error);
            }
        }
    }
}

fn sync_json(v: &pb::SyncVolume) -> serde_json::Value {
    let members: Vec<_> = v
        .members
        .iter()
        .map(|m| json!({"endpoint": m.endpoint, "state": m.state, "reason": m.reason, "mark": m.mark}))
        .collect();
    json!({"volume": v.volume, "kind": "sync", "role": v.role, "generation": v.generation, "primary": v.primary,
           "members": members, "refused": v.refused, "requests": v.requests,
           "added_latency_us": v.added_latency_us})
}

/// Synchronous volumes: one row per member.
pub fn print_sync_volumes(out: Output, list: &[pb::SyncVolume]) {
    match out {
        Output::Json if list.len() == 1 => println!("{}", sync_json(&list[0])),
        Output::Json => println!("{}", serde_json::Value::Array(list.iter().map(sync_json).collect())),
        Output::Table => {
            let mut rows = Vec::new();
            for v in list {
                for m in &v.members {
                    let state =
                        if m.reason.is_empty() { m.state.clone() } else { format!("{} ({})", m.state, m.reason) };
                    rows.push(vec![v.volume.clone(), v.generation.to_string(), m.endpoint.clone(), state]);
                }
            }
            println!("{}", table(&["VOLUME", "GENERATION", "MEMBER", "STATE"], rows));
            for v in list {
                let added =
                    if v.requests == 0 { String::new() } else { format!(", +{:.0} µs per write", v.added_latency_us) };
                println!("{}: {} here{added}", v.volume, v.role);
                if !v.refused.is_empty() {
                    println!("{}: {}", v.volume, v.refused);
                }
            }
        }
    }
}

/// The primaries the failover loop may hand over from here ([`hand_over::movable`]).
async fn movable(c: &mut Admin) -> anyhow::Result<BTreeSet<String>> {
    let held = c.list_sync_replicas(pb::ListReplicationsRequest::default()).await.map_err(rpc_error)?.into_inner();
    let published = c.list_publications(pb::ListPublicationsRequest {}).await.map_err(rpc_error)?.into_inner();
    Ok(hand_over::movable(&held.volumes, &published.publications).into_iter().map(|(v, _)| v.volume.clone()).collect())
}

/// `ferrite replica hand-over`: the daemon pod's preStop hook. When the pod is stopped on
/// purpose (a rolling upgrade, a drain), its heartbeat marks the node's Lease as stopping and the
/// failover loop hands this daemon's unpublished primaries over to in-sync copies on other
/// nodes; this waits until that is done, so that no such volume is left without a primary while
/// the daemon restarts. A volume published here stays: its device is served by this daemon and
/// the kernel holds its I/O through the restart (ublk user recovery).
///
/// The wait ends early when no primary moved for `idle` (no controller is handing over: failover
/// off, or no copy can take it), and at `timeout` in any case; it always succeeds, since the
/// kubelet stops the pod whatever a preStop hook answers.
async fn wait_for_hand_over(c: &mut Admin, timeout: Duration, idle: Duration) -> anyhow::Result<()> {
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
