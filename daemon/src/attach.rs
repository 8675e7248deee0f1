//! Volumes attached as block devices on this node: ublk where the kernel has it, else the kernel
//! NBD client connected to our own Unix socket. Attachments are persisted in
//! `<data-dir>/attachments.json`, so a restarted daemon takes its ublk devices back
//! (USER_RECOVERY) instead of leaving them hung.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrite_engine::{ErrorKind, Pool, Volume};
use ferrite_proto::ferrite::v1 as pb;
use serde::{Deserialize, Serialize};
use tonic::Status;

/// How long a daemon exit waits for ublk requests already in the engine.
const FREEZE_LIMIT: Duration = Duration::from_secs(30);

/// An attachment as persisted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AttachRecord {
    /// A volume, or `volume@snapshot`.
    pub volume: String,
    /// "ublk" or "nbd".
    pub transport: String,
    /// /dev/ublkbN or /dev/nbdN.
    pub device: String,
    /// ublk device id or NBD index.
    pub index: u32,
    pub read_only: bool,
    /// The NBD export the kernel client uses (NBD only).
    #[serde(default)]
    pub export: Option<String>,
}

/// The live half of an attachment.
#[derive(Debug)]
pub enum Handle {
    Ublk(ferrite_ublk::Device),
    Nbd,
}

/// Opens a volume, or `volume@snapshot` (read-only).
pub fn open_image(pool: &Pool, spec: &str) -> Result<Volume, ferrite_engine::Error> {
    match spec.split_once('@') {
        Some((vol, snap)) => {
            let info = pool.snapshot_info(snap)?;
            // (A snapshot outlives its volume; then only the snapshot name has to match.)
            if info.volume.as_deref().is_some_and(|v| v != vol) {
                return Err(ferrite_engine::Error::new(
                    ErrorKind::NotFound,
                    format!("volume {vol:?} has no snapshot {snap:?}"),
                ));
            }
            pool.open_snapshot(snap)
        }
        None => pool.open_volume(spec),
    }
}

pub fn attachments_file(data_dir: &Path) -> PathBuf {
    data_dir.join("attachments.json")
}

pub fn load(data_dir: &Path) -> anyhow::Result<Vec<AttachRecord>> {
    let p = attachments_file(data_dir);
    match std::fs::read(&p) {
        Ok(b) => Ok(serde_json::from_slice(&b).map_err(|e| anyhow::anyhow!("parsing {}: {e}", p.display()))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(anyhow::anyhow!("reading {}: {e}", p.display())),
    }
}

pub fn save(data_dir: &Path, live: &[(AttachRecord, Handle)]) -> std::io::Result<()> {
    let records: Vec<&AttachRecord> = live.iter().map(|(r, _)| r).collect();
    let p = attachments_file(data_dir);
    let tmp = p.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&records).expect("serialisable"))?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, &p)
}

/// The transport to use for `wanted` ("", "auto", "ublk", "nbd"), and why.
pub fn choose_transport(wanted: &str) -> Result<(&'static str, String), Status> {
    match wanted {
        "" | "auto" => match ferrite_ublk::Features::probe() {
            Ok(f) => Ok(("ublk", f.describe())),
            Err(e) => Ok(("nbd", format!("ublk unavailable ({e}); using the kernel NBD client"))),
        },
        "ublk" => ferrite_ublk::Features::probe()
            .map(|f| ("ublk", f.describe()))
            .map_err(|e| Status::failed_precondition(e.to_string())),
        "nbd" => Ok(("nbd", "kernel NBD client, as asked".into())),
        other => Err(Status::invalid_argument(format!("transport must be auto, ublk or nbd, not {other:?}"))),
    }
}

/// Takes back the ublk devices a previous daemon left (kill -9, or a clean exit that froze them);
/// forgets NBD attachments, whose connections ended with that daemon.
pub fn restore(pool: &Pool, records: Vec<AttachRecord>, opts: &ferrite_ublk::Options) -> Vec<(AttachRecord, Handle)> {
    let mut live = Vec::new();
    for r in records {
        if r.transport != "ublk" {
            tracing::warn!(device = %r.device, volume = %r.volume,
                "the kernel NBD connection ended with the previous daemon; attach the volume again");
            continue;
        }
        if !Path::new(&format!("/sys/class/ublk-char/ublkc{}", r.index)).exists() {
            tracing::warn!(device = %r.device, volume = %r.volume, "ublk device is gone; not recovering it");
            continue;
        }
        let recovered = open_image(pool, &r.volume)
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|v| ferrite_ublk::Device::recover(r.index, v, opts));
        match recovered {
            Ok(d) => {
                tracing::info!(device = %r.device, volume = %r.volume, "ublk device recovered");
                live.push((r, Handle::Ublk(d)));
            }
            Err(e) => tracing::error!(device = %r.device, volume = %r.volume, error = %e, "cannot recover ublk device"),
        }
    }
    live
}

/// Before the pool closes: ublk devices stop taking requests (the kernel keeps them for the next
/// daemon) and the ones already running finish.
pub fn freeze(live: &[(AttachRecord, Handle)]) {
    for (r, h) in live {
        if let Handle::Ublk(d) = h
            && !d.freeze(FREEZE_LIMIT)
        {
            tracing::error!(device = %r.device, "ublk requests still running after {FREEZE_LIMIT:?}");
        }
    }
}

pub fn message(r: &AttachRecord, size: u64, detail: String) -> pb::Attachment {
    pb::Attachment {
        volume: r.volume.clone(),
        device: r.device.clone(),
        transport: r.transport.clone(),
        read_only: r.read_only,
        size,
        detail,
    }
}
