//! Backups against a real object store (SeaweedFS's S3 gateway on loopback) and a directory:
//! round trips, incrementals, dedup, encryption, resume after the store went down, corruption,
//! credentials, newer formats, delete, prune and retention.

#![allow(clippy::cast_possible_truncation)]

use crate::common;
use crate::pool;

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::Weed;
use ferrite_backup::{BackupRef, CreateOptions, Error, Manifest, Retention, Sweep, Target, TargetConfig, TargetKind};
use ferrite_engine::Image;
use object_store::{ObjectStore, ObjectStoreExt};
use pool::*;

fn s3(weed: &Weed, creds: Option<(&str, &str)>, dir: &std::path::Path) -> TargetConfig {
    let credentials = creds.map(|(id, secret)| {
        let d = dir.join(format!("creds-{id}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("access-key-id"), id).unwrap();
        std::fs::write(d.join("secret-access-key"), format!("{secret}\n")).unwrap();
        d
    });
    TargetConfig {
        kind: Some(TargetKind::S3),
        endpoint: Some(weed.endpoint()),
        bucket: Some("ferrite-test".into()),
        prefix: Some("cluster-a".into()),
        credentials,
        chunk_size: Some(MIB),
        concurrency: Some(4),
        retries: Some(1),
        ..TargetConfig::default()
    }
}

/// A raw client on the same bucket and prefix, to look at and tamper with what is stored.
fn raw(weed: &Weed, creds: Option<(&str, &str)>) -> object_store::prefix::PrefixStore<object_store::aws::AmazonS3> {
    let mut b = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(weed.endpoint())
        .with_bucket_name("ferrite-test")
        .with_region("us-east-1")
        .with_allow_http(true);
    b = match creds {
        Some((id, secret)) => b.with_access_key_id(id).with_secret_access_key(secret),
        None => b.with_skip_signature(true),
    };
    object_store::prefix::PrefixStore::new(b.build().unwrap(), "cluster-a")
}

/// Plain S3 target: a full backup, an incremental that uploads only the touched chunks, a
/// clone that uploads nothing (dedup), zero ranges that cost nothing, byte-identical restores,
/// and O(1) LISTs (none at all) for a backup and a restore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_dedup_and_restore_on_s3() {
    let Some(weed) = Weed::start(false) else { return };
    let (dir, pool) = new_pool();
    let target = Target::open("offsite", s3(&weed, None, dir.path())).await.unwrap();
    pool.create_volume("db", SIZE).unwrap();
    let v = pool.open_volume("db").unwrap();
    // 40 MiB of data, then 8 MiB never written (zeros: no chunk).
    v.write(0, &noise(1, 40 * MIB as usize)).unwrap();
    pool.create_snapshot("db", "s1").unwrap();
    let before = target.counters.snapshot();
    let full = backup(&target, &pool, "db", "s1", "b1").await.unwrap();
    let after = target.counters.snapshot();
    assert!(full.full && full.previous.is_none());
    assert_eq!(full.chunk_count(), 40, "the 8 zero MiB have no chunks");
    assert_eq!(full.new_chunks, 40);
    assert_eq!(after[5] - before[5], 0, "a backup lists nothing");

    // 1% of the blocks rewritten at random: the incremental reads and uploads only their chunks.
    let mut touched = std::collections::BTreeSet::new();
    for n in 0..(SIZE / 4096 / 100) {
        let off = (n * 7919 * 4096) % (40 * MIB);
        v.write(off, &noise(100 + n, 4096)).unwrap();
        touched.insert(off / MIB);
    }
    pool.create_snapshot("db", "s2").unwrap();
    let before = target.counters.snapshot();
    let inc = backup(&target, &pool, "db", "s2", "b2").await.unwrap();
    let after = target.counters.snapshot();
    assert!(!inc.full);
    assert_eq!(inc.previous.as_deref(), Some("b1"));
    assert_eq!(inc.read_bytes, touched.len() as u64 * MIB, "only the touched chunks are read");
    assert_eq!(inc.new_chunks, touched.len() as u64);
    let uploaded = after[1] - before[1];
    assert!(
        uploaded as f64 <= 1.2 * (touched.len() as u64 * MIB) as f64,
        "uploaded {uploaded} for {} chunks",
        touched.len()
    );
    assert_eq!(after[5] - before[5], 0, "an incremental lists nothing");

    // A clone backed up after its parent: every chunk is already there.
    pool.clone_volume(Image::Snapshot("s2"), "db-clone").unwrap();
    pool.create_snapshot("db-clone", "c1").unwrap();
    let clone = backup(&target, &pool, "db-clone", "c1", "b1").await.unwrap();
    assert_eq!((clone.new_chunks, clone.uploaded_bytes), (0, 0), "a clone's backup uploads nothing new");

    // Restores are byte-identical, and cost no LIST.
    let before = target.counters.snapshot();
    restore(&target, &pool, &"db/b1".parse().unwrap(), "r1").await.unwrap();
    restore(&target, &pool, &"db/b2".parse().unwrap(), "r2").await.unwrap();
    assert_eq!(target.counters.snapshot()[5] - before[5], 0, "a restore lists nothing");
    assert!(volume_image(&pool, "r1") == image(&pool, "s1"), "b1 restores s1");
    assert!(volume_image(&pool, "r2") == image(&pool, "s2"), "b2 restores s2");

    // Another daemon (a new pool) with only the target's configuration restores it too.
    let (_dir2, pool2) = new_pool();
    let target2 = Target::open("offsite", s3(&weed, None, dir.path())).await.unwrap();
    restore(&target2, &pool2, &"db/b2".parse().unwrap(), "db").await.unwrap();
    assert!(volume_image(&pool2, "db") == image(&pool, "s2"));
    let index = ferrite_backup::Index::load(&target2, "db").await.unwrap();
    assert_eq!(index.backups.iter().map(|b| b.id.as_str()).collect::<Vec<_>>(), ["b1", "b2"]);
    assert!(matches!(backup(&target, &pool, "db", "s2", "b2").await, Err(Error::Conflict(_))), "ids are unique");
}

/// An encrypted target: nothing readable in the store, restores on another pool with the key,
/// refusals for a wrong key, a missing key, wrong credentials and a user that may not write;
/// an encrypted volume is refused by a target without a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_target_with_credentials() {
    let Some(weed) = Weed::start(true) else { return };
    let (dir, pool) = new_pool();
    let key = dir.path().join("backup.key");
    std::fs::write(&key, format!("{}\n", "ab".repeat(32))).unwrap();
    let config =
        TargetConfig { key_file: Some(key.clone()), ..s3(&weed, Some(("ferrite", "ferrite-secret")), dir.path()) };
    let target = Target::open("vault", config.clone()).await.unwrap();
    let kek = ferrite_crypt::Kek::new("k1", [0x5a; 32]).unwrap();
    pool.create_encrypted_volume("secret", 8 * MIB, &kek).unwrap();
    let marker: Vec<u8> = b"FERRITE-PLAINTEXT-MARKER-".iter().cycle().take(4096).copied().collect();
    let v = pool.open_volume("secret").unwrap();
    for n in 0..8 {
        v.write(n * MIB, &marker).unwrap();
    }
    pool.create_snapshot("secret", "e1").unwrap();
    let m = backup(&target, &pool, "secret", "e1", "x1").await.unwrap();
    assert!(m.encrypted_volume);

    // Nothing in the store holds the plaintext (or the volume's name in a manifest).
    let store = raw(&weed, Some(("ferrite", "ferrite-secret")));
    let objects: Vec<_> = futures_util::TryStreamExt::try_collect(store.list(None)).await.unwrap();
    assert!(objects.len() >= 3);
    for o in &objects {
        let data = store.get(&o.location).await.unwrap().bytes().await.unwrap();
        assert!(!data.windows(25).any(|w| w == &marker[..25]), "{} holds plaintext", o.location);
        if o.location.as_ref().contains("/backups/") {
            assert!(!data.windows(6).any(|w| w == b"secret"), "a manifest is sealed");
        }
    }

    // Another daemon with the key restores it.
    let (_d2, pool2) = new_pool();
    let t2 = Target::open("vault", config.clone()).await.unwrap();
    restore(&t2, &pool2, &"secret/x1".parse().unwrap(), "back").await.unwrap();
    assert!(volume_image(&pool2, "back") == image(&pool, "e1"));

    // The refusals, each saying what is wrong.
    let wrong = dir.path().join("wrong.key");
    std::fs::write(&wrong, [7u8; 32]).unwrap();
    let e = Target::open("vault", TargetConfig { key_file: Some(wrong), ..config.clone() }).await.unwrap_err();
    assert!(e.to_string().contains("not the key this target was created with"), "{e}");
    let e = Target::open("vault", TargetConfig { key_file: None, ..config.clone() }).await.unwrap_err();
    assert!(e.to_string().contains("encrypted: configure its key-file"), "{e}");
    let bad = s3(&weed, Some(("ferrite", "not-the-secret")), dir.path());
    let e = Target::open("vault", TargetConfig { key_file: Some(key.clone()), ..bad }).await.unwrap_err();
    assert!(matches!(e, Error::Store { .. }), "{e}");
    assert!(e.to_string().contains("vault"), "{e}");
    // The marker as an earlier build wrote it: a read-only credential opens it as it is.
    let store = raw(&weed, Some(("ferrite", "ferrite-secret")));
    let marker = object_store::path::Path::from("ferrite-backup.json");
    let mut old: serde_json::Value =
        serde_json::from_slice(&store.get(&marker).await.unwrap().bytes().await.unwrap()).unwrap();
    assert_eq!(old["format"], 3, "{old}");
    old["format"] = 1.into();
    old.as_object_mut().unwrap().remove("grace-s");
    store.put(&marker, serde_json::to_vec(&old).unwrap().into()).await.unwrap();
    let reader = s3(&weed, Some(("reader", "reader-secret")), dir.path());
    let ro = Target::open("vault", TargetConfig { key_file: Some(key.clone()), ..reader }).await.unwrap();
    let kept: serde_json::Value =
        serde_json::from_slice(&store.get(&marker).await.unwrap().bytes().await.unwrap()).unwrap();
    assert_eq!(kept["format"], 1, "a reader writes nothing");
    pool.create_snapshot("secret", "e2").unwrap();
    v.write(0, &noise(9, 4096)).unwrap();
    pool.create_snapshot("secret", "e3").unwrap();
    let e = backup(&ro, &pool, "secret", "e3", "x2").await.unwrap_err();
    assert!(matches!(e, Error::Store { op: "PUT", .. }), "a refused PUT fails the backup: {e}");
    let index = ferrite_backup::Index::load(&target, "secret").await.unwrap();
    assert_eq!(index.backups.len(), 1, "a failed backup is not listed");

    // A target without a key refuses an encrypted volume.
    let plain =
        TargetConfig { prefix: Some("plain".into()), ..s3(&weed, Some(("ferrite", "ferrite-secret")), dir.path()) };
    let plain = Target::open("plain", plain).await.unwrap();
    let e = backup(&plain, &pool, "secret", "e1", "p1").await.unwrap_err();
    assert!(e.to_string().contains("would hold plaintext"), "{e}");
}

