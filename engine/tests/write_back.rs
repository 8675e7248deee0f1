//! The open batch (write-back of small writes): acknowledged writes are readable at once,
//! share one header per batch, reach the store after `write_delay` or with a flush, FUA or
//! checkpoint, and — as with any volatile write cache — may be lost in a crash until then.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small values

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use common::{Fixture, pattern, small_opts};
use ferrite_engine::PoolOptions;
use ferrite_engine::io::CrashMode;

const MIB: u64 = 1 << 20;
const B: usize = 4096;

/// Batches stay open until something closes them (the flusher would wait an hour).
fn held_opts() -> PoolOptions {
    PoolOptions { write_delay: Duration::from_secs(3600), max_batch_bytes: 4 << 20, ..small_opts() }
}

fn read(pool: &ferrite_engine::Pool, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    pool.open_volume("v").unwrap().read(offset, &mut b).unwrap();
    b
}

#[test]
fn open_batch_is_readable_and_shares_one_header() {
    let (_f, pool) = Fixture::with_opts(16, held_opts());
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(1, B)).unwrap();
    v.flush().unwrap();
    let media0 = pool.stats().media_bytes_written;
    // 20 single-block writes (one an overwrite within the batch), none on the store yet.
    for i in 1..20u64 {
        v.write(i * B as u64, &pattern(10 + i, B)).unwrap();
    }
    v.write(5 * B as u64, &pattern(99, B)).unwrap();
    assert_eq!(pool.stats().media_bytes_written, media0, "nothing written before the batch closes");
    // A read spanning the store (block 0) and the open batch (blocks 1..20).
    let got = read(&pool, 0, 20 * B);
    for (i, blk) in got.chunks(B).enumerate() {
        let want = match i {
            0 => pattern(1, B),
            5 => pattern(99, B),
            _ => pattern(10 + i as u64, B),
        };
        assert_eq!(blk, &want[..], "block {i}");
    }
    v.flush().unwrap();
    // One header block for all 20 data blocks (a batch per write would have cost 20).
    assert_eq!(pool.stats().media_bytes_written - media0, 21 * B as u64);
    assert_eq!(read(&pool, 5 * B as u64, B), pattern(99, B), "read back from the store");
}

#[test]
fn a_power_cut_may_lose_unflushed_writes_a_process_crash_never() {
    for power_cut in [true, false] {
        let (f, pool) = Fixture::with_opts(16, held_opts());
        pool.create_volume("v", MIB).unwrap();
        let v = pool.open_volume("v").unwrap();
        v.write(0, &pattern(1, B)).unwrap();
        v.flush().unwrap();
        v.write(B as u64, &pattern(2, B)).unwrap();
        pool.checkpoint().unwrap();
        v.write(2 * B as u64, &pattern(3, B)).unwrap();
        v.write_fua(3 * B as u64, &pattern(4, B)).unwrap();
        // Acknowledged after the FUA write, never flushed: only in the open batch at the crash.
        v.write(4 * B as u64, &pattern(5, B)).unwrap();
        drop(v);
        f.backend.crash();
        drop(pool);
        if power_cut {
            f.backend.restart(CrashMode::Random(7));
            f.lose_tail_file();
        } else {
            f.backend.restart(CrashMode::KeepAll);
        }
        let pool = f.reopen();
        let got = read(&pool, 0, 5 * B);
        for (i, seed) in [1u64, 2, 3, 4].into_iter().enumerate() {
            assert_eq!(&got[i * B..(i + 1) * B], &pattern(seed, B)[..], "block {i} was covered by a flush");
        }
        if power_cut {
            assert_eq!(&got[4 * B..], &[0u8; B][..], "the unflushed write was in the open batch at the power cut");
        } else {
            assert_eq!(&got[4 * B..], &pattern(5, B)[..], "the open batch came back from the tail file");
            assert_eq!(pool.recovery_report().batches_from_tail, 1);
        }
    }
}

#[test]
fn flusher_writes_the_batch_after_the_delay() {
    let opts = PoolOptions { write_delay: Duration::from_millis(5), ..held_opts() };
    let (_f, pool) = Fixture::with_opts(16, opts);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let media0 = pool.stats().media_bytes_written;
    v.write(0, &pattern(1, B)).unwrap();
    let t0 = Instant::now();
    while pool.stats().media_bytes_written == media0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the open batch was never written");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(pool.stats().media_bytes_written - media0, 2 * B as u64);
    assert_eq!(read(&pool, 0, B), pattern(1, B));
}

