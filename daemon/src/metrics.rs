//! The opt-in Prometheus endpoint (`metrics-listen`): `GET /metrics` in the text format, behind
//! the same fence list, connection limit and TLS as the other TCP listeners (`listen.rs`).
//! A tiny HTTP/1.1 responder: one request per connection, anything else gets 404/400.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferrite_engine::Pool;
use ferrite_nbd::Server;
use ferrite_nbd::metrics::{escape, render_headers};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::config::Limits;
use crate::listen::{Guarded, ListenerStats};

/// Renders every metric.
pub fn render(pool: &Pool, nbd: &Server, listeners: &Listeners) -> String {
    let mut out = String::new();
    let s = pool.stats();
    for (name, help, v) in [
        ("ferrite_pool_size_bytes", "Data area of the pool.", s.size),
        ("ferrite_pool_used_bytes", "Bytes of log in segments that are not free.", s.used),
        ("ferrite_pool_free_bytes", "Bytes free for client writes (reserve excluded).", s.free),
        ("ferrite_pool_live_bytes", "Bytes mapped by some volume.", s.live),
        ("ferrite_pool_reclaimable_bytes", "Dead bytes in sealed segments.", s.reclaimable),
        ("ferrite_pool_segments_free", "Free segments.", s.segments_free),
        ("ferrite_pool_volumes", "Volumes in the pool.", s.volumes as u64),
        ("ferrite_nbd_connections_open", "Open NBD connections.", nbd.stats.connections_open.load(Ordering::Relaxed)),
        ("ferrite_cleaner_active", "1 while the cleaner runs.", u64::from(s.cleaner_active)),
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
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    for (name, help, v) in [
        ("ferrite_pool_client_written_bytes_total", "Bytes clients wrote.", s.client_bytes_written),
        ("ferrite_pool_media_written_bytes_total", "Bytes the log wrote to media.", s.media_bytes_written),
        (
            "ferrite_admin_connections_refused_total",
            "Admin API TCP clients closed on arrival: the listener was at max-connections.",
            listeners.admin.refused.load(Ordering::Relaxed),
        ),
        (
            "ferrite_admin_tls_handshake_failures_total",
            "Admin API TCP clients whose TLS handshake failed or timed out.",
            listeners.admin.handshake_failures.load(Ordering::Relaxed),
        ),
        (
            "ferrite_metrics_connections_refused_total",
            "Metrics clients closed on arrival: the listener was at max-connections.",
            listeners.metrics.refused.load(Ordering::Relaxed),
        ),
        ("ferrite_cleaner_segments_cleaned_total", "Segments the cleaner emptied.", s.cleaner_segments_cleaned),
        ("ferrite_cleaner_moved_bytes_total", "Live bytes the cleaner moved.", s.cleaner_bytes_moved),
        ("ferrite_readahead_read_bytes_total", "Bytes read ahead for sequential readers.", s.readahead_bytes),
        ("ferrite_readahead_hit_bytes_total", "Bytes reads took from what was read ahead.", s.readahead_hit_bytes),
        (
            "ferrite_nbd_connections_total",
            "NBD connections accepted.",
            nbd.stats.connections_total.load(Ordering::Relaxed),
        ),
        (
            "ferrite_nbd_connections_refused_total",
            "NBD clients closed on arrival: the listener was at max-connections.",
            nbd.stats.connections_refused.load(Ordering::Relaxed),
        ),
        (
            "ferrite_nbd_handshake_timeouts_total",
            "NBD clients cut for not finishing the handshake in time.",
            nbd.stats.handshake_timeouts.load(Ordering::Relaxed),
        ),
        (
            "ferrite_nbd_accept_errors_total",
            "Failed accept() calls on NBD listeners (retried).",
            nbd.stats.accept_errors.load(Ordering::Relaxed),
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
    let _ = writeln!(out, "# HELP ferrite_volume_size_bytes Provisioned size.\n# TYPE ferrite_volume_size_bytes gauge");
    let _ = writeln!(
        out,
        "# HELP ferrite_volume_allocated_bytes Mapped bytes.\n# TYPE ferrite_volume_allocated_bytes gauge"
    );
    for v in pool.volumes() {
        let l = escape(&v.name);
        let _ = writeln!(out, "ferrite_volume_size_bytes{{volume=\"{l}\"}} {}", v.size);
        let _ = writeln!(out, "ferrite_volume_allocated_bytes{{volume=\"{l}\"}} {}", v.allocated);
    }
    render_headers(&mut out);
    for e in nbd.exports.list() {
        e.metrics.render(&mut out, &e.name, e.volume.name());
    }
    out
}

/// Counters of the daemon's own TCP listeners.
#[derive(Debug, Clone, Default)]
pub struct Listeners {
    pub admin: Arc<ListenerStats>,
    pub metrics: Arc<ListenerStats>,
}

/// Most bytes of a request head (request line and headers).
const MAX_HEAD: usize = 8 << 10;

async fn answer(mut stream: Guarded, pool: Arc<Pool>, nbd: Arc<Server>, listeners: Listeners) -> std::io::Result<()> {
    let mut req = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || req.len() > MAX_HEAD {
            return Ok(());
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&req);
    let mut parts = line.split_whitespace();
    let (status, body) = match (parts.next(), parts.next()) {
        (Some("GET"), Some("/metrics")) => {
            ("200 OK", tokio::task::spawn_blocking(move || render(&pool, &nbd, &listeners)).await.unwrap_or_default())
        }
        (Some(_), Some(_)) => ("404 Not Found", "not found; try /metrics\n".to_string()),
        _ => ("400 Bad Request", String::new()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

/// Answers the clients `listen::accept` admits, one request each, each bounded in time (the
/// handshake timeout to send its request, the send timeout for the answer) and size.
pub async fn serve(
    mut clients: mpsc::Receiver<Guarded>,
    pool: Arc<Pool>,
    nbd: Arc<Server>,
    listeners: Listeners,
    limits: Limits,
) {
    while let Some(stream) = clients.recv().await {
        let (pool, nbd, listeners) = (Arc::clone(&pool), Arc::clone(&nbd), listeners.clone());
        let deadline = limits.handshake_timeout + limits.send_timeout;
        tokio::spawn(async move {
            let peer = stream.peer();
            match tokio::time::timeout(deadline, answer(stream, pool, nbd, listeners)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(?peer, error = %e, "metrics request failed"),
                Err(_) => tracing::debug!(?peer, "metrics client cut: too slow"),
            }
        });
    }
}
