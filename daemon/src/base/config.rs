//! The daemon's configuration: one TOML file, every field optional.
//!
//! ```toml
//! data-dir = "/var/lib/ferrite"     # default: $FERRITE_DATA_DIR or ./ferrite-data
//! pool-path = "/dev/nvme0n1"        # default: <data-dir>/pool.img (a sparse file)
//! pool-size = "64G"                 # size of a new pool file; default 16G; "auto": the free
//!                                   # space of the filesystem under it, less pool-reserve
//! pool-reserve = "10%"              # with pool-size auto: what stays free on that filesystem
//!                                   # (a size, or a percentage of its size); default 10%
//! segment-size = "32M"              # for a new pool; default 32M
//! pool-discard = "auto"             # give freed segments back: auto (holes in a sparse pool file
//!                                   # only), on (also BLKDISCARD on a device, for SSDs), off
//! overcommit-ratio = 4.0            # volumes may provision at most 4x the pool; default: no cap
//! admin-socket = "/run/ferrite/admin.sock"  # default: <data-dir>/admin.sock
//! nbd-socket = "/run/ferrite/nbd.sock"      # default: <data-dir>/nbd.sock
//! nbd-listen = "127.0.0.1:10809"    # optional TCP listener for NBD
//! metrics-listen = "127.0.0.1:9574" # optional Prometheus endpoint (GET /metrics)
//! admin-listen = "10.0.0.5:7070"    # optional TCP listener for the admin API (for a remote CSI
//!                                   # controller): mutual TLS, so it needs the three tls-* keys
//! insecure-admin-listen = false     # true serves admin-listen WITHOUT TLS or authentication:
//!                                   # anyone who reaches it controls the daemon
//! tls-cert = "/etc/ferrite/node.pem"    # this daemon's certificate (PEM; chain, leaf first) and
//! tls-key = "/etc/ferrite/node-key.pem" # key: TLS on every TCP listener (`ferrite certs` makes them)
//! tls-client-ca = "/etc/ferrite/ca.pem" # clients must present a certificate signed by this CA
//!                                   # (mutual TLS) on every TCP listener
//! nbd-tls = "require"               # off | allow | require (NBD_OPT_STARTTLS) on nbd-listen;
//!                                   # default: require with tls-cert, else off
//! meta-dir = "/var/lib/ferrite/meta"   # the catalog (RocksDB); default: <data-dir>/meta
//! log-level = "info"                # or a tracing filter such as "ferrite=debug"
//! ublk-queues = 4                   # queues (threads) per attached ublk device; default: one per core
//! ublk-depth = 128                  # requests in flight per ublk queue; default 128
//! write-delay-us = 1000             # how long small writes may wait in memory for others to
//!                                   # share their log batch (a flush or FUA write never waits);
//!                                   # 0 writes each batch at once; default 1000, at most 100000
//! idle-cleaning-s = 2               # once no client request has come for this long, the cleaner
//!                                   # compacts mostly-dead segments ahead of need (0: only when
//!                                   # free space runs low); default 2
//! readahead = "2M"                  # most read ahead of a sequential reader; 0 turns it off;
//!                                   # default 2M, at most 64M
//! max-connections = 1024            # per listener (NBD, admin, metrics); more are closed on arrival
//! handshake-timeout-s = 30          # a client that has not finished its handshake (NBD
//!                                   # negotiation, TLS) by then is cut
//! send-timeout-s = 60               # a client that reads no reply for this long is cut
//! nbd-memory = "1G"                 # request data in flight over all NBD connections
//! nbd-connection-memory = "64M"     # ... and per connection (one larger request still runs alone)
//! nbd-connection-requests = 256     # requests in flight per NBD connection
//! replication-endpoint = "tcp://10.0.0.5:7070"  # how peers reach this daemon's admin API for
//!                                   # replication; default: tcp://<admin-listen>, else admin-socket
//! replication-bandwidth = "100M"    # bytes per second sent to each peer; default: no limit
//! replication-idle-timeout-s = 60   # an incoming push that sends nothing for this long is ended
//!                                   # (its resume point kept); default 60
//! sync-timeout-ms = 3000            # a synchronous replica that does not answer a request for
//!                                   # this long is ejected; default 3000
//! peer-quota = 2000                 # what one replication peer may make here: at most this many
//!                                   # relations and as many synchronous memberships; default 2000
//! peer-space-percent = 50           # and volumes adding up to at most this share of what the pool
//!                                   # may hold (its size times the overcommit cap); default: no
//!                                   # bound but each volume's (set it where copies spread evenly)
//! sync-mark-interval-ms = 60000     # how often a synchronous primary that took writes takes a
//!                                   # mark with its members (where a returning member's rebuild
//!                                   # starts); default 60000
//! device-hold-s = 120               # how long a device holds its I/O while its daemon (or a
//!                                   # relayed volume's primary) is away; then EIO (a ublk
//!                                   # device's through the node plugin or `ferrite watchdog`)
//! nbd-device-timeout-s = 10         # a kernel NBD request unanswered this long is re-sent on
//!                                   # a new connection (what a daemon killed mid-request costs)
//!
//! [backup-targets.offsite]          # where `ferrite backup` sends backups (see ferrite_backup::TargetConfig)
//! kind = "s3"                       # or "dir" with path = "/mnt/nfs/backups"
//! endpoint = "https://s3.example"   # default AWS's; bucket, prefix, region (us-east-1),
//! bucket = "backups"                # virtual-hosted = false (path-style requests)
//! credentials = "/etc/ferrite/s3"   # access-key-id and secret-access-key files; else AWS_* env
//! key-file = "/etc/ferrite/bk.key"  # 32 bytes: everything sealed; chunk-size = "4M",
//!                                   # concurrency = 8, bandwidth = "100M", full-every = 30,
//!                                   # grace-s = 86400, retries = 10, timeout-s = 120
//!                                   # (one request, its answer included), ca-file,
//!                                   # verify-every-s (none), verify-sample = 0.1,
//!                                   # conditional-writes = true, object-lock-days (none;
//!                                   # S3 Object Lock), object-lock-mode = "governance"
//! (top level) backup-targets-file = "/etc/ferrite/backup/targets.toml"
//!                                   # more targets as [NAME] tables (a mounted Secret: paths
//!                                   # in it relative to it); absent, none
//! insecure-nbd-listen = false       # true allows nbd-listen on a non-loopback address without
//!                                   # TLS (nbd-tls off): volume data in the clear on the network
//!
//! [roles]                           # what each client certificate may do over mutual TLS, by
//! "csi-controller" = "controller"   # a name it carries (DNS or IP subjectAltName; the CN only
//! "node-b.example" = ["replication-peer", "nbd-client"]  # without any; exact match): operator,
//! "10.0.0.6" = "replication-peer"   # controller, replication-peer, nbd-client, metrics. A
//! "prometheus" = "metrics"          # certificate naming none is closed after its handshake;
//!                                   # the admin socket is always operator
//! ```
//! Past the memory and request limits a connection is not refused: the server stops reading
//! its requests until replies drain (backpressure).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::authz::{Role, RoleList, parse_roles};
use crate::base::size::parse_size;
use ferrite_nbd::tls::TlsMode;

