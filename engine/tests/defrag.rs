//! Defragmentation: a volume scattered by random writes is rewritten in logical order while a
//! writer keeps writing to it and snapshots share its blocks; every image reads what it should
//! throughout, snapshots stay shared, and what was written during the pass stays where it is.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::{Fixture, pattern};
use ferrite_engine::io::CrashMode;
use ferrite_engine::{Image, PoolOptions};

const B: u64 = 4096;
const MIB: u64 = 1 << 20;
const SIZE: u64 = 8 * MIB;

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn a_scattered_volume_comes_out_in_order_under_writes_and_snapshots() {
    let opts = PoolOptions { segment_size: MIB, max_batch_bytes: 256 << 10, ..common::small_opts() };
    let (f, pool) = Fixture::with_opts(96, opts);
    pool.create_volume("v", SIZE).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut model = pattern(1, SIZE as usize);
    v.write(0, &model).unwrap();
    // Random 4 KiB overwrites in two rounds, a snapshot between them: half the blocks end up
    // scattered, some owned by the snapshot's layer, some by the volume's.
    let mut x = 7u64;
    for round in 0..2u64 {
        for i in 0..1024u64 {
            let lba = next(&mut x) % (SIZE / B);
            let data = pattern(round * 10_000 + i, B as usize);
            v.write(lba * B, &data).unwrap();
            model[(lba * B) as usize..((lba + 1) * B) as usize].copy_from_slice(&data);
        }
        if round == 0 {
            pool.create_snapshot("v", "s").unwrap();
        }
    }
    let snap = {
        let mut b = vec![0u8; SIZE as usize];
        pool.open_snapshot("s").unwrap().read(0, &mut b).unwrap();
        b
    };
    pool.clone_volume(Image::Snapshot("s"), "c").unwrap();
    // Other traffic after the random writes: they are no longer in the segment being written
    // (whose blocks are hot, and stay where they are).
    pool.create_volume("other", 2 * MIB).unwrap();
    pool.open_volume("other").unwrap().write(0, &pattern(3, (2 * MIB) as usize)).unwrap();
    let (runs_before, mapped) = pool.volume_layout("v").unwrap();
    let live_before = pool.stats().live;
    assert_eq!(mapped, SIZE);
    assert!(runs_before > 500, "random writes scattered the volume: {runs_before} runs");

    // A writer keeps writing (blocks it writes during the pass are hot and stay put).
    let stop = AtomicBool::new(false);
    let (report, written) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut y = 99u64;
            let mut written = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) || i < 64 {
                let lba = next(&mut y) % (SIZE / B);
                let data = pattern(50_000 + i, B as usize);
                v.write(lba * B, &data).unwrap();
                written.push((lba, data));
                i += 1;
            }
            written
        });
        let mut last = 0;
        let r = pool
            .defrag_volume("v", |p| {
                assert!(p.done_bytes > last && p.done_bytes <= p.total_bytes, "{p:?}");
                last = p.done_bytes;
            })
            .unwrap();
        assert_eq!(last, SIZE, "progress reaches the end");
        stop.store(true, Ordering::Relaxed);
        (r, writer.join().unwrap())
    });
    for (lba, data) in &written {
        model[(lba * B) as usize..((lba + 1) * B) as usize].copy_from_slice(data);
    }
    eprintln!("{report:?}, {} writes during the pass", written.len());
    assert!(report.windows_rewritten >= 6 && report.moved_bytes >= 4 * MIB, "{report:?}");
    // What the writer wrote during the pass stays where it is: at most a run or two each.
    let hot = 2 * written.len() as u64;
    assert!(
        report.runs_after < report.runs_before / 8 + hot,
        "the volume is far less scattered: {} -> {} runs ({} writes during the pass)",
        report.runs_before,
        report.runs_after,
        written.len()
    );

    let read = |pool: &ferrite_engine::Pool, img: Image<'_>| {
        let mut b = vec![0u8; SIZE as usize];
        match img {
            Image::Volume(n) => pool.open_volume(n).unwrap().read(0, &mut b).unwrap(),
            Image::Snapshot(n) => pool.open_snapshot(n).unwrap().read(0, &mut b).unwrap(),
        }
        b
    };
    assert!(read(&pool, Image::Volume("v")) == model, "the volume reads what was written");
    assert!(read(&pool, Image::Snapshot("s")) == snap, "the snapshot is unchanged");
    assert!(read(&pool, Image::Volume("c")) == snap, "the clone is unchanged");
    // Moved, not copied: the snapshot and the clone still share the blocks they shared.
    pool.reclaim().unwrap();
    let live_after = pool.stats().live;
    assert!(
        live_after <= live_before + (written.len() as u64) * B,
        "live bytes grew by more than what the writer added: {live_before} -> {live_after}"
    );
    // A second pass, with nobody writing (and the client head moved on), puts the blocks written
    // during the first in order too.
    pool.open_volume("other").unwrap().write(0, &pattern(4, (2 * MIB) as usize)).unwrap();
    let again = pool.defrag_volume("v", |_| {}).unwrap();
    assert!(again.runs_after <= 16, "{again:?}");

    // Durable: after a crash and a reopen every image still reads the same.
    pool.flush().unwrap();
    drop(v);
    f.backend.crash();
    drop(pool);
    f.backend.restart(CrashMode::Random(11));
    let pool = f.reopen();
    assert!(read(&pool, Image::Volume("v")) == model, "after a crash");
    assert!(read(&pool, Image::Snapshot("s")) == snap, "snapshot after a crash");
    assert_eq!(pool.defrag_volume("nope", |_| {}).unwrap_err().kind(), ferrite_engine::ErrorKind::NotFound);
}
