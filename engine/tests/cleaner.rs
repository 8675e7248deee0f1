//! The cleaner: space comes back, data does not change, concurrent writers and full pools.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Fixture, SEG, pattern, small_opts};
use ferrite_engine::io::CrashMode;
use ferrite_engine::{ErrorKind, Image, Pool, PoolOptions};

const B: u64 = 4096;
const MIB: u64 = 1 << 20;

fn read(pool: &Pool, name: &str, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    pool.open_volume(name).unwrap().read(0, &mut buf).unwrap();
    buf
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn reclaim_brings_physical_usage_to_within_5_percent_of_live() {
    // 1 MiB segments and 512 KiB batches: headers are under 1% of the log, as in production.
    let opts = ferrite_engine::PoolOptions { segment_size: MIB, max_batch_bytes: 512 << 10, ..small_opts() };
    let (f, pool) = Fixture::with_opts(40, opts);
    pool.create_volume("v", 8 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(1, (8 * MIB) as usize)).unwrap();
    pool.create_snapshot("v", "s").unwrap();
    pool.clone_volume(Image::Snapshot("s"), "c").unwrap();
    // Overwrite 1 MiB at random 4 KiB blocks, twice over, and trim 1 MiB.
    let mut x = 99u64;
    for i in 0..512u64 {
        let lba = next(&mut x) % (8 * MIB / B);
        v.write(lba * B, &pattern(i, 4096)).unwrap();
    }
    v.trim(4 * MIB, MIB).unwrap();
    pool.delete_snapshot("s").unwrap();
    let (want_v, want_c) = (read(&pool, "v", 8 * MIB), read(&pool, "c", 8 * MIB));
    let before = pool.stats();
    let r = pool.reclaim().unwrap();
    let after = pool.stats();
    eprintln!(
        "reclaim: used {} -> {} KiB, live {} KiB, cleaned {} segments, moved {} blocks, freed {}",
        before.used >> 10,
        after.used >> 10,
        after.live >> 10,
        r.segments_cleaned,
        r.blocks_moved,
        r.segments_freed
    );
    assert!(r.segments_cleaned > 0 && r.segments_freed > 0, "{r:?}");
    assert_eq!(after.live, before.live, "cleaning moves data, it does not drop it");
    assert!(after.used as f64 <= after.live as f64 * 1.05, "used {} vs live {}", after.used, after.live);
    assert_eq!(read(&pool, "v", 8 * MIB), want_v);
    assert_eq!(read(&pool, "c", 8 * MIB), want_c);
    // Moved data survives a crash and a clean reopen.
    f.backend.crash();
    drop(pool);
    f.backend.restart(ferrite_engine::io::CrashMode::DropAll);
    let pool = f.reopen();
    assert_eq!(read(&pool, "v", 8 * MIB), want_v);
    assert_eq!(read(&pool, "c", 8 * MIB), want_c);
    pool.delete_volume("v").unwrap();
    pool.delete_volume("c").unwrap();
    pool.reclaim().unwrap();
    assert_eq!(pool.stats().live, 0);
    assert!(pool.stats().used <= MIB, "only the head segment stays in use");
}

#[test]
fn cleaning_under_concurrent_writers_loses_nothing() {
    let (_f, pool) = Fixture::new(96);
    let pool = Arc::new(pool);
    pool.create_volume("v", 4 * MIB).unwrap();
    let blocks = 4 * MIB / B;
    let writers: Vec<_> = (0..4u64)
        .map(|t| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                // Each writer owns the blocks congruent to t mod 4; returns what it last wrote.
                let v = pool.open_volume("v").unwrap();
                let mut last = vec![None; blocks as usize];
                let mut x = t + 1;
                for i in 0..3000u64 {
                    let lba = (next(&mut x) % (blocks / 4)) * 4 + t;
                    let seed = t << 32 | i;
                    v.write(lba * B, &pattern(seed, 4096)).unwrap();
                    last[lba as usize] = Some(seed);
                }
                last
            })
        })
        .collect();
    let mut cleaned = 0;
    while writers.iter().any(|w| !w.is_finished()) {
        cleaned += pool.reclaim().unwrap().segments_cleaned;
    }
    let mut expect = vec![None; blocks as usize];
    for w in writers {
        for (i, s) in w.join().unwrap().into_iter().enumerate() {
            if s.is_some() {
                expect[i] = s;
            }
        }
    }
    cleaned += pool.reclaim().unwrap().segments_cleaned;
    assert!(cleaned > 0);
    let got = read(&pool, "v", 4 * MIB);
    for (i, s) in expect.iter().enumerate() {
        let want = s.map_or_else(|| vec![0; 4096], |s| pattern(s, 4096));
        assert_eq!(&got[i * 4096..(i + 1) * 4096], &want[..], "block {i}");
    }
}

