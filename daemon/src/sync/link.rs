//! The primary's stream to one member: requests go out in order on one framed mutual-TLS
//! connection ([`super::wire`]) and acks come back by sequence number. A request waits on an
//! [`Acks`] that every member it went to answers; a stream that ends answers everything still
//! waiting on it with the reason, so no request waits longer than the primary's timeout.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::{MirrorAck, MirrorMessage, MirrorOpen};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use super::wire::{self, Frames};
use crate::config::TlsFiles;

/// The members' answers to one request.
#[derive(Debug)]
pub struct Acks {
    state: Mutex<AckState>,
    answered: Condvar,
}

#[derive(Debug)]
struct AckState {
    waiting: Vec<String>,
    failed: Vec<(String, String)>,
}

impl Acks {
    pub fn new(members: Vec<String>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(AckState { waiting: members, failed: Vec::new() }),
            answered: Condvar::new(),
        })
    }

    /// `member` answered: done, or failed saying why.
    pub fn answer(&self, member: &str, error: Option<String>) {
        let mut s = self.state.lock().expect("not poisoned");
        let Some(i) = s.waiting.iter().position(|m| m == member) else { return };
        s.waiting.swap_remove(i);
        if let Some(e) = error {
            s.failed.push((member.to_owned(), e));
        }
        if s.waiting.is_empty() {
            self.answered.notify_all();
        }
    }

    /// Waits until every member answered or `deadline` passed: the members that failed, and
    /// those that did not answer in time, each with why.
    pub fn wait_until(&self, deadline: Instant) -> Vec<(String, String)> {
        let mut s = self.state.lock().expect("not poisoned");
        while !s.waiting.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self.answered.wait_timeout(s, left).expect("not poisoned").0;
        }
        let late = s.waiting.iter().map(|m| (m.clone(), "did not answer within the sync timeout".to_owned()));
        s.failed.iter().cloned().chain(late).collect()
    }
}

/// One member's stream.
#[derive(Debug)]
pub struct Link {
    pub endpoint: String,
    /// The member is being rebuilt (it gets whole blocks).
    pub rebuilding: AtomicBool,
    tx: Mutex<Option<mpsc::UnboundedSender<MirrorMessage>>>,
    waiting: Mutex<HashMap<u64, Arc<Acks>>>,
    ended: Mutex<Option<String>>,
    /// Stops the ack reader (a member that stopped answering never closes its side).
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl Link {
    /// Opens the stream of `volume` at `generation` to the member at `endpoint`; for a rebuild
    /// (`rebuild` the base mark, empty for a full copy), the member rolls back first.
    pub async fn open(
        tls: Option<&TlsFiles>,
        endpoint: &str,
        volume: &str,
        generation: u64,
        rebuild: Option<&str>,
    ) -> Result<Arc<Self>, Status> {
        let at_peer = |e: String| format!("peer {endpoint}: {e}");
        let conn = wire::connect(tls, endpoint).await.map_err(|e| Status::unavailable(at_peer(e.to_string())))?;
        let (r, w) = tokio::io::split(conn);
        let mut acks = Frames::<_, MirrorAck>::new(r, None);
        let (tx, rx) = mpsc::unbounded_channel();
        let open = MirrorOpen {
            volume: volume.to_owned(),
            generation,
            rebuild: rebuild.is_some(),
            base: rebuild.unwrap_or_default().to_owned(),
        };
        tx.send(MirrorMessage { seq: 0, op: Some(Op::Open(open)) }).expect("the receiver is here");
        tokio::spawn(wire::send_requests(w, rx));
        match acks.next().await {
            Ok(Some(MirrorAck { seq: 0, error })) if error.is_empty() => {}
            Ok(Some(MirrorAck { error, .. })) => return Err(Status::failed_precondition(at_peer(error))),
            Ok(None) => return Err(Status::unavailable(at_peer("it closed the stream".into()))),
            Err(e) => return Err(Status::unavailable(at_peer(e))),
        }
        let (stop, mut stopped) = oneshot::channel();
        let link = Arc::new(Self {
            endpoint: endpoint.to_owned(),
            rebuilding: AtomicBool::new(rebuild.is_some()),
            tx: Mutex::new(Some(tx)),
            waiting: Mutex::default(),
            ended: Mutex::default(),
            stop: Mutex::new(Some(stop)),
        });
        let l = Arc::clone(&link);
        tokio::spawn(async move {
            let why = loop {
                let next = tokio::select! {
                    a = acks.next() => a,
                    _ = &mut stopped => break "the stream was ended here".to_owned(),
                };
                match next {
                    Ok(Some(MirrorAck { seq: 0, error })) => break format!("the member ended the stream: {error}"),
                    Ok(Some(a)) => l.answered(a.seq, a.error),
                    Ok(None) => break "the member ended the stream".to_owned(),
                    Err(e) => break format!("the stream failed: {e}"),
                }
            };
            l.end(&why);
        });
        Ok(link)
    }

    /// Sends one request; `acks` hears the member's answer (at once if the stream has ended).
    pub fn send(&self, msg: MirrorMessage, acks: &Arc<Acks>) {
        let seq = msg.seq;
        let mut waiting = self.waiting.lock().expect("not poisoned");
        // `end` records why before it answers the waiting, so a request registered here after
        // that sees the reason instead.
        if let Some(why) = self.ended.lock().expect("not poisoned").clone() {
            drop(waiting);
            acks.answer(&self.endpoint, Some(why));
            return;
        }
        waiting.insert(seq, Arc::clone(acks));
        let sent = self.tx.lock().expect("not poisoned").as_ref().is_some_and(|tx| tx.send(msg).is_ok());
        if !sent {
            waiting.remove(&seq);
            drop(waiting);
            acks.answer(&self.endpoint, Some("the stream is closed".into()));
        }
    }

    fn answered(&self, seq: u64, error: String) {
        let acks = self.waiting.lock().expect("not poisoned").remove(&seq);
        if let Some(a) = acks {
            a.answer(&self.endpoint, (!error.is_empty()).then_some(error));
        }
    }

    /// The stream is over: everything waiting on it fails with `why`, and so does what is sent
    /// from now on.
    pub fn end(&self, why: &str) {
        self.ended.lock().expect("not poisoned").get_or_insert_with(|| why.to_owned());
        self.tx.lock().expect("not poisoned").take();
        if let Some(stop) = self.stop.lock().expect("not poisoned").take() {
            let _ = stop.send(());
        }
        let waiting: Vec<_> = self.waiting.lock().expect("not poisoned").drain().map(|(_, a)| a).collect();
        for a in waiting {
            a.answer(&self.endpoint, Some(why.to_owned()));
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
}
