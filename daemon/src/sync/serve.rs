//! The member's side: the calls of the `Mirror` service on the admin listeners (mutual TLS on
//! TCP, the fence list, connection limits; its gRPC face is `api/mirror.rs`), and the same stream
//! as a framed connection on them ([`wire`], what primaries use). A stream is accepted only from the primary the member's own membership
//! names, at the generation it holds, and only while this member gets writes in it; small writes
//! are applied on the stream's task, other requests on the blocking pool (at most [`IN_FLIGHT`] at
//! a time), each acknowledged once applied (durable for FUA and flush). A membership is stored only
//! from the primary it names, only with a higher generation, never as the first one of a volume
//! that exists here, and never makes this daemon primary (only a promotion here does); the
//! whole rule is `MirrorService::may_change` and docs/design/replication.md "Trust".

use std::future::Future;
use std::sync::Arc;

use ferrite_engine::{Pool, Volume};
use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::{
    Membership as PbMembership, MirrorAck, MirrorMessage, RebuildMessage, RebuildReply, RecordReply, rebuild_message,
};
use ferrite_replication::Piece;
use tokio::io::AsyncRead;
use tokio::sync::Semaphore;
use tokio_stream::{Stream, StreamExt};

use super::SyncHub;
use super::ack_sink::AckSink;
use super::applied::{Applied, ack_of};
use super::catch_up::CatchUp;
use super::records::{Membership, State};
use super::wire::{self, Frames};
use crate::authz::Caller;
use crate::base::error::{Error, Kind, blocking};
use crate::net::listen::Guarded;

/// Requests a stream applies at once; the stream reads no further while they are all busy.
const IN_FLIGHT: u32 = 64;

/// Acks a gRPC stream queues before the member stops applying requests.
pub const STREAM_ACKS: usize = 2 * IN_FLIGHT as usize;

/// A rebuild that sends nothing for this long is ended.
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct MirrorService(pub Arc<SyncHub>);

impl MirrorService {
    /// Refuses `caller` unless it may act as the member at `endpoint`.
    fn check_is(&self, caller: &Caller, endpoint: &str, call: &str) -> Result<(), Error> {
        let hub = &self.0;
        match hub.identity(endpoint) {
            Some(id) if caller.is_peer(&id) => Ok(()),
            _ => Err(hub
                .policy
                .refuse(caller, call, &format!("it is not {endpoint}, the primary of this membership"))
                .into()),
        }
    }

    /// The membership `volume` holds here while `primary` may still write to this member.
    fn still_writer(&self, volume: &str, primary: &str) -> Result<Membership, Error> {
        let hub = &self.0;
        let held = hub
            .records
            .get(volume)
            .ok_or_else(|| Error::not_found(format!("volume {volume:?} has no synchronous membership here")))?;
        if held.primary != primary {
            return Err(Error::refused(format!(
                "stale primary: generation {} here names {} the primary of {volume:?}",
                held.generation, held.primary
            )));
        }
        match held.state_of(&hub.me) {
            Some(State::InSync | State::Rebuilding) => Ok(held),
            s => Err(Error::refused(format!(
                "this member is {} at generation {} of {volume:?}",
                s.map_or("not a member", State::as_str),
                held.generation
            ))),
        }
    }

    /// Whether `next` (a later generation, proposed by its primary, the caller) may replace
    /// `held` here: from the same primary; or a promotion of a member in sync here; or, where
    /// `held` is this daemon's own proposal and it no longer takes writes as primary, a
    /// membership that leaves it out of sync (its proposal did not win: a majority moved on,
    /// and its copy is rebuilt from the new primary). A witness never turns into a copy.
    fn may_change(&self, held: &Membership, next: &Membership, mine: State) -> Result<(), String> {
        let hub = &self.0;
        let (volume, by) = (&next.volume, &next.primary);
        if held.state_of(&hub.me) == Some(State::Witness) && mine != State::Witness {
            return Err(format!("this daemon is a witness of {volume:?}: it never becomes a copy of it"));
        }
        let stepped_down = held.primary == hub.me
            && hub.primary(volume).is_none_or(|p| p.refused().is_some())
            && mine != State::InSync;
        match held.state_of(by) {
            None => Err(format!("{by} is not a member of {volume:?} here")),
            _ if held.primary == *by || stepped_down => Ok(()),
            Some(State::InSync) => Ok(()),
            Some(s) => Err(format!(
                "{by} is {} at generation {} here: a stale member cannot become primary",
                s.as_str(),
                held.generation
            )),
        }
    }