/// Longest `write-delay-us`: acknowledged writes wait at most this long to reach the store.
/// How long a kernel NBD device waits for a new connection (`device-hold-s`).
pub const DEFAULT_DEVICE_HOLD: Duration = Duration::from_secs(120);
/// When a kernel NBD device re-sends an unanswered request (`nbd-device-timeout-s`).
pub const DEFAULT_NBD_DEVICE_TIMEOUT: Duration = Duration::from_secs(10);
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
    pub pool_reserve: Option<String>,
    pub segment_size: Option<String>,
    pub pool_discard: Option<String>,
    pub overcommit_ratio: Option<f64>,
    pub admin_socket: Option<PathBuf>,
    /// Key-encryption keys of encrypted volumes, one file each (`<id>.key`, mode 0600).
    pub key_dir: Option<PathBuf>,
    pub nbd_socket: Option<PathBuf>,
    pub nbd_listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub log_level: Option<String>,
    pub ublk_queues: Option<u16>,
    pub ublk_depth: Option<u16>,
    pub write_delay_us: Option<u64>,
    pub idle_cleaning_s: Option<u64>,
    pub readahead: Option<String>,
    pub max_connections: Option<usize>,
    pub handshake_timeout_s: Option<u64>,
    pub send_timeout_s: Option<u64>,
    pub nbd_memory: Option<String>,
    pub nbd_connection_memory: Option<String>,
    pub nbd_connection_requests: Option<usize>,
    pub insecure_admin_listen: Option<bool>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub nbd_tls: Option<String>,
    pub replication_endpoint: Option<String>,
    /// The name peer daemons' certificates carry, when it is not the host of their endpoint.
    pub peer_server_name: Option<String>,
    pub replication_bandwidth: Option<String>,
    pub replication_idle_timeout_s: Option<u64>,
    pub sync_timeout_ms: Option<u64>,
    pub sync_mark_interval_ms: Option<u64>,
    pub peer_quota: Option<usize>,
    pub peer_space_percent: Option<u64>,
    pub device_hold_s: Option<u64>,
    pub nbd_device_timeout_s: Option<u64>,
    /// The failure domains of this daemon's node (its `topology.kubernetes.io/zone` and
    /// `region` labels): reported to the CSI node plugin, and where replicated volumes spread.
    pub zone: Option<String>,
    pub region: Option<String>,
    pub insecure_nbd_listen: Option<bool>,
    pub roles: Option<BTreeMap<String, RoleList>>,
    /// Backup targets by name (`[backup-targets.NAME]`, see `ferrite_backup::TargetConfig`).
    pub backup_targets: Option<BTreeMap<String, ferrite_backup::TargetConfig>>,
    /// More targets, in a file of their own (`[NAME]` tables; a mounted Secret's): relative
    /// paths in it are from its directory; a file that is not there names none.
    pub backup_targets_file: Option<PathBuf>,
}

