//! The member's side: the `Mirror` gRPC service on the admin listeners (mutual TLS on TCP, the
//! fence list, connection limits). A stream is accepted only from the primary the member's own
//! membership names, at the generation it holds, and only while this member gets writes in it;
//! requests are applied on the blocking pool, at most [`IN_FLIGHT`] at a time, and acknowledged
//! once applied (durable for FUA and flush). A membership is stored only from the primary it
//! names, only with a higher generation, and never makes this daemon primary (only a promotion
//! here does).

use std::sync::Arc;

use ferrite_engine::Volume;
use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::{
    Membership as PbMembership, MembershipRequest, MirrorAck, MirrorMessage, RecordReply, mirror_server,
};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::SyncHub;
use super::records::{Membership, State};
use crate::authz::{Caller, caller_of};
use crate::rpc::{blocking, status};

/// Requests a stream applies at once; the stream reads no further while they are all busy.
const IN_FLIGHT: usize = 64;

#[derive(Debug, Clone)]
pub struct MirrorService(pub Arc<SyncHub>);

impl MirrorService {
    /// Refuses `caller` unless it may act as the member at `endpoint`.
    fn check_is(&self, caller: &Caller, endpoint: &str, call: &str) -> Result<(), Status> {
        let hub = &self.0;
        match hub.identity(endpoint) {
            Some(id) if caller.is_peer(&id) => Ok(()),
            _ => Err(hub.policy.refuse(caller, call, &format!("it is not {endpoint}, the primary of this membership"))),
        }
    }

    /// The membership `volume` holds here while `primary` may still write to this member.
    fn still_writer(&self, volume: &str, primary: &str) -> Result<Membership, Status> {
        let hub = &self.0;
        let held = hub
            .records
            .get(volume)
            .ok_or_else(|| Status::not_found(format!("volume {volume:?} has no synchronous membership here")))?;
        if held.primary != primary {
            return Err(Status::failed_precondition(format!(
                "stale primary: generation {} here names {} the primary of {volume:?}",
                held.generation, held.primary
            )));
        }
        match held.state_of(&hub.me) {
            Some(State::InSync | State::Rebuilding) => Ok(held),
            s => Err(Status::failed_precondition(format!(
                "this member is {} at generation {} of {volume:?}",
                s.map_or("not a member", State::as_str),
                held.generation
            ))),
        }
    }
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
        Op::Zero(z) if z.allocate => write_zero_data(volume, z.offset, z.length, z.fua),
        Op::Zero(z) => volume.write_zeroes(z.offset, z.length, z.fua),
        Op::Flush(_) => volume.flush(),
        Op::Open(_) => return Err("the stream is already open".into()),
    };
    r.map_err(|e| e.to_string())
}

/// Zeroes that stay allocated, as the primary wrote them: zero data, 1 MiB at a time.
fn write_zero_data(volume: &Volume, offset: u64, len: u64, fua: bool) -> ferrite_engine::Result<()> {
    let zeros = vec![0u8; usize::try_from(len.min(1 << 20)).expect("at most 1 MiB")];
    let mut at = offset;
    while at < offset + len {
        let n = usize::try_from((offset + len - at).min(zeros.len() as u64)).expect("at most 1 MiB");
        if fua {
            volume.write_fua(at, &zeros[..n])?
        } else {
            volume.write(at, &zeros[..n])?
        }
        at += n as u64;
    }
    Ok(())
}

#[tonic::async_trait]
impl mirror_server::Mirror for MirrorService {
    type StreamStream = ReceiverStream<Result<MirrorAck, Status>>;

