//! The sending end: one push of a volume to its peer. It asks the peer where its replica stands;
//! finishes an unfinished transfer of one of this relation's mirror snapshots from its resume
//! offset, or takes a new mirror snapshot and ships what changed since the newest mirror snapshot
//! both sides hold. Pieces are read on the blocking pool, paced by the peer's bandwidth limit,
//! into a short channel, so a delta of any size holds a few MiB.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ferrite_proto::ferrite::v1::push_message::Msg;
use ferrite_proto::ferrite::v1::replica_client::ReplicaClient;
use ferrite_proto::ferrite::v1::{
    PushBegin, PushCommit, PushData, PushMessage, PushZero, ReplicaPositionRequest, SyncReplicationResponse,
};
use ferrite_replication::Piece;
use ferrite_replication::delta::Delta;
use tonic::Status;
use tonic::transport::Channel;

use super::records::{Relation, Role};
use super::{Progress, Replication, now_ms};
use crate::admin::{blocking, status};
use crate::config::TlsFiles;
use crate::exports::snapshot_of;

/// Data bytes per push piece.
pub const PIECE: usize = 1 << 20;

/// A client of the peer's `Replica` service (mutual TLS to a tcp:// peer).
pub async fn connect(tls: Option<&TlsFiles>, peer: &str) -> Result<ReplicaClient<Channel>, Status> {
    let client_tls = match (peer.starts_with("tcp://"), tls) {
        (false, _) => None,
        (true, Some(TlsFiles { cert, key, client_ca: Some(ca) })) => Some(
            ferrite_proto::admin_tls(ca, Some((cert, key)))
                .map_err(|e| Status::failed_precondition(format!("TLS client identity for {peer}: {e}")))?,
        ),
        (true, _) => {
            return Err(Status::failed_precondition(format!(
                "replicating to {peer} needs tls-cert, tls-key and tls-client-ca (mutual TLS with the peer)"
            )));
        }
    };
    let channel = ferrite_proto::connect(peer, client_tls)
        .await
        .map_err(|e| Status::unavailable(format!("connecting to peer {peer}: {e}")))?;
    Ok(ReplicaClient::new(channel).max_decoding_message_size(super::MAX_PUSH_MESSAGE))
}

/// A peer's error, saying which peer.
pub fn at_peer(peer: &str) -> impl Fn(Status) -> Status + '_ {
    move |e| Status::new(e.code(), format!("peer {peer}: {}", e.message()))
}

/// Deletes this relation's mirror snapshots of its volume other than `keep`: after a complete
/// push (or receipt) `keep` is the common point, and anything else is an older point or an
/// abandoned transfer's. One a client reads (exported or attached) stays until a later prune.
pub async fn prune(hub: &Replication, rel: &Relation, keep: &str) {
    // Held across the deletions so that no export or attachment of them starts meanwhile.
    let live = hub.attachments.lock().await;
    let records = hub.exports.lock().await;
    let in_use: Vec<String> = live
        .iter()
        .filter_map(|(a, _)| snapshot_of(&a.volume))
        .chain(records.iter().filter_map(|r| r.snapshot()))
        .map(str::to_owned)
        .collect();
    let (pool, volume, prefix, keep) = (Arc::clone(&hub.pool), rel.volume.clone(), rel.prefix.clone(), keep.to_owned());
    let r = blocking(move || {
        for s in pool.snapshots(Some(&volume))? {
            if s.name != keep && s.name.starts_with(&prefix) && !in_use.contains(&s.name) {
                pool.delete_snapshot(&s.name)?;
            }
        }
        Ok(())
    })
    .await;
    drop((records, live));
    if let Err(e) = r {
        tracing::warn!(volume = %rel.volume, error = %e.message(), "could not delete older mirror snapshots");
    }
}

