//! S3 Object Lock against SeaweedFS (which implements it): a target refuses a bucket without
//! object lock; on one with it (no default retention needed), every object a backup writes is
//! locked by its own PUT, a prune extends the lock of what it keeps (PutObjectRetention), and
//! what a prune (or a thief with the node's credential) deletes is only hidden: the locked
//! versions stay, and deleting one is refused.

#![allow(clippy::cast_possible_truncation)]

use crate::common;
use crate::pool;

use common::Weed;
use ferrite_backup::{LockMode, Sweep, Target, TargetConfig, TargetKind};
use pool::*;

const BUCKET: &str = "ferrite-locked";

fn locked(weed: &Weed, bucket: &str, days: u64, mode: Option<LockMode>) -> TargetConfig {
    TargetConfig {
        kind: Some(TargetKind::S3),
        endpoint: Some(weed.endpoint()),
        bucket: Some(bucket.into()),
        prefix: Some("cluster-a".into()),
        chunk_size: Some(MIB),
        retries: Some(1),
        object_lock_days: Some(days),
        object_lock_mode: mode,
        ..TargetConfig::default()
    }
}

/// The retention of `key`'s current version: its mode and its date (to the second); None when
/// it has none.
fn retention(weed: &Weed, key: &str) -> Option<(String, String)> {
    let (code, xml) = weed.s3_request("GET", &format!("/{BUCKET}/{key}?retention"), &[], "");
    let field = |name: &str| {
        let (_, rest) = xml.split_once(&format!("<{name}>"))?;
        Some(rest.split_once(&format!("</{name}>"))?.0.to_owned())
    };
    if code != 200 {
        assert!(
            xml.contains("NoSuchObjectLockConfiguration") || xml.contains("ObjectLockConfigurationNotFound"),
            "{xml}"
        );
        return None;
    }
    Some((field("Mode")?, field("RetainUntilDate")?.get(..19)?.to_owned()))
}

/// The ISO date (to the second) `secs` from now, as S3 writes it.
fn from_now(secs: u64) -> String {
    let id = ferrite_backup::new_id(ferrite_backup::now_unix() + secs);
    format!("{}-{}-{}T{}:{}:{}", &id[..4], &id[4..6], &id[6..8], &id[9..11], &id[11..13], &id[13..15])
}

/// Whether `date` is within a minute of `secs` from now.
fn about(date: &str, secs: u64) -> bool {
    (from_now(secs - 60)..=from_now(secs + 60)).contains(&date.to_owned())
}

/// The version ids of `key` in the bucket (newest first), and whether a delete marker hides it.
fn versions(weed: &Weed, key: &str) -> (Vec<String>, bool) {
    let (code, xml) = weed.s3_request("GET", &format!("/{BUCKET}?versions&prefix={key}"), &[], "");
    assert_eq!(code, 200, "{xml}");
    let mut ids = Vec::new();
    for v in xml.split("<Version>").skip(1) {
        let id = v.split_once("<VersionId>").and_then(|(_, r)| r.split_once("</VersionId>")).unwrap().0;
        ids.push(id.to_owned());
    }
    let hidden = xml.contains(&format!("<DeleteMarker><Key>{key}</Key>"));
    (ids, hidden)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_target_keeps_what_is_deleted() {
    let Some(weed) = Weed::start(false) else { return };
    let (dir, pool) = new_pool();

    // A bucket without object lock is refused, with how to get one; so is a directory.
    let err = Target::open("t", locked(&weed, "ferrite-test", 2, None)).await.unwrap_err().to_string();
    assert!(err.contains("has no object lock") && err.contains("--object-lock-enabled-for-bucket"), "{err}");
    let said = weed.shell(&format!("s3.bucket.create -name {BUCKET} -withLock"));
    assert!(said.contains("created bucket"), "{said}");
    let on_dir = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(dir.path().join("t")),
        ..locked(&weed, BUCKET, 2, None)
    };
    let err = Target::open("t", on_dir).await.unwrap_err().to_string();
    assert!(err.contains("for s3 targets"), "{err}");

    // The bucket has object lock and no default retention: each PUT locks its own version.
    let target = Target::open("t", locked(&weed, BUCKET, 2, None)).await.unwrap();
    pool.create_volume("db", SIZE).unwrap();
    let v = pool.open_volume("db").unwrap();
    v.write(0, &noise(7, 4 * MIB as usize)).unwrap();
    pool.create_snapshot("db", "s1").unwrap();
    let m = backup(&target, &pool, "db", "s1", "b1").await.unwrap();
    assert_eq!(m.chunk_count(), 4);
    v.write(0, &noise(8, MIB as usize)).unwrap();
    pool.create_snapshot("db", "s2").unwrap();
    let m2 = backup(&target, &pool, "db", "s2", "b2").await.unwrap();
    assert!(!m2.full, "a fresh full backup is a base under the lock");
    restore(&target, &pool, &"db/b2".parse().unwrap(), "back").await.unwrap();
    assert_eq!(volume_image(&pool, "back"), image(&pool, "s2"));

    let chunk = chunk_key(&target, &m, 3).await;
    let manifest = format!("cluster-a/volumes/db/backups/b1@{}", m.attempt.as_deref().unwrap());
    for key in [chunk.as_str(), &manifest, "cluster-a/volumes/db/index", "cluster-a/ferrite-backup.json"] {
        let (mode, until) = retention(&weed, key).unwrap_or_else(|| panic!("{key} is not locked"));
        assert_eq!(mode, "GOVERNANCE", "{key}");
        assert!(about(&until, 2 * 86_400), "{key} is locked until {until}");
    }

    // The first prune extends the lock of everything it keeps: the marker, the index, both
    // manifests, the 5 chunks and the manifests' 2 segments; the next one, a quarter of the lock later at the earliest.
    let (_, uploaded) = retention(&weed, &chunk).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!((r.locks_extended, r.chunks_deleted), (1 + 1 + 2 + 5 + 2, 0), "{r:?}");
    let (_, extended) = retention(&weed, &chunk).unwrap();
    assert!(extended > uploaded, "extended from {uploaded} to {extended}");
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!(r.locks_extended, 0, "{r:?}");

    // Both backups deleted and pruned at once: the chunks vanish from the target's view...
    ferrite_backup::delete(&target, &"db/b1".parse().unwrap()).await.unwrap();
    ferrite_backup::delete(&target, &"db/b2".parse().unwrap()).await.unwrap();
    let r = ferrite_backup::prune(&target, None, pool::no_writers()).await.unwrap();
    assert_eq!(r.chunks_deleted, 5 + 2, "and the 2 segments: {r:?}");
    let (ids, hidden) = versions(&weed, &chunk);
    assert!(hidden, "a delete leaves a marker in a versioned bucket");
    // ...but their locked versions stay, and deleting one for good is refused.
    assert_eq!(ids.len(), 1);
    let (code, said) = weed.s3_request("DELETE", &format!("/{BUCKET}/{chunk}?versionId={}", ids[0]), &[], "");
    assert_eq!(code, 403, "a locked version cannot be deleted: {said}");
    let (code, _) = weed.s3_request("GET", &format!("/{BUCKET}/{chunk}?versionId={}", ids[0]), &[], "");
    assert_eq!(code, 200, "the locked version is still readable");
}

