//! A prune deletes only on evidence: a lost index update, a deleted index, a forged manifest,
//! an interrupted attempt's leftover and two daemons that disagree on the grace each leave
//! every backup a user was told was made restorable.

#![allow(clippy::cast_possible_truncation)]

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::stream::BoxStream;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMultipartOptions,
    PutOptions, PutPayload, PutResult,
};
use tokio::sync::oneshot;

use crate::pool;

use ferrite_backup::{
    BackupRef, Error, Index, Manifest, Retention, SegmentRef, Sweep, Target, TargetConfig, TargetKind,
};
use pool::{MIB, backup, image, new_pool, noise, restore, volume_image};

/// The grace of the tests' targets: a backup must commit within 0.9 x of it on the store's clock,
/// whose times are whole seconds (a backup of a second may count two).
const GRACE_S: u64 = 3;
/// Long enough for a manifest to be older than [`GRACE_S`] on the store's clock.
const PAST_GRACE: Duration = Duration::from_millis(GRACE_S * 1000 + 1100);

fn config(root: &Path, grace_s: u64) -> TargetConfig {
    TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(root.to_owned()),
        chunk_size: Some(MIB),
        grace_s: Some(grace_s),
        ..TargetConfig::default()
    }
}

/// A pool, and a directory target `t` of `grace_s` at `root`.
async fn setup(grace_s: u64) -> (tempfile::TempDir, ferrite_engine::Pool, std::path::PathBuf, Target) {
    let (dir, pool) = new_pool();
    let root = dir.path().join("t");
    let target = Target::open("t", config(&root, grace_s)).await.unwrap();
    (dir, pool, root, target)
}

/// Backs up `n` snapshots of volume `v`, each with a chunk of its own: their ids.
async fn backups(target: &Target, pool: &ferrite_engine::Pool, n: u64) -> Vec<String> {
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(MIB, &noise(100, 3 * MIB as usize)).unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        v.write(0, &noise(i, MIB as usize)).unwrap();
        pool.create_snapshot("v", &format!("s{i}")).unwrap();
        backup(target, pool, "v", &format!("s{i}"), &format!("b{i}")).await.unwrap();
        ids.push(format!("b{i}"));
    }
    ids
}

/// Every backup in `ids` restores to its snapshot `s<N>`.
async fn all_restore(target: &Target, pool: &ferrite_engine::Pool, ids: &[&str]) {
    for id in ids {
        let name = format!("r-{id}-{}", rand_suffix());
        restore(target, pool, &format!("v/{id}").parse().unwrap(), &name).await.unwrap();
        assert!(volume_image(pool, &name) == image(pool, &format!("s{}", &id[1..])), "{id} restores its snapshot");
    }
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos()
}

/// An envelope of a keyless target holding `json` as it is (format 1, kind 2: a manifest).
fn plain_manifest(m: &Manifest) -> Vec<u8> {
    [&b"FRBK\x01\x02\x00"[..], &serde_json::to_vec(m).unwrap()].concat()
}

fn ids(index: &Index) -> Vec<&str> {
    index.backups.iter().map(|b| b.id.as_str()).collect()
}