    /// A membership without this member, from its primary (checked by the caller) in a later
    /// generation: it was removed, and forgets the volume's membership (the copy stays). The
    /// primary is the one held here, or a member in sync here (promoted while this member was
    /// away), or this daemon was the primary and takes no writes: the same primaries whose
    /// memberships it would take as a member.
    async fn removed(&self, next: Membership) -> Result<RecordReply, Error> {
        let hub = &self.0;
        let _op = hub.op_lock(&next.volume);
        let _op = _op.lock().await;
        let from_its_primary = |h: &Membership| {
            h.primary == next.primary
                || h.state_of(&next.primary) == Some(State::InSync)
                || (h.primary == hub.me && hub.primary(&next.volume).is_none_or(|p| p.refused().is_some()))
        };
        match hub.records.get(&next.volume) {
            Some(h) if from_its_primary(&h) && next.outranks(&h) => {
                hub.step_down(&next.volume, "removed from the synchronous members");
                hub.records.set(&next.volume, None)?;
                hub.drop_marks(&next.volume).await;
                tracing::info!(volume = %next.volume, generation = next.generation, primary = %next.primary,
                    "removed from the synchronous members: the copy here stays, read-only");
                Ok(RecordReply { stored: true, held: Some(next.to_proto()) })
            }
            _ => Err(Error::invalid(format!("{} is not a member of that membership", hub.me))),
        }
    }
}

/// A member's handle on its copy: past its read-only flag, and for an encrypted volume one
/// that writes the ciphertext the primary sends as it is (a member holds no key).
fn member_volume(pool: &Pool, name: &str) -> ferrite_engine::Result<Volume> {
    let v = pool.open_volume(name)?.past_read_only();
    Ok(if v.is_encrypted()? { v.ciphertext() } else { v })
}

/// Applies one request to the member's copy.
fn apply(volume: &Volume, op: Op) -> Result<(), String> {
    let r = match op {
        Op::Write(w) => {
            if crc32c::crc32c(&w.data) != w.crc {
                return Err(format!("the write at {} arrived damaged (crc mismatch)", w.offset));
            }
            if w.fua { volume.write_fua(w.offset, &w.data) } else { volume.write(w.offset, &w.data) }
        }
        Op::Trim(t) => volume.trim(t.offset, t.length),
        Op::Zero(z) if z.allocate => volume.write_zero_data(z.offset, z.length, z.fua),
        Op::Zero(z) => volume.write_zeroes(z.offset, z.length, z.fua),
        Op::Flush(_) => volume.flush(),
        Op::Open(_) => return Err("the stream is already open".into()),
        Op::Mark(_) => return Err("a mark is taken by the stream".into()),
    };
    r.map_err(|e| e.to_string())
}

/// Whether the engine takes a request in memory without waiting for the device (as NBD's loop
/// runs it in place): a write that is not FUA, no longer than NBD's loop runs.
fn runs_now(op: &Op) -> bool {
    matches!(op, Op::Write(w) if !w.fua && w.data.len() <= ferrite_nbd::inbox::MAX_HELD_WRITE as usize)
}

/// The bytes a request changes, and whether only its whole blocks change (a trim); None for a
/// flush.
fn op_range(op: &Op) -> Option<(u64, u64, bool)> {
    match op {
        Op::Write(w) => Some((w.offset, w.data.len() as u64, false)),
        Op::Zero(z) => Some((z.offset, z.length, false)),
        Op::Trim(t) => Some((t.offset, t.length, true)),
        Op::Flush(_) | Op::Open(_) | Op::Mark(_) => None,
    }
}

