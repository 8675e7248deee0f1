//! Replication between daemons: the `Replica` gRPC service (the receiving end) and
//! [`push_to_peer`] (the sending end). A peer pushes a delta between
//! two mirror snapshots; `ferrite_replication::apply::Transfer` checks every piece and takes the
//! mirror snapshot only when the delta is complete. The resume point of an unfinished transfer
//! is kept in `<data dir>/replication.json` (made durable every [`CHECKPOINT_BYTES`] and when a
//! stream ends early), so a cut link or a restart of either daemon resumes, not restarts.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

use ferrite_engine::Pool;
use ferrite_proto::ferrite::v1::push_message::Msg;
use ferrite_proto::ferrite::v1::replica_client::ReplicaClient;
use ferrite_proto::ferrite::v1::{
    PushBegin, PushCommit, PushData, PushMessage, PushReplicaResponse, PushReply, PushZero, ReplicaPosition,
    ReplicaPositionRequest, replica_server,
};
use ferrite_replication::Piece;
use ferrite_replication::apply::Transfer;
use ferrite_replication::delta::Delta;
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status, Streaming};

use crate::admin::{blocking, status};
use crate::config::TlsFiles;
use crate::state::RecordFile;

/// Bytes applied between two durable resume points.
const CHECKPOINT_BYTES: u64 = 64 << 20;

/// The largest push message: a 1 MiB piece of data ([`PIECE`]) with its crcs, and framing.
pub const MAX_PUSH_MESSAGE: usize = PIECE + (16 << 10);

/// An unfinished transfer: what it brings, over what, and where it resumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct PendingRecord {
    replica: String,
    snapshot: String,
    base: String,
    resume: u64,
}

/// The receiving end, shared by the admin listeners.
#[derive(Debug, Clone)]
pub struct ReplicaService {
    pool: Arc<Pool>,
    file: RecordFile,
    pending: Arc<Mutex<Vec<PendingRecord>>>,
    /// Replicas with a push in flight: a second one is refused (Aborted).
    busy: Arc<Mutex<HashSet<String>>>,
}

/// Holds a replica's in-flight mark; dropping it clears the mark.
struct Busy(Arc<Mutex<HashSet<String>>>, String);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.lock().expect("not poisoned").remove(&self.1);
    }
}

impl ReplicaService {
    pub fn new(pool: Arc<Pool>, data_dir: &Path) -> anyhow::Result<Self> {
        let file = RecordFile::new(data_dir, "replication");
        let pending = Arc::new(Mutex::new(file.load()?));
        Ok(Self { pool, file, pending, busy: Arc::default() })
    }

    /// Records (or, with `None`, forgets) `replica`'s unfinished transfer, durably.
    fn keep(&self, replica: &str, record: Option<PendingRecord>) -> Result<(), Status> {
        let mut list = self.pending.lock().expect("not poisoned");
        list.retain(|p| p.replica != replica);
        list.extend(record);
        self.file.save(&list).map_err(|e| Status::internal(format!("saving {}: {e}", self.file.path().display())))
    }

    fn claim(&self, replica: &str) -> Result<Busy, Status> {
        if !self.busy.lock().expect("not poisoned").insert(replica.to_owned()) {
            return Err(Status::aborted(format!("a transfer to replica {replica:?} is already in flight")));
        }
        Ok(Busy(Arc::clone(&self.busy), replica.to_owned()))
    }

    /// Makes what `t` applied durable and records where it resumes.
    async fn checkpoint(&self, t: Transfer, rec: &mut PendingRecord) -> Result<Transfer, Status> {
        let (t, at) = blocking(move || t.durable().map(|at| (t, at))).await?;
        rec.resume = at;
        self.keep(&rec.replica, Some(rec.clone()))?;
        Ok(t)
    }
}

#[tonic::async_trait]
impl replica_server::Replica for ReplicaService {
    async fn position(&self, req: Request<ReplicaPositionRequest>) -> Result<Response<ReplicaPosition>, Status> {
        let replica = req.into_inner().replica;
        let pool = Arc::clone(&self.pool);
        let name = replica.clone();
        // Snapshots come in creation order: the last is the newest mirror snapshot.
        let snaps = blocking(move || match pool.snapshots(Some(&name)) {
            Err(e) if e.kind() == ferrite_engine::ErrorKind::NotFound => Ok(Vec::new()),
            r => r,
        })
        .await?;
        let mut out = ReplicaPosition {
            snapshot: snaps.last().map(|s| s.name.clone()).unwrap_or_default(),
            ..Default::default()
        };
        if let Some(p) = self.pending.lock().expect("not poisoned").iter().find(|p| p.replica == replica) {
            (out.pending_snapshot, out.pending_base, out.resume_offset) =
                (p.snapshot.clone(), p.base.clone(), p.resume);
        }
        Ok(Response::new(out))
    }

