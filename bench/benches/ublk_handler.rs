//! The ublk request handler over the engine, without a kernel: a descriptor (op_flags, start
//! sector, sector count) in, the completion value out, on the io_uring file backend. The same
//! workloads as direct engine calls run alongside, so the handler's own cost shows as a ratio.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ferrite_bench::{WORKLOADS, Workload, prefill, run, run_with, setup};
use ferrite_engine::Volume;
use ferrite_ublk::Request;
use libublk::sys;

const VOL: u64 = 256 << 20;

/// Every I/O of `w` as a decoded ublk descriptor, executed by the handler.
fn run_descriptors(vol: &Volume, w: Workload, ops: u64) -> Duration {
    let sectors = u32::try_from(w.block >> 9).expect("block");
    let op = if w.write { sys::UBLK_IO_OP_WRITE } else { sys::UBLK_IO_OP_READ };
    let expect = i32::try_from(w.block).expect("block");
    run_with(vol, w, ops, Duration::from_secs(3600), |vol, off, buf| {
        let req = Request::decode(op, off / 512, sectors).expect("decode");
        assert_eq!(req.execute(vol, buf), expect);
    })
    .1
}

fn ublk_handler(c: &mut Criterion) {
    let dir =
        tempfile::tempdir_in(std::env::var("FERRITE_BENCH_DIR").unwrap_or_else(|_| ".".into())).expect("bench dir");
    let (pool, vol) = setup(dir.path(), 4 << 30, VOL);
    prefill(&vol);
    let mut g = c.benchmark_group("ublk_handler");
    g.sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for w in WORKLOADS.into_iter().filter(|w| w.block == 4096) {
        g.throughput(Throughput::Bytes(w.block as u64));
        g.bench_function(format!("{}/descriptor", w.name), |b| b.iter_custom(|n| run_descriptors(&vol, w, n)));
        g.bench_function(format!("{}/engine", w.name), |b| {
            b.iter_custom(|n| run(&vol, w, n, Duration::from_secs(3600)).1)
        });
    }
    g.finish();
    drop(vol);
    pool.close().expect("close");
}

criterion_group!(benches, ublk_handler);
criterion_main!(benches);
