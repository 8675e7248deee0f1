//! S3 Object Lock: a target whose every object version is locked for a number of days, so that
//! a stolen credential (or ransomware on a node) can neither delete nor overwrite what a backup
//! needs. Done as S3 defines it, and as kopia's maintenance does:
//! - **on upload**: every PUT carries its own retention (`x-amz-object-lock-mode` and
//!   `-retain-until-date`, now + `object-lock-days`); the bucket needs object lock enabled, not a
//!   default retention;
//! - **while referenced**: a prune extends the retention of every chunk (condemned ones too: a
//!   backup may upload one again), manifest and index (PutObjectRetention), once the last
//!   extension is older than a quarter of the lock, and records when it did in `gc/condemned`
//!   ([`extend_all`]: checkpointed, and run even when the prune's mark or sweep fails).
//!
//! Dedup is what makes a lock subtle: a backup relies on chunks uploaded long before it. A chunk
//! present and not condemned is locked until at least `max(its upload, the last extension) +
//! days`. A backup uses such a chunk as it is while that is at most a quarter of the lock ago,
//! and extends it itself otherwise; when no prune has extended the chunks for a quarter of the
//! lock, a backup reads the whole volume (so it checks every chunk) once its last full backup is
//! older than that. **A backup is locked for at least half of `object-lock-days` from its
//! creation, and for three quarters of them ahead as long as it is kept and a prune runs at least
//! every quarter.**

use object_store::client::HttpRequest;

use futures_util::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::config::{Lock, LockMode};
use crate::signed::{Signed, Signer, field};
use crate::{Error, Target};

/// Whether an `ObjectLockConfiguration` document says the bucket has object lock (a default
/// retention is not needed: every PUT sets its own).
pub(crate) fn enabled(xml: &str) -> bool {
    field(xml, "ObjectLockEnabled") == Some("Enabled")
}

/// An ISO 8601 UTC time, as S3 writes retention dates.
fn iso8601(unix: u64) -> String {
    let id = crate::new_id(unix);
    format!("{}-{}-{}T{}:{}:{}Z", &id[..4], &id[4..6], &id[6..8], &id[9..11], &id[11..13], &id[13..15])
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
    signed: std::sync::Arc<Signed>,
}

impl std::fmt::Debug for Locker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locker").field("lock", &self.lock).field("signed", &self.signed).finish()
    }
}

impl Locker {
    /// Checks that `bucket` has object lock (a signed `GET ?object-lock`); the locker of a
    /// target that sends its own requests through `signed`.
    pub(crate) async fn open(signed: std::sync::Arc<Signed>, bucket: &str, lock: Lock) -> Result<Locker, String> {
        let url = signed.bucket.clone();
        let locker = Locker { lock, signed };
        let (status, text) = locker.signed.send(http::Method::GET, &format!("{url}?object-lock"), &[], None).await?;
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
        Retain { mode: self.lock.mode, until, signer: self.signed.signer.clone() }
    }

    /// Locks the current version of the object at `path` until `until` (unix seconds), or
    /// later: a version locked longer already is left as it is. False when the object is gone
    /// (404, or 405: its current version is a delete marker).
    pub(crate) async fn extend(&self, path: &str, until: u64) -> Result<bool, String> {
        let url = self.signed.object_url(path, "?retention");
        let until = iso8601(until);
        let body = format!(
            r#"<Retention xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Mode>{}</Mode><RetainUntilDate>{until}</RetainUntilDate></Retention>"#,
            self.lock.mode.s3_name()
        );
        let (status, text) = self.signed.send(http::Method::PUT, &url, &[], Some(body)).await?;
        if status.is_success() {
            return Ok(true);
        }
        if matches!(status, http::StatusCode::NOT_FOUND | http::StatusCode::METHOD_NOT_ALLOWED) {
            return Ok(false);
        }
        // A shorter retention is refused (403): longer already is what we want.
        if status == http::StatusCode::FORBIDDEN {
            let (status, held) = self.signed.send(http::Method::GET, &url, &[], None).await?;
            let date = field(&held, "RetainUntilDate").unwrap_or_default();
            if status.is_success() && date.get(..19).is_some_and(|d| d >= &until[..19]) {
                return Ok(true);
            }
        }
        Err(format!(
            "PUT {url}: {status} {} (the credential needs s3:PutObjectRetention and s3:GetObjectRetention)",
            field(&text, "Code").unwrap_or_default()
        ))
    }
}