#[test]
fn a_full_pool_comes_back_after_reclaim_without_a_restart() {
    let (_f, pool) = Fixture::new(24); // 6 MiB
    pool.create_volume("v", 2 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(1, (2 * MIB) as usize)).unwrap();
    // Random overwrites leave every segment partly dead until nothing is free.
    let mut x = 5u64;
    let err = loop {
        let lba = next(&mut x) % (2 * MIB / B);
        if let Err(e) = v.write(lba * B, &pattern(lba, 4096)) {
            break e;
        }
    };
    assert_eq!(err.kind(), ErrorKind::NoSpace);
    let snapshot = read(&pool, "v", 2 * MIB);
    let r = pool.reclaim().unwrap();
    assert!(r.segments_freed > 0, "{r:?}");
    assert_eq!(read(&pool, "v", 2 * MIB), snapshot);
    v.write(0, &[7; 4096]).unwrap();
    assert_eq!(read(&pool, "v", 4096), vec![7; 4096]);
}

#[test]
fn a_damaged_block_is_never_moved_and_other_segments_still_clean() {
    let (f, pool) = Fixture::new(32);
    pool.create_volume("v", 2 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    // The first batches fill segment 0; overwrite all but its first data block so it is
    // mostly dead, and make the rest of the pool mostly dead too.
    v.write(0, &pattern(1, (2 * MIB) as usize)).unwrap();
    v.write(B, &pattern(2, (2 * MIB - B) as usize)).unwrap();
    v.write(B, &pattern(3, (2 * MIB - B) as usize)).unwrap();
    pool.checkpoint().unwrap();
    // Damage the one live block left in segment 0 (after the batch header).
    f.backend.corrupt(ferrite_engine::format::DATA_START + 4096 + 1, &[0xEE]);
    assert_eq!(pool.stats().checksum_errors, 0);
    let r = pool.reclaim().unwrap();
    assert!(r.segments_cleaned > 0, "the other segments still clean: {r:?}");
    let seen = pool.stats().checksum_errors;
    assert!(seen >= 1, "the cleaner counted the block it could not move");
    // The damage is still reported as damage, at the same offset: it was not laundered.
    let s = pool.scrub(&mut |_| {}).unwrap();
    assert_eq!(s.damaged.len(), 1, "{s:?}");
    assert_eq!(s.damaged[0].offset, 0);
    let mut b = vec![0u8; 4096];
    assert_eq!(v.read(0, &mut b).unwrap_err().kind(), ErrorKind::Corrupt);
    assert_eq!(pool.stats().checksum_errors, seen + 1, "the failed read counted");
    // Rewriting the block makes the segment dead, and it is freed like any other.
    v.write(0, &[1; 4096]).unwrap();
    pool.reclaim().unwrap();
    assert!(pool.scrub(&mut |_| {}).unwrap().damaged.is_empty());
}

/// With the background cleaner on, random overwrites of a pool whose volume fills 80% of it never
/// fail (dead space is always there to reclaim: the writer cleans inline when it must), and what
/// was flushed survives a crash. Inline cleaning once left the log head it moved data into open
/// (leaking a segment per inline clean) and rewound the head's sequence number.
#[test]
fn a_pool_kept_80_percent_full_takes_random_overwrites_and_recovers() {
    let opts = PoolOptions { background_cleaner: true, cleaner_interval: Duration::from_millis(20), ..small_opts() };
    let (f, pool) = Fixture::with_opts(40, opts); // 10 MiB
    let size = 8 * MIB - MIB / 2; // ~80% of the segments, after the reserve
    pool.create_volume("v", size).unwrap();
    let v = pool.open_volume("v").unwrap();
    let blocks = size / B;
    let mut seeds: Vec<u64> = (0..blocks).collect();
    v.write(0, &(0..blocks).flat_map(|b| pattern(b, 4096)).collect::<Vec<_>>()).unwrap();
    let mut x = 11u64;
    for i in 0..4 * blocks {
        let lba = next(&mut x) % blocks;
        let seed = blocks + i;
        v.write(lba * B, &pattern(seed, 4096)).unwrap_or_else(|e| panic!("overwrite {i} failed: {e}"));
        seeds[lba as usize] = seed;
    }
    let st = pool.stats();
    assert!(st.cleaner_segments_cleaned > 0, "{st:?}");
    pool.flush().unwrap();
    f.backend.crash();
    drop(v);
    drop(pool);
    f.backend.restart(CrashMode::Random(3));
    let pool = f.reopen();
    let got = read(&pool, "v", size);
    for (b, seed) in seeds.iter().enumerate() {
        assert!(got[b * 4096..(b + 1) * 4096] == pattern(*seed, 4096)[..], "block {b} lost after the crash");
    }
}

/// Cleaned blocks go to a head of their own; the checkpoint keeps its place, so after a crash
/// and a reopen the cold head continues in the same segment; moves lost with a crash before
/// their checkpoint lose nothing (the victim still holds the data); client writes stay at theirs.
#[test]
fn moved_blocks_go_to_a_cold_head_that_survives_crash_and_reopen() {
    use ferrite_engine::FaultPoint;
    for mode in [CrashMode::DropAll, CrashMode::KeepAll, CrashMode::Random(3)] {
        let (f, pool) = Fixture::new(40);
        pool.create_volume("v", 2 * MIB).unwrap();
        let v = pool.open_volume("v").unwrap();
        v.write(0, &pattern(1, (2 * MIB) as usize)).unwrap();
        // Every other block of the first half overwritten: those segments are half dead.
        for i in (0..256u64).step_by(2) {
            v.write(i * B, &pattern(100 + i, 4096)).unwrap();
        }
        let want = read(&pool, "v", 2 * MIB);
        let hot = pool.stats().head_segment;
        let r = pool.reclaim().unwrap();
        assert!(r.blocks_moved > 100, "{r:?}");
        let s = pool.stats();
        let cold = s.cold_segment.expect("the moves opened a cold head");
        assert_ne!(cold, s.head_segment);
        assert_eq!(s.head_segment, hot, "moves leave the client head where it was");
        assert_eq!(read(&pool, "v", 2 * MIB), want);

        // A crash after the reclaim's checkpoint: the cold head is where the checkpoint left it.
        drop(v);
        f.backend.crash();
        drop(pool);
        f.backend.restart(mode);
        let pool = f.reopen();
        assert_eq!(pool.stats().cold_segment, Some(cold), "{mode:?}");
        assert_eq!(read(&pool, "v", 2 * MIB), want, "{mode:?}");

        // More dead space, cleaned again; the checkpoint that would free the victims fails: the
        // crash loses the moves, never the data.
        let v = pool.open_volume("v").unwrap();
        for i in (256..512u64).step_by(2) {
            v.write(i * B, &pattern(1000 + i, 4096)).unwrap();
        }
        pool.flush().unwrap();
        let want = read(&pool, "v", 2 * MIB);
        pool.inject_fault(FaultPoint::CheckpointBeforeCommit);
        assert!(pool.reclaim().is_err());
        drop(v);
        f.backend.crash();
        drop(pool);
        f.backend.restart(mode);
        let pool = f.reopen();
        assert_eq!(read(&pool, "v", 2 * MIB), want, "{mode:?}: moves lost with their checkpoint cost data");
        // The cold head continues in its segment: the recorded place, or, once that filled, a
        // fresh one (no client batch is ever written into it).
        pool.reclaim().unwrap();
        assert_eq!(read(&pool, "v", 2 * MIB), want, "{mode:?}");
        let s = pool.stats();
        assert_ne!(s.cold_segment, Some(s.head_segment));
        drop(pool);
        let pool = f.reopen();
        assert_eq!(read(&pool, "v", 2 * MIB), want, "{mode:?}: after a clean reopen");
    }
}

/// A pool whose first 16 segments are half dead (every other block of a 4 MiB volume
/// overwritten), far above the low-water mark, and the volume's contents.
fn half_dead_pool(idle_cleaning: Option<Duration>) -> (Fixture, Pool, Vec<u8>) {
    let opts = PoolOptions {
        background_cleaner: true,
        cleaner_interval: Duration::from_millis(20),
        idle_cleaning,
        ..small_opts()
    };
    let (f, pool) = Fixture::with_opts(64, opts);
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut model = pattern(1, 4 * MIB as usize);
    v.write(0, &model).unwrap();
    for blk in (0..4 * MIB / B).step_by(2) {
        let at = (blk * B) as usize;
        let data = pattern(blk + 2, B as usize);
        v.write(blk * B, &data).unwrap();
        model[at..at + B as usize].copy_from_slice(&data);
    }
    v.flush().unwrap();
    (f, pool, model)
}

#[test]
fn an_idle_pool_compacts_half_dead_segments_ahead_of_need_and_a_busy_one_does_not() {
    let (_f, pool, model) = half_dead_pool(Some(Duration::from_millis(300)));
    let before = pool.stats();
    assert_eq!(before.cleaner_segments_cleaned, 0);
    // Busy: a request every 50 ms keeps the pool from ever being idle for 300 ms.
    let v = pool.open_volume("v").unwrap();
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_millis(1200) {
        v.read(0, &mut [0u8; 4096]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(pool.stats().cleaner_segments_cleaned, 0, "nothing is cleaned while clients come");
    // Idle: the half-dead segments are cleaned and come free, with nothing lost.
    let start = std::time::Instant::now();
    let after = loop {
        let s = pool.stats();
        if s.cleaner_segments_cleaned >= 16 && s.segments_free >= before.segments_free + 8 {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "idle cleaning did not happen: {s:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(after.cleaner_bytes_moved <= 16 * SEG / 2 + SEG, "moved only the live halves: {after:?}");
    assert!(read(&pool, "v", 4 * MIB) == model);
    // Done for this idle period: no victim left, nothing more moved.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(pool.stats().cleaner_bytes_moved, after.cleaner_bytes_moved);
}

#[test]
fn without_idle_cleaning_an_idle_pool_is_left_as_it_is() {
    let (_f, pool, model) = half_dead_pool(None);
    let before = pool.stats();
    std::thread::sleep(Duration::from_millis(1000));
    let after = pool.stats();
    assert_eq!(after.cleaner_segments_cleaned, 0);
    assert_eq!(after.segments_free, before.segments_free);
    assert!(read(&pool, "v", 4 * MIB) == model);
}
