//! Per-export counters and latency histograms, rendered in the Prometheus text format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 12] = [0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5];

/// A cumulative latency histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
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

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (b, n) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += n.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
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
    pub read_latency: Histogram,
    pub write_latency: Histogram,
}

impl ExportMetrics {
    /// Renders this export's series (HELP/TYPE lines come from [`render_headers`]).
    pub fn render(&self, out: &mut String, export: &str, volume: &str) {
        let labels = format!("export=\"{}\",volume=\"{}\"", escape(export), escape(volume));
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(out, "ferrite_nbd_read_bytes_total{{{labels}}} {}", c(&self.read_bytes));
        let _ = writeln!(out, "ferrite_nbd_write_bytes_total{{{labels}}} {}", c(&self.write_bytes));
        let _ = writeln!(out, "ferrite_nbd_other_ops_total{{{labels}}} {}", c(&self.other_ops));
        let _ = writeln!(out, "ferrite_nbd_errors_total{{{labels}}} {}", c(&self.errors));
        let _ = writeln!(out, "ferrite_nbd_helper_threads_started_total{{{labels}}} {}", c(&self.helpers_started));
        self.read_latency.render(out, "ferrite_nbd_read_seconds", &labels);
        self.write_latency.render(out, "ferrite_nbd_write_seconds", &labels);
    }
}

/// HELP and TYPE lines for the per-export series.
pub fn render_headers(out: &mut String) {
    for (name, kind, help) in [
        ("ferrite_nbd_read_bytes_total", "counter", "Bytes read through NBD."),
        ("ferrite_nbd_write_bytes_total", "counter", "Bytes written through NBD."),
        ("ferrite_nbd_other_ops_total", "counter", "Flush, trim, write-zeroes, cache and block-status requests."),
        ("ferrite_nbd_errors_total", "counter", "Requests answered with an error."),
        (
            "ferrite_nbd_helper_threads_started_total",
            "counter",
            "Worker threads started for requests in flight, beyond each connection's first.",
        ),
        ("ferrite_nbd_read_seconds", "histogram", "Latency of NBD reads (the _count is the number of reads)."),
        ("ferrite_nbd_write_seconds", "histogram", "Latency of NBD writes (the _count is the number of writes)."),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
}

/// Escapes a label value.
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(30));
        h.observe(Duration::from_micros(700));
        h.observe(Duration::from_secs(2));
        let mut s = String::new();
        h.render(&mut s, "x", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.00005\"} 1"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.001\"} 2"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3"), "{s}");
        assert!(s.contains("x_count{a=\"b\"} 3"), "{s}");
        assert_eq!(escape("a\"b"), "a\\\"b");
    }
}
