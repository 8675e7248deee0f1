//! Per-volume QoS: IOPS and bandwidth limits for reads, writes, or both, each a token bucket
//! with a burst allowance. Over the limit a request is delayed, never failed: `reserve` takes
//! the request's tokens at once (a bucket may go into debt) and says how long the caller waits
//! before doing the I/O, so requests are admitted in arrival order at exactly the set rate,
//! and a waiting request holds nothing but its own caller. One limiter per volume, shared by
//! every handle of it (NBD, ublk, anything later), kept in the catalog with the volume.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A volume's limits; 0 is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QosLimits {
    /// Operations per second, reads and writes together.
    pub iops: u64,
    pub read_iops: u64,
    pub write_iops: u64,
    /// Bytes per second, reads and writes together.
    pub bps: u64,
    pub read_bps: u64,
    pub write_bps: u64,
    /// How much a bucket holds, as time at its rate (0: one second). Idle time up to this long
    /// is banked for a burst.
    pub burst_ms: u64,
}

impl QosLimits {
    pub fn is_unlimited(&self) -> bool {
        self.rates().iter().all(|&r| r == 0)
    }

    fn rates(&self) -> [u64; 6] {
        [self.iops, self.read_iops, self.write_iops, self.bps, self.read_bps, self.write_bps]
    }

    /// The catalog's order of the fields.
    pub(crate) fn to_array(self) -> [u64; 7] {
        let r = self.rates();
        [r[0], r[1], r[2], r[3], r[4], r[5], self.burst_ms]
    }

    pub(crate) fn from_array(a: [u64; 7]) -> Self {
        let [iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms] = a;
        Self { iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms }
    }
}

/// What a request is, for the limits that apply to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    /// Writes, write-zeroes and trims (a trim counts as an operation, not as bytes).
    Write,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    rate: f64,
    cap: f64,
    tokens: f64,
}

/// What the limiter has seen: totals since the volume was opened, and the rate over the last
/// whole second.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QosStats {
    pub throttled_ops: u64,
    pub throttled_wait: Duration,
    pub ops_per_sec: f64,
    pub bytes_per_sec: f64,
}

#[derive(Debug)]
struct State {
    limits: QosLimits,
    /// iops, read_iops, write_iops, bps, read_bps, write_bps.
    buckets: [Option<Bucket>; 6],
    last: Instant,
    stats: QosStats,
    window: (Instant, u64, u64),
}

#[derive(Debug)]
pub(crate) struct Qos {
    state: Mutex<State>,
}

const OPS: [usize; 3] = [0, 1, 2];

impl Qos {
    pub fn new(limits: QosLimits) -> Self {
        let now = Instant::now();
        Self {
            state: Mutex::new(State {
                limits,
                buckets: buckets(limits),
                last: now,
                stats: QosStats::default(),
                window: (now, 0, 0),
            }),
        }
    }

    /// New limits, in effect for the next request: buckets start full, debts are forgiven.
    pub fn set(&self, limits: QosLimits) {
        let mut s = self.state.lock();
        s.limits = limits;
        s.buckets = buckets(limits);
        s.last = Instant::now();
    }

    /// Whether any limit is set (a request may have to wait).
    pub fn is_limited(&self) -> bool {
        !self.state.lock().limits.is_unlimited()
    }

