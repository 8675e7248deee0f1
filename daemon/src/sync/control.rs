//! What operators and the start-up do with synchronous volumes: add a member, promote a
//! replica, step down, status, and bring primaries back after a restart.

use std::sync::Arc;
use std::time::Duration;

use ferrite_engine::Mirror;
use ferrite_proto::ferrite::v1::{SyncMember, SyncVolume};

use super::link::Link;
use super::records::{Member, Membership, State, check_endpoint};
use super::{Primary, SyncHub};
use crate::base::error::{Error, blocking};

impl SyncHub {
    /// Adds the daemon at `peer` as a member of `volume` (primary here): a witness holds the
    /// membership only; a replica joins in sync if the volume holds no data yet, else it is
    /// rebuilt (a copy of the allocated blocks) and then in sync.
    pub async fn add(self: &Arc<Self>, volume: &str, peer: &str, witness: bool) -> Result<SyncVolume, Error> {
        check_endpoint(peer).map_err(Error::invalid)?;
        if check_endpoint(&self.me).is_err() {
            return Err(Error::refused(
                "synchronous replicas need replication-endpoint = \"tcp://host:port\" (how members reach this daemon)",
            ));
        }
        if peer == self.me {
            return Err(Error::invalid(format!("{peer} is this daemon")));
        }
        let op = self.op_lock(volume);
        let _op = op.lock().await;
        let (info, filling) = {
            let (pool, name) = (Arc::clone(&self.pool), volume.to_owned());
            blocking(move || Ok((pool.volume_info(&name)?, pool.is_filling(&name)?))).await?
        };
        if filling {
            // Its copies are made from it once it is whole: the backup is fetched once.
            return Err(Error::unavailable(format!(
                "volume {volume:?} is being restored; add its replicas once the restore is done"
            )));
        }
        let primary = match (self.records.get(volume), self.primary(volume)) {
            (Some(_), Some(p)) => p,
            (Some(h), None) => {
                return Err(Error::refused(format!(
                    "volume {volume:?} is a synchronous replica here; its primary is {}",
                    h.primary
                )));
            }
            (None, _) => {
                if info.read_only {
                    return Err(Error::refused(format!("volume {volume:?} is read-only here")));
                }
                let wrapped_key = self.wrapped_key(volume).await?;
                let first = Membership {
                    volume: volume.to_owned(),
                    generation: 1,
                    primary: self.me.clone(),
                    members: vec![Member {
                        endpoint: self.me.clone(),
                        state: State::InSync,
                        reason: String::new(),
                        mark: String::new(),
                    }],
                    size: info.size,
                    wrapped_key,
                };
                self.records.put(first.clone())?;
                self.start_primary(first, None)
            }
        };
        if let Some(why) = primary.refused() {
            return Err(Error::unavailable(why));
        }
        // No request in flight while the member joins: it gets every request after this point,
        // and whether the volume held data before it decides whether it needs a copy first.
        let hold = primary.hold().await;
        let (pool, name) = (Arc::clone(&self.pool), volume.to_owned());
        let empty = blocking(move || {
            let v = pool.open_volume(&name)?;
            Ok(v.allocation(0, v.size()?)?.iter().all(|&(_, mapped)| !mapped))
        })
        .await?;
        let _c = primary.change.lock().await;
        let old = primary.record();
        if old.member(peer).is_some() {
            return Err(Error::already_exists(format!("{peer} is already a member of {volume:?}")));
        }
        let mut next = old.clone();
        next.generation = self.next_generation(&old).map_err(Error::refused)?;
        // A replica of a volume that holds data joins out of sync: its rebuild (a copy of the
        // allocated blocks) starts within a second, and it is in sync when that is done.
        let (state, reason) = match (witness, empty) {
            (true, _) => (State::Witness, String::new()),
            (false, true) => (State::InSync, String::new()),
            (false, false) => (State::Ejected, "joining: its first copy follows".to_owned()),
        };
        next.members.push(Member { endpoint: peer.to_owned(), state, reason, mark: String::new() });
        let r = self.propose(&old, &next).await;
        let r = match r {
            Ok(()) if state != State::InSync => Ok(()),
            Ok(()) => match self.open_link(&next, peer).await {
                Ok(link) => {
                    primary.add_link(link);
                    Ok(())
                }
                Err(e) => Err(format!("{peer} took the membership but its stream did not open: {}", e.message())),
            },
            Err(e) => Err(e),
        };
        primary.adopt(if r.is_ok() { next } else { self.records.get(volume).unwrap_or(old) });
        drop((_c, hold));
        r.map_err(Error::refused)?;
        tracing::info!(volume, member = peer, witness, "synchronous member added");
        Ok(self.view(volume).expect("just recorded"))
    }

