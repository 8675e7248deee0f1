//! The receiving end: the calls of the `Replica` service on both admin listeners (so on TCP it
//! sits behind mutual TLS, the fence list and the connection limits; its gRPC face is
//! `api/replica.rs`). A push is one client stream
//! (begin, pieces, commit); `ferrite_replication::apply::Transfer` checks every piece and takes
//! the mirror snapshot only when the delta is complete. The resume point of an unfinished
//! transfer is made durable every [`CHECKPOINT_BYTES`] and whenever a stream ends early, so a cut
//! link or a restart of either daemon resumes, not restarts.

use std::sync::Arc;

use ferrite_engine::ErrorKind;
use ferrite_proto::ferrite::v1::push_message::Msg;
use ferrite_proto::ferrite::v1::{
    GroupCommitReply, GroupCommitRequest, PushMessage, PushReply, ReplicaPosition, ReplicaSyncReply, ReplicaSyncRequest,
};
use ferrite_replication::Piece;
use ferrite_replication::apply::Transfer;
use tokio_stream::{Stream, StreamExt};

use super::Replication;
use super::admit::{self, check_epoch_bound, check_name, check_not_stale};
use super::records::{PendingRecord, Relation, Role};
use crate::authz::Caller;
use crate::base::error::{Error, Kind, blocking};
use crate::records::keys::MAX_WRAPPED_KEY;

/// Older data keys a push may name: one per data-key rotation its snapshots span.
const MAX_OLDER_KEYS: usize = 64;

/// Bytes applied between two durable resume points.
const CHECKPOINT_BYTES: u64 = 64 << 20;

/// A push's messages as they arrive.
pub type PushStream = std::pin::Pin<Box<dyn Stream<Item = Result<PushMessage, Error>> + Send>>;

/// The receiving end, shared by the admin listeners.
#[derive(Debug, Clone)]
pub struct ReplicaService(pub Arc<Replication>);

impl ReplicaService {
    /// Makes what `t` applied durable and records where it resumes.
    async fn checkpoint(&self, t: Transfer, rec: &mut PendingRecord) -> Result<Transfer, Error> {
        let (t, at) = blocking(move || t.durable().map(|at| (t, at))).await?;
        rec.resume = at;
        self.0.pending.put(rec.clone())?;
        Ok(t)
    }

    /// A transfer whose commit landed before the daemon could record it (a crash between the
    /// two): the snapshot it brought is there, so it is recorded now rather than resumed (which
    /// would be refused for ever, the snapshot being held already).
    async fn settle(&self, replica: &str) -> Result<(), Error> {
        let hub = &self.0;
        let Some(p) = hub.pending.get(replica) else { return Ok(()) };
        let (pool, snap) = (Arc::clone(&hub.pool), p.snapshot.clone());
        let landed = blocking(move || Ok(pool.snapshot_info(&snap).ok())).await?;
        if landed.is_none_or(|s| s.volume.as_deref() != Some(replica)) {
            return Ok(());
        }
        hub.pending.set(replica, None)?;
        tracing::info!(%replica, snapshot = %p.snapshot, "an unrecorded commit had landed: recorded now");
        if hub.relations.get(replica).is_some_and(|r| !r.group) {
            self.committed(replica, &p.snapshot).await?;
        }
        Ok(())
    }

    /// After a commit: the replica's other mirror snapshots go (the new one is the common point),
    /// and the relation records it.
    async fn committed(&self, replica: &str, snapshot: &str) -> Result<(), Error> {
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
        super::send::prune(hub, &rel, &[snapshot]).await;
        Ok(())
    }
}

