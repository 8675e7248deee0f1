//! Shared workload code for the engine benches: the criterion bench (`benches/engine.rs`) and
//! the `engine-load` binary that `compare_raw.sh` runs beside fio.

pub mod sim;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferrite_engine::{Pool, PoolOptions, Volume};

/// One fio-like workload.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub name: &'static str,
    pub block: usize,
    pub random: bool,
    pub write: bool,
    /// Requests in flight: one issuing thread per request for the blocking engine API.
    pub qd: usize,
}

/// The workloads of the foundation issue.
pub const WORKLOADS: [Workload; 9] = [
    Workload { name: "randwrite-4k-qd1", block: 4096, random: true, write: true, qd: 1 },
    Workload { name: "randwrite-4k-qd32", block: 4096, random: true, write: true, qd: 32 },
    Workload { name: "randread-4k-qd1", block: 4096, random: true, write: false, qd: 1 },
    Workload { name: "randread-4k-qd32", block: 4096, random: true, write: false, qd: 32 },
    Workload { name: "seqwrite-128k-qd1", block: 128 << 10, random: false, write: true, qd: 1 },
    Workload { name: "seqread-128k-qd1", block: 128 << 10, random: false, write: false, qd: 1 },
    Workload { name: "seqwrite-1m-qd1", block: 1 << 20, random: false, write: true, qd: 1 },
    Workload { name: "seqwrite-128k-qd16", block: 128 << 10, random: false, write: true, qd: 16 },
    Workload { name: "seqwrite-1m-qd16", block: 1 << 20, random: false, write: true, qd: 16 },
];

/// Creates a pool (io_uring backend) with one volume of `vol_size` bytes on a file that is
/// first written in full, like a block device (or the raw file fio is compared against): a fresh
/// sparse file would also measure ext4 converting unwritten extents on first write.
pub fn setup(dir: &Path, pool_size: u64, vol_size: u64) -> (Pool, Volume) {
    setup_with(dir, pool_size, vol_size, PoolOptions::default())
}

/// As [`setup`], with pool options.
pub fn setup_with(dir: &Path, pool_size: u64, vol_size: u64, opts: PoolOptions) -> (Pool, Volume) {
    let path = dir.join("pool.img");
    {
        let mut f = std::fs::File::create(&path).expect("create pool file");
        let zeros = vec![0u8; 8 << 20];
        let mut left = pool_size;
        while left > 0 {
            let n = usize::try_from(left.min(zeros.len() as u64)).expect("bounded");
            std::io::Write::write_all(&mut f, &zeros[..n]).expect("precondition pool file");
            left -= n as u64;
        }
        f.sync_all().expect("sync pool file");
    }
    let backend = std::sync::Arc::new(ferrite_engine::io::UringBackend::open(&path).expect("open pool file"));
    let pool = Pool::create_on(backend, &dir.join("meta"), opts).expect("create pool");
    // FERRITE_BENCH_ENCRYPT=1: the same volume, encrypted (AES-256-XTS).
    if std::env::var("FERRITE_BENCH_ENCRYPT").is_ok_and(|v| v == "1") {
        let kek = ferrite_crypt::Kek::new("bench", [7; 32]).expect("key");
        pool.create_encrypted_volume("bench", vol_size, &kek).expect("create volume");
    } else {
        pool.create_volume("bench", vol_size).expect("create volume");
    }
    let vol = pool.open_volume("bench").expect("open volume");
    (pool, vol)
}

/// Writes the whole volume once so reads hit real data.
pub fn prefill(vol: &Volume) {
    let size = vol.size().expect("size");
    let chunk = vec![0x5Au8; 1 << 20];
    let mut off = 0;
    while off < size {
        let n = usize::try_from((size - off).min(chunk.len() as u64)).expect("below 1 MiB");
        vol.write(off, &chunk[..n]).expect("prefill");
        off += n as u64;
    }
    vol.flush().expect("flush");
}

/// The next value of a xorshift sequence: random offsets without a dependency.
pub fn next_random(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Runs `w` until `ops` requests complete or `limit` passes; returns (requests, elapsed).
pub fn run(vol: &Volume, w: Workload, ops: u64, limit: Duration) -> (u64, Duration) {
    run_with(vol, w, ops, limit, |vol, off, buf| {
        if w.write {
            vol.write(off, buf).expect("bench write");
        } else {
            vol.read(off, buf).expect("bench read");
        }
    })
}

/// Like [`run`], with `io(volume, offset, buffer of w.block bytes)` doing each request (the
/// ublk handler bench sends them through a ublk descriptor instead).
pub fn run_with(
    vol: &Volume,
    w: Workload,
    ops: u64,
    limit: Duration,
    io: impl Fn(&Volume, u64, &mut [u8]) + Sync,
) -> (u64, Duration) {
    let size = vol.size().expect("size");
    let slots = size / w.block as u64;
    let issued = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..w.qd {
            let (vol, issued, io) = (vol.clone(), &issued, &io);
            s.spawn(move || {
                let mut buf = vec![0xA5u8; w.block];
                let mut x = 0x1234_5678_9ABC_DEF1u64 ^ ((t as u64 + 1) << 32);
                loop {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= ops || start.elapsed() >= limit {
                        break;
                    }
                    let slot = if w.random { next_random(&mut x) % slots } else { n % slots };
                    io(&vol, slot * w.block as u64, &mut buf);
                }
            });
        }
    });
    let done = issued.load(Ordering::Relaxed).min(ops);
    (done, start.elapsed())
}