    /// Removes `peer` from the members of `volume` (primary here): the next generation without
    /// it, recorded on a majority of the old and the new members (the member forgets the
    /// membership; its copy stays read-only there). Without other members left the volume is a
    /// local one again.
    pub async fn remove(self: &Arc<Self>, volume: &str, peer: &str) -> Result<SyncVolume, Error> {
        let op = self.op_lock(volume);
        let _op = op.lock().await;
        let Some(primary) = self.primary(volume) else {
            return Err(match self.records.get(volume) {
                Some(h) => Error::refused(format!(
                    "volume {volume:?} is a synchronous replica here; remove members on its primary, {}",
                    h.primary
                )),
                None => Error::not_found(format!("volume {volume:?} has no synchronous members here")),
            });
        };
        if peer == self.me {
            return Err(Error::invalid(format!("{peer} is the primary of {volume:?}: promote another member first")));
        }
        let hold = primary.hold().await;
        let _c = primary.change.lock().await;
        let old = primary.record();
        if old.member(peer).is_none() {
            drop((_c, hold));
            return self.tell_removed(&old, peer).await;
        }
        let mut next = old.clone();
        next.generation = self.next_generation(&old).map_err(Error::refused)?;
        next.members.retain(|m| m.endpoint != peer);
        self.propose(&old, &next).await.map_err(Error::refused)?;
        primary.adopt(next.clone());
        tracing::info!(volume, member = peer, generation = next.generation, "synchronous member removed");
        if next.members.len() > 1 {
            drop((_c, hold));
            return Ok(self.view(volume).expect("just recorded"));
        }
        // Only this daemon is left: no mirror, no membership.
        self.primaries.lock().expect("not poisoned").remove(volume);
        primary.close("the volume has no synchronous members any more");
        let (pool, name) = (Arc::clone(&self.pool), volume.to_owned());
        blocking(move || pool.set_mirror(&name, None)).await?;
        self.records.set(volume, None)?;
        self.drop_marks(volume).await;
        drop((_c, hold));
        Ok(SyncVolume { volume: volume.to_owned(), generation: next.generation, ..Default::default() })
    }

    /// A former member (`peer`, not in `current`) that still holds an older membership of the
    /// volume (it was away when it was removed: a replaced copy whose node came back) gets the
    /// current one, in which it is no member: it forgets the membership, and its copy stays
    /// there read-only, to be deleted. NotFound when it holds none.
    async fn tell_removed(self: &Arc<Self>, current: &Membership, peer: &str) -> Result<SyncVolume, Error> {
        let volume = &current.volume;
        let held = self.held_at(peer, volume).await.map_err(|e| {
            Error::not_found(format!("{peer} is not a member of {volume:?} and holds no membership of it: {e}"))
        })?;
        if !current.outranks(&held) {
            return Err(Error::refused(format!(
                "{peer} holds generation {} of {volume:?}, not older than this one's {}",
                held.generation, current.generation
            )));
        }
        let mut c = self.client(peer).await?;
        c.record(current.to_proto()).await.map_err(crate::base::rpc::at_peer(peer))?;
        tracing::info!(
            volume,
            member = peer,
            held = held.generation,
            "a removed member that came back forgot the membership"
        );
        Ok(self.view(volume).expect("a primary here"))
    }

