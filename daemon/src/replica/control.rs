//! The replication state machine of a volume, as the CSI-Addons spec has it, and the scheduler.
//!
//! - enable: a primary relation; the scheduler pushes every interval.
//! - demote: the volume becomes read-only (the write gate waits for writes in flight), the
//!   relation a secondary with a pending handover, and the final delta goes to the peer (retried
//!   by the scheduler until it arrives).
//! - promote: writable again, at the newest complete mirror snapshot (an unfinished incoming
//!   transfer is cancelled and dropped). Without force only when the peer is demoted, its final
//!   delta has arrived, and this side holds the peer's newest mirror snapshot: nothing is lost.
//! - resync (a secondary): drops a pending handover and asks the primary to push now; the push
//!   rolls this side back to the newest mirror snapshot both hold and applies the primary's delta,
//!   so only what differs crosses and local divergence (split-brain) is discarded.
//! - disable: the relation goes; a secondary becomes an independent volume at its newest complete
//!   mirror snapshot. Mirror snapshots go with the relation.
//!
//! Every change of a volume's relation, and every push of it, holds the volume's op lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrite_proto::ferrite::v1 as pb;

use super::records::{Relation, Role};
use super::send::{connect, group_points, position, prune, push, push_group};
use super::{Replication, load, now_ms};
use crate::base::error::{Error, blocking};
use crate::base::rpc::at_peer;

/// How often a demoted volume retries its final delta when it has no interval of its own.
const HANDOVER_RETRY: Duration = Duration::from_secs(10);
/// A failed push is retried after this, doubled per consecutive failure up to the interval: a
/// peer that was briefly away (a restart, a rotated certificate) does not cost a whole interval.
const FAILED_RETRY: Duration = Duration::from_secs(5);

/// How often the scheduler pushes a relation, if it does.
fn period(rel: &Relation) -> Option<Duration> {
    match rel.role {
        Role::Primary if rel.interval_secs > 0 => Some(Duration::from_secs(rel.interval_secs)),
        Role::Secondary if rel.handover => Some(Duration::from_secs(rel.interval_secs).max(HANDOVER_RETRY)),
        _ => None,
    }
}

/// When to retry after the `failing`-th consecutive failure (1-based), no later than `every`.
fn retry_after(failing: u32, every: Duration) -> Duration {
    FAILED_RETRY.saturating_mul(1 << failing.saturating_sub(1).min(16)).min(every)
}

fn not_replicated(volume: &str) -> Error {
    Error::not_found(format!("volume {volume:?} is not replicated on this daemon"))
}

impl Replication {
    fn relation(&self, volume: &str) -> Result<Relation, Error> {
        self.relations.get(volume).ok_or_else(|| not_replicated(volume))
    }

    /// The newest complete point of this relation here: a volume's newest mirror snapshot; a
    /// group's last point every member reached (or, demoted with its final delta not landed,
    /// its newest group snapshot, taken read-only).
    async fn newest_point(&self, rel: &Relation) -> Result<Option<String>, Error> {
        match (rel.group, rel.handover) {
            (false, _) => {
                let (pool, name) = (Arc::clone(&self.pool), rel.volume.clone());
                let snaps = blocking(move || pool.snapshots(Some(&name))).await?;
                Ok(snaps.into_iter().rev().map(|s| s.name).find(|n| n.starts_with(&rel.prefix)))
            }
            (true, false) => Ok(Some(rel.synced.clone()).filter(|s| !s.is_empty())),
            (true, true) => Ok(group_points(self, rel).await?.pop().map(|g| g.name)),
        }
    }

    /// The volumes a relation covers here: its volume, or its group's members.
    async fn volumes_of(&self, rel: &Relation) -> Result<Vec<String>, Error> {
        if !rel.group {
            return Ok(vec![rel.volume.clone()]);
        }
        let (pool, g) = (Arc::clone(&self.pool), rel.volume.clone());
        let now = blocking(move || Ok(pool.groups().into_iter().find(|x| x.name == g).map(|x| x.volumes))).await?;
        Ok(now.unwrap_or_else(|| rel.members.clone()))
    }

