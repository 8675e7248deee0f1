//! Snapshot benches, under chains of growing depth (from `FERRITE_BENCH_DEPTHS`, default `1,33`,
//! e.g. `1,33,1001,10001`; the first 32 layers and every 100th after hold 1 MiB of random
//! overwrites, so the chain's maps are real): block resolution alone (`allocation` of a random
//! 4 KiB, no media I/O), and 4 KiB random reads. Then the time to take a snapshot of a small and
//! of a 100 GiB thin volume (O(1): the same within noise).

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ferrite_bench::{WORKLOADS, next_random, prefill, run, setup};

const VOL: u64 = 256 << 20;

fn snapshots(c: &mut Criterion) {
    let dir =
        tempfile::tempdir_in(std::env::var("FERRITE_BENCH_DIR").unwrap_or_else(|_| ".".into())).expect("bench dir");
    let (pool, vol) = setup(dir.path(), 2 << 30, VOL);
    prefill(&vol);
    let reads: Vec<_> = WORKLOADS.iter().filter(|w| w.random && !w.write).copied().collect();
    let overwrite = WORKLOADS.iter().find(|w| w.random && w.write && w.qd == 1).copied().expect("a 4k write");
    let mut g = c.benchmark_group("chain");
    g.sample_size(20).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    let mut taken = 0;
    let depths: Vec<usize> = std::env::var("FERRITE_BENCH_DEPTHS")
        .unwrap_or_else(|_| "1,33".into())
        .split(',')
        .map(|d| d.trim().parse().expect("FERRITE_BENCH_DEPTHS: chain depths like 1,33,1001"))
        .collect();
    for depth in depths {
        while pool.volume_info("bench").expect("info").chain_depth < depth {
            if taken < 32 || taken % 100 == 0 {
                run(&vol, overwrite, 256, Duration::from_secs(60));
            }
            pool.create_snapshot("bench", &format!("s{taken}")).expect("snapshot");
            taken += 1;
        }
        g.bench_function(BenchmarkId::new("resolve-4k", format!("depth-{depth}")), |b| {
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            b.iter(|| vol.allocation((next_random(&mut x) % (VOL / 4096)) * 4096, 4096).expect("allocation"));
        });
        for w in &reads {
            g.bench_with_input(BenchmarkId::new(w.name, format!("depth-{depth}")), w, |b, w| {
                b.iter_custom(|iters| run(&vol, *w, iters, Duration::from_secs(3600)).1);
            });
        }
    }
    g.finish();
    let mut g = c.benchmark_group("snapshot-create");
    g.sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    pool.create_volume("big", 100 << 30).expect("100 GiB thin volume");
    for name in ["bench", "big"] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut t = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    pool.create_snapshot(name, &format!("s{taken}")).expect("snapshot");
                    t += start.elapsed();
                    taken += 1;
                }
                t
            });
        });
    }
    g.finish();
    drop(vol);
    pool.close().expect("close");
}

criterion_group!(benches, snapshots);
criterion_main!(benches);
