//! `ferrite pool node`: which store holds a Kubernetes node's pool, for the data-path
//! DaemonSet's init container. One ConfigMap serves every node; each node says in its own
//! annotations which device is its pool:
//!
//! - `pool.ferrite.dev/device: /dev/disk/by-id/nvme-...`: the pool is that block device;
//! - `pool.ferrite.dev/format: "true"`: and it may be formatted when it holds nothing at all.
//!
//! Without a device annotation the pool is the configuration's file under data-dir. A device
//! that already holds a pool is used as it is; one that holds anything else (a filesystem, a
//! partition table, a volume manager) or is in use is refused whatever the annotations say, and
//! a blank one is formatted only with the opt-in. The result is the daemon's configuration with
//! `pool-path` set, and `zone` and `region` from the node's `topology.kubernetes.io/` labels,
//! written where the daemon container reads it.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::pool_format::{self, FormatRequest};
use ferrite_daemon::base::config::Config;

#[derive(clap::Args)]
pub struct Args {
    /// This node's name.
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    /// The configuration every node shares.
    #[arg(long, short)]
    pub config: PathBuf,
    /// Where the daemon reads its configuration.
    #[arg(long)]
    pub out: PathBuf,
    /// The node's address: the configuration's TCP listeners on every address (0.0.0.0)
    /// listen on it alone.
    #[arg(long)]
    pub listen_ip: Option<std::net::IpAddr>,
}

pub fn run(a: &Args) -> Result<()> {
    super::init_logging("warn");
    prepare(&a.node, &a.config, &a.out, a.listen_ip)
}

pub const DEVICE: &str = "pool.ferrite.dev/device";
pub const FORMAT: &str = "pool.ferrite.dev/format";

/// What a node's annotations ask for.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    /// The configuration's pool (a file under data-dir, or its pool-path).
    Configured,
    /// A block device; formatting it when blank is allowed or not.
    Device { path: PathBuf, format: bool },
}

pub fn plan(annotations: &BTreeMap<String, String>) -> Result<Plan> {
    let format = match annotations.get(FORMAT).map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => bail!("annotation {FORMAT} must be \"true\" or \"false\", not {other:?}"),
    };
    let Some(dev) = annotations.get(DEVICE) else {
        if format {
            bail!("annotation {FORMAT} is set but {DEVICE} names no device");
        }
        return Ok(Plan::Configured);
    };
    let path = PathBuf::from(dev);
    if !path.is_absolute() || !path.starts_with("/dev") || dev.contains("/../") {
        bail!("annotation {DEVICE} must name a block device under /dev, not {dev:?}");
    }
    Ok(Plan::Device { path, format })
}

/// Reads `node`'s annotations, prepares its pool and writes the daemon's configuration to `out`,
/// its TCP listeners on `listen_ip` (the node's address) where the shared configuration says
/// any address.
pub fn prepare(node: &str, config: &Path, out: &Path, listen_ip: Option<std::net::IpAddr>) -> Result<()> {
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    let text = std::fs::read_to_string(config).with_context(|| format!("reading config {}", config.display()))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (annotations, labels) = rt.block_on(ferrite_csi::shared::nodes::kubernetes::node_annotations(node))?;
    let text = match plan(&annotations).with_context(|| format!("node {node}"))? {
        Plan::Configured => {
            println!("node {node}: no {DEVICE} annotation; the pool is the configuration's");
            text
        }
        Plan::Device { path, format } => {
            let parsed: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", config.display()))?;
            if parsed.contains_key("pool-path") {
                bail!(
                    "{} sets pool-path and node {node}'s annotation {DEVICE} names {}: keep one",
                    config.display(),
                    path.display()
                );
            }
            let line = format!("pool-path = {}\n", toml::Value::String(path.display().to_string()));
            let text = line + &text;
            let cfg: Config = Config::load_str(&text)?;
            device(&cfg, &path, format).with_context(|| format!("node {node}: pool device {}", path.display()))?;
            text
        }
    };
    let mut text = domains(&labels) + &text;
    if let Some(ip) = listen_ip {
        text = bind_to(&text, ip)?;
    }
    Config::load_str(&text).with_context(|| format!("node {node}'s topology labels"))?;
    write_private(out, &text)
}

/// The TCP listeners of a configuration that listen on every address (`0.0.0.0`, `[::]`) moved
/// to `ip` alone: a host-network daemon then serves on the node's address, not on every
/// interface of the host.
fn bind_to(text: &str, ip: std::net::IpAddr) -> Result<String> {
    let mut t: toml::Table = toml::from_str(text).context("parsing the configuration")?;
    let mut moved = false;
    for key in ["nbd-listen", "admin-listen", "metrics-listen"] {
        let Some(toml::Value::String(v)) = t.get_mut(key) else { continue };
        let at: std::net::SocketAddr = v.parse().with_context(|| format!("{key} = {v:?}"))?;
        if at.ip().is_unspecified() {
            *v = std::net::SocketAddr::new(ip, at.port()).to_string();
            moved = true;
        }
    }
    Ok(if moved { toml::to_string(&t)? } else { text.to_owned() })
}