/// The calls of the `Replica` service.
impl ReplicaService {
    /// Where `replica` stands here, for `caller`.
    pub async fn position(&self, caller: &Caller, replica: String) -> Result<ReplicaPosition, Error> {
        let rel = admit::relation_of(&self.0, &replica);
        match &rel {
            Some(r) => admit::check_peer(&self.0, caller, "/ferrite.v1.Replica/Position", r)?,
            // What is not replicated here is nobody's business but an operator's, unless it
            // does not exist (a first sync asks before it makes it).
            None if !caller.is_operator() && self.0.pool.volume_info(&replica).is_ok() => {
                return Err(self
                    .0
                    .policy
                    .refuse(
                        caller,
                        "/ferrite.v1.Replica/Position",
                        &format!("volume {replica:?} is not replicated with it"),
                    )
                    .into());
            }
            None => {}
        }
        let busy = self.0.incoming.lock().expect("not poisoned").contains_key(&replica);
        if !busy {
            self.settle(&replica).await?;
        }
        let pool = Arc::clone(&self.0.pool);
        let name = replica.clone();
        let snaps = blocking(move || match pool.snapshots(Some(&name)) {
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(Vec::new()),
            r => r,
        })
        .await?;
        let mut out =
            ReplicaPosition { snapshots: snaps.into_iter().map(|s| s.name).collect(), busy, ..Default::default() };
        if let Some(r) = rel {
            out.role = r.role.as_str().into();
            out.handover = r.handover;
            out.synced = r.synced;
            out.epoch = r.epoch;
        }
        if let Some(p) = self.0.pending.get(&replica) {
            (out.pending_snapshot, out.pending_base, out.resume_offset) = (p.snapshot, p.base, p.resume);
        }
        Ok(out)
    }

    /// The secondary at `caller` asks this primary to push now.
    pub fn sync(&self, caller: &Caller, r: ReplicaSyncRequest) -> Result<ReplicaSyncReply, Error> {
        let ReplicaSyncRequest { volume, epoch } = r;
        check_epoch_bound(epoch)?;
        match self.0.relations.get(&volume) {
            Some(r) if r.role == Role::Primary => {
                admit::check_peer(&self.0, caller, "/ferrite.v1.Replica/Sync", &r)?;
                self.0.resync_requested(&volume, epoch);
                Ok(ReplicaSyncReply {})
            }
            _ => Err(Error::refused(format!("volume {volume:?} is not a primary on this daemon"))),
        }
    }

    /// `caller` says every member of a group holds its new point.
    pub async fn group_commit(&self, caller: &Caller, r: GroupCommitRequest) -> Result<GroupCommitReply, Error> {
        let hub = &self.0;
        check_name("group", &r.group)?;
        check_epoch_bound(r.epoch)?;
        let lock = hub.op_lock(&r.group);
        let _g = lock.lock().await;
        let mut rel = hub
            .relations
            .get(&r.group)
            .filter(|x| x.group && x.role == Role::Secondary)
            .ok_or_else(|| Error::refused(format!("{:?} is not a replicated group here", r.group)))?;
        admit::check_peer(&self.0, caller, "/ferrite.v1.Replica/GroupCommit", &rel)?;
        check_not_stale("group commit", &r.group, r.epoch, rel.epoch)?;
        if let Some(m) = r.members.iter().find(|m| !rel.members.contains(m)) {
            let why = format!("volume {m:?} is not a member of replicated group {:?} here", r.group);
            return Err(hub.policy.refuse(caller, "/ferrite.v1.Replica/GroupCommit", &why).into());
        }
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
        rel.handover = false;
        rel.epoch = r.epoch;
        hub.relations.put(rel.clone())?;
        hub.live(&r.group, |l| {
            l.resynced = true;
            l.error.clear();
        });
        super::send::prune(hub, &Relation { members: r.members.clone(), ..rel }, &[&r.point]).await;
        tracing::info!(group = %r.group, point = %r.point, "replica group at a new point");
        Ok(GroupCommitReply {})
    }

    /// A push from `caller`, from its begin to its commit or early end.
    pub async fn push(&self, caller: Caller, stream: PushStream) -> Result<PushReply, Error> {
        // In a task of its own: when the connection dies (a cut link found by keepalive) the
        // server drops this call, but the receive goes on to see its stream end and record its
        // resume point.
        let this = self.clone();
        tokio::spawn(async move { this.receive(&caller, stream).await })
            .await
            .map_err(|e| Error::internal(format!("replica receive task: {e}")))?
    }
}

