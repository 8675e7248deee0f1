//! Criterion benches of the engine's hot path on the io_uring backend over a file: 4 KiB random
//! write and read at QD1 and QD32, 128 KiB sequential write and read.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ferrite_bench::{WORKLOADS, prefill, run, setup};

const VOL: u64 = 256 << 20;

fn engine(c: &mut Criterion) {
    let dir =
        tempfile::tempdir_in(std::env::var("FERRITE_BENCH_DIR").unwrap_or_else(|_| ".".into())).expect("bench dir");
    let (pool, vol) = setup(dir.path(), 6 << 30, VOL);
    prefill(&vol);
    let mut g = c.benchmark_group("engine");
    g.sample_size(20).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for w in WORKLOADS {
        g.throughput(Throughput::Bytes(w.block as u64));
        g.bench_function(w.name, |b| {
            b.iter_custom(|iters| {
                let (_, t) = run(&vol, w, iters, Duration::from_secs(3600));
                t
            });
        });
    }
    g.finish();
    drop(vol);
    pool.close().expect("close");
}

criterion_group!(benches, engine);
criterion_main!(benches);
