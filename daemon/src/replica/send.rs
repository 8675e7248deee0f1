//! The sending end: one push of a volume to its peer. It asks the peer where its replica stands;
//! finishes an unfinished transfer of one of this relation's mirror snapshots from its resume
//! offset, or takes a new mirror snapshot and ships what changed since the newest mirror snapshot
//! both sides hold. Pieces are read on the blocking pool, paced by the peer's bandwidth limit,
//! into a short channel, so a delta of any size holds a few MiB.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ferrite_engine::{GroupSnapshotInfo, Image};
use ferrite_proto::ferrite::v1::push_message::Msg;
use ferrite_proto::ferrite::v1::replica_client::ReplicaClient;
use ferrite_proto::ferrite::v1::{
    GroupCommitRequest, PushBegin, PushCommit, PushData, PushMessage, PushZero, ReplicaPosition,
    ReplicaPositionRequest, SyncReplicationResponse,
};
use ferrite_replication::Piece;
use ferrite_replication::delta::Delta;
use tonic::transport::Channel;

use super::records::{Relation, Role};
use super::{Progress, Replication, now_ms};
use crate::base::config::TlsFiles;
use crate::base::error::{Error, blocking};
use crate::base::rpc::at_peer;
use crate::records::exports::snapshot_of;

/// Data bytes per push piece.
pub const PIECE: usize = 1 << 20;

/// A client of the peer's `Replica` service (mutual TLS to a tcp:// peer).
pub async fn connect(tls: Option<&TlsFiles>, peer: &str) -> Result<ReplicaClient<Channel>, Error> {
    Ok(ReplicaClient::new(channel(tls, peer).await?).max_decoding_message_size(super::MAX_PUSH_MESSAGE))
}

/// A channel to a peer daemon's admin API: mutual TLS with this daemon's identity to a tcp://
/// peer, plain to a socket path.
pub async fn channel(tls: Option<&TlsFiles>, peer: &str) -> Result<Channel, Error> {
    let client_tls = match (peer.starts_with("tcp://"), tls) {
        (false, _) => None,
        (true, Some(TlsFiles { cert, key, client_ca: Some(ca), .. })) => Some(
            ferrite_proto::admin_tls(ca, Some((cert, key)))
                .map_err(|e| Error::refused(format!("TLS client identity for {peer}: {e}")))?,
        ),
        (true, _) => {
            return Err(Error::refused(format!(
                "replicating to {peer} needs tls-cert, tls-key and tls-client-ca (mutual TLS with the peer)"
            )));
        }
    };
    let name = tls.and_then(|t| t.peer_name.as_deref());
    ferrite_proto::connect_as(peer, client_tls, name)
        .await
        .map_err(|e| Error::unavailable(format!("connecting to peer {peer}: {e}")))
}

/// Where `volume` (or a group) stands on `peer`.
pub async fn position(client: &mut ReplicaClient<Channel>, peer: &str, volume: &str) -> Result<ReplicaPosition, Error> {
    let req = ReplicaPositionRequest { replica: volume.to_owned() };
    Ok(client.position(req).await.map_err(at_peer(peer))?.into_inner())
}

/// Deletes this relation's mirror snapshots other than the points in `keep` (for a group: its
/// other group points, and member snapshots other than `<keep>.<member>`): after a complete push
/// (or receipt) `keep` is the common point, and anything else is an older point or an abandoned
/// transfer's. One a client reads (exported or attached) stays until a later prune.
pub async fn prune(hub: &Replication, rel: &Relation, keep: &[&str]) {
    // Held across the deletions so that no export or attachment of them starts meanwhile.
    let live = hub.attachments.lock().await;
    let records = hub.exports.lock().await;
    let in_use: Vec<String> = live
        .iter()
        .filter_map(|(a, _)| snapshot_of(&a.volume))
        .chain(records.iter().filter_map(|r| r.snapshot()))
        .map(str::to_owned)
        .collect();
    let (pool, rel) = (Arc::clone(&hub.pool), rel.clone());
    let keep: Vec<String> = keep.iter().map(|k| (*k).to_owned()).collect();
    let name = rel.volume.clone();
    let r = blocking(move || {
        let unused = |snapshot: &str| !in_use.iter().any(|u| u == snapshot);
        let volumes = if rel.group {
            for p in pool.group_snapshots(Some(&rel.volume)).unwrap_or_default() {
                if rel.made(&p.name, None)
                    && !keep.contains(&p.name)
                    && p.snapshots.iter().all(|(s, v)| rel.made(s, Some(v)) && unused(s))
                {
                    pool.delete_group_snapshot(&p.name)?;
                }
            }
            rel.members.clone()
        } else {
            vec![rel.volume.clone()]
        };
        for v in &volumes {
            let own: Vec<String> =
                keep.iter().map(|k| if rel.group { format!("{k}.{v}") } else { k.clone() }).collect();
            for s in pool.snapshots(Some(v)).unwrap_or_default() {
                if !own.contains(&s.name) && rel.made(&s.name, rel.group.then_some(v.as_str())) && unused(&s.name) {
                    pool.delete_snapshot(&s.name)?;
                }
            }
        }
        Ok(())
    })
    .await;
    drop((records, live));
    if let Err(e) = r {
        tracing::warn!(relation = %name, error = %e.message(), "could not delete older mirror snapshots");
    }
}

