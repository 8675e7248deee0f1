//! A volume's primary: the engine's [`Mirror`] for it. Each client request goes to every data
//! member's stream and is answered when all of them acknowledged it. A member that fails or
//! does not answer within the timeout is ejected: the next generation, without it, is recorded
//! on a majority of the members before the request (or any later one) is acknowledged. Without
//! a majority the primary refuses writes from then on, saying why, until one answers again.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use ferrite_engine::{Batch, Error, ErrorKind, Mirror, MirrorOp, Pending};
use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::{MirrorFlush, MirrorMark, MirrorMessage, MirrorTrim, MirrorZero};

use super::SyncHub;
use super::link::{Acks, Link};
use super::records::{Membership, State};
use super::wire;

#[derive(Debug)]
pub struct Primary {
    pub volume: String,
    hub: Weak<SyncHub>,
    me: Weak<Primary>,
    /// The membership as last recorded on a majority.
    pub record: Mutex<Membership>,
    links: Mutex<Vec<Arc<Link>>>,
    /// Why writes are refused now, and since when; None while they are taken.
    refused: Mutex<Option<(String, Instant)>>,
    /// The next request's sequence number, taken under this lock while the request is queued
    /// on every stream: each stream carries them in increasing order (a member's cumulative ack
    /// says "every request up to N", which counts on it).
    seq: Mutex<u64>,
    /// One membership change at a time.
    pub change: tokio::sync::Mutex<()>,
    /// Requests sent and not yet answered to the client, and a pause that holds new ones back
    /// (a member joins between two requests).
    inflight: Mutex<u64>,
    idle: Condvar,
    paused: AtomicBool,
    /// Members being rebuilt: while there is one, writes reach the members as whole blocks.
    rebuilding: AtomicUsize,
    /// The rebuild running, if one does: the member, data bytes sent and to send.
    pub progress: Mutex<Option<(String, Arc<AtomicU64>, u64)>>,
    timeout: Duration,
    /// How long each mirrored request waited for the members after its local write.
    pub added: ferrite_nbd::metrics::Histogram,
    /// Members ejected, and data bytes rebuilds sent, since the daemon started.
    pub ejections: AtomicU64,
    pub rebuilt_bytes: AtomicU64,
}

