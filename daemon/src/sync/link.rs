//! The primary's stream to one member: requests go out in order on one framed mutual-TLS
//! connection ([`super::wire`]) and acks come back by sequence number. A request waits on an
//! [`Acks`] that every member it went to answers; a stream that ends answers everything still
//! waiting on it with the reason, and a request its member has not answered within the
//! primary's timeout is answered "did not answer" by the stream's ack reader, so none waits
//! longer. Whoever waits for an [`Acks`] either blocks ([`Acks::wait_until`]) or leaves a
//! completion that the last answer runs ([`Acks::then`]), on the ack reader: no thread waits.
//! Requests go out from the sending thread ([`super::outbound`]).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use ferrite_engine::{Batch, Push};
use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::{MirrorAck, MirrorMessage, MirrorOpen};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;

use super::outbound::Outbound;
use super::wire::{self, Frames};
use crate::base::config::TlsFiles;
use crate::base::error::Error;

/// The members that failed a request or did not answer it in time, each with why.
pub type Failed = Vec<(String, String)>;

/// What runs once every member answered ([`Acks::then`]).
type Then = Box<dyn FnOnce(Failed) + Send>;

/// The members' answers to one request.
pub struct Acks {
    state: Mutex<AckState>,
    answered: Condvar,
}

struct AckState {
    waiting: Vec<String>,
    failed: Failed,
    then: Option<Then>,
    /// A thread waits in [`Acks::wait_until`]: only then does the last answer wake it (a
    /// condvar's notify is a syscall even when nobody waits).
    blocked: bool,
}

impl std::fmt::Debug for Acks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock().expect("not poisoned");
        f.debug_struct("Acks").field("waiting", &s.waiting).field("failed", &s.failed).finish_non_exhaustive()
    }
}

const LATE: &str = "did not answer within the sync timeout";

impl Acks {
    pub fn new(members: Vec<String>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(AckState { waiting: members, failed: Vec::new(), then: None, blocked: false }),
            answered: Condvar::new(),
        })
    }

    /// `member` answered: done, or failed saying why. The last answer runs the completion
    /// left by [`Acks::then`], here.
    pub fn answer(&self, member: &str, error: Option<String>) {
        let mut s = self.state.lock().expect("not poisoned");
        let Some(i) = s.waiting.iter().position(|m| m == member) else { return };
        s.waiting.swap_remove(i);
        if let Some(e) = error {
            s.failed.push((member.to_owned(), e));
        }
        if s.waiting.is_empty() {
            if s.blocked {
                self.answered.notify_all();
            }
            if let Some(then) = s.then.take() {
                let failed = std::mem::take(&mut s.failed);
                drop(s);
                then(failed);
            }
        }
    }

    /// Runs `then` with the members that failed once every member answered (at once if they
    /// all did): on the thread of the last answer, so it must be quick. The stream's timeout
    /// answers for a member that stays silent.
    pub fn then(&self, then: impl FnOnce(Failed) + Send + 'static) {
        let mut s = self.state.lock().expect("not poisoned");
        if s.waiting.is_empty() {
            let failed = std::mem::take(&mut s.failed);
            drop(s);
            then(failed);
        } else {
            s.then = Some(Box::new(then));
        }
    }

    /// Waits until every member answered or `deadline` passed: the members that failed, and
    /// those that did not answer in time, each with why.
    pub fn wait_until(&self, deadline: Instant) -> Vec<(String, String)> {
        Batch::flush();
        let mut s = self.state.lock().expect("not poisoned");
        s.blocked = true;
        while !s.waiting.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self.answered.wait_timeout(s, left).expect("not poisoned").0;
        }
        let late = s.waiting.iter().map(|m| (m.clone(), LATE.to_owned()));
        s.failed.iter().cloned().chain(late).collect()
    }
}

