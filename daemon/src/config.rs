//! The daemon's configuration: one TOML file, every field optional.
//!
//! ```toml
//! data-dir = "/var/lib/ferrite"     # default: $FERRITE_DATA_DIR or ./ferrite-data
//! pool-path = "/dev/nvme0n1"        # default: <data-dir>/pool.img (a sparse file)
//! pool-size = "64G"                 # size of a new pool file; default 16G
//! segment-size = "32M"              # for a new pool; default 32M
//! overcommit-ratio = 4.0            # volumes may provision at most 4x the pool; default: no cap
//! admin-socket = "/run/ferrite/admin.sock"  # default: <data-dir>/admin.sock
//! nbd-socket = "/run/ferrite/nbd.sock"      # default: <data-dir>/nbd.sock
//! nbd-listen = "127.0.0.1:10809"    # optional TCP listener for NBD
//! metrics-listen = "127.0.0.1:9574" # optional Prometheus endpoint (GET /metrics)
//! admin-listen = "10.0.0.5:7070"    # optional TCP listener for the admin API (for a remote CSI
//!                                   # controller): no authentication, so a trusted network only
//! log-level = "info"                # or a tracing filter such as "ferrite=debug"
//! ublk-queues = 4                   # queues (threads) per attached ublk device; default: one per core
//! ublk-depth = 128                  # requests in flight per ublk queue; default 128
//! write-delay-us = 1000             # how long small writes may wait in memory for others to
//!                                   # share their log batch (a flush or FUA write never waits);
//!                                   # 0 writes each batch at once; default 1000, at most 100000
//! readahead = "2M"                  # most read ahead of a sequential reader; 0 turns it off;
//!                                   # default 2M, at most 64M
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::size::parse_size;

/// Longest `write-delay-us`: acknowledged writes wait at most this long to reach the store.
const MAX_WRITE_DELAY_US: u64 = 100_000;
/// Largest `readahead` window (the cache holds a few windows' worth per pool).
const MAX_READAHEAD: u64 = 64 << 20;

/// Daemon configuration as written in the file (kebab-case keys; unknown keys are errors).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct ConfigFile {
    pub data_dir: Option<PathBuf>,
    pub pool_path: Option<PathBuf>,
    pub meta_dir: Option<PathBuf>,
    pub pool_size: Option<String>,
    pub segment_size: Option<String>,
    pub overcommit_ratio: Option<f64>,
    pub admin_socket: Option<PathBuf>,
    pub nbd_socket: Option<PathBuf>,
    pub nbd_listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub log_level: Option<String>,
    pub ublk_queues: Option<u16>,
    pub ublk_depth: Option<u16>,
    pub write_delay_us: Option<u64>,
    pub readahead: Option<String>,
}

/// Configuration with every default filled in and every value checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub pool_path: PathBuf,
    pub meta_dir: PathBuf,
    pub pool_size: u64,
    pub segment_size: u64,
    pub overcommit_ratio: Option<f64>,
    pub admin_socket: PathBuf,
    pub nbd_socket: PathBuf,
    pub nbd_listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub log_level: String,
    pub ublk: ferrite_ublk::Options,
    pub write_delay: std::time::Duration,
    pub readahead: u64,
}

/// The data directory used when neither the config nor the command line names one.
pub fn default_data_dir() -> PathBuf {
    std::env::var_os("FERRITE_DATA_DIR").map_or_else(|| PathBuf::from("ferrite-data"), PathBuf::from)
}