/// Pushes `rel.volume` to its peer once. The caller holds the volume's op lock.
pub async fn push(hub: &Replication, rel: &Relation) -> Result<SyncReplicationResponse, Status> {
    if rel.role == Role::Secondary && !rel.handover {
        return Err(Status::failed_precondition(format!(
            "volume {:?} is a secondary here: its primary on {} pushes to it",
            rel.volume, rel.peer
        )));
    }
    let peer = rel.peer.as_str();
    let mut client = connect(hub.tls.as_ref(), peer).await?;
    let pos = client
        .position(ReplicaPositionRequest { replica: rel.remote.clone() })
        .await
        .map_err(at_peer(peer))?
        .into_inner();
    // Asked first, so a push that would be refused sends no data.
    if pos.busy {
        return Err(Status::aborted(format!(
            "peer {peer}: a transfer into {:?} is still in flight there (a cut one ends within 15 s)",
            rel.remote
        )));
    }
    if pos.role == Role::Primary.as_str() {
        return Err(Status::failed_precondition(format!(
            "split-brain: {:?} on {peer} is a primary too; demote one side and resync it",
            rel.remote
        )));
    }
    let pool = Arc::clone(&hub.pool);
    let (v, prefix) = (rel.volume.clone(), rel.prefix.clone());
    let ours: Vec<String> = blocking(move || pool.snapshots(Some(&v)))
        .await?
        .into_iter()
        .map(|s| s.name)
        .filter(|n| n.starts_with(&prefix))
        .collect();
    let held = |n: &str| n.is_empty() || ours.iter().any(|o| o == n);
    let resumable = !pos.pending_snapshot.is_empty() && held(&pos.pending_snapshot) && held(&pos.pending_base);
    let (to, base, from, resumed) = if resumable {
        (pos.pending_snapshot, pos.pending_base, pos.resume_offset, true)
    } else {
        // The newest snapshot the replica holds that is one of ours is the common point.
        let base = pos.snapshots.iter().rev().find(|n| ours.contains(n)).cloned().unwrap_or_default();
        if base.is_empty() && !pos.snapshots.is_empty() {
            return Err(Status::failed_precondition(format!(
                "{:?} on {peer} holds none of the mirror snapshots of {:?}: it needs a resync (or a new replica)",
                rel.remote, rel.volume
            )));
        }
        let (p, v, name) = (Arc::clone(&hub.pool), rel.volume.clone(), format!("{}{}", rel.prefix, now_ms()));
        blocking(move || p.create_snapshot(&v, &name)).await.map(|s| (s.name, base, 0, false))?
    };
    let (p, t, b) = (Arc::clone(&hub.pool), to.clone(), base.clone());
    let delta = blocking(move || Delta::plan(&p, &t, Some(b.as_str()).filter(|b| !b.is_empty()))).await?;
    let progress = Arc::new(Progress {
        started: Instant::now(),
        done: AtomicU64::new(0),
        total: AtomicU64::new(delta.data_bytes_from(from)),
    });
    hub.live(&rel.volume, |l| l.running = Some(Arc::clone(&progress)));
    let begin = PushBegin {
        replica: rel.remote.clone(),
        base: base.clone(),
        snapshot: to.clone(),
        size: delta.size,
        end: delta.end(),
        resume: resumed,
        origin: hub.endpoint.clone(),
        origin_volume: rel.volume.clone(),
        interval_secs: rel.interval_secs,
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
    let read = reader.await.map_err(|e| Status::internal(format!("replica reader: {e}")));
    hub.live(&rel.volume, |l| l.running = None);
    read?.map_err(status)?;
    let reply = sent.map_err(at_peer(peer))?.into_inner();
    let secs = progress.started.elapsed().as_secs_f64();
    let mut now = hub.relations.get(&rel.volume).unwrap_or_else(|| rel.clone());
    now.synced.clone_from(&reply.snapshot);
    hub.relations.put(now.clone())?;
    hub.live(&rel.volume, |l| (l.last_secs, l.last_bytes) = (secs, reply.data_bytes));
    prune(hub, &now, &reply.snapshot).await;
    tracing::info!(volume = %rel.volume, %peer, replica = %rel.remote, snapshot = %reply.snapshot,
        bytes = reply.data_bytes, resumed, "replica pushed");
    Ok(SyncReplicationResponse { snapshot: reply.snapshot, base, data_bytes: reply.data_bytes, resumed })
}