/// Two writers with `conditional-writes = false` (or a store that loses an update): the index
/// is written back without the second backup. Prunes keep its chunks while it may be a backup
/// being committed, then list it again; it restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_index_update_loses_no_backup() {
    let (_dir, pool, root, target) = setup(GRACE_S).await;
    let index_file = root.join("volumes/v/index");
    backups(&target, &pool, 1).await;
    let before = std::fs::read(&index_file).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &noise(1, MIB as usize)).unwrap();
    pool.create_snapshot("v", "s1").unwrap();
    backup(&target, &pool, "v", "s1", "b1").await.unwrap();
    std::fs::write(&index_file, before).unwrap();

    // While it may be a backup being committed: kept, not listed yet. A retention that keeps
    // only the newest listed backup deletes nothing it cannot see.
    let keep = Retention { keep_last: 1, ..Retention::default() };
    let r = ferrite_backup::prune(&target, Some(&keep), Sweep::default()).await.unwrap();
    assert!(r.backups_recovered.is_empty() && r.chunks_deleted == 0 && r.manifests == 2, "{r:?}");
    tokio::time::sleep(PAST_GRACE).await;
    for round in 0..2 {
        let r = ferrite_backup::prune(&target, Some(&keep), Sweep::default()).await.unwrap();
        if round == 0 {
            assert_eq!(r.backups_recovered, ["v/b1"], "{r:?}");
            assert!(r.indexes_rebuilt.is_empty(), "the index was there: {r:?}");
        } else {
            assert!(r.backups_recovered.is_empty(), "{r:?}");
        }
    }
    let index = Index::load(&target, "v").await.unwrap();
    assert_eq!(ids(&index), ["b1"], "b1 listed again; b0 deleted by the retention since");
    all_restore(&target, &pool, &["b1"]).await;
}

/// The index deleted (a stolen credential, an operator's mistake, a replication lag): the next
/// prunes delete no manifest and no chunk, and rebuild it from the manifests. A backup deleted
/// before stays deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_index_is_rebuilt_from_the_manifests() {
    let (_dir, pool, root, target) = setup(GRACE_S).await;
    backups(&target, &pool, 3).await;
    ferrite_backup::delete(&target, &"v/b0".parse().unwrap()).await.unwrap();
    std::fs::remove_file(root.join("volumes/v/index")).unwrap();
    tokio::time::sleep(PAST_GRACE).await;
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!((r.indexes_rebuilt.as_slice(), r.backups_recovered.len()), (&["v".to_owned()][..], 2), "{r:?}");
    assert_eq!((r.manifests_deleted, r.chunks_deleted), (0, 0), "{r:?}");
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert!(r.backups_recovered.is_empty() && r.indexes_rebuilt.is_empty(), "{r:?}");
    assert_eq!(ids(&Index::load(&target, "v").await.unwrap()), ["b1", "b2"]);
    all_restore(&target, &pool, &["b1", "b2"]).await;
}

/// A manifest goes only on its index's word: an attempt another attempt of the same backup
/// superseded, and a deleted backup's whose removal was interrupted. One nothing speaks for is
/// listed again, whatever its age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_go_on_evidence_only() {
    let (_dir, pool, root, target) = setup(GRACE_S).await;
    backups(&target, &pool, 2).await;
    let m = Manifest::load(&target, &"v/b0".parse().unwrap()).await.unwrap();
    let attempt = m.attempt.clone().expect("a backup names its attempt");
    let backups_dir = root.join("volumes/v/backups");
    assert!(backups_dir.join(format!("b0@{attempt}")).is_file());
    // An interrupted attempt of b0, superseded by the one its index lists.
    let leftover = Manifest { attempt: Some("00000000000000aa".into()), ..m.clone() };
    std::fs::write(backups_dir.join("b0@00000000000000aa"), plain_manifest(&leftover)).unwrap();
    // b1 deleted, its manifest left by a crash between the index update and its removal.
    let b1 = Manifest::load(&target, &"v/b1".parse().unwrap()).await.unwrap();
    let b1_file = backups_dir.join(format!("b1@{}", b1.attempt.as_deref().unwrap()));
    let kept = std::fs::read(&b1_file).unwrap();
    ferrite_backup::delete(&target, &"v/b1".parse().unwrap()).await.unwrap();
    std::fs::write(&b1_file, kept).unwrap();
    // A backup nothing lists (its commit's index update lost).
    let orphan = Manifest { id: "b9".into(), attempt: Some("00000000000000bb".into()), ..m.clone() };
    std::fs::write(backups_dir.join("b9@00000000000000bb"), plain_manifest(&orphan)).unwrap();
    // Not a manifest's name: left alone.
    std::fs::write(backups_dir.join("x@notes"), b"x").unwrap();

    tokio::time::sleep(PAST_GRACE).await;
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!((r.manifests_deleted, r.backups_recovered.as_slice()), (2, &["v/b9".to_owned()][..]), "{r:?}");
    let mut left: Vec<String> =
        std::fs::read_dir(&backups_dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, [format!("b0@{attempt}"), "b9@00000000000000bb".into(), "x@notes".into()]);
    let index = Index::load(&target, "v").await.unwrap();
    assert_eq!((ids(&index), index.deleted.len()), (vec!["b0", "b9"], 0), "the deleted name is forgotten once gone");
    all_restore(&target, &pool, &["b0"]).await;
    restore(&target, &pool, &"v/b9".parse().unwrap(), "b9").await.unwrap();
    assert!(volume_image(&pool, "b9") == image(&pool, "s0"));
}