impl Primary {
    pub fn new(hub: &Arc<SyncHub>, record: Membership, refused: Option<String>) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            volume: record.volume.clone(),
            hub: Arc::downgrade(hub),
            me: me.clone(),
            record: Mutex::new(record),
            links: Mutex::default(),
            refused: Mutex::new(refused.map(|why| (why, Instant::now()))),
            seq: Mutex::new(1),
            change: tokio::sync::Mutex::new(()),
            inflight: Mutex::new(0),
            idle: Condvar::new(),
            paused: AtomicBool::new(false),
            rebuilding: AtomicUsize::new(0),
            progress: Mutex::new(None),
            timeout: hub.timeout,
            added: Default::default(),
            ejections: AtomicU64::new(0),
            rebuilt_bytes: AtomicU64::new(0),
        })
    }

    pub fn record(&self) -> Membership {
        self.record.lock().expect("not poisoned").clone()
    }

    pub fn refused(&self) -> Option<String> {
        self.refused.lock().expect("not poisoned").as_ref().map(|(why, _)| why.clone())
    }

    /// Refuses writes for `why` (kept from the first refusal: since then, see [`Self::reads`]),
    /// or takes them again.
    pub fn refuse(&self, why: Option<String>) {
        let mut r = self.refused.lock().expect("not poisoned");
        *r = why.map(|why| (why, r.as_ref().map_or_else(Instant::now, |(_, since)| *since)));
    }

    /// Whether reads may be served: not once writes have been refused for longer than the
    /// members' ejection timeout. A primary that long without a majority may have been replaced
    /// on the other side of a partition, and its copy is stale for every write since; as DRBD's
    /// quorum does, it fails reads rather than serve them.
    fn reads(&self) -> Option<String> {
        let r = self.refused.lock().expect("not poisoned");
        let (why, since) = r.as_ref().filter(|(_, since)| since.elapsed() > self.timeout)?;
        Some(format!("{why}; reads are refused too after {:?} without a majority", since.elapsed()))
    }

    pub fn add_link(&self, link: Arc<Link>) {
        let mut links = self.links.lock().expect("not poisoned");
        if link.rebuilding.load(Ordering::SeqCst) {
            self.rebuilding.fetch_add(1, Ordering::SeqCst);
        }
        links.push(link);
    }

    /// `member` has every piece of its rebuild: it needs whole blocks no longer.
    pub fn rebuilt(&self, member: &str) {
        for l in self.links.lock().expect("not poisoned").iter().filter(|l| l.endpoint == member) {
            self.unmark_rebuilding(l);
        }
    }

    fn unmark_rebuilding(&self, l: &Link) {
        if l.rebuilding.swap(false, Ordering::SeqCst) {
            self.rebuilding.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Makes `next` the membership (it is recorded on a majority): streams of members that no
    /// longer get writes end.
    pub fn adopt(&self, next: Membership) {
        let keep: Vec<String> = next.data_members().map(|m| m.endpoint.clone()).collect();
        *self.record.lock().expect("not poisoned") = next;
        self.links.lock().expect("not poisoned").retain(|l| {
            let stays = keep.contains(&l.endpoint);
            if !stays {
                self.unmark_rebuilding(l);
                l.end("the member was ejected");
            }
            stays
        });
    }

    /// Ends every stream (the volume stepped down or stops being mirrored).
    pub fn close(&self, why: &str) {
        self.refuse(Some(why.to_owned()));
        for l in self.links.lock().expect("not poisoned").drain(..) {
            self.unmark_rebuilding(&l);
            l.end(why);
        }
    }

    /// Holds new requests back and waits until none is in flight; they go on when the guard
    /// drops. Blocking: call it on the blocking pool.
    pub fn pause(&self) -> PauseGuard<'_> {
        self.paused.store(true, Ordering::SeqCst);
        let mut n = self.inflight.lock().expect("not poisoned");
        while *n > 0 {
            n = self.idle.wait(n).expect("not poisoned");
        }
        PauseGuard(self)
    }

    /// [`Primary::pause`] from async code: held until the returned value drops.
    pub async fn hold(self: &Arc<Self>) -> Hold {
        let (held_tx, held_rx) = tokio::sync::oneshot::channel();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let p = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let _pause = p.pause();
            let _ = held_tx.send(());
            let _ = release_rx.blocking_recv();
        });
        let _ = held_rx.await;
        Hold(Some(release_tx))
    }

    /// Ejects `member` (it failed a request, or did not answer it in time): records the next
    /// generation without it on a majority. Ok once it is out of the writes (here or by another
    /// request's ejection); an error (and writes refused from now on) without a majority.
    pub async fn eject(&self, member: &str, why: &str) -> Result<(), String> {
        let _c = self.change.lock().await;
        if let Some(r) = self.refused() {
            return Err(r);
        }
        let mut next = self.record();
        match next.member_mut(member) {
            Some(m) if m.state == State::InSync || m.state == State::Rebuilding => {
                m.state = State::Ejected;
                m.reason = why.chars().take(200).collect();
            }
            _ => return Ok(()),
        }
        let hub = self.hub.upgrade().ok_or_else(|| "the daemon is stopping".to_owned())?;
        let old = self.record();
        let proposed = match hub.next_generation(&next) {
            Ok(g) => {
                next.generation = g;
                tracing::warn!(volume = %self.volume, %member, reason = why, generation = g,
                    "ejecting a synchronous replica");
                hub.propose(&old, &next).await
            }
            Err(e) => Err(e),
        };
        match proposed {
            Ok(()) => {
                self.adopt(next);
                self.ejections.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                if e.contains("failed over") {
                    hub.step_down(&self.volume, &e);
                }
                let why = format!("volume {} refuses writes: ejecting {member} failed: {e}", self.volume);
                tracing::error!(volume = %self.volume, "{why}");
                self.refuse(Some(why.clone()));
                Err(why)
            }
        }
    }

    /// Takes a mark: under a pause, a snapshot here and the same on every member with a stream
    /// (one that does not take it is ejected). The members that took it hold it alike with this
    /// one: a later rebuild of theirs starts there. Blocking.
    pub fn mark(&self, pool: &ferrite_engine::Pool) -> Result<String, String> {
        let hub = self.hub.upgrade().ok_or_else(|| "the daemon is stopping".to_owned())?;
        let _pause = self.pause();
        if let Some(why) = self.refused() {
            return Err(why);
        }
        let name = format!("{}{}", super::mark_prefix(&self.volume), crate::replica::now_ms());
        pool.create_snapshot(&self.volume, &name).map_err(|e| e.to_string())?;
        let (links, acks) = self.send_all(Op::Mark(MirrorMark { snapshot: name.clone(), kept: false }));
        let bad = acks.wait_until(Instant::now() + self.timeout);
        for (member, why) in &bad {
            hub.rt.block_on(self.eject(member, why))?;
        }
        let mut rec = self.record.lock().expect("not poisoned");
        let primary = rec.primary.clone();
        for m in &mut rec.members {
            let took = links.iter().any(|l| l.endpoint == m.endpoint) && !bad.iter().any(|(b, _)| *b == m.endpoint);
            if m.endpoint == primary || took {
                m.mark.clone_from(&name);
            }
        }
        Ok(name)
    }

    /// Takes snapshot `name` here and, at the same point of the stream, on every member with
    /// one: the snapshot outlives this node. A member that cannot take it keeps streaming (a
    /// snapshot is no part of what it must hold alike); which members hold it is logged.
    /// Blocking.
    pub fn snapshot(
        &self,
        pool: &ferrite_engine::Pool,
        name: &str,
    ) -> Result<ferrite_engine::SnapshotInfo, crate::base::error::Error> {
        let _pause = self.pause();
        if let Some(why) = self.refused() {
            return Err(crate::base::error::Error::unavailable(why));
        }
        let s = pool.create_snapshot(&self.volume, name)?;
        let (links, acks) = self.send_all(Op::Mark(MirrorMark { snapshot: name.to_owned(), kept: true }));
        let bad = acks.wait_until(Instant::now() + self.timeout);
        for (member, why) in &bad {
            tracing::warn!(volume = %self.volume, snapshot = name, member, why, "a copy did not take the snapshot");
        }
        tracing::info!(volume = %self.volume, snapshot = name, copies = 1 + links.len() - bad.len(), "snapshot taken on every copy");
        Ok(s)
    }

    /// Sends `op` to every member with a stream: the streams, and their answers to come.
    fn send_all(&self, op: Op) -> (Vec<Arc<Link>>, Arc<Acks>) {
        let op = Some(op);
        self.send_frame(|seq, frame| wire::put(frame, &MirrorMessage { seq, op: op.clone() }))
    }

    /// Sends the request `encode` appends as a frame, given its sequence number, to every
    /// member with a stream (into each stream's buffer: no frame of its own to copy from).
    fn send_frame(&self, encode: impl Fn(u64, &mut Vec<u8>)) -> (Vec<Arc<Link>>, Arc<Acks>) {
        let (links, acks) = {
            let mut seq = self.seq.lock().expect("not poisoned");
            let links = self.links.lock().expect("not poisoned").clone();
            let acks = Acks::new(links.iter().map(|l| l.endpoint.clone()).collect());
            for l in &links {
                l.queue(*seq, |buf| encode(*seq, buf), &acks);
            }
            *seq += 1;
            (links, acks)
        };
        for l in &links {
            Batch::push(l);
        }
        (links, acks)
    }
}