/// One volume's part of a push: what goes where.
struct Leg<'a> {
    volume: &'a str,
    remote: &'a str,
    /// The mirror snapshot to bring (a group point's member snapshot); None: take a new one.
    to: Option<String>,
    /// The remote group, for a member of a replicated group.
    group: &'a str,
    /// The relation's name here (a volume or a group): what the peer records as its origin,
    /// and whose status shows the progress.
    relation: &'a Relation,
}

/// Pushes `rel.volume` to its peer once. The caller holds the volume's op lock.
pub async fn push(hub: &Replication, rel: &Relation) -> Result<SyncReplicationResponse, Error> {
    check_role(rel)?;
    let mut client = connect(hub.tls.as_ref(), &rel.peer).await?;
    let mut user_bytes = 0;
    for s in user_snapshots_to_send(hub, &mut client, rel).await? {
        let leg = Leg { volume: &rel.volume, remote: &rel.remote, to: Some(s), group: "", relation: rel };
        user_bytes += push_leg(hub, &mut client, leg).await?.data_bytes;
    }
    let leg = Leg { volume: &rel.volume, remote: &rel.remote, to: None, group: "", relation: rel };
    let mut out = push_leg(hub, &mut client, leg).await?;
    out.data_bytes += user_bytes;
    let mut now = hub.relations.get(&rel.volume).unwrap_or_else(|| rel.clone());
    now.synced.clone_from(&out.snapshot);
    hub.relations.put(now.clone())?;
    prune(hub, &now, &[&out.snapshot]).await;
    Ok(out)
}

/// The user snapshots the settings name that the peer lacks, taken since the newest snapshot
/// both sides hold, oldest first: each crosses as its own delta before the next mirror snapshot.
async fn user_snapshots_to_send(
    hub: &Replication,
    client: &mut ReplicaClient<Channel>,
    rel: &Relation,
) -> Result<Vec<String>, Error> {
    if rel.snapshots.is_empty() {
        return Ok(Vec::new());
    }
    let theirs = position(client, &rel.peer, &rel.remote).await?.snapshots;
    let (pool, v) = (Arc::clone(&hub.pool), rel.volume.clone());
    let ours: Vec<String> = blocking(move || pool.snapshots(Some(&v))).await?.into_iter().map(|s| s.name).collect();
    let since = ours.iter().rposition(|n| rel.carries(n) && theirs.contains(n)).map_or(0, |i| i + 1);
    Ok(ours[since..]
        .iter()
        .filter(|n| !n.starts_with(&rel.prefix) && rel.carries(n) && !theirs.contains(n))
        .cloned()
        .collect())
}

fn check_role(rel: &Relation) -> Result<(), Error> {
    if rel.role == Role::Secondary && !rel.handover {
        return Err(Error::refused(format!(
            "{:?} is a secondary here: its primary on {} pushes to it",
            rel.volume, rel.peer
        )));
    }
    Ok(())
}

/// A peer whose relation is at a higher epoch was promoted after this side's last promotion:
/// this side was failed over, and pushing would overwrite its successor.
fn check_epoch(rel: &Relation, pos: &ReplicaPosition) -> Result<(), Error> {
    if pos.epoch > rel.epoch {
        return Err(Error::refused(format!(
            "{:?} on {} is at epoch {}, this side at {}: it was promoted since; demote this side and resync it",
            rel.remote, rel.peer, pos.epoch, rel.epoch
        )));
    }
    Ok(())
}

fn split_brain(peer: &str, remote: &str) -> Error {
    Error::refused(format!("split-brain: {remote:?} on {peer} is a primary too; demote one side and resync it"))
}

