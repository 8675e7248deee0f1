//! A backup target: where backups go (an S3 bucket and prefix, or a directory), with which
//! credentials and key, and the counted requests every other part makes through it.

use std::path::Path as FsPath;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AwsCredential, Checksum};
use object_store::client::HttpConnector;
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path;
use object_store::{
    ClientOptions, GetResultPayload, ListResult, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig, UpdateVersion,
};
use serde::{Deserialize, Serialize};

use crate::codec::{Codec, Kind};
use crate::config::{Lock, LockMode, TargetConfig, TargetKind};
use crate::object_lock::Locker;
use crate::signed::Signed;
use crate::{Error, Result};

/// Requests made through a target, by kind (for the bench, the metrics and the tests' O(1)
/// LIST checks).
#[derive(Debug, Default)]
pub struct Counters {
    pub puts: AtomicU64,
    /// Bytes of the PUTs the store accepted (a PUT cut off by a failure is not counted).
    pub put_bytes: AtomicU64,
    pub gets: AtomicU64,
    pub get_bytes: AtomicU64,
    pub heads: AtomicU64,
    pub lists: AtomicU64,
    pub deletes: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> [u64; 7] {
        [&self.puts, &self.put_bytes, &self.gets, &self.get_bytes, &self.heads, &self.lists, &self.deletes]
            .map(|c| c.load(Relaxed))
    }
}

/// The marker at the target's root: format and key check, and what every writer and prune of
/// the target must agree on: the grace, and the object lock.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Marker {
    format: u32,
    /// HMAC of a fixed string under the chunk-naming key: present iff the target has a key.
    key_check: Option<String>,
    /// The target's grace (`prune.rs`); absent in markers of earlier builds (the first daemon
    /// that opens it records its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    grace_s: Option<u64>,
    /// The target's object lock: changed only on purpose, never by a config that differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    object_lock: Option<Lock>,
}

/// How far this host's clock may be from the store's for it to write locked objects: their
/// retention dates are this host's time plus the lock's days.
const MAX_SKEW_S: i64 = 120;

pub(crate) const MARKER: &str = "ferrite-backup.json";
/// What [`Target::now`] writes to read the store's clock.
const CLOCK: &str = "gc/clock";
/// Most bytes the marker may have (it has a few dozen).
const MAX_MARKER: u64 = 64 << 10;
/// The grace of a target whose config names none: a day.
const DEFAULT_GRACE_S: u64 = 86_400;
/// The format of the manifests and indexes this build writes and reads: 2 since manifests
/// list their chunks in segments (`segment.rs`) and the condemned list is binary.
pub const FORMAT: u32 = 2;
/// The format of the marker: 2 since manifests are named by attempt (`ID@ATTEMPT`), which a
/// build of format 1 would take for unlisted ones and delete by age; 3 since manifests are
/// segmented, whose chunks a build of format 2 would not see. Such a build refuses the target
/// ("upgrade it") once a newer daemon has opened it.
const MARKER_FORMAT: u32 = 3;

/// An opened target.
#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub config: TargetConfig,
    store: Arc<dyn ObjectStore>,
    pub(crate) codec: Arc<Codec>,
    pub counters: Arc<Counters>,
    /// An S3 target's store without the prefix: its listings are paged here, with a budget.
    s3: Option<Arc<AmazonS3>>,
    /// An S3 target's own signed requests (`signed.rs`).
    signed: Option<Arc<Signed>>,
    /// An S3 target's object lock.
    locker: Option<Arc<Locker>>,
    /// Opened to set its lock ([`Target::set_lock`]), and the lock that replaced.
    set_lock: bool,
    replaced_lock: Option<(LockMode, u64)>,
}

/// Every page of a listing costs at least this many of its entry budget.
pub(crate) const PAGE_COST: u64 = 100;

/// Where a paged listing is.
struct Paging {
    prefix: String,
    token: Option<String>,
    done: bool,
    entries: u64,
    cost: u64,
    max: u64,
}

impl Paging {
    fn new(prefix: &str, max: u64) -> Paging {
        Paging { prefix: prefix.to_owned(), token: None, done: false, entries: 0, cost: 0, max }
    }
}

/// The target's prefix in its store, without slashes at either end ("" for none).
fn root_of(config: &TargetConfig) -> &str {
    config.prefix.as_deref().unwrap_or("").trim_matches('/')
}

impl Target {
    /// Opens target `name`: builds the client, reads the marker (writing it on a new target),
    /// and checks the key against it.
    pub async fn open(name: &str, config: TargetConfig) -> Result<Target> {
        Self::open_as(name, config, false).await
    }