/// Where a stream's requests come from: the gRPC stream, or a framed connection.
pub trait Inbound: Send + 'static {
    fn message(&mut self) -> impl Future<Output = Result<Option<MirrorMessage>, String>> + Send;
    /// Whether the next message has arrived already (the batch goes on).
    fn ready(&self) -> bool;
}

impl<R: AsyncRead + Unpin + Send + 'static> Inbound for Frames<R, MirrorMessage> {
    async fn message(&mut self) -> Result<Option<MirrorMessage>, String> {
        self.next().await
    }

    fn ready(&self) -> bool {
        self.has_frame()
    }
}

/// A stream the member took: for which volume, from which primary, and where its writes go.
pub(super) struct Opened {
    volume_name: String,
    primary: String,
    volume: Volume,
    catch_up: Option<Arc<CatchUp>>,
    /// The primary takes cumulative acks: what has been applied.
    cumulative: Option<Arc<Applied>>,
}

#[cfg(test)]
impl Opened {
    /// A stream of `volume` from `primary` with cumulative acks, as `accept` opens it.
    pub(super) fn plain(volume_name: &str, primary: &str, volume: Volume) -> Self {
        let (volume_name, primary) = (volume_name.to_owned(), primary.to_owned());
        Self { volume_name, primary, volume, catch_up: None, cumulative: Some(Arc::default()) }
    }
}

const STREAM: &str = "/ferrite.v1.Mirror/Stream";

impl MirrorService {
    /// Takes the open a stream starts with, from `caller`, or refuses it saying why.
    async fn accept(&self, caller: &Caller, inbound: &mut impl Inbound) -> Result<Opened, Error> {
        let first = tokio::time::timeout(self.0.timeout, inbound.message())
            .await
            .map_err(|_| Error::new(Kind::TimedOut, "no open on the stream"))?
            .map_err(Error::unavailable)?;
        let Some(MirrorMessage { op: Some(Op::Open(open)), .. }) = first else {
            return Err(Error::invalid("a mirror stream starts with an open"));
        };
        let held =
            self.0.records.get(&open.volume).ok_or_else(|| {
                Error::not_found(format!("volume {:?} has no synchronous membership here", open.volume))
            })?;
        self.check_is(caller, &held.primary, STREAM)?;
        if open.generation != held.generation {
            return Err(Error::refused(format!(
                "stale generation {}: this member holds generation {} of {:?} (primary {})",
                open.generation, held.generation, open.volume, held.primary
            )));
        }
        let state = self.still_writer(&open.volume, &held.primary)?.state_of(&self.0.me);
        let volume = member_volume(&self.0.pool, &open.volume).map_err(Error::from)?;
        let catch_up = match (open.rebuild, state) {
            (false, _) => None,
            (true, Some(State::Rebuilding)) => Some(self.0.start_catch_up(&volume, &open.base).await?),
            (true, _) => {
                return Err(Error::refused("only a member being rebuilt opens a stream for a rebuild"));
            }
        };
        let cumulative = open.cumulative_acks.then(Arc::default);
        Ok(Opened { volume_name: open.volume, primary: held.primary, volume, catch_up, cumulative })
    }

