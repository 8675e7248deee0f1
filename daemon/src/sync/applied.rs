//! A member's cumulative acknowledgements (a stream opened with `cumulative_acks`): instead of
//! one ack per request, it says "every request up to N is done", one frame for a batch, and the
//! primary's ack reader answers them all at once. Requests applied on the stream's task finish
//! in order; those on the blocking pool finish in any order, so N is just below the oldest one
//! still running. A failure is answered on its own and leaves `running` only after that answer
//! is queued, so no cumulative ack covering it can overtake it.

use std::collections::BTreeSet;
use std::sync::Mutex;

use ferrite_proto::ferrite::v1::MirrorAck;

/// The requests a member received and has not finished yet.
#[derive(Debug, Default)]
pub struct Applied {
    state: Mutex<(u64, BTreeSet<u64>)>,
}

impl Applied {
    /// Request `seq` (sequence numbers go up) arrived; `running` if it goes to the blocking pool.
    pub fn received(&self, seq: u64, running: bool) {
        let mut s = self.state.lock().expect("not poisoned");
        s.0 = s.0.max(seq);
        if running {
            s.1.insert(seq);
        }
    }

    /// Whether request `seq` comes after every one received: a stream carries them in order, and
    /// a cumulative ack for one that overtook an older request would answer that one unseen.
    pub fn follows(&self, seq: u64) -> bool {
        seq > self.state.lock().expect("not poisoned").0
    }

    /// Request `seq` of the blocking pool finished (after its failure, if it failed, was queued).
    pub fn finished(&self, seq: u64) {
        self.state.lock().expect("not poisoned").1.remove(&seq);
    }

    /// Every request up to this one is done.
    pub fn through(&self) -> u64 {
        let s = self.state.lock().expect("not poisoned");
        s.1.first().map_or(s.0, |oldest| oldest - 1)
    }
}

/// The ack of request `seq` that ended with `r`: a success is cumulative where the stream takes
/// them (None while an older request still runs from the first one on: there is nothing to say
/// yet, and a zero would read as the stream's own ack), a failure always answers its own request.
pub fn ack_of(seq: u64, r: Result<(), String>, cumulative: Option<&Applied>) -> Option<MirrorAck> {
    match (r, cumulative) {
        (Ok(()), Some(a)) => {
            Some(a.through()).filter(|&n| n > 0).map(|through| MirrorAck { seq: 0, error: String::new(), through })
        }
        (r, _) => Some(MirrorAck { seq, error: r.err().unwrap_or_default(), through: 0 }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cumulative_acks_stop_below_the_oldest_request_still_running() {
        let a = Applied::default();
        a.received(1, false);
        a.received(2, true);
        a.received(3, false);
        a.received(4, true);
        assert_eq!(a.through(), 1);
        a.finished(4);
        assert_eq!(a.through(), 1, "2 still runs");
        a.finished(2);
        assert_eq!(a.through(), 4);
        a.received(5, false);
        assert_eq!(a.through(), 5);
        assert!(!a.follows(4) && !a.follows(5) && a.follows(6), "an older request after a newer one is refused");
    }

    #[test]
    fn a_success_behind_the_first_request_still_running_waits_for_it() {
        let a = Applied::default();
        a.received(1, true);
        a.received(2, false);
        assert_eq!(ack_of(2, Ok(()), Some(&a)), None, "a zero would read as the stream's own ack");
        let failed = ack_of(1, Err("disk full".into()), Some(&a)).unwrap();
        assert_eq!((failed.seq, failed.error.as_str(), failed.through), (1, "disk full", 0));
        a.finished(1);
        assert_eq!(ack_of(1, Ok(()), Some(&a)).unwrap().through, 2, "the newer success is acknowledged then");
        assert_eq!(ack_of(3, Ok(()), None).unwrap().seq, 3, "without cumulative acks, each its own");
    }
}