    /// Changes the object lock target `name`'s marker records to the one `config` names (its
    /// `object-lock-mode` and `object-lock-days`): the one way a target's lock changes. The
    /// lock before, if any. Every daemon using the target then needs the same lock in its
    /// config: it refuses the target until then.
    pub async fn set_lock(name: &str, config: TargetConfig) -> Result<Option<(LockMode, u64)>> {
        if Lock::of(&config).is_none() {
            return Err(Error::Invalid(format!("backup target {name}: a lock to set needs object-lock-days")));
        }
        let target = Self::open_as(name, config, true).await?;
        Ok(target.replaced_lock)
    }

    /// [`Target::open`]; with `set_lock`, the config's lock replaces the marker's.
    async fn open_as(name: &str, config: TargetConfig, set_lock: bool) -> Result<Target> {
        let invalid = |msg: String| Error::Invalid(format!("backup target {name}: {msg}"));
        let chunk = config.chunk_size.unwrap_or(crate::DEFAULT_CHUNK);
        if !(crate::MIN_CHUNK..=crate::MAX_CHUNK).contains(&chunk) || !chunk.is_multiple_of(4096) {
            return Err(invalid(format!("chunk-size {chunk} is not 1-4 MiB in whole 4 KiB blocks")));
        }
        let (store, s3) = build_store(&config).map_err(invalid)?;
        let (mut signed, mut locker) = (None, None);
        if config.kind == Some(TargetKind::S3) {
            let key = credentials(config.credentials.as_deref()).map_err(invalid)?;
            let key = key.map(|(key_id, secret_key)| AwsCredential { key_id, secret_key, token: None });
            let options = s3_options(&config).map_err(invalid)?;
            let client = crate::bounded::BoundedConnector.connect(&options).map_err(|e| invalid(e.to_string()))?;
            signed = Some(Arc::new(Signed::new(&config, client, key, root_of(&config))));
        }
        if let Some(lock) = Lock::of(&config) {
            let Some(signed) = signed.clone().filter(|_| lock.days > 0) else {
                return Err(invalid("object-lock-days (at least 1) is for s3 targets".into()));
            };
            let bucket = config.bucket.as_deref().unwrap_or_default();
            locker = Some(Arc::new(Locker::open(signed, bucket, lock).await.map_err(invalid)?));
        }
        let key = match &config.key_file {
            Some(path) => Some(read_key(path).map_err(invalid)?),
            None => None,
        };
        let codec = Codec::new(name, root_of(&config), key.as_ref());
        let mut target = Target {
            set_lock,
            replaced_lock: None,
            name: name.to_owned(),
            config,
            store,
            codec: Arc::new(codec),
            counters: Arc::default(),
            s3,
            signed,
            locker,
        };
        target.check_marker().await?;
        Ok(target)
    }

