//! S3 Object Lock: a target whose bucket keeps every object version for a number of days, so
//! that a stolen credential (or ransomware on a node) can neither delete nor overwrite what a
//! backup needs. Ferrite does not set retention per object: object_store 0.13 cannot sign the
//! per-request retention headers. The bucket's default retention does it for every PUT, and
//! the target checks at open that the bucket has it (mode, at least `object-lock-days`).
//!
//! Dedup is what makes a lock subtle: a chunk uploaded once is locked from its upload, yet a
//! backup made much later references it. So a backup on a locked target uploads again any chunk
//! whose stored version is older than a quarter of the lock (a new version, locked afresh), and
//! every such quarter reads the whole volume once (a full backup HEADs every chunk). Each chunk
//! a backup references then has a version at most half the lock old: **a backup is protected
//! for at least half of `object-lock-days` from its creation**.

use std::time::{Duration, SystemTime};

use object_store::ClientOptions;
use object_store::aws::{AwsAuthorizer, AwsCredential};
use object_store::client::{HttpConnector, HttpRequestBody};
use serde::{Deserialize, Serialize};

use crate::target::TargetConfig;

/// How the bucket's lock treats its own administrators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LockMode {
    /// Users with `s3:BypassGovernanceRetention` may still delete a locked version.
    Governance,
    /// Nobody may delete a locked version before its date, not even the account's root.
    Compliance,
}

impl LockMode {
    fn s3_name(self) -> &'static str {
        match self {
            LockMode::Governance => "GOVERNANCE",
            LockMode::Compliance => "COMPLIANCE",
        }
    }
}

/// The lock a target's config asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lock {
    pub mode: LockMode,
    pub days: u64,
}

impl Lock {
    /// From `object-lock-days` / `object-lock-mode` (governance by default).
    pub(crate) fn of(config: &TargetConfig) -> Option<Lock> {
        config.object_lock_days.map(|days| Lock { mode: config.object_lock_mode.unwrap_or(LockMode::Governance), days })
    }

    /// A stored chunk older than this is uploaded again, and a backup reads the whole volume
    /// once the last full backup is older than this.
    pub(crate) fn refresh(self) -> Duration {
        Duration::from_secs(self.days * 86_400 / 4)
    }

    /// Whether a version stored at `stored` is too old for a backup made at `now` to rely on.
    pub(crate) fn is_stale(self, stored: SystemTime, now: SystemTime) -> bool {
        now.duration_since(stored).is_ok_and(|age| age > self.refresh())
    }
}

/// What `GET ?object-lock` says of the bucket.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BucketLock {
    pub enabled: bool,
    pub default: Option<(String, u64)>,
}

/// Reads the few fields of an `ObjectLockConfiguration` document (a fixed, flat shape).
pub(crate) fn parse(xml: &str) -> BucketLock {
    let field = |name: &str| {
        let (open, close) = (format!("<{name}>"), format!("</{name}>"));
        let start = xml.find(&open)? + open.len();
        let len = xml[start..].find(&close)?;
        Some(xml[start..start + len].trim().to_owned())
    };
    let days = match (field("Days"), field("Years")) {
        (Some(d), _) => d.parse().ok(),
        (None, Some(y)) => y.parse::<u64>().ok().map(|y| y * 365),
        _ => None,
    };
    BucketLock { enabled: field("ObjectLockEnabled").as_deref() == Some("Enabled"), default: field("Mode").zip(days) }
}

