//! The controller's admission webhook: an HTTPS endpoint the API server calls with an
//! `AdmissionReview` before a Node is cordoned (the `ferrite-drain-guard`
//! ValidatingWebhookConfiguration, deploy/kubernetes/base/webhook.yaml). What it answers is the
//! drain guard's (`failover/guard.rs`); this module is the listener: TLS with the controller's
//! certificate (which names the controller Service; reloaded when it changes), and bounded like
//! every listener: connections (overall and per source address), request size, time. `GET /metrics` serves the failover
//! controller's metrics (`failover/metrics.rs`) on the same port.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferrite_tls::Reloading;
use ferrite_tls::rustls::ServerConfig;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// The path the drain guard answers on.
pub const PATH: &str = "/drain-guard";
/// At most this many connections at once (the API server sends one review per cordon), and
/// from one address: anyone in the cluster can connect, and none may take the API server's slots.
const MAX_CONNECTIONS: usize = 32;
const PER_SOURCE: usize = 8;
/// The largest review taken: a Node twice (object and oldObject), with its image list.
const MAX_BODY: usize = 4 << 20;
/// For the TLS handshake and the request head; for the whole exchange (the API server's own
/// timeout for the webhook is shorter).
const HANDSHAKE: Duration = Duration::from_secs(5);
const EXCHANGE: Duration = Duration::from_secs(15);

/// What a review decided: allowed or not, why, and warnings `kubectl` shows either way.
#[derive(Debug, Default, PartialEq)]
pub struct Answer {
    pub allowed: bool,
    pub message: String,
    pub warnings: Vec<String>,
}

impl Answer {
    pub fn allow() -> Self {
        Self { allowed: true, ..Self::default() }
    }
}

/// Judges an admission request (the `request` of an AdmissionReview).
pub trait Review: Send + Sync + 'static {
    fn review<'a>(&'a self, request: &'a Value) -> Pin<Box<dyn Future<Output = Answer> + Send + 'a>>;
}

/// What `GET /metrics` answers (the failover controller's metrics, OpenMetrics text).
pub trait Exposition: Send + Sync + 'static {
    fn render(&self) -> String;
}

/// Serves reviews on `listener` until the process ends.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<Reloading<ServerConfig>>,
    judge: Arc<dyn Review>,
    metrics: Arc<dyn Exposition>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let sources = Sources::default();
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: try again shortly rather than spin.
                tracing::warn!("webhook: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(from) = sources.take(peer.ip()) else {
            tracing::warn!(%peer, "webhook: {PER_SOURCE} connections from this address open already; refused");
            continue;
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!(%peer, "webhook: {MAX_CONNECTIONS} connections open already; refused");
            continue;
        };
        let acceptor = ferrite_tls::TlsAcceptor::from(tls.current());
        let judge = Arc::clone(&judge);
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let _slots = (slot, from);
            let exchange = async {
                let stream = tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp))
                    .await
                    .map_err(|_| "TLS handshake timed out".to_owned())?
                    .map_err(|e| format!("TLS handshake: {e}"))?;
                let mut http = http1::Builder::new();
                http.keep_alive(false).timer(TokioTimer::new()).header_read_timeout(HANDSHAKE);
                let service = hyper::service::service_fn(move |req| {
                    let (judge, metrics) = (Arc::clone(&judge), Arc::clone(&metrics));
                    async move { Ok::<_, Infallible>(respond(req, &*judge, &*metrics).await) }
                });
                http.serve_connection(TokioIo::new(stream), service).await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(EXCHANGE, exchange).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%peer, "webhook exchange: {e}"),
                Err(_) => tracing::debug!(%peer, "webhook client cut: too slow"),
            }
        });
    }
}

/// Connections open per source address.
#[derive(Clone, Default)]
struct Sources(Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>);

/// One connection of a source; its count drops with it.
struct SourceSlot(Sources, std::net::IpAddr);