    /// Grows every copy of `volume` (primary here) to `new_size` before the primary's own: the
    /// next generation carries the size, and each member grows its copy as it records it (a
    /// majority must, as for any change). No request is in flight meanwhile, and none can reach
    /// past the old end until this daemon's volume grows, after the record.
    pub async fn grow(self: &Arc<Self>, volume: &str, new_size: u64) -> Result<(), Error> {
        let op = self.op_lock(volume);
        let _op = op.lock().await;
        let Some(primary) = self.primary(volume) else {
            return match self.records.get(volume) {
                Some(h) => Err(Error::refused(format!(
                    "volume {volume:?} is a synchronous replica here: grow it on its primary, {}",
                    h.primary
                ))),
                None => Ok(()),
            };
        };
        let hold = primary.hold().await;
        let _c = primary.change.lock().await;
        let old = primary.record();
        if new_size <= old.size {
            return Ok(());
        }
        let mut next = old.clone();
        next.generation = self.next_generation(&old).map_err(Error::refused)?;
        next.size = new_size;
        self.propose(&old, &next)
            .await
            .map_err(|e| Error::refused(format!("the members did not take the new size: {e}")))?;
        primary.adopt(next);
        drop((_c, hold));
        tracing::info!(volume, size = new_size, "synchronous members grown");
        Ok(())
    }

    /// After a rekey of `volume` here (its primary): the members record its new wrapping, so
    /// that a promoted one opens with the new key-encryption key.
    pub async fn rewrapped(self: &Arc<Self>, volume: &str) -> Result<(), Error> {
        let op = self.op_lock(volume);
        let _op = op.lock().await;
        let Some(primary) = self.primary(volume) else { return Ok(()) };
        let wrapped_key = self.wrapped_key(volume).await?;
        let _c = primary.change.lock().await;
        let old = primary.record();
        if old.wrapped_key == wrapped_key {
            return Ok(());
        }
        let generation = self.next_generation(&old).map_err(Error::refused)?;
        let next = Membership { generation, wrapped_key, ..old.clone() };
        self.propose(&old, &next).await.map_err(|e| {
            Error::unavailable(format!(
                "rekeyed here, but the members did not record the new wrapping ({e}): run the rekey again once they answer"
            ))
        })?;
        primary.adopt(next);
        tracing::info!(volume, "synchronous members follow the new key wrapping");
        Ok(())
    }

    /// `volume`'s wrapped data key here (empty: plaintext).
    async fn wrapped_key(&self, volume: &str) -> Result<Vec<u8>, Error> {
        let (pool, name) = (Arc::clone(&self.pool), volume.to_owned());
        blocking(move || pool.wrapped_key(ferrite_engine::Image::Volume(&name)).map(Option::unwrap_or_default)).await
    }

    async fn open_link(&self, rec: &Membership, endpoint: &str) -> Result<Arc<Link>, Error> {
        tokio::time::timeout(
            self.timeout,
            Link::open(self.tls.as_ref(), endpoint, &rec.volume, rec.generation, None, self.timeout),
        )
        .await
        .map_err(|_| Error::unavailable(format!("{endpoint} did not open the stream within {:?}", self.timeout)))?
    }

    /// Serves `rec` (whose primary is this daemon) from now on: the engine sends the volume's
    /// requests through it. Refused writes until `refused` is cleared.
    fn start_primary(self: &Arc<Self>, rec: Membership, refused: Option<String>) -> Arc<Primary> {
        let p = Primary::new(self, rec.clone(), refused);
        if let Err(e) = self.pool.set_mirror(&rec.volume, Some(Arc::clone(&p) as Arc<dyn Mirror>)) {
            tracing::error!(volume = %rec.volume, error = %e, "could not mirror the volume");
        }
        self.primaries.lock().expect("not poisoned").insert(rec.volume.clone(), Arc::clone(&p));
        p
    }

