//! Recovery: torn tails, corruption in the middle of the log, crashes inside a checkpoint, and
//! crashes after segments were freed and reused.

#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)] // test arithmetic on small values

use crate::common;

use common::{Fixture, SEG, pattern};
use ferrite_engine::format::DATA_START;
use ferrite_engine::io::CrashMode;
use ferrite_engine::{ErrorKind, FaultPoint};

const MIB: u64 = 1 << 20;

fn read_all(pool: &ferrite_engine::Pool, name: &str, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    pool.open_volume(name).unwrap().read(0, &mut b).unwrap();
    b
}

#[test]
fn torn_last_batch_is_truncated_and_flushed_data_kept() {
    let mut saw_truncation = false;
    for seed in 0..24 {
        let (f, pool) = Fixture::new(16);
        pool.create_volume("v", MIB).unwrap();
        let v = pool.open_volume("v").unwrap();
        let old = pattern(1, 256 << 10);
        v.write(0, &old).unwrap();
        pool.flush().unwrap();
        // Unflushed: one large multi-block batch per write, so torn batches are likely.
        let new = pattern(2, 256 << 10);
        for i in 0..4 {
            v.write(i * (64 << 10), &new[(i * (64 << 10)) as usize..((i + 1) * (64 << 10)) as usize]).unwrap();
        }
        f.backend.crash();
        drop(pool);
        f.backend.restart(CrashMode::Random(seed));
        let pool = f.reopen();
        let got = read_all(&pool, "v", 256 << 10);
        for (i, blk) in got.chunks(4096).enumerate() {
            let o = &old[i * 4096..(i + 1) * 4096];
            let n = &new[i * 4096..(i + 1) * 4096];
            assert!(blk == o || blk == n, "seed {seed} block {i} is neither old nor new");
        }
        let report = pool.recovery_report();
        saw_truncation |= report.truncated.is_some();
        // The log is a prefix: once a block is old, every later-written block is old too.
        let first_old = got.chunks(4096).zip(new.chunks(4096)).position(|(g, n)| g != n);
        if let Some(k) = first_old {
            let batch_end = (k / 16 + 1) * 16;
            for (i, blk) in got.chunks(4096).enumerate().skip(batch_end) {
                assert_eq!(blk, &old[i * 4096..(i + 1) * 4096], "seed {seed}: block {i} survived past a lost batch");
            }
        }
        // The recovered pool takes writes and a clean reopen keeps them.
        pool.open_volume("v").unwrap().write(0, &new[..4096]).unwrap();
        pool.close().unwrap();
        let pool = f.reopen();
        assert_eq!(&read_all(&pool, "v", 4096)[..], &new[..4096]);
    }
    assert!(saw_truncation, "some seed tore a batch and recovery reported it");
}

#[test]
fn corrupt_batch_in_the_middle_stops_replay_there_and_is_reported() {
    let (f, pool) = Fixture::new(16);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    // Five single-block batches (header block + data block each), each flushed.
    for i in 0..5u64 {
        v.write(i * 4096, &pattern(10 + i, 4096)).unwrap();
        pool.flush().unwrap();
    }
    f.backend.crash();
    drop(pool);
    f.backend.restart(CrashMode::KeepAll);
    // Batch 2's data block sits at segment 0, offset 2 * 8 KiB + 4 KiB.
    f.backend.corrupt(DATA_START + 2 * 8192 + 4096 + 100, &[0xFF, 0x00, 0xFF]);
    let pool = f.reopen();
    let report = pool.recovery_report().clone();
    assert_eq!(report.batches_replayed, 2);
    let why = report.truncated.expect("truncation reported");
    assert!(why.contains("checksum"), "{why}");
    let got = read_all(&pool, "v", 5 * 4096);
    assert_eq!(&got[..4096], &pattern(10, 4096)[..]);
    assert_eq!(&got[4096..8192], &pattern(11, 4096)[..]);
    assert!(got[8192..].iter().all(|&b| b == 0), "nothing after the corrupt batch is applied");
}