/// The store goes down in the middle of a backup: the backup fails with the store's error,
/// and run again once the store is back it uploads only what was missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_backup_resumes() {
    let Some(mut weed) = Weed::start(false) else { return };
    let (dir, pool) = new_pool();
    // 4 MiB/s: the 32 chunks take ~8 s, and the store is killed after ~10 of them.
    let config = TargetConfig { bandwidth: Some(4 * MIB), concurrency: Some(2), ..s3(&weed, None, dir.path()) };
    let target = Target::open("offsite", config.clone()).await.unwrap();
    pool.create_volume("vol", 32 * MIB).unwrap();
    pool.open_volume("vol").unwrap().write(0, &noise(3, 32 * MIB as usize)).unwrap();
    pool.create_snapshot("vol", "s").unwrap();
    let opts = CreateOptions { volume: "vol".into(), snapshot: "s".into(), id: "r1".into(), full: false };
    let (tx, rx) = std::sync::mpsc::channel();
    let sent = std::sync::atomic::AtomicBool::new(false);
    let watch = |p: &ferrite_backup::Progress| {
        if p.chunks_done >= 10 && !sent.swap(true, Relaxed) {
            tx.send(()).unwrap();
        }
    };
    let run = ferrite_backup::create(&target, &pool, &opts, &watch);
    let killer = async {
        tokio::task::spawn_blocking(move || rx.recv()).await.unwrap().unwrap();
        weed.stop();
        weed
    };
    let (result, mut weed) = tokio::join!(run, killer);
    let e = result.unwrap_err();
    assert!(matches!(e, Error::Store { .. }), "the store's failure is the error: {e}");
    let uploaded_before = target.counters.put_bytes.load(Relaxed);
    assert!((10 * MIB..30 * MIB).contains(&uploaded_before), "{uploaded_before}");

    weed.resume();
    // Its S3 gateway answers before its volume server is registered again (GETs of what it
    // held fail with 500 meanwhile): the store is back once the target's marker reads.
    let config = TargetConfig { bandwidth: None, retries: None, ..config };
    let back = std::time::Instant::now();
    let target = loop {
        match Target::open("offsite", config.clone()).await {
            Ok(t) => break t,
            Err(e) if back.elapsed() < Duration::from_secs(60) => {
                eprintln!("the store is not back yet: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("the store did not come back: {e}"),
        }
    };
    let m = backup(&target, &pool, "vol", "s", "r1").await.unwrap();
    let again = target.counters.put_bytes.load(Relaxed);
    assert!(again + uploaded_before <= 33 * MIB, "the rerun sent {again} more after {uploaded_before}: nothing twice");
    assert_eq!(m.chunk_count(), 32);
    restore(&target, &pool, &"vol/r1".parse().unwrap(), "back").await.unwrap();
    assert!(volume_image(&pool, "back") == image(&pool, "s"));
}

/// A chunk damaged in the store: verify names it and the backups that list it, a restore fails
/// naming it. A manifest from a newer format is refused, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corruption_and_newer_formats_are_named() {
    let Some(weed) = Weed::start(false) else { return };
    let (dir, pool) = new_pool();
    let target = Target::open("offsite", s3(&weed, None, dir.path())).await.unwrap();
    pool.create_volume("v", 8 * MIB).unwrap();
    pool.open_volume("v").unwrap().write(0, &noise(5, 8 * MIB as usize)).unwrap();
    pool.create_snapshot("v", "s").unwrap();
    let m = backup(&target, &pool, "v", "s", "b").await.unwrap();
    let b: BackupRef = "v/b".parse().unwrap();
    let clean = ferrite_backup::verify(&target, std::slice::from_ref(&b), None, &|_| {}).await.unwrap();
    assert_eq!((clean.chunks_checked, clean.bad.len()), (8 + 1, 0), "8 chunks and the segment");

    let store = raw(&weed, None);
    let victim = &m.chunk_list(&target).await.unwrap()[3].id.clone();
    let path = object_store::path::Path::from(format!("chunks/{}/{victim}", &victim[..2]));
    let mut data = store.get(&path).await.unwrap().bytes().await.unwrap().to_vec();
    let mid = data.len() / 2;
    data[mid] ^= 0x40;
    store.put(&path, data.into()).await.unwrap();
    let report = ferrite_backup::verify(&target, std::slice::from_ref(&b), None, &|_| {}).await.unwrap();
    assert_eq!(report.bad.len(), 1);
    assert_eq!(&report.bad[0].0, victim);
    assert_eq!(report.bad[0].2, vec!["v/b".to_string()]);
    let e = restore(&target, &pool, &b, "r").await.unwrap_err();
    assert!(e.to_string().contains(victim.as_str()) && e.to_string().contains("corrupt"), "{e}");
    let sample = ferrite_backup::verify(&target, std::slice::from_ref(&b), Some(0.25), &|_| {}).await.unwrap();
    assert!(sample.chunks_checked < 8, "a sample checks fewer: {}", sample.chunks_checked);

    // An instant restore serves the good chunks (fetched on demand before the copy gets there;
    // a write lands on top), fails I/O to the damaged one naming it, and its copy stops there.
    pool.create_volume("fast", m.size).unwrap();
    // The record as the daemon keeps it: the bitmap (hex) written whole, positions added since.
    let saved = Arc::new(std::sync::Mutex::new(String::new()));
    let save: ferrite_backup::Save = {
        let saved = Arc::clone(&saved);
        Box::new(move |done| {
            let mut record = saved.lock().unwrap();
            match done {
                ferrite_backup::Saved::All(hex) => hex.clone_into(&mut record),
                ferrite_backup::Saved::Done(positions) => {
                    let mut bits: Vec<u8> = (0..record.len() / 2)
                        .map(|i| u8::from_str_radix(&record[2 * i..2 * i + 2], 16).unwrap())
                        .collect();
                    positions.iter().for_each(|&p| bits[p / 8] |= 1 << (p % 8));
                    *record = bits.iter().map(|b| format!("{b:02x}")).collect();
                }
            }
            Ok(())
        })
    };
    let writer = pool.open_volume("fast").unwrap().past_read_only();
    let rt = tokio::runtime::Handle::current();
    let chunks = m.chunk_list(&target).await.unwrap();
    let f = ferrite_backup::Filling::new(target.clone(), m.clone(), chunks, writer, None, save, rt).unwrap();
    pool.set_fill("fast", Some(f.clone())).unwrap();
    assert_eq!(*saved.lock().unwrap(), "00", "recorded before it serves, nothing done");
    let v = pool.open_volume("fast").unwrap();
    let (read, damaged) = tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; 8192];
        v.read(5 * MIB + 4096, &mut buf).unwrap();
        v.write(6 * MIB, &[9u8; 4096]).unwrap();
        (buf, v.read(3 * MIB, &mut [0u8; 4096]).unwrap_err())
    })
    .await
    .unwrap();
    assert_eq!(read, noise(5, 8 * MIB as usize)[(5 * MIB + 4096) as usize..][..8192]);
    assert!(damaged.to_string().contains(victim.as_str()), "{damaged}");
    assert_eq!(f.counts(), (2, 8, 2), "chunks 5 and 6 fetched on demand");
    assert_eq!(*saved.lock().unwrap(), "60", "chunks 5 and 6 recorded done");
    let e = f.run(&|_| {}).await.unwrap_err();
    assert!(e.to_string().contains(victim.as_str()), "{e}");
    assert_eq!(f.counts().0, 7, "every chunk but the damaged one");
    let mut want = noise(5, 8 * MIB as usize);
    want[6 * MIB as usize..][..4096].fill(9);
    pool.set_fill("fast", None).unwrap();
    let mut got = volume_image(&pool, "fast");
    got[3 * MIB as usize..4 * MIB as usize].copy_from_slice(&want[3 * MIB as usize..4 * MIB as usize]);
    assert!(got == want, "the restored chunks and the write differ");

    // An index written by a newer Ferrite (plain target: the envelope holds JSON), and a
    // manifest it does not list (no backup: not found).
    let json = serde_json::json!({"format": 3, "volume": "w", "backups": []}).to_string();
    let newer = [b"FRBK".as_slice(), &[1, 3, 0], json.as_bytes()].concat();
    store.put(&object_store::path::Path::from("volumes/w/index"), newer.into()).await.unwrap();
    let unlisted = [b"FRBK".as_slice(), &[1, 2, 0], br#"{"format":1}"#].concat();
    store.put(&object_store::path::Path::from("volumes/v/backups/n"), unlisted.into()).await.unwrap();
    let e = Manifest::load(&target, &"v/n".parse().unwrap()).await.unwrap_err();
    assert!(e.is_not_found(), "{e}");
    let e = Manifest::load(&target, &"w/n".parse().unwrap()).await.unwrap_err();
    assert!(matches!(e, Error::Newer { found: 3, .. }) && e.to_string().contains("upgrade"), "{e}");
}

