//! Bounds on what an S3 store may send back. object_store reads some answers whole (LIST pages,
//! error bodies) and sizes its buffer from the Content-Length the store claims: one answer
//! claiming 64 GiB aborted the daemon. Every S3 target's HTTP client is object_store's own
//! (reqwest) wrapped here: an answer that object_store buffers may hold at most
//! [`MAX_BUFFERED`] bytes, refused as soon as its Content-Length or its bytes go past that, and
//! no body may ask for more than [`MAX_HINT`] bytes in advance. An object's body (a GET) is not
//! capped here: [`crate::Target`] streams it with the cap of the object it expects.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use object_store::ClientOptions;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpResponseBody, HttpService,
    ReqwestConnector,
};

/// Most bytes of an answer read whole: a LIST page holds at most 1000 keys of at most 1 KiB
/// each (S3's limits), an error, a PUT's answer or a bucket's object lock a few hundred bytes.
pub const MAX_BUFFERED: u64 = 4 << 20;
/// Most bytes a body's size hint may announce (what a reader preallocates).
const MAX_HINT: u64 = 1 << 20;

/// Makes the bounded client of an S3 target.
#[derive(Debug, Default)]
pub(crate) struct BoundedConnector;

impl HttpConnector for BoundedConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(Bounded(ReqwestConnector::default().connect(options)?)))
    }
}

#[derive(Debug)]
struct Bounded(HttpClient);

fn too_large(what: String) -> HttpError {
    HttpError::new(HttpErrorKind::Decode, std::io::Error::new(std::io::ErrorKind::InvalidData, what))
}

#[async_trait::async_trait]
impl HttpService for Bounded {
    async fn call(&self, mut req: HttpRequest) -> Result<HttpResponse, HttpError> {
        crate::object_lock::stamp(&mut req);
        // A HEAD's Content-Length is the object's, and it has no body.
        if req.method() == http::Method::HEAD {
            return self.0.execute(req).await;
        }
        // An object's GET has no query; a listing, `?object-lock` and the like are answers.
        let object = req.method() == http::Method::GET && req.uri().query().is_none();
        let res = self.0.execute(req).await?;
        let cap = if object && res.status().is_success() { u64::MAX } else { MAX_BUFFERED };
        let claimed =
            res.headers().get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if let Some(len) = claimed.filter(|&len| len > cap) {
            return Err(too_large(format!("the store announced an answer of {len} bytes; at most {cap} are read")));
        }
        let (parts, body) = res.into_parts();
        Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(Capped { inner: body, left: cap, cap, ended: false })))
    }
}

/// A body that fails once it has delivered more than `cap` bytes, and announces at most
/// `MAX_HINT`.
struct Capped {
    inner: HttpResponseBody,
    left: u64,
    cap: u64,
    ended: bool,
}

impl Body for Capped {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            let n = data.len() as u64;
            if n > self.left {
                self.ended = true;
                let cap = self.cap;
                return Poll::Ready(Some(Err(too_large(format!("the store's answer ran past {cap} bytes")))));
            }
            self.left -= n;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = SizeHint::new();
        hint.set_lower(self.inner.size_hint().lower().min(MAX_HINT));
        hint
    }
}