#[test]
fn corrupt_checkpointed_block_reads_as_an_error_not_data() {
    let (f, pool) = Fixture::new(16);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(3, 8192)).unwrap();
    pool.checkpoint().unwrap();
    // First data block follows the 1-block header at the start of segment 0.
    f.backend.corrupt(DATA_START + 4096 + 5, &[0xAA]);
    let mut b = vec![0u8; 8192];
    let err = v.read(0, &mut b).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(err.to_string().contains("\"v\"") && err.to_string().contains("offset 0"), "{err}");
    // The neighbouring block is still readable.
    v.read(4096, &mut b[..4096]).unwrap();
    assert_eq!(&b[..4096], &pattern(3, 8192)[4096..]);
}

#[test]
fn a_corrupt_block_fails_only_its_own_range_of_a_batched_read() {
    let (f, pool) = Fixture::new(16);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(3, 4 * 4096)).unwrap();
    pool.checkpoint().unwrap();
    f.backend.corrupt(DATA_START + 4096 + 5, &[0xAA]); // the first data block: volume offset 0
    let mut bufs = [vec![0u8; 4096], vec![0u8; 8192], vec![0u8; 4096]];
    let [a, b, c] = &mut bufs;
    let mut parts: Vec<(u64, &mut [u8])> = vec![(4096, &mut a[..]), (0, &mut b[..]), (3 * 4096, &mut c[..])];
    let results = v.read_sparse_many(&mut parts);
    assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Corrupt);
    // The ranges before and after it read their own blocks.
    assert_eq!(results[0].as_ref().unwrap(), &[(4096, true)]);
    assert_eq!(results[2].as_ref().unwrap(), &[(4096, true)]);
    assert_eq!(bufs[0], pattern(3, 4 * 4096)[4096..8192]);
    assert_eq!(bufs[2], pattern(3, 4 * 4096)[3 * 4096..]);
}

#[test]
fn crash_inside_checkpoint_loses_nothing_flushed() {
    for point in [FaultPoint::CheckpointBeforeCommit, FaultPoint::CheckpointAfterCommit] {
        for mode in [CrashMode::DropAll, CrashMode::KeepAll, CrashMode::Random(5)] {
            let (f, pool) = Fixture::new(16);
            pool.create_volume("v", MIB).unwrap();
            let v = pool.open_volume("v").unwrap();
            let a = pattern(1, 512 << 10);
            v.write(0, &a).unwrap();
            pool.checkpoint().unwrap();
            let b = pattern(2, 256 << 10);
            v.write(0, &b).unwrap();
            pool.flush().unwrap();
            pool.inject_fault(point);
            assert!(pool.checkpoint().is_err());
            assert_eq!(v.write(0, &b).unwrap_err().kind(), ErrorKind::Closed, "a failed pool refuses writes");
            f.backend.crash();
            drop(pool);
            f.backend.restart(mode);
            let pool = f.reopen();
            let got = read_all(&pool, "v", 512 << 10);
            assert!(got[..256 << 10] == b[..], "{point:?} {mode:?}: flushed overwrite lost");
            assert!(got[256 << 10..] == a[256 << 10..], "{point:?} {mode:?}: older data lost");
        }
    }
}

#[test]
fn crash_after_freed_segments_are_reused() {
    for mode in [CrashMode::DropAll, CrashMode::KeepAll, CrashMode::Random(1), CrashMode::Random(2)] {
        let (f, pool) = Fixture::new(16);
        pool.create_volume("v", 2 * MIB).unwrap();
        let v = pool.open_volume("v").unwrap();
        // Fill several segments, then overwrite everything so they all die.
        v.write(0, &pattern(1, MIB as usize)).unwrap();
        let second = pattern(2, MIB as usize);
        v.write(0, &second).unwrap();
        let free_before = pool.stats().segments_free;
        pool.checkpoint().unwrap(); // frees the dead segments
        assert!(pool.stats().segments_free > free_before, "dead segments released");
        // New writes land in reused segments; flush them, then write more without a flush.
        let third = pattern(3, (MIB / 2) as usize);
        v.write(MIB, &third).unwrap();
        v.write(MIB + MIB / 2, &third).unwrap();
        pool.flush().unwrap();
        v.write(0, &pattern(4, 64 << 10)).unwrap();
        f.backend.crash();
        drop(pool);
        f.backend.restart(mode);
        let pool = f.reopen();
        let got = read_all(&pool, "v", 2 * MIB as usize);
        assert!(got[64 << 10..MIB as usize] == second[64 << 10..], "{mode:?}: checkpointed data lost");
        assert!(got[MIB as usize..(MIB + MIB / 2) as usize] == third[..], "{mode:?}: flushed data lost");
        assert!(got[(MIB + MIB / 2) as usize..] == third[..], "{mode:?}: flushed data lost");
        let head = &got[..64 << 10];
        assert!(
            head.chunks(4096)
                .zip(second.chunks(4096))
                .zip(pattern(4, 64 << 10).chunks(4096))
                .all(|((g, s), n)| g == s || g == n),
            "{mode:?}: unflushed blocks must be old or new"
        );
    }
}