    async fn push(&self, req: Request<Streaming<PushMessage>>) -> Result<Response<PushReply>, Status> {
        let mut stream = req.into_inner();
        let Some(Msg::Begin(b)) = stream.message().await?.and_then(|m| m.msg) else {
            return Err(Status::invalid_argument("a push starts with its begin message"));
        };
        if b.replica.is_empty() || b.snapshot.is_empty() {
            return Err(Status::invalid_argument("a push names its replica volume and the snapshot it brings"));
        }
        let _busy = self.claim(&b.replica)?;
        let mut rec =
            PendingRecord { replica: b.replica.clone(), snapshot: b.snapshot.clone(), base: b.base.clone(), resume: 0 };
        let resume = if b.resume {
            let list = self.pending.lock().expect("not poisoned");
            let found =
                list.iter().find(|p| p.replica == rec.replica && p.snapshot == rec.snapshot && p.base == rec.base);
            Some(found.map(|p| p.resume).ok_or_else(|| {
                Status::failed_precondition(format!(
                    "replica {:?} has no unfinished transfer of {:?} over {:?} to resume",
                    rec.replica, rec.snapshot, rec.base
                ))
            })?)
        } else {
            None
        };
        let restarted_first_sync = !b.resume
            && rec.base.is_empty()
            && self.pending.lock().expect("not poisoned").iter().any(|p| p.replica == rec.replica && p.base.is_empty());
        if restarted_first_sync {
            // The volume is what an abandoned first sync of ours left: start it afresh.
            let (pool, name) = (Arc::clone(&self.pool), rec.replica.clone());
            blocking(move || match pool.delete_volume(&name) {
                Err(e) if e.kind() == ferrite_engine::ErrorKind::NotFound => Ok(()),
                r => r,
            })
            .await?;
        }
        let (pool, r) = (Arc::clone(&self.pool), rec.clone());
        let mut t = blocking(move || {
            let base = (!r.base.is_empty()).then_some(r.base.as_str());
            Transfer::begin(&pool, &r.replica, base, &r.snapshot, b.size, b.end, resume)
        })
        .await?;
        rec.resume = t.next();
        self.keep(&rec.replica, Some(rec.clone()))?;
        let (mut received, mut since_checkpoint) = (0u64, 0u64);
        // Why the stream stopped short of its commit (None: the client ended it), if it did.
        let stopped: Option<Option<Status>> = loop {
            let piece = match stream.message().await {
                Ok(None) => break Some(None),
                Err(e) => break Some(Some(e)),
                Ok(Some(m)) => match m.msg {
                    Some(Msg::Data(d)) => Piece::Data { offset: d.offset, data: d.data, crcs: d.crcs },
                    Some(Msg::Zero(z)) => Piece::Zero { offset: z.offset, len: z.length },
                    Some(Msg::Commit(_)) => break None,
                    Some(Msg::Begin(_)) | None => {
                        break Some(Some(Status::invalid_argument("a push has one begin, then pieces, then a commit")));
                    }
                },
            };
            let bytes = if let Piece::Data { data, .. } = &piece { data.len() as u64 } else { 0 };
            let applied = tokio::task::spawn_blocking(move || {
                let r = t.apply(&piece);
                (t, r)
            })
            .await
            .map_err(|e| Status::internal(format!("engine task failed: {e}")))?;
            t = applied.0;
            if let Err(e) = applied.1 {
                break Some(Some(status(e)));
            }
            received += bytes;
            since_checkpoint += bytes;
            if since_checkpoint >= CHECKPOINT_BYTES {
                t = self.checkpoint(t, &mut rec).await?;
                since_checkpoint = 0;
            }
        };
        if let Some(why) = stopped {
            // Whatever ended it, what was applied is kept for a resume.
            self.checkpoint(t, &mut rec).await?;
            return Err(why.unwrap_or_else(|| {
                Status::aborted(format!(
                    "the push of {:?} ended before its commit; {} bytes applied, it resumes at byte {}",
                    rec.snapshot, received, rec.resume
                ))
            }));
        }
        let pool = Arc::clone(&self.pool);
        // An incomplete delta is refused here with nothing taken; it resumes from the last
        // recorded point.
        let snap = blocking(move || t.commit(&pool)).await?;
        self.keep(&rec.replica, None)?;
        tracing::info!(replica = %rec.replica, snapshot = %snap.name, bytes = received, "replica updated");
        Ok(Response::new(PushReply { snapshot: snap.name, data_bytes: received }))
    }
}

/// Data bytes per push piece.
const PIECE: usize = 1 << 20;

