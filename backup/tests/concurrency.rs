//! Backups, deletes and prunes at once on one S3 target (SeaweedFS), from two daemons whose
//! volumes share a name (so they share one index): after many rounds every backup the index
//! lists restores to exactly what its snapshot held, and no update of the index was lost.

#![allow(clippy::cast_possible_truncation)]

use crate::common;
use crate::pool;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::Weed;
use ferrite_backup::{BackupRef, Error, Index, Sweep, Target, TargetConfig, TargetKind};
use pool::{MIB, backup, image, new_pool, noise, restore, volume_image};

const ROUNDS: u64 = 16;

fn config(weed: &Weed) -> TargetConfig {
    TargetConfig {
        kind: Some(TargetKind::S3),
        endpoint: Some(weed.endpoint()),
        bucket: Some("ferrite-test".into()),
        prefix: Some("race".into()),
        chunk_size: Some(MIB),
        concurrency: Some(4),
        // Short, so that prunes below condemn and delete chunks while backups run.
        grace_s: Some(3),
        retries: Some(2),
        ..TargetConfig::default()
    }
}

/// A digest of a volume image (what a restore must give back).
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backups_deletes_and_prunes_at_once_lose_nothing() {
    let Some(weed) = Weed::start(false) else { return };
    let made: Arc<parking_lot::Mutex<BTreeMap<String, u64>>> = Arc::default();
    let mut nodes = Vec::new();
    for node in 0..2u64 {
        let (weed_cfg, made) = (config(&weed), Arc::clone(&made));
        nodes.push(tokio::spawn(async move {
            let (_dir, pool) = new_pool();
            let target = Target::open("race", weed_cfg).await.unwrap();
            pool.create_volume("db", 8 * MIB).unwrap();
            let v = pool.open_volume("db").unwrap();
            for round in 0..ROUNDS {
                // Some chunks rewritten (new), one only this backup holds (deleting it leaves
                // that chunk to the sweep), some written as the other node writes them (shared).
                v.write((round % 7) * MIB, &noise(node * 1000 + round, MIB as usize)).unwrap();
                v.write(7 * MIB, &noise(node * 1000 + 500 + round, MIB as usize)).unwrap();
                v.write(((round + 3) % 7) * MIB, &noise(round, MIB as usize)).unwrap();
                let snap = format!("n{node}-r{round:02}");
                pool.create_snapshot("db", &snap).unwrap();
                let id = snap.clone();
                loop {
                    match backup(&target, &pool, "db", &snap, &id).await {
                        Ok(_) => break,
                        // The store's answers under load, or a backup that outlived the grace.
                        Err(e @ (Error::Store { .. } | Error::Conflict(_))) => eprintln!("{id}: {e}; again"),
                        Err(e) => panic!("{id}: {e}"),
                    }
                }
                made.lock().insert(id, digest(&image(&pool, &snap)));
                // Spread over several prunes' grace: chunks are condemned and deleted meanwhile.
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
        }));
    }
    // Deletes of older backups and prunes, while the backups run.
    let janitor = {
        let (target, made) = (Target::open("race", config(&weed)).await.unwrap(), Arc::clone(&made));
        tokio::spawn(async move {
            let (mut deleted, mut swept) = (Vec::new(), 0);
            for n in 0.. {
                tokio::time::sleep(Duration::from_millis(400)).await;
                let victim = made.lock().keys().nth(n % 3).cloned().filter(|_| n % 2 == 0);
                if let Some(id) = victim {
                    ferrite_backup::delete(&target, &BackupRef { volume: "db".into(), id: id.clone() }).await.unwrap();
                    made.lock().remove(&id);
                    deleted.push(id);
                }
                let report = ferrite_backup::prune(&target, None, Sweep::default()).await.unwrap();
                eprintln!("prune {n}: {report:?}");
                swept += report.chunks_deleted;
                if made.lock().len() + deleted.len() == 2 * ROUNDS as usize {
                    return (deleted, swept);
                }
            }
            unreachable!()
        })
    };
    for n in nodes {
        n.await.unwrap();
    }
    let (deleted, swept) = janitor.await.unwrap();
    assert!(!deleted.is_empty() && swept > 0, "deleted {deleted:?}, swept {swept} chunks");

    // Every backup made and not deleted is listed, and restores to its snapshot's bytes.
    let target = Target::open("race", config(&weed)).await.unwrap();
    let index = Index::load(&target, "db").await.unwrap();
    let listed: Vec<&str> = index.backups.iter().map(|b| b.id.as_str()).collect();
    let made = made.lock().clone();
    assert_eq!(listed.len(), made.len(), "listed {listed:?}, made {:?}", made.keys());
    let (_dir, pool) = new_pool();
    for (n, (id, want)) in made.iter().enumerate() {
        let b = BackupRef { volume: "db".into(), id: id.clone() };
        restore(&target, &pool, &b, &format!("r{n}")).await.unwrap();
        assert_eq!(digest(&volume_image(&pool, &format!("r{n}"))), *want, "{id} does not restore its snapshot");
    }
    // Once nothing runs, a prune keeps every chunk they need.
    ferrite_backup::prune(&target, None, pool::no_writers()).await.unwrap();
    let report = ferrite_backup::verify(
        &target,
        &made.keys().map(|id| BackupRef { volume: "db".into(), id: id.clone() }).collect::<Vec<_>>(),
        None,
        &|_| {},
    )
    .await
    .unwrap();
    assert!(report.bad.is_empty(), "{:?}", report.bad);
}