    /// Ends the pushes coming into the relation's volumes, if any.
    async fn cancel_incoming_of(&self, volume: &str) -> Result<(), Error> {
        let Some(rel) = self.relations.get(volume) else { return Ok(()) };
        for v in self.volumes_of(&rel).await? {
            self.cancel_incoming(&v).await;
        }
        Ok(())
    }

    /// Makes the relation's volumes read-only for clients, or writable.
    async fn set_read_only(&self, rel: &Relation, read_only: bool) -> Result<(), Error> {
        let (pool, volumes) = (Arc::clone(&self.pool), self.volumes_of(rel).await?);
        blocking(move || volumes.iter().try_for_each(|v| pool.set_read_only(v, read_only).map(drop))).await
    }

    /// The status of a replicated volume.
    pub fn status_of(&self, rel: &Relation) -> pb::Replication {
        let live = self.live(&rel.volume, |l| l.clone());
        let taken = rel.taken_ms(&rel.synced).unwrap_or(0);
        let (done, total, rate) = live.running.as_ref().map_or((0, 0, 0), |p| {
            let done = load(&p.done);
            let ms = u64::try_from(p.started.elapsed().as_millis()).unwrap_or(u64::MAX).max(1);
            (done, load(&p.total), done.saturating_mul(1000) / ms)
        });
        let state = match (&live.running, live.error.is_empty()) {
            (Some(_), _) => "syncing",
            (None, true) => "idle",
            (None, false) => "error",
        };
        pb::Replication {
            volume: rel.volume.clone(),
            role: rel.role.as_str().into(),
            peer: rel.peer.clone(),
            remote: rel.remote.clone(),
            interval_secs: rel.interval_secs,
            state: state.into(),
            error: live.error,
            last_snapshot: rel.synced.clone(),
            last_snapshot_unix_ms: taken,
            last_sync_seconds: live.last_secs,
            last_sync_bytes: live.last_bytes,
            lag_seconds: if taken == 0 { 0.0 } else { now_ms().saturating_sub(taken) as f64 / 1000.0 },
            bytes_done: done,
            bytes_left: total.saturating_sub(done),
            bytes_per_second: rate,
            handover: rel.handover,
            resynced: live.resynced,
            group: rel.group,
            members: rel.members.clone(),
            snapshots: rel.snapshots.clone(),
        }
    }

    /// Every replicated volume, or one.
    pub fn list(&self, volume: &str) -> Result<Vec<pb::Replication>, Error> {
        if !volume.is_empty() {
            return Ok(vec![self.status_of(&self.relation(volume)?)]);
        }
        let mut all: Vec<_> = self.relations.all().iter().map(|r| self.status_of(r)).collect();
        all.sort_by(|a, b| a.volume.cmp(&b.volume));
        Ok(all)
    }

    /// Starts replicating `volume` to `remote` on `peer`; enabling it again changes the interval.
    pub async fn enable(
        &self,
        volume: &str,
        peer: &str,
        remote: &str,
        interval_secs: u64,
        group: bool,
        snapshots: Vec<String>,
    ) -> Result<pb::Replication, Error> {
        if peer.is_empty() {
            return Err(Error::invalid("replication needs the peer daemon's admin endpoint"));
        }
        if interval_secs > super::MAX_INTERVAL_SECS {
            return Err(Error::invalid(format!(
                "interval {interval_secs} s: at most a week (604800 s), or 0 for on request only"
            )));
        }
        let lock = self.op_lock(volume);
        let _g = lock.lock().await;
        let (pool, v) = (Arc::clone(&self.pool), volume.to_owned());
        let members = blocking(move || match group {
            false => pool.volume_info(&v).map(|_| Vec::new()),
            true => pool.groups().into_iter().find(|g| g.name == v).map(|g| g.volumes).ok_or_else(|| {
                ferrite_engine::Error::new(ferrite_engine::ErrorKind::NotFound, format!("group {v:?} not found"))
            }),
        })
        .await?;
        let remote = if remote.is_empty() { volume } else { remote };
        let rel = match self.relations.get(volume) {
            Some(r) if r.role == Role::Secondary => {
                return Err(Error::refused(format!(
                    "volume {volume:?} is a secondary of {:?} on {}: promote it to replicate it elsewhere",
                    r.remote, r.peer
                )));
            }
            Some(r) if r.peer != peer || r.remote != remote || r.group != group => {
                return Err(Error::already_exists(format!(
                    "volume {volume:?} already replicates to {:?} on {}: disable that first",
                    r.remote, r.peer
                )));
            }
            Some(r) => Relation { interval_secs, snapshots, ..r },
            None => Relation {
                volume: volume.to_owned(),
                role: Role::Primary,
                peer: peer.to_owned(),
                remote: remote.to_owned(),
                prefix: format!("{volume}.mirror."),
                interval_secs,
                handover: false,
                synced: String::new(),
                group,
                members,
                snapshots,
                epoch: 0,
            },
        };
        self.relations.put(rel.clone())?;
        self.live(volume, |l| l.next_at = None);
        self.wake.notify_one();
        tracing::info!(%volume, %peer, %remote, interval_secs, "replication enabled");
        Ok(self.status_of(&rel))
    }