/// The size of a new pool file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolSize {
    Fixed(u64),
    /// The free space of the filesystem under the file, less the reserve.
    Auto {
        reserve: Reserve,
    },
}

/// What a pool sized `auto` leaves free on its filesystem.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reserve {
    Bytes(u64),
    /// A percentage of the filesystem's size.
    Percent(f64),
}

impl Reserve {
    fn parse(v: &str) -> Result<Self> {
        let r = match v.strip_suffix('%') {
            Some(p) => match p.trim().parse::<f64>() {
                Ok(p) if (0.0..100.0).contains(&p) => Self::Percent(p),
                _ => bail!("pool-reserve: {v:?} is no percentage from 0 to below 100"),
            },
            None => Self::Bytes(parse_size(v).map_err(|e| anyhow::anyhow!("pool-reserve: {e}"))?),
        };
        Ok(r)
    }
}

impl PoolSize {
    /// The size for a new pool file on a filesystem of `total` bytes with `free` available,
    /// in whole segments.
    pub fn resolve(self, total: u64, free: u64, segment: u64) -> Result<u64> {
        let reserve = match self {
            Self::Fixed(n) => return Ok(n),
            Self::Auto { reserve: Reserve::Bytes(b) } => b,
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
            Self::Auto { reserve: Reserve::Percent(p) } => (total as f64 * p / 100.0) as u64,
        };
        let size = free.saturating_sub(reserve) / segment.max(1) * segment.max(1);
        // The engine's smallest useful pool: a few segments beyond its own.
        if size < 8 * segment {
            bail!(
                "pool-size auto: the filesystem has {} free and keeps {} in reserve, which leaves no room for a pool; set pool-size or free space",
                crate::base::size::format_size(free),
                crate::base::size::format_size(reserve)
            );
        }
        Ok(size)
    }

    /// The size for a new pool file at `path`: its filesystem's free space less the reserve.
    pub fn for_file(self, path: &Path, segment: u64) -> Result<u64> {
        if let Self::Fixed(n) = self {
            return Ok(n);
        }
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let s = rustix::fs::statvfs(dir).with_context(|| format!("statvfs {}", dir.display()))?;
        let (total, free) = (s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize);
        self.resolve(total, free, segment).with_context(|| format!("sizing a pool file in {}", dir.display()))
    }
}

/// Configuration with every default filled in and every value checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub pool_path: PathBuf,
    pub meta_dir: PathBuf,
    pub pool_size: PoolSize,
    pub segment_size: u64,
    pub pool_discard: ferrite_engine::Discard,
    pub overcommit_ratio: Option<f64>,
    pub admin_socket: PathBuf,
    pub key_dir: PathBuf,
    pub nbd_socket: PathBuf,
    pub nbd_listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub log_level: String,
    pub ublk: ferrite_ublk::Options,
    pub write_delay: std::time::Duration,
    pub idle_cleaning: Option<Duration>,
    pub readahead: u64,
    pub limits: Limits,
    /// TLS on TCP listeners: certificate and key, and the CA client certificates must chain to.
    pub tls: Option<TlsFiles>,
    pub nbd_tls: TlsMode,
    pub insecure_admin_listen: bool,
    /// This daemon's admin endpoint as replication peers reach it.
    pub replication_endpoint: String,
    /// Bytes per second sent to each replication peer; 0: no limit.
    pub replication_bandwidth: u64,
    /// An incoming push silent this long is ended.
    pub replication_idle_timeout: Duration,
    /// A synchronous replica that does not answer a request within this is ejected.
    pub sync_timeout: Duration,
    /// How often a synchronous primary that took writes takes a mark with its members.
    pub sync_mark_interval: Duration,
    /// Relations, and synchronous memberships, one replication peer may make here.
    pub peer_quota: usize,
    /// The share of what the pool may hold (percent) that one peer's volumes here may add up to
    /// (None: no bound but each volume's).
    pub peer_space_percent: Option<u64>,
    /// How long a kernel NBD device holds its I/O for a new connection.
    pub device_hold: Duration,
    /// A kernel NBD request unanswered this long is re-sent on the next connection.
    pub nbd_device_timeout: Duration,
    /// This node's zone and region (empty: none).
    pub zone: String,
    pub region: String,
    /// Client certificate identities and their roles (`[roles]`).
    pub roles: Vec<(String, Vec<Role>)>,
    /// Backup targets by name, opened on first use.
    pub backup_targets: BTreeMap<String, ferrite_backup::TargetConfig>,
}

