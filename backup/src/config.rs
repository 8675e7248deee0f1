//! What a backup target's config says (`[backup-targets.NAME]`), read by the target, its object
//! lock and the daemon: no I/O here.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where a target keeps its objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetKind {
    /// An S3-compatible object store (path-style requests unless `virtual-hosted`).
    S3,
    /// A directory, such as an NFS mount.
    Dir,
}

/// A target as the daemon's config names it (`[backup-targets.NAME]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct TargetConfig {
    pub kind: Option<TargetKind>,
    /// S3: the endpoint URL (`https://s3.example:9000`); default AWS's for the region.
    pub endpoint: Option<String>,
    /// S3: default `us-east-1`.
    pub region: Option<String>,
    pub bucket: Option<String>,
    /// S3: `bucket.endpoint` host names instead of `endpoint/bucket` paths.
    pub virtual_hosted: bool,
    /// Objects go under this prefix (several clusters can share a bucket).
    pub prefix: Option<String>,
    /// Dir: the directory (created 0700 if missing).
    pub path: Option<PathBuf>,
    /// S3: a directory holding `access-key-id` and `secret-access-key` files (a mounted
    /// Kubernetes Secret); default `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, else unsigned.
    pub credentials: Option<PathBuf>,
    /// S3 over https: trust this CA (PEM) besides the system's.
    pub ca_file: Option<PathBuf>,
    /// 32 bytes (raw, or 64 hex digits): chunks, manifests and indexes are sealed with
    /// AES-256-GCM under keys derived from it. Keep a copy outside the cluster.
    pub key_file: Option<PathBuf>,
    /// Chunk size (1-4 MiB, whole 4 KiB blocks: "1M", or bytes); default 4M.
    #[serde(deserialize_with = "size")]
    pub chunk_size: Option<u64>,
    /// Requests in flight; default 8.
    pub concurrency: Option<usize>,
    /// Bytes per second uploaded (and downloaded by restores): "100M", or bytes; default no
    /// limit.
    #[serde(deserialize_with = "size")]
    pub bandwidth: Option<u64>,
    /// Every Nth backup of a volume is full (reads everything); default 30.
    pub full_every: Option<u32>,
    /// How long a chunk stays unreferenced before a prune deletes it, and how long a backup may
    /// run (see `prune.rs`); default 86400.
    pub grace_s: Option<u64>,
    /// Retries of a failed request (with backoff, within 30 s); default 10.
    pub retries: Option<usize>,
    /// Seconds one request may take, its answer's body included (S3); default 120. A whole
    /// operation, its retries included, ends after twice this plus 30 s.
    pub timeout_s: Option<u64>,
    /// Seconds between verifies of the backups of the daemon's volumes on this target (none by
    /// default); each checks `verify-sample` of their chunks (a share, default 0.1; 1: all).
    pub verify_every_s: Option<u64>,
    pub verify_sample: Option<f64>,
    /// S3: update indexes with conditional PUTs (If-Match / If-None-Match, which AWS S3, MinIO and
    /// SeaweedFS honour); false for a store that refuses them, where two daemons updating one
    /// index at once may lose an update. Default true.
    pub conditional_writes: Option<bool>,
    /// S3 Object Lock: days each object version is kept from deletion and overwrite, set on
    /// every upload and extended by prunes while a backup needs it (`object_lock.rs`; the bucket
    /// needs object lock enabled). Uploads then carry SHA-256 checksums.
    pub object_lock_days: Option<u64>,
    /// The bucket's lock mode: governance (default) or compliance.
    pub object_lock_mode: Option<LockMode>,
}

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
    /// Its name in a config (`object-lock-mode`) and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            LockMode::Governance => "governance",
            LockMode::Compliance => "compliance",
        }
    }

    pub(crate) fn s3_name(self) -> &'static str {
        match self {
            LockMode::Governance => "GOVERNANCE",
            LockMode::Compliance => "COMPLIANCE",
        }
    }
}

impl std::str::FromStr for LockMode {
    type Err = String;

    fn from_str(s: &str) -> Result<LockMode, String> {
        [LockMode::Governance, LockMode::Compliance]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("object lock mode {s:?}: governance or compliance"))
    }
}

/// The lock a target's config asks for (and its marker records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Lock {
    pub mode: LockMode,
    pub days: u64,
}

impl Lock {
    /// From `object-lock-days` / `object-lock-mode` (governance by default).
    pub(crate) fn of(config: &TargetConfig) -> Option<Lock> {
        config.object_lock_days.map(|days| Lock { mode: config.object_lock_mode.unwrap_or(LockMode::Governance), days })
    }

    /// A chunk stored or extended longer ago than this is extended before a backup relies on
    /// it, and a prune extends every kept object once its last extension is older than this.
    pub(crate) fn refresh(self) -> Duration {
        Duration::from_secs(self.days * 86_400 / 4)
    }

    /// Whether a lock set (stored or extended) at `since` is too old at `now` to rely on (unix
    /// seconds; a `since` ahead of `now`, another clock's, is not).
    pub(crate) fn is_stale(self, since: i64, now: i64) -> bool {
        u64::try_from(now.saturating_sub(since)).is_ok_and(|age| age > self.refresh().as_secs())
    }

    /// When a lock set at `from` (unix seconds) ends.
    pub(crate) fn until(self, from: u64) -> u64 {
        from + self.days * 86_400
    }
}

/// A size as bytes or a string with a binary suffix ("4M", "1G").
fn size<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    let text = match Size::deserialize(d)? {
        Size::Bytes(n) => return Ok(Some(n)),
        Size::Text(t) => t,
    };
    let t = text.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c @ ('K' | 'M' | 'G' | 'T'))) => (&t[..i], 10 * (1 + "KMGT".find(c).expect("listed"))),
        _ => (t, 0),
    };
    digits.parse::<u64>().ok().and_then(|n| n.checked_mul(1 << shift)).map(Some).ok_or_else(|| {
        serde::de::Error::custom(format!("{text:?} is not a size (bytes, or a number with K, M, G or T)"))
    })
}