impl Sources {
    /// A slot for a connection from `ip`, unless [`PER_SOURCE`] are open from there.
    fn take(&self, ip: std::net::IpAddr) -> Option<SourceSlot> {
        let mut open = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = open.entry(ip.to_canonical()).or_default();
        if *n >= PER_SOURCE {
            return None;
        }
        *n += 1;
        Some(SourceSlot(self.clone(), ip.to_canonical()))
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut open = self.0.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.1);
            }
        }
    }
}

fn reply(status: StatusCode, body: String) -> Response<String> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    if status == StatusCode::OK {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, "application/json".parse().expect("static header"));
    }
    r
}

async fn respond(req: Request<Incoming>, judge: &dyn Review, metrics: &dyn Exposition) -> Response<String> {
    if req.uri().path() == "/metrics" && req.method() == Method::GET {
        let mut r = Response::new(metrics.render());
        let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, kind.parse().expect("static header"));
        return r;
    }
    if req.uri().path() != PATH {
        return reply(StatusCode::NOT_FOUND, format!("not found; the drain guard is at {PATH}\n"));
    }
    if req.method() != Method::POST {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "only POST\n".into());
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return reply(StatusCode::PAYLOAD_TOO_LARGE, format!("request body: {e}\n")),
    };
    match answer(&body, judge).await {
        Ok(review) => reply(StatusCode::OK, review.to_string()),
        Err(e) => reply(StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

/// The AdmissionReview (v1) answering the one in `body`.
async fn answer(body: &[u8], judge: &dyn Review) -> Result<Value, String> {
    let review: Value = serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}"))?;
    if review["apiVersion"] != "admission.k8s.io/v1" || review["kind"] != "AdmissionReview" {
        return Err("not an admission.k8s.io/v1 AdmissionReview".into());
    }
    let request = &review["request"];
    let uid = request["uid"].as_str().filter(|u| !u.is_empty()).ok_or("the review has no request.uid")?;
    let a = judge.review(request).await;
    let mut response = json!({"uid": uid, "allowed": a.allowed});
    if !a.allowed {
        response["status"] = json!({"code": 403, "reason": "Forbidden", "message": a.message});
    }
    if !a.warnings.is_empty() {
        response["warnings"] = json!(a.warnings);
    }
    Ok(json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Refuse;
    impl Review for Refuse {
        fn review<'a>(&'a self, request: &'a Value) -> Pin<Box<dyn Future<Output = Answer> + Send + 'a>> {
            Box::pin(async move {
                Answer {
                    allowed: false,
                    message: format!("no to {}", request["name"].as_str().unwrap_or("?")),
                    warnings: vec!["careful".into()],
                }
            })
        }
    }

    #[test]
    fn one_address_takes_its_share_of_connections_only() {
        let sources = Sources::default();
        let (a, b) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let held: Vec<SourceSlot> = (0..PER_SOURCE).map(|_| sources.take(a).unwrap()).collect();
        assert!(sources.take(a).is_none(), "a ninth from one address");
        assert!(sources.take("::ffff:10.0.0.1".parse().unwrap()).is_none(), "the same address, mapped");
        assert!(sources.take(b).is_some(), "another address is served");
        drop(held);
        assert!(sources.take(a).is_some());
        assert_eq!(sources.0.lock().unwrap().len(), 0, "closed connections leave nothing counted");
    }

    #[tokio::test]
    async fn answers_reviews_and_refuses_what_is_not_one() {
        let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "name": "node-b"}});
        let out = answer(review.to_string().as_bytes(), &Refuse).await.unwrap();
        assert_eq!(out["response"]["uid"], "u-1");
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["message"], "no to node-b");
        assert_eq!(out["response"]["warnings"], json!(["careful"]));
        assert!(answer(b"{", &Refuse).await.unwrap_err().contains("not an AdmissionReview"));
        let v1beta1 = json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
            "request": {"uid": "u"}});
        assert!(answer(v1beta1.to_string().as_bytes(), &Refuse).await.is_err());
        let no_uid = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}});
        assert!(answer(no_uid.to_string().as_bytes(), &Refuse).await.unwrap_err().contains("uid"));
    }
}
