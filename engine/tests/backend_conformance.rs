//! One conformance suite, run on every I/O backend.

#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)] // test arithmetic on small values

use std::fs::OpenOptions;
use std::sync::Arc;

use ferrite_engine::io::{
    AlignedBuf, BLOCK, Backend, CrashBackend, CrashMode, MemoryBackend, ReadOp, SyncFileBackend, UringBackend,
};

const LEN: u64 = 4 << 20;

fn file_of(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let p = dir.path().join("store.img");
    OpenOptions::new().create_new(true).write(true).open(&p).unwrap().set_len(LEN).unwrap();
    p
}

fn pattern(seed: u8, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = seed.wrapping_add((i % 251) as u8);
    }
    b
}

/// The contract every backend honours.
fn conformance(b: &dyn Backend) {
    assert_eq!(b.len(), LEN);
    // A fresh store reads as zeros.
    let mut r = AlignedBuf::new(BLOCK);
    b.read_at(&mut r, 0).unwrap();
    assert!(r.iter().all(|&x| x == 0));

    // Written data reads back, at the start, the middle and the very end; a large write (which
    // io_uring sends as pieces in flight together, the last one short) lands whole.
    let large = (1 << 20) + 3 * BLOCK;
    for (off, seed, len) in
        [(0, 1u8, BLOCK), (8 * BLOCK as u64, 2, 16 * BLOCK), (LEN - BLOCK as u64, 3, BLOCK), (1 << 20, 4, large)]
    {
        let w = pattern(seed, len);
        b.write_at(&w, off).unwrap();
        let mut r = AlignedBuf::new(len);
        b.read_at(&mut r, off).unwrap();
        assert_eq!(&r[..], &w[..], "offset {off}");
    }
    b.sync().unwrap();

    // read_many fills each buffer from its own offset.
    let mut a = AlignedBuf::new(BLOCK);
    let mut c = AlignedBuf::new(2 * BLOCK);
    let mut ops = [ReadOp { offset: 0, buf: &mut a }, ReadOp { offset: 8 * BLOCK as u64, buf: &mut c }];
    b.read_many(&mut ops).unwrap();
    assert_eq!(&a[..], &pattern(1, BLOCK)[..]);
    assert_eq!(&c[..], &pattern(2, 16 * BLOCK)[..2 * BLOCK]);

    // Overwrite replaces, neighbours untouched.
    b.write_at(&pattern(9, BLOCK), 9 * BLOCK as u64).unwrap();
    let mut r = AlignedBuf::new(3 * BLOCK);
    b.read_at(&mut r, 8 * BLOCK as u64).unwrap();
    assert_eq!(&r[..BLOCK], &pattern(2, 16 * BLOCK)[..BLOCK]);
    assert_eq!(&r[BLOCK..2 * BLOCK], &pattern(9, BLOCK)[..]);
    assert_eq!(&r[2 * BLOCK..], &pattern(2, 16 * BLOCK)[2 * BLOCK..3 * BLOCK]);

    // write_pieces: pieces asked for one at a time, in any order, more than a ring holds, one
    // larger than a write piece; all land. A bad piece ends the stream with an error, and the
    // pieces before it still land whole.
    let base = 512 * BLOCK as u64;
    let big = pattern(6, 300 << 10);
    let blocks: Vec<AlignedBuf> = (0..80u8).map(|i| pattern(i.wrapping_add(100), BLOCK)).collect();
    let mut asked = 0;
    let mut pieces = blocks
        .iter()
        .enumerate()
        .rev()
        .map(|(i, w)| (&w[..], base + (i * BLOCK) as u64))
        .chain([(&big[..], base + 128 * BLOCK as u64)])
        .inspect(|_| asked += 1);
    b.write_pieces(&mut pieces).unwrap();
    assert_eq!(asked, 81);
    let mut r = AlignedBuf::new(80 * BLOCK);
    b.read_at(&mut r, base).unwrap();
    for (i, w) in blocks.iter().enumerate() {
        assert_eq!(&r[i * BLOCK..(i + 1) * BLOCK], &w[..], "piece {i}");
    }
    let mut r = AlignedBuf::new(big.len());
    b.read_at(&mut r, base + 128 * BLOCK as u64).unwrap();
    assert_eq!(&r[..], &big[..]);
    let good = pattern(7, BLOCK);
    let mut pieces = [(&good[..], base), (&good[..], LEN), (&good[..], base + BLOCK as u64)].into_iter();
    assert!(b.write_pieces(&mut pieces).is_err(), "a piece past the end fails the write");
    let mut r = AlignedBuf::new(BLOCK);
    b.read_at(&mut r, base).unwrap();
    assert_eq!(&r[..], &good[..]);

    // Misaligned or out-of-range requests are refused, not half-done.
    let mut small = AlignedBuf::new(BLOCK);
    assert!(b.read_at(&mut small[..512], 0).is_err());
    assert!(b.read_at(&mut small, 100).is_err());
    assert!(b.read_at(&mut small, LEN).is_err());
    assert!(b.write_at(&pattern(4, BLOCK), LEN).is_err());
    assert!(b.write_at(&pattern(4, 2 * BLOCK), LEN - BLOCK as u64).is_err());
    b.read_at(&mut small, LEN - BLOCK as u64).unwrap();
    assert_eq!(&small[..], &pattern(3, BLOCK)[..]);

    // allocate and discard are accepted on whole ranges.
    b.allocate(0, LEN).unwrap();
    b.discard(LEN - 2 * BLOCK as u64, BLOCK as u64).unwrap();

    // Many threads at once.
    std::thread::scope(|s| {
        for t in 0..8u8 {
            s.spawn(move || {
                for i in 0..32u64 {
                    let off = (64 + u64::from(t) * 32 + i) * BLOCK as u64;
                    let w = pattern(t.wrapping_mul(31).wrapping_add(i as u8), BLOCK);
                    b.write_at(&w, off).unwrap();
                    let mut r = AlignedBuf::new(BLOCK);
                    b.read_at(&mut r, off).unwrap();
                    assert_eq!(&r[..], &w[..]);
                }
            });
        }
    });
    b.sync().unwrap();
}

