//! The daemon-wide families: build, certificate, pool, listener and NBD server gauges and
//! counters, and the calls refused.

use std::fmt;

use ferrite_engine::PoolStats;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::{Sources, certificate_expiry, load};

impl Sources {
    pub(super) fn encode_daemon(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let stats = self.pool.stats();
        self.encode_build(enc)?;
        self.encode_daemon_gauges(&stats, enc)?;
        self.encode_daemon_counters(&stats, enc)?;
        self.encode_denials(enc)
    }

    /// The version and pool format, and when the listeners' certificate expires.
    fn encode_build(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let format = ferrite_engine::format::FORMAT_VERSION.to_string();
        enc.encode_descriptor(
            "ferrite_build_info",
            "The daemon's version and pool format (always 1).",
            None,
            MetricType::Gauge,
        )?
        .encode_family(&[("version", ferrite_proto::version::VERSION), ("format", format.as_str())])?
        .encode_gauge(&1u64)?;
        if let Some(expiry) = self.tls_cert.as_deref().and_then(certificate_expiry) {
            enc.encode_descriptor(
                "ferrite_tls_certificate_expiry_timestamp_seconds",
                "When the certificate the TCP listeners serve expires (seconds since 1970).",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&expiry)?;
        }
        Ok(())
    }

    fn encode_daemon_gauges(&self, s: &PoolStats, enc: &mut DescriptorEncoder) -> fmt::Result {
        let nbd = &self.nbd;
        for (name, help, v) in [
            ("ferrite_pool_size_bytes", "Data area of the pool.", s.size),
            ("ferrite_pool_used_bytes", "Bytes of log in segments that are not free.", s.used),
            ("ferrite_pool_free_bytes", "Bytes free for client writes (reserve excluded).", s.free),
            ("ferrite_pool_live_bytes", "Bytes mapped by some volume.", s.live),
            ("ferrite_pool_reclaimable_bytes", "Dead bytes in sealed segments.", s.reclaimable),
            ("ferrite_pool_segments_free", "Free segments.", s.segments_free),
            ("ferrite_pool_volumes", "Volumes in the pool.", s.volumes as u64),
            ("ferrite_cleaner_active", "1 while the cleaner runs.", u64::from(s.cleaner_active)),
            (
                "ferrite_pool_failed",
                "1 once the pool stopped after a media failure (it refuses writes).",
                u64::from(s.failed),
            ),
            (
                "ferrite_fences",
                "Address blocks fenced (refused on the TCP listeners).",
                self.fences.list().len() as u64,
            ),
            ("ferrite_nbd_connections_open", "Open NBD connections.", load(&nbd.stats.connections_open)),
            ("ferrite_nbd_memory_in_flight_bytes", "Request data NBD connections hold now.", nbd.limits.memory.used()),
            (
                "ferrite_nbd_memory_in_flight_peak_bytes",
                "The most request data NBD connections held.",
                nbd.limits.memory.peak(),
            ),
            (
                "ferrite_nbd_memory_limit_bytes",
                "Request data NBD connections may hold (nbd-memory).",
                nbd.limits.memory.cap(),
            ),
        ] {
            enc.encode_descriptor(name, help, None, MetricType::Gauge)?.encode_gauge(&v)?;
        }
        Ok(())
    }

    /// Counters: the encoder appends `_total` to each name.
    fn encode_daemon_counters(&self, s: &PoolStats, enc: &mut DescriptorEncoder) -> fmt::Result {
        let (nbd, listeners) = (&self.nbd, &self.listeners);
        for (name, help, v) in [
            ("ferrite_pool_client_written_bytes", "Bytes clients wrote.", s.client_bytes_written),
            ("ferrite_pool_media_written_bytes", "Bytes the log wrote to media.", s.media_bytes_written),
            ("ferrite_cleaner_segments_cleaned", "Segments the cleaner emptied.", s.cleaner_segments_cleaned),
            ("ferrite_cleaner_moved_bytes", "Live bytes the cleaner moved.", s.cleaner_bytes_moved),
            (
                "ferrite_pool_checksum_errors",
                "Blocks read whose checksum did not match (the read failed).",
                s.checksum_errors,
            ),
            ("ferrite_readahead_read_bytes", "Bytes read ahead for sequential readers.", s.readahead_bytes),
            ("ferrite_readahead_hit_bytes", "Bytes reads took from what was read ahead.", s.readahead_hit_bytes),
            ("ferrite_nbd_connections", "NBD connections accepted.", load(&nbd.stats.connections_total)),
            (
                "ferrite_nbd_connections_refused",
                "NBD clients closed on arrival: the listener was at max-connections.",
                load(&nbd.stats.connections_refused),
            ),
            (
                "ferrite_nbd_handshake_timeouts",
                "NBD clients cut for not finishing the handshake in time.",
                load(&nbd.stats.handshake_timeouts),
            ),
            (
                "ferrite_nbd_accept_errors",
                "Failed accept() calls on NBD listeners (retried).",
                load(&nbd.stats.accept_errors),
            ),
            (
                "ferrite_admin_connections_refused",
                "Admin API TCP clients closed on arrival: the listener was at max-connections.",
                load(&listeners.admin.refused),
            ),
            (
                "ferrite_admin_tls_handshake_failures",
                "Admin API TCP clients whose TLS handshake failed or timed out.",
                load(&listeners.admin.handshake_failures),
            ),
            (
                "ferrite_admin_connections_no_role",
                "Admin API TCP clients closed after the handshake: their identity holds no role.",
                load(&listeners.admin.no_role),
            ),
            (
                "ferrite_admin_connections_identity_full",
                "Admin API TCP clients closed after the handshake: their identity held its share of max-connections.",
                load(&listeners.admin.identity_full),
            ),
            (
                "ferrite_metrics_connections_no_role",
                "Metrics clients closed after the handshake: their identity holds neither the metrics nor the operator role.",
                load(&listeners.metrics.no_role),
            ),
            (
                "ferrite_metrics_connections_refused",
                "Metrics clients closed on arrival: the listener was at max-connections.",
                load(&listeners.metrics.refused),
            ),
        ] {
            enc.encode_descriptor(name, help, None, MetricType::Counter)?
                .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
        }
        Ok(())
    }

    fn encode_denials(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        // Refusals by identity (a configured one, "unconfigured" or "local") and call (a known
        // RPC, or "unknown"): both bounded, whatever clients send.
        let mut m = enc.encode_descriptor(
            "ferrite_authz_denied",
            "Calls refused: the caller's roles or relations do not allow them.",
            None,
            MetricType::Counter,
        )?;
        for ((who, call), n) in self.replication.policy.denials() {
            m.encode_family(&[("identity", who.as_str()), ("call", call.as_str())])?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
        Ok(())
    }
}