/// A manifest a keyless store forges (chunk size 0, segments out of order or unnamed, a segment
/// that lists chunks out of order, past the volume, or longer than their place) is refused when
/// it is read, by every reader: nothing panics, and a prune deletes nothing on its account.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_manifest_is_refused_at_load() {
    let (_dir, pool, root, target) = setup(GRACE_S).await;
    backups(&target, &pool, 1).await;
    let b: BackupRef = "v/b0".parse().unwrap();
    let m = Manifest::load(&target, &b).await.unwrap();
    let file = root.join(format!("volumes/v/backups/b0@{}", m.attempt.as_deref().unwrap()));
    let seg = m.segments[0].clone();
    let listed = m.chunk_list(&target).await.unwrap();
    // A segment as the store can forge one (it is named by an unkeyed hash), and a manifest
    // that lists it.
    let forge = |chunks: &[(u64, u32, &str)]| {
        let mut plain = [&b"FRSG\x01"[..], &0u64.to_le_bytes(), &(chunks.len() as u32).to_le_bytes()].concat();
        for (i, len, id) in chunks {
            plain.extend((*i as u32).to_le_bytes().iter().chain(&len.to_le_bytes()));
            plain.extend((0..32).map(|n| u8::from_str_radix(&id[2 * n..2 * n + 2], 16).unwrap()));
        }
        let id = target.chunk_name(&plain);
        let path = root.join("chunks").join(&id[..2]).join(&id);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, [&b"FRBK\x01\x01\x00"[..], &plain].concat()).unwrap();
        let bytes = chunks.iter().map(|c| u64::from(c.1)).sum();
        let forged = SegmentRef { first: 0, id, chunks: chunks.len() as u32, bytes };
        Manifest { segments: vec![forged], ..m.clone() }
    };
    let (a, z) = (listed[0].id.as_str(), listed[1].id.as_str());
    let forgeries = [
        Manifest { chunk_size: 0, ..m.clone() },
        Manifest { size: u64::MAX, ..m.clone() },
        Manifest { segments: vec![seg.clone(), seg.clone()], ..m.clone() },
        Manifest { segments: vec![SegmentRef { id: "x".into(), ..seg.clone() }], ..m.clone() },
        Manifest { segments: vec![SegmentRef { first: 1, ..seg.clone() }], ..m.clone() },
        Manifest { segments: vec![SegmentRef { chunks: seg.chunks + 1, ..seg.clone() }], ..m.clone() },
        forge(&[(1, MIB as u32, a), (0, MIB as u32, z)]),
        forge(&[(99, MIB as u32, a)]),
        forge(&[(0, MIB as u32 + 1, a)]),
        forge(&[(0, 0, a)]),
    ];
    for forged in &forgeries {
        std::fs::write(&file, plain_manifest(forged)).unwrap();
        let e = match Manifest::load(&target, &b).await {
            Ok(m) => m.chunk_list(&target).await.unwrap_err(),
            Err(e) => e,
        };
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        let e = restore(&target, &pool, &b, "r").await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        let e = ferrite_backup::prune(&target, None, pool::no_writers()).await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    }
    std::fs::write(&file, plain_manifest(&m)).unwrap();
    all_restore(&target, &pool, &["b0"]).await;
}