/// New requests wait while this lives.
#[derive(Debug)]
pub struct PauseGuard<'a>(&'a Primary);

/// New requests wait while this lives ([`Primary::hold`]).
#[derive(Debug)]
pub struct Hold(Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        let _n = self.0.inflight.lock().expect("not poisoned");
        self.0.paused.store(false, Ordering::SeqCst);
        self.0.idle.notify_all();
    }
}

impl Mirror for Primary {
    fn whole_blocks(&self) -> bool {
        self.rebuilding.load(Ordering::SeqCst) > 0
    }

    fn admit(&self) -> ferrite_engine::Result<Box<dyn Send>> {
        Ok(Box::new(self.enter(true)?))
    }

    fn try_admit(&self) -> Option<ferrite_engine::Result<Box<dyn Send>>> {
        // A pause that begins after this look waits for the request like any admitted one.
        if self.paused.load(Ordering::SeqCst) {
            return None;
        }
        Some(self.enter(false).map(|w| Box::new(w) as Box<dyn Send>))
    }

    fn admit_read(&self) -> ferrite_engine::Result<()> {
        self.reads().map_or(Ok(()), |why| Err(Error::new(ErrorKind::Io, why)))
    }

    fn send(&self, op: MirrorOp<'_>) -> ferrite_engine::Result<Box<dyn Pending>> {
        // Its admission counts it in flight: a pause waits for it, so it must not wait for one.
        let mut waiting = self.enter(false)?;
        waiting.acks = match op {
            // Zero data (NBD's NO_HOLE zeroing comes as such writes) crosses as a range.
            MirrorOp::Write { offset, data, fua } if data.iter().all(|&b| b == 0) => {
                let len = data.len() as u64;
                self.send_all(Op::Zero(MirrorZero { offset, length: len, fua, allocate: true })).1
            }
            // Encoded from the caller's buffer: no copy of the data into a message first.
            MirrorOp::Write { offset, data, fua } => {
                let crc = crc32c::crc32c(data);
                self.send_frame(|seq, frame| wire::put_write(frame, seq, offset, data, fua, crc)).1
            }
            MirrorOp::Trim { offset, len } => self.send_all(Op::Trim(MirrorTrim { offset, length: len })).1,
            MirrorOp::Zero { offset, len, fua } => {
                self.send_all(Op::Zero(MirrorZero { offset, length: len, fua, allocate: false })).1
            }
            MirrorOp::Flush => self.send_all(Op::Flush(MirrorFlush {})).1,
        };
        Ok(Box::new(waiting))
    }
}