impl ReplicaService {
    /// The next message of a push, or DeadlineExceeded when the sender is silent too long.
    async fn next(&self, stream: &mut PushStream) -> Result<Option<PushMessage>, Error> {
        let idle = self.0.idle_timeout;
        tokio::time::timeout(idle, stream.next()).await.map(Option::transpose).unwrap_or_else(|_| {
            Err(Error::new(Kind::TimedOut, format!("the push sent nothing for {} s", idle.as_secs())))
        })
    }

    /// One push, from its begin to its commit or early end.
    async fn receive(&self, caller: &Caller, mut stream: PushStream) -> Result<PushReply, Error> {
        let hub = &self.0;
        let Some(Msg::Begin(b)) = self.next(&mut stream).await?.and_then(|m| m.msg) else {
            return Err(Error::invalid("a push starts with its begin message"));
        };
        admit::check_begin(&self.0, &b)?;
        let incoming = hub.claim_incoming(&b.replica)?;
        // Promote, disable and resync of the relation wait for this push, and it for them.
        let lock = hub.op_lock(if b.group.is_empty() { &b.replica } else { &b.group });
        let _g = tokio::select! {
            g = lock.lock() => g,
            () = incoming.cancelled.notified() => {
                return Err(Error::busy(format!("replica {:?} was promoted or disabled", b.replica)));
            }
        };
        let new_relation = admit::admit(&self.0, caller, &b)?;
        self.settle(&b.replica).await?;
        let mut rec =
            PendingRecord { replica: b.replica.clone(), snapshot: b.snapshot.clone(), base: b.base.clone(), resume: 0 };
        let pending = hub.pending.get(&rec.replica);
        let resume = if b.resume {
            let found = pending.as_ref().filter(|p| p.snapshot == rec.snapshot && p.base == rec.base);
            Some(found.map(|p| p.resume).ok_or_else(|| {
                Error::refused(format!(
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
        let (pool, r, size, end) = (Arc::clone(&hub.pool), rec.clone(), b.size, b.end);
        if b.older_keys.len() > MAX_OLDER_KEYS
            || b.older_keys.iter().chain([&b.wrapped_key]).any(|k| k.len() > MAX_WRAPPED_KEY)
        {
            return Err(Error::invalid(format!(
                "a push carries at most {MAX_OLDER_KEYS} older keys, each wrapped key at most {MAX_WRAPPED_KEY} bytes"
            )));
        }
        let keys: Vec<Vec<u8>> = std::iter::once(b.wrapped_key.clone()).chain(b.older_keys.clone()).collect();
        let mut t = blocking(move || {
            let base = (!r.base.is_empty()).then_some(r.base.as_str());
            let keys = (!keys[0].is_empty()).then_some(keys.as_slice());
            Transfer::begin(&pool, &r.replica, base, &r.snapshot, size, end, resume, keys)
        })
        .await?;
        if let Some(r) = new_relation {
            hub.relations.put(r)?;
        }
        // A group's members here are the volumes its pushes made: only those take its pushes.
        if let Some(mut g) = hub.relations.get(&b.group).filter(|g| g.group && !g.members.contains(&b.replica)) {
            g.members.push(b.replica.clone());
            hub.relations.put(g)?;
        }
        rec.resume = t.next();
        hub.pending.put(rec.clone())?;
        let (mut received, mut since_checkpoint) = (0u64, 0u64);
        // Why the stream stopped short of its commit (None: the client ended it), if it did.
        let stopped: Option<Option<Error>> = loop {
            let next = tokio::select! {
                m = self.next(&mut stream) => m,
                () = incoming.cancelled.notified() => {
                    break Some(Some(Error::busy(format!("replica {:?} was promoted or disabled", rec.replica))));
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
                        break Some(Some(Error::invalid("a push has one begin, then pieces, then a commit")));
                    }
                },
            };
            let bytes = if let Piece::Data { data, .. } = &piece { data.len() as u64 } else { 0 };
            let applied = tokio::task::spawn_blocking(move || {
                let r = t.apply(&piece);
                (t, r)
            })
            .await
            .map_err(|e| Error::internal(format!("engine task failed: {e}")))?;
            t = applied.0;
            if let Err(e) = applied.1 {
                break Some(Some(Error::from(e)));
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
                Error::busy(format!(
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
