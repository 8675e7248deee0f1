//! What the daemon keeps in a target can always be read back: every list it writes is capped on
//! write at what its readers accept, however much the target holds.

#![allow(clippy::cast_possible_truncation)]

use std::time::Duration;

use crate::pool;

use ferrite_backup::{Index, IndexEntry, Sweep, Target, TargetConfig, TargetKind};
use pool::{MIB, backup, new_pool, noise};

async fn dir_target(root: &std::path::Path) -> Target {
    let config = TargetConfig { kind: Some(TargetKind::Dir), path: Some(root.to_owned()), ..TargetConfig::default() };
    Target::open("t", config).await.unwrap()
}

/// Writes `n` chunks no manifest lists, named from `first` on.
fn orphans(root: &std::path::Path, first: u64, n: u64) {
    for i in first..first + n {
        let id = format!("{:016x}{:048x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15), i);
        let dir = root.join("chunks").join(&id[..2]);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(&id), b"x").unwrap();
    }
}

/// More unreferenced chunks than the condemned list holds (200 000): a prune condemns up to
/// the cap, the next carries those and adds none, and a backup reads the list after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_condemned_list_never_outgrows_its_readers() {
    let (dir, pool) = new_pool();
    let root = dir.path().join("target");
    let target = dir_target(&root).await;
    orphans(&root, 0, 210_000);
    // Condemned strictly after they were written (the store's times are whole seconds).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let first = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!((first.chunks_condemned, first.chunks_deleted), (200_000, 0));
    orphans(&root, 210_000, 5_000);
    let second = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
    assert_eq!((second.chunks_condemned, second.chunks_deleted), (200_000, 0), "carried first, none added");
    let list = std::fs::metadata(root.join("gc").join("condemned")).unwrap().len();
    assert!(list < 32 << 20, "the list ({list} bytes) stays under what its readers take");
    // Every backup reads the list first.
    pool.create_volume("v", MIB).unwrap();
    pool.open_volume("v").unwrap().write(0, &noise(3, MIB as usize)).unwrap();
    pool.create_snapshot("v", "s").unwrap();
    backup(&target, &pool, "v", "s", "b").await.unwrap();
}

/// An index update that would pass what its readers take (16 MiB) is refused and changes
/// nothing: the index still reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_past_its_cap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir_target(&dir.path().join("target")).await;
    let entry = |n: u64| IndexEntry {
        id: format!("b{n:06}"),
        snapshot: "s".repeat(100),
        source: None,
        created: n,
        size: 0,
        full: true,
        previous: None,
        chunks: 0,
        bytes: 0,
        uploaded_bytes: 0,
        copied_from: None,
        attempt: None,
    };
    Index::update(&target, "v", |i| {
        i.backups.push(entry(0));
        Ok(true)
    })
    .await
    .unwrap();
    let e = Index::update(&target, "v", |i| {
        i.backups.extend((1..100_000).map(entry));
        Ok(true)
    })
    .await
    .unwrap_err();
    assert!(e.to_string().contains("prune them first"), "{e}");
    assert_eq!(Index::load(&target, "v").await.unwrap().backups.len(), 1);
}