impl Primary {
    /// A request in flight (waiting out a pause first, if `wait_pause`), or its refusal.
    fn enter(&self, wait_pause: bool) -> ferrite_engine::Result<Waiting> {
        {
            let mut n = self.inflight.lock().expect("not poisoned");
            while wait_pause && self.paused.load(Ordering::SeqCst) {
                n = self.idle.wait(n).expect("not poisoned");
            }
            *n += 1;
        }
        let waiting = Waiting {
            primary: self.me.upgrade().expect("a primary in use is alive"),
            acks: Acks::new(Vec::new()),
            sent: Instant::now(),
        };
        match self.refused() {
            Some(why) => Err(Error::new(ErrorKind::Io, why)),
            None => Ok(waiting),
        }
    }
}

/// A request sent to the members.
struct Waiting {
    primary: Arc<Primary>,
    acks: Arc<Acks>,
    sent: Instant,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut n = self.primary.inflight.lock().expect("not poisoned");
        *n -= 1;
        // Only a pause waits for none in flight (it sets `paused` before it takes the lock).
        if *n == 0 && self.primary.paused.load(Ordering::SeqCst) {
            self.primary.idle.notify_all();
        }
    }
}

impl Pending for Waiting {
    fn wait(self: Box<Self>) -> ferrite_engine::Result<()> {
        let p = &self.primary;
        let started = Instant::now();
        let bad = self.acks.wait_until(self.sent + p.timeout);
        if !bad.is_empty() {
            let hub = p.hub.upgrade().ok_or_else(stopping)?;
            hub.rt.block_on(p.eject_all(bad))?;
        }
        p.added.observe(started.elapsed());
        Ok(())
    }

    fn then(self: Box<Self>, done: Box<dyn FnOnce(ferrite_engine::Result<()>) + Send>) {
        let started = Instant::now();
        let acks = Arc::clone(&self.acks);
        acks.then(move |bad| {
            let p = Arc::clone(&self.primary);
            if bad.is_empty() {
                p.added.observe(started.elapsed());
                drop(self);
                return done(Ok(()));
            }
            // An ejection waits for a majority to record it: not on the ack reader.
            let Some(hub) = p.hub.upgrade() else { return done(Err(stopping())) };
            hub.rt.spawn(async move {
                let r = p.eject_all(bad).await;
                p.added.observe(started.elapsed());
                drop(self);
                done(r);
            });
        });
    }
}

fn stopping() -> Error {
    Error::new(ErrorKind::Closed, "the daemon is stopping")
}

impl Primary {
    /// Ejects the members that failed a request or did not answer it: Ok once none of them
    /// gets writes any more.
    async fn eject_all(&self, bad: super::link::Failed) -> ferrite_engine::Result<()> {
        for (member, why) in bad {
            self.eject(&member, &why).await.map_err(|e| Error::new(ErrorKind::Io, e))?;
        }
        Ok(())
    }
}