/// How far a prune's extension of every lock got: the next prune resumes it after a failure.
#[derive(Debug, Serialize, Deserialize)]
struct Checkpoint {
    /// When the run began (unix seconds, the store's clock): what it extended is locked until
    /// then + the lock's days.
    since: i64,
    /// The last object it extended (in listing order, `volumes/` before `chunks/`), if any.
    after: Option<String>,
}

/// Where the checkpoint is (an envelope of the GC's kind, bound to its name).
const CHECKPOINT: &str = "gc/locking";
/// Objects extended between two checkpoints.
const CHECKPOINT_EVERY: usize = 10_000;

/// Extends the lock of every object of `target` (the marker, manifests, indexes, chunks, the
/// condemned ones too: a backup may upload one again) until `now` + the lock's days; objects
/// deleted meanwhile are skipped. A run a failure cut short is resumed where it stopped while
/// what it extended still holds for three quarters of the lock. How many it extended, and since
/// when every object is locked (the run's start).
pub(crate) async fn extend_all(target: &Target, lock: Lock, now: i64) -> Result<(u64, i64), Error> {
    let resumed = match target.get_object(Kind::Condemned, CHECKPOINT, 64 << 10).await {
        Ok((data, _)) => serde_json::from_slice::<Checkpoint>(&data).ok().filter(|c| !lock.is_stale(c.since, now)),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(e),
    };
    let mut at = resumed.unwrap_or(Checkpoint { since: now, after: None });
    let until = lock.until(u64::try_from(at.since).unwrap_or(0));
    let mut extended = 0u64;
    if at.after.is_none() && target.extend_lock(crate::target::MARKER, until).await? {
        extended += 1;
    }
    // S3 lists in key order (only S3 targets have a lock): a resumed run skips what sorts before.
    let phase = |path: &str| u8::from(path.starts_with("chunks/"));
    for (prefix, max) in [("volumes", crate::prune::MAX_VOLUME_OBJECTS), ("chunks", crate::prune::MAX_CHUNKS)] {
        let mut listed = target.list_stream(prefix, max).try_chunks(CHECKPOINT_EVERY);
        while let Some(batch) = listed.try_next().await.map_err(|e| e.1)? {
            let todo: Vec<String> = batch
                .into_iter()
                .map(|o| o.location.to_string())
                .filter(|p| at.after.as_deref().is_none_or(|a| (phase(p), p.as_str()) > (phase(a), a)))
                .collect();
            let Some(last) = todo.last().cloned() else { continue };
            let done: Vec<bool> = futures_util::stream::iter(todo)
                .map(|path| async move { target.extend_lock(&path, until).await })
                .buffer_unordered(target.concurrency())
                .try_collect()
                .await?;
            extended += done.iter().filter(|&&d| d).count() as u64;
            at.after = Some(last);
            let data = serde_json::to_vec(&at).expect("serialises");
            target.put_object(Kind::Condemned, CHECKPOINT, data).await?;
        }
    }
    target.delete(CHECKPOINT).await?;
    Ok((extended, at.since))
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
    fn writes_retention_dates_as_s3_does() {
        assert_eq!(iso8601(1_795_861_815), "2026-11-28T10:30:15Z");
    }

    /// A stamped PUT carries the retention headers, and they are signed: S3 refuses `x-amz-*`
    /// headers the signature does not cover.
    #[test]
    fn a_stamped_put_signs_its_retention() {
        let credential =
            object_store::aws::AwsCredential { key_id: "id".into(), secret_key: "secret".into(), token: None };
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
            .body(object_store::client::HttpRequestBody::from("hello".to_owned()))
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
        let mut plain =
            http::Request::builder().uri("http://h/b/k").body(object_store::client::HttpRequestBody::empty()).unwrap();
        stamp(&mut plain);
        assert!(plain.headers().is_empty());
    }
}