#[test]
fn concurrent_writers_and_readers_see_their_last_write() {
    // A short delay so batches close under the readers' feet, and segments small enough that
    // the head moves on often.
    let opts = PoolOptions { write_delay: Duration::from_micros(200), ..small_opts() };
    let (_f, pool) = Fixture::with_opts(64, opts);
    pool.create_volume("v", 2 * MIB).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let v = pool.open_volume("v").unwrap();
            s.spawn(move || {
                // Each thread owns 32 blocks and checks every write by reading it back, together
                // with a neighbour it wrote earlier.
                let base = t * 32;
                let mut last = [0u64; 32];
                for i in 1..=600u64 {
                    let k = (i * 7 + t) % 32;
                    let seed = (t << 32) | i;
                    v.write((base + k) * B as u64, &pattern(seed, B)).unwrap();
                    last[k as usize] = seed;
                    let j = (k + 1) % 32;
                    let mut got = vec![0u8; B];
                    for (blk, want) in [(k, seed), (j, last[j as usize])] {
                        v.read((base + blk) * B as u64, &mut got).unwrap();
                        let want = if want == 0 { vec![0u8; B] } else { pattern(want, B) };
                        assert_eq!(got, want, "thread {t} block {blk} after write {i}");
                    }
                }
            });
        }
    });
    let used = pool.stats().live;
    assert_eq!(used, 128 * B as u64);
}

/// A store whose writes wait while a gate is closed: a batch can be held in flight.
#[derive(Debug)]
struct Gated {
    inner: ferrite_engine::io::CrashBackend,
    closed: Mutex<bool>,
    cv: Condvar,
    held: AtomicU64,
}

impl Gated {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.cv.notify_all();
    }

    fn store(&self) -> &ferrite_engine::io::CrashBackend {
        &self.inner
    }
}

impl ferrite_engine::io::Backend for Gated {
    fn len(&self) -> u64 {
        self.store().len()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.store().read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let mut closed = self.closed.lock().unwrap();
        if *closed {
            self.held.fetch_add(1, Ordering::SeqCst);
        }
        while *closed {
            closed = self.cv.wait(closed).unwrap();
        }
        drop(closed);
        self.store().write_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.store().sync()
    }
}

#[test]
fn a_batch_in_flight_is_readable_and_does_not_hold_up_the_next() {
    use std::sync::Arc;
    let opts = PoolOptions { write_delay: Duration::from_millis(2), ..held_opts() };
    let store = ferrite_engine::io::CrashBackend::new(ferrite_engine::format::DATA_START + 16 * opts.segment_size);
    let gated =
        Arc::new(Gated { inner: store, closed: Mutex::new(false), cv: Condvar::new(), held: AtomicU64::new(0) });
    // Opens the gate however the test ends: a failed assertion must not hang the pool's drop.
    struct OpenOnDrop(Arc<Gated>);
    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.set(false);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let pool = ferrite_engine::Pool::create_on(gated.clone(), &dir.path().join("meta"), opts).unwrap();
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let _gate = OpenOnDrop(gated.clone());
    gated.set(true);
    v.write(0, &pattern(1, B)).unwrap();
    // The flusher seals the batch after the delay and its write waits at the gate.
    let t0 = Instant::now();
    while gated.held.load(Ordering::SeqCst) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the batch was never written");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(read(&pool, 0, B), pattern(1, B), "served from the batch in flight");
    // The next write opens a batch behind the one in flight and is acknowledged without it.
    let writing = std::thread::spawn({
        let v = pool.open_volume("v").unwrap();
        move || v.write(B as u64, &pattern(2, B))
    });
    let t0 = Instant::now();
    while !writing.is_finished() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(writing.is_finished(), "a write waited for the batch in flight");
    writing.join().unwrap().unwrap();
    assert_eq!(read(&pool, 0, 2 * B), [pattern(1, B), pattern(2, B)].concat());
    // A flush waits for the write in flight; the gate opens while it waits.
    let flushing = std::thread::spawn({
        let v = pool.open_volume("v").unwrap();
        move || v.flush()
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(!flushing.is_finished(), "a flush cannot complete before the batch in flight lands");
    gated.set(false);
    flushing.join().unwrap().unwrap();
    assert_eq!(read(&pool, 0, 2 * B), [pattern(1, B), pattern(2, B)].concat());
    drop(v);
    pool.close().unwrap();
    let pool = ferrite_engine::Pool::open_on(gated.clone(), &dir.path().join("meta"), held_opts()).unwrap();
    assert_eq!(read(&pool, 0, 2 * B), [pattern(1, B), pattern(2, B)].concat(), "both batches replayed");
}