/// The configuration lines of a node's zone and region labels (none for a label it lacks).
fn domains(labels: &BTreeMap<String, String>) -> String {
    let line = |key: &str, label: &str| {
        labels.get(label).map(|v| format!("{key} = {}\n", toml::Value::String(v.clone()))).unwrap_or_default()
    };
    line("zone", "topology.kubernetes.io/zone") + &line("region", "topology.kubernetes.io/region")
}

/// Uses the device if it holds a pool; formats it if it holds nothing and `format` allows.
fn device(cfg: &Config, path: &Path, format: bool) -> Result<()> {
    let meta = std::fs::metadata(path).context("looking at it")?;
    if !meta.file_type().is_block_device() {
        bail!("not a block device");
    }
    let file = std::fs::File::open(path).context("opening it")?;
    if ferrite_engine::io::holds_pool(&file).context("reading it")? {
        println!("{}: holds a Ferrite pool; serving it", path.display());
        return Ok(());
    }
    if let Some(found) = ferrite_engine::io::probe(&file).context("reading it")? {
        bail!("holds {found}; refusing to format it (wipe it by hand if it is really free)");
    }
    if !format {
        bail!("holds no pool; annotate the node with {FORMAT}=\"true\" to format it (nothing on it is kept)");
    }
    drop(file);
    // The format refuses a device in use (it opens it exclusively) and looks again.
    let req = FormatRequest { path: Some(path.to_path_buf()), size: None, preallocate: false, force: false };
    pool_format::format(cfg, &req)
}

fn write_private(out: &Path, text: &str) -> Result<()> {
    let tmp = out.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(text.as_bytes()).and_then(|()| f.sync_all()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, out).with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn listeners_on_every_address_move_to_the_node_address() {
        let text = "insecure-admin-listen = true\ninsecure-nbd-listen = true\nadmin-listen = \"0.0.0.0:7070\"\nnbd-listen = \"[::]:10809\"\nmetrics-listen = \"127.0.0.1:9200\"\n[roles]\n\"a\" = \"operator\"\n";
        let out = super::bind_to(text, "10.0.0.5".parse().unwrap()).unwrap();
        let cfg = ferrite_daemon::base::config::Config::load_str(&out).unwrap();
        assert_eq!(cfg.admin_listen.unwrap().to_string(), "10.0.0.5:7070");
        assert_eq!(cfg.nbd_listen.unwrap().to_string(), "10.0.0.5:10809");
        assert_eq!(cfg.metrics_listen.unwrap().to_string(), "127.0.0.1:9200", "a chosen address stays");
        assert!(out.contains("[roles]"), "{out}");
        let none = "data-dir = \"/x\"\n";
        assert_eq!(super::bind_to(none, "10.0.0.5".parse().unwrap()).unwrap(), none);
    }

    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn zone_and_region_from_labels() {
        let labels = BTreeMap::from([
            ("topology.kubernetes.io/zone".to_owned(), "eu-1a".to_owned()),
            ("kubernetes.io/hostname".to_owned(), "n1".to_owned()),
        ]);
        assert_eq!(domains(&labels), "zone = \"eu-1a\"\n");
        let cfg = Config::load_str(&domains(&labels)).unwrap();
        assert_eq!((cfg.zone.as_str(), cfg.region.as_str()), ("eu-1a", ""));
        assert!(domains(&BTreeMap::new()).is_empty());
        let bad = BTreeMap::from([("topology.kubernetes.io/region".to_owned(), "-x".to_owned())]);
        assert!(Config::load_str(&domains(&bad)).is_err());
    }

    #[test]
    fn plans_from_annotations() {
        assert_eq!(plan(&ann(&[])).unwrap(), Plan::Configured);
        assert_eq!(
            plan(&ann(&[(DEVICE, "/dev/disk/by-id/nvme-x")])).unwrap(),
            Plan::Device { path: "/dev/disk/by-id/nvme-x".into(), format: false }
        );
        assert_eq!(
            plan(&ann(&[(DEVICE, "/dev/sdb"), (FORMAT, "true")])).unwrap(),
            Plan::Device { path: "/dev/sdb".into(), format: true }
        );
        for (bad, why) in [
            (ann(&[(DEVICE, "sdb")]), "under /dev"),
            (ann(&[(DEVICE, "/etc/passwd")]), "under /dev"),
            (ann(&[(DEVICE, "/dev/../etc/x")]), "under /dev"),
            (ann(&[(DEVICE, "/dev/sdb"), (FORMAT, "yes")]), "\"true\" or \"false\""),
            (ann(&[(FORMAT, "true")]), "names no device"),
        ] {
            let e = plan(&bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
