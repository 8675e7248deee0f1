//! A verify that heals: a chunk found bad is quarantined, the next backup of a volume that still
//! holds its data uploads it again (although the previous backup lists it), and the older backup
//! that lists it restores again.

#![allow(clippy::cast_possible_truncation)]

use crate::pool;

use ferrite_backup::{BackupRef, Target, TargetConfig, TargetKind};
use pool::{MIB, backup, image, new_pool, noise, restore, volume_image};

/// Every file under `dir`, as paths relative to it.
fn files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(files(&e.path()).into_iter().map(|p| std::path::Path::new(&e.file_name()).join(p)));
        } else {
            out.push(e.file_name().into());
        }
    }
    out
}

/// A directory target at `root`, with 1 MiB chunks.
async fn dir_target(root: &std::path::Path) -> Target {
    let config = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(root.to_owned()),
        chunk_size: Some(MIB),
        ..TargetConfig::default()
    };
    Target::open("t", config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_chunk_is_quarantined_and_uploaded_again() {
    let (dir, pool) = new_pool();
    let root = dir.path().join("target");
    let target = dir_target(&root).await;
    pool.create_volume("v", 4 * MIB).unwrap();
    pool.open_volume("v").unwrap().write(0, &noise(7, 4 * MIB as usize)).unwrap();
    pool.create_snapshot("v", "s1").unwrap();
    let b1 = backup(&target, &pool, "v", "s1", "b1").await.unwrap();

    // The store damages one chunk.
    let bad = b1.chunk_list(&target).await.unwrap()[2].id.clone();
    let chunk = root.join("chunks").join(&bad[..2]).join(&bad);
    let mut data = std::fs::read(&chunk).unwrap();
    data[100] ^= 1;
    std::fs::write(&chunk, data).unwrap();
    let b1_ref = BackupRef { volume: "v".into(), id: "b1".into() };
    let report = ferrite_backup::verify(&target, std::slice::from_ref(&b1_ref), None, &|_| {}).await.unwrap();
    assert_eq!(report.bad.iter().map(|b| b.0.as_str()).collect::<Vec<_>>(), [bad.as_str()]);
    assert!(!chunk.exists(), "the bad chunk left chunks/");
    assert!(root.join("quarantine").join(&bad).exists(), "it is kept in quarantine/: {:?}", files(&root));

    // Nothing changed in the volume, yet the next backup reads and uploads that chunk again.
    pool.create_snapshot("v", "s2").unwrap();
    let b2 = backup(&target, &pool, "v", "s2", "b2").await.unwrap();
    assert!(!b2.full, "{b2:?}");
    assert_eq!((b2.read_bytes, b2.new_chunks), (MIB, 1), "only the quarantined chunk: {b2:?}");
    assert!(chunk.exists());
    restore(&target, &pool, &b1_ref, "r1").await.unwrap();
    assert!(volume_image(&pool, "r1") == image(&pool, "s1"), "b1 restores again");

    // A verify that finds it good takes it out of quarantine: the backup after reads nothing.
    let all = [b1_ref, BackupRef { volume: "v".into(), id: "b2".into() }];
    assert!(ferrite_backup::verify(&target, &all, None, &|_| {}).await.unwrap().bad.is_empty());
    pool.create_snapshot("v", "s3").unwrap();
    let b3 = backup(&target, &pool, "v", "s3", "b3").await.unwrap();
    assert_eq!((b3.read_bytes, b3.new_chunks), (0, 0), "{b3:?}");
}

/// A chunk that reads bad once (a store's passing fault) and good a moment later is not moved:
/// it stays in chunks/, out of quarantine, and the next backup reads nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_misread_moves_nothing() {
    let (dir, pool) = new_pool();
    let root = dir.path().join("target");
    let target = dir_target(&root).await;
    pool.create_volume("v", MIB).unwrap();
    pool.open_volume("v").unwrap().write(0, &noise(9, MIB as usize)).unwrap();
    pool.create_snapshot("v", "s1").unwrap();
    let b1 = backup(&target, &pool, "v", "s1", "b1").await.unwrap();
    let id = b1.chunk_list(&target).await.unwrap()[0].id.clone();
    let chunk = root.join("chunks").join(&id[..2]).join(&id);
    let good = std::fs::read(&chunk).unwrap();
    let mut damaged = good.clone();
    damaged[100] ^= 1;
    std::fs::write(&chunk, &damaged).unwrap();

    // The verify reads the index, the manifest and its segment, then checks the segment and the
    // chunk (bad) at once; while it pauses before reading the chunk again, the store answers
    // truly again.
    let gets = || target.counters.gets.load(std::sync::atomic::Ordering::Relaxed);
    let before = gets();
    let verifying = {
        let target = target.clone();
        tokio::spawn(async move {
            let b1 = BackupRef { volume: "v".into(), id: "b1".into() };
            ferrite_backup::verify(&target, &[b1], None, &|_| {}).await
        })
    };
    while gets() < before + 5 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    std::fs::write(&chunk, &good).unwrap();
    let report = verifying.await.unwrap().unwrap();
    assert!(report.bad.is_empty() && report.quarantined == 0, "{report:?}");
    // The index, the manifest, the segment twice, the chunk twice, the quarantine list.
    assert_eq!(gets(), before + 7, "the chunk was read twice");
    assert!(chunk.exists() && !root.join("quarantine").exists(), "{:?}", files(&root));
    pool.create_snapshot("v", "s2").unwrap();
    let b2 = backup(&target, &pool, "v", "s2", "b2").await.unwrap();
    assert_eq!((b2.read_bytes, b2.new_chunks), (0, 0), "{b2:?}");
}
