//! What one request costs the engine in CPU, with the store out of the way: a pool on the
//! in-memory backend, 4 KiB random and 128 KiB sequential reads and writes through the paths
//! the NBD and ublk servers use (reads: `Volume::start_reads`, the store reads, `Reads::finish`;
//! writes: `Volume::write`, which a small write completes in the open batch, and the flusher
//! writes the batch behind it), one request at a time.
//!
//! The figure criterion reports as "time" is the process's CPU time per request (every thread:
//! the flusher's share of a write, and checksums, are in it), not wall time. A line per workload
//! also prints CPU and wall nanoseconds per request (median of 5 runs), for the record.
//! `FERRITE_BENCH_ONLY=write-4k` runs only the workloads whose name contains it (for a profile).

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use ferrite_bench::next_random;
use ferrite_engine::io::MemoryBackend;
use ferrite_engine::{Pool, PoolOptions, Volume};

const VOL: u64 = 256 << 20;
/// Large enough that the cleaner has little to move (the volume is a sixteenth of it).
const POOL: u64 = 4 << 30;

#[derive(Clone, Copy)]
struct Job {
    name: &'static str,
    block: usize,
    random: bool,
    write: bool,
}

const JOBS: [Job; 4] = [
    Job { name: "read-4k-random", block: 4 << 10, random: true, write: false },
    Job { name: "write-4k-random", block: 4 << 10, random: true, write: true },
    Job { name: "read-128k-sequential", block: 128 << 10, random: false, write: false },
    Job { name: "write-128k-sequential", block: 128 << 10, random: false, write: true },
];

/// CPU time of every thread of this process.
fn process_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &raw mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
    Duration::new(u64::try_from(ts.tv_sec).expect("positive"), u32::try_from(ts.tv_nsec).expect("below 1e9"))
}

/// One read as the servers do it on a store that is not a file.
fn read(vol: &Volume, offset: u64, buf: &mut [u8]) {
    let mut reads = vol.start_reads(&[(offset, buf.len())]).expect("start reads");
    let media = reads.read_media();
    let out = reads.finish(media, &mut [buf]).pop().expect("one outcome");
    out.expect("read");
}

/// Runs `n` requests of `job`; returns (CPU, wall) time.
fn run(vol: &Volume, job: Job, n: u64, x: &mut u64, seq: &mut u64, buf: &mut [u8]) -> (Duration, Duration) {
    let slots = VOL / job.block as u64;
    let (cpu, wall) = (process_cpu(), Instant::now());
    for _ in 0..n {
        let slot = if job.random { next_random(x) % slots } else { *seq % slots };
        *seq += 1;
        let offset = slot * job.block as u64;
        if job.write {
            vol.write(offset, buf).expect("write");
        } else {
            read(vol, offset, buf);
        }
    }
    (process_cpu() - cpu, wall.elapsed())
}

fn request_cost(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(std::env::var("FERRITE_BENCH_DIR").unwrap_or_else(|_| "/dev/shm".into()))
        .expect("bench dir");
    let pool =
        Pool::create_on(Arc::new(MemoryBackend::committed(POOL)), &dir.path().join("meta"), PoolOptions::default())
            .expect("create pool");
    pool.create_volume("bench", VOL).expect("create volume");
    let vol = pool.open_volume("bench").expect("open volume");
    ferrite_bench::prefill(&vol);
    let (mut x, mut seq) = (0x9E37_79B9_7F4A_7C15u64, 0u64);
    let mut g = c.benchmark_group("request_cost");
    g.sample_size(30).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let mut lines = Vec::new();
    let only = std::env::var("FERRITE_BENCH_ONLY").unwrap_or_default();
    for job in JOBS.into_iter().filter(|j| j.name.contains(&only)) {
        let mut buf = vec![0xA5u8; job.block];
        g.bench_function(job.name, |b| b.iter_custom(|n| run(&vol, job, n, &mut x, &mut seq, &mut buf).0));
        let n = if job.block > 4096 { 5_000 } else { 50_000 };
        let mut runs: Vec<(Duration, Duration)> =
            (0..5).map(|_| run(&vol, job, n, &mut x, &mut seq, &mut buf)).collect();
        runs.sort_unstable();
        let (cpu, wall) = runs[2];
        let per = |d: Duration| d.as_nanos() / u128::from(n);
        lines.push(format!(
            "request-cost {:<22} {:>7} ns CPU/request {:>7} ns wall/request",
            job.name,
            per(cpu),
            per(wall)
        ));
    }
    g.finish();
    for l in lines {
        println!("{l}");
    }
    drop(vol);
    pool.close().expect("close");
}

criterion_group!(benches, request_cost);
criterion_main!(benches);