    /// Reads the marker (writing it on a new target, or completing one of an earlier build),
    /// checks the key against it, and adopts its grace; refuses a config whose object lock
    /// differs from the marker's.
    async fn check_marker(&mut self) -> Result<()> {
        let ours = self.codec.is_sealed().then(|| self.codec.key_check());
        let lock = Lock::of(&self.config);
        let grace_s = self.config.grace_s.unwrap_or(DEFAULT_GRACE_S);
        let (mut marker, seen) = match self.get(MARKER, MAX_MARKER).await {
            Ok((data, meta)) => {
                let m: Marker =
                    serde_json::from_slice(&data).map_err(|e| Error::corrupt(&self.name, MARKER, e.to_string()))?;
                (m, Some(meta))
            }
            Err(e) if e.is_not_found() => {
                (Marker { format: MARKER_FORMAT, key_check: ours.clone(), grace_s: None, object_lock: None }, None)
            }
            Err(e) => return Err(e),
        };
        if marker.format > MARKER_FORMAT {
            return Err(Error::Newer {
                target: self.name.clone(),
                what: MARKER.into(),
                found: marker.format,
                supported: MARKER_FORMAT,
            });
        }
        let msg = match (&marker.key_check, &ours) {
            (Some(a), Some(b)) if a != b => Some("its key-file is not the key this target was created with"),
            (Some(_), None) => Some("this target is encrypted: configure its key-file"),
            (None, Some(_)) => Some(
                "this target was created without a key: its backups are not encrypted (use another prefix for an encrypted target)",
            ),
            _ => None,
        };
        if let Some(msg) = msg {
            return Err(Error::Key { target: self.name.clone(), msg: msg.into() });
        }
        let mut changed = seen.is_none() || marker.format < MARKER_FORMAT;
        match (marker.object_lock, lock) {
            (Some(marked), Some(asked)) if marked == asked => {}
            (Some(marked), Some(asked)) if self.set_lock => {
                tracing::warn!(target = %self.name, from = ?marked, to = ?asked, "the target's object lock changes");
                self.replaced_lock = Some((marked.mode, marked.days));
                marker.object_lock = Some(asked);
                changed = true;
            }
            (Some(marked), asked) => {
                let said = asked.map_or("none".to_owned(), |l| format!("{:?} for {} days", l.mode, l.days));
                return Err(Error::Invalid(format!(
                    "backup target {}: its marker says object lock {:?} for {} days and this daemon's config says \
                     {said}: configure object-lock-mode and object-lock-days as the marker says (every writer \
                     of a target locks alike; a target's lock changes only on purpose)",
                    self.name, marked.mode, marked.days
                )));
            }
            (None, _) => {}
        }
        marker.format = MARKER_FORMAT;
        if marker.object_lock.is_none() && lock.is_some() {
            // A lock is only ever added by a config: the target is locked from now on.
            marker.object_lock = lock;
            changed = true;
        }
        match marker.grace_s {
            Some(g) if self.config.grace_s.is_some_and(|c| c != g) => tracing::warn!(
                target = %self.name,
                "this daemon's grace-s is {}, the target's marker says {g}: every writer and prune of a target keeps \
                 one grace, the marker's",
                grace_s
            ),
            Some(_) => {}
            None => {
                marker.grace_s = Some(grace_s);
                changed = true;
            }
        }
        self.config.grace_s = marker.grace_s;
        if changed {
            let data = serde_json::to_vec_pretty(&marker).expect("serialises").into();
            match self.put_if(MARKER, data, seen.as_ref()).await {
                Ok(true) => {}
                Ok(false) => {
                    // Another daemon wrote it first: read what it wrote.
                    self.replaced_lock = None;
                    return Box::pin(self.check_marker()).await;
                }
                // A read-only credential (a restore at another site) reads an earlier build's
                // target as it is: it writes nothing a prune of that build could take.
                Err(Error::Store { source, .. })
                    if !self.set_lock
                        && matches!(
                            *source,
                            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }
                        ) =>
                {
                    tracing::warn!(target = %self.name, "the credential may not write the target's marker: read only");
                }
                Err(e) => return Err(e),
            }
        }
        if self.locker.is_some() {
            self.check_clock().await?;
        }
        Ok(())
    }

    /// Under an object lock: refuses a host whose clock is off the store's by minutes.
    async fn check_clock(&self) -> Result<()> {
        let before = crate::now_unix();
        let store = self.now().await?;
        self.check_skew(before, store)
    }

    /// Under an object lock, fails when this host's time `local` (read just before the store's
    /// `store`, unix seconds) is off by more than [`MAX_SKEW_S`]: the retention dates it writes
    /// are its time plus the lock's days.
    pub(crate) fn check_skew(&self, local: u64, store: i64) -> Result<()> {
        let skew = store.saturating_sub(i64::try_from(local).unwrap_or(i64::MAX));
        if self.locker.is_none() || skew.abs() <= MAX_SKEW_S {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "backup target {}: this host's clock is {skew} s off the store's; under an object lock the retention \
             dates it writes would be off as much: set its clock (NTP)",
            self.name
        )))
    }

    /// The same target with its store seen through `layer`: for tests that put a store's faults
    /// or pauses between the target and its store (a directory's listings included; an S3
    /// target's listings page through the bucket's own client).
    #[doc(hidden)]
    pub fn with_store_layer(mut self, layer: impl FnOnce(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore>) -> Target {
        self.store = layer(self.store);
        self
    }

    pub fn chunk_size(&self) -> u64 {
        self.config.chunk_size.unwrap_or(crate::DEFAULT_CHUNK)
    }

    pub fn concurrency(&self) -> usize {
        self.config.concurrency.unwrap_or(8).clamp(1, 256)
    }

    /// The grace every writer and prune of the target keeps: the marker's.
    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.config.grace_s.unwrap_or(DEFAULT_GRACE_S))
    }

    /// The bucket's object lock, if the target has one.
    pub(crate) fn object_lock(&self) -> Option<Lock> {
        self.locker.as_ref().map(|l| l.lock)
    }

    /// A PUT's options: its mode, and under an object lock the new version's retention.
    fn put_options(&self, mode: PutMode) -> PutOptions {
        let mut opts = PutOptions::from(mode);
        if let Some(locker) = &self.locker {
            opts.extensions.insert(locker.retain());
        }
        opts
    }

    /// Under an object lock, locks the current version of `path` until `until` (unix seconds,
    /// or later if it is already); false when it is gone.
    pub(crate) async fn extend_lock(&self, path: &str, until: u64) -> Result<bool> {
        let Some(locker) = &self.locker else { return Ok(true) };
        let p = Path::from(path);
        self.counters.puts.fetch_add(1, Relaxed);
        self.timed("PUT ?retention", &p, async {
            locker.extend(path, until).await.map_err(|why| Error::answer(&self.name, "PUT ?retention", &p, why))
        })
        .await
    }

    pub fn is_sealed(&self) -> bool {
        self.codec.is_sealed()
    }

    /// The name a chunk holding `plain` has on this target.
    pub fn chunk_name(&self, plain: &[u8]) -> String {
        self.codec.chunk_id(plain)
    }

    /// How long one operation may take, its retries included.
    pub(crate) fn deadline(&self) -> Duration {
        self.request_timeout() * 2 + Duration::from_secs(30)
    }

    fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.config.timeout_s.unwrap_or(120).max(1))
    }

    /// `op` on `path`, failed with an [`Error::Answer`] once it has run for [`Self::deadline`].
    async fn timed<T>(&self, op: &'static str, path: &Path, f: impl Future<Output = Result<T>>) -> Result<T> {
        self.timed_within(self.deadline(), op, path, f).await
    }

    /// The same within `limit`.
    async fn timed_within<T>(
        &self,
        limit: Duration,
        op: &'static str,
        path: &Path,
        f: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(limit, f)
            .await
            .unwrap_or_else(|_| Err(Error::answer(&self.name, op, path, format!("no answer within {limit:?}"))))
    }

    pub(crate) async fn put(&self, path: &str, data: Bytes) -> Result<()> {
        self.put_within(self.deadline(), path, data).await
    }

    /// A PUT that fails unless it is done within `limit` (and [`Self::deadline`]).
    pub(crate) async fn put_within(&self, limit: Duration, path: &str, data: Bytes) -> Result<()> {
        let p = Path::from(path);
        self.counters.puts.fetch_add(1, Relaxed);
        let len = data.len() as u64;
        self.timed_within(limit.min(self.deadline()), "PUT", &p, async {
            let opts = self.put_options(PutMode::Overwrite);
            let put = self.store.put_opts(&p, PutPayload::from_bytes(data), opts).await;
            put.map_err(|e| Error::store(&self.name, "PUT", &p, e))
        })
        .await?;
        self.counters.put_bytes.fetch_add(len, Relaxed);
        Ok(())
    }

    /// Writes `data` at `path` only if the object there is still `seen` (None: absent); false
    /// when another writer changed it first. S3: a conditional PUT (If-Match / If-None-Match);
    /// a directory: the check and the write under the target's lock.
    pub(crate) async fn put_if(&self, path: &str, data: Bytes, seen: Option<&ObjectMeta>) -> Result<bool> {
        let p = Path::from(path);
        self.counters.puts.fetch_add(1, Relaxed);
        let len = data.len() as u64;
        let fail = |e| Error::store(&self.name, "PUT", &p, e);
        let stored = self
            .timed("PUT", &p, async {
                if self.config.kind == Some(TargetKind::Dir) {
                    let _lock = self.lock().await?;
                    let now = self.store.head(&p).await.map(Some).or_else(|e| match e {
                        object_store::Error::NotFound { .. } => Ok(None),
                        e => Err(fail(e)),
                    })?;
                    if now.as_ref().map(|m| &m.e_tag) != seen.map(|m| &m.e_tag) {
                        return Ok(false);
                    }
                    self.store.put(&p, PutPayload::from_bytes(data)).await.map_err(fail)?;
                    return Ok(true);
                }
                let mode = match seen {
                    _ if self.config.conditional_writes == Some(false) => PutMode::Overwrite,
                    Some(m) => PutMode::Update(UpdateVersion { e_tag: m.e_tag.clone(), version: m.version.clone() }),
                    None => PutMode::Create,
                };
                match self.store.put_opts(&p, PutPayload::from_bytes(data), self.put_options(mode)).await {
                    Ok(_) => Ok(true),
                    Err(object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. }) => {
                        Ok(false)
                    }
                    Err(e) => Err(fail(e)),
                }
            })
            .await?;
        if stored {
            self.counters.put_bytes.fetch_add(len, Relaxed);
        }
        Ok(stored)
    }

    /// A directory target's lock (an flock on `.ferrite-lock` in it, which daemons sharing the
    /// directory over NFS see too), held until the file is dropped.
    async fn lock(&self) -> Result<std::fs::File> {
        let path = self.config.path.as_ref().expect("a dir target has a path").join(".ferrite-lock");
        let shown = path.display().to_string();
        tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::OpenOptionsExt as _;
            let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(&path)?;
            rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)?;
            Ok(file)
        })
        .await
        .expect("locking does not panic")
        .map_err(|e: std::io::Error| Error::Invalid(format!("backup target {}: locking {shown}: {e}", self.name)))
    }

    /// The object at `path`, refused (before it is read, or as its bytes arrive) if it has more
    /// than `max` bytes, or fewer than the store announced.
    pub(crate) async fn get(&self, path: &str, max: u64) -> Result<(Bytes, ObjectMeta)> {
        let p = Path::from(path);
        self.counters.gets.fetch_add(1, Relaxed);
        let fail = |e| Error::store(&self.name, "GET", &p, e);
        let bad = |why: String| Error::answer(&self.name, "GET", &p, why);
        let (data, meta) = self
            .timed("GET", &p, async {
                let got = self.store.get(&p).await.map_err(fail)?;
                let meta = got.meta.clone();
                if meta.size > max {
                    return Err(bad(format!("the object has {} bytes; at most {max} are expected here", meta.size)));
                }
                if matches!(got.payload, GetResultPayload::File(..)) {
                    return Ok((got.bytes().await.map_err(fail)?, meta));
                }
                let mut data = Vec::with_capacity(usize::try_from(meta.size).expect("at most max"));
                let mut body = got.into_stream();
                while let Some(piece) = body.try_next().await.map_err(fail)? {
                    if (data.len() + piece.len()) as u64 > meta.size {
                        return Err(bad(format!("the store sent more than the {} bytes it announced", meta.size)));
                    }
                    data.extend_from_slice(&piece);
                }
                if data.len() as u64 != meta.size {
                    return Err(bad(format!("the store sent {} of the {} bytes it announced", data.len(), meta.size)));
                }
                Ok((Bytes::from(data), meta))
            })
            .await?;
        self.counters.get_bytes.fetch_add(data.len() as u64, Relaxed);
        Ok((data, meta))
    }

    /// The object's metadata, or None when it is absent.
    pub async fn head(&self, path: &str) -> Result<Option<ObjectMeta>> {
        let p = Path::from(path);
        self.counters.heads.fetch_add(1, Relaxed);
        self.timed("HEAD", &p, async {
            match self.store.head(&p).await {
                Ok(meta) => Ok(Some(meta)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(Error::store(&self.name, "HEAD", &p, e)),
            }
        })
        .await
    }

    /// Writes an empty object at `path` and reads back when the store says it was written: the
    /// store's time now (unix seconds), the one clock every daemon and prune shares.
    pub(crate) async fn stamp(&self, path: &str) -> Result<i64> {
        self.put(path, Bytes::new()).await?;
        let written = self.head(path).await?.ok_or_else(|| Error::corrupt(&self.name, path, "vanished"))?;
        Ok(written.last_modified.timestamp())
    }

    /// The store's time now (unix seconds).
    pub(crate) async fn now(&self) -> Result<i64> {
        self.stamp(CLOCK).await
    }

    /// Whether the target holds the object at `path` in a version a new backup may rely on:
    /// present, and under an object lock locked long enough (`object_lock.rs`): stored or last
    /// extended (`extended`, unix seconds) at most the lock's refresh ago, else extended now.
    pub(crate) async fn holds_fresh(&self, path: &str, extended: Option<i64>) -> Result<bool> {
        let Some(stored) = self.head(path).await? else { return Ok(false) };
        let Some(lock) = self.object_lock() else { return Ok(true) };
        let since = stored.last_modified.timestamp().max(extended.unwrap_or(i64::MIN));
        let now = crate::now_unix();
        if lock.is_stale(since, i64::try_from(now).unwrap_or(i64::MAX)) {
            return self.extend_lock(path, lock.until(now)).await;
        }
        Ok(true)
    }

    /// Deletes the object at `path` only if it is still the version `seen` (its ETag); false
    /// when another version replaced it. S3: a DELETE with If-Match (where the store does not
    /// honour it: a HEAD, then the DELETE); a directory: the check and the delete under the
    /// target's lock.
    pub async fn delete_if(&self, path: &str, seen: &ObjectMeta) -> Result<bool> {
        let p = Path::from(path);
        let e_tag = seen.e_tag.as_deref().unwrap_or_default();
        if let Some(signed) = self.signed.as_ref().filter(|_| !e_tag.is_empty()) {
            self.counters.deletes.fetch_add(1, Relaxed);
            let done = self
                .timed("DELETE", &p, async {
                    signed.delete_if(path, e_tag).await.map_err(|why| Error::answer(&self.name, "DELETE", &p, why))
                })
                .await?;
            match done {
                Some(true) => return Ok(true),
                // Absent counts as gone (a store may answer a condition on nothing with 412).
                Some(false) => return Ok(self.head(path).await?.is_none()),
                None => {}
            }
        }
        let _lock = match self.config.kind {
            Some(TargetKind::Dir) => Some(self.lock().await?),
            _ => None,
        };
        match self.head(path).await? {
            Some(now) if now.e_tag != seen.e_tag || now.last_modified != seen.last_modified => Ok(false),
            _ => self.delete(path).await.map(|()| true),
        }
    }

    pub(crate) async fn delete(&self, path: &str) -> Result<()> {
        let p = Path::from(path);
        self.counters.deletes.fetch_add(1, Relaxed);
        self.timed("DELETE", &p, async {
            match self.store.delete(&p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(Error::store(&self.name, "DELETE", &p, e)),
            }
        })
        .await
    }

    /// Moves the object at `from` to `to`: a copy, then a delete.
    pub(crate) async fn rename(&self, from: &str, to: &str) -> Result<()> {
        let (f, t) = (Path::from(from), Path::from(to));
        self.counters.puts.fetch_add(1, Relaxed);
        self.timed("COPY", &f, async {
            self.store.copy(&f, &t).await.map_err(|e| Error::store(&self.name, "COPY", &f, e))
        })
        .await?;
        self.delete(from).await
    }

    /// The objects under `prefix` as they are listed, refused past `max` of them: one LIST per
    /// page, each page within the deadline of one operation, each costing at least
    /// [`PAGE_COST`] of `max` (a store that pages forever, empty pages or not, is stopped).
    pub(crate) fn list_stream(&self, prefix: &str, max: u64) -> BoxStream<'_, Result<ObjectMeta>> {
        let p = Path::from(prefix);
        let Some(s3) = self.s3.clone() else {
            // A directory (NFS may hang): object_store walks it as it is read; each entry within
            // the deadline of one operation, and a bound on their count.
            self.counters.lists.fetch_add(1, Relaxed);
            let listed = self.store.list(Some(&p)).enumerate();
            let limit = self.deadline();
            return futures_util::stream::unfold((listed, p), move |(mut listed, p)| async move {
                let next = match tokio::time::timeout(limit, listed.next()).await {
                    Err(_) => Err(Error::answer(&self.name, "LIST", &p, format!("no answer within {limit:?}"))),
                    Ok(None) => return None,
                    Ok(Some((n, _))) if n as u64 >= max => {
                        Err(Error::answer(&self.name, "LIST", &p, format!("more than {max} objects are listed")))
                    }
                    Ok(Some((_, r))) => r.map_err(|e| Error::store(&self.name, "LIST", &p, e)),
                };
                Some((next, (listed, p)))
            })
            .boxed();
        };
        let start = Paging::new(prefix, max);
        futures_util::stream::try_unfold(start, move |mut paging| {
            let s3 = s3.clone();
            async move {
                if paging.done {
                    return Ok::<_, Error>(None);
                }
                let page = self.page(&s3, &mut paging, false).await?;
                let objects = page.objects.into_iter().map(Ok::<_, Error>);
                Ok(Some((futures_util::stream::iter(objects), paging)))
            }
        })
        .try_flatten()
        .boxed()
    }

    /// The names directly under `prefix` (one LIST per page), refused past `max` of them.
    pub(crate) async fn list_dirs(&self, prefix: &str, max: u64) -> Result<Vec<String>> {
        let p = Path::from(prefix);
        let Some(s3) = self.s3.clone() else { return self.read_dir(prefix, max).await };
        let mut paging = Paging::new(prefix, max);
        let mut names = Vec::new();
        while !paging.done {
            let page = self.page(&s3, &mut paging, true).await?;
            for dir in page.common_prefixes {
                match dir.filename() {
                    Some(name) => names.push(name.to_owned()),
                    None => return Err(Error::answer(&self.name, "LIST", &p, format!("it listed {dir:?}"))),
                }
            }
        }
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// One page of an S3 listing, its keys relative to the target's prefix; counts it against
    /// the listing's budget and fails once that is spent with more to come.
    async fn page(&self, s3: &AmazonS3, paging: &mut Paging, delimiter: bool) -> Result<ListResult> {
        let p = Path::from(paging.prefix.as_str());
        self.counters.lists.fetch_add(1, Relaxed);
        let root = root_of(&self.config);
        let root = if root.is_empty() { String::new() } else { format!("{root}/") };
        let options = PaginatedListOptions {
            delimiter: delimiter.then_some("/".into()),
            page_token: paging.token.take(),
            ..PaginatedListOptions::default()
        };
        let asked = format!("{root}{}/", paging.prefix);
        let page = self
            .timed("LIST", &p, async {
                s3.list_paginated(Some(&asked), options).await.map_err(|e| Error::store(&self.name, "LIST", &p, e))
            })
            .await?;
        let n = (page.result.objects.len() + page.result.common_prefixes.len()) as u64;
        paging.entries += n;
        paging.cost += n.max(PAGE_COST);
        paging.done = page.page_token.is_none();
        paging.token = page.page_token;
        let max = paging.max;
        if paging.entries > max || (!paging.done && paging.cost >= max) {
            let why = format!("the listing goes on past {max} entries (or pages of {PAGE_COST}): refused");
            return Err(Error::answer(&self.name, "LIST", &p, why));
        }
        let outside =
            |key: &str| Error::answer(&self.name, "LIST", &p, format!("it listed {key:?}, not under {asked}"));
        let relative = |path: &Path| {
            let key = path.as_ref();
            key.strip_prefix(&asked).map(|_| Path::from(&key[root.len()..])).ok_or_else(|| outside(key))
        };
        let mut result = ListResult { common_prefixes: Vec::new(), objects: Vec::new() };
        for dir in &page.result.common_prefixes {
            result.common_prefixes.push(relative(dir)?);
        }
        for mut object in page.result.objects {
            object.location = relative(&object.location)?;
            result.objects.push(object);
        }
        Ok(result)
    }

    /// A directory target's subdirectories under `prefix`, refused past `max` of them.
    async fn read_dir(&self, prefix: &str, max: u64) -> Result<Vec<String>> {
        let p = Path::from(prefix);
        self.counters.lists.fetch_add(1, Relaxed);
        let root = root_of(&self.config);
        let dir = self.config.path.as_ref().expect("a dir target has a path").join(root).join(prefix);
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Option<Vec<String>>> {
            let entries = match std::fs::read_dir(&dir) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Some(Vec::new())),
                entries => entries?,
            };
            let mut names = Vec::new();
            for entry in entries {
                let entry = entry?;
                if !entry.file_type()?.is_dir() {
                    continue;
                }
                if names.len() as u64 == max {
                    return Ok(None);
                }
                names.extend(entry.file_name().into_string().ok());
            }
            names.sort();
            Ok(Some(names))
        });
        // NFS may hang: the blocking read goes on, but the call ends within the deadline.
        let limit = self.deadline();
        let Ok(read) = tokio::time::timeout(limit, read).await else {
            return Err(Error::answer(&self.name, "LIST", &p, format!("no answer within {limit:?}")));
        };
        match read.expect("reading a directory does not panic") {
            Ok(Some(names)) => Ok(names),
            Ok(None) => Err(Error::answer(&self.name, "LIST", &p, format!("more than {max} entries are listed"))),
            Err(e) => Err(Error::answer(&self.name, "LIST", &p, e.to_string())),
        }
    }

    /// Reads and opens an enveloped object (at most `max` bytes of plaintext).
    pub(crate) async fn get_object(&self, kind: Kind, path: &str, max: usize) -> Result<(Vec<u8>, ObjectMeta)> {
        let (data, meta) = self.get(path, crate::codec::max_envelope(max)).await?;
        let codec = self.codec.clone();
        let name = path.to_owned();
        let plain = tokio::task::spawn_blocking(move || codec.open(kind, &name, data.to_vec(), max))
            .await
            .expect("opening an object does not panic")?;
        Ok((plain, meta))
    }

    /// Seals and writes an enveloped object.
    pub(crate) async fn put_object(&self, kind: Kind, path: &str, plain: Vec<u8>) -> Result<()> {
        self.put_object_within(self.deadline(), kind, path, plain).await
    }

    /// The same, done within `limit` or failed.
    pub(crate) async fn put_object_within(
        &self,
        limit: Duration,
        kind: Kind,
        path: &str,
        plain: Vec<u8>,
    ) -> Result<()> {
        let sealed = self.seal(kind, path, plain).await;
        self.put_within(limit, path, sealed).await
    }

    /// Seals and writes an enveloped object if it is still `seen` (see [`Self::put_if`]).
    pub(crate) async fn put_object_if(
        &self,
        kind: Kind,
        path: &str,
        plain: Vec<u8>,
        seen: Option<&ObjectMeta>,
    ) -> Result<bool> {
        let sealed = self.seal(kind, path, plain).await;
        self.put_if(path, sealed, seen).await
    }

    /// Changes the enveloped object at `path` (at most `max` bytes of plaintext) with `change`,
    /// which gets its plaintext (None: absent) and returns the new one (None: nothing to
    /// change), and stores it only if nobody stored another version in between; else reads it
    /// again and changes that, so that two writers at once lose neither change.
    pub(crate) async fn update_object(
        &self,
        kind: Kind,
        path: &str,
        max: usize,
        mut change: impl FnMut(Option<Vec<u8>>) -> Result<Option<Vec<u8>>>,
    ) -> Result<()> {
        for attempt in 0..32u64 {
            let (plain, seen) = match self.get_object(kind, path, max).await {
                Ok((plain, meta)) => (Some(plain), Some(meta)),
                Err(e) if e.is_not_found() => (None, None),
                Err(e) => return Err(e),
            };
            let Some(plain) = change(plain)? else { return Ok(()) };
            if self.put_object_if(kind, path, plain, seen.as_ref()).await? {
                return Ok(());
            }
            // Another writer won: a pause that grows and differs between writers, then again.
            let jitter = u64::from(crate::codec::random::<1>()[0]);
            tokio::time::sleep(Duration::from_millis(10 * attempt.min(10) + jitter)).await;
        }
        Err(Error::Conflict(format!("{path} on target {} kept changing under this update; try again", self.name)))
    }

    async fn seal(&self, kind: Kind, path: &str, plain: Vec<u8>) -> Bytes {
        let (codec, name) = (self.codec.clone(), path.to_owned());
        let sealed = tokio::task::spawn_blocking(move || codec.seal(kind, &name, &plain));
        sealed.await.expect("sealing does not panic").into()
    }
}

