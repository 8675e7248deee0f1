//! Readahead: a sequential reader is served from blocks read ahead, and never from stale ones,
//! whatever happens to the range meanwhile (writes, trims, cleaning, segment reuse, corruption).

#![allow(clippy::cast_possible_truncation)] // test sizes are small

mod common;

use std::time::{Duration, Instant};

use common::{Fixture, pattern, small_opts};
use ferrite_engine::format::DATA_START;
use ferrite_engine::io::{AlignedBuf, Backend};
use ferrite_engine::{ErrorKind, Pool, PoolOptions, Volume};

const B: u64 = 4096;
const K: u64 = 1024;
const MIB: u64 = 1 << 20;
const CHUNK: u64 = 64 * K;

fn opts() -> PoolOptions {
    PoolOptions { readahead: 512 * K, ..small_opts() }
}

/// Writes `data` over the volume one block at a time in a scrambled order, so consecutive
/// volume blocks land in scattered pool blocks (as after random overwrites).
fn write_scattered(v: &Volume, data: &[u8]) {
    let n = data.len() as u64 / B;
    for i in 0..n {
        let lba = (i * 7919) % n; // 7919 is prime: a permutation of 0..n
        v.write(lba * B, &data[(lba * B) as usize..((lba + 1) * B) as usize]).unwrap();
    }
}

fn read_chunks(v: &Volume, from: u64, to: u64, want: &[u8]) {
    let mut buf = vec![0u8; CHUNK as usize];
    for off in (from..to).step_by(CHUNK as usize) {
        v.read(off, &mut buf).unwrap();
        assert!(buf[..] == want[off as usize..(off + CHUNK) as usize], "chunk at {off} differs");
    }
}

/// Waits until the readahead thread has read at least `bytes` (it runs in the background).
fn wait_read_ahead(pool: &Pool, bytes: u64) {
    let t = Instant::now();
    while pool.stats().readahead_bytes < bytes {
        assert!(t.elapsed() < Duration::from_secs(10), "nothing read ahead: {:?}", pool.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_sequential_reader_is_served_from_readahead_and_sees_every_write_and_trim() {
    let (_f, pool) = Fixture::with_opts(64, opts());
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut want = pattern(1, (4 * MIB) as usize);
    write_scattered(&v, &want);
    read_chunks(&v, 0, MIB, &want);
    wait_read_ahead(&pool, 256 * K);
    // Change the range just ahead of the reader, which is read ahead by now: a whole-block
    // overwrite, a partial-block one, and a trim.
    let b = pattern(2, (24 * K) as usize);
    v.write(MIB + 8 * K, &b).unwrap();
    want[(MIB + 8 * K) as usize..(MIB + 32 * K) as usize].copy_from_slice(&b);
    v.write(MIB + 100 * K + 10, b"partial").unwrap();
    want[(MIB + 100 * K + 10) as usize..(MIB + 100 * K + 17) as usize].copy_from_slice(b"partial");
    v.trim(MIB + 128 * K, 64 * K).unwrap();
    want[(MIB + 128 * K) as usize..(MIB + 192 * K) as usize].fill(0);
    read_chunks(&v, MIB, 4 * MIB, &want);
    let s = pool.stats();
    eprintln!("read ahead {} KiB, taken {} KiB", s.readahead_bytes >> 10, s.readahead_hit_bytes >> 10);
    assert!(s.readahead_hit_bytes >= 2 * MIB, "most of the stream came from readahead: {s:?}");
    assert!(s.readahead_bytes <= 4 * MIB + 512 * K, "nothing read ahead twice: {s:?}");
}

#[test]
fn readahead_never_serves_a_block_of_a_segment_freed_and_written_again() {
    let (_f, pool) = Fixture::with_opts(64, opts());
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let a = pattern(1, (4 * MIB) as usize);
    v.write(0, &a).unwrap();
    // Start a stream and stop: the windows ahead of it stay cached, untaken.
    read_chunks(&v, 0, 256 * K, &a);
    wait_read_ahead(&pool, 512 * K);
    // Overwrite everything, free the old segments, and write again: the new data reuses the
    // freed segments, so the cached pool blocks now hold other volume blocks.
    v.write(0, &pattern(2, (4 * MIB) as usize)).unwrap();
    let free = pool.stats().segments_free;
    pool.checkpoint().unwrap();
    assert!(pool.stats().segments_free >= free + 16, "the first data's segments are free again");
    let c = pattern(3, (4 * MIB) as usize);
    write_scattered(&v, &c);
    read_chunks(&v, 0, 4 * MIB, &c);
}

#[test]
fn a_corrupt_block_fails_only_the_read_that_covers_it() {
    let (f, pool) = Fixture::with_opts(64, opts());
    pool.create_volume("v", 2 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let a = pattern(4, (2 * MIB) as usize);
    v.write(0, &a).unwrap();
    pool.checkpoint().unwrap();
    // Find where volume offset 1 MiB + 4 KiB landed and flip a byte there.
    let target = &a[(MIB + B) as usize..(MIB + 2 * B) as usize];
    let mut block = AlignedBuf::new(B as usize); // the backend refuses unaligned buffers
    let at = (DATA_START..f.backend.len())
        .step_by(B as usize)
        .find(|&off| {
            f.backend.read_at(&mut block, off).unwrap();
            block[..] == *target
        })
        .expect("the block is on media");
    f.backend.corrupt(at + 9, &[0x55]);
    let mut buf = vec![0u8; CHUNK as usize];
    for off in (0..2 * MIB).step_by(CHUNK as usize) {
        match v.read(off, &mut buf) {
            Ok(()) => assert!(buf[..] == a[off as usize..(off + CHUNK) as usize], "chunk at {off} differs"),
            Err(e) => {
                assert_eq!(off, MIB, "only the chunk holding the bad block fails: {e}");
                assert_eq!(e.kind(), ErrorKind::Corrupt);
            }
        }
    }
    assert!(v.read(MIB, &mut buf).is_err(), "the bad block fails every read of it");
    assert!(pool.stats().readahead_hit_bytes > MIB, "{:?}", pool.stats());
}

#[test]
fn with_readahead_off_nothing_is_read_ahead() {
    let (_f, pool) = Fixture::with_opts(64, PoolOptions { readahead: 0, ..small_opts() });
    pool.create_volume("v", 2 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let a = pattern(5, (2 * MIB) as usize);
    v.write(0, &a).unwrap();
    read_chunks(&v, 0, 2 * MIB, &a);
    let s = pool.stats();
    assert_eq!((s.readahead_bytes, s.readahead_hit_bytes), (0, 0));
}