/// The targets of `[backup-targets]` and of the targets file; their names are path and metric
/// label safe, each says what it is.
fn check_targets(
    mut targets: BTreeMap<String, ferrite_backup::TargetConfig>,
    file: Option<&Path>,
) -> Result<BTreeMap<String, ferrite_backup::TargetConfig>> {
    if let Some(file) = file {
        for (name, t) in targets_file(file)? {
            if targets.insert(name.clone(), t).is_some() {
                bail!("backup target {name:?} is named both in the config and in {}", file.display());
            }
        }
    }
    for (name, t) in &targets {
        if !ferrite_backup::valid_component(name) {
            bail!("backup-targets.{name}: a target's name is letters, digits, '-', '_' or '.'");
        }
        if t.kind.is_none() {
            bail!("backup-targets.{name}: kind is missing (s3 or dir)");
        }
    }
    Ok(targets)
}

/// The targets `file` names, its relative paths made absolute; none if it is not there (an
/// optional Secret not created).
fn targets_file(file: &Path) -> Result<BTreeMap<String, ferrite_backup::TargetConfig>> {
    let text = match std::fs::read_to_string(file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        other => other.with_context(|| format!("reading backup targets from {}", file.display()))?,
    };
    let mut targets: BTreeMap<String, ferrite_backup::TargetConfig> =
        toml::from_str(&text).with_context(|| format!("parsing backup targets in {}", file.display()))?;
    let dir = file.parent().unwrap_or(Path::new("/"));
    for t in targets.values_mut() {
        for p in [&mut t.path, &mut t.credentials, &mut t.ca_file, &mut t.key_file].into_iter().flatten() {
            *p = dir.join(&*p);
        }
    }
    Ok(targets)
}

/// The PEM files of a daemon's TLS.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    /// What a peer daemon's certificate must name (`peer-server-name`), else its endpoint's host.
    pub peer_name: Option<String>,
}

impl TlsFiles {
    /// The listeners' TLS files as configured: none, or a certificate with its key.
    fn of(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
        peer_name: Option<String>,
    ) -> Result<Option<Self>> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(Self { cert, key, client_ca, peer_name })),
            (None, None) if client_ca.is_some() => bail!("tls-client-ca needs tls-cert and tls-key"),
            (None, None) => Ok(None),
            _ => bail!("tls-cert and tls-key go together"),
        }
    }
}

/// What every listener may be asked for, and the NBD server's memory limits.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_connections: usize,
    pub handshake_timeout: Duration,
    pub send_timeout: Duration,
    pub nbd_memory: u64,
    pub nbd_connection_memory: u64,
    pub nbd_connection_requests: usize,
}

impl Limits {
    /// The listeners' and the NBD server's limits as configured, each checked.
    fn of(
        max_connections: Option<usize>,
        handshake_timeout_s: Option<u64>,
        send_timeout_s: Option<u64>,
        nbd_memory: Option<String>,
        nbd_connection_memory: Option<String>,
        nbd_connection_requests: Option<usize>,
    ) -> Result<Self> {
        let d = ferrite_nbd::Limits::default();
        let secs = |v: Option<u64>, default: Duration, what: &str| match v {
            Some(0) => bail!("{what} must be at least 1 second"),
            Some(s) if s > 86_400 => bail!("{what} must be at most 86400 (a day), not {s}"),
            Some(s) => Ok(Duration::from_secs(s)),
            None => Ok(default),
        };
        let positive = |v: Option<usize>, default: usize, what: &str| match v {
            Some(0) => bail!("{what} must be at least 1"),
            v => Ok(v.unwrap_or(default)),
        };
        let nbd_memory = match nbd_memory {
            None => d.memory.cap(),
            Some(m) => parse_size(&m).map_err(|e| anyhow::anyhow!("nbd-memory: {e}"))?,
        };
        let nbd_connection_memory = match nbd_connection_memory {
            None => d.connection_bytes,
            Some(m) => parse_size(&m).map_err(|e| anyhow::anyhow!("nbd-connection-memory: {e}"))?,
        };
        if nbd_memory < 64 << 20 || nbd_connection_memory < 1 << 20 {
            bail!("nbd-memory must be at least 64M and nbd-connection-memory at least 1M");
        }
        Ok(Self {
            max_connections: positive(max_connections, d.max_connections, "max-connections")?,
            handshake_timeout: secs(handshake_timeout_s, d.handshake_timeout, "handshake-timeout-s")?,
            send_timeout: secs(send_timeout_s, d.send_timeout, "send-timeout-s")?,
            nbd_memory,
            nbd_connection_memory,
            nbd_connection_requests: positive(
                nbd_connection_requests,
                d.connection_requests,
                "nbd-connection-requests",
            )?,
        })
    }

