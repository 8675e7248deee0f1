//! `ferrite pool format`: makes a new pool on a block device or a file, offline (no daemon).
//!
//! It refuses a store that holds something recognisable (a filesystem, a partition table, a
//! volume manager, another pool) unless forced, and says what it found; a device that is in
//! use (mounted, held by another program) is refused even then (it is opened with O_EXCL). A
//! pool file may be preallocated: written once in full, so that the filesystem has real, written
//! extents under it and first writes do not pay for allocating them (fallocate would leave
//! unwritten extents, whose conversion on first write is the cost to avoid); a preallocated file
//! keeps its blocks when segments are freed (`pool-discard = auto`).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ferrite_engine::Pool;

use crate::out::Progress;
use ferrite_daemon::base::config::Config;
use ferrite_daemon::base::size::{format_size, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// The device or file (default: the configuration's pool-path).
    pub path: Option<PathBuf>,
    /// Size of a new pool file (default: pool-size); an existing file is grown to it.
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Write the whole file once, so first writes do not pay the filesystem's allocation
    /// (a file pool only; freed segments then keep their blocks).
    #[arg(long)]
    pub preallocate: bool,
    /// Format even if a filesystem, partition table or pool is found (its data is lost).
    #[arg(long)]
    pub force: bool,
    /// The daemon's TOML configuration (meta-dir, segment-size, pool-path, pool-size).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Data directory (overrides the config file).
    #[arg(long, env = "FERRITE_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
}

pub fn run(a: &Args) -> Result<()> {
    super::init_logging("warn");
    let req = FormatRequest { path: a.path.clone(), size: a.size, preallocate: a.preallocate, force: a.force };
    Config::load(a.config.as_deref(), a.data_dir.clone()).and_then(|cfg| format(&cfg, &req))
}

/// What `ferrite pool format` was asked.
#[derive(Debug)]
pub struct FormatRequest {
    /// The device or file (default: the configuration's pool-path).
    pub path: Option<PathBuf>,
    /// Size of a new (or grown) pool file.
    pub size: Option<u64>,
    pub preallocate: bool,
    pub force: bool,
}

/// Formats the pool and prints what it made.
pub fn format(cfg: &Config, req: &FormatRequest) -> Result<()> {
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    let path = req.path.clone().unwrap_or_else(|| cfg.pool_path.clone());
    if cfg.meta_dir.read_dir().is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "the metadata directory {} already holds a pool's catalog; a new pool needs an empty one \
             (move it away, or name another with meta-dir)",
            cfg.meta_dir.display()
        );
    }
    let found = std::fs::metadata(&path);
    let device = found.as_ref().is_ok_and(|m| m.file_type().is_block_device());
    if device && (req.size.is_some() || req.preallocate) {
        bail!("--size and --preallocate apply to pool files; a device pool takes the whole device");
    }
    match found {
        Ok(_) => {
            let file = open_existing(&path, device)?;
            if let Some(found) =
                ferrite_engine::io::probe(&file).with_context(|| format!("reading {}", path.display()))?
            {
                if !req.force {
                    bail!(
                        "{} holds {found}; refusing to format it (--force formats it anyway, and everything on it is lost)",
                        path.display()
                    );
                }
                eprintln!("{} held {found}: formatting it anyway (--force)", path.display());
            }
            if let Some(size) = req.size.filter(|&s| !device && s > file.metadata().map_or(0, |m| m.len())) {
                file.set_len(size).with_context(|| format!("growing {} to {}", path.display(), format_size(size)))?;
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let size = match req.size {
                Some(s) => s,
                None => cfg.pool_size.for_file(&path, cfg.segment_size)?,
            };
            Pool::create_file(&path, size)?;
        }
        Err(e) => return Err(e).with_context(|| format!("looking at {}", path.display())),
    }
    if req.preallocate {
        preallocate(&path)?;
    }
    let opts = ferrite_daemon::serve::daemon::pool_options(cfg);
    let pool = Pool::format(&path, &cfg.meta_dir, opts).with_context(|| format!("formatting {}", path.display()))?;
    let s = pool.stats();
    pool.close().context("closing the new pool")?;
    println!(
        "formatted {}: {} in {} segments of {}, uuid {}; catalog in {}",
        path.display(),
        format_size(s.size),
        s.segments,
        format_size(s.segment_size),
        s.uuid,
        cfg.meta_dir.display()
    );
    if path != cfg.pool_path {
        println!("set pool-path = {:?} in the daemon's configuration to serve it", path.display().to_string());
    }
    Ok(())
}

/// How long a device that is busy may take to be let go (udev probes a device right after it
/// is unmounted or closed) before it counts as in use.
const BUSY_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// Opens an existing store to look at it; a device exclusively, so one in use is refused.
fn open_existing(path: &Path, device: bool) -> Result<File> {
    let flags = if device { i32::try_from(rustix::fs::OFlags::EXCL.bits()).expect("a small flag") } else { 0 };
    let start = std::time::Instant::now();
    loop {
        let e = match OpenOptions::new().read(true).write(true).custom_flags(flags).open(path) {
            Ok(f) => return Ok(f),
            Err(e) => e,
        };
        if e.raw_os_error() != Some(rustix::io::Errno::BUSY.raw_os_error()) {
            return Err(anyhow::Error::new(e).context(format!("opening {}", path.display())));
        }
        if start.elapsed() >= BUSY_PATIENCE {
            anyhow::bail!("{} is in use (mounted, or held by another program); refusing to format it", path.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Writes zeros over the whole file, with progress, and syncs it.
fn preallocate(path: &Path) -> Result<()> {
    let mut f = OpenOptions::new().write(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    let total = f.metadata()?.len();
    let zeros = vec![0u8; 8 << 20];
    let mut progress = Progress::new("preallocating");
    let mut done = 0;
    while done < total {
        let n = usize::try_from((total - done).min(zeros.len() as u64)).expect("bounded");
        f.write_all(&zeros[..n]).with_context(|| format!("preallocating {} at {}", path.display(), done))?;
        done += n as u64;
        progress.update(done, total);
    }
    f.sync_all().with_context(|| format!("syncing {}", path.display()))?;
    progress.finish();
    Ok(())
}