/// Backups written before the target had `object-lock-days` have no retention of their own: the
/// first prune with it locks them (in the mode asked for), and a later backup's compliance-mode
/// uploads say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_locked_later_is_locked_by_its_first_prune() {
    let Some(weed) = Weed::start(false) else { return };
    let (_dir, pool) = new_pool();
    let said = weed.shell(&format!("s3.bucket.create -name {BUCKET} -withLock"));
    assert!(said.contains("created bucket"), "{said}");
    let unlocked = TargetConfig { object_lock_days: None, ..locked(&weed, BUCKET, 1, None) };
    let target = Target::open("t", unlocked.clone()).await.unwrap();
    pool.create_volume("db", SIZE).unwrap();
    pool.open_volume("db").unwrap().write(0, &noise(3, 2 * MIB as usize)).unwrap();
    pool.create_snapshot("db", "s1").unwrap();
    let m = backup(&target, &pool, "db", "s1", "b1").await.unwrap();
    let chunk = chunk_key(&target, &m, 0).await;
    assert_eq!(retention(&weed, &chunk), None, "an unlocked target's PUT sets no retention");

    let target = Target::open("t", locked(&weed, BUCKET, 1, Some(LockMode::Compliance))).await.unwrap();
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!(r.locks_extended, 1 + 1 + 1 + 2 + 1, "marker, index, manifest, 2 chunks, a segment: {r:?}");
    let (mode, until) = retention(&weed, &chunk).unwrap();
    assert!(mode == "COMPLIANCE" && about(&until, 86_400), "{mode} {until}");

    pool.open_volume("db").unwrap().write(0, &noise(4, MIB as usize)).unwrap();
    pool.create_snapshot("db", "s2").unwrap();
    let m = backup(&target, &pool, "db", "s2", "b2").await.unwrap();
    assert_eq!(m.new_chunks, 1, "{m:?}");
    let fresh = chunk_key(&target, &m, 0).await;
    let (mode, until) = retention(&weed, &fresh).unwrap();
    assert!(mode == "COMPLIANCE" && about(&until, 86_400), "{mode} {until}");

    // The target's marker holds its lock now: a daemon whose config says governance, other
    // days or no lock at all is refused (AWS would not turn compliance back; a writer without
    // the lock would store unlocked objects).
    for other in [locked(&weed, BUCKET, 1, None), locked(&weed, BUCKET, 2, Some(LockMode::Compliance)), unlocked] {
        let e = Target::open("t", other).await.unwrap_err().to_string();
        assert!(e.contains("marker says object lock Compliance for 1 days"), "{e}");
    }
    // Changed on purpose: then every daemon's config must say the new lock.
    let longer = locked(&weed, BUCKET, 2, Some(LockMode::Compliance));
    let before = Target::set_lock("t", longer.clone()).await.unwrap();
    assert_eq!(before, Some((LockMode::Compliance, 1)));
    let e = Target::open("t", locked(&weed, BUCKET, 1, Some(LockMode::Compliance))).await.unwrap_err().to_string();
    assert!(e.contains("marker says object lock Compliance for 2 days"), "{e}");
    let target = Target::open("t", longer).await.unwrap();
    pool.open_volume("db").unwrap().write(0, &noise(5, MIB as usize)).unwrap();
    pool.create_snapshot("db", "s3").unwrap();
    let m = backup(&target, &pool, "db", "s3", "b3").await.unwrap();
    let fresh = chunk_key(&target, &m, 0).await;
    let (mode, until) = retention(&weed, &fresh).unwrap();
    assert!(mode == "COMPLIANCE" && about(&until, 2 * 86_400), "{mode} {until}");
}

