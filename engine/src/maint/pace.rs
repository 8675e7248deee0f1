//! Pacing client writes against the background cleaner.
//!
//! Without it, writers outrun the cleaner until the pool is out of free segments, then all of
//! them stall until a victim is finished and a checkpoint frees it (stop and go: a p99 of tens
//! of milliseconds). While the background cleaner runs, each client block written instead
//! spends credit that the cleaner earns as it moves blocks: a victim with `L` of `S` blocks
//! live gives back `S - L` blocks for the `L` it moves, so each moved block earns `(S - L) / L`
//! client blocks (less while free space is below the cleaner's low-water mark, so it recovers).
//! Client writes and cleaning then share the disk in the proportion that keeps free space
//! level, and a write waits a fraction of a cleaning step rather than a whole victim.
//!
//! Writes are served in arrival order: each takes the next stretch of a running count of
//! blocks demanded and goes once the cleaner's running count of credit has reached the start
//! of its stretch — so a large write is never starved by small ones (it runs into debt that the
//! writes after it wait out), and no writer is passed over however the threads are scheduled.
//! A write never waits longer than [`MAX_WAIT`] (the no-space path behind it still protects the
//! reserve).

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The longest a write waits for credit.
const MAX_WAIT: Duration = Duration::from_millis(500);

#[derive(Debug, Default)]
struct Balance {
    on: bool,
    /// Client blocks asked for since pacing started.
    demanded: f64,
    /// Client blocks the cleaner has made room for since pacing started, never more than `cap`
    /// ahead of `demanded`: credit earned while nobody writes
    /// does not come back as an unpaced burst.
    earned: f64,
    cap: f64,
}

#[derive(Debug, Default)]
pub(crate) struct Pace {
    balance: Mutex<Balance>,
    cv: Condvar,
}

impl Pace {
    /// Writes pay from now on, with no credit yet; at most `cap` blocks of credit are kept.
    pub fn start(&self, cap: u64) {
        *self.balance.lock() = Balance { on: true, demanded: 0.0, earned: 0.0, cap: cap as f64 };
    }

    /// Writes go unpaced again.
    pub fn stop(&self) {
        self.balance.lock().on = false;
        self.cv.notify_all();
    }

    /// Whether writes are paced now (and so may wait).
    pub fn is_on(&self) -> bool {
        self.balance.lock().on
    }

    /// The cleaner made room for `blocks` more client blocks.
    pub fn earn(&self, blocks: f64) {
        let mut b = self.balance.lock();
        b.earned = (b.earned + blocks).min(b.demanded + b.cap);
        drop(b);
        self.cv.notify_all();
    }

    /// Waits (while pacing is on, at most [`MAX_WAIT`]) for the writes before this one and for
    /// credit to reach this one's turn; `blocks` is its size.
    pub fn pay(&self, blocks: u64) {
        let mut b = self.balance.lock();
        if !b.on {
            return;
        }
        let turn = b.demanded;
        b.demanded += blocks as f64;
        let deadline = Instant::now() + MAX_WAIT;
        while b.on && b.earned <= turn {
            if self.cv.wait_until(&mut b, deadline).timed_out() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn unpaced_writes_never_wait() {
        let p = Pace::default();
        let t = Instant::now();
        p.pay(1 << 20);
        assert!(t.elapsed() < MAX_WAIT);
    }

    #[test]
    fn a_write_waits_for_credit_and_a_large_one_runs_into_debt() {
        let p = Arc::new(Pace::default());
        p.start(1000);
        p.earn(10.0);
        p.pay(64); // positive balance: proceeds, owes 54
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                p.pay(1);
                tx.send(()).expect("main thread listens");
            })
        };
        p.earn(50.0); // still owing 4: the writer keeps waiting
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        p.earn(5.0);
        // (Well before the writer's own deadline: it is the credit that lets it go.)
        rx.recv_timeout(Duration::from_millis(300)).expect("credit lets the write go");
        waiter.join().expect("writer");
    }

    #[test]
    fn credit_is_capped_and_stopping_releases_waiting_writes() {
        let p = Arc::new(Pace::default());
        p.start(8);
        p.earn(100.0);
        p.pay(8);
        let b = p.balance.lock();
        assert!(b.earned <= b.demanded, "only 8 blocks of credit were kept");
        drop(b);
        let waiter = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || p.pay(1))
        };
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(50));
        p.stop();
        waiter.join().expect("writer");
        assert!(t.elapsed() < MAX_WAIT * 4 / 5, "stop released the writer, not its timeout");
    }
}
