//! `copy`: a backup copied to a second target restores there; only what the second target lacks
//! travels; under another key its chunks are sealed and named anew.

#![allow(clippy::cast_possible_truncation)]

use crate::pool;

use ferrite_backup::{BackupRef, Error, Target, TargetConfig, TargetKind};
use pool::{MIB, backup, image, new_pool, noise, restore, volume_image};

async fn target(dir: &std::path::Path, name: &str, key: Option<u8>, chunk: u64) -> Target {
    let key_file = key.map(|k| {
        let path = dir.join(format!("{name}.key"));
        std::fs::write(&path, [k; 32]).unwrap();
        path
    });
    let config = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(dir.join(name)),
        chunk_size: Some(chunk),
        key_file,
        ..TargetConfig::default()
    };
    Target::open(name, config).await.unwrap()
}

fn chunk_names(root: &std::path::Path) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for d in std::fs::read_dir(root.join("chunks")).unwrap().flatten() {
        out.extend(std::fs::read_dir(d.path()).unwrap().flatten().map(|f| f.file_name().into_string().unwrap()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_sends_what_the_other_target_lacks() {
    let (dir, pool) = new_pool();
    let (a, b, c) = (
        target(dir.path(), "a", Some(1), MIB).await,
        target(dir.path(), "b", Some(1), MIB).await,
        target(dir.path(), "c", Some(2), MIB).await,
    );
    pool.create_volume("v", 8 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &noise(3, 6 * MIB as usize)).unwrap();
    pool.create_snapshot("v", "s1").unwrap();
    backup(&a, &pool, "v", "s1", "b1").await.unwrap();
    let b1 = BackupRef { volume: "v".into(), id: "b1".into() };

    // The same key: sealed chunks travel as they are, under the same names.
    let first = ferrite_backup::copy(&a, &b, &b1, &|_| {}).await.unwrap();
    assert_eq!((first.chunk_count(), first.new_chunks), (6, 6));
    assert_eq!(chunk_names(&dir.path().join("a")), chunk_names(&dir.path().join("b")));
    restore(&b, &pool, &b1, "from-b").await.unwrap();
    assert!(volume_image(&pool, "from-b") == image(&pool, "s1"));
    assert!(matches!(ferrite_backup::copy(&a, &b, &b1, &|_| {}).await, Err(Error::Conflict(_))), "once");

    // An incremental copied after it: one chunk travels.
    v.write(2 * MIB, &noise(4, 4096)).unwrap();
    pool.create_snapshot("v", "s2").unwrap();
    backup(&a, &pool, "v", "s2", "b2").await.unwrap();
    let b2 = BackupRef { volume: "v".into(), id: "b2".into() };
    let second = ferrite_backup::copy(&a, &b, &b2, &|_| {}).await.unwrap();
    assert_eq!((second.chunk_count(), second.new_chunks), (6, 1), "{second:?}");
    restore(&b, &pool, &b2, "from-b2").await.unwrap();
    assert!(volume_image(&pool, "from-b2") == image(&pool, "s2"));

    // Another key: opened, checked, sealed and named anew; it restores with that key.
    ferrite_backup::copy(&a, &c, &b2, &|_| {}).await.unwrap();
    assert!(chunk_names(&dir.path().join("c")).is_disjoint(&chunk_names(&dir.path().join("a"))));
    restore(&c, &pool, &b2, "from-c").await.unwrap();
    assert!(volume_image(&pool, "from-c") == image(&pool, "s2"));

    // Chunks are by offset: a target of another chunk size cannot take the copy.
    let d = target(dir.path(), "d", Some(1), 2 * MIB).await;
    assert!(matches!(ferrite_backup::copy(&a, &d, &b1, &|_| {}).await, Err(Error::Invalid(_))));
}
