//! The primary's side of marks and rebuilds. A mark is a snapshot the primary and its members
//! take at one point of the write stream (`Primary::mark`); a member that comes back after an
//! ejection, a reboot or an upgrade — or a primary that was failed over and stepped down — is
//! rebuilt from the newest mark both hold: its stream, opened for the rebuild at a point the
//! primary snapshots under a pause, rolls it back to that mark and carries every write from then
//! on, while the changed ranges between the mark and the point (`ferrite_replication::delta`,
//! no media I/O to find them) cross on a `Rebuild` call, paced by `replication-bandwidth`. Once
//! they are all there a new mark is taken with every member and the member is recorded in sync.
//! A member without a common mark (new, wiped) gets the allocated blocks of the point only.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferrite_proto::ferrite::v1::{PushData, PushZero, RebuildBegin, RebuildEnd, RebuildMessage, rebuild_message};
use ferrite_replication::Piece;
use ferrite_replication::delta::Delta;

use super::link::Link;
use super::records::State;
use super::{Primary, SyncHub};
use crate::base::error::blocking;
use crate::base::rpc::at_peer;

/// Data bytes per rebuild piece.
const PIECE: usize = 1 << 20;

impl SyncHub {
    /// Runs for the daemon's life: every second, a primary taking writes takes a mark when one
    /// is due (it took requests since the last, `sync-mark-interval-ms` ago), and starts the
    /// rebuild of an ejected member that answers again (one rebuild per volume at a time).
    pub async fn tend(self: Arc<Self>) {
        let mut marked: HashMap<String, (Instant, u64)> = HashMap::new();
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            for p in self.primaries_refusing(false) {
                let requests = p.added.count();
                let due = marked
                    .get(&p.volume)
                    .is_none_or(|&(at, seen)| seen != requests && at.elapsed() >= self.mark_interval);
                if due && requests > 0 && p.progress.lock().expect("not poisoned").is_none() {
                    marked.insert(p.volume.clone(), (Instant::now(), requests));
                    if let Err(e) = self.mark_and_prune(&p).await {
                        tracing::warn!(volume = %p.volume, error = %e, "mark not taken");
                    }
                }
                if p.progress.lock().expect("not poisoned").is_some() {
                    continue;
                }
                let ejected: Vec<String> = p
                    .record()
                    .members
                    .iter()
                    .filter(|m| m.state == State::Ejected)
                    .map(|m| m.endpoint.clone())
                    .collect();
                for member in ejected {
                    if self.held_at(&member, &p.volume).await.is_err() {
                        continue;
                    }
                    *p.progress.lock().expect("not poisoned") = Some((member.clone(), Arc::default(), 0));
                    let (hub, p) = (Arc::clone(&self), Arc::clone(&p));
                    tokio::spawn(async move {
                        match hub.rebuild(&p, &member).await {
                            Ok(bytes) => tracing::info!(volume = %p.volume, %member, bytes, "member rebuilt: in sync"),
                            Err(e) => {
                                tracing::warn!(volume = %p.volume, %member, error = %e, "rebuild failed");
                                let _ = p.eject(&member, &format!("rebuild failed: {e}")).await;
                            }
                        }
                        *p.progress.lock().expect("not poisoned") = None;
                    });
                    break;
                }
            }
        }
    }

    /// A mark with every member, then the primary's marks no member needs go (the newest stays).
    async fn mark_and_prune(&self, p: &Arc<Primary>) -> Result<String, String> {
        let (pool, pp) = (Arc::clone(&self.pool), Arc::clone(p));
        let name = tokio::task::spawn_blocking(move || pp.mark(&pool)).await.map_err(|e| e.to_string())??;
        let needed: Vec<String> = p.record().members.iter().map(|m| m.mark.clone()).collect();
        for old in self.marks(&p.volume).await {
            if old != name && !needed.contains(&old) {
                let (pool, old) = (Arc::clone(&self.pool), old.clone());
                if let Err(e) = blocking(move || pool.delete_snapshot(&old)).await {
                    tracing::warn!(volume = %p.volume, error = %e.message(), "could not drop a mark");
                }
            }
        }
        Ok(name)
    }

    /// Records `member` in `state` (with `mark`, if given) on a majority.
    async fn set_state(
        self: &Arc<Self>,
        p: &Arc<Primary>,
        member: &str,
        state: State,
        mark: Option<&str>,
    ) -> Result<(), String> {
        let _c = p.change.lock().await;
        let old = p.record();
        let mut next = old.clone();
        let m = next.member_mut(member).ok_or_else(|| format!("{member} is no member"))?;
        m.state = state;
        m.reason.clear();
        if let Some(mark) = mark {
            mark.clone_into(&mut m.mark);
        }
        next.generation = self.next_generation(&old)?;
        self.propose(&old, &next).await?;
        p.adopt(next);
        Ok(())
    }

    /// Rebuilds `member` of `p`'s volume: the data bytes that crossed.
    async fn rebuild(self: &Arc<Self>, p: &Arc<Primary>, member: &str) -> Result<u64, String> {
        let volume = p.volume.clone();
        let theirs = self.get_at(member, &volume).await?.marks;
        let base = self.marks(&volume).await.into_iter().rev().find(|m| theirs.contains(m));
        tracing::info!(volume, member, base = base.as_deref().unwrap_or("none: a full copy"), "rebuilding a member");
        self.set_state(p, member, State::Rebuilding, None).await?;
        // The point the pieces come from, and the member's stream from that point on.
        let point = format!("{volume}.rebuild.{}", crate::replica::now_ms());
        let opened = {
            let _hold = p.hold().await;
            let (pool, v, n) = (Arc::clone(&self.pool), volume.clone(), point.clone());
            blocking(move || pool.create_snapshot(&v, &n).map(drop)).await.map_err(|e| e.message().to_owned())?;
            let generation = p.record().generation;
            let base = Some(base.as_deref().unwrap_or_default());
            let open = Link::open(self.tls.as_ref(), member, &volume, generation, base, self.timeout);
            match tokio::time::timeout(self.timeout * 4, open).await {
                Ok(Ok(link)) => {
                    p.add_link(link);
                    Ok(())
                }
                Ok(Err(e)) => Err(e.message().to_owned()),
                Err(_) => Err(format!("{member} did not open its stream in time")),
            }
        };
        let sent = match opened {
            Ok(()) => self.send_pieces(p, member, &point, base.as_deref()).await,
            Err(e) => Err(e),
        };
        let (pool, n) = (Arc::clone(&self.pool), point.clone());
        let _ = blocking(move || pool.delete_snapshot(&n)).await;
        let sent = sent?;
        p.rebuilt(member);
        let mark = self.mark_and_prune(p).await?;
        self.set_state(p, member, State::InSync, Some(&mark)).await?;
        Ok(sent)
    }

    /// Sends what changed between `base` and `point` to `member`, paced; the data bytes sent.
    async fn send_pieces(
        &self,
        p: &Arc<Primary>,
        member: &str,
        point: &str,
        base: Option<&str>,
    ) -> Result<u64, String> {
        let (pool, to, from) = (Arc::clone(&self.pool), point.to_owned(), base.map(str::to_owned));
        let delta =
            blocking(move || Delta::plan(&pool, &to, from.as_deref())).await.map_err(|e| e.message().to_owned())?;
        let done = Arc::new(AtomicU64::new(0));
        *p.progress.lock().expect("not poisoned") = Some((member.to_owned(), Arc::clone(&done), delta.data_bytes()));
        let generation = p.record().generation;
        let (tx, rx) = tokio::sync::mpsc::channel::<RebuildMessage>(4);
        let begin = RebuildBegin { volume: p.volume.clone(), generation, end: delta.end() };
        tx.send(RebuildMessage { msg: Some(rebuild_message::Msg::Begin(begin)) }).await.map_err(|e| e.to_string())?;
        let (pool, limiter, primary) = (Arc::clone(&self.pool), self.limiter(member), Arc::clone(p));
        let reader = tokio::task::spawn_blocking(move || -> Result<(), String> {
            for piece in delta.pieces(&pool, 0, PIECE).map_err(|e| e.to_string())? {
                let msg = match piece.map_err(|e| e.to_string())? {
                    Piece::Data { offset, data, crcs } => {
                        limiter.take(data.len() as u64);
                        done.fetch_add(data.len() as u64, Ordering::Relaxed);
                        primary.rebuilt_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
                        rebuild_message::Msg::Data(PushData { offset, data, crcs })
                    }
                    Piece::Zero { offset, len } => rebuild_message::Msg::Zero(PushZero { offset, length: len }),
                };
                if tx.blocking_send(RebuildMessage { msg: Some(msg) }).is_err() {
                    return Err("the rebuild call ended".into());
                }
            }
            let _ = tx.blocking_send(RebuildMessage { msg: Some(rebuild_message::Msg::End(RebuildEnd {})) });
            Ok(())
        });
        let mut c = self.client(member).await.map_err(|e| e.message().to_owned())?;
        let r = c.rebuild(tokio_stream::wrappers::ReceiverStream::new(rx)).await.map_err(at_peer(member));
        let read = reader.await.map_err(|e| e.to_string())?;
        let reply = r.map_err(|e| e.message().to_owned())?.into_inner();
        read?;
        Ok(reply.data_bytes)
    }

    fn limiter(&self, member: &str) -> Arc<crate::replica::Limiter> {
        self.limiters.get(member, || crate::replica::Limiter::new(self.bandwidth))
    }
}