/// The bucket's lock is asked for with a signed request: a store with authentication answers
/// the right key (here: no lock on that bucket) and refuses a wrong one, which the error names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_is_read_with_the_targets_credentials() {
    let Some(weed) = Weed::start(true) else { return };
    let dir = tempfile::tempdir().unwrap();
    let with_key = |secret: &str| {
        let creds = dir.path().join(secret);
        std::fs::create_dir_all(&creds).unwrap();
        std::fs::write(creds.join("access-key-id"), "ferrite").unwrap();
        std::fs::write(creds.join("secret-access-key"), secret).unwrap();
        TargetConfig { credentials: Some(creds), ..locked(&weed, "ferrite-test", 1, None) }
    };
    let err = Target::open("t", with_key("ferrite-secret")).await.unwrap_err().to_string();
    assert!(err.contains("has no object lock"), "signed and accepted: {err}");
    let err = Target::open("t", with_key("wrong-secret")).await.unwrap_err().to_string();
    assert!(err.contains("403") && err.contains("s3:GetBucketObjectLockConfiguration"), "{err}");

    // On a locked bucket, the retention headers a PUT carries and the PutObjectRetention of a
    // prune are signed as the store checks them (a header the signature misses is refused).
    let said = weed.shell(&format!("s3.bucket.create -name {BUCKET} -withLock"));
    assert!(said.contains("created bucket"), "{said}");
    let target =
        Target::open("t", TargetConfig { bucket: Some(BUCKET.into()), ..with_key("ferrite-secret") }).await.unwrap();
    let (_pool_dir, pool) = new_pool();
    pool.create_volume("db", SIZE).unwrap();
    pool.open_volume("db").unwrap().write(0, &noise(5, MIB as usize)).unwrap();
    pool.create_snapshot("db", "s1").unwrap();
    backup(&target, &pool, "db", "s1", "b1").await.unwrap();
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!(r.locks_extended, 1 + 1 + 1 + 1 + 1, "marker, index, manifest, chunk, segment: {r:?}");
}

/// A prune whose mark fails (a manifest nothing lists that does not read) still extends every
/// object's lock, the condemned chunks' too, and records it: the next prune, the manifest gone,
/// has nothing to extend and deletes nothing it should keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prune_still_extends_the_lock() {
    let Some(weed) = Weed::start(false) else { return };
    let (_dir, pool) = new_pool();
    let said = weed.shell(&format!("s3.bucket.create -name {BUCKET} -withLock"));
    assert!(said.contains("created bucket"), "{said}");
    let target = Target::open("t", locked(&weed, BUCKET, 1, None)).await.unwrap();
    pool.create_volume("db", SIZE).unwrap();
    pool.open_volume("db").unwrap().write(0, &noise(3, 2 * MIB as usize)).unwrap();
    pool.create_snapshot("db", "s1").unwrap();
    let m = backup(&target, &pool, "db", "s1", "b1").await.unwrap();
    let chunk = chunk_key(&target, &m, 0).await;
    let (_, uploaded) = retention(&weed, &chunk).unwrap();
    // Garbage where a manifest of an interrupted attempt would be: the mark cannot read it.
    let junk = format!("/{BUCKET}/cluster-a/volumes/db/backups/b2@00000000000000aa");
    let (code, _) = weed.s3_request("PUT", &junk, &[], "not a manifest");
    assert_eq!(code, 200);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let e = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap_err();
    assert!(matches!(e, ferrite_backup::Error::Corrupt { .. }), "{e}");
    let (_, extended) = retention(&weed, &chunk).unwrap();
    assert!(extended > uploaded, "extended from {uploaded} to {extended} although the mark failed");
    let (code, _) = weed.s3_request("DELETE", &junk, &[], "");
    assert_eq!(code, 204);
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!((r.locks_extended, r.chunks_deleted, r.manifests), (0, 0, 1), "recorded as done: {r:?}");
    assert!(r.locked_at.is_some(), "{r:?}");
    restore(&target, &pool, &"db/b1".parse().unwrap(), "back").await.unwrap();
    assert_eq!(volume_image(&pool, "back"), image(&pool, "s1"));
}

/// The key of chunk `n` of backup `m` under the target's prefix.
async fn chunk_key(target: &Target, m: &ferrite_backup::Manifest, n: usize) -> String {
    let id = m.chunk_list(target).await.unwrap()[n].id.clone();
    format!("cluster-a/chunks/{}/{id}", &id[..2])
}
