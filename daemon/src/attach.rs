//! Volumes attached as block devices on this node: ublk where the kernel has it, else the kernel
//! NBD client connected to our own Unix socket. Attachments are persisted in
//! `<data-dir>/attachments.json`, so a restarted daemon takes its ublk devices back
//! (USER_RECOVERY) instead of leaving them hung.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferrite_engine::{ErrorKind, Pool, Volume};
use ferrite_proto::ferrite::v1 as pb;
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::admin::{AdminService, ExportRecord, require, status};
use crate::state::{load_list, save_list};

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
    load_list(&attachments_file(data_dir))
}

pub fn save(data_dir: &Path, live: &[(AttachRecord, Handle)]) -> std::io::Result<()> {
    let records: Vec<&AttachRecord> = live.iter().map(|(r, _)| r).collect();
    save_list(&attachments_file(data_dir), &records)
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

/// The attachment RPCs (the `Admin` trait methods delegate here).
impl AdminService {
    /// Makes the devices attached to `volume` follow its new size, and says how it went.
    pub(crate) async fn resize_devices(&self, volume: &str, size: u64) -> Vec<String> {
        let live = self.attached.lock().await;
        let mut notes = Vec::new();
        for (r, h) in live.iter().filter(|(r, _)| r.volume == volume) {
            let note = match h {
                Handle::Ublk(d) => match tokio::task::block_in_place(|| d.resize(size)) {
                    Ok(true) => format!("{} resized online", r.device),
                    Ok(false) => format!(
                        "{} keeps its old size until it is detached and attached again \
                         (this kernel's ublk driver has no UPDATE_SIZE, Linux 6.16+)",
                        r.device
                    ),
                    Err(e) => format!("{}: resize failed: {e}", r.device),
                },
                Handle::Nbd => {
                    let index = r.index;
                    match tokio::task::spawn_blocking(move || ferrite_nbd::kernel::resize(index, size)).await {
                        Ok(Ok(())) => format!("{} resized online", r.device),
                        Ok(Err(e)) => {
                            format!("{}: resize failed ({e}); it keeps its old size until re-attached", r.device)
                        }
                        Err(e) => format!("{}: resize task failed: {e}", r.device),
                    }
                }
            };
            tracing::info!(device = %r.device, "{note}");
            notes.push(note);
        }
        notes
    }

    fn attachment_msg(&self, r: &AttachRecord, detail: String) -> pb::Attachment {
        let size = open_image(&self.pool, &r.volume).and_then(|v| v.size()).unwrap_or(0);
        message(r, size, detail)
    }

    /// AttachVolume: ublk where the kernel has it (or as asked), else the kernel NBD client.
    pub(crate) async fn attach(&self, r: pb::AttachVolumeRequest) -> Result<pb::Attachment, Status> {
        require("volume", &r.volume)?;
        let (transport, detail) = choose_transport(&r.transport)?;
        let mut opts = self.ublk;
        if r.queues != 0 {
            opts.queues = u16::try_from(r.queues).unwrap_or(u16::MAX);
        }
        if r.depth != 0 {
            opts.depth = u16::try_from(r.depth).unwrap_or(u16::MAX);
        }
        opts.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
        let mut live = self.attached.lock().await;
        if let Some((old, _)) = live.iter().find(|(x, _)| x.volume == r.volume) {
            return Err(Status::already_exists(format!("{} is already attached as {}", r.volume, old.device)));
        }
        let (rec, handle) = if transport == "ublk" {
            let (pool, spec) = (Arc::clone(&self.pool), r.volume.clone());
            let dev = tokio::task::spawn_blocking(move || {
                let v = open_image(&pool, &spec).map_err(status)?;
                ferrite_ublk::Device::attach(v, &opts).map_err(|e| Status::internal(e.to_string()))
            })
            .await
            .map_err(|e| Status::internal(format!("attach task failed: {e}")))??;
            let rec = AttachRecord {
                volume: r.volume.clone(),
                transport: transport.into(),
                device: dev.path().display().to_string(),
                index: dev.id(),
                read_only: dev.is_read_only(),
                export: None,
            };
            (rec, Handle::Ublk(dev))
        } else {
            let name = r.volume.clone();
            let export = ExportRecord {
                name: name.clone(),
                volume: r.volume.clone(),
                read_only: r.volume.contains('@'),
                allow: Vec::new(),
            };
            let created = self.ensure_export(&export).await?;
            let sock = self.cfg.nbd_socket.clone();
            let a = tokio::task::spawn_blocking(move || ferrite_nbd::kernel::attach(&sock, &name))
                .await
                .map_err(|e| Status::internal(format!("attach task failed: {e}")))?
                .map_err(|e| Status::failed_precondition(format!("kernel NBD attach: {e}")));
            let a = match a {
                Ok(a) => a,
                Err(e) => {
                    if created {
                        self.drop_export(&export.name).await;
                    }
                    return Err(e);
                }
            };
            let rec = AttachRecord {
                volume: r.volume.clone(),
                transport: transport.into(),
                device: a.device.display().to_string(),
                index: a.index,
                read_only: a.read_only,
                export: created.then_some(export.name),
            };
            (rec, Handle::Nbd)
        };
        tracing::info!(volume = %rec.volume, device = %rec.device, transport, %detail, "volume attached");
        let msg = self.attachment_msg(&rec, detail);
        live.push((rec, handle));
        if let Err(e) = save(&self.cfg.data_dir, &live) {
            tracing::error!(error = %e, "cannot save the attachment list; a restart will not recover this device");
        }
        Ok(msg)
    }

    /// DetachVolume, by device path or volume name.
    pub(crate) async fn detach(&self, device: &str) -> Result<pb::DetachVolumeResponse, Status> {
        require("device", device)?;
        let mut live = self.attached.lock().await;
        let Some(i) = live.iter().position(|(r, _)| r.device == device || r.volume == device) else {
            return Err(Status::not_found(format!("{device:?} is not attached by this daemon")));
        };
        let (rec, handle) = &mut live[i];
        let index = rec.index;
        let done = match handle {
            Handle::Ublk(d) => tokio::task::block_in_place(|| d.detach()),
            Handle::Nbd => tokio::task::spawn_blocking(move || ferrite_nbd::kernel::detach(index))
                .await
                .map_err(|e| Status::internal(format!("detach task failed: {e}")))?,
        };
        done.map_err(|e| Status::internal(format!("detaching {}: {e}", rec.device)))?;
        let (rec, _) = live.remove(i);
        if let Some(export) = &rec.export {
            self.drop_export(export).await;
        }
        if let Err(e) = save(&self.cfg.data_dir, &live) {
            tracing::error!(error = %e, "cannot save the attachment list");
        }
        tracing::info!(volume = %rec.volume, device = %rec.device, "volume detached");
        Ok(pb::DetachVolumeResponse {})
    }

    pub(crate) async fn attachments(&self) -> pb::ListAttachmentsResponse {
        let live = self.attached.lock().await;
        let attachments = live.iter().map(|(r, _)| self.attachment_msg(r, String::new())).collect();
        pb::ListAttachmentsResponse { attachments }
    }
}