/// Prefix of the mirror snapshots this daemon takes of `volume`.
fn mirror_prefix(volume: &str) -> String {
    format!("{volume}.mirror.")
}

/// Sends `volume` to replica `replica` on the daemon at `peer`: finishes the replica's
/// unfinished transfer if it has one this pool can still serve, else takes a new mirror snapshot
/// and ships what changed since the replica's newest one. On success the previous mirror
/// snapshot here (the delta's base) is deleted: the new one is the common point now.
pub async fn push_to_peer(
    pool: Arc<Pool>,
    tls: Option<&TlsFiles>,
    volume: String,
    peer: String,
    replica: String,
) -> Result<PushReplicaResponse, Status> {
    let client_tls = match (peer.starts_with("tcp://"), tls) {
        (false, _) => None,
        (true, Some(TlsFiles { cert, key, client_ca: Some(ca) })) => Some(
            ferrite_proto::admin_tls(ca, Some((cert, key)))
                .map_err(|e| Status::failed_precondition(format!("TLS client identity for {peer}: {e}")))?,
        ),
        (true, _) => {
            return Err(Status::failed_precondition(format!(
                "pushing to {peer} needs tls-cert, tls-key and tls-client-ca (mutual TLS with the peer)"
            )));
        }
    };
    let channel = ferrite_proto::connect(&peer, client_tls)
        .await
        .map_err(|e| Status::unavailable(format!("connecting to peer {peer}: {e}")))?;
    let mut client = ReplicaClient::new(channel).max_decoding_message_size(MAX_PUSH_MESSAGE);
    let at_peer = |e: Status| Status::new(e.code(), format!("peer {peer}: {}", e.message()));
    let pos = client.position(ReplicaPositionRequest { replica: replica.clone() }).await.map_err(at_peer)?.into_inner();
    let has = |name: &str| -> bool { name.is_empty() || pool.snapshot_info(name).is_ok() };
    let prefix = mirror_prefix(&volume);
    let (to, base, from, resumed) = if !pos.pending_snapshot.is_empty()
        && pos.pending_snapshot.starts_with(&prefix)
        && has(&pos.pending_snapshot)
        && has(&pos.pending_base)
    {
        (pos.pending_snapshot, pos.pending_base, pos.resume_offset, true)
    } else {
        if !has(&pos.snapshot) {
            return Err(Status::failed_precondition(format!(
                "replica {replica:?} on {peer} is at snapshot {:?}, which volume {volume:?} does not have: it needs a resync",
                pos.snapshot
            )));
        }
        let millis = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let (p, v, name) = (Arc::clone(&pool), volume.clone(), format!("{prefix}{millis}"));
        blocking(move || p.create_snapshot(&v, &name)).await.map(|s| (s.name, pos.snapshot, 0, false))?
    };
    let (p, t, b) = (Arc::clone(&pool), to.clone(), base.clone());
    let delta = blocking(move || Delta::plan(&p, &t, Some(b.as_str()).filter(|b| !b.is_empty()))).await?;
    let begin = PushBegin {
        replica: replica.clone(),
        base: base.clone(),
        snapshot: to.clone(),
        size: delta.size,
        end: delta.end(),
        resume: resumed,
    };
    // The pieces are read on the blocking pool and flow through a short channel: at most a few
    // MiB are in memory whatever the delta's size.
    let (tx, rx) = tokio::sync::mpsc::channel::<PushMessage>(4);
    let reader = {
        let pool = Arc::clone(&pool);
        tokio::task::spawn_blocking(move || -> ferrite_engine::Result<()> {
            let send = |m: Msg| tx.blocking_send(PushMessage { msg: Some(m) }).is_ok();
            if !send(Msg::Begin(begin)) {
                return Ok(());
            }
            for piece in delta.pieces(&pool, from, PIECE)? {
                let m = match piece? {
                    Piece::Data { offset, data, crcs } => Msg::Data(PushData { offset, data, crcs }),
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
    reader.await.map_err(|e| Status::internal(format!("replica reader: {e}")))?.map_err(status)?;
    let reply = sent.map_err(at_peer)?.into_inner();
    if base.starts_with(&prefix) {
        let (p, b) = (Arc::clone(&pool), base.clone());
        if let Err(e) = blocking(move || p.delete_snapshot(&b)).await {
            tracing::warn!(snapshot = %base, error = %e.message(), "could not delete the previous mirror snapshot");
        }
    }
    tracing::info!(%volume, %peer, %replica, snapshot = %reply.snapshot, bytes = reply.data_bytes, resumed, "replica pushed");
    Ok(PushReplicaResponse { snapshot: reply.snapshot, base, data_bytes: reply.data_bytes, resumed })
}