    /// Stops replicating `volume`; a secondary becomes writable at its newest complete mirror
    /// snapshot.
    pub async fn disable(&self, volume: &str) -> Result<pb::Replication, Error> {
        let lock = self.op_lock(volume);
        self.cancel_incoming_of(volume).await?;
        let _g = lock.lock().await;
        let rel = self.relation(volume)?;
        let volumes = self.volumes_of(&rel).await?;
        for v in &volumes {
            self.cancel_incoming(v).await;
            self.pending.set(v, None)?;
        }
        if rel.role == Role::Secondary {
            let at = self.newest_point(&rel).await?;
            self.writable_at(&rel, &volumes, at).await?;
        }
        prune(self, &Relation { members: volumes, ..rel.clone() }, &[]).await;
        self.relations.set(volume, None)?;
        self.live.lock().expect("not poisoned").remove(volume);
        tracing::info!(%volume, "replication disabled");
        let mut out = self.status_of(&rel);
        out.state = "disabled".into();
        Ok(out)
    }

    /// Rolls the relation's volumes back to point `at`, if given (a group member to its
    /// snapshot `<at>.<member>`), and makes them writable; a group is made here if it is not.
    async fn writable_at(&self, rel: &Relation, volumes: &[String], at: Option<String>) -> Result<(), Error> {
        let (pool, group, volumes) = (Arc::clone(&self.pool), rel.group.then(|| rel.volume.clone()), volumes.to_vec());
        blocking(move || {
            for v in &volumes {
                if let Some(a) = &at {
                    let snapshot = if group.is_some() { format!("{a}.{v}") } else { a.clone() };
                    pool.rollback_volume(v, &snapshot)?;
                }
                pool.set_read_only(v, false)?;
            }
            if let Some(g) = group.filter(|g| !pool.groups().iter().any(|x| &x.name == g)) {
                pool.create_group(&g, &volumes.iter().map(String::as_str).collect::<Vec<_>>())?;
            }
            Ok(())
        })
        .await
    }

    /// Pushes `volume` now, waiting for a push already running to finish first.
    pub async fn sync(&self, volume: &str) -> Result<pb::SyncReplicationResponse, Error> {
        let lock = self.op_lock(volume);
        let _g = lock.lock().await;
        self.sync_locked(volume).await
    }

    /// Pushes `volume` soon, unless a push or a state change of it is running.
    pub fn sync_soon(self: &Arc<Self>, volume: &str) {
        let (hub, volume) = (Arc::clone(self), volume.to_owned());
        tokio::spawn(async move {
            let lock = hub.op_lock(&volume);
            let Ok(_g) = lock.try_lock() else { return };
            // The outcome is in the volume's status.
            let _ = hub.sync_locked(&volume).await;
        });
    }