/// Two daemons whose configs name other graces keep one, the target's marker's; a prune goes
/// below it only with `no_writers`, and not while a writer's lease is alive. A backup takes its
/// lease away when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_grace_for_every_writer() {
    let (_dir, pool, root, first) = setup(3600).await;
    let second = Target::open("t", config(&root, 5)).await.unwrap();
    assert_eq!((first.grace(), second.grace()), (Duration::from_secs(3600), Duration::from_secs(3600)));
    backups(&second, &pool, 1).await;
    let leases = root.join("gc/writers");
    assert_eq!(std::fs::read_dir(&leases).map_or(0, Iterator::count), 0, "the backup's lease is gone");

    let short = Sweep { grace: Some(Duration::from_secs(5)), no_writers: false };
    let e = ferrite_backup::prune(&second, None, short).await.unwrap_err();
    assert!(matches!(e, Error::Invalid(_)) && e.to_string().contains("no-writers"), "{e}");
    // A backup running elsewhere (its lease is young).
    std::fs::create_dir_all(&leases).unwrap();
    std::fs::write(leases.join("0123456789abcdef"), b"").unwrap();
    let e = ferrite_backup::prune(&second, None, Sweep { no_writers: true, ..short }).await.unwrap_err();
    assert!(matches!(e, Error::Conflict(_)) && e.to_string().contains("0123456789abcdef"), "{e}");
    std::fs::remove_file(leases.join("0123456789abcdef")).unwrap();
    ferrite_backup::prune(&second, None, Sweep { no_writers: true, ..short }).await.unwrap();
    // A longer grace needs nothing.
    let long = Sweep { grace: Some(Duration::from_secs(7200)), no_writers: false };
    ferrite_backup::prune(&first, None, long).await.unwrap();
    all_restore(&first, &pool, &["b0"]).await;
}

/// A store that holds the first GET of one object until told to go: the prune that makes it
/// waits there, between its listing and what it decides from the index.
#[derive(Debug)]
struct Paused {
    inner: Arc<dyn ObjectStore>,
    at: object_store::path::Path,
    gate: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
}

impl std::fmt::Display for Paused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Paused({})", self.inner)
    }
}

type StoreResult<T> = object_store::Result<T>;

#[async_trait::async_trait]
impl ObjectStore for Paused {
    async fn put_opts(&self, at: &object_store::path::Path, p: PutPayload, o: PutOptions) -> StoreResult<PutResult> {
        self.inner.put_opts(at, p, o).await
    }

    async fn put_multipart_opts(
        &self,
        at: &object_store::path::Path,
        o: PutMultipartOptions,
    ) -> StoreResult<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(at, o).await
    }

    async fn get_opts(&self, at: &object_store::path::Path, o: GetOptions) -> StoreResult<GetResult> {
        let gate = if *at == self.at { self.gate.lock().unwrap().take() } else { None };
        if let Some((paused, go)) = gate {
            paused.send(()).unwrap();
            go.await.unwrap();
        }
        self.inner.get_opts(at, o).await
    }

    fn delete_stream(
        &self,
        at: BoxStream<'static, StoreResult<object_store::path::Path>>,
    ) -> BoxStream<'static, StoreResult<object_store::path::Path>> {
        self.inner.delete_stream(at)
    }

    fn list(&self, prefix: Option<&object_store::path::Path>) -> BoxStream<'static, StoreResult<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&object_store::path::Path>) -> StoreResult<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        o: CopyOptions,
    ) -> StoreResult<()> {
        self.inner.copy_opts(from, to, o).await
    }
}

