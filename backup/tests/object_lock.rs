//! S3 Object Lock against SeaweedFS (which implements it): a target refuses a bucket that does
//! not lock what it is asked to; on one that does, backups upload with checksums, every object
//! they write is locked, and what a prune (or a thief with the node's credential) deletes is
//! only hidden: the locked versions stay, and deleting one is refused.

#![allow(clippy::cast_possible_truncation)]

use crate::common;
use crate::pool;

use common::Weed;
use ferrite_backup::{LockMode, Target, TargetConfig, TargetKind};
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

fn retention(mode: &str, days: u64) -> String {
    format!(
        r#"<ObjectLockConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><ObjectLockEnabled>Enabled</ObjectLockEnabled><Rule><DefaultRetention><Mode>{mode}</Mode><Days>{days}</Days></DefaultRetention></Rule></ObjectLockConfiguration>"#
    )
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

    // A bucket without object lock, one with it but no default retention, one whose retention
    // is shorter or in another mode: each refused with what to set.
    let err = Target::open("t", locked(&weed, "ferrite-test", 2, None)).await.unwrap_err().to_string();
    assert!(err.contains("has no object lock"), "{err}");
    let said = weed.shell(&format!("s3.bucket.create -name {BUCKET} -withLock"));
    assert!(said.contains("created bucket"), "{said}");
    let err = Target::open("t", locked(&weed, BUCKET, 2, None)).await.unwrap_err().to_string();
    assert!(err.contains("no default retention") && err.contains("put-object-lock-configuration"), "{err}");
    let (code, said) = weed.s3_request("PUT", &format!("/{BUCKET}?object-lock"), &[], &retention("GOVERNANCE", 2));
    assert_eq!(code, 200, "{said}");
    let err = Target::open("t", locked(&weed, BUCKET, 3, None)).await.unwrap_err().to_string();
    assert!(err.contains("fewer than object-lock-days (3)"), "{err}");
    let err = Target::open("t", locked(&weed, BUCKET, 2, Some(LockMode::Compliance))).await.unwrap_err().to_string();
    assert!(err.contains("GOVERNANCE mode, not COMPLIANCE"), "{err}");
    let on_dir = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(dir.path().join("t")),
        ..locked(&weed, BUCKET, 2, None)
    };
    let err = Target::open("t", on_dir).await.unwrap_err().to_string();
    assert!(err.contains("for s3 targets"), "{err}");

    // The bucket locks new versions for 2 days in governance mode: backups work (with checksums).
    let target = Target::open("t", locked(&weed, BUCKET, 2, None)).await.unwrap();
    pool.create_volume("db", SIZE).unwrap();
    let v = pool.open_volume("db").unwrap();
    v.write(0, &noise(7, 4 * MIB as usize)).unwrap();
    pool.create_snapshot("db", "s1").unwrap();
    let m = backup(&target, &pool, "db", "s1", "b1").await.unwrap();
    assert_eq!(m.chunks.len(), 4);
    v.write(0, &noise(8, MIB as usize)).unwrap();
    pool.create_snapshot("db", "s2").unwrap();
    let m2 = backup(&target, &pool, "db", "s2", "b2").await.unwrap();
    assert!(!m2.full, "a fresh full backup is a base under the lock");
    restore(&target, &pool, &"db/b2".parse().unwrap(), "back").await.unwrap();
    assert_eq!(volume_image(&pool, "back"), image(&pool, "s2"));

    // Every chunk is locked until about two days from now.
    let chunk = format!("cluster-a/chunks/{}/{}", &m.chunks[3].id[..2], m.chunks[3].id);
    let (code, said) = weed.s3_request("GET", &format!("/{BUCKET}/{chunk}?retention"), &[], "");
    assert_eq!(code, 200, "{said}");
    assert!(said.contains("<Mode>GOVERNANCE</Mode>"), "{said}");
    let until = said.split_once("<RetainUntilDate>").unwrap().1.split_once('T').unwrap().0.to_owned();
    let day = |unix: u64| {
        let id = ferrite_backup::new_id(unix);
        format!("{}-{}-{}", &id[..4], &id[4..6], &id[6..8])
    };
    let now = ferrite_backup::now_unix();
    assert!([day(now + 2 * 86_400 - 60), day(now + 2 * 86_400 + 60)].contains(&until), "{until}");

    // Both backups deleted and pruned at once: the chunks vanish from the target's view...
    ferrite_backup::delete(&target, &"db/b1".parse().unwrap()).await.unwrap();
    ferrite_backup::delete(&target, &"db/b2".parse().unwrap()).await.unwrap();
    let r = ferrite_backup::prune(&target, None, std::time::Duration::ZERO).await.unwrap();
    assert_eq!(r.chunks_deleted, 5, "{r:?}");
    let (ids, hidden) = versions(&weed, &chunk);
    assert!(hidden, "a delete leaves a marker in a versioned bucket");
    // ...but their locked versions stay, and deleting one for good is refused.
    assert_eq!(ids.len(), 1);
    let (code, said) = weed.s3_request("DELETE", &format!("/{BUCKET}/{chunk}?versionId={}", ids[0]), &[], "");
    assert_eq!(code, 403, "a locked version cannot be deleted: {said}");
    let (code, _) = weed.s3_request("GET", &format!("/{BUCKET}/{chunk}?versionId={}", ids[0]), &[], "");
    assert_eq!(code, 200, "the locked version is still readable");
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
}