    /// Applies the requests of an opened stream as they come; their acks (and an error that
    /// ends the stream) go to `acks`, held for a batch: until no request waits to be read.
    pub(super) async fn apply_all(self, s: Opened, mut inbound: impl Inbound, acks: AckSink) {
        let slots = Arc::new(Semaphore::new(IN_FLIGHT as usize));
        let mut checked = u64::MAX;
        loop {
            if !inbound.ready() && !acks.flush() {
                break;
            }
            acks.room().await;
            let msg = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::info!(volume = %s.volume_name, error = %e, "mirror stream ended");
                    break;
                }
            };
            if msg.seq == 0 && msg.op.is_none() {
                continue; // a keepalive
            }
            // A promotion elsewhere, or an ejection of this member, ends the stream: it never
            // applies a request of a primary that is no longer its primary. (The records are
            // checked again only when they changed.)
            let changes = self.0.records.changes();
            if changes != checked {
                if let Err(e) = self.still_writer(&s.volume_name, &s.primary) {
                    acks.fail(e).await;
                    break;
                }
                checked = changes;
            }
            if let Some(a) = s.cumulative.as_deref().filter(|a| !a.follows(msg.seq)) {
                let why = format!("request {} came after a newer one (through {})", msg.seq, a.through());
                acks.fail(Error::invalid(why)).await;
                break;
            }
            let Some(op) = msg.op else {
                acks.fail(Error::invalid("a mirror message without a request")).await;
                break;
            };
            if let Op::Mark(m) = op {
                // Every earlier request applied, none later (the primary waits for this ack).
                let all = Arc::clone(&slots).acquire_many_owned(IN_FLIGHT).await.expect("never closed");
                let taken = match m.kept {
                    true => self.0.take_kept(&s.volume_name, &m.snapshot).await,
                    false => self.0.take_mark(&s.volume_name, &m.snapshot).await,
                };
                let error = taken.err().unwrap_or_default();
                drop(all);
                acks.send(MirrorAck { seq: msg.seq, error, through: 0 }).await;
                continue;
            }
            if s.catch_up.is_none() && runs_now(&op) {
                // Taken in memory by the engine: no thread hop. A success counts as received
                // before its cumulative ack; a failure only once its own ack is queued, so no
                // cumulative ack covers it first.
                let r = apply(&s.volume, op);
                let (ok, count) = (r.is_ok(), |a: &Applied| a.received(msg.seq, false));
                if ok {
                    s.cumulative.as_deref().map(count);
                }
                if let Some(ack) = ack_of(msg.seq, r, s.cumulative.as_deref())
                    && !acks.send(ack).await
                {
                    break;
                }
                if !ok {
                    s.cumulative.as_deref().map(count);
                }
                continue;
            }
            if let Some(a) = &s.cumulative {
                a.received(msg.seq, true);
            }
            let permit = Arc::clone(&slots).acquire_owned().await.expect("never closed");
            let (volume, acks, seq, catch_up) = (s.volume.clone(), acks.clone(), msg.seq, s.catch_up.clone());
            let cumulative = s.cumulative.clone();
            tokio::task::spawn_blocking(move || {
                let r = match (&catch_up, op_range(&op)) {
                    (Some(c), Some((offset, len, whole_only))) => {
                        c.write(offset, len, whole_only, || apply(&volume, op))
                    }
                    _ => apply(&volume, op),
                };
                drop(permit);
                let send = |ack: Option<MirrorAck>| ack.map(|ack| acks.send_blocking(ack));
                if r.is_err() || cumulative.is_none() {
                    // A failure is queued before it leaves `running`: no cumulative ack covers
                    // it first.
                    send(ack_of(seq, r, None));
                }
                if let Some(a) = &cumulative {
                    a.finished(seq);
                    // This request, and the newer ones that finished while it ran.
                    send(ack_of(seq, Ok(()), Some(a)));
                }
            });
        }
    }
}

/// Serves a framed mirror connection (the admin listener's clients that chose [`wire::ALPN`]):
/// the caller's role is checked as the gRPC layer checks a call, then the stream runs as over
/// gRPC; its first ack says whether the open was taken.
pub async fn serve_framed(svc: MirrorService, conn: Guarded) {
    let caller = svc.0.policy.caller(&conn.info().names);
    let (r, w) = tokio::io::split(conn);
    let mut inbound = Frames::new(r, Some(wire::IDLE));
    let acks = AckSink::framed(w);
    let opened = match svc.0.policy.check(&caller, STREAM) {
        Ok(()) => svc.accept(&caller, &mut inbound).await,
        Err(e) => Err(e.into()),
    };
    match opened {
        Ok(s) => {
            if acks.send(MirrorAck { seq: 0, error: String::new(), through: 0 }).await {
                svc.apply_all(s, inbound, acks.clone()).await;
            }
        }
        Err(e) => acks.fail(e).await,
    }
    acks.close();
}

