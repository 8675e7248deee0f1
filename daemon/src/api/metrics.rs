//! The opt-in Prometheus endpoint (`metrics-listen`): `GET /metrics` in the OpenMetrics text
//! format, behind the same fence list, connection limit and TLS as the other TCP listeners
//! (`listen.rs`). prometheus-client encodes; hyper speaks HTTP/1.1, one request per connection.
//! Every value is read at scrape time from the counters the pool, the NBD server and the
//! listeners keep anyway (a `Collector`), so nothing on the data path knows about Prometheus.

use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ferrite_engine::Pool;
use ferrite_nbd::Server;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use crate::base::config::Limits;
use crate::net::listen::{Guarded, ListenerStats};
use crate::records::backup_outcomes::{BackupOutcome, BackupOutcomes, VerifyOutcome};
use crate::replica::Replication;
use ferrite_proto::ferrite::v1 as pb;

/// Counters of the daemon's own TCP listeners.
#[derive(Debug, Clone, Default)]
pub struct Listeners {
    pub admin: Arc<ListenerStats>,
    pub metrics: Arc<ListenerStats>,
}

/// Where the values come from.
#[derive(Debug)]
pub struct Sources {
    pub pool: Arc<Pool>,
    pub nbd: Arc<Server>,
    pub listeners: Listeners,
    pub replication: Arc<Replication>,
    pub sync: Arc<crate::sync::SyncHub>,
    pub restores: Arc<crate::records::restores::Restores>,
    pub backups: Arc<BackupOutcomes>,
    pub fences: Arc<crate::records::fence::Fences>,
    /// The certificate the listeners serve (its expiry is a gauge).
    pub tls_cert: Option<std::path::PathBuf>,
}