/// Delete and prune on a directory target: what only deleted backups listed goes (at once with
/// no grace; after the grace otherwise, unless a backup uploaded it again), the rest restores;
/// retention keeps the newest N. The directory is private.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_prune_and_retention_on_a_directory() {
    let (dir, pool) = new_pool();
    let config = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(dir.path().join("nfs/backups")),
        chunk_size: Some(MIB),
        ..TargetConfig::default()
    };
    let target = Target::open("nfs", config).await.unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(std::fs::metadata(dir.path().join("nfs/backups")).unwrap().permissions().mode() & 0o777, 0o700);
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let chunks = |t: &str| walk(&dir.path().join("nfs/backups/chunks")).into_iter().filter(|p| p.contains(t)).count();
    let mut ids = Vec::new();
    for n in 0..4u64 {
        // Each backup has one chunk of its own (chunk 0) and shares chunks 1-3.
        v.write(0, &noise(20 + 2 * n, MIB as usize)).unwrap();
        if n == 0 {
            v.write(MIB, &noise(99, 3 * MIB as usize)).unwrap();
        }
        pool.create_snapshot("v", &format!("s{n}")).unwrap();
        let m = backup(&target, &pool, "v", &format!("s{n}"), &format!("b{n}")).await.unwrap();
        ids.push(m.chunk_list(&target).await.unwrap()[0].id.clone());
    }
    assert_eq!(chunks(""), 4 + 3 + 4, "and a segment for each backup");

    // Delete b0; a prune with a grace only condemns its chunk and its segment.
    ferrite_backup::delete(&target, &"v/b0".parse().unwrap()).await.unwrap();
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!((r.chunks_deleted, r.chunks_condemned, r.manifests), (0, 2, 3));
    assert_eq!(chunks(&ids[0]), 1);
    // With no grace, unreferenced chunks go at once.
    let r = ferrite_backup::prune(&target, None, pool::no_writers()).await.unwrap();
    assert_eq!((r.chunks_deleted, r.chunks_condemned), (2, 0));
    assert_eq!(chunks(&ids[0]), 0);

    // Retention: keep the last 2; b1's own chunk goes with a grace-free prune.
    let keep = Retention { keep_last: 2, ..Retention::default() };
    let r = ferrite_backup::prune(&target, Some(&keep), pool::no_writers()).await.unwrap();
    assert_eq!(r.backups_deleted, ["v/b1"]);
    assert_eq!(chunks(&ids[1]), 0);
    assert!(matches!(ferrite_backup::delete(&target, &"v/b1".parse().unwrap()).await, Err(Error::NotFound(_))));
    for b in ["v/b2", "v/b3"] {
        let name = b.replace('/', "-");
        restore(&target, &pool, &b.parse().unwrap(), &name).await.unwrap();
        assert!(volume_image(&pool, &name) == image(&pool, &format!("s{}", &b[3..])), "{b}");
    }
}