    /// The peer's replica asked for a resync: this side's data over its own. Its next push
    /// (now, unless one runs) first makes this side's epoch at least the replica's, so the push
    /// is not stale there. Requests coalesce: a peer that asks a thousand times starts one push.
    pub fn resync_requested(self: &Arc<Self>, volume: &str, epoch: u64) {
        self.live(volume, |l| l.asked_epoch = l.asked_epoch.max(epoch));
        self.sync_soon(volume);
    }

    async fn sync_locked(&self, volume: &str) -> Result<pb::SyncReplicationResponse, Error> {
        let mut rel = self.relation(volume)?;
        let asked = self.live(volume, |l| std::mem::take(&mut l.asked_epoch));
        if rel.role == Role::Primary && asked > rel.epoch {
            rel.epoch = asked;
            self.relations.put(rel.clone())?;
        }
        let r = if rel.group { push_group(self, &rel).await } else { push(self, &rel).await };
        match &r {
            Ok(done) => {
                self.live(volume, |l| {
                    l.error.clear();
                    l.failing = 0;
                    l.syncs += 1;
                    l.sent_bytes += done.data_bytes;
                });
                if rel.handover {
                    let mut now = self.relation(volume)?;
                    now.handover = false;
                    self.relations.put(now)?;
                    tracing::info!(%volume, "demoted: the final delta reached the peer");
                }
            }
            Err(e) => {
                tracing::warn!(%volume, error = %e.message(), "replication push failed");
                let every = period(&rel).unwrap_or(Duration::MAX);
                self.live(volume, |l| {
                    l.error = e.message().to_owned();
                    l.failures += 1;
                    l.failing = l.failing.saturating_add(1);
                    let retry = Instant::now() + retry_after(l.failing, every);
                    l.next_at = Some(l.next_at.map_or(retry, |t| t.min(retry)));
                });
            }
        }
        r
    }

    /// Makes `volume` read-only here and sends its final delta.
    pub async fn demote(&self, volume: &str) -> Result<pb::Replication, Error> {
        let lock = self.op_lock(volume);
        let _g = lock.lock().await;
        let mut rel = self.relation(volume)?;
        if rel.role == Role::Secondary {
            return Ok(self.status_of(&rel));
        }
        self.set_read_only(&rel, true).await?;
        rel.role = Role::Secondary;
        rel.handover = true;
        self.relations.put(rel)?;
        self.live(volume, |l| l.resynced = false);
        tracing::info!(%volume, "demoted: read-only, sending the final delta");
        // A failed final delta is retried by the scheduler; the status says why it failed.
        let _ = self.sync_locked(volume).await;
        Ok(self.status_of(&self.relation(volume)?))
    }

    /// Makes `volume` writable here (see the module docs for when).
    pub async fn promote(&self, volume: &str, force: bool) -> Result<pb::Replication, Error> {
        let lock = self.op_lock(volume);
        // A push in flight holds the lock: a forced promotion ends it, a planned one waits for
        // it (it may be the peer's final delta).
        if force {
            self.cancel_incoming_of(volume).await?;
        }
        let _g = lock.lock().await;
        let mut rel = self.relation(volume)?;
        if rel.role == Role::Primary {
            return Ok(self.status_of(&rel));
        }
        if !force {
            self.check_peer_handed_over(&rel).await?;
        }
        let volumes = self.volumes_of(&rel).await?;
        for v in &volumes {
            self.cancel_incoming(v).await;
        }
        let Some(at) = self.newest_point(&rel).await? else {
            return Err(Error::refused(format!(
                "{volume:?} holds no complete mirror snapshot: there is nothing to promote"
            )));
        };
        // What an unfinished transfer applied goes with the rollback.
        for v in &volumes {
            self.pending.set(v, None)?;
        }
        // The new epoch is durable before anything is writable: from here on a push from the
        // old primary is stale, whatever order its messages arrive in.
        rel.epoch = rel.epoch.saturating_add(1);
        self.relations.put(rel.clone())?;
        self.writable_at(&rel, &volumes, Some(at.clone())).await?;
        // Mirror snapshots past the point (an unfinished group point's) are no ancestors of
        // what this side writes next: they go, so no delta is planned over them.
        prune(self, &Relation { members: volumes, ..rel.clone() }, &[&at]).await;
        rel.role = Role::Primary;
        rel.handover = false;
        rel.synced = at;
        self.relations.put(rel.clone())?;
        self.live(volume, |l| (l.next_at, l.error) = (None, String::new()));
        self.wake.notify_one();
        tracing::info!(%volume, force, at = %rel.synced, epoch = rel.epoch, "promoted");
        Ok(self.status_of(&rel))
    }

