//! A member's cumulative acknowledgements (a stream opened with `cumulative_acks`): instead of
//! one ack per request, it says "every request up to N is done", one frame for a batch, and the
//! primary's ack reader answers them all at once. Requests applied on the stream's task finish
//! in order; those on the blocking pool finish in any order, so N is just below the oldest one
//! still running. A failure is answered on its own and leaves `running` only after that answer
//! is queued, so no cumulative ack covering it can overtake it.

use std::collections::BTreeSet;
use std::sync::Mutex;

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
    }
}