    /// Takes the tokens of one request of `bytes`; how long its caller waits before the I/O.
    pub fn reserve(&self, kind: IoKind, bytes: u64) -> Duration {
        let now = Instant::now();
        let mut guard = self.state.lock();
        let s = &mut *guard;
        let dt = now.saturating_duration_since(s.last).as_secs_f64();
        s.last = now;
        let mine = match kind {
            IoKind::Read => [0, 1, 3, 4],
            IoKind::Write => [0, 2, 3, 5],
        };
        let mut wait = 0f64;
        for i in mine {
            let Some(b) = &mut s.buckets[i] else { continue };
            b.tokens = (b.tokens + b.rate * dt).min(b.cap);
            b.tokens -= if OPS.contains(&i) { 1.0 } else { bytes as f64 };
            if b.tokens < 0.0 {
                wait = wait.max(-b.tokens / b.rate);
            }
        }
        let (start, ops, by) = &mut s.window;
        let elapsed = now.saturating_duration_since(*start);
        if elapsed >= Duration::from_secs(1) {
            s.stats.ops_per_sec = *ops as f64 / elapsed.as_secs_f64();
            s.stats.bytes_per_sec = *by as f64 / elapsed.as_secs_f64();
            *start = now;
            *ops = 0;
            *by = 0;
        }
        *ops += 1;
        *by += bytes;
        let wait = Duration::from_secs_f64(wait);
        if !wait.is_zero() {
            s.stats.throttled_ops += 1;
            s.stats.throttled_wait += wait;
        }
        wait
    }

    pub fn stats(&self) -> QosStats {
        let s = self.state.lock();
        let mut st = s.stats;
        // A window that saw nothing for a while reports no rate rather than an old one.
        if s.window.0.elapsed() > Duration::from_secs(2) {
            st.ops_per_sec = 0.0;
            st.bytes_per_sec = 0.0;
        }
        st
    }
}

fn buckets(l: QosLimits) -> [Option<Bucket>; 6] {
    let burst = if l.burst_ms == 0 { 1.0 } else { l.burst_ms as f64 / 1000.0 };
    l.rates().map(|r| {
        (r > 0).then(|| {
            let rate = r as f64;
            let cap = (rate * burst).max(1.0);
            Bucket { rate, cap, tokens: cap }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waits(q: &Qos, kind: IoKind, bytes: u64, n: usize) -> Duration {
        (0..n).map(|_| q.reserve(kind, bytes)).max().unwrap_or_default()
    }

    #[test]
    fn iops_limit_spaces_requests_after_the_burst() {
        let q = Qos::new(QosLimits { iops: 100, burst_ms: 500, ..Default::default() });
        // 50 banked: the first 50 go at once, the 100th waits about half a second.
        assert!(waits(&q, IoKind::Read, 4096, 50).is_zero());
        let w = waits(&q, IoKind::Write, 4096, 50);
        assert!(w > Duration::from_millis(450) && w < Duration::from_millis(520), "{w:?}");
        assert!(q.stats().throttled_ops >= 49);
    }

    #[test]
    fn read_and_write_limits_apply_to_their_kind_only() {
        let q = Qos::new(QosLimits { write_bps: 1 << 20, ..Default::default() });
        assert!(waits(&q, IoKind::Read, 64 << 20, 10).is_zero(), "reads are unlimited");
        assert!(q.reserve(IoKind::Write, 1 << 20).is_zero(), "one second of burst");
        let w = q.reserve(IoKind::Write, 2 << 20);
        assert!(w > Duration::from_millis(1900) && w < Duration::from_millis(2100), "{w:?}");
    }

    #[test]
    fn new_limits_take_effect_at_once_and_forgive_debt() {
        let q = Qos::new(QosLimits { iops: 10, ..Default::default() });
        let w = waits(&q, IoKind::Read, 0, 100);
        assert!(w > Duration::from_secs(8), "{w:?}");
        q.set(QosLimits::default());
        assert!(waits(&q, IoKind::Read, 0, 1000).is_zero());
        q.set(QosLimits { iops: 1000, ..Default::default() });
        assert!(waits(&q, IoKind::Read, 0, 1000).is_zero(), "a fresh bucket is full");
    }

    #[test]
    fn limits_round_trip_the_catalog_order() {
        let l = QosLimits { iops: 1, read_iops: 2, write_iops: 3, bps: 4, read_bps: 5, write_bps: 6, burst_ms: 7 };
        assert_eq!(QosLimits::from_array(l.to_array()), l);
    }
}