    /// The NBD server's limits.
    pub fn nbd(&self) -> ferrite_nbd::Limits {
        ferrite_nbd::Limits {
            connection_bytes: self.nbd_connection_memory,
            connection_requests: self.nbd_connection_requests,
            memory: ferrite_nbd::limits::Budget::new(self.nbd_memory),
            max_connections: self.max_connections,
            handshake_timeout: self.handshake_timeout,
            send_timeout: self.send_timeout,
            ..ferrite_nbd::Limits::default()
        }
    }
}

/// A level, or a tracing filter whose every directive names a level (`ferrite=debug,warn`): a
/// bare word is a target, which would silently log nothing useful, so it is refused.
/// A zone or region: a Kubernetes label value (at most 63 of `A-Za-z0-9-_.`, alphanumeric at
/// both ends).
fn check_domain(what: &str, v: Option<String>) -> Result<String> {
    let v = v.unwrap_or_default();
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let ends = v.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && v.chars().last().is_some_and(|c| c.is_ascii_alphanumeric());
    if !v.is_empty() && (v.len() > 63 || !v.chars().all(ok) || !ends) {
        bail!("{what} {v:?}: a label value (at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends)");
    }
    Ok(v)
}

fn check_log_level(l: String) -> Result<String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let known = |d: &str| d.contains('=') || LEVELS.contains(&d.trim().to_ascii_lowercase().as_str());
    match tracing_subscriber::EnvFilter::builder().parse(&l) {
        Ok(_) if l.split(',').all(known) => Ok(l),
        _ => bail!(
            "log-level {l:?} is not a level (off, error, warn, info, debug, trace) or a filter like ferrite=debug"
        ),
    }
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

    /// A configuration from its text (one that was written, not read from a path).
    pub fn load_str(text: &str) -> Result<Self> {
        Self::resolve(toml::from_str(text).context("parsing the configuration")?, None)
    }

    fn resolve(f: ConfigFile, data_dir: Option<PathBuf>) -> Result<Self> {
        let data_dir = data_dir.or(f.data_dir).unwrap_or_else(default_data_dir);
        let size = |v: Option<String>, default: &str, what: &str| -> Result<u64> {
            parse_size(v.as_deref().unwrap_or(default)).map_err(|e| anyhow::anyhow!("{what}: {e}"))
        };
        let mut cfg = Self {
            pool_path: f.pool_path.unwrap_or_else(|| data_dir.join("pool.img")),
            meta_dir: f.meta_dir.unwrap_or_else(|| data_dir.join("meta")),
            pool_size: match f.pool_size.as_deref() {
                Some("auto") => PoolSize::Auto { reserve: Reserve::parse(f.pool_reserve.as_deref().unwrap_or("10%"))? },
                _ if f.pool_reserve.is_some() => bail!("pool-reserve is for pool-size = \"auto\""),
                _ => PoolSize::Fixed(size(f.pool_size, "16G", "pool-size")?),
            },
            segment_size: size(f.segment_size, "32M", "segment-size")?,
            pool_discard: match f.pool_discard.as_deref() {
                None | Some("auto") => ferrite_engine::Discard::Auto,
                Some("on") => ferrite_engine::Discard::On,
                Some("off") => ferrite_engine::Discard::Off,
                Some(other) => bail!("pool-discard must be auto, on or off, not {other:?}"),
            },
            overcommit_ratio: match f.overcommit_ratio {
                Some(r) if !(r.is_finite() && r >= 1.0) => bail!("overcommit-ratio must be a number >= 1.0, not {r}"),
                r => r,
            },
            admin_socket: f.admin_socket.unwrap_or_else(|| data_dir.join("admin.sock")),
            key_dir: f.key_dir.unwrap_or_else(|| data_dir.join("keys")),
            nbd_socket: f.nbd_socket.unwrap_or_else(|| data_dir.join("nbd.sock")),
            nbd_listen: f.nbd_listen,
            metrics_listen: f.metrics_listen,
            admin_listen: f.admin_listen,
            log_level: match f.log_level {
                Some(l) => check_log_level(l)?,
                None => "info".into(),
            },
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
            idle_cleaning: match f.idle_cleaning_s {
                None => ferrite_engine::PoolOptions::default().idle_cleaning,
                Some(0) => None,
                Some(s) => Some(Duration::from_secs(s)),
            },
            readahead: match f.readahead {
                None => ferrite_engine::PoolOptions::default().readahead,
                r => match size(r, "", "readahead")? {
                    n if n > MAX_READAHEAD => bail!("readahead must be at most 64M, not {n} bytes"),
                    n => n,
                },
            },
            limits: Limits::of(
                f.max_connections,
                f.handshake_timeout_s,
                f.send_timeout_s,
                f.nbd_memory,
                f.nbd_connection_memory,
                f.nbd_connection_requests,
            )?,
            tls: TlsFiles::of(f.tls_cert, f.tls_key, f.tls_client_ca, f.peer_server_name)?,
            nbd_tls: TlsMode::Off,
            insecure_admin_listen: f.insecure_admin_listen.unwrap_or(false),
            replication_endpoint: String::new(),
            replication_bandwidth: match f.replication_bandwidth {
                None => 0,
                b => size(b, "", "replication-bandwidth")?,
            },
            replication_idle_timeout: Duration::from_secs(between(
                f.replication_idle_timeout_s,
                60,
                1..=3600,
                "replication-idle-timeout-s",
            )?),
            sync_timeout: Duration::from_millis(between(f.sync_timeout_ms, 3000, 100..=600_000, "sync-timeout-ms")?),
            sync_mark_interval: Duration::from_millis(between(
                f.sync_mark_interval_ms,
                60_000,
                100..=86_400_000,
                "sync-mark-interval-ms",
            )?),
            device_hold: Duration::from_secs(between(
                f.device_hold_s,
                DEFAULT_DEVICE_HOLD.as_secs(),
                5..=86_400,
                "device-hold-s",
            )?),
            nbd_device_timeout: Duration::from_secs(between(
                f.nbd_device_timeout_s,
                DEFAULT_NBD_DEVICE_TIMEOUT.as_secs(),
                1..=3600,
                "nbd-device-timeout-s",
            )?),
            // 50 nodes, each primary of a few dozen volumes with a copy here: far below this.
            peer_quota: between(f.peer_quota, 2000, 1..=1_000_000, "peer-quota")?,
            // Off by default: where one node holds the primaries of most volumes (two nodes, or
            // a node the others copy), its copies are most of each other node's pool.
            peer_space_percent: f
                .peer_space_percent
                .map(|p| between(Some(p), p, 1..=100, "peer-space-percent"))
                .transpose()?,
            roles: parse_roles(f.roles.unwrap_or_default())?,
            backup_targets: check_targets(f.backup_targets.unwrap_or_default(), f.backup_targets_file.as_deref())?,
            zone: check_domain("zone", f.zone)?,
            region: check_domain("region", f.region)?,
            data_dir,
        };
        cfg.replication_endpoint = cfg.replication_endpoint(f.replication_endpoint)?;
        cfg.nbd_tls = match f
            .nbd_tls
            .as_deref()
            .map(str::parse::<TlsMode>)
            .transpose()
            .map_err(|e| anyhow::anyhow!("nbd-tls: {e}"))?
        {
            Some(TlsMode::Off) => TlsMode::Off,
            Some(_) if cfg.tls.is_none() => bail!("nbd-tls needs tls-cert and tls-key"),
            Some(m) => m,
            None if cfg.tls.is_some() => TlsMode::Require,
            None => TlsMode::Off,
        };
        cfg.check_listeners(f.insecure_nbd_listen.unwrap_or(false))?;
        Ok(cfg)
    }

    /// Where peers reach this daemon for replication. The environment wins: in a DaemonSet the
    /// node's address is known only to the pod.
    fn replication_endpoint(&self, configured: Option<String>) -> Result<String> {
        let endpoint = std::env::var("FERRITE_REPLICATION_ENDPOINT").ok().or(configured);
        Ok(match (endpoint, self.admin_listen) {
            (Some(e), _) if e.is_empty() => bail!("replication-endpoint must not be empty"),
            (Some(e), _) => e,
            (None, Some(a)) => format!("tcp://{a}"),
            (None, None) => self.admin_socket.display().to_string(),
        })
    }

    /// What the listeners together must not do: serve the admin API or volume data over TCP in
    /// the clear unless told to, or share a socket.
    fn check_listeners(&self, insecure_nbd_listen: bool) -> Result<()> {
        if self.admin_listen.is_some()
            && !self.insecure_admin_listen
            && self.tls.as_ref().is_none_or(|t| t.client_ca.is_none())
        {
            bail!(
                "admin-listen serves the admin API over TCP with mutual TLS: set tls-cert, tls-key and tls-client-ca \
                 (`ferrite certs` makes them), or insecure-admin-listen = true to serve it to anyone who can connect"
            );
        }
        if let Some(a) = self.nbd_listen
            && !a.ip().is_loopback()
            && self.nbd_tls != TlsMode::Require
            && !insecure_nbd_listen
        {
            bail!(
                "nbd-listen {a} is not a loopback address and nbd-tls is not \"require\": volume data would cross \
                 the network in the clear. Set tls-cert and tls-key (nbd-tls then defaults to require), or \
                 insecure-nbd-listen = true to serve it in the clear anyway"
            );
        }
        self.ublk.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        if self.admin_socket == self.nbd_socket {
            bail!("admin-socket and nbd-socket must differ");
        }
        Ok(())
    }
}