#[test]
fn recovery_follows_the_log_across_segments() {
    let (f, pool) = Fixture::new(16);
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let data = pattern(9, (3 * SEG) as usize);
    v.write(0, &data).unwrap();
    pool.flush().unwrap();
    f.backend.crash();
    drop(pool);
    f.backend.restart(CrashMode::DropAll);
    let pool = f.reopen();
    assert!(pool.recovery_report().batches_replayed > 3);
    assert!(pool.recovery_report().truncated.is_none());
    assert!(read_all(&pool, "v", data.len()) == data);
    assert!(pool.stats().generation >= 3);
}

#[test]
fn random_corruption_never_panics_and_never_returns_wrong_data() {
    for seed in 0..12u64 {
        let (f, pool) = Fixture::new(16);
        pool.create_volume("v", MIB).unwrap();
        let v = pool.open_volume("v").unwrap();
        let data = pattern(seed, MIB as usize);
        v.write(0, &data[..(MIB / 2) as usize]).unwrap();
        pool.checkpoint().unwrap();
        v.write(MIB / 2, &data[(MIB / 2) as usize..]).unwrap();
        pool.flush().unwrap();
        f.backend.crash();
        drop(pool);
        f.backend.restart(CrashMode::KeepAll);
        // Scribble over random places of the first few segments (the log and the data).
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for _ in 0..8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let at = DATA_START + x % (6 * SEG);
            f.backend.corrupt(at, &pattern(x, 64));
        }
        let pool = match ferrite_engine::Pool::open_on(f.backend.clone(), &f.meta(), f.opts.clone()) {
            Ok(p) => p,
            Err(e) => panic!("seed {seed}: a damaged log must still open (truncating), got {e}"),
        };
        let v = pool.open_volume("v").unwrap();
        for blk in 0..(MIB / 4096) {
            let mut b = vec![0u8; 4096];
            match v.read(blk * 4096, &mut b) {
                Ok(()) => {
                    let want = &data[(blk * 4096) as usize..((blk + 1) * 4096) as usize];
                    assert!(b == want || b.iter().all(|&x| x == 0), "seed {seed} block {blk}: wrong data returned");
                }
                Err(e) => assert_eq!(e.kind(), ErrorKind::Corrupt, "seed {seed} block {blk}: {e}"),
            }
        }
    }
}

