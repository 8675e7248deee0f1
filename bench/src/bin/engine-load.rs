//! Runs one workload against the engine (io_uring backend, file-backed pool) for a fixed time
//! and prints one line: `<workload> <iops> <MiB/s> <cpu-seconds>`. Used by `compare_raw.sh`.
//!
//! Usage: engine-load <dir> <workload-name> <seconds> <volume-bytes>

use std::time::Duration;

use ferrite_bench::{WORKLOADS, prefill, run, setup};

fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: engine-load <dir> <workload> <seconds> <volume-bytes>");
        std::process::exit(2);
    }
    let dir = std::path::Path::new(&args[1]);
    let Some(w) = WORKLOADS.iter().find(|w| w.name == args[2]).copied() else {
        eprintln!("unknown workload {:?}; one of: {:?}", args[2], WORKLOADS.map(|w| w.name));
        std::process::exit(2);
    };
    let secs: f64 = args[3].parse().expect("seconds");
    let vol_size: u64 = args[4].parse().expect("volume bytes");
    // Room for the prefill plus everything a 5-10 s run appends (no cleaner yet).
    let (pool, vol) = setup(dir, vol_size * 3 + (2 << 30), vol_size);
    if !w.write || !w.random {
        prefill(&vol);
    }
    let cpu0 = cpu_seconds();
    let (ops, elapsed) = run(&vol, w, u64::MAX, Duration::from_secs_f64(secs));
    if w.write {
        vol.flush().expect("flush");
    }
    let cpu = cpu_seconds() - cpu0;
    let t = elapsed.as_secs_f64();
    let iops = ops as f64 / t;
    println!("{} {:.0} {:.1} {:.2}", w.name, iops, iops * w.block as f64 / (1 << 20) as f64, cpu);
    drop(vol);
    pool.close().expect("close");
}
