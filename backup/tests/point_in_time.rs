//! A backup restores the point in time it names: an incremental builds only on the very snapshot
//! its predecessor read (by identity: pool and snapshot id), never on another one that happens
//! to carry the same name, here or on another pool.

#![allow(clippy::cast_possible_truncation)]

use crate::pool;

use ferrite_backup::{Target, TargetConfig, TargetKind};
use pool::{MIB, backup, image, new_pool, restore, volume_image};

async fn dir_target(dir: &std::path::Path) -> Target {
    let config = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(dir.join("target")),
        chunk_size: Some(MIB),
        ..TargetConfig::default()
    };
    Target::open("offsite", config).await.unwrap()
}

fn fill(pool: &ferrite_engine::Pool, volume: &str, byte: u8) {
    pool.open_volume(volume).unwrap().write(0, &vec![byte; 4 * MIB as usize]).unwrap();
}

/// Snapshot `nightly` backed up, deleted, the volume rewritten, `nightly` taken again and backed
/// up: the second backup holds the second `nightly`, and says why it read everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_name_made_again_is_read_whole() {
    let (dir, pool) = new_pool();
    let target = dir_target(dir.path()).await;
    pool.create_volume("db", 8 * MIB).unwrap();
    fill(&pool, "db", 17);
    pool.create_snapshot("db", "nightly").unwrap();
    let first = backup(&target, &pool, "db", "nightly", "b1").await.unwrap();
    assert!(first.full && first.full_reason.is_none(), "the first backup has nothing to build on");
    let source = first.source.clone().expect("the snapshot's identity is recorded");
    assert_eq!(source.pool, pool.uuid().to_string());

    pool.delete_snapshot("nightly").unwrap();
    fill(&pool, "db", 34);
    pool.create_snapshot("db", "nightly").unwrap();
    let second = backup(&target, &pool, "db", "nightly", "b2").await.unwrap();
    assert!(second.full, "{second:?}");
    assert!(second.full_reason.as_deref().is_some_and(|r| r.contains("is gone")), "{:?}", second.full_reason);
    assert_ne!(second.source.as_ref().unwrap().id, source.id, "another snapshot, whatever its name");
    assert_eq!(second.created, pool.snapshot_info("nightly").unwrap().created_unix, "its time is the snapshot's");

    restore(&target, &pool, &"db/b2".parse().unwrap(), "r2").await.unwrap();
    assert!(volume_image(&pool, "r2") == image(&pool, "nightly"), "b2 restores the second nightly");
    restore(&target, &pool, &"db/b1".parse().unwrap(), "r1").await.unwrap();
    assert!(volume_image(&pool, "r1").iter().take(4 * MIB as usize).all(|&b| b == 17), "b1 still holds the first");

    // An incremental on the same snapshot's successor still builds on it.
    fill(&pool, "db", 51);
    pool.create_snapshot("db", "later").unwrap();
    let third = backup(&target, &pool, "db", "later", "b3").await.unwrap();
    assert!(!third.full && third.previous.as_deref() == Some("b2"), "{third:?}");
    restore(&target, &pool, &"db/b3".parse().unwrap(), "r3").await.unwrap();
    assert!(volume_image(&pool, "r3") == image(&pool, "later"));
}

/// Two daemons whose volumes and snapshots have the same names share a target: neither builds on
/// the other's backup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_names_on_another_pool_are_not_a_base() {
    let (dir, a) = new_pool();
    let (_dir_b, b) = new_pool();
    let target = dir_target(dir.path()).await;
    for (pool, byte) in [(&a, 68), (&b, 85)] {
        pool.create_volume("db", 8 * MIB).unwrap();
        fill(pool, "db", byte);
        pool.create_snapshot("db", "s").unwrap();
    }
    backup(&target, &a, "db", "s", "from-a").await.unwrap();
    let from_b = backup(&target, &b, "db", "s", "from-b").await.unwrap();
    assert!(from_b.full, "{from_b:?}");
    assert!(from_b.full_reason.as_deref().is_some_and(|r| r.contains("another pool")), "{:?}", from_b.full_reason);
    restore(&target, &a, &"db/from-b".parse().unwrap(), "r").await.unwrap();
    assert!(volume_image(&a, "r") == image(&b, "s"), "from-b holds b's data");
}

/// Two nodes started from one copied data directory (a machine image: same pool uuid, same
/// snapshot ids to come) each write their own bytes to `db` and back it up to one target: the
/// second's backup does not build on the first's (whose snapshot has its id on this pool too),
/// reads everything and restores its own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_copied_from_one_image_is_not_a_base() {
    let dir = tempfile::tempdir().unwrap();
    let opts = || ferrite_engine::PoolOptions {
        segment_size: MIB,
        reserve_segments: 2,
        background_cleaner: false,
        ..ferrite_engine::PoolOptions::default()
    };
    let image_dir = dir.path().join("image");
    std::fs::create_dir(&image_dir).unwrap();
    let made =
        ferrite_engine::Pool::create(&image_dir.join("pool"), &image_dir.join("meta"), 64 * MIB, opts()).unwrap();
    made.create_volume("db", 8 * MIB).unwrap();
    drop(made);
    let node = |name: &str| {
        let to = dir.path().join(name);
        let copied = std::process::Command::new("cp").arg("-a").arg(&image_dir).arg(&to).status().unwrap();
        assert!(copied.success());
        ferrite_engine::Pool::open(&to.join("pool"), &to.join("meta"), opts()).unwrap()
    };
    let (a, b) = (node("a"), node("b"));
    assert_eq!(a.uuid(), b.uuid(), "one image, one uuid");
    let target = dir_target(dir.path()).await;
    fill(&a, "db", 102);
    a.create_snapshot("db", "s").unwrap();
    fill(&b, "db", 119);
    b.create_snapshot("db", "s").unwrap();
    assert_eq!(a.snapshot_info("s").unwrap().id, b.snapshot_info("s").unwrap().id, "the same ids");

    backup(&target, &a, "db", "s", "from-a").await.unwrap();
    let from_b = backup(&target, &b, "db", "s", "from-b").await.unwrap();
    assert!(from_b.full && from_b.previous.is_none(), "{from_b:?}");
    assert!(from_b.full_reason.as_deref().is_some_and(|r| r.contains("copied from the same image")), "{from_b:?}");
    assert_eq!(from_b.read_bytes, 4 * MIB, "it read what b wrote");
    restore(&target, &a, &"db/from-b".parse().unwrap(), "r").await.unwrap();
    assert!(volume_image(&a, "r") == image(&b, "s"), "from-b holds b's bytes");
}
