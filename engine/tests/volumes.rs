//! Thin volumes: catalog operations, byte-granular I/O, space, and persistence across reopen.

#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)] // test arithmetic on small values

use crate::common;

use common::{Fixture, SEG, pattern};
use ferrite_engine::{ErrorKind, Pool, PoolOptions};

const MIB: u64 = 1 << 20;

#[test]
fn catalog_create_list_grow_delete() {
    let (_f, pool) = Fixture::new(8);
    let a = pool.create_volume("a", 4 * MIB).unwrap();
    pool.create_volume("b", MIB).unwrap();
    assert_eq!(pool.create_volume("a", MIB).unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(pool.create_volume("bad name", MIB).unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(pool.create_volume("c", 1000).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let names: Vec<_> = pool.volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(a.size, 4 * MIB);
    assert_eq!(a.allocated, 0);
    assert_eq!(pool.grow_volume("a", 8 * MIB).unwrap().size, 8 * MIB);
    assert_eq!(pool.grow_volume("a", MIB).unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(pool.grow_volume("zz", MIB).unwrap_err().kind(), ErrorKind::NotFound);
    pool.delete_volume("b").unwrap();
    assert_eq!(pool.delete_volume("b").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(pool.volume_info("b").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(pool.volumes().len(), 1);
}

#[test]
fn unwritten_reads_zero_and_byte_granular_io() {
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut buf = vec![1u8; 10_000];
    v.read(12_345, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));

    // Reference image of the volume, updated alongside.
    let mut model = vec![0u8; MIB as usize];
    let writes: [(u64, usize); 7] =
        [(0, 4096), (100, 1), (4095, 2), (8192, 12_288), (5000, 9000), (MIB - 7, 7), (777, 65_536)];
    for (i, (off, len)) in writes.into_iter().enumerate() {
        let data = pattern(i as u64, len);
        v.write(off, &data).unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
        let mut back = vec![0u8; MIB as usize];
        v.read(0, &mut back).unwrap();
        assert!(back == model, "after write {i} at {off}+{len}");
    }
    // Sub-block writes never corrupt their neighbours, even when they race.
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let v = v.clone();
            s.spawn(move || {
                for k in 0..16u64 {
                    // Each thread owns bytes t*512.. of block 200+k: all threads share each block.
                    v.write((200 + k) * 4096 + t * 512, &[t as u8 + 1; 512]).unwrap();
                }
            });
        }
    });
    for k in 0..16u64 {
        let mut b = vec![0u8; 4096];
        v.read((200 + k) * 4096, &mut b).unwrap();
        for t in 0..8usize {
            assert!(b[t * 512..(t + 1) * 512].iter().all(|&x| x == t as u8 + 1), "block {k} part {t}");
        }
    }
}

#[test]
fn unwritten_ranges_cost_no_media_read() {
    let (f, pool) = Fixture::new(8);
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(MIB, &pattern(1, 4096)).unwrap();
    // Written to the store, so the read below cannot be served from the open batch.
    v.flush().unwrap();
    let before = f.backend.counters().reads;
    let mut buf = vec![1u8; MIB as usize];
    v.read(0, &mut buf).unwrap();
    v.read(2 * MIB, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    assert_eq!(f.backend.counters().reads, before, "holes are served without touching media");
    // A read spanning data and holes costs one request per contiguous run of data.
    let mut buf = vec![0u8; 3 * 4096];
    v.read(MIB - 4096, &mut buf).unwrap();
    assert_eq!(f.backend.counters().reads, before + 1);
    assert_eq!(&buf[4096..8192], &pattern(1, 4096)[..]);
}

#[test]
fn catalog_changes_are_durable_on_return() {
    let (f, pool) = Fixture::new(8);
    pool.create_volume("a", MIB).unwrap();
    pool.create_volume("b", MIB).unwrap();
    pool.grow_volume("a", 3 * MIB).unwrap();
    pool.delete_volume("b").unwrap();
    // Power loss right after the calls returned, nothing flushed or checkpointed since.
    f.backend.crash();
    drop(pool);
    f.backend.restart(ferrite_engine::io::CrashMode::DropAll);
    let pool = f.reopen();
    assert_eq!(pool.volume_info("a").unwrap().size, 3 * MIB);
    assert_eq!(pool.volume_info("b").unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn out_of_range_is_rejected() {
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut b = [0u8; 4096];
    assert_eq!(v.read(MIB - 100, &mut b).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(v.write(MIB, &b).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(v.write(u64::MAX - 10, &b).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(v.trim(0, MIB + 1).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(v.write_zeroes(MIB, 1, false).unwrap_err().kind(), ErrorKind::OutOfRange);
    // After growing, the new range works and reads as zeros.
    pool.grow_volume("v", 2 * MIB).unwrap();
    v.read(MIB - 100, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0));
    v.write(MIB, &b).unwrap();
}

#[test]
fn trim_and_write_zeroes() {
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let data = pattern(7, 64 << 10);
    v.write(0, &data).unwrap();
    assert_eq!(pool.volume_info("v").unwrap().allocated, 64 << 10);
    // Trim with unaligned edges: only whole blocks go.
    v.trim(1000, 20_000).unwrap();
    let mut back = vec![0u8; 64 << 10];
    v.read(0, &mut back).unwrap();
    assert_eq!(&back[..4096], &data[..4096]);
    assert!(back[4096..20480].iter().all(|&b| b == 0));
    assert_eq!(&back[20480..], &data[20480..]);
    assert_eq!(pool.volume_info("v").unwrap().allocated, (64 << 10) - 4 * 4096);
    // Write-zeroes zeroes exactly its bytes.
    v.write_zeroes(30_000, 10_000, true).unwrap();
    v.read(0, &mut back).unwrap();
    assert!(back[30_000..40_000].iter().all(|&b| b == 0));
    assert_eq!(&back[29_990..30_000], &data[29_990..30_000]);
    assert_eq!(&back[40_000..40_010], &data[40_000..40_010]);
    v.write_zeroes(5, 3, false).unwrap();
    v.read(0, &mut back[..16]).unwrap();
    assert_eq!(&back[..5], &data[..5]);
    assert_eq!(&back[5..8], &[0, 0, 0]);
}

#[test]
fn data_survives_clean_reopen_and_deleted_volumes_stay_gone() {
    let (f, pool) = Fixture::new(16);
    pool.create_volume("keep", 2 * MIB).unwrap();
    pool.create_volume("drop", MIB).unwrap();
    let keep = pool.open_volume("keep").unwrap();
    let data = pattern(1, 2 * MIB as usize);
    keep.write(0, &data).unwrap();
    pool.open_volume("drop").unwrap().write(0, &pattern(2, 4096)).unwrap();
    pool.delete_volume("drop").unwrap();
    pool.close().unwrap();
    assert!(keep.write(0, &[0; 4096]).is_err(), "handles fail after close");

    let pool = f.reopen();
    assert_eq!(pool.recovery_report().batches_replayed, 0, "clean close leaves nothing to replay");
    let mut back = vec![0u8; 2 * MIB as usize];
    pool.open_volume("keep").unwrap().read(0, &mut back).unwrap();
    assert!(back == data);
    assert_eq!(pool.volume_info("drop").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(pool.volume_info("keep").unwrap().allocated, 2 * MIB);
}

#[test]
fn full_pool_gives_enospc_reads_work_and_trim_frees_space() {
    // 8 segments of 256 KiB, one held in reserve.
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", 8 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let chunk = pattern(3, 64 << 10);
    let mut written = 0u64;
    let err = loop {
        match v.write(written, &chunk) {
            Ok(()) => written += chunk.len() as u64,
            Err(e) => break e,
        }
        assert!(written < 8 * MIB, "the pool never filled");
    };
    assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
    assert_eq!(err.errno(), libc_enospc());
    assert!(written >= 5 * SEG, "most of the pool was usable (wrote {written})");
    // Reads still work.
    let mut back = vec![0u8; chunk.len()];
    v.read(0, &mut back).unwrap();
    assert_eq!(back, chunk);
    assert_eq!(pool.stats().free, 0);
    // Trim half of it: writes resume without a restart.
    v.trim(0, written / 2).unwrap();
    assert!(pool.stats().reclaimable > 0 || pool.stats().segments_free > 1);
    v.write(0, &chunk).unwrap();
    v.read(0, &mut back).unwrap();
    assert_eq!(back, chunk);
}

fn libc_enospc() -> i32 {
    28
}

#[test]
fn stats_account_for_space() {
    let (_f, pool) = Fixture::new(16);
    let s0 = pool.stats();
    assert_eq!(s0.size, 16 * SEG);
    assert_eq!(s0.live, 0);
    pool.create_volume("v", 4 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(1, MIB as usize)).unwrap();
    // Small writes may wait in memory for their batch; a flush writes it.
    v.flush().unwrap();
    let s = pool.stats();
    assert_eq!(s.live, MIB);
    assert!(s.used >= MIB);
    assert_eq!(s.client_bytes_written, MIB);
    assert!(s.media_bytes_written > MIB);
    v.write(0, &pattern(2, MIB as usize)).unwrap();
    let s = pool.stats();
    assert_eq!(s.live, MIB, "overwrites do not grow live data");
    assert!(s.reclaimable >= MIB / 2, "overwritten data in sealed segments is reclaimable: {s:?}");
    // Fully dead segments are released by a checkpoint, and not before one.
    let free_before = s.segments_free;
    v.write(2 * MIB, &pattern(3, 4096)).unwrap();
    assert!(pool.stats().segments_free <= free_before, "no dead segment is reused before a checkpoint");
    pool.checkpoint().unwrap();
    assert!(pool.stats().segments_free > free_before);
}

#[test]
fn file_pool_create_open_and_bad_images() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("pool.img");
    let meta = dir.path().join("meta");
    let opts = PoolOptions { segment_size: SEG, reserve_segments: 1, ..PoolOptions::default() };
    let pool = Pool::create(&img, &meta, 8 * MIB, opts.clone()).unwrap();
    pool.create_volume("v", MIB).unwrap();
    pool.open_volume("v").unwrap().write(4096, &pattern(9, 8192)).unwrap();
    pool.close().unwrap();
    // Refuses to overwrite.
    assert_eq!(Pool::create(&img, &meta, 8 * MIB, opts.clone()).unwrap_err().kind(), ErrorKind::AlreadyExists);

    let pristine = std::fs::read(&img).unwrap();
    let check_refused = |mutate: &dyn Fn(&mut Vec<u8>), want: &str| {
        let mut bytes = pristine.clone();
        mutate(&mut bytes);
        std::fs::write(&img, &bytes).unwrap();
        let err = Pool::open(&img, &meta, opts.clone()).unwrap_err();
        assert!(err.to_string().contains(want), "{want}: got {err}");
        assert_eq!(std::fs::read(&img).unwrap(), bytes, "a refused open changes nothing");
    };
    // Format 2 keeps a copy of the superblock in the second block: damage refuses the pool only
    // where both copies have it (one damaged copy is repaired: format_upgrade.rs). A newer
    // version is refused as it is.
    check_refused(&|b| (b[0], b[4096]) = (b'X', b'X'), "magic");
    check_refused(&|b| b[8] = 7, "version");
    check_refused(&|b| (b[200], b[4096 + 200]) = (b[200] ^ 1, b[4096 + 200] ^ 1), "checksum");
    check_refused(&|b| b.truncate(4 * MIB as usize), "truncated");
    check_refused(&|b| b.truncate(100), "too small");
    std::fs::write(&img, &pristine).unwrap();
    let pool = Pool::open(&img, &meta, opts.clone()).unwrap();
    let mut back = vec![0u8; 8192];
    pool.open_volume("v").unwrap().read(4096, &mut back).unwrap();
    assert_eq!(back, pattern(9, 8192));
    drop(pool);
    // A metadata directory of another pool is refused.
    let other = dir.path().join("other.img");
    drop(Pool::create(&other, &dir.path().join("meta2"), 8 * MIB, opts.clone()).unwrap());
    let err = Pool::open(&img, &dir.path().join("meta2"), opts.clone()).unwrap_err();
    assert!(err.to_string().contains("another pool"), "{err}");
    let err = Pool::open(&img, &dir.path().join("missing"), opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
}

#[test]
fn allocation_reports_mapped_runs() {
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    assert_eq!(v.allocation(0, MIB).unwrap(), vec![(MIB, false)]);
    v.write(8192, &pattern(1, 8192)).unwrap();
    assert_eq!(v.allocation(0, MIB).unwrap(), vec![(8192, false), (8192, true), (MIB - 16384, false)]);
    assert_eq!(v.allocation(100, 9000).unwrap(), vec![(8092, false), (908, true)]);
    v.trim(8192, 4096).unwrap();
    assert_eq!(v.allocation(8192, 8192).unwrap(), vec![(4096, false), (4096, true)]);
    assert_eq!(v.allocation(MIB, 1).unwrap_err().kind(), ErrorKind::OutOfRange);
}

#[test]
fn read_sparse_agrees_with_read_and_allocation() {
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(4096, &pattern(1, 2 * 4096)).unwrap();
    v.write(8 * 4096, &pattern(2, 4096)).unwrap();
    v.trim(4096, 4096).unwrap();
    // Unaligned ranges that start and end in data and in holes.
    for (offset, len) in [(0u64, 40960usize), (5000, 4000), (8200, 30000), (4096 * 8 + 7, 100), (100, 200)] {
        let mut a = vec![0xAAu8; len];
        let mut b = vec![0u8; len];
        let runs = v.read_sparse(offset, &mut a).unwrap();
        v.read(offset, &mut b).unwrap();
        assert_eq!(a, b, "data at {offset}+{len}");
        assert_eq!(runs, v.allocation(offset, len as u64).unwrap(), "allocation at {offset}+{len}");
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), len as u64);
    }
    let mut past = vec![0u8; 4096];
    assert_eq!(v.read_sparse(MIB - 2048, &mut past).unwrap_err().kind(), ferrite_engine::ErrorKind::OutOfRange);
}

#[test]
fn read_sparse_many_answers_each_range_as_read_sparse_does() {
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    for i in 0..64u64 {
        if i % 3 != 2 {
            v.write(i * 4096, &pattern(i, 4096)).unwrap();
        }
    }
    v.flush().unwrap();
    v.write(20 * 4096, &pattern(99, 4096)).unwrap(); // still in the open batch
    v.trim(9 * 4096, 4096).unwrap();
    // Ranges in any order, overlapping, unaligned, over holes, one past the end, one empty.
    let ranges =
        [(40 * 4096u64, 8192usize), (5000, 4000), (MIB - 2048, 4096), (0, 65536), (20 * 4096 + 7, 100), (4096, 0)];
    let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, len)| vec![0xAA; len]).collect();
    let mut parts: Vec<(u64, &mut [u8])> = ranges.iter().zip(&mut bufs).map(|(r, b)| (r.0, &mut b[..])).collect();
    let results = v.read_sparse_many(&mut parts);
    assert_eq!(results.len(), ranges.len());
    for ((&(offset, len), got), result) in ranges.iter().zip(&bufs).zip(results) {
        let mut want = vec![0u8; len];
        match v.read_sparse(offset, &mut want) {
            Ok(runs) => {
                assert_eq!(result.unwrap(), runs, "allocation at {offset}+{len}");
                assert_eq!(got, &want, "data at {offset}+{len}");
            }
            Err(e) => assert_eq!(result.unwrap_err().kind(), e.kind(), "error at {offset}+{len}"),
        }
    }
}

#[test]
fn read_only_volumes_refuse_client_writes_on_every_handle_and_stay_so() {
    let (f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let open = pool.open_volume("v").unwrap();
    open.write(0, &pattern(1, 8192)).unwrap();
    assert!(pool.set_read_only("v", true).unwrap().read_only);
    assert!(open.is_read_only(), "a handle opened before sees the change");
    type Write<'a> = Box<dyn Fn() -> ferrite_engine::Result<()> + 'a>;
    let writes: [(&str, Write); 4] = [
        ("write", Box::new(|| open.write(0, &[1; 4096]))),
        ("fua", Box::new(|| open.write_fua(100, &[1; 10]))),
        ("trim", Box::new(|| open.trim(0, MIB))),
        ("zeroes", Box::new(|| open.write_zeroes(0, 8192, false))),
    ];
    for (what, w) in &writes {
        let e = w().unwrap_err();
        assert_eq!((e.kind(), e.errno()), (ErrorKind::ReadOnly, libc::EROFS), "{what}: {e}");
    }
    let mut buf = vec![0u8; 8192];
    open.read(0, &mut buf).unwrap();
    assert_eq!(buf, pattern(1, 8192), "nothing reached the volume and reads still work");
    // The pool's owner writes past it; clients still cannot.
    pool.open_volume("v").unwrap().past_read_only().write(0, &[5; 4096]).unwrap();
    assert_eq!(pool.open_volume("v").unwrap().write(0, &[1; 4096]).unwrap_err().kind(), ErrorKind::ReadOnly);
    // Snapshots, clones and growth still work; a clone is writable.
    pool.create_snapshot("v", "s").unwrap();
    pool.grow_volume("v", 2 * MIB).unwrap();
    assert!(pool.volume_info("v").unwrap().read_only);
    assert!(!pool.clone_volume(ferrite_engine::Image::Volume("v"), "c").unwrap().read_only);
    drop(writes);
    drop(open);
    pool.close().unwrap();
    let pool = f.reopen();
    assert!(pool.volume_info("v").unwrap().read_only, "read-only survives a reopen");
    assert!(pool.open_volume("v").unwrap().is_read_only());
    assert_eq!(pool.open_volume("v").unwrap().write(0, &[1; 4096]).unwrap_err().kind(), ErrorKind::ReadOnly);
    assert!(!pool.set_read_only("v", false).unwrap().read_only);
    pool.open_volume("v").unwrap().write(0, &[2; 4096]).unwrap();
    assert_eq!(pool.set_read_only("nope", true).unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn volume_limits_delay_client_io_on_every_handle_and_survive_a_reopen() {
    use ferrite_engine::{IoKind, QosLimits};
    use std::time::{Duration, Instant};
    let (f, pool) = Fixture::new(64);
    pool.create_volume("v", MIB).unwrap();
    pool.create_volume("free", MIB).unwrap();
    let open = pool.open_volume("v").unwrap();
    // 100 writes/s with a 100 ms burst: 40 writes take about (40 - 10) / 100 s.
    let limits = QosLimits { write_iops: 100, burst_ms: 100, ..Default::default() };
    assert_eq!(pool.set_qos("v", limits).unwrap().qos, limits);
    let timed = |f: &dyn Fn()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };
    let took = timed(&|| (0..40).for_each(|i| open.write(i * 4096, &[1; 4096]).unwrap()));
    assert!(took > Duration::from_millis(270) && took < Duration::from_millis(600), "{took:?}");
    assert!(pool.qos_stats("v").unwrap().throttled_ops >= 25);
    // Reads are not limited by a write limit; another volume is not limited at all; the
    // owner's handle writes past the limits.
    let mut buf = vec![0u8; 4096];
    assert!(
        timed(&|| (0..200).for_each(|_| pool.open_volume("v").unwrap().read(0, &mut buf.clone()).unwrap()))
            < Duration::from_millis(200)
    );
    let free = pool.open_volume("free").unwrap();
    assert!(timed(&|| (0..200).for_each(|i| free.write(i * 4096, &[2; 4096]).unwrap())) < Duration::from_millis(500));
    let owner = pool.open_volume("v").unwrap().past_read_only();
    assert!(timed(&|| (0..100).for_each(|i| owner.write(i * 4096, &[3; 4096]).unwrap())) < Duration::from_millis(500));
    // A handle whose caller paces: its calls do not wait; reserve says how long the caller must.
    let paced = pool.open_volume("v").unwrap().caller_paces();
    assert!(timed(&|| (0..50).for_each(|i| paced.write(i * 4096, &[4; 4096]).unwrap())) < Duration::from_millis(200));
    let last = (0..30).map(|_| paced.reserve(IoKind::Write, 4096)).max().unwrap();
    assert!(last > Duration::from_millis(150), "30 places at 100/s: {last:?}");
    open.read(0, &mut buf).unwrap();
    drop((open, free, owner, paced));
    pool.close().unwrap();
    let pool = f.reopen();
    assert_eq!(pool.volume_info("v").unwrap().qos, limits, "limits survive a reopen");
    assert_eq!(pool.set_qos("v", QosLimits::default()).unwrap().qos, QosLimits::default());
    let open = pool.open_volume("v").unwrap();
    assert!(timed(&|| (0..200).for_each(|i| open.write(i * 4096, &[5; 4096]).unwrap())) < Duration::from_millis(500));
    assert_eq!(pool.set_qos("nope", limits).unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn making_a_volume_read_only_waits_for_the_writes_inside() {
    let (_f, pool) = Fixture::new(64);
    pool.create_volume("v", MIB).unwrap();
    let pool = std::sync::Arc::new(pool);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..4u64)
        .map(|t| {
            let (pool, stop) = (pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let v = pool.open_volume("v").unwrap();
                let mut acked = Vec::new();
                for i in 0u64.. {
                    let off = ((i * 4 + t) % 256) * 4096;
                    match v.write(off, &pattern(i * 4 + t, 4096)) {
                        Ok(()) => acked.push((off, i * 4 + t)),
                        Err(e) => {
                            assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
                            break;
                        }
                    }
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                }
                acked
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(50));
    pool.set_read_only("v", true).unwrap();
    // A snapshot taken now holds every write that was acknowledged.
    pool.create_snapshot("v", "frozen").unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let snap = pool.open_snapshot("frozen").unwrap();
    let mut last = std::collections::HashMap::new();
    for w in writers {
        for (off, seed) in w.join().unwrap() {
            last.insert(off, seed); // offsets are per writer, so the last ack is the content
        }
    }
    assert!(!last.is_empty());
    for (off, seed) in last {
        let mut buf = vec![0u8; 4096];
        snap.read(off, &mut buf).unwrap();
        assert_eq!(buf, pattern(seed, 4096), "acknowledged write at {off} missing from the snapshot");
    }
}

#[test]
fn a_writers_buffer_is_its_own_again_once_write_returns() {
    // Aligned writes are read in place from the caller's buffer (no copy before the batch): the
    // log must be done with it when `write` returns, whichever path the write took (the open
    // batch for small ones, a batch of its own for large ones, FUA or not).
    let (_f, pool) = Fixture::new(160);
    pool.create_volume("v", 8 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let v = v.clone();
            s.spawn(move || {
                let mut buf = vec![0u8; 512 << 10];
                for k in 0..24u64 {
                    let len = [4096, 128 << 10, 512 << 10][(k % 3) as usize];
                    let off = t * 2 * MIB + (k % 4) * (512 << 10);
                    buf[..len].copy_from_slice(&pattern(t * 100 + k, len));
                    if k % 5 == 0 { v.write_fua(off, &buf[..len]) } else { v.write(off, &buf[..len]) }.unwrap();
                    buf.fill(0xEE); // scribbled over at once: a lingering reference would write this
                }
            });
        }
    });
    for t in 0..4u64 {
        let mut model = vec![0u8; 2 * MIB as usize];
        for k in 0..24u64 {
            let len = [4096, 128 << 10, 512 << 10][(k % 3) as usize];
            let at = ((k % 4) * (512 << 10)) as usize;
            model[at..at + len].copy_from_slice(&pattern(t * 100 + k, len));
        }
        let mut back = vec![0u8; 2 * MIB as usize];
        v.read(t * 2 * MIB, &mut back).unwrap();
        assert!(back == model, "writer {t}'s range");
    }
}

/// A filler that writes 64 KiB pieces of a pattern the first time a request touches them, and
/// counts what it was asked.
#[derive(Debug)]
struct PatternFill {
    writer: ferrite_engine::Volume,
    done: std::sync::Mutex<std::collections::BTreeSet<u64>>,
    asked: std::sync::atomic::AtomicU64,
}

const PIECE: u64 = 64 << 10;

impl ferrite_engine::Fill for PatternFill {
    fn fill(&self, offset: u64, len: u64, access: ferrite_engine::Access) -> ferrite_engine::Result<()> {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for piece in offset / PIECE..(offset + len).div_ceil(PIECE) {
            let whole = offset <= piece * PIECE && (piece + 1) * PIECE <= offset + len;
            if self.done.lock().unwrap().insert(piece) && !(whole && access == ferrite_engine::Access::Trim) {
                self.writer.write(piece * PIECE, &pattern(piece, PIECE as usize))?;
            }
        }
        Ok(())
    }

    fn pending(&self, offset: u64, len: u64) -> ferrite_engine::Result<Vec<(u64, u64)>> {
        let done = self.done.lock().unwrap();
        let pieces = offset / PIECE..(offset + len).div_ceil(PIECE);
        Ok(pieces.filter(|p| !done.contains(p)).map(|p| (p * PIECE, PIECE)).collect())
    }
}

#[test]
fn a_fill_brings_each_range_to_its_content_before_clients_touch_it() {
    let (_f, pool) = Fixture::new(8);
    pool.create_volume("v", MIB).unwrap();
    let writer = pool.open_volume("v").unwrap().past_read_only();
    let fill = std::sync::Arc::new(PatternFill { writer, done: Default::default(), asked: Default::default() });
    pool.set_fill("v", Some(fill.clone())).unwrap();
    let v = pool.open_volume("v").unwrap();
    // A read sees the filler's data; a write over a piece not yet filled keeps the rest of it.
    let mut buf = vec![0u8; 4096];
    v.read(3 * 65536 + 4096, &mut buf).unwrap();
    assert_eq!(buf, pattern(3, 65536)[4096..8192]);
    v.write(5 * 65536, &[7u8; 512]).unwrap();
    let mut piece = vec![0u8; 65536];
    v.read(5 * 65536, &mut piece).unwrap();
    assert!(piece[..512].iter().all(|&b| b == 7));
    assert_eq!(piece[512..], pattern(5, 65536)[512..]);
    // An allocation query reports what is not filled yet as data, without filling it; a trim of
    // a whole piece needs none of its content, one of part of a piece does.
    assert_eq!(v.allocation(9 * 65536, 65536).unwrap(), [(65536, true)]);
    assert_eq!(v.allocation_depth(9 * 65536, 65536).unwrap(), [(65536, 1)]);
    v.trim(10 * 65536, 65536).unwrap();
    v.trim(11 * 65536 + 4096, 8192).unwrap();
    assert_eq!(fill.done.lock().unwrap().iter().copied().collect::<Vec<_>>(), [3, 5, 10, 11]);
    let mut piece = vec![0u8; 65536];
    v.read(10 * 65536, &mut piece).unwrap();
    assert!(piece.iter().all(|&b| b == 0), "the trimmed piece reads as zeros");
    v.read(11 * 65536, &mut piece).unwrap();
    assert_eq!((&piece[..4096], &piece[12_288..]), (&pattern(11, 65536)[..4096], &pattern(11, 65536)[12_288..]));
    // No snapshot or clone of a volume whose content is not all there.
    let e = pool.create_snapshot("v", "s").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert_eq!(e.errno(), libc::EBUSY);
    pool.set_fill("v", None).unwrap();
    let asked = fill.asked.load(std::sync::atomic::Ordering::Relaxed);
    v.read(0, &mut buf).unwrap();
    assert_eq!(fill.asked.load(std::sync::atomic::Ordering::Relaxed), asked, "asked after it was removed");
    assert!(buf.iter().all(|&b| b == 0));
    pool.create_snapshot("v", "s").unwrap();
}
