//! Per volume (size, allocation, what its QoS limits delayed) and per NBD export (bytes,
//! requests, errors, threads, latency).

use std::fmt;
use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::families::{counters, gauges};
use super::{Sources, load};

impl Sources {
    pub(super) fn encode_volumes(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let nbd = &self.nbd;
        let volumes = self.pool.volumes();
        let labels: Vec<_> = volumes.iter().map(|v| [("volume", v.name.as_str())]).collect();
        gauges(
            enc,
            &volumes,
            &labels,
            &[
                (
                    "ferrite_volume_size_bytes",
                    "Provisioned size.",
                    (|v| v.size) as fn(&ferrite_engine::VolumeInfo) -> u64,
                ),
                ("ferrite_volume_allocated_bytes", "Mapped bytes.", |v| v.allocated),
            ],
        )?;

        // QoS: what each volume's limits delayed (counters since the daemon started).
        let stats: Vec<_> = volumes.iter().map(|v| self.pool.qos_stats(&v.name).unwrap_or_default()).collect();
        let mut m = enc.encode_descriptor(
            "ferrite_volume_throttled_requests",
            "Requests a volume's limits delayed.",
            None,
            MetricType::Counter,
        )?;
        for (v, s) in volumes.iter().zip(&stats) {
            m.encode_family(&[("volume", v.name.as_str())])?
                .encode_counter::<NoLabelSet, _, u64>(&s.throttled_ops, None)?;
        }
        let mut m = enc.encode_descriptor(
            "ferrite_volume_throttled_seconds",
            "Time requests waited for a volume's limits.",
            None,
            MetricType::Counter,
        )?;
        for (v, s) in volumes.iter().zip(&stats) {
            let secs = s.throttled_wait.as_secs_f64();
            m.encode_family(&[("volume", v.name.as_str())])?.encode_counter::<NoLabelSet, _, f64>(&secs, None)?;
        }

        let exports = nbd.exports.list();
        let labels: Vec<_> =
            exports.iter().map(|e| [("export", e.name.as_str()), ("volume", e.volume.name())]).collect();
        type Counter = fn(&Arc<ferrite_nbd::Export>) -> u64;
        counters(
            enc,
            &exports,
            &labels,
            &[
                ("ferrite_nbd_read_bytes", "Bytes read through NBD.", (|e| load(&e.metrics.read_bytes)) as Counter),
                ("ferrite_nbd_write_bytes", "Bytes written through NBD.", |e| load(&e.metrics.write_bytes)),
                ("ferrite_nbd_other_ops", "Flush, trim, write-zeroes, cache and block-status requests.", |e| {
                    load(&e.metrics.other_ops)
                }),
                ("ferrite_nbd_errors", "Requests answered with an error.", |e| load(&e.metrics.errors)),
                (
                    "ferrite_nbd_helper_threads_started",
                    "Worker threads started for requests in flight, beyond each connection's first.",
                    |e| load(&e.metrics.helpers_started),
                ),
                (
                    "ferrite_nbd_sender_threads_started",
                    "Threads started to write replies that did not fit a connection's socket (one per connection at most).",
                    |e| load(&e.metrics.senders_started),
                ),
            ],
        )?;
        type Latency = fn(&ferrite_nbd::metrics::ExportMetrics) -> &ferrite_nbd::metrics::Histogram;
        for (name, help, histogram) in [
            (
                "ferrite_nbd_read_seconds",
                "Latency of NBD reads (the _count is the number of reads).",
                (|m| &m.read_latency) as Latency,
            ),
            ("ferrite_nbd_write_seconds", "Latency of NBD writes (the _count is the number of writes).", |m| {
                &m.write_latency
            }),
        ] {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (e, l) in exports.iter().zip(&labels) {
                let h = histogram(&e.metrics).snapshot();
                m.encode_family(l)?.encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?;
            }
        }
        Ok(())
    }
}