/// Checks that the bucket locks every new object version as `want` asks: Ok, or what to set.
pub(crate) fn judge(bucket: &BucketLock, want: Lock, name: &str) -> Result<(), String> {
    let (mode, days) = (want.mode.s3_name(), want.days);
    let set = format!(
        "set it with `aws s3api put-object-lock-configuration --bucket {name} --object-lock-configuration \
         '{{\"ObjectLockEnabled\":\"Enabled\",\"Rule\":{{\"DefaultRetention\":{{\"Mode\":\"{mode}\",\"Days\":{days}}}}}}}'`"
    );
    if !bucket.enabled {
        return Err(format!(
            "object-lock-days is set but bucket {name} has no object lock (a bucket gets it only when it is created: \
             create one with --object-lock-enabled-for-bucket, then {set})"
        ));
    }
    match &bucket.default {
        None => Err(format!("bucket {name} has object lock but no default retention: {set}")),
        Some((m, _)) if m != mode => Err(format!("bucket {name} locks new objects in {m} mode, not {mode}: {set}")),
        Some((_, d)) if *d < days => {
            Err(format!("bucket {name} keeps new objects {d} days, fewer than object-lock-days ({days}): {set}"))
        }
        Some(_) => Ok(()),
    }
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

/// Asks the store for the bucket's object lock (a signed `GET ?object-lock`) and judges it.
pub(crate) async fn check(
    config: &TargetConfig,
    options: &ClientOptions,
    credentials: Option<&AwsCredential>,
    want: Lock,
) -> Result<(), String> {
    let bucket = config.bucket.as_deref().unwrap_or_default();
    let url = format!("{}?object-lock", bucket_url(config, bucket));
    let mut req = http::Request::builder()
        .method(http::Method::GET)
        .uri(&url)
        .body(HttpRequestBody::empty())
        .map_err(|e| format!("{url}: {e}"))?;
    if let Some(c) = credentials {
        AwsAuthorizer::new(c, "s3", config.region.as_deref().unwrap_or("us-east-1")).authorize(&mut req, None);
    }
    let client = crate::bounded::BoundedConnector.connect(options).map_err(|e| e.to_string())?;
    let asked = format!("GET {url}");
    let res = client.execute(req).await.map_err(|e| format!("{asked}: {e}"))?;
    let status = res.status();
    let body = res.into_body().bytes().await.map_err(|e| format!("{asked}: {e}"))?;
    let text = String::from_utf8_lossy(&body);
    let bucket_lock = if status.is_success() {
        parse(&text)
    } else if text.contains("ObjectLockConfigurationNotFoundError") {
        BucketLock { enabled: false, default: None }
    } else {
        let code = parse_code(&text);
        return Err(format!(
            "{asked}: {status} {code} (the credential needs s3:GetBucketObjectLockConfiguration on the bucket)"
        ));
    };
    judge(&bucket_lock, want, bucket)
}

fn parse_code(xml: &str) -> &str {
    xml.split_once("<Code>").and_then(|(_, rest)| rest.split_once("</Code>")).map_or("", |(code, _)| code)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOV_30: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<ObjectLockConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><ObjectLockEnabled>Enabled</ObjectLockEnabled><Rule><DefaultRetention><Mode>GOVERNANCE</Mode><Days>30</Days></DefaultRetention></Rule></ObjectLockConfiguration>"#;

    #[test]
    fn reads_the_configuration() {
        assert_eq!(parse(GOV_30), BucketLock { enabled: true, default: Some(("GOVERNANCE".into(), 30)) });
        let years = GOV_30.replace("<Days>30</Days>", "<Years>2</Years>").replace("GOVERNANCE", "COMPLIANCE");
        assert_eq!(parse(&years).default, Some(("COMPLIANCE".into(), 730)));
        let bare = "<ObjectLockConfiguration><ObjectLockEnabled>Enabled</ObjectLockEnabled></ObjectLockConfiguration>";
        assert_eq!(parse(bare), BucketLock { enabled: true, default: None });
    }

    #[test]
    fn judges_the_bucket_against_the_config() {
        let gov = |days| Lock { mode: LockMode::Governance, days };
        assert!(judge(&parse(GOV_30), gov(30), "b").is_ok());
        assert!(judge(&parse(GOV_30), gov(14), "b").is_ok(), "a longer default retention is fine");
        let short = judge(&parse(GOV_30), gov(60), "b").unwrap_err();
        assert!(short.contains("fewer than object-lock-days (60)") && short.contains("put-object-lock-configuration"));
        let mode = judge(&parse(GOV_30), Lock { mode: LockMode::Compliance, days: 30 }, "b").unwrap_err();
        assert!(mode.contains("GOVERNANCE mode, not COMPLIANCE"), "{mode}");
        let none = judge(&BucketLock { enabled: false, default: None }, gov(1), "b").unwrap_err();
        assert!(none.contains("has no object lock"), "{none}");
    }

    #[test]
    fn a_version_older_than_a_quarter_of_the_lock_is_stale() {
        let lock = Lock { mode: LockMode::Governance, days: 8 };
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(100 * 86_400);
        assert!(!lock.is_stale(now - Duration::from_secs(2 * 86_400 - 1), now));
        assert!(lock.is_stale(now - Duration::from_secs(2 * 86_400 + 1), now));
        assert!(!lock.is_stale(now + Duration::from_secs(60), now), "a clock ahead of ours is not stale");
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
    }
}