/// The calls of the `Mirror` service (its gRPC face is `api/mirror.rs`).
impl MirrorService {
    /// The same stream over gRPC (primaries use the framed connection; see [`wire`]): once
    /// `caller`'s open is taken, its requests are applied in a task of their own, their acks
    /// going to `acks`.
    pub async fn stream(&self, caller: &Caller, mut inbound: impl Inbound, acks: AckSink) -> Result<(), Error> {
        let s = self.accept(caller, &mut inbound).await?;
        tokio::spawn(self.clone().apply_all(s, inbound, acks));
        Ok(())
    }

    /// Stores membership `next` as `caller` proposes it, if the rule lets it.
    pub async fn record(&self, caller: &Caller, next: &PbMembership) -> Result<RecordReply, Error> {
        const CALL: &str = "/ferrite.v1.Mirror/Record";
        let hub = &self.0;
        let next = Membership::from_proto(next).map_err(Error::invalid)?;
        crate::replica::check_name("volume", &next.volume)?;
        if hub.me.is_empty() {
            return Err(Error::refused("replication-endpoint is not set on this daemon"));
        }
        self.check_is(caller, &next.primary, CALL)?;
        if next.primary == hub.me {
            return Err(hub.policy.refuse(caller, CALL, "only a promotion on this daemon makes it the primary").into());
        }
        let Some(mine) = next.state_of(&hub.me) else {
            return self.removed(next).await;
        };
        let _op = hub.op_lock(&next.volume);
        let _op = _op.lock().await;
        let held = hub.records.get(&next.volume);
        match &held {
            None => {
                let made = hub.records.all().iter().filter(|r| r.primary == next.primary).count();
                if made >= hub.quota {
                    let why = format!(
                        "{} is the primary of {made} memberships here (peer-quota {})",
                        next.primary, hub.quota
                    );
                    return Err(hub.policy.exhausted(caller, CALL, &why).into());
                }
                if mine != State::Witness {
                    hub.check_size(next.size)?;
                    hub.check_share(caller, &next.primary, next.size, CALL)?;
                }
                hub.create_member(&next, mine).await?;
            }
            Some(h) if !next.outranks(h) => {
                return Ok(RecordReply { stored: false, held: Some(h.to_proto()) });
            }
            Some(h) => {
                if let Err(why) = self.may_change(h, &next, mine) {
                    // Answered with what this member holds (a failed-over primary learns it
                    // was), unless the caller is no member at all.
                    let refused = hub.policy.refuse(caller, CALL, &why);
                    return match h.state_of(&next.primary) {
                        None => Err(refused.into()),
                        Some(_) => Ok(RecordReply { stored: false, held: Some(h.to_proto()) }),
                    };
                }
            }
        }
        // A larger size (the primary grows the volume): this copy first, so that no write the
        // new size allows can fail here.
        if let Some(h) = &held
            && next.size > h.size
            && mine != State::Witness
        {
            hub.check_size(next.size)?;
            hub.check_share(caller, &next.primary, next.size - h.size, CALL)?;
            let (pool, name, size) = (Arc::clone(&hub.pool), next.volume.clone(), next.size);
            blocking(move || pool.grow_volume(&name, size).map(drop)).await?;
        }
        if held.is_some() && mine != State::Witness {
            hub.follow_key(&next).await?;
        }
        if held.as_ref().is_some_and(|h| h.primary == hub.me) {
            hub.step_down(&next.volume, &format!("generation {} names {} the primary", next.generation, next.primary));
        }
        hub.records.put(next.clone())?;
        tracing::info!(volume = %next.volume, generation = next.generation, primary = %next.primary,
            state = mine.as_str(), "synchronous membership recorded");
        Ok(RecordReply { stored: true, held: Some(next.to_proto()) })
    }