impl Config {
    /// Reads `path` (if given) and fills in defaults; `data_dir` from the command line wins.
    pub fn load(path: Option<&Path>, data_dir: Option<PathBuf>) -> Result<Self> {
        let file = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading config {}", p.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing config {}", p.display()))?
            }
            None => ConfigFile::default(),
        };
        Self::resolve(file, data_dir)
    }

    fn resolve(f: ConfigFile, data_dir: Option<PathBuf>) -> Result<Self> {
        let data_dir = data_dir.or(f.data_dir).unwrap_or_else(default_data_dir);
        let size = |v: Option<String>, default: &str, what: &str| -> Result<u64> {
            parse_size(v.as_deref().unwrap_or(default)).map_err(|e| anyhow::anyhow!("{what}: {e}"))
        };
        let cfg = Self {
            pool_path: f.pool_path.unwrap_or_else(|| data_dir.join("pool.img")),
            meta_dir: f.meta_dir.unwrap_or_else(|| data_dir.join("meta")),
            pool_size: size(f.pool_size, "16G", "pool-size")?,
            segment_size: size(f.segment_size, "32M", "segment-size")?,
            overcommit_ratio: match f.overcommit_ratio {
                Some(r) if !(r.is_finite() && r >= 1.0) => bail!("overcommit-ratio must be a number >= 1.0, not {r}"),
                r => r,
            },
            admin_socket: f.admin_socket.unwrap_or_else(|| data_dir.join("admin.sock")),
            nbd_socket: f.nbd_socket.unwrap_or_else(|| data_dir.join("nbd.sock")),
            nbd_listen: f.nbd_listen,
            metrics_listen: f.metrics_listen,
            admin_listen: f.admin_listen,
            log_level: f.log_level.unwrap_or_else(|| "info".into()),
            ublk: {
                let d = ferrite_ublk::Options::default();
                ferrite_ublk::Options {
                    queues: f.ublk_queues.unwrap_or(d.queues),
                    depth: f.ublk_depth.unwrap_or(d.depth),
                    ..d
                }
            },
            write_delay: match f.write_delay_us {
                Some(us) if us > MAX_WRITE_DELAY_US => {
                    bail!("write-delay-us must be at most {MAX_WRITE_DELAY_US} (100 ms), not {us}")
                }
                Some(us) => std::time::Duration::from_micros(us),
                None => ferrite_engine::PoolOptions::default().write_delay,
            },
            readahead: match f.readahead {
                None => ferrite_engine::PoolOptions::default().readahead,
                r => match size(r, "", "readahead")? {
                    n if n > MAX_READAHEAD => bail!("readahead must be at most 64M, not {n} bytes"),
                    n => n,
                },
            },
            data_dir,
        };
        cfg.ublk.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        if cfg.admin_socket == cfg.nbd_socket {
            bail!("admin-socket and nbd-socket must differ");
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let c = Config::resolve(ConfigFile::default(), Some("/d".into())).unwrap();
        assert_eq!(c.pool_path, PathBuf::from("/d/pool.img"));
        assert_eq!(c.admin_socket, PathBuf::from("/d/admin.sock"));
        assert_eq!(c.pool_size, 16 << 30);
        assert_eq!(c.write_delay, std::time::Duration::from_millis(1));
        assert_eq!(c.readahead, 2 << 20);
        let f: ConfigFile =
            toml::from_str("pool-size = \"2G\"\nnbd-listen = \"127.0.0.1:10809\"\ndata-dir = \"/x\"").unwrap();
        let c = Config::resolve(f, None).unwrap();
        assert_eq!(c.pool_size, 2 << 30);
        assert_eq!(c.meta_dir, PathBuf::from("/x/meta"));
        assert!(c.nbd_listen.is_some());
    }

    #[test]
    fn bad_configs_are_refused() {
        assert!(toml::from_str::<ConfigFile>("no-such-key = 1").is_err());
        let f: ConfigFile = toml::from_str("overcommit-ratio = 0.5").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("overcommit-ratio"));
        let f: ConfigFile = toml::from_str("overcommit-ratio = 3.0").unwrap();
        assert_eq!(Config::resolve(f, None).unwrap().overcommit_ratio, Some(3.0));
        let f: ConfigFile = toml::from_str("pool-size = \"12Q\"").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("pool-size"));
        let f: ConfigFile = toml::from_str("ublk-depth = 0").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("depth"));
        let f: ConfigFile = toml::from_str("ublk-queues = 2").unwrap();
        assert_eq!(Config::resolve(f, None).unwrap().ublk.queues, 2);
        let f: ConfigFile = toml::from_str("write-delay-us = 100001").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("write-delay-us"));
        let f: ConfigFile = toml::from_str("write-delay-us = 0").unwrap();
        assert!(Config::resolve(f, None).unwrap().write_delay.is_zero());
        let f: ConfigFile = toml::from_str("readahead = \"65M\"").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("readahead"));
        let f: ConfigFile = toml::from_str("readahead = \"0\"").unwrap();
        assert_eq!(Config::resolve(f, None).unwrap().readahead, 0);
        let f: ConfigFile = toml::from_str("admin-socket = \"/s\"\nnbd-socket = \"/s\"").unwrap();
        assert!(Config::resolve(f, None).is_err());
    }
}
