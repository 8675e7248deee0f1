//! Readahead: a sequential reader is served from blocks read ahead, and never from stale ones,
//! whatever happens to the range meanwhile (writes, trims, cleaning, segment reuse, corruption).

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Fixture, pattern, small_opts};
use ferrite_engine::format::DATA_START;
use ferrite_engine::io::{AlignedBuf, AsyncIo, Backend, ReadOp, SyncFileBackend};
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

/// A file store whose batches of reads through the engine (the readahead thread's) take 50 ms
/// once `slow` is set, and fail once after `fail_once` is set; reads on its descriptor (a
/// caller's own I/O) are never held up.
#[derive(Debug)]
struct SlowReads {
    file: SyncFileBackend,
    slow: AtomicBool,
    fail_once: AtomicBool,
}

impl Backend for SlowReads {
    fn len(&self) -> u64 {
        self.file.len()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.read_many(&mut [ReadOp { offset, buf }])
    }
    fn read_many(&self, ops: &mut [ReadOp<'_>]) -> std::io::Result<()> {
        if self.slow.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.fail_once.swap(false, Ordering::Relaxed) {
            return Err(std::io::Error::other("injected"));
        }
        self.file.read_many(ops)
    }
    fn raw_fd(&self) -> Option<RawFd> {
        self.file.raw_fd()
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.file.write_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.file.sync()
    }
}

/// A caller's own I/O done on the spot: each read with pread(2), each wait with poll(2).
#[derive(Default)]
struct OnTheSpot {
    done: VecDeque<(u64, i32)>,
    polls: usize,
}

impl AsyncIo for OnTheSpot {
    fn read_at(&mut self, fd: RawFd, buf: *mut u8, len: usize, offset: u64, user_data: u64) {
        // SAFETY: the engine promises `buf` is valid for `len` bytes until the completion.
        let n = unsafe { libc::pread(fd, buf.cast(), len, i64::try_from(offset).unwrap()) };
        let res = if n < 0 { -std::io::Error::last_os_error().raw_os_error().unwrap() } else { n as i32 };
        self.done.push_back((user_data, res));
    }
    fn poll_readable(&mut self, fd: RawFd, user_data: u64) {
        self.polls += 1;
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd, a live local.
        let n = unsafe { libc::poll(&mut p, 1, 10_000) };
        assert_eq!(n, 1, "the window's eventfd became readable");
        self.done.push_back((user_data, i32::from(p.revents)));
    }
}

/// A pool on [`SlowReads`] with a 2 MiB volume written scattered, made slow once written.
fn slow_pool(dir: &tempfile::TempDir, want: &[u8]) -> (Arc<SlowReads>, Pool) {
    let path = dir.path().join("pool.img");
    std::fs::File::create(&path).unwrap().set_len(64 * common::SEG + DATA_START).unwrap();
    let file = SyncFileBackend::open(&path).unwrap();
    let store = Arc::new(SlowReads { file, slow: AtomicBool::new(false), fail_once: AtomicBool::new(false) });
    let pool = Pool::create_on(Arc::clone(&store) as Arc<dyn Backend>, &dir.path().join("meta"), opts()).unwrap();
    pool.create_volume("v", want.len() as u64).unwrap();
    write_scattered(&pool.open_volume("v").unwrap(), want);
    pool.flush().unwrap();
    store.slow.store(true, Ordering::Relaxed);
    (store, pool)
}

/// Reads the volume front to back as an event loop does, on `io`; checks every chunk.
fn read_on(io: &mut OnTheSpot, v: &Volume, want: &[u8]) {
    let mut buf = vec![0u8; CHUNK as usize];
    for off in (0..want.len() as u64).step_by(CHUNK as usize) {
        // A block of a window still being read is waited for by a poll, not in start_reads.
        let mut reads = v.start_reads(&[(off, CHUNK as usize)]).unwrap();
        let n = reads.submit(io, |i| i as u64).expect("a file store");
        let mut media = (n == 0).then_some(Ok(()));
        while media.is_none() {
            let (i, res) = io.done.pop_front().expect("an operation to report");
            media = reads.complete(io, usize::try_from(i).unwrap(), res);
        }
        reads.finish(media.unwrap(), &mut [&mut buf[..]]).pop().unwrap().unwrap();
        assert!(buf[..] == want[off as usize..(off + CHUNK) as usize], "chunk at {off} differs");
        assert!(io.done.is_empty(), "every operation was reported once");
    }
}

#[test]
fn a_reader_on_its_own_io_waits_for_a_window_being_read_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let want = pattern(7, (2 * MIB) as usize);
    let (_store, pool) = slow_pool(&dir, &want);
    let mut io = OnTheSpot::default();
    read_on(&mut io, &pool.open_volume("v").unwrap(), &want);
    let s = pool.stats();
    assert!(io.polls > 0 && s.readahead_hit_bytes > 0, "{} waits, {s:?}", io.polls);
}

#[test]
fn the_blocks_of_a_window_that_failed_are_read_by_their_reader() {
    let dir = tempfile::tempdir().unwrap();
    let want = pattern(8, (2 * MIB) as usize);
    let (store, pool) = slow_pool(&dir, &want);
    // The first window's read fails after its readers found it still being read.
    store.fail_once.store(true, Ordering::Relaxed);
    let mut io = OnTheSpot::default();
    read_on(&mut io, &pool.open_volume("v").unwrap(), &want);
    assert!(!store.fail_once.load(Ordering::Relaxed), "a window read failed");
    assert!(io.polls > 0, "a reader waited for a window");
}