    /// The membership of `volume` held here, as `caller` may see it.
    pub async fn get(&self, caller: &Caller, volume: &str) -> PbMembership {
        const CALL: &str = "/ferrite.v1.Mirror/Get";
        let hub = &self.0;
        let Some(held) = hub.records.get(volume) else {
            return PbMembership::default();
        };
        let member = held.members.iter().any(|m| hub.identity(&m.endpoint).is_some_and(|id| caller.is_peer(&id)));
        if !member && !caller.is_operator() {
            // A peer outside the membership learns nothing of it: it is answered as if none
            // were held. Such a caller is usually a removed member that came back and asks its
            // old peers until its primary tells it; a refusal would log an attack each second.
            tracing::debug!(volume = %held.volume, %caller, call = CALL, "a non-member asked: answered with none");
            return PbMembership::default();
        }
        let mut p = held.to_proto();
        p.marks = hub.marks(&held.volume).await;
        p
    }

    /// Applies the pieces of a rebuild `caller` sends to this member.
    pub async fn rebuild(
        &self,
        caller: &Caller,
        mut inbound: impl Stream<Item = Result<RebuildMessage, Error>> + Unpin,
    ) -> Result<RebuildReply, Error> {
        const CALL: &str = "/ferrite.v1.Mirror/Rebuild";
        let hub = &self.0;
        let first = tokio::time::timeout(hub.timeout, inbound.next())
            .await
            .map_err(|_| Error::new(Kind::TimedOut, "no begin on the rebuild"))?
            .transpose()?;
        let Some(RebuildMessage { msg: Some(rebuild_message::Msg::Begin(begin)) }) = first else {
            return Err(Error::invalid("a rebuild starts with a begin"));
        };
        let held = hub
            .records
            .get(&begin.volume)
            .ok_or_else(|| Error::not_found(format!("volume {:?} has no synchronous membership here", begin.volume)))?;
        self.check_is(caller, &held.primary, CALL)?;
        if begin.generation != held.generation || held.state_of(&hub.me) != Some(State::Rebuilding) {
            return Err(Error::refused(format!(
                "this member is not being rebuilt at generation {} of {:?}",
                begin.generation, begin.volume
            )));
        }
        let catch_up = hub
            .catch_ups
            .lock()
            .expect("not poisoned")
            .get(&begin.volume)
            .cloned()
            .ok_or_else(|| Error::refused("no stream was opened for this rebuild (the member restarted?)"))?;
        let volume = member_volume(&hub.pool, &begin.volume).map_err(Error::from)?;
        let size = volume.size().map_err(Error::from)?;
        let (mut next, mut data_bytes) = (0u64, 0u64);
        loop {
            let msg = tokio::time::timeout(IDLE, inbound.next())
                .await
                .map_err(|_| Error::new(Kind::TimedOut, "the rebuild sent nothing for a minute"))?
                .transpose()?
                .ok_or_else(|| Error::busy("the rebuild ended before its end"))?;
            let piece = match msg.msg {
                Some(rebuild_message::Msg::Data(d)) => Piece::Data { offset: d.offset, data: d.data, crcs: d.crcs },
                Some(rebuild_message::Msg::Zero(z)) => Piece::Zero { offset: z.offset, len: z.length },
                Some(rebuild_message::Msg::End(_)) if next <= begin.end => break,
                _ => return Err(Error::invalid("a rebuild message out of place")),
            };
            let (offset, len) = piece.range();
            if offset < next || offset.checked_add(len).is_none_or(|e| e > size) {
                return Err(Error::invalid(format!(
                    "a piece at {offset} of {len} bytes is out of order or past the end"
                )));
            }
            next = offset + len;
            let (c, v) = (Arc::clone(&catch_up), volume.clone());
            data_bytes += blocking(move || {
                c.piece(&v, &piece).map_err(|e| ferrite_engine::Error::new(ferrite_engine::ErrorKind::Io, e))
            })
            .await?;
        }
        let v = volume.clone();
        blocking(move || v.flush()).await?;
        hub.catch_ups.lock().expect("not poisoned").remove(&begin.volume);
        tracing::info!(volume = %begin.volume, data_bytes, "rebuilt up to the primary's point");
        Ok(RebuildReply { data_bytes })
    }
}