    async fn stream(&self, req: Request<Streaming<MirrorMessage>>) -> Result<Response<Self::StreamStream>, Status> {
        const CALL: &str = "/ferrite.v1.Mirror/Stream";
        let caller = caller_of(&req)?;
        let mut inbound = req.into_inner();
        let first = tokio::time::timeout(self.0.timeout, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no open on the stream"))??;
        let Some(MirrorMessage { op: Some(Op::Open(open)), .. }) = first else {
            return Err(Status::invalid_argument("a mirror stream starts with an open"));
        };
        let held =
            self.0.records.get(&open.volume).ok_or_else(|| {
                Status::not_found(format!("volume {:?} has no synchronous membership here", open.volume))
            })?;
        self.check_is(&caller, &held.primary, CALL)?;
        if open.generation != held.generation {
            return Err(Status::failed_precondition(format!(
                "stale generation {}: this member holds generation {} of {:?} (primary {})",
                open.generation, held.generation, open.volume, held.primary
            )));
        }
        self.still_writer(&open.volume, &held.primary)?;
        let volume = self.0.pool.open_volume(&open.volume).map_err(status)?.past_read_only();
        let (tx, rx) = mpsc::channel(2 * IN_FLIGHT);
        let svc = self.clone();
        tokio::spawn(async move {
            let slots = Arc::new(Semaphore::new(IN_FLIGHT));
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::info!(volume = %open.volume, error = %e.message(), "mirror stream ended");
                        break;
                    }
                };
                // A promotion elsewhere, or an ejection of this member, ends the stream: it
                // never applies a request of a primary that is no longer its primary.
                if let Err(e) = svc.still_writer(&open.volume, &held.primary) {
                    let _ = tx.send(Err(e)).await;
                    break;
                }
                let Some(op) = msg.op else {
                    let _ = tx.send(Err(Status::invalid_argument("a mirror message without a request"))).await;
                    break;
                };
                let permit = Arc::clone(&slots).acquire_owned().await.expect("never closed");
                let (volume, tx, seq) = (volume.clone(), tx.clone(), msg.seq);
                tokio::task::spawn_blocking(move || {
                    let error = apply(&volume, op).err().unwrap_or_default();
                    drop(permit);
                    let _ = tx.blocking_send(Ok(MirrorAck { seq, error }));
                });
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn record(&self, req: Request<PbMembership>) -> Result<Response<RecordReply>, Status> {
        const CALL: &str = "/ferrite.v1.Mirror/Record";
        let caller = caller_of(&req)?;
        let hub = &self.0;
        let next = Membership::from_proto(req.get_ref()).map_err(Status::invalid_argument)?;
        crate::replica::check_name("volume", &next.volume)?;
        if hub.me.is_empty() {
            return Err(Status::failed_precondition("replication-endpoint is not set on this daemon"));
        }
        self.check_is(&caller, &next.primary, CALL)?;
        if next.primary == hub.me {
            return Err(hub.policy.refuse(&caller, CALL, "only a promotion on this daemon makes it the primary"));
        }
        let Some(mine) = next.state_of(&hub.me) else {
            return Err(Status::invalid_argument(format!("{} is not a member of that membership", hub.me)));
        };
        let _op = hub.op_lock(&next.volume);
        let _op = _op.lock().await;
        let held = hub.records.get(&next.volume);
        match &held {
            Some(h) if h.state_of(&next.primary).is_none() => {
                return Err(hub.policy.refuse(
                    &caller,
                    CALL,
                    &format!("{} is not a member of {:?} here", next.primary, next.volume),
                ));
            }
            Some(h) if next.generation <= h.generation => {
                return Ok(Response::new(RecordReply { stored: false, held: Some(h.to_proto()) }));
            }
            // A new primary must hold every acknowledged write as far as this member knows: a
            // member ejected here cannot make itself primary by telling the others so.
            // Refused with what this member holds, so a failed-over primary learns it was.
            Some(h) if h.primary != next.primary && h.state_of(&next.primary) != Some(State::InSync) => {
                let why = format!(
                    "{} is {} at generation {} here: a stale member cannot become primary",
                    next.primary,
                    h.state_of(&next.primary).map_or("no member", State::as_str),
                    h.generation
                );
                drop(hub.policy.refuse(&caller, CALL, &why));
                return Ok(Response::new(RecordReply { stored: false, held: Some(h.to_proto()) }));
            }
            Some(_) => {}
            None if mine == State::Witness => {}
            None => hub.create_replica(&next).await?,
        }
        if held.as_ref().is_some_and(|h| h.primary == hub.me) {
            hub.step_down(&next.volume, &format!("generation {} names {} the primary", next.generation, next.primary));
        }
        hub.records.put(next.clone())?;
        tracing::info!(volume = %next.volume, generation = next.generation, primary = %next.primary,
            state = mine.as_str(), "synchronous membership recorded");
        Ok(Response::new(RecordReply { stored: true, held: Some(next.to_proto()) }))
    }

    async fn get(&self, req: Request<MembershipRequest>) -> Result<Response<PbMembership>, Status> {
        const CALL: &str = "/ferrite.v1.Mirror/Get";
        let caller = caller_of(&req)?;
        let hub = &self.0;
        let Some(held) = hub.records.get(&req.get_ref().volume) else {
            return Ok(Response::new(PbMembership::default()));
        };
        let member = held.members.iter().any(|m| hub.identity(&m.endpoint).is_some_and(|id| caller.is_peer(&id)));
        if !member && !caller.is_operator() {
            return Err(hub.policy.refuse(&caller, CALL, "it is no member of that volume"));
        }
        Ok(Response::new(held.to_proto()))
    }
}

impl SyncHub {
    /// Makes the replica volume of a first membership here: it must not exist yet (a member
    /// never takes over a volume it did not create), is bounded by the pool, and is read-only
    /// to clients.
    async fn create_replica(&self, rec: &Membership) -> Result<(), Status> {
        let most = crate::replica::largest_replica(&self.pool, self.overcommit);
        if rec.size == 0 || rec.size > most {
            return Err(Status::invalid_argument(format!(
                "volume size {} is out of bounds here (at most {most}: the pool's size times its overcommit cap)",
                rec.size
            )));
        }
        let (pool, name, size) = (Arc::clone(&self.pool), rec.volume.clone(), rec.size);
        blocking(move || {
            if pool.volume_info(&name).is_ok() {
                return Err(ferrite_engine::Error::new(
                    ferrite_engine::ErrorKind::AlreadyExists,
                    format!("volume {name:?} exists here and is no synchronous replica: a member never takes over a volume it did not create"),
                ));
            }
            pool.create_volume(&name, size)?;
            pool.set_read_only(&name, true).map(drop)
        })
        .await
    }
}