/// The expiry of the first certificate in `path` (the file the listeners reload from).
fn certificate_expiry(path: &std::path::Path) -> Option<i64> {
    let cert = ferrite_tls::load_certs(path).ok()?.into_iter().next()?;
    ferrite_tls::validity(&cert).map(|(_, to)| to)
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

impl Collector for Sources {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let s = self.pool.stats();
        let (nbd, listeners) = (&self.nbd, &self.listeners);
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
        // Counters: the encoder appends `_total` to each name.
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

        let volumes = self.pool.volumes();
        let labels: Vec<_> = volumes.iter().map(|v| [("volume", v.name.as_str())]).collect();
        gauges(
            &mut enc,
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
            &mut enc,
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
        self.encode_replication(&mut enc)?;
        self.encode_backups(&mut enc)?;
        self.encode_sync(&mut enc)
    }
}

impl Sources {
    /// Per replicated volume (labels: volume, role).
    fn encode_replication(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows = self.replication.list("").unwrap_or_default();
        let live: Vec<_> = rows.iter().map(|r| self.replication.live(&r.volume, |l| l.clone())).collect();
        let labels: Vec<_> = rows.iter().map(|r| [("volume", r.volume.as_str()), ("role", r.role.as_str())]).collect();
        type Gauge = fn(&pb::Replication) -> f64;
        gauges(
            enc,
            &rows,
            &labels,
            &[
                (
                    "ferrite_replication_lag_seconds",
                    "Age of the newest mirror snapshot both sides hold (the recovery point).",
                    (|r| r.lag_seconds) as Gauge,
                ),
                ("ferrite_replication_syncing", "1 while a transfer runs.", |r| {
                    f64::from(u8::from(r.state == "syncing"))
                }),
                ("ferrite_replication_error", "1 while the last transfer failed.", |r| {
                    f64::from(u8::from(r.state == "error"))
                }),
                ("ferrite_replication_bytes_left", "Data bytes the running transfer still has to send.", |r| {
                    r.bytes_left as f64
                }),
                ("ferrite_replication_last_sync_seconds", "Duration of the last completed transfer.", |r| {
                    r.last_sync_seconds
                }),
                ("ferrite_replication_last_sync_bytes", "Data bytes of the last completed transfer.", |r| {
                    r.last_sync_bytes as f64
                }),
            ],
        )?;
        type Counter = fn(&crate::replica::Live) -> u64;
        counters(
            enc,
            &live,
            &labels,
            &[
                ("ferrite_replication_sent_bytes", "Data bytes pushed to the peer.", (|l| l.sent_bytes) as Counter),
                ("ferrite_replication_syncs", "Transfers completed.", |l| l.syncs),
                ("ferrite_replication_sync_failures", "Transfers that failed.", |l| l.failures),
            ],
        )?;
        Ok(())
    }
}

impl Sources {
    /// Per volume being restored (instant restore: it serves while its chunks are copied).
    fn encode_backups(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows: Vec<_> = self.backups.backups();
        let labels: Vec<_> = rows.iter().map(|((t, v), _)| [("target", t.as_str()), ("volume", v.as_str())]).collect();
        type Value = fn(&((String, String), BackupOutcome)) -> u64;
        gauges(
            enc,
            &rows,
            &labels,
            &[
                (
                    "ferrite_backup_last_success_timestamp_seconds",
                    "When the volume's last successful backup to the target ended (Unix seconds; since the daemon started).",
                    (|(_, o)| o.last_success_unix) as Value,
                ),
                ("ferrite_backup_last_failed", "1 if the volume's last backup to the target failed.", |(_, o)| {
                    u64::from(o.last_failed)
                }),
            ],
        )?;
        counters(
            enc,
            &rows,
            &labels,
            &[("ferrite_backup_failures", "Backups that failed.", (|(_, o)| o.failures) as Value)],
        )?;
        let verifies = self.backups.verifies();
        let labels: Vec<_> = verifies.iter().map(|v| [("target", v.target.as_str())]).collect();
        type Verified = fn(&VerifyOutcome) -> u64;
        gauges(
            enc,
            &verifies,
            &labels,
            &[
                (
                    "ferrite_backup_verify_last_timestamp_seconds",
                    "When the last verify of the target's backups ended (Unix seconds).",
                    (|v| v.finished_unix) as Verified,
                ),
                (
                    "ferrite_backup_verify_bad_chunks",
                    "Chunks of the target found bad by a verify and not found good since (quarantined).",
                    |v| v.quarantined,
                ),
            ],
        )?;
        self.encode_restores(enc)
    }

    fn encode_restores(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows: Vec<_> = self.restores.counts().into_iter().collect();
        let labels: Vec<_> = rows.iter().map(|(volume, _)| [("volume", volume.as_str())]).collect();
        type Value = fn(&(String, (u64, u64, u64))) -> u64;
        gauges(
            enc,
            &rows,
            &labels,
            &[
                (
                    "ferrite_backup_restore_chunks_left",
                    "Chunks of the backup a volume is restored from that are not copied yet.",
                    (|(_, (done, total, _))| total - done) as Value,
                ),
                (
                    "ferrite_backup_restore_chunks_on_demand",
                    "Chunks fetched because a client read or wrote them before the copy got there.",
                    |(_, (_, _, on_demand))| *on_demand,
                ),
            ],
        )
    }

    /// Per volume with synchronous replicas (labels: volume, and this daemon's role in it).
    fn encode_sync(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows = self.sync.list(None);
        let labels: Vec<_> = rows.iter().map(|r| [("volume", r.volume.as_str()), ("role", r.role.as_str())]).collect();
        let mut m = enc.encode_descriptor(
            "ferrite_sync_generation",
            "Generation of the membership this daemon holds.",
            None,
            MetricType::Gauge,
        )?;
        for (r, l) in rows.iter().zip(&labels) {
            m.encode_family(l)?.encode_gauge(&r.generation)?;
        }
        let mut m = enc.encode_descriptor(
            "ferrite_sync_members",
            "Members of the volume in each state (primary, in-sync, rebuilding, ejected, witness).",
            None,
            MetricType::Gauge,
        )?;
        for r in &rows {
            for state in ["primary", "in-sync", "rebuilding", "ejected", "witness"] {
                let n = r.members.iter().filter(|m| m.state == state).count() as u64;
                m.encode_family(&[("volume", r.volume.as_str()), ("state", state)])?.encode_gauge(&n)?;
            }
        }
        // The rest only where this daemon is the primary.
        let primaries: Vec<_> = rows.iter().filter_map(|r| self.sync.primary(&r.volume)).collect();
        let labels: Vec<_> = primaries.iter().map(|p| [("volume", p.volume.as_str())]).collect();
        let mut m = enc.encode_descriptor(
            "ferrite_sync_refusing_writes",
            "1 while the primary refuses writes (it lost the majority of its members, or stepped down).",
            None,
            MetricType::Gauge,
        )?;
        for (p, l) in primaries.iter().zip(&labels) {
            m.encode_family(l)?.encode_gauge(&u64::from(p.refused().is_some()))?;
        }
        let mut m = enc.encode_descriptor(
            "ferrite_sync_rebuild_bytes_left",
            "Data bytes the running rebuild still has to send.",
            None,
            MetricType::Gauge,
        )?;
        for (p, l) in primaries.iter().zip(&labels) {
            let left = p
                .progress
                .lock()
                .expect("not poisoned")
                .as_ref()
                .map_or(0, |(_, done, total)| total.saturating_sub(done.load(Ordering::Relaxed)));
            m.encode_family(l)?.encode_gauge(&left)?;
        }
        type Counter = fn(&Arc<crate::sync::primary::Primary>) -> u64;
        counters(
            enc,
            &primaries,
            &labels,
            &[
                (
                    "ferrite_sync_ejections",
                    "Members ejected for failing or not answering.",
                    (|p| load(&p.ejections)) as Counter,
                ),
                ("ferrite_sync_rebuild_sent_bytes", "Data bytes rebuilds sent to members.", |p| load(&p.rebuilt_bytes)),
            ],
        )?;
        let mut m = enc.encode_descriptor(
            "ferrite_sync_added_seconds",
            "Time a mirrored request waited for its members after the local write (the _count is the mirrored requests).",
            None,
            MetricType::Histogram,
        )?;
        for (p, l) in primaries.iter().zip(&labels) {
            let h = p.added.snapshot();
            m.encode_family(l)?.encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?;
        }
        Ok(())
    }
}

/// A family of samples: its name, its help, and each row's value.
type Family<'a, T, V> = (&'a str, &'a str, fn(&T) -> V);

/// One gauge family per `(name, help, value)`: a sample per row, labelled by `labels` (in the
/// rows' order).
fn gauges<T, L: EncodeLabelSet, V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    rows: &[T],
    labels: &[L],
    families: &[Family<T, V>],
) -> fmt::Result {
    for (name, help, value) in families {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (r, l) in rows.iter().zip(labels) {
            m.encode_family(l)?.encode_gauge(&value(r))?;
        }
    }
    Ok(())
}

