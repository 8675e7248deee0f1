//! The opt-in Prometheus endpoint (`metrics-listen`): `GET /metrics` in the OpenMetrics text
//! format, behind the same fence list, connection limit and TLS as the other TCP listeners
//! (`listen.rs`). prometheus-client encodes; hyper speaks HTTP/1.1, one request per connection.
//! Every value is read at scrape time from the counters the pool, the NBD server and the
//! listeners keep anyway (a `Collector`), so nothing on the data path knows about Prometheus.
//! The families are encoded by phase: `daemon.rs` (daemon-wide), `volumes.rs` (volumes and
//! exports), `replication.rs` (replicas, backups, synchronous replicas), over `families.rs`.

mod daemon;
mod families;
mod replication;
mod volumes;

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
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use crate::base::config::Limits;
use crate::net::listen::{Guarded, ListenerStats};
use crate::records::backup_outcomes::BackupOutcomes;
use crate::replica::Replication;

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
        self.encode_daemon(&mut enc)?;
        self.encode_volumes(&mut enc)?;
        self.encode_replication(&mut enc)?;
        self.encode_backups(&mut enc)?;
        self.encode_sync(&mut enc)
    }
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
