//! Write amplification and latency under the cleaner: a volume filling 80% of the pool is
//! written once, then overwritten at random with 4 KiB writes at QD32 for a fixed time, so the
//! background cleaner runs continuously. The traffic is uniform, 80/20 (80% of the writes to 20%
//! of the blocks) or Zipf (s = 0.99); the cleaner's moves go to a head of their own unless
//! `mixed` is given. Next to the engine's figure it prints what a greedy cleaner reaches on the
//! same geometry and traffic in a simulation (`ferrite_bench::sim`), with and without separation. Prints write amplification (bytes written to media /
//! bytes written by clients, over the overwrite phase) and write latency percentiles while the
//! cleaner was running and while it was idle, measured in the same run. The run starts from a
//! sequentially written volume (every segment full), so the first overwrites make the cleaner move
//! nearly full segments; the amplification per sixth of the run shows when the steady state is
//! reached, and the last half's figure is the steady-state one.
//!
//! Usage: cleaner-load <dir> [seconds=60] [pool-bytes=2G] [fill-percent=80] [uniform|80/20|zipf] [mixed]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferrite_bench::sim::{Geometry, Picker, Policy, Traffic, simulate};
use ferrite_bench::{prefill, setup_with};
use ferrite_engine::{ErrorKind, PoolOptions};