/// A condemned chunk that a backup uploads again before the grace ends is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_condemned_chunk_uploaded_again_survives_the_sweep() {
    let (dir, pool) = new_pool();
    let config = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(dir.path().join("t")),
        chunk_size: Some(MIB),
        grace_s: Some(2),
        ..TargetConfig::default()
    };
    let target = Target::open("t", config).await.unwrap();
    pool.create_volume("v", MIB).unwrap();
    let data = noise(42, MIB as usize);
    pool.open_volume("v").unwrap().write(0, &data).unwrap();
    pool.create_snapshot("v", "s0").unwrap();
    backup(&target, &pool, "v", "s0", "b0").await.unwrap();
    ferrite_backup::delete(&target, &"v/b0".parse().unwrap()).await.unwrap();
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!(r.chunks_condemned, 2, "its chunk and its segment");
    // Another volume with the same contents is backed up after the condemnation: the chunk is
    // uploaded again even though it is there.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    pool.create_volume("w", MIB).unwrap();
    pool.open_volume("w").unwrap().write(0, &data).unwrap();
    pool.create_snapshot("w", "t0").unwrap();
    let m = backup(&target, &pool, "w", "t0", "c0").await.unwrap();
    assert_eq!(m.new_chunks, 1, "a condemned chunk is uploaded again");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let r = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!(r.chunks_deleted, 0);
    restore(&target, &pool, &"w/c0".parse().unwrap(), "back").await.unwrap();
    assert!(volume_image(&pool, "back") == data);
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path().display().to_string());
        }
    }
    out
}

