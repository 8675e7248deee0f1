//! Requests to an S3 target that object_store 0.13 does not make: PutObjectRetention and
//! `?object-lock` (`object_lock.rs`), and a DELETE conditional on the version a HEAD saw. Our
//! own, signed with the target's key (SigV4, as object_store signs) and sent through the bounded
//! HTTP client (`bounded.rs`).

use base64::Engine as _;
use object_store::aws::{AwsAuthorizer, AwsCredential};
use object_store::client::{HttpClient, HttpRequest, HttpRequestBody};

use crate::config::TargetConfig;

/// The text of the first `<name>` element of a flat S3 answer.
pub(crate) fn field<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let (open, close) = (format!("<{name}>"), format!("</{name}>"));
    let start = xml.find(&open)? + open.len();
    let len = xml[start..].find(&close)?;
    Some(xml[start..start + len].trim())
}

/// The bucket's URL, as object_store addresses it.
fn bucket_url(config: &TargetConfig, bucket: &str) -> String {
    let region = config.region.as_deref().unwrap_or("us-east-1");
    match (config.endpoint.as_deref().map(|e| e.trim_end_matches('/')), config.virtual_hosted) {
        // object_store takes a virtual-hosted endpoint with the bucket already in it.
        (Some(e), true) => e.to_owned(),
        (Some(e), false) => format!("{e}/{bucket}"),
        (None, true) => format!("https://{bucket}.s3.{region}.amazonaws.com"),
        (None, false) => format!("https://s3.{region}.amazonaws.com/{bucket}"),
    }
}

/// Who signs a target's requests: its key, and the region it signs for.
#[derive(Clone)]
pub(crate) struct Signer(pub(crate) std::sync::Arc<(AwsCredential, String)>);

impl Signer {
    /// Signs `req` (again), with the payload digest its `x-amz-content-sha256` names, if any.
    pub(crate) fn sign(&self, req: &mut HttpRequest) {
        let (credential, region) = &*self.0;
        req.headers_mut().remove(http::header::AUTHORIZATION);
        let digest = req.headers().get("x-amz-content-sha256").and_then(|v| crate::codec::unhex(v.to_str().ok()?));
        let authorizer = AwsAuthorizer::new(credential, "s3", region);
        match digest.filter(|d| d.len() == 32) {
            Some(d) => authorizer.authorize(req, Some(&d)),
            None => authorizer.with_sign_payload(false).authorize(req, None),
        }
    }
}

/// Characters left as they are in a key's URL path (S3's unreserved set and `/`).
fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An S3 target's own signed requests.
pub(crate) struct Signed {
    pub(crate) signer: Option<Signer>,
    /// The bucket's URL.
    pub(crate) bucket: String,
    /// The bucket's URL with the target's prefix: an object's key follows.
    root: String,
    client: HttpClient,
}

impl std::fmt::Debug for Signed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signed").field("root", &self.root).finish_non_exhaustive()
    }
}

impl Signed {
    /// The requests of a target under `prefix`, signed with `credential` (unsigned without).
    pub(crate) fn new(
        config: &TargetConfig,
        client: HttpClient,
        credential: Option<AwsCredential>,
        prefix: &str,
    ) -> Signed {
        let bucket = bucket_url(config, config.bucket.as_deref().unwrap_or_default());
        let region = config.region.clone().unwrap_or_else(|| "us-east-1".into());
        let signer = credential.map(|c| Signer(std::sync::Arc::new((c, region))));
        let root = if prefix.is_empty() { bucket.clone() } else { format!("{bucket}/{}", encode_key(prefix)) };
        Signed { signer, bucket, root, client }
    }

    /// The URL of the object at `path` under the target's prefix, with `query` (`?…` or "").
    pub(crate) fn object_url(&self, path: &str, query: &str) -> String {
        format!("{}/{}{query}", self.root, encode_key(path))
    }

    /// Sends one signed request with `headers`; its status and body.
    pub(crate) async fn send(
        &self,
        method: http::Method,
        url: &str,
        headers: &[(&'static str, &str)],
        body: Option<String>,
    ) -> Result<(http::StatusCode, String), String> {
        let asked = format!("{method} {url}");
        let mut req = http::Request::builder().method(method).uri(url);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        if let Some(body) = &body {
            let sum = ring::digest::digest(&ring::digest::SHA256, body.as_bytes());
            req = req
                .header("x-amz-checksum-sha256", base64::engine::general_purpose::STANDARD.encode(sum))
                .header("x-amz-sdk-checksum-algorithm", "SHA256");
        }
        let body = body.map_or_else(HttpRequestBody::empty, |b| HttpRequestBody::from(b.into_bytes()));
        let mut req = req.body(body).map_err(|e| format!("{asked}: {e}"))?;
        if let Some(signer) = &self.signer {
            signer.sign(&mut req);
        }
        let res = self.client.execute(req).await.map_err(|e| format!("{asked}: {e}"))?;
        let status = res.status();
        let text = res.into_body().bytes().await.map_err(|e| format!("{asked}: {e}"))?;
        Ok((status, String::from_utf8_lossy(&text).into_owned()))
    }

    /// Deletes the object at `path` if its current version still has `e_tag`: Some(true) when
    /// it is gone (deleted, or absent), Some(false) when another version replaced it, None when
    /// the store does not honour the condition (it says so with 501 or 400).
    pub(crate) async fn delete_if(&self, path: &str, e_tag: &str) -> Result<Option<bool>, String> {
        let url = self.object_url(path, "");
        let (status, text) = self.send(http::Method::DELETE, &url, &[("if-match", e_tag)], None).await?;
        match status {
            s if s.is_success() || s == http::StatusCode::NOT_FOUND => Ok(Some(true)),
            http::StatusCode::PRECONDITION_FAILED => Ok(Some(false)),
            http::StatusCode::NOT_IMPLEMENTED | http::StatusCode::BAD_REQUEST => Ok(None),
            s => Err(format!("DELETE {url}: {s} {}", field(&text, "Code").unwrap_or_default())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_the_bucket_as_object_store_does() {
        let mut c = TargetConfig { endpoint: Some("http://127.0.0.1:9000/".into()), ..TargetConfig::default() };
        assert_eq!(bucket_url(&c, "b"), "http://127.0.0.1:9000/b");
        c.endpoint = None;
        c.region = Some("eu-west-1".into());
        assert_eq!(bucket_url(&c, "b"), "https://s3.eu-west-1.amazonaws.com/b");
        c.virtual_hosted = true;
        assert_eq!(bucket_url(&c, "b"), "https://b.s3.eu-west-1.amazonaws.com");
        assert_eq!(encode_key("volumes/db 1/ä"), "volumes/db%201/%C3%A4");
    }
}