/// The target's store (under its prefix) and, for S3, the bucket's store for paged listings.
type Stores = (Arc<dyn ObjectStore>, Option<Arc<AmazonS3>>);

fn build_store(config: &TargetConfig) -> std::result::Result<Stores, String> {
    let prefix = root_of(config);
    let mut s3 = None;
    let store: Arc<dyn ObjectStore> = match config.kind {
        Some(TargetKind::Dir) => {
            let dir = config.path.as_ref().ok_or("a dir target needs path")?;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            Arc::new(
                object_store::local::LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| format!("{}: {e}", dir.display()))?
                    .with_automatic_cleanup(true),
            )
        }
        Some(TargetKind::S3) => {
            let bucket = config.bucket.as_ref().ok_or("an s3 target needs bucket")?;
            let retry = RetryConfig {
                max_retries: config.retries.unwrap_or(10),
                retry_timeout: Duration::from_secs(30),
                ..RetryConfig::default()
            };
            let mut b = object_store::aws::AmazonS3Builder::new()
                .with_bucket_name(bucket)
                .with_region(config.region.as_deref().unwrap_or("us-east-1"))
                .with_virtual_hosted_style_request(config.virtual_hosted)
                .with_client_options(s3_options(config)?)
                .with_http_connector(crate::bounded::BoundedConnector)
                .with_retry(retry);
            if let Some(e) = &config.endpoint {
                b = b.with_endpoint(e);
            }
            if config.object_lock_days.is_some() {
                // AWS refuses a PUT into a bucket with a default retention without one.
                b = b.with_checksum_algorithm(Checksum::SHA256);
            }
            b = match credentials(config.credentials.as_deref())? {
                Some((id, secret)) => b.with_access_key_id(id).with_secret_access_key(secret),
                None => b.with_skip_signature(true),
            };
            let bucket = Arc::new(b.build().map_err(|e| e.to_string())?);
            s3 = Some(Arc::clone(&bucket));
            bucket
        }
        None => return Err("kind is missing (s3 or dir)".into()),
    };
    let store = if prefix.is_empty() { store } else { Arc::new(object_store::prefix::PrefixStore::new(store, prefix)) };
    Ok((store, s3))
}