impl SyncHub {
    /// The marks of `volume` here, oldest first.
    pub async fn marks(&self, volume: &str) -> Vec<String> {
        let (pool, v) = (Arc::clone(&self.pool), volume.to_owned());
        let prefix = super::mark_prefix(volume);
        let all = blocking(move || pool.snapshots(Some(&v))).await.unwrap_or_default();
        all.into_iter().map(|s| s.name).filter(|n| n.starts_with(&prefix)).collect()
    }

    /// Deletes every mark of `volume` here (it left the membership: they mean nothing now).
    pub async fn drop_marks(&self, volume: &str) {
        for m in self.marks(volume).await {
            let (pool, name) = (Arc::clone(&self.pool), m.clone());
            if let Err(e) = blocking(move || pool.delete_snapshot(&name)).await {
                tracing::warn!(volume, mark = %m, error = %e.message(), "could not drop a mark");
            }
        }
    }

    /// Takes mark `name` of `volume` (every earlier request applied), and drops this member's
    /// older marks but the one before it.
    async fn take_mark(&self, volume: &str, name: &str) -> Result<(), String> {
        if !name.starts_with(&super::mark_prefix(volume)) || name.len() > 255 {
            return Err(format!("{name:?} is no mark of {volume:?}"));
        }
        let (pool, v, n) = (Arc::clone(&self.pool), volume.to_owned(), name.to_owned());
        blocking(move || pool.create_snapshot(&v, &n).map(drop)).await.map_err(|e| e.message().to_owned())?;
        let marks = self.marks(volume).await;
        for old in marks.iter().take(marks.len().saturating_sub(2)) {
            let (pool, old) = (Arc::clone(&self.pool), old.clone());
            if let Err(e) = blocking(move || pool.delete_snapshot(&old)).await {
                tracing::warn!(volume, error = %e.message(), "could not drop an older mark");
            }
        }
        Ok(())
    }

    /// Takes the user's snapshot `name` of `volume`, at the point the primary took it.
    async fn take_kept(&self, volume: &str, name: &str) -> Result<(), String> {
        crate::replica::check_name("snapshot", name).map_err(|e| e.message().to_owned())?;
        if name.starts_with(&super::mark_prefix(volume)) {
            return Err(format!("{name:?} is a mark's name, not a snapshot's"));
        }
        let (pool, v, n) = (Arc::clone(&self.pool), volume.to_owned(), name.to_owned());
        blocking(move || pool.create_snapshot(&v, &n).map(drop)).await.map_err(|e| e.message().to_owned())
    }

    /// A stream opened for a rebuild: the copy goes back to mark `base` (or, with none, holds
    /// nothing), and what the stream writes from now on is remembered against the pieces.
    async fn start_catch_up(&self, volume: &Volume, base: &str) -> Result<Arc<CatchUp>, Error> {
        let name = volume.name().to_owned();
        if !base.is_empty() && !self.marks(&name).await.iter().any(|m| m == base) {
            return Err(Error::not_found(format!("this member holds no mark {base:?} of {name:?}")));
        }
        let (pool, v, base) = (Arc::clone(&self.pool), volume.clone(), base.to_owned());
        blocking(move || {
            if base.is_empty() {
                let size = v.size()?;
                v.trim(0, size)
            } else {
                pool.rollback_volume(v.name(), &base).map(drop)
            }
        })
        .await?;
        let c = Arc::new(CatchUp::default());
        self.catch_ups.lock().expect("not poisoned").insert(name, Arc::clone(&c));
        Ok(c)
    }