/// A prune's DELETE of a condemned chunk is conditional on the version its HEAD saw: SeaweedFS
/// honours If-Match (signed, as a store with authentication checks it), so a chunk a backup
/// uploaded again in between stays, and the version seen goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_is_deleted_only_as_it_was_seen() {
    let Some(weed) = Weed::start(true) else { return };
    let dir = tempfile::tempdir().unwrap();
    let target = Target::open("t", s3(&weed, Some(("ferrite", "ferrite-secret")), dir.path())).await.unwrap();
    let store = raw(&weed, Some(("ferrite", "ferrite-secret")));
    let path = "chunks/ab/ab00";
    store.put(&path.into(), b"first".to_vec().into()).await.unwrap();
    let seen = target.head(path).await.unwrap().unwrap();
    store.put(&path.into(), b"again".to_vec().into()).await.unwrap();
    assert!(!target.delete_if(path, &seen).await.unwrap(), "another version is there");
    assert_eq!(store.get(&path.into()).await.unwrap().bytes().await.unwrap().as_ref(), b"again");
    let seen = target.head(path).await.unwrap().unwrap();
    assert!(target.delete_if(path, &seen).await.unwrap());
    assert!(target.head(path).await.unwrap().is_none());
    assert!(target.delete_if(path, &seen).await.unwrap(), "gone already is gone");
}