/// The same for counters (the encoder adds `_total` to each name).
fn counters<T, L: EncodeLabelSet, V: EncodeCounterValue>(
    enc: &mut DescriptorEncoder,
    rows: &[T],
    labels: &[L],
    families: &[Family<T, V>],
) -> fmt::Result {
    for (name, help, value) in families {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (r, l) in rows.iter().zip(labels) {
            m.encode_family(l)?.encode_counter::<NoLabelSet, _, u64>(&value(r), None)?;
        }
    }
    Ok(())
}

/// The registry every scrape encodes.
fn registry(sources: Sources) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(sources));
    r
}

/// Renders every metric in the OpenMetrics text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail; a collector's error would leave a partial text.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::warn!(error = %e, "encoding metrics failed");
    }
    out
}

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn respond(req: Request<Incoming>, registry: Arc<Registry>) -> Response<String> {
    let reply = |status, body: String| {
        let mut r = Response::new(body);
        *r.status_mut() = status;
        r
    };
    if req.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, "not found; try /metrics\n".into());
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
        r.headers_mut().insert(ALLOW, "GET, HEAD".parse().expect("static header"));
        return r;
    }
    // The pool's statistics take its locks: off the async workers.
    let body = tokio::task::spawn_blocking(move || render(&registry)).await.unwrap_or_default();
    let mut r = reply(StatusCode::OK, body);
    r.headers_mut().insert(CONTENT_TYPE, OPENMETRICS.parse().expect("static header"));
    r
}

/// Largest request head hyper buffers (its minimum).
const MAX_HEAD: usize = 8 << 10;

/// Answers the clients `listen::accept` admits, one request each, each bounded in time (the
/// handshake timeout to send its request head, both timeouts together for the whole exchange)
/// and in size (8 KiB of request head).
pub async fn serve(mut clients: mpsc::Receiver<Guarded>, sources: Sources, limits: Limits) {
    let registry = Arc::new(registry(sources));
    let mut http = http1::Builder::new();
    http.keep_alive(false)
        .max_buf_size(MAX_HEAD)
        .timer(TokioTimer::new())
        .header_read_timeout(limits.handshake_timeout);
    let deadline = limits.handshake_timeout + limits.send_timeout;
    while let Some(stream) = clients.recv().await {
        let registry = Arc::clone(&registry);
        let peer = stream.peer();
        let exchange = http.serve_connection(
            TokioIo::new(stream),
            hyper::service::service_fn(move |req| {
                let registry = Arc::clone(&registry);
                async move { Ok::<_, Infallible>(respond(req, registry).await) }
            }),
        );
        tokio::spawn(async move {
            match tokio::time::timeout(deadline, exchange).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(?peer, error = %e, "metrics request failed"),
                Err(_) => tracing::debug!(?peer, "metrics client cut: too slow"),
            }
        });
    }
}