#[test]
fn memory_backend() {
    conformance(&MemoryBackend::new(LEN));
}

#[test]
fn sync_file_backend() {
    let dir = tempfile::tempdir().unwrap();
    let b = SyncFileBackend::open(&file_of(&dir)).unwrap();
    conformance(&b);
}

#[test]
fn uring_backend() {
    let dir = tempfile::tempdir().unwrap();
    match UringBackend::open(&file_of(&dir)) {
        Ok(b) => {
            assert!(b.is_direct(), "O_DIRECT on the work filesystem");
            conformance(&b);
        }
        Err(e) => eprintln!("SKIPPED uring_backend: io_uring unavailable here ({e})"),
    }
}

#[test]
fn crash_backend() {
    conformance(&CrashBackend::new(LEN));
}

#[test]
fn uring_read_many_larger_than_ring() {
    let dir = tempfile::tempdir().unwrap();
    let Ok(b) = UringBackend::open(&file_of(&dir)) else {
        return eprintln!("SKIPPED: io_uring unavailable");
    };
    let n = 300; // more operations than the ring has entries
    for i in 0..n {
        b.write_at(&pattern(i as u8, BLOCK), (i * BLOCK) as u64).unwrap();
    }
    let mut bufs: Vec<AlignedBuf> = (0..n).map(|_| AlignedBuf::new(BLOCK)).collect();
    let mut ops: Vec<ReadOp> =
        bufs.iter_mut().enumerate().map(|(i, buf)| ReadOp { offset: (i * BLOCK) as u64, buf }).collect();
    b.read_many(&mut ops).unwrap();
    for (i, buf) in bufs.iter().enumerate() {
        assert_eq!(&buf[..], &pattern(i as u8, BLOCK)[..]);
    }
}

#[test]
fn crash_keeps_synced_and_loses_or_tears_unsynced() {
    let b = Arc::new(CrashBackend::new(LEN));
    b.write_at(&pattern(1, BLOCK), 0).unwrap();
    b.sync().unwrap();
    b.write_at(&pattern(2, BLOCK), 0).unwrap();
    b.crash();
    let mut r = AlignedBuf::new(BLOCK);
    assert!(b.read_at(&mut r, 0).is_err(), "a crashed store refuses I/O");
    assert!(b.sync().is_err());
    b.restart(CrashMode::DropAll);
    b.read_at(&mut r, 0).unwrap();
    assert_eq!(&r[..], &pattern(1, BLOCK)[..], "unsynced write dropped, synced kept");

    // A torn multi-block write: over many seeds, some blocks survive and some do not.
    let mut saw_torn = false;
    for seed in 0..64 {
        let b = CrashBackend::new(LEN);
        b.write_at(&pattern(5, 8 * BLOCK), 0).unwrap();
        b.crash();
        b.restart(CrashMode::Random(seed));
        let mut r = AlignedBuf::new(8 * BLOCK);
        b.read_at(&mut r, 0).unwrap();
        let kept: Vec<bool> = r.chunks(BLOCK).map(|c| c.iter().any(|&x| x != 0)).collect();
        for (i, k) in kept.iter().enumerate() {
            if *k {
                assert_eq!(&r[i * BLOCK..(i + 1) * BLOCK], &pattern(5, 8 * BLOCK)[i * BLOCK..(i + 1) * BLOCK]);
            }
        }
        saw_torn |= kept.iter().any(|&k| k) && kept.iter().any(|&k| !k);
    }
    assert!(saw_torn, "random crashes produce torn writes");
}
