//! The receiving end: the `Replica` gRPC service on both admin listeners (so on TCP it sits
//! behind mutual TLS, the fence list and the connection limits). A push is one client stream
//! (begin, pieces, commit); `ferrite_replication::apply::Transfer` checks every piece and takes
//! the mirror snapshot only when the delta is complete. The resume point of an unfinished
//! transfer is made durable every [`CHECKPOINT_BYTES`] and whenever a stream ends early, so a cut
//! link or a restart of either daemon resumes, not restarts.

use std::sync::Arc;

use ferrite_engine::ErrorKind;
use ferrite_proto::ferrite::v1::push_message::Msg;
use ferrite_proto::ferrite::v1::{
    GroupCommitReply, GroupCommitRequest, PushBegin, PushMessage, PushReply, ReplicaPosition, ReplicaPositionRequest,
    ReplicaSyncReply, ReplicaSyncRequest, replica_server,
};
use ferrite_replication::Piece;
use ferrite_replication::apply::Transfer;
use tonic::{Request, Response, Status, Streaming};

use super::Replication;
use super::records::{PendingRecord, Relation, Role};
use crate::admin::{blocking, status};

/// Bytes applied between two durable resume points.
const CHECKPOINT_BYTES: u64 = 64 << 20;

/// The receiving end, shared by the admin listeners.
#[derive(Debug, Clone)]
pub struct ReplicaService(pub Arc<Replication>);

impl ReplicaService {
    /// Makes what `t` applied durable and records where it resumes.
    async fn checkpoint(&self, t: Transfer, rec: &mut PendingRecord) -> Result<Transfer, Status> {
        let (t, at) = blocking(move || t.durable().map(|at| (t, at))).await?;
        rec.resume = at;
        self.0.pending.put(rec.clone())?;
        Ok(t)
    }

    /// Whether this daemon takes pushes into `b.replica`: a secondary does (for a group member,
    /// the group's relation says), a volume that is not replicated here only as a first sync,
    /// which creates it: then the relation it gets.
    fn admit(&self, b: &PushBegin) -> Result<Option<Relation>, Status> {
        let key = if b.group.is_empty() { &b.replica } else { &b.group };
        match self.0.relations.get(key) {
            Some(r) if r.role == Role::Primary => Err(Status::failed_precondition(format!(
                "{key:?} is a primary on this daemon: both sides are primary (split-brain); demote one \
                 and resync it"
            ))),
            Some(mut r) => {
                // A promoted replica schedules as its primary did.
                if r.interval_secs != b.interval_secs {
                    r.interval_secs = b.interval_secs;
                    self.0.relations.put(r)?;
                }
                Ok(None)
            }
            None if !b.base.is_empty() => Err(Status::failed_precondition(format!(
                "volume {:?} is not a replica on this daemon: a push over a base needs one",
                b.replica
            ))),
            None if b.prefix.is_empty() => {
                Err(Status::invalid_argument("a first push names the prefix of its relation's mirror snapshots"))
            }
            None => Ok(Some(Relation {
                volume: key.clone(),
                role: Role::Secondary,
                peer: b.origin.clone(),
                remote: b.origin_volume.clone(),
                prefix: b.prefix.clone(),
                interval_secs: b.interval_secs,
                handover: false,
                synced: String::new(),
                group: !b.group.is_empty(),
                members: Vec::new(),
                snapshots: Vec::new(),
            })),
        }
    }

    /// After a commit: the replica's other mirror snapshots go (the new one is the common point),
    /// and the relation records it.
    async fn committed(&self, replica: &str, snapshot: &str) -> Result<(), Status> {
        let hub = &self.0;
        let Some(mut rel) = hub.relations.get(replica) else { return Ok(()) };
        rel.synced = snapshot.to_owned();
        // A demoted primary that takes a push was overtaken by its peer: its final delta is moot.
        rel.handover = false;
        hub.relations.put(rel.clone())?;
        hub.live(replica, |l| {
            l.resynced = true;
            l.error.clear();
        });
        super::send::prune(hub, &rel, snapshot).await;
        Ok(())
    }
}

#[tonic::async_trait]
impl replica_server::Replica for ReplicaService {
    async fn position(&self, req: Request<ReplicaPositionRequest>) -> Result<Response<ReplicaPosition>, Status> {
        let replica = req.into_inner().replica;
        let pool = Arc::clone(&self.0.pool);
        let name = replica.clone();
        let snaps = blocking(move || match pool.snapshots(Some(&name)) {
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(Vec::new()),
            r => r,
        })
        .await?;
        let mut out = ReplicaPosition { snapshots: snaps.into_iter().map(|s| s.name).collect(), ..Default::default() };
        if let Some(r) = self.0.relations.get(&replica) {
            out.role = r.role.as_str().into();
            out.handover = r.handover;
            out.synced = r.synced;
        }
        out.busy = self.0.incoming.lock().expect("not poisoned").contains_key(&replica);
        if let Some(p) = self.0.pending.get(&replica) {
            (out.pending_snapshot, out.pending_base, out.resume_offset) = (p.snapshot, p.base, p.resume);
        }
        Ok(Response::new(out))
    }

