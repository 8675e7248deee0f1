//! `ferrite`: for now, a demonstration of the engine on an embedded default pool. The daemon,
//! its admin API and the CLI proper come next (see ARCHITECTURE.md).

mod size;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use ferrite_engine::{ErrorKind, Pool, PoolOptions, format_uuid};
use size::{format_size, parse_size};

#[derive(Parser)]
#[command(name = "ferrite", version, about = "Ferrite block storage engine")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create (or open) a pool under DIR, write a volume through the engine, reopen the pool and
    /// verify every byte.
    Demo {
        /// Data directory holding pool.img and meta/.
        #[arg(long, default_value = "./ferrite-data")]
        dir: PathBuf,
        /// Size of the pool file (sparse) when it is created.
        #[arg(long, default_value = "4G", value_parser = parse_size)]
        pool_size: u64,
        /// Size of the demo volume.
        #[arg(long, default_value = "1G", value_parser = parse_size)]
        volume_size: u64,
        /// Bytes to write and verify.
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        write: u64,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FERRITE_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Demo { dir, pool_size, volume_size, write } => demo(&dir, pool_size, volume_size, write),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn pattern(offset: u64, buf: &mut [u8]) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = (offset / 8 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn open_or_create(dir: &std::path::Path, pool_size: u64) -> Result<Pool> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating data directory {}", dir.display()))?;
    let (img, meta) = (dir.join("pool.img"), dir.join("meta"));
    if img.exists() {
        let pool = Pool::open(&img, &meta, PoolOptions::default()).context("opening the pool")?;
        println!("opened pool {} at {}", format_uuid(&pool.stats().uuid), img.display());
        Ok(pool)
    } else {
        let pool = Pool::create(&img, &meta, pool_size, PoolOptions::default()).context("creating the pool")?;
        println!("created pool {} at {} ({})", format_uuid(&pool.stats().uuid), img.display(), format_size(pool_size));
        Ok(pool)
    }
}

fn demo(dir: &std::path::Path, pool_size: u64, volume_size: u64, write: u64) -> Result<()> {
    if write > volume_size {
        bail!("--write ({}) is larger than --volume-size ({})", format_size(write), format_size(volume_size));
    }
    let pool = open_or_create(dir, pool_size)?;
    match pool.create_volume("demo", volume_size) {
        Ok(v) => println!("created volume demo ({})", format_size(v.size)),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => println!("volume demo exists; writing over it"),
        Err(e) => return Err(e).context("creating volume demo"),
    }
    let vol = pool.open_volume("demo")?;
    let step = 4u64 << 20;
    let mut buf = vec![0u8; usize::try_from(step)?];
    let t = Instant::now();
    let mut off = 0;
    while off < write {
        let n = (write - off).min(step);
        let b = &mut buf[..usize::try_from(n)?];
        pattern(off, b);
        vol.write(off, b).with_context(|| format!("writing at offset {off}"))?;
        off += n;
        eprint!("\rwriting: {:>3}%", off * 100 / write);
    }
    vol.flush().context("flushing")?;
    eprintln!();
    let secs = t.elapsed().as_secs_f64();
    println!("wrote {} in {secs:.2}s ({:.0} MiB/s), flushed", format_size(write), write as f64 / secs / 1048576.0);
    drop(vol);
    pool.close().context("closing the pool")?;

    let pool = open_or_create(dir, pool_size)?;
    let r = pool.recovery_report();
    println!("recovery: replayed {} batches from sequence {}", r.batches_replayed, r.from_seq);
    let vol = pool.open_volume("demo")?;
    let mut want = vec![0u8; buf.len()];
    let t = Instant::now();
    let mut off = 0;
    while off < write {
        let n = usize::try_from((write - off).min(step))?;
        vol.read(off, &mut buf[..n]).with_context(|| format!("reading at offset {off}"))?;
        pattern(off, &mut want[..n]);
        if buf[..n] != want[..n] {
            bail!("data mismatch in the 4 MiB at offset {off}");
        }
        off += n as u64;
        eprint!("\rverifying: {:>3}%", off * 100 / write);
    }
    eprintln!();
    let secs = t.elapsed().as_secs_f64();
    println!(
        "read back and verified {} in {secs:.2}s ({:.0} MiB/s)",
        format_size(write),
        write as f64 / secs / 1048576.0
    );
    let s = pool.stats();
    println!(
        "pool: size {}, used {}, live {}, reclaimable {}, free {}; volume demo allocated {}",
        format_size(s.size),
        format_size(s.used),
        format_size(s.live),
        format_size(s.reclaimable),
        format_size(s.free),
        format_size(pool.volume_info("demo")?.allocated)
    );
    drop(vol);
    pool.close().context("closing the pool")?;
    println!("OK");
    Ok(())
}