/// The `per_mille`-th quantile (nearest rank).
fn percentile(v: &mut [u32], per_mille: usize) -> u32 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[(v.len() - 1) * per_mille.min(1000) / 1000]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 2 {
        eprintln!("usage: cleaner-load <dir> [seconds] [pool-bytes] [fill-percent] [uniform|80/20|zipf] [mixed]");
        std::process::exit(2);
    }
    let arg = |i: usize, d: u64| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(d);
    let secs = arg(2, 60);
    let pool_size = arg(3, 2 << 30);
    let fill = arg(4, 80);
    let traffic: Traffic = args.get(5).map_or(Ok(Traffic::Uniform), |t| t.parse()).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let separate = args.get(6).map(String::as_str) != Some("mixed");
    let opts = PoolOptions { segment_size: 4 << 20, cold_head: separate, ..PoolOptions::default() };
    let vol_size = (pool_size - (1 << 20)) / 100 * fill / 4096 * 4096;
    eprintln!("preconditioning a {} MiB pool file and writing the {} MiB volume...", pool_size >> 20, vol_size >> 20);
    let dir = std::path::Path::new(&args[1]);
    let (pool, vol) = setup_with(dir, pool_size, vol_size, opts);
    prefill(&vol);
    let pool = Arc::new(pool);
    let s0 = pool.stats();
    let cleaning = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (pool, cleaning, stop) = (Arc::clone(&pool), Arc::clone(&cleaning), Arc::clone(&stop));
        // (client, media) bytes at each sixth of the run.
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut marks = vec![(0u64, 0u64)];
            while !stop.load(Ordering::Relaxed) {
                let st = pool.stats();
                cleaning.store(st.cleaner_active, Ordering::Relaxed);
                if t0.elapsed().as_secs_f64() >= secs as f64 * marks.len() as f64 / 6.0 && marks.len() < 6 {
                    marks.push((st.client_bytes_written, st.media_bytes_written));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            marks
        })
    };
    let enospc = AtomicU64::new(0);
    let blocks = vol_size / 4096;
    let picker = Picker::new(traffic, blocks);
    let start = Instant::now();
    eprintln!("overwriting at random ({traffic}, 4 KiB, QD32) for {secs} s...");
    let lat: Vec<(Vec<u32>, Vec<u32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..32u64)
            .map(|t| {
                let (vol, cleaning, enospc, picker) = (vol.clone(), &cleaning, &enospc, &picker);
                s.spawn(move || {
                    let (mut busy, mut idle) = (Vec::new(), Vec::new());
                    let buf = vec![0xC3u8; 4096];
                    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
                    while start.elapsed() < Duration::from_secs(secs) {
                        let (r1, r2) = (ferrite_bench::next_random(&mut x), ferrite_bench::next_random(&mut x));
                        let t0 = Instant::now();
                        match vol.write(picker.pick(r1, r2) * 4096, &buf) {
                            Ok(()) => {}
                            Err(e) if e.kind() == ErrorKind::NoSpace => {
                                enospc.fetch_add(1, Ordering::Relaxed);
                                std::thread::sleep(Duration::from_millis(1));
                                continue;
                            }
                            Err(e) => panic!("write failed: {e}"),
                        }
                        let us = u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX);
                        if cleaning.load(Ordering::Relaxed) { busy.push(us) } else { idle.push(us) }
                    }
                    (busy, idle)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("writer")).collect()
    });
    stop.store(true, Ordering::Relaxed);
    let mut marks = sampler.join().expect("sampler");
    let s1 = pool.stats();
    marks[0] = (s0.client_bytes_written, s0.media_bytes_written);
    marks.push((s1.client_bytes_written, s1.media_bytes_written));
    let wa = |a: (u64, u64), b: (u64, u64)| (b.1 - a.1) as f64 / (b.0 - a.0).max(1) as f64;
    let per_sixth: Vec<String> = marks.windows(2).map(|w| format!("{:.2}", wa(w[0], w[1]))).collect();
    let (mut busy, mut idle): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
    for (b, i) in lat {
        busy.extend(b);
        idle.extend(i);
    }
    let client = s1.client_bytes_written - s0.client_bytes_written;
    let media = s1.media_bytes_written - s0.media_bytes_written;
    let ops = busy.len() + idle.len();
    println!(
        "pool {} MiB, volume {} MiB ({fill}% full), {secs} s of {traffic} 4 KiB overwrites at QD32, cleaner moves {}",
        pool_size >> 20,
        vol_size >> 20,
        if separate { "to a cold head" } else { "mixed with client writes" }
    );
    println!(
        "ops {ops} ({:.0}/s), client {} MiB, media {} MiB, write amplification {:.2}",
        ops as f64 / secs as f64,
        client >> 20,
        media >> 20,
        media as f64 / client.max(1) as f64
    );
    println!(
        "write amplification per sixth of the run: {}; steady state (last half) {:.2}",
        per_sixth.join(" "),
        wa(marks[marks.len() / 2], marks[marks.len() - 1])
    );
    println!(
        "cleaner: {} segments cleaned, {} MiB moved, ENOSPC retries {}",
        s1.cleaner_segments_cleaned - s0.cleaner_segments_cleaned,
        (s1.cleaner_bytes_moved - s0.cleaner_bytes_moved) >> 20,
        enospc.load(Ordering::Relaxed)
    );
    // The same geometry in the simulation: as many writes to warm up as the engine took, then
    // as many measured.
    let geometry = Geometry {
        segments: usize::try_from(s1.segments).expect("small"),
        blocks_per_seg: usize::try_from(s1.segment_size / 4096).expect("small"),
        volume_blocks: blocks,
        low_water: 4,
    };
    let n = (client / 4096).max(blocks);
    let sim = |p, sep| simulate(geometry, traffic, p, sep, n, n, 7).write_amplification;
    println!(
        "simulation, same geometry and traffic: greedy {:.2} mixed, {:.2} separated; cost-benefit {:.2} mixed, {:.2} separated",
        sim(Policy::Greedy, 0),
        sim(Policy::Greedy, 1),
        sim(Policy::CostBenefit, 0),
        sim(Policy::CostBenefit, 1),
    );
    let (nb, ni) = (busy.len(), idle.len());
    println!(
        "latency µs while cleaning ({nb} ops): p50 {} p99 {} p99.9 {}",
        percentile(&mut busy, 500),
        percentile(&mut busy, 990),
        percentile(&mut busy, 999)
    );
    println!(
        "latency µs while idle     ({ni} ops): p50 {} p99 {} p99.9 {}",
        percentile(&mut idle, 500),
        percentile(&mut idle, 990),
        percentile(&mut idle, 999)
    );
    drop(vol);
    match Arc::try_unwrap(pool) {
        Ok(p) => p.close().expect("close"),
        Err(_) => unreachable!("all users joined"),
    }
}