/// The HTTP client's options of an S3 target.
fn s3_options(config: &TargetConfig) -> std::result::Result<ClientOptions, String> {
    let mut options = ClientOptions::new()
        .with_timeout(Duration::from_secs(config.timeout_s.unwrap_or(120).max(1)))
        .with_connect_timeout(Duration::from_secs(5));
    if let Some(ca) = &config.ca_file {
        let pem = std::fs::read(ca).map_err(|e| format!("ca-file {}: {e}", ca.display()))?;
        for cert in
            object_store::Certificate::from_pem_bundle(&pem).map_err(|e| format!("ca-file {}: {e}", ca.display()))?
        {
            options = options.with_root_certificate(cert);
        }
    }
    if config.endpoint.as_deref().is_some_and(|e| e.starts_with("http://")) {
        options = options.with_allow_http(true);
    }
    Ok(options)
}

/// The access key pair from a Secret's directory, else the environment, else none (unsigned).
fn credentials(dir: Option<&FsPath>) -> std::result::Result<Option<(String, String)>, String> {
    if let Some(dir) = dir {
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .map(|s| s.trim().to_owned())
                .map_err(|e| format!("credentials {}/{f}: {e}", dir.display()))
        };
        return Ok(Some((read("access-key-id")?, read("secret-access-key")?)));
    }
    match (std::env::var("AWS_ACCESS_KEY_ID"), std::env::var("AWS_SECRET_ACCESS_KEY")) {
        (Ok(id), Ok(secret)) => Ok(Some((id, secret))),
        _ => Ok(None),
    }
}

/// The fingerprint of the key in `path`: the first 16 hex digits of the key check a target made
/// with it stores in its marker (an HMAC under a key derived from it: it reveals nothing of the
/// key). Two copies of a key have the same fingerprint; an escrowed copy is checked with it.
pub fn key_fingerprint(path: &FsPath) -> std::result::Result<String, String> {
    let key = read_key(path)?;
    Ok(Codec::new("", "", Some(&key)).key_check()[..16].to_owned())
}

/// A key file: 32 raw bytes, or 64 hex digits.
fn read_key(path: &FsPath) -> std::result::Result<[u8; 32], String> {
    let data = std::fs::read(path).map_err(|e| format!("key-file {}: {e}", path.display()))?;
    let bytes = if data.len() == 32 {
        data
    } else {
        std::str::from_utf8(&data).ok().and_then(|s| crate::codec::unhex(s.trim())).unwrap_or_default()
    };
    bytes.try_into().map_err(|_| format!("key-file {}: not 32 bytes (raw) or 64 hex digits", path.display()))
}

use std::os::unix::fs::DirBuilderExt;