    /// This daemon is no longer the primary of `volume` (a newer generation names another):
    /// its writes stop for good, the volume turns read-only, and it waits to be rebuilt.
    /// Its writes are refused at once; turning the volume read-only waits for the writes inside
    /// it, so it runs in a task of its own (a caller may be such a write, or a call its peer
    /// gives up on).
    pub fn step_down(&self, volume: &str, why: &str) {
        let Some(p) = self.primaries.lock().expect("not poisoned").remove(volume) else { return };
        p.close(&format!("volume {volume} is no longer primary here: {why}"));
        tracing::warn!(volume, reason = why, "synchronous primary stepped down: read-only here now");
        if let Some(tx) = self.stepped_down.lock().expect("not poisoned").as_ref() {
            let _ = tx.send(volume.to_owned());
        }
        let (pool, name) = (Arc::clone(&self.pool), volume.to_owned());
        drop(tokio::task::spawn_blocking(move || {
            let r = pool.set_read_only(&name, true).and_then(|_| pool.set_mirror(&name, None));
            if let Err(e) = r {
                tracing::error!(volume = %name, error = %e, "stepping down");
            }
        }));
    }

    /// Makes this member the primary of `volume`. Without `force`: only an in-sync member of
    /// the newest generation a majority of the members hold, and only if a majority records
    /// the new one. With it: a stale member too, and without a majority (the operator knows the
    /// others are gone): what that loses is logged and answered. The next membership is built
    /// from this daemon's own record (the others' answers are evidence of the newest generation
    /// only), and every other member leaves it out of sync: each is brought to this copy's
    /// content (rolled back to the newest mark both hold, then sent what changed since) before
    /// it is in sync again, so in-sync copies never differ and a write that failed to its client
    /// never reappears in a later failover.
    pub async fn promote(self: &Arc<Self>, volume: &str, force: bool) -> Result<SyncVolume, Error> {
        let op = self.op_lock(volume);
        let _op = op.lock().await;
        let held = self
            .records
            .get(volume)
            .ok_or_else(|| Error::not_found(format!("volume {volume:?} has no synchronous replica here")))?;
        if held.primary == self.me && self.primary(volume).is_some() {
            return Ok(self.view(volume).expect("held"));
        }
        match held.state_of(&self.me) {
            Some(State::Witness) => return Err(Error::refused("a witness holds no data to promote")),
            None => return Err(Error::refused(format!("this daemon is no member of {volume:?}"))),
            _ => {}
        }
        // What the others hold: the newest generation among a majority is at least the newest
        // one ever recorded on a majority. They are asked at once; one that does not answer
        // costs the timeout, once.
        let others: Vec<String> =
            held.members.iter().filter(|m| m.endpoint != self.me).map(|m| m.endpoint.clone()).collect();
        tracing::info!(volume, members = %others.join(", "), timeout = ?self.timeout,
            "promotion: asking the members what they hold");
        let mut calls = tokio::task::JoinSet::new();
        for e in others {
            let (hub, v) = (Arc::clone(self), volume.to_owned());
            calls.spawn(async move { (hub.held_at(&e, &v).await, e) });
        }
        let mut newest = held.clone();
        let mut answered = 1;
        while let Some(Ok((r, member))) = calls.join_next().await {
            match r {
                Ok(h) => {
                    answered += 1;
                    if h.outranks(&newest) {
                        newest = h;
                    }
                }
                Err(e) => tracing::info!(volume, %member, error = %e, "member did not answer"),
            }
        }
        let mut lost = Vec::new();
        if answered < held.majority() {
            let why =
                format!("only {answered} of {} members answer (a majority is {})", held.members.len(), held.majority());
            if !force {
                return Err(Error::unavailable(format!(
                    "{why}: promoting now could make a second primary; promote with --force only if the others are known to be down"
                )));
            }
            lost.push(why);
        }
        if newest.state_of(&self.me) != Some(State::InSync) {
            let m = newest.member(&self.me);
            let why = format!(
                "this replica is stale: generation {} has it {} ({}); in sync: {}",
                newest.generation,
                m.map_or("not a member", |m| m.state.as_str()),
                m.map_or("", |m| m.reason.as_str()),
                newest
                    .members
                    .iter()
                    .filter(|m| m.state == State::InSync)
                    .map(|m| m.endpoint.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if !force {
                return Err(Error::refused(format!(
                    "{why}. Promote an in-sync member, or --force to promote this one and lose the writes acknowledged since it was ejected"
                )));
            }
            lost.push(format!("{why}: the writes acknowledged since then are lost"));
        }
        let mut next = held.clone();
        next.generation = self.next_generation(&newest).map_err(Error::refused)?;
        next.primary = self.me.clone();
        for m in &mut next.members {
            if m.endpoint == self.me {
                m.state = State::InSync;
                m.reason.clear();
            } else if m.endpoint == held.primary {
                m.state = State::Ejected;
                m.reason = format!("failed over to {}", self.me);
            } else if matches!(m.state, State::InSync | State::Rebuilding) {
                m.state = State::Ejected;
                m.reason = format!("reconciling with the new primary {}", self.me);
            }
        }
        if let Err(e) = self.propose(&held, &next).await {
            if !force {
                return Err(Error::refused(format!("promotion not recorded: {e}")));
            }
            lost.push(e);
            self.records.put(next.clone())?;
        }
        if !lost.is_empty() {
            tracing::warn!(volume, lost = %lost.join("; "), "forced promotion");
        }
        let (pool, name) = (Arc::clone(&self.pool), volume.to_owned());
        blocking(move || pool.set_read_only(&name, false)).await?;
        self.start_primary(next.clone(), None);
        tracing::info!(volume, generation = next.generation, "promoted to synchronous primary");
        let mut v = self.view(volume).expect("held");
        v.refused = lost.join("; ");
        Ok(v)
    }

    /// After a restart: each volume this daemon was primary of starts with writes refused, and
    /// serves again once a majority records a new generation (or steps down if a newer one
    /// names another primary). Replicas stay read-only. Called before exports are restored.
    pub fn resume(self: &Arc<Self>) {
        for rec in self.records.all() {
            if rec.primary != self.me {
                continue;
            }
            self.start_primary(rec, Some("re-establishing the volume's membership after a restart".into()));
        }
        let hub = Arc::clone(self);
        tokio::spawn(async move { hub.retry_refused().await });
        tokio::spawn(Arc::clone(self).tend());
    }

    /// Every second: a primary that refuses writes tries again to record its membership (ejecting
    /// the members that do not answer) on a majority.
    async fn retry_refused(self: Arc<Self>) {
        loop {
            for p in self.primaries_refusing(true) {
                self.reassert(&p).await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    async fn reassert(self: &Arc<Self>, p: &Arc<Primary>) {
        let _c = p.change.lock().await;
        let old = p.record();
        let mut next = old.clone();
        next.generation = match self.next_generation(&old) {
            Ok(g) => g,
            Err(e) => return p.refuse(Some(format!("volume {} refuses writes: {e}", old.volume))),
        };
        // Members that cannot take a stream now are ejected in the same generation. Without a
        // majority answering nothing is proposed: a proposal stores its generation here first,
        // and a primary cut off from its members (fenced after a failover) would count its
        // generation up every second, past the one that replaced it, and refuse that one.
        let mut links = Vec::new();
        let mut answered = 1;
        let mut newer = Vec::new();
        for m in next.members.iter_mut().filter(|m| m.endpoint != self.me) {
            match self.held_at(&m.endpoint, &old.volume).await {
                Ok(h) => {
                    answered += 1;
                    if m.state == State::InSync {
                        links.push(m.endpoint.clone());
                    }
                    if h.outranks(&old) && h.primary != self.me {
                        newer.push((m.endpoint.clone(), h));
                    }
                }
                Err(e) if m.state == State::InSync => {
                    m.state = State::Ejected;
                    m.reason = e.chars().take(200).collect();
                }
                Err(_) => {}
            }
        }
        if let Some(why) = super::failed_over(&old, &newer) {
            // Evidence only: the new primary's Record, when it rebuilds this daemon, is what
            // changes the membership here.
            return self.step_down(&old.volume, &why);
        }
        if answered < old.majority() {
            let why =
                format!("only {answered} of {} members answer (a majority is {})", old.members.len(), old.majority());
            p.refuse(Some(format!("volume {} refuses writes: {why}", old.volume)));
            return;
        }
        match self.propose(&old, &next).await {
            Ok(()) => {
                p.adopt(next.clone());
                for e in links {
                    match self.open_link(&next, &e).await {
                        Ok(l) => p.add_link(l),
                        Err(err) => {
                            // Its next request ejects it; refusing again would loop.
                            tracing::warn!(volume = %old.volume, member = %e, error = %err.message(), "stream did not open");
                            let (p, why) = (Arc::clone(p), format!("its stream did not open: {}", err.message()));
                            tokio::spawn(async move { p.eject(&e, &why).await });
                        }
                    }
                }
                p.refuse(None);
                tracing::info!(volume = %old.volume, generation = next.generation, "synchronous primary takes writes");
            }
            Err(e) if e.contains("failed over") => self.step_down(&old.volume, &e),
            Err(e) => {
                p.refuse(Some(format!("volume {} refuses writes: {e}", old.volume)));
            }
        }
    }

    /// Every synchronous volume here (or one), as status shows it.
    pub fn list(&self, volume: Option<&str>) -> Vec<SyncVolume> {
        let mut names: Vec<String> = self.records.all().into_iter().map(|r| r.volume).collect();
        names.retain(|n| volume.is_none_or(|v| v == n));
        names.sort();
        names.iter().filter_map(|n| self.view(n)).collect()
    }

    fn view(&self, volume: &str) -> Option<SyncVolume> {
        let p = self.primary(volume);
        let rec = p.as_ref().map(|p| p.record()).or_else(|| self.records.get(volume))?;
        let role = match rec.state_of(&self.me) {
            _ if p.is_some() => "primary",
            Some(State::Witness) => "witness",
            _ => "replica",
        };
        let added = p.as_ref().map(|p| p.added.snapshot());
        let (requests, waited) = added.map_or((0, 0.0), |h| (h.count, h.sum));
        let progress = p.as_ref().and_then(|p| p.progress.lock().expect("not poisoned").clone());
        Some(SyncVolume {
            volume: volume.to_owned(),
            role: role.into(),
            generation: rec.generation,
            primary: rec.primary.clone(),
            members: rec
                .members
                .iter()
                .map(|m| SyncMember {
                    endpoint: m.endpoint.clone(),
                    state: if m.endpoint == rec.primary { "primary".into() } else { m.state.as_str().into() },
                    reason: match progress.as_ref().filter(|(who, ..)| *who == m.endpoint) {
                        Some((_, done, total)) if m.state == State::Rebuilding => format!(
                            "{} of {} copied",
                            crate::base::size::format_size(done.load(std::sync::atomic::Ordering::Relaxed)),
                            crate::base::size::format_size(*total)
                        ),
                        _ => m.reason.clone(),
                    },
                    mark: m.mark.clone(),
                })
                .collect(),
            refused: p.as_ref().and_then(|p| p.refused()).unwrap_or_default(),
            requests,
            added_latency_us: if requests == 0 { 0.0 } else { waited / requests as f64 * 1e6 },
        })
    }
}
