//! The tower layer every gRPC server of the daemon runs its services behind: it turns the
//! connection into a [`Caller`], checks the call against the role table and either refuses it
//! (PermissionDenied, before any handler runs) or passes it on with the caller in the request's
//! extensions, where handlers that decide per object (the Replica service) find it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::codegen::http;

use super::{Caller, PeerInfo, Policy};

/// How a listener's clients are identified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The admin socket (root-only), or TCP without TLS by the operator's choice: operators.
    Local,
    /// Mutual TLS: the client certificate's names.
    Certificate,
}

/// The layer: one per server.
#[derive(Debug, Clone)]
pub struct Authorize {
    policy: Arc<Policy>,
    source: Source,
}

impl Authorize {
    pub fn new(policy: Arc<Policy>, source: Source) -> Self {
        Self { policy, source }
    }
}

impl<S> tower::Layer<S> for Authorize {
    type Service = Authorized<S>;
    fn layer(&self, inner: S) -> Authorized<S> {
        Authorized { inner, policy: Arc::clone(&self.policy), source: self.source }
    }
}

/// A service behind the layer.
#[derive(Debug, Clone)]
pub struct Authorized<S> {
    inner: S,
    policy: Arc<Policy>,
    source: Source,
}

impl<S> Authorized<S> {
    fn caller<B>(&self, req: &http::Request<B>) -> Caller {
        match self.source {
            Source::Local => Caller::local(),
            Source::Certificate => {
                let names = req.extensions().get::<PeerInfo>().map(|p| p.names.as_slice()).unwrap_or_default();
                self.policy.caller(names)
            }
        }
    }
}

/// Refuses a caller whose version may not talk to this daemon ([`ferrite_proto::version`]).
fn skew<B>(req: &http::Request<B>) -> Result<(), tonic::Status> {
    use ferrite_proto::version::{self, Caller};
    let ua = req.headers().get(http::header::USER_AGENT).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let Some(theirs) = version::from_user_agent(ua) else { return Ok(()) };
    let path = req.uri().path();
    let role = if path.starts_with("/ferrite.v1.Admin/") { Caller::Client } else { Caller::Peer };
    version::check(role, theirs, version::VERSION).map_err(|why| {
        tracing::warn!(call = path, caller_version = theirs, "refused: {why}");
        tonic::Status::failed_precondition(why)
    })
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for Authorized<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let caller = self.caller(&req);
        let checked = self.policy.check(&caller, req.uri().path()).and_then(|()| skew(&req));
        match checked {
            Ok(()) => {
                req.extensions_mut().insert(caller);
                Box::pin(self.inner.call(req))
            }
            Err(refused) => Box::pin(std::future::ready(Ok(refused.into_http()))),
        }
    }
}