    /// Keeps this member's copy wrapped as `rec` says its primary's volume is now (after a
    /// rekey there: the same data key, sealed anew); refuses a membership that disagrees with
    /// the copy on whether it is encrypted, or that names another data key.
    async fn follow_key(&self, rec: &Membership) -> Result<(), Error> {
        let (pool, name, wrapped) = (Arc::clone(&self.pool), rec.volume.clone(), rec.wrapped_key.clone());
        blocking(move || {
            let refuse = |why: String| {
                Err(ferrite_engine::Error::new(ferrite_engine::ErrorKind::InvalidArgument, format!("volume {name:?}: {why}")))
            };
            let here = pool.wrapped_key(ferrite_engine::Image::Volume(&name))?;
            match (here, wrapped.is_empty()) {
                (Some(here), false) if here == wrapped => Ok(()),
                (Some(here), false) => {
                    let decode = |b: &[u8]| ferrite_crypt::WrappedKey::decode(b).map_err(|e| e.to_string());
                    match decode(&here).and_then(|h| Ok(h.same_key(&decode(&wrapped)?))) {
                        Ok(Some(false)) => refuse("the membership names another data key: only a rekey (the same key, wrapped anew) changes it".into()),
                        Err(e) => refuse(format!("a bad wrapped key: {e}")),
                        Ok(_) => pool.follow_wrapped_keys(&name, &wrapped, &[]),
                    }
                }
                (None, true) => Ok(()),
                (here, _) => refuse(format!(
                    "it is {} here and the membership says it is {}",
                    if here.is_some() { "encrypted" } else { "plaintext" },
                    if here.is_some() { "plaintext" } else { "encrypted" }
                )),
            }
        })
        .await
    }

    /// Refuses a copy of `size` bytes unless the pool could hold it.
    fn check_size(&self, size: u64) -> Result<(), Error> {
        let most = crate::replica::largest_replica(&self.pool, self.overcommit);
        if size == 0 || size > most {
            return Err(Error::invalid(format!(
                "volume size {size} is out of bounds here (at most {most}: the pool's size times its overcommit cap)"
            )));
        }
        Ok(())
    }

    /// Refuses `adding` bytes more of copies made for `primary` past its share of the pool
    /// (`peer-space-percent`): the copies it is the primary of here, witnesses aside.
    fn check_share(&self, caller: &Caller, primary: &str, adding: u64, call: &str) -> Result<(), Error> {
        if caller.is_operator() {
            return Ok(());
        }
        let copies = self.records.all().into_iter().filter(|r| r.primary == primary);
        let held: u64 = copies.filter(|r| r.state_of(&self.me) != Some(State::Witness)).map(|r| r.size).sum();
        crate::replica::check_peer_space(&self.pool, self.overcommit, self.space_percent, held, adding)
            .map_err(|why| self.policy.exhausted(caller, call, &format!("{primary}: {why}")).into())
    }

    /// Takes a first membership of `rec`'s volume here: the volume must not exist (a member
    /// never takes over a volume it did not create, whatever its role, witness included). A
    /// copy is made bounded by the pool and read-only to clients; a witness holds no volume.
    async fn create_member(&self, rec: &Membership, mine: State) -> Result<(), Error> {
        let (pool, name) = (Arc::clone(&self.pool), rec.volume.clone());
        if blocking(move || Ok(pool.volume_info(&name).is_ok())).await? {
            return Err(Error::already_exists(format!(
                "volume {:?} exists here and is no synchronous replica: a member never takes over a volume it did not create",
                rec.volume
            )));
        }
        if mine == State::Witness {
            return Ok(());
        }
        self.check_size(rec.size)?;
        let (pool, name, size, wrapped) =
            (Arc::clone(&self.pool), rec.volume.clone(), rec.size, rec.wrapped_key.clone());
        blocking(move || {
            // An encrypted volume's copy is made with its wrapped key: locked here, written
            // with the ciphertext the primary sends, and opened with the same key-encryption
            // key once promoted.
            match wrapped.is_empty() {
                true => pool.create_volume(&name, size)?,
                false => pool.create_volume_wrapped(&name, size, &wrapped)?,
            };
            pool.set_read_only(&name, true).map(drop)
        })
        .await
    }
}