    /// A promotion without force loses nothing only if the peer is demoted, its final delta is
    /// here, and this side holds the peer's newest mirror snapshot.
    async fn check_peer_handed_over(&self, rel: &Relation) -> Result<(), Error> {
        let unsure = |why: String| {
            Error::refused(format!(
                "{why}; promote with force to take over at this side's last complete mirror snapshot"
            ))
        };
        let pos = async {
            let mut c = connect(self.tls.as_ref(), &rel.peer).await?;
            position(&mut c, &rel.peer, &rel.remote).await
        }
        .await
        .map_err(|e| unsure(format!("the primary cannot be asked ({})", e.message())))?;
        if pos.role == Role::Primary.as_str() {
            return Err(unsure(format!("{:?} on {} is still primary: demote it first", rel.remote, rel.peer)));
        }
        if pos.handover {
            return Err(unsure(format!("the final delta of {:?} on {} has not arrived yet", rel.remote, rel.peer)));
        }
        let theirs = if rel.group {
            pos.synced
        } else {
            pos.snapshots.iter().rev().find(|n| n.starts_with(&rel.prefix)).cloned().unwrap_or_default()
        };
        let pending = self.volumes_of(rel).await?.iter().any(|v| self.pending.get(v).is_some());
        if theirs.is_empty() || theirs != rel.synced || pending {
            return Err(unsure(format!(
                "this side is at mirror snapshot {:?}, {:?} on {} at {theirs:?}",
                rel.synced, rel.remote, rel.peer
            )));
        }
        Ok(())
    }

    /// On a secondary: discard what differs from the primary and ask it to push now.
    pub async fn resync(&self, volume: &str) -> Result<pb::Replication, Error> {
        let lock = self.op_lock(volume);
        let _g = lock.lock().await;
        let mut rel = self.relation(volume)?;
        if rel.role == Role::Primary {
            return Err(Error::refused(format!(
                "volume {volume:?} is primary here: demote it before resyncing it from {}",
                rel.peer
            )));
        }
        rel.handover = false;
        self.relations.put(rel.clone())?;
        self.live(volume, |l| (l.resynced, l.error) = (false, String::new()));
        let asked = async {
            let mut c = connect(self.tls.as_ref(), &rel.peer).await?;
            let req = pb::ReplicaSyncRequest { volume: rel.remote.clone(), epoch: rel.epoch };
            c.sync(req).await.map_err(at_peer(&rel.peer))
        }
        .await;
        if let Err(e) = asked {
            // The primary's scheduler pushes at its next interval anyway.
            self.live(volume, |l| l.error = format!("asking the primary to push now: {}", e.message()));
        }
        tracing::info!(%volume, peer = %rel.peer, "resync requested");
        Ok(self.status_of(&rel))
    }

    /// Pushes every primary at its interval, and retries demoted volumes' final deltas.
    pub async fn schedule(self: Arc<Self>) {
        loop {
            let now = Instant::now();
            for rel in self.relations.all() {
                let Some(every) = period(&rel) else { continue };
                if self.live(&rel.volume, |l| l.next_at.is_some_and(|t| t > now)) {
                    continue;
                }
                self.live(&rel.volume, |l| l.next_at = Some(now + every));
                self.sync_soon(&rel.volume);
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_pushes_back_off_up_to_the_interval() {
        let every = Duration::from_secs(300);
        let waits: Vec<u64> = (1..=8).map(|n| retry_after(n, every).as_secs()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(retry_after(u32::MAX, every), every);
        assert_eq!(retry_after(1, Duration::from_secs(2)), Duration::from_secs(2));
    }
}