/// A retried commit racing a prune: an interrupted attempt of b1 left its manifest (older than
/// the grace); a prune lists it and pauses before it reads the index; meanwhile the retry
/// commits b1 as a new attempt. The prune deletes the superseded attempt's manifest on the
/// index's word and nothing of the retry's: b1 restores then and after two more prunes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_commit_racing_a_prune_keeps_its_manifest() {
    let (_dir, pool, root, target) = setup(GRACE_S).await;
    backups(&target, &pool, 1).await;
    let v = pool.open_volume("v").unwrap();
    v.write(0, &noise(1, MIB as usize)).unwrap();
    pool.create_snapshot("v", "s1").unwrap();
    let m0 = Manifest::load(&target, &"v/b0".parse().unwrap()).await.unwrap();
    let interrupted = Manifest { id: "b1".into(), attempt: Some("00000000000000a1".into()), ..m0 };
    let backups_dir = root.join("volumes/v/backups");
    std::fs::write(backups_dir.join("b1@00000000000000a1"), plain_manifest(&interrupted)).unwrap();
    tokio::time::sleep(PAST_GRACE).await;

    let ((paused, on_pause), (go, on_go)) = (oneshot::channel(), oneshot::channel());
    let racing = target.clone().with_store_layer(|inner| {
        Arc::new(Paused { inner, at: "volumes/v/index".into(), gate: Mutex::new(Some((paused, on_go))) })
    });
    let prune = tokio::spawn(async move { ferrite_backup::prune(&racing, None, Sweep::default()).await });
    on_pause.await.unwrap();
    let retried = backup(&target, &pool, "v", "s1", "b1").await.unwrap();
    assert_ne!(retried.attempt.as_deref(), Some("00000000000000a1"), "each attempt has a name of its own");
    go.send(()).unwrap();
    let r = prune.await.unwrap().unwrap();
    assert_eq!((r.manifests_deleted, r.backups_recovered.len(), r.chunks_deleted), (1, 0, 0), "{r:?}");
    assert!(!backups_dir.join("b1@00000000000000a1").exists());
    all_restore(&target, &pool, &["b0", "b1"]).await;
    for _ in 0..2 {
        tokio::time::sleep(PAST_GRACE).await;
        ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    }
    all_restore(&target, &pool, &["b0", "b1"]).await;
}

/// Two clusters share a store and a key under their own prefixes: one's index and manifests
/// copied under the other's prefix do not open there (the prefix is sealed into them), while
/// chunks, named by their contents, are the same under both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_cannot_serve_one_clusters_backups_as_anothers() {
    let (dir, pool) = new_pool();
    let key = dir.path().join("key");
    std::fs::write(&key, [9u8; 32]).unwrap();
    let root = dir.path().join("store");
    let at = |prefix: &str| TargetConfig {
        prefix: Some(prefix.into()),
        key_file: Some(key.clone()),
        ..config(&root, GRACE_S)
    };
    let a = Target::open("a", at("cluster-a")).await.unwrap();
    let b = Target::open("b", at("cluster-b")).await.unwrap();
    backups(&a, &pool, 1).await;
    let copy = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, to).unwrap();
    };
    let m = Manifest::load(&a, &"v/b0".parse().unwrap()).await.unwrap();
    let manifest = format!("volumes/v/backups/{}", m.name());
    for path in ["volumes/v/index", manifest.as_str()] {
        copy(&root.join("cluster-a").join(path), &root.join("cluster-b").join(path));
    }
    let e = Index::load(&b, "v").await.unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    let chunks = m.chunk_list(&a).await.unwrap().into_iter().map(|c| c.id);
    for id in m.segments.iter().map(|s| s.id.clone()).chain(chunks) {
        let path = format!("chunks/{}/{id}", &id[..2]);
        copy(&root.join("cluster-a").join(&path), &root.join("cluster-b").join(&path));
    }
    let e = Manifest::load(&b, &"v/b0".parse().unwrap()).await.unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    let report = ferrite_backup::verify(&a, &["v/b0".parse().unwrap()], None, &|_| {}).await.unwrap();
    assert!(report.bad.is_empty(), "{:?}", report.bad);
}