#[test]
fn faults_in_the_tail_the_room_and_the_cleaner_lose_nothing_flushed() {
    const HALF: usize = 512 << 10;
    for point in [FaultPoint::TailBeforeWrite, FaultPoint::RoomBeforeChain, FaultPoint::CleanerBeforeMove] {
        for mode in [CrashMode::DropAll, CrashMode::KeepAll, CrashMode::Random(3)] {
            let (f, pool) = Fixture::new(32);
            pool.create_volume("v", MIB).unwrap();
            let v = pool.open_volume("v").unwrap();
            let (a, b, c) = (pattern(1, MIB as usize), pattern(2, HALF), pattern(3, HALF));
            v.write(0, &a).unwrap();
            pool.flush().unwrap();
            v.write(0, &b).unwrap(); // dead space for the cleaner
            pool.flush().unwrap();
            pool.checkpoint().unwrap();
            pool.inject_fault(point);
            // Small writes (through the open batch) that cross segments, a flush, a cleaning run:
            // the armed point is on one of these paths.
            let wrote = (0..HALF).step_by(16 << 10).try_for_each(|at| v.write(at as u64, &c[at..at + (16 << 10)]));
            let flush = wrote.and_then(|()| pool.flush());
            let flushed = flush.is_ok();
            let failed = flush.and_then(|()| pool.reclaim().map(drop)).expect_err("the armed fault is reached");
            // The fault itself, or the pool it poisoned refusing what came after.
            let why = failed.to_string();
            assert!(why.contains("injected fault") || why.contains("media failure"), "{point:?}: {why}");
            f.backend.crash();
            drop(pool);
            f.backend.restart(mode);
            let pool = f.reopen();
            let got = read_all(&pool, "v", MIB as usize);
            assert!(got[HALF..] == a[HALF..], "{point:?} {mode:?}: data no write touched changed");
            if flushed {
                assert!(got[..HALF] == c[..], "{point:?} {mode:?}: flushed writes lost");
            } else {
                // Unflushed writes may be lost, block by block, never garbled.
                for (i, block) in got[..HALF].chunks(4096).enumerate() {
                    let r = i * 4096..(i + 1) * 4096;
                    assert!(block == &b[r.clone()] || block == &c[r], "{point:?} {mode:?}: block {i} is neither");
                }
            }
        }
    }
}

#[test]
fn segment_moves_survive_a_process_crash_and_a_flush_makes_them_durable() {
    // (flushed, tail file lost as in a power cut)
    for (flush, lose_tail) in [(false, false), (true, false), (true, true)] {
        let (f, pool) = Fixture::new(16);
        pool.create_volume("v", MIB).unwrap();
        let v = pool.open_volume("v").unwrap();
        let data = pattern(7, MIB as usize);
        // 1 MiB through 256 KiB segments: the head moves several times.
        v.write(0, &data).unwrap();
        if flush {
            pool.flush().unwrap();
        }
        f.backend.crash();
        drop(pool);
        // Every batch issued reached the device: the chain records of the moves were written
        // (unsynced) before them, and the batches not yet issued are in the tail file.
        f.backend.restart(CrashMode::KeepAll);
        if lose_tail {
            f.lose_tail_file();
        }
        let pool = f.reopen();
        let got = read_all(&pool, "v", MIB as usize);
        let kept = got.chunks(4096).zip(data.chunks(4096)).take_while(|(g, d)| g == d).count();
        assert!(got == data, "flush {flush}, tail lost {lose_tail}: replay ended after {kept} blocks");
        assert!(pool.recovery_report().truncated.is_none());
    }
}

#[test]
fn segments_discarded_at_release_held_nothing_a_crash_needs() {
    for mode in [CrashMode::DropAll, CrashMode::KeepAll, CrashMode::Random(4)] {
        let opts = ferrite_engine::PoolOptions { discard: ferrite_engine::Discard::On, ..common::small_opts() };
        let (f, pool) = Fixture::with_opts(16, opts);
        pool.create_volume("v", MIB).unwrap();
        let v = pool.open_volume("v").unwrap();
        let (a, b, c) = (pattern(1, MIB as usize), pattern(2, MIB as usize / 2), pattern(3, 64 << 10));
        v.write(0, &a).unwrap();
        v.write(0, &b).unwrap();
        pool.flush().unwrap();
        // Cleaning empties the victims; the checkpoint that releases them discards them, and
        // the backend zeroes them at once, as a device may.
        pool.reclaim().unwrap();
        assert!(f.backend.counters().discards > 0, "{mode:?}: freed segments were discarded");
        v.write(MIB / 4, &c).unwrap();
        pool.flush().unwrap();
        f.backend.crash();
        drop(pool);
        f.backend.restart(mode);
        let pool = f.reopen();
        let mut want = a.clone();
        want[..b.len()].copy_from_slice(&b);
        want[(MIB / 4) as usize..(MIB / 4) as usize + c.len()].copy_from_slice(&c);
        assert!(read_all(&pool, "v", MIB as usize) == want, "{mode:?}: flushed data lost");
    }
}