/// One member's stream.
#[derive(Debug)]
pub struct Link {
    pub endpoint: String,
    /// The member is being rebuilt (it gets whole blocks).
    pub rebuilding: AtomicBool,
    out: Arc<Out>,
    /// Requests sent and not answered yet, by sequence number, with when they were sent.
    waiting: Mutex<BTreeMap<u64, (Instant, Arc<Acks>)>>,
    /// How long the member has to answer a request.
    timeout: Duration,
    ended: Mutex<Option<String>>,
    /// Stops the ack reader (a member that stopped answering never closes its side).
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl Link {
    /// Opens the stream of `volume` at `generation` to the member at `endpoint`; for a rebuild
    /// (`rebuild` the base mark, empty for a full copy), the member rolls back first. A request
    /// it does not answer within `timeout` is answered as failed.
    pub async fn open(
        tls: Option<&TlsFiles>,
        endpoint: &str,
        volume: &str,
        generation: u64,
        rebuild: Option<&str>,
        timeout: Duration,
    ) -> Result<Arc<Self>, Error> {
        let at_peer = |e: String| format!("peer {endpoint}: {e}");
        let conn = wire::connect(tls, endpoint).await.map_err(|e| Error::unavailable(at_peer(e.to_string())))?;
        let (r, w) = tokio::io::split(conn);
        let open = MirrorOpen {
            volume: volume.to_owned(),
            generation,
            rebuild: rebuild.is_some(),
            base: rebuild.unwrap_or_default().to_owned(),
            cumulative_acks: true,
        };
        Self::over(r, w, endpoint, open, timeout).await
    }

    /// Opens a stream with `open` on a connection made already (its two halves).
    pub(super) async fn over(
        r: impl AsyncRead + Unpin + Send + 'static,
        w: impl AsyncWrite + Unpin + Send + 'static,
        endpoint: &str,
        open: MirrorOpen,
        timeout: Duration,
    ) -> Result<Arc<Self>, Error> {
        let at_peer = |e: String| format!("peer {endpoint}: {e}");
        let rebuild = open.rebuild;
        let mut acks = Frames::<_, MirrorAck>::new(r, None);
        let me = Arc::new(OnceLock::<Weak<Self>>::new());
        let out = Out::start(Box::new(w), true, {
            let me = Arc::clone(&me);
            move |why| me.get().and_then(Weak::upgrade).into_iter().for_each(|l| l.end(&why))
        });
        out.queue(&MirrorMessage { seq: 0, op: Some(Op::Open(open)) });
        out.push().map_err(|e| Error::unavailable(at_peer(e)))?;
        match acks.next().await {
            Ok(Some(MirrorAck { seq: 0, error, through: 0 })) if error.is_empty() => {}
            Ok(Some(MirrorAck { error, .. })) => return Err(Error::refused(at_peer(error))),
            Ok(None) => return Err(Error::unavailable(at_peer("it closed the stream".into()))),
            Err(e) => return Err(Error::unavailable(at_peer(e))),
        }
        let (stop, mut stopped) = oneshot::channel();
        let link = Arc::new(Self {
            endpoint: endpoint.to_owned(),
            rebuilding: AtomicBool::new(rebuild),
            out,
            waiting: Mutex::default(),
            timeout,
            ended: Mutex::default(),
            stop: Mutex::new(Some(stop)),
        });
        let _ = me.set(Arc::downgrade(&link));
        let l = Arc::clone(&link);
        tokio::spawn(async move {
            let mut tick =
                tokio::time::interval((timeout / 10).clamp(Duration::from_millis(10), Duration::from_millis(250)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let why = loop {
                let next = tokio::select! {
                    a = acks.next() => a,
                    _ = tick.tick() => {
                        l.expire();
                        continue;
                    }
                    _ = &mut stopped => break "the stream was ended here".to_owned(),
                };
                // Every ack that arrived, answered in one batch: the replies of all the requests
                // they answer go out together (reading a whole frame that is there never waits).
                let mut arrived = vec![next];
                while matches!(arrived.last(), Some(Ok(Some(_)))) && acks.has_frame() {
                    arrived.push(acks.next().await);
                }
                if let Some(why) = l.answer_all(arrived) {
                    break why;
                }
            };
            l.end(&why);
        });
        Ok(link)
    }

    /// Queues request `seq`, the frame `encode` appends, for the stream's next push; `acks`
    /// hears the member's answer (at once if the stream has ended). Requests are queued in
    /// sequence order.
    pub fn queue(&self, seq: u64, encode: impl FnOnce(&mut Vec<u8>), acks: &Arc<Acks>) {
        let mut waiting = self.waiting.lock().expect("not poisoned");
        // `end` records why before it answers the waiting, so a request registered here after
        // that sees the reason instead.
        if let Some(why) = self.ended.lock().expect("not poisoned").clone() {
            drop(waiting);
            acks.answer(&self.endpoint, Some(why));
            return;
        }
        waiting.insert(seq, (Instant::now(), Arc::clone(acks)));
        self.out.queue_with(encode);
    }

    /// Answers what the member sent, in one batch: why the stream ends, if it does.
    fn answer_all(&self, arrived: Vec<Result<Option<MirrorAck>, String>>) -> Option<String> {
        let _replies = Batch::hold();
        for next in arrived {
            match next {
                Ok(Some(MirrorAck { through, .. })) if through > 0 => self.answered_through(through),
                Ok(Some(MirrorAck { seq: 0, error, .. })) => {
                    return Some(format!("the member ended the stream: {error}"));
                }
                Ok(Some(a)) => self.answered(a.seq, a.error),
                Ok(None) => return Some("the member ended the stream".to_owned()),
                Err(e) => return Some(format!("the stream failed: {e}")),
            }
        }
        None
    }

    fn answered(&self, seq: u64, error: String) {
        let acks = self.waiting.lock().expect("not poisoned").remove(&seq);
        if let Some((_, a)) = acks {
            a.answer(&self.endpoint, (!error.is_empty()).then_some(error));
        }
    }

    /// The member did every request up to `through` that it did not answer on its own.
    fn answered_through(&self, through: u64) {
        let done = {
            let mut waiting = self.waiting.lock().expect("not poisoned");
            let later = waiting.split_off(&through.saturating_add(1));
            std::mem::replace(&mut *waiting, later)
        };
        for (_, a) in done.into_values() {
            a.answer(&self.endpoint, None);
        }
    }

    /// Answers the requests the member left unanswered for longer than the timeout (oldest
    /// first: sequence numbers go up with time).
    fn expire(&self) {
        let now = Instant::now();
        let late: Vec<Arc<Acks>> = {
            let mut waiting = self.waiting.lock().expect("not poisoned");
            let mut late = Vec::new();
            while let Some(e) = waiting.first_entry().filter(|e| now.duration_since(e.get().0) > self.timeout) {
                late.push(e.remove().1);
            }
            late
        };
        for a in late {
            a.answer(&self.endpoint, Some(LATE.to_owned()));
        }
    }

    /// The stream is over: everything waiting on it fails with `why`, and so does what is sent
    /// from now on.
    pub fn end(&self, why: &str) {
        self.ended.lock().expect("not poisoned").get_or_insert_with(|| why.to_owned());
        self.out.end(why);
        if let Some(stop) = self.stop.lock().expect("not poisoned").take() {
            let _ = stop.send(());
        }
        let waiting = std::mem::take(&mut *self.waiting.lock().expect("not poisoned"));
        for (_, a) in waiting.into_values() {
            a.answer(&self.endpoint, Some(why.to_owned()));
        }
    }
}

/// The primary's side of a mirror connection.
type Out = Outbound<Box<dyn AsyncWrite + Unpin + Send>>;

impl Push for Link {
    fn push_now(&self) {
        if let Err(why) = self.out.push() {
            self.end(&why);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn acks_report_failures_and_members_that_did_not_answer() {
        let a = Acks::new(vec!["b".into(), "c".into(), "d".into()]);
        a.answer("b", None);
        a.answer("c", Some("disk full".into()));
        a.answer("x", None);
        let t = Instant::now();
        let bad = a.wait_until(Instant::now() + Duration::from_millis(50));
        assert!(t.elapsed() >= Duration::from_millis(45));
        assert_eq!(
            bad,
            vec![("c".into(), "disk full".into()), ("d".into(), "did not answer within the sync timeout".into())]
        );
        let all = Acks::new(vec!["b".into()]);
        let waiter = {
            let all = Arc::clone(&all);
            std::thread::spawn(move || all.wait_until(Instant::now() + Duration::from_secs(5)))
        };
        all.answer("b", None);
        assert!(waiter.join().unwrap().is_empty());
    }

    #[tokio::test]
    async fn the_last_answer_runs_the_completion_and_a_late_member_is_answered_by_the_timeout() {
        let got = Arc::new(Mutex::new(None));
        let done = |got: &Arc<Mutex<Option<Failed>>>| {
            let got = Arc::clone(got);
            move |f: Failed| *got.lock().unwrap() = Some(f)
        };
        let a = Acks::new(vec!["b".into(), "c".into()]);
        a.then(done(&got));
        a.answer("b", None);
        assert!(got.lock().unwrap().is_none(), "completed before every member answered");
        a.answer("c", Some("disk full".into()));
        assert_eq!(got.lock().unwrap().take(), Some(vec![("c".into(), "disk full".into())]));
        // Every member answered already: at once.
        a.then(done(&got));
        assert_eq!(got.lock().unwrap().take(), Some(vec![]));

        let link = Link {
            endpoint: "tcp://m:1".into(),
            rebuilding: AtomicBool::new(false),
            out: Out::start(Box::new(tokio::io::sink()), true, |_| {}),
            waiting: Mutex::default(),
            timeout: Duration::from_millis(30),
            ended: Mutex::default(),
            stop: Mutex::default(),
        };
        let (old, new) = (Acks::new(vec!["tcp://m:1".into()]), Acks::new(vec!["tcp://m:1".into()]));
        old.then(done(&got));
        link.waiting.lock().unwrap().insert(1, (Instant::now(), Arc::clone(&old)));
        std::thread::sleep(Duration::from_millis(40));
        link.waiting.lock().unwrap().insert(2, (Instant::now(), Arc::clone(&new)));
        link.expire();
        assert_eq!(got.lock().unwrap().take(), Some(vec![("tcp://m:1".into(), LATE.into())]));
        assert_eq!(link.waiting.lock().unwrap().keys().copied().collect::<Vec<_>>(), vec![2], "only the late one");
        link.answered(2, String::new());
        assert!(new.wait_until(Instant::now()).is_empty());
    }
}
