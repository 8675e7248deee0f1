//! S3 Object Lock: a target whose every object version is locked for a number of days, so that
//! a stolen credential (or ransomware on a node) can neither delete nor overwrite what a backup
//! needs. Done as S3 defines it, and as kopia's maintenance does:
//! - **on upload**: every PUT carries its own retention (`x-amz-object-lock-mode` and
//!   `-retain-until-date`, now + `object-lock-days`); the bucket needs object lock enabled, not a
//!   default retention;
//! - **while referenced**: a prune extends the retention of every chunk it keeps, and of every
//!   manifest and index (PutObjectRetention), once the last extension is older than a quarter of
//!   the lock, and records when it did in `gc/condemned`.
//!
//! Dedup is what makes a lock subtle: a backup relies on chunks uploaded long before it. A chunk
//! present and not condemned is locked until at least `max(its upload, the last extension) +
//! days`. A backup uses such a chunk as it is while that is at most a quarter of the lock ago,
//! and extends it itself otherwise; when no prune has extended the chunks for a quarter of the
//! lock, a backup reads the whole volume (so it checks every chunk) once its last full backup is
//! older than that. **A backup is locked for at least half of `object-lock-days` from its
//! creation, and for three quarters of them ahead as long as it is kept and a prune runs at least
//! every quarter.**

use base64::Engine as _;
use object_store::aws::{AwsAuthorizer, AwsCredential};
use object_store::client::{HttpClient, HttpRequest, HttpRequestBody};

use crate::config::{Lock, LockMode, TargetConfig};

/// Whether an `ObjectLockConfiguration` document says the bucket has object lock (a default
/// retention is not needed: every PUT sets its own).
pub(crate) fn enabled(xml: &str) -> bool {
    field(xml, "ObjectLockEnabled") == Some("Enabled")
}

/// The text of the first `<name>` element of a flat S3 answer.
fn field<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
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

/// An ISO 8601 UTC time, as S3 writes retention dates.
fn iso8601(unix: u64) -> String {
    let id = crate::new_id(unix);
    format!("{}-{}-{}T{}:{}:{}Z", &id[..4], &id[4..6], &id[6..8], &id[9..11], &id[11..13], &id[13..15])
}

/// Who signs a target's requests: its key, and the region it signs for.
#[derive(Clone)]
struct Signer(std::sync::Arc<(AwsCredential, String)>);