    async fn sync(&self, req: Request<ReplicaSyncRequest>) -> Result<Response<ReplicaSyncReply>, Status> {
        let volume = req.into_inner().volume;
        match self.0.relations.get(&volume) {
            Some(r) if r.role == Role::Primary => {
                self.0.sync_soon(&volume);
                Ok(Response::new(ReplicaSyncReply {}))
            }
            _ => Err(Status::failed_precondition(format!("volume {volume:?} is not a primary on this daemon"))),
        }
    }

    async fn group_commit(&self, req: Request<GroupCommitRequest>) -> Result<Response<GroupCommitReply>, Status> {
        let r = req.into_inner();
        let hub = &self.0;
        let mut rel = hub
            .relations
            .get(&r.group)
            .filter(|x| x.group && x.role == Role::Secondary)
            .ok_or_else(|| Status::failed_precondition(format!("{:?} is not a replicated group here", r.group)))?;
        let (pool, point, members) = (Arc::clone(&hub.pool), r.point.clone(), r.members.clone());
        blocking(move || {
            for m in &members {
                let name = format!("{point}.{m}");
                if !pool.snapshot_info(&name).is_ok_and(|s| s.volume.as_deref() == Some(m)) {
                    return Err(ferrite_engine::Error::new(
                        ErrorKind::NotFound,
                        format!("member {m:?} does not hold group mirror point {point:?}"),
                    ));
                }
            }
            Ok(())
        })
        .await?;
        rel.synced.clone_from(&r.point);
        rel.members = r.members;
        rel.handover = false;
        hub.relations.put(rel.clone())?;
        hub.live(&r.group, |l| {
            l.resynced = true;
            l.error.clear();
        });
        super::send::prune(hub, &rel, &r.point).await;
        tracing::info!(group = %r.group, point = %r.point, "replica group at a new point");
        Ok(Response::new(GroupCommitReply {}))
    }

    async fn push(&self, req: Request<Streaming<PushMessage>>) -> Result<Response<PushReply>, Status> {
        // In a task of its own: when the connection dies (a cut link found by keepalive) the
        // server drops this call, but the receive goes on to see its stream end and record its
        // resume point.
        let this = self.clone();
        tokio::spawn(async move { this.receive(req.into_inner()).await })
            .await
            .map_err(|e| Status::internal(format!("replica receive task: {e}")))?
            .map(Response::new)
    }
}

impl ReplicaService {
    /// One push, from its begin to its commit or early end.
    async fn receive(&self, mut stream: Streaming<PushMessage>) -> Result<PushReply, Status> {
        let hub = &self.0;
        let Some(Msg::Begin(b)) = stream.message().await?.and_then(|m| m.msg) else {
            return Err(Status::invalid_argument("a push starts with its begin message"));
        };
        if b.replica.is_empty() || b.snapshot.is_empty() {
            return Err(Status::invalid_argument("a push names its replica volume and the snapshot it brings"));
        }
        let incoming = hub.claim_incoming(&b.replica)?;
        let new_relation = self.admit(&b)?;
        let mut rec =
            PendingRecord { replica: b.replica.clone(), snapshot: b.snapshot.clone(), base: b.base.clone(), resume: 0 };
        let pending = hub.pending.get(&rec.replica);
        let resume = if b.resume {
            let found = pending.as_ref().filter(|p| p.snapshot == rec.snapshot && p.base == rec.base);
            Some(found.map(|p| p.resume).ok_or_else(|| {
                Status::failed_precondition(format!(
                    "replica {:?} has no unfinished transfer of {:?} over {:?} to resume",
                    rec.replica, rec.snapshot, rec.base
                ))
            })?)
        } else {
            None
        };
        if !b.resume && rec.base.is_empty() && pending.is_some_and(|p| p.base.is_empty()) {
            // The volume is what an abandoned first sync of ours left: start it afresh.
            let (pool, name) = (Arc::clone(&hub.pool), rec.replica.clone());
            blocking(move || match pool.delete_volume(&name) {
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
                r => r,
            })
            .await?;
        }
        let (pool, r) = (Arc::clone(&hub.pool), rec.clone());
        let mut t = blocking(move || {
            let base = (!r.base.is_empty()).then_some(r.base.as_str());
            Transfer::begin(&pool, &r.replica, base, &r.snapshot, b.size, b.end, resume)
        })
        .await?;
        if let Some(r) = new_relation {
            hub.relations.put(r)?;
        }
        rec.resume = t.next();
        hub.pending.put(rec.clone())?;
        let (mut received, mut since_checkpoint) = (0u64, 0u64);
        // Why the stream stopped short of its commit (None: the client ended it), if it did.
        let stopped: Option<Option<Status>> = loop {
            let next = tokio::select! {
                m = stream.message() => m,
                () = incoming.cancelled.notified() => {
                    break Some(Some(Status::aborted(format!("replica {:?} was promoted or disabled", rec.replica))));
                }
            };
            let piece = match next {
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
        let pool = Arc::clone(&hub.pool);
        // An incomplete delta is refused here with nothing taken; it resumes from the last
        // recorded point.
        let snap = blocking(move || t.commit(&pool)).await?;
        hub.pending.set(&rec.replica, None)?;
        self.committed(&rec.replica, &snap.name).await?;
        tracing::info!(replica = %rec.replica, snapshot = %snap.name, bytes = received, "replica updated");
        Ok(PushReply { snapshot: snap.name, data_bytes: received })
    }
}
