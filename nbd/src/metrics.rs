//! Per-export counters and latency histograms. Plain atomics, bumped on every request; the
//! daemon's metrics endpoint reads them at scrape time and encodes them with prometheus-client.
//! (prometheus-client's own `Histogram` takes a lock per observation, which the data path avoids.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
pub const BUCKETS: [f64; 12] =
    [0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5];

/// A latency histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// A histogram read at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Sum of the observations, in seconds.
    pub sum: f64,
    pub count: u64,
    /// `(upper bound, observations in this bucket alone)`, ending with `+Inf`: the form
    /// prometheus-client's encoder takes (it makes them cumulative).
    pub buckets: Vec<(f64, u64)>,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| s <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let count = self.count.load(Ordering::Relaxed);
        let mut buckets: Vec<_> =
            BUCKETS.iter().zip(&self.buckets).map(|(&b, n)| (b, n.load(Ordering::Relaxed))).collect();
        let bounded: u64 = buckets.iter().map(|b| b.1).sum();
        buckets.push((f64::INFINITY, count.saturating_sub(bounded)));
        HistogramSnapshot { sum: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9, count, buckets }
    }
}

/// Traffic of one export.
#[derive(Debug, Default)]
pub struct ExportMetrics {
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub other_ops: AtomicU64,
    pub errors: AtomicU64,
    /// Helper threads started for requests that may wait long (flush, FUA, trim, zeroes, ...).
    pub helpers_started: AtomicU64,
    /// Sender threads started for connections whose replies did not fit their socket.
    pub senders_started: AtomicU64,
    pub read_latency: Histogram,
    pub write_latency: Histogram,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_bucket() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(30));
        h.observe(Duration::from_micros(700));
        h.observe(Duration::from_secs(2));
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert_eq!(s.buckets[0], (0.000_05, 1));
        assert_eq!(s.buckets[4], (0.001, 1));
        assert_eq!(s.buckets.last(), Some(&(f64::INFINITY, 1)));
        assert_eq!(s.buckets.iter().map(|b| b.1).sum::<u64>(), 3);
        assert!((s.sum - 2.00073).abs() < 1e-9, "{}", s.sum);
    }
}