impl Signer {
    /// Signs `req` (again), with the payload digest its `x-amz-content-sha256` names, if any.
    fn sign(&self, req: &mut HttpRequest) {
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

/// The retention a PUT's new version gets, carried to the HTTP client as a request extension:
/// object_store 0.13 has no attribute for these headers and signs a request before the client
/// sees it, so [`stamp`] adds them there and signs the request again.
#[derive(Clone)]
pub(crate) struct Retain {
    mode: LockMode,
    until: String,
    signer: Option<Signer>,
}

/// Adds the retention headers of the request's [`Retain`], if it has one (every attempt of a
/// retried PUT passes here, and is signed afresh).
pub(crate) fn stamp(req: &mut HttpRequest) {
    let Some(retain) = req.extensions().get::<Retain>().cloned() else { return };
    let headers = req.headers_mut();
    headers.insert("x-amz-object-lock-mode", http::HeaderValue::from_static(retain.mode.s3_name()));
    let until = http::HeaderValue::from_str(&retain.until).expect("a date is a header value");
    headers.insert("x-amz-object-lock-retain-until-date", until);
    if let Some(signer) = &retain.signer {
        signer.sign(req);
    }
}

/// An S3 target's object lock: stamps its uploads and extends retention (PutObjectRetention).
pub(crate) struct Locker {
    pub lock: Lock,
    signer: Option<Signer>,
    /// The bucket's URL with the target's prefix: an object's key follows.
    root: String,
    client: HttpClient,
}

impl std::fmt::Debug for Locker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locker").field("lock", &self.lock).field("root", &self.root).finish_non_exhaustive()
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

impl Locker {
    /// Checks that the bucket has object lock (a signed `GET ?object-lock`); the locker of a
    /// target under `prefix`.
    pub(crate) async fn open(
        config: &TargetConfig,
        client: HttpClient,
        credential: Option<AwsCredential>,
        lock: Lock,
        prefix: &str,
    ) -> Result<Locker, String> {
        let bucket = config.bucket.as_deref().unwrap_or_default();
        let url = bucket_url(config, bucket);
        let region = config.region.clone().unwrap_or_else(|| "us-east-1".into());
        let signer = credential.map(|c| Signer(std::sync::Arc::new((c, region))));
        let root = if prefix.is_empty() { url.clone() } else { format!("{url}/{}", encode_key(prefix)) };
        let locker = Locker { lock, signer, root, client };
        let (status, text) = locker.send(http::Method::GET, &format!("{url}?object-lock"), None).await?;
        if status.is_success() && enabled(&text) {
            return Ok(locker);
        }
        if status.is_success() || text.contains("ObjectLockConfigurationNotFoundError") {
            return Err(format!(
                "object-lock-days is set but bucket {bucket} has no object lock (a bucket gets it only when it is \
                 created: `aws s3api create-bucket --bucket NAME --object-lock-enabled-for-bucket`)"
            ));
        }
        Err(format!(
            "GET {url}?object-lock: {status} {} (the credential needs s3:GetBucketObjectLockConfiguration on the bucket)",
            field(&text, "Code").unwrap_or_default()
        ))
    }

    /// The retention a PUT made now gives its new version.
    pub(crate) fn retain(&self) -> Retain {
        let until = iso8601(self.lock.until(crate::now_unix()));
        Retain { mode: self.lock.mode, until, signer: self.signer.clone() }
    }

    /// Locks the current version of the object at `path` until `until` (unix seconds), or
    /// later: a version locked longer already is left as it is.
    pub(crate) async fn extend(&self, path: &str, until: u64) -> Result<(), String> {
        let url = format!("{}/{}?retention", self.root, encode_key(path));
        let until = iso8601(until);
        let body = format!(
            r#"<Retention xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Mode>{}</Mode><RetainUntilDate>{until}</RetainUntilDate></Retention>"#,
            self.lock.mode.s3_name()
        );
        let (status, text) = self.send(http::Method::PUT, &url, Some(body)).await?;
        if status.is_success() {
            return Ok(());
        }
        // A shorter retention is refused (403): longer already is what we want.
        if status == http::StatusCode::FORBIDDEN {
            let (status, held) = self.send(http::Method::GET, &url, None).await?;
            let date = field(&held, "RetainUntilDate").unwrap_or_default();
            if status.is_success() && date.get(..19).is_some_and(|d| d >= &until[..19]) {
                return Ok(());
            }
        }
        Err(format!(
            "PUT {url}: {status} {} (the credential needs s3:PutObjectRetention and s3:GetObjectRetention)",
            field(&text, "Code").unwrap_or_default()
        ))
    }

    /// Sends one signed request; its status and (capped) body.
    async fn send(
        &self,
        method: http::Method,
        url: &str,
        body: Option<String>,
    ) -> Result<(http::StatusCode, String), String> {
        let asked = format!("{method} {url}");
        let mut req = http::Request::builder().method(method).uri(url);
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_whether_the_bucket_has_a_lock() {
        let on = r#"<?xml version="1.0" encoding="UTF-8"?>
<ObjectLockConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><ObjectLockEnabled>Enabled</ObjectLockEnabled><Rule><DefaultRetention><Mode>GOVERNANCE</Mode><Days>30</Days></DefaultRetention></Rule></ObjectLockConfiguration>"#;
        assert!(enabled(on));
        assert!(enabled(
            "<ObjectLockConfiguration><ObjectLockEnabled>Enabled</ObjectLockEnabled></ObjectLockConfiguration>"
        ));
        assert!(!enabled("<ObjectLockConfiguration></ObjectLockConfiguration>"));
        assert!(!enabled("garbage"));
    }

    #[test]
    fn a_version_older_than_a_quarter_of_the_lock_is_stale() {
        let lock = Lock { mode: LockMode::Governance, days: 8 };
        let now = 100 * 86_400;
        assert!(!lock.is_stale(now - (2 * 86_400 - 1), now));
        assert!(lock.is_stale(now - (2 * 86_400 + 1), now));
        assert!(!lock.is_stale(now + 60, now), "a clock ahead of ours is not stale");
        assert_eq!(lock.until(10), 10 + 8 * 86_400);
    }

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
        assert_eq!(iso8601(1_795_861_815), "2026-11-28T10:30:15Z");
    }

    /// A stamped PUT carries the retention headers, and they are signed: S3 refuses `x-amz-*`
    /// headers the signature does not cover.
    #[test]
    fn a_stamped_put_signs_its_retention() {
        let credential = AwsCredential { key_id: "id".into(), secret_key: "secret".into(), token: None };
        let retain = Retain {
            mode: LockMode::Compliance,
            until: iso8601(1_795_861_815),
            signer: Some(Signer(std::sync::Arc::new((credential, "us-east-1".into())))),
        };
        let digest = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";
        let mut req = http::Request::builder()
            .method(http::Method::PUT)
            .uri("http://127.0.0.1:9000/b/chunks/ab/abc")
            .header("x-amz-content-sha256", digest)
            .header(http::header::AUTHORIZATION, "stale")
            .body(HttpRequestBody::from("hello".to_owned()))
            .unwrap();
        req.extensions_mut().insert(retain);
        stamp(&mut req);
        let h = req.headers();
        assert_eq!(h["x-amz-object-lock-mode"], "COMPLIANCE");
        assert_eq!(h["x-amz-object-lock-retain-until-date"], "2026-11-28T10:30:15Z");
        assert_eq!(h["x-amz-content-sha256"], digest, "the payload stays signed");
        let auth = h[http::header::AUTHORIZATION].to_str().unwrap();
        assert!(
            auth.contains("x-amz-object-lock-mode;x-amz-object-lock-retain-until-date"),
            "the retention is signed: {auth}"
        );
        // A request without the extension is left alone.
        let mut plain = http::Request::builder().uri("http://h/b/k").body(HttpRequestBody::empty()).unwrap();
        stamp(&mut plain);
        assert!(plain.headers().is_empty());
    }
}
