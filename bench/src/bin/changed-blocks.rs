//! Changed-block listing for incremental backups, in one run: a thin volume (default 100 GiB)
//! with a fraction (default 1%) of its 4 KiB blocks written at random between two snapshots.
//! Times, as medians of ROUNDS:
//! - the delta listing (`Pool::changed_ranges`: what the admin API's ChangedRanges, CSI
//!   GetMetadataDelta and `ferrite snapshot diff` serve);
//! - the same through 32 MiB windows (`Volume::changed`: NBD's `ferrite:changed:` block status);
//! - a full read of the changed data (what the backup then copies).
//!
//!   changed-blocks DIR [VOLUME_GIB] [PERCENT] [ROUNDS]

#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)] // sizes and rates

use std::time::{Duration, Instant};

use ferrite_engine::{Image, PoolOptions};

const B: u64 = 4096;
const WINDOW: u64 = 32 << 20;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(args.get(1).expect("usage: changed-blocks DIR [VOLUME_GIB] [PERCENT] [ROUNDS]"));
    let gib: u64 = args.get(2).map_or(100, |a| a.parse().expect("VOLUME_GIB"));
    let percent: f64 = args.get(3).map_or(1.0, |a| a.parse().expect("PERCENT"));
    let rounds: usize = args.get(4).map_or(5, |a| a.parse().expect("ROUNDS"));
    let size = gib << 30;
    let writes = ((size / B) as f64 * percent / 100.0) as u64;
    let pool_size = (writes * B * 3 / 2).max(1 << 30);
    eprintln!("preparing: {gib} GiB volume, {writes} random 4 KiB writes on a {} MiB pool", pool_size >> 20);
    let (pool, vol) = ferrite_bench::setup_with(&dir, pool_size, size, PoolOptions::default());
    pool.create_snapshot("bench", "base").expect("snapshot");
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let vol = vol.clone();
            s.spawn(move || {
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
                let block = vec![0xA5u8; B as usize];
                for _ in 0..writes / 2 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    vol.write((x % (size / B)) * B, &block).expect("write");
                }
            });
        }
    });
    vol.flush().expect("flush");
    pool.create_snapshot("bench", "target").expect("snapshot");
    eprintln!("written in {:.1} s", started.elapsed().as_secs_f64());

    let target = pool.open_snapshot("target").expect("open");
    let (mut list, mut windows, mut read) = (Vec::new(), Vec::new(), Vec::new());
    let mut ranges = Vec::new();
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        let t = Instant::now();
        ranges = pool.changed_ranges(Image::Snapshot("target"), Some("base")).expect("delta");
        list.push(t.elapsed());
        let t = Instant::now();
        let mut flagged = 0;
        let mut at = 0;
        while at < size {
            let n = WINDOW.min(size - at);
            flagged += target.changed("base", at, n).expect("window").iter().filter(|r| r.1).map(|r| r.0).sum::<u64>();
            at += n;
        }
        windows.push(t.elapsed());
        assert_eq!(flagged, ranges.iter().map(|r| r.1).sum::<u64>(), "the windows flag what the listing lists");
        let t = Instant::now();
        let mut buf = vec![0u8; 1 << 20];
        for &(o, n) in &ranges {
            let mut done = 0;
            while done < n {
                let k = (n - done).min(buf.len() as u64) as usize;
                target.read(o + done, &mut buf[..k]).expect("read");
                done += k as u64;
            }
        }
        read.push(t.elapsed());
    }
    let bytes: u64 = ranges.iter().map(|r| r.1).sum();
    let (list, windows, read) = (median(list), median(windows), median(read));
    println!(
        "volume {gib} GiB, changed {bytes} bytes ({:.2}%) in {} ranges",
        bytes as f64 * 100.0 / size as f64,
        ranges.len()
    );
    println!("delta listing (ChangedRanges, CSI GetMetadataDelta):  {:9.1} ms", list.as_secs_f64() * 1e3);
    println!("delta by 32 MiB windows (NBD ferrite:changed:):        {:9.1} ms", windows.as_secs_f64() * 1e3);
    println!("full read of the changed data:                         {:9.1} ms", read.as_secs_f64() * 1e3);
    println!("listing / read: {:.3}", list.as_secs_f64() / read.as_secs_f64());
    pool.close().expect("close");
}
