//! The base policy (`ferrite_backup::plan`): a backup with no snapshot named takes its own and
//! keeps it as the next incremental's base, dropping the one before; a retry of a chosen id is
//! what was made; an interrupted backup's snapshot is resumed; another target's base is never
//! touched; and the volume's index is read once per backup.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use crate::pool;

use ferrite_backup::{Plan, Planned, Target, TargetConfig, TargetKind};
use pool::{MIB, new_pool};

async fn dir_target(dir: &std::path::Path, name: &str) -> Target {
    let config = TargetConfig {
        kind: Some(TargetKind::Dir),
        path: Some(dir.join(name)),
        chunk_size: Some(MIB),
        ..TargetConfig::default()
    };
    Target::open(name, config).await.unwrap()
}

fn planned(plan: Plan) -> Planned {
    match plan {
        Plan::Make(p) => p,
        Plan::Made(m) => panic!("made before: {m:?}"),
    }
}

fn snapshots(pool: &ferrite_engine::Pool) -> Vec<String> {
    pool.snapshots(Some("db")).unwrap().into_iter().map(|s| s.name).collect()
}

/// Plans, makes and settles a backup as the daemon's service does.
async fn back_up(target: &Target, pool: &Arc<ferrite_engine::Pool>, id: &str) -> ferrite_backup::Manifest {
    let p = planned(ferrite_backup::plan(target, pool, "db", "", id).await.unwrap());
    let m = p.create(target, pool, false, &|_| {}).await.unwrap();
    p.drop_older_bases(target, pool).await.unwrap();
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_backup_keeps_one_base_per_target() {
    let (dir, pool) = new_pool();
    let pool = Arc::new(pool);
    let (a, b) = (dir_target(dir.path(), "a").await, dir_target(dir.path(), "b").await);
    pool.create_volume("db", 4 * MIB).unwrap();
    pool.open_volume("db").unwrap().write(0, &[7; 4096]).unwrap();

    let first = back_up(&a, &pool, "").await;
    assert_eq!(snapshots(&pool), [format!("db.backup.a.{}", first.id)], "a time-named base of its own");
    let on_b = back_up(&b, &pool, "nightly").await;
    // Two backups to `a` within a second: the second id takes a suffix.
    let second = back_up(&a, &pool, "").await;
    assert!(!second.full && second.previous.as_deref() == Some(first.id.as_str()), "{second:?}");
    let want = ["db.backup.b.nightly".to_owned(), format!("db.backup.a.{}", second.id)];
    assert_eq!(snapshots(&pool), want, "a's older base went, b's stayed");
    assert_eq!(on_b.snapshot, "db.backup.b.nightly");

    // A retry of a chosen id is what was made, and takes no snapshot.
    match ferrite_backup::plan(&b, &pool, "db", "", "nightly").await.unwrap() {
        Plan::Made(m) => assert_eq!(m, on_b),
        Plan::Make(p) => panic!("made again: {p:?}"),
    }
    assert_eq!(snapshots(&pool), want);

    // A named snapshot is read as it is, and no base goes.
    pool.create_snapshot("db", "mine").unwrap();
    let p = planned(ferrite_backup::plan(&a, &pool, "db", "mine", "").await.unwrap());
    assert_eq!(p.snapshot, "mine");
    p.create(&a, &pool, false, &|_| {}).await.unwrap();
    p.drop_older_bases(&a, &pool).await.unwrap();
    assert_eq!(snapshots(&pool).len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_backup_is_resumed_and_the_index_read_once() {
    let (dir, pool) = new_pool();
    let pool = Arc::new(pool);
    let target = dir_target(dir.path(), "a").await;
    pool.create_volume("db", 4 * MIB).unwrap();
    pool.open_volume("db").unwrap().write(0, &[9; 4096]).unwrap();

    // Planned (its snapshot taken) and never made: the next plan resumes it, same id.
    let cut = planned(ferrite_backup::plan(&target, &pool, "db", "", "").await.unwrap());
    let again = planned(ferrite_backup::plan(&target, &pool, "db", "", "").await.unwrap());
    assert_eq!((&again.snapshot, &again.id), (&cut.snapshot, &cut.id));
    assert_eq!(snapshots(&pool).len(), 1, "no second snapshot");

    again.create(&target, &pool, false, &|_| {}).await.unwrap();

    // Made from a plan, the index is not read again: one GET fewer than `create` alone (each
    // with a previous backup, so each reads its manifest).
    let gets = || target.counters.gets.load(Relaxed);
    let next = planned(ferrite_backup::plan(&target, &pool, "db", "", "next").await.unwrap());
    let before = gets();
    next.create(&target, &pool, false, &|_| {}).await.unwrap();
    let planned_gets = gets() - before;
    pool.create_snapshot("db", "later").unwrap();
    let opts =
        ferrite_backup::CreateOptions { volume: "db".into(), snapshot: "later".into(), id: "x".into(), full: false };
    let before = gets();
    ferrite_backup::create(&target, &pool, &opts, &|_| {}).await.unwrap();
    assert_eq!(gets() - before, planned_gets + 1, "create alone reads the index; a planned one does not");
}