/// Sends one volume's delta: asks the peer where its copy stands, finishes an unfinished
/// transfer of the same mirror snapshot or sends the delta over the newest common one.
async fn push_leg(
    hub: &Replication,
    client: &mut ReplicaClient<Channel>,
    leg: Leg<'_>,
) -> Result<SyncReplicationResponse, Error> {
    let rel = leg.relation;
    let peer = rel.peer.as_str();
    let pos = position(client, peer, leg.remote).await?;
    // Asked first, so a push that would be refused sends no data.
    if pos.busy {
        return Err(Error::busy(format!(
            "peer {peer}: a transfer into {:?} is still in flight there (a cut one ends within 15 s)",
            leg.remote
        )));
    }
    if pos.role == Role::Primary.as_str() {
        return Err(split_brain(peer, leg.remote));
    }
    check_epoch(rel, &pos)?;
    if let Some(to) = leg.to.as_ref().filter(|t| pos.snapshots.contains(t)) {
        // This member already holds the group point.
        return Ok(SyncReplicationResponse { snapshot: to.clone(), ..Default::default() });
    }
    let pool = Arc::clone(&hub.pool);
    let v = leg.volume.to_owned();
    let ours: Vec<String> = blocking(move || pool.snapshots(Some(&v)))
        .await?
        .into_iter()
        .map(|s| s.name)
        .filter(|n| rel.carries(n))
        .collect();
    let held = |n: &str| n.is_empty() || ours.iter().any(|o| o == n);
    let wanted = |n: &str| leg.to.as_deref().is_none_or(|t| t == n);
    let resumable = !pos.pending_snapshot.is_empty()
        && wanted(&pos.pending_snapshot)
        && held(&pos.pending_snapshot)
        && held(&pos.pending_base);
    let (to, base, from, resumed) = if resumable {
        (pos.pending_snapshot, pos.pending_base, pos.resume_offset, true)
    } else {
        // The newest snapshot the replica holds that is one of ours is the common point.
        let base = pos.snapshots.iter().rev().find(|n| ours.contains(n)).cloned().unwrap_or_default();
        if base.is_empty() && !pos.snapshots.is_empty() {
            return Err(Error::refused(format!(
                "{:?} on {peer} holds none of the mirror snapshots of {:?}: it needs a resync (or a new replica)",
                leg.remote, leg.volume
            )));
        }
        match leg.to {
            Some(to) => (to, base, 0, false),
            None => {
                // Mirror snapshots of pushes the peer refused or never finished are of no use:
                // they go before a new one is taken, so a peer that refuses every push leaves
                // this side with the common point and the newest attempt, whatever it does.
                prune(hub, rel, &[&base, &pos.pending_snapshot]).await;
                let (p, v, name) =
                    (Arc::clone(&hub.pool), leg.volume.to_owned(), format!("{}{}", rel.prefix, now_ms()));
                blocking(move || p.create_snapshot(&v, &name)).await.map(|s| (s.name, base, 0, false))?
            }
        }
    };
    let (p, t, b) = (Arc::clone(&hub.pool), to.clone(), base.clone());
    let (delta, wrapped_key, older_keys) = blocking(move || {
        let delta = Delta::plan(&p, &t, Some(b.as_str()).filter(|b| !b.is_empty()))?;
        let image = Image::Snapshot(&t);
        Ok((delta, p.wrapped_key(image)?.unwrap_or_default(), p.older_wrapped_keys(image)?))
    })
    .await?;
    let progress = Arc::new(Progress {
        started: Instant::now(),
        done: AtomicU64::new(0),
        total: AtomicU64::new(delta.data_bytes_from(from)),
    });
    hub.live(&rel.volume, |l| l.running = Some(Arc::clone(&progress)));
    let begin = PushBegin {
        replica: leg.remote.to_owned(),
        base: base.clone(),
        snapshot: to.clone(),
        size: delta.size,
        end: delta.end(),
        resume: resumed,
        origin: hub.endpoint.clone(),
        origin_volume: rel.volume.clone(),
        interval_secs: rel.interval_secs,
        group: leg.group.to_owned(),
        prefix: rel.prefix.clone(),
        epoch: rel.epoch,
        wrapped_key,
        older_keys,
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<PushMessage>(4);
    let reader = {
        let (pool, limiter, progress) = (Arc::clone(&hub.pool), hub.limiter(peer), Arc::clone(&progress));
        tokio::task::spawn_blocking(move || -> ferrite_engine::Result<()> {
            let send = |m: Msg| tx.blocking_send(PushMessage { msg: Some(m) }).is_ok();
            if !send(Msg::Begin(begin)) {
                return Ok(());
            }
            for piece in delta.pieces(&pool, from, PIECE)? {
                let m = match piece? {
                    Piece::Data { offset, data, crcs } => {
                        limiter.take(data.len() as u64);
                        progress.done.fetch_add(data.len() as u64, Ordering::Relaxed);
                        Msg::Data(PushData { offset, data, crcs })
                    }
                    Piece::Zero { offset, len } => Msg::Zero(PushZero { offset, length: len }),
                };
                if !send(m) {
                    return Ok(()); // the call ended; its status says why
                }
            }
            send(Msg::Commit(PushCommit {}));
            Ok(())
        })
    };
    let sent = client.push(tokio_stream::wrappers::ReceiverStream::new(rx)).await;
    let read = reader.await.map_err(|e| Error::internal(format!("replica reader: {e}")));
    hub.live(&rel.volume, |l| l.running = None);
    read?.map_err(Error::from)?;
    let reply = sent.map_err(at_peer(peer))?.into_inner();
    let secs = progress.started.elapsed().as_secs_f64();
    hub.live(&rel.volume, |l| (l.last_secs, l.last_bytes) = (secs, reply.data_bytes));
    tracing::info!(volume = %leg.volume, %peer, replica = %leg.remote, snapshot = %reply.snapshot,
        bytes = reply.data_bytes, resumed, "replica pushed");
    Ok(SyncReplicationResponse { snapshot: reply.snapshot, base, data_bytes: reply.data_bytes, resumed })
}

/// A group relation's points here (its group snapshots), oldest first.
pub async fn group_points(hub: &Replication, rel: &Relation) -> Result<Vec<GroupSnapshotInfo>, Error> {
    let (pool, rel) = (Arc::clone(&hub.pool), rel.clone());
    blocking(move || {
        let mut points: Vec<_> =
            pool.group_snapshots(Some(&rel.volume))?.into_iter().filter(|g| rel.taken_ms(&g.name).is_some()).collect();
        points.sort_by_key(|g| rel.taken_ms(&g.name));
        Ok(points)
    })
    .await
}

/// Pushes a replicated group once: every member to the same group mirror point (a group
/// snapshot here, so crash-consistent across members), then tells the peer the point is
/// complete; only then does it count, there and here. An unfinished point is finished first.
pub async fn push_group(hub: &Replication, rel: &Relation) -> Result<SyncReplicationResponse, Error> {
    check_role(rel)?;
    let peer = rel.peer.as_str();
    let mut client = connect(hub.tls.as_ref(), peer).await?;
    let pos = position(&mut client, peer, &rel.remote).await?;
    if pos.role == Role::Primary.as_str() {
        return Err(split_brain(peer, &rel.remote));
    }
    check_epoch(rel, &pos)?;
    let (pool, group) = (Arc::clone(&hub.pool), rel.volume.clone());
    let mut members = blocking(move || Ok(pool.groups().into_iter().find(|g| g.name == group).map(|g| g.volumes)))
        .await?
        .unwrap_or_default();
    if members.is_empty() {
        return Err(Error::refused(format!("group {:?} has no volumes here", rel.volume)));
    }
    members.sort();
    let points = group_points(hub, rel).await?;
    // An unfinished point with every current member continues; otherwise a new one.
    let unfinished = points
        .last()
        .filter(|p| p.name != rel.synced && members.iter().all(|m| p.snapshots.iter().any(|(_, v)| v == m)));
    let point = match unfinished {
        Some(p) => p.name.clone(),
        None => {
            let (pool, group, name) =
                (Arc::clone(&hub.pool), rel.volume.clone(), format!("{}{}", rel.prefix, now_ms()));
            blocking(move || pool.create_group_snapshot(&group, &name)).await?.name
        }
    };
    let (mut bytes, mut resumed) = (0, false);
    for m in &members {
        let leg = Leg { volume: m, remote: m, to: Some(format!("{point}.{m}")), group: &rel.remote, relation: rel };
        let out = push_leg(hub, &mut client, leg).await?;
        bytes += out.data_bytes;
        resumed |= out.resumed;
    }
    let req = GroupCommitRequest {
        group: rel.remote.clone(),
        point: point.clone(),
        members: members.clone(),
        epoch: rel.epoch,
    };
    client.group_commit(req).await.map_err(at_peer(peer))?;
    hub.live(&rel.volume, |l| l.last_bytes = bytes);
    let mut now = hub.relations.get(&rel.volume).unwrap_or_else(|| rel.clone());
    now.synced.clone_from(&point);
    now.members.clone_from(&members);
    hub.relations.put(now.clone())?;
    prune(hub, &now, &[&point]).await;
    let base = rel.synced.clone();
    Ok(SyncReplicationResponse { snapshot: point, base, data_bytes: bytes, resumed })
}