/// `value` (or `default` when unset), refused outside `range` with a message naming `what`.
fn between<T: PartialOrd + Copy + std::fmt::Display>(
    value: Option<T>,
    default: T,
    range: std::ops::RangeInclusive<T>,
    what: &str,
) -> Result<T> {
    match value {
        None => Ok(default),
        Some(v) if !range.contains(&v) => {
            bail!("{what} must be between {} and {}, not {v}", range.start(), range.end())
        }
        Some(v) => Ok(v),
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
        assert_eq!(c.pool_size, PoolSize::Fixed(16 << 30));
        assert_eq!(c.write_delay, std::time::Duration::from_millis(1));
        assert_eq!(c.readahead, 2 << 20);
        assert_eq!(c.idle_cleaning, Some(Duration::from_secs(2)));
        let f: ConfigFile = toml::from_str("idle-cleaning-s = 0").unwrap();
        assert_eq!(Config::resolve(f, None).unwrap().idle_cleaning, None);
        let f: ConfigFile = toml::from_str("idle-cleaning-s = 30").unwrap();
        assert_eq!(Config::resolve(f, None).unwrap().idle_cleaning, Some(Duration::from_secs(30)));
        let f: ConfigFile =
            toml::from_str("pool-size = \"2G\"\nnbd-listen = \"127.0.0.1:10809\"\ndata-dir = \"/x\"").unwrap();
        let c = Config::resolve(f, None).unwrap();
        assert_eq!(c.pool_size, PoolSize::Fixed(2 << 30));
        assert_eq!(c.meta_dir, PathBuf::from("/x/meta"));
        assert!(c.nbd_listen.is_some());
    }

    #[test]
    fn an_auto_pool_takes_the_free_space_less_the_reserve() {
        let auto =
            |r: &str| Config::load_str(&format!("pool-size = \"auto\"\npool-reserve = \"{r}\"")).unwrap().pool_size;
        let g = 1u64 << 30;
        let seg = 32 << 20;
        // 100 GiB filesystem, 40 GiB free: 10% keeps 10 GiB, 5G keeps 5 GiB; whole segments.
        assert_eq!(auto("10%").resolve(100 * g, 40 * g, seg).unwrap(), 30 * g);
        assert_eq!(auto("5G").resolve(100 * g, 40 * g + 1000, seg).unwrap(), 35 * g);
        let default = Config::load_str("pool-size = \"auto\"").unwrap().pool_size;
        assert_eq!(default, auto("10%"), "10% by default");
        let full = auto("10%").resolve(100 * g, 10 * g, seg).unwrap_err().to_string();
        assert!(full.contains("no room for a pool") && full.contains("10.0 GiB"), "{full}");
        assert_eq!(PoolSize::Fixed(2 * g).resolve(100 * g, 0, seg).unwrap(), 2 * g, "a size given is the size");
        for bad in ["100%", "-1%", "x%", "12Q"] {
            assert!(Config::load_str(&format!("pool-size = \"auto\"\npool-reserve = \"{bad}\"")).is_err(), "{bad}");
        }
        assert!(Config::load_str("pool-reserve = \"1G\"").unwrap_err().to_string().contains("auto"));
        // On a real filesystem: at most its free space.
        let dir = tempfile::tempdir().unwrap();
        let free = rustix::fs::statvfs(dir.path()).map(|s| s.f_bavail * s.f_frsize).unwrap();
        match auto("0%").for_file(&dir.path().join("pool.img"), seg) {
            Ok(n) => assert!(n <= free && n > 0),
            Err(e) => assert!(e.to_string().contains("no room"), "{e:#}"),
        }
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
        for (bad, key) in [
            ("max-connections = 0", "max-connections"),
            ("handshake-timeout-s = 0", "handshake-timeout-s"),
            ("send-timeout-s = 100000", "send-timeout-s"),
            ("nbd-memory = \"1M\"", "nbd-memory"),
            ("nbd-connection-requests = 0", "nbd-connection-requests"),
            ("log-level = \"loud\"", "log-level"),
            ("log-level = \"ferrite=loud\"", "log-level"),
        ] {
            let f: ConfigFile = toml::from_str(bad).unwrap();
            assert!(Config::resolve(f, None).unwrap_err().to_string().contains(key), "{bad}");
        }
        for (bad, key) in [
            ("tls-cert = \"/c\"", "go together"),
            ("tls-client-ca = \"/ca\"", "tls-client-ca"),
            ("nbd-tls = \"require\"", "nbd-tls"),
            ("nbd-tls = \"maybe\"", "nbd-tls"),
            ("admin-listen = \"127.0.0.1:1\"", "mutual TLS"),
            ("admin-listen = \"127.0.0.1:1\"\ntls-cert = \"/c\"\ntls-key = \"/k\"", "mutual TLS"),
        ] {
            let f: ConfigFile = toml::from_str(bad).unwrap();
            assert!(Config::resolve(f, None).unwrap_err().to_string().contains(key), "{bad}");
        }
        let tls = "tls-cert = \"/c\"\ntls-key = \"/k\"\ntls-client-ca = \"/ca\"\nadmin-listen = \"127.0.0.1:1\"";
        let c = Config::resolve(toml::from_str(tls).unwrap(), None).unwrap();
        assert_eq!(c.nbd_tls, TlsMode::Require, "TLS is required where a certificate is configured");
        let f: ConfigFile = toml::from_str("admin-listen = \"127.0.0.1:1\"\ninsecure-admin-listen = true").unwrap();
        assert!(Config::resolve(f, None).unwrap().insecure_admin_listen);
        // Plaintext NBD on the network is a choice, never a default.
        let f: ConfigFile = toml::from_str("nbd-listen = \"0.0.0.0:10809\"").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("insecure-nbd-listen"));
        let f: ConfigFile = toml::from_str("nbd-listen = \"10.0.0.5:10809\"\ninsecure-nbd-listen = true").unwrap();
        assert!(Config::resolve(f, None).is_ok());
        let f: ConfigFile = toml::from_str("nbd-listen = \"[::1]:10809\"").unwrap();
        assert!(Config::resolve(f, None).is_ok(), "loopback stays on the machine");
        let f: ConfigFile = toml::from_str("replication-idle-timeout-s = 0").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("replication-idle-timeout-s"));
        let f: ConfigFile =
            toml::from_str("[roles]\n\"csi\" = \"controller\"\n\"n\" = [\"replication-peer\", \"nbd-client\"]")
                .unwrap();
        let roles = Config::resolve(f, None).unwrap().roles;
        assert_eq!(roles.len(), 2);
        let f: ConfigFile = toml::from_str("[roles]\n\"csi\" = \"admin\"").unwrap();
        assert!(Config::resolve(f, None).unwrap_err().to_string().contains("unknown role"));
        let f: ConfigFile = toml::from_str("nbd-memory = \"256M\"\nmax-connections = 5").unwrap();
        let l = Config::resolve(f, None).unwrap().limits;
        assert_eq!((l.nbd_memory, l.max_connections, l.nbd_connection_requests), (256 << 20, 5, 256));
    }

    #[test]
    fn backup_targets_come_from_the_config_and_a_file_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("targets.toml");
        let config = |extra: &str| {
            let text = format!(
                "backup-targets-file = \"{}\"\n[backup-targets.local]\nkind = \"dir\"\npath = \"/b\"\n{extra}",
                file.display()
            );
            Config::resolve(toml::from_str(&text).unwrap(), None)
        };
        // No file (an optional Secret not created): the config's targets only.
        assert_eq!(config("").unwrap().backup_targets.keys().collect::<Vec<_>>(), ["local"]);
        std::fs::write(&file, "[offsite]\nkind = \"s3\"\nbucket = \"b\"\ncredentials = \".\"\nkey-file = \"k\"\n")
            .unwrap();
        let t = config("").unwrap().backup_targets;
        assert_eq!(t["offsite"].credentials.as_deref(), Some(dir.path().join(".").as_path()));
        assert_eq!(t["offsite"].key_file.as_deref(), Some(dir.path().join("k").as_path()));
        assert_eq!(t["local"].path.as_deref(), Some(Path::new("/b")), "the config's paths are as written");
        std::fs::write(&file, "[local]\nkind = \"dir\"\npath = \"/c\"\n").unwrap();
        assert!(config("").unwrap_err().to_string().contains("named both"));
        std::fs::write(&file, "[x]\nkind = \"ftp\"\n").unwrap();
        assert!(format!("{:#}", config("").unwrap_err()).contains("targets.toml"));
    }
}
