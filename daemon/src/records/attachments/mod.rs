//! Volumes attached as block devices on this node: ublk where the kernel has it, else the kernel
//! NBD client, served by this daemon ([`kernel_nbd`]). Attachments are persisted in
//! `<data-dir>/attachments.json`, so a restarted daemon takes its devices back (ublk: user
//! recovery; kernel NBD: a new connection) instead of leaving them hung.

pub mod calls;
pub mod kernel_nbd;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferrite_engine::Pool;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, MutexGuard};

use crate::base::error::Error;
use crate::base::state::RecordFile;
use crate::records::exports::{ExportRecord, ExportTable, open_image};
use kernel_nbd::{Keeper, Links};

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
    /// For a volume another node serves: its NBD listener (host:port), reached through a relay.
    #[serde(default)]
    pub remote: Option<String>,
    /// The NBD listeners of its other copies, where its primary may move (a relay follows).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copies: Vec<String>,
}

impl AttachRecord {
    /// The attachment as the admin API gives it, with its device's `size`.
    pub fn message(&self, detail: String, size: u64) -> ferrite_proto::ferrite::v1::Attachment {
        ferrite_proto::ferrite::v1::Attachment {
            volume: self.volume.clone(),
            device: self.device.clone(),
            transport: self.transport.clone(),
            read_only: self.read_only,
            size,
            detail,
            remote: self.remote.clone().unwrap_or_default(),
        }
    }
}

/// The live half of an attachment.
#[derive(Debug)]
pub enum Handle {
    Ublk(ferrite_ublk::Device),
    /// A kernel NBD device (a local volume's, or a relayed one's): the task keeping it connected.
    Nbd(Keeper),
}

/// The devices this daemon attached, with their records.
#[derive(Debug)]
pub struct Attachments {
    file: RecordFile,
    /// The ublk devices and their hold, for the watchdog ([`ferrite_ublk::hold`]).
    hold_list: PathBuf,
    links: Arc<Links>,
    live: Mutex<Vec<(AttachRecord, Handle)>>,
}

/// The transport to use for `wanted` ("", "auto", "ublk", "nbd"), and why.
pub fn choose_transport(wanted: &str) -> Result<(&'static str, String), Error> {
    match wanted {
        "" | "auto" => match ferrite_ublk::Features::probe() {
            Ok(f) => Ok(("ublk", f.describe())),
            Err(e) => Ok(("nbd", format!("ublk unavailable ({e}); using the kernel NBD client"))),
        },
        "ublk" => {
            ferrite_ublk::Features::probe().map(|f| ("ublk", f.describe())).map_err(|e| Error::refused(e.to_string()))
        }
        "nbd" => Ok(("nbd", "kernel NBD client, as asked".into())),
        other => Err(Error::invalid(format!("transport must be auto, ublk or nbd, not {other:?}"))),
    }
}

impl Attachments {
    /// Takes back the devices a previous daemon left (kill -9, or a clean exit): ublk devices
    /// through user recovery, kernel NBD devices with a new connection each; saves what remains.
    /// Without a pool (a node plugin with no daemon on its node: [`crate::serve::attach_only`]) only
    /// other nodes' volumes are attached, and only those are taken back.
    pub async fn restore(
        pool: Option<&Arc<Pool>>,
        data_dir: &Path,
        hold_list: PathBuf,
        links: Links,
        ublk: ferrite_ublk::Options,
    ) -> anyhow::Result<Self> {
        let file = RecordFile::new(data_dir, "attachments");
        let records: Vec<AttachRecord> = file.load()?;
        let (ublk_records, nbd_records) = records.into_iter().partition(|r| r.transport == "ublk");
        let links = Arc::new(links);
        let lost = pool.and_then(|p| p.recovery_report().truncated.clone());
        let mut live = match pool {
            Some(pool) => {
                let pool = Arc::clone(pool);
                tokio::task::spawn_blocking(move || recover(&pool, ublk_records, &ublk)).await?
            }
            None => Vec::new(),
        };
        for r in nbd_records {
            live.extend(reconnect(&links, r, lost.as_deref()).await);
        }
        let this = Self { file, hold_list, links, live: Mutex::new(live) };
        this.save(&this.live.lock().await).map_err(|e| anyhow::anyhow!("saving the attachment list: {e}"))?;
        Ok(this)
    }

    fn save(&self, live: &[(AttachRecord, Handle)]) -> std::io::Result<()> {
        let records: Vec<AttachRecord> = live.iter().map(current).collect();
        self.file.save(&records)?;
        let held: Vec<ferrite_ublk::hold::Held> = records
            .iter()
            .filter(|r| r.transport == "ublk")
            .map(|r| ferrite_ublk::hold::Held {
                id: r.index,
                volume: r.volume.clone(),
                hold_s: self.links.hold.as_secs(),
            })
            .collect();
        crate::base::state::save_json(&self.hold_list, &ferrite_ublk::hold::List::now(held)?)
    }

    /// The attachments, locked: held across a deletion so that nothing attaches what is being
    /// deleted meanwhile. Lock order everywhere: attachments, then exports.
    pub async fn lock(&self) -> MutexGuard<'_, Vec<(AttachRecord, Handle)>> {
        self.live.lock().await
    }

    pub async fn list(&self) -> Vec<AttachRecord> {
        self.live.lock().await.iter().map(current).collect()
    }

    /// Attaches `volume` (or `volume@snapshot`) over `transport` ("ublk" or "nbd", as
    /// [`choose_transport`] picked); the NBD way exports it first if no export of that name runs.
    pub async fn attach(
        &self,
        pool: &Arc<Pool>,
        exports: &ExportTable,
        volume: &str,
        transport: &'static str,
        opts: ferrite_ublk::Options,
    ) -> Result<AttachRecord, Error> {
        let mut live = self.live.lock().await;
        if let Some((old, _)) = live.iter().find(|(x, _)| x.volume == volume) {
            return Err(Error::already_exists(format!("{volume} is already attached as {}", old.device)));
        }
        let (rec, handle) = if transport == "ublk" {
            let (pool, spec) = (Arc::clone(pool), volume.to_owned());
            let dev = tokio::task::spawn_blocking(move || {
                let v = open_image(&pool, &spec).map_err(Error::from)?;
                ferrite_ublk::Device::attach(v, &opts).map_err(|e| Error::internal(e.to_string()))
            })
            .await
            .map_err(|e| Error::internal(format!("attach task failed: {e}")))??;
            let rec = AttachRecord {
                volume: volume.to_owned(),
                transport: transport.into(),
                device: dev.path().display().to_string(),
                index: dev.id(),
                read_only: dev.is_read_only(),
                export: None,
                remote: None,
                copies: Vec::new(),
            };
            (rec, Handle::Ublk(dev))
        } else {
            let export = ExportRecord {
                name: volume.to_owned(),
                volume: volume.to_owned(),
                read_only: volume.contains('@'),
                // The kernel client is on this node: the export is never served over TCP.
                allow: vec!["local".into()],
            };
            let created = exports.ensure_local(&export).await?;
            let rec = AttachRecord {
                volume: volume.to_owned(),
                transport: transport.into(),
                device: String::new(),
                index: 0,
                read_only: false,
                export: created.then(|| export.name.clone()),
                remote: None,
                copies: Vec::new(),
            };
            match self.links.attach(&rec).await {
                Ok(attached) => self.keep(rec, attached),
                Err(e) => {
                    if created {
                        exports.discard(&export.name).await;
                    }
                    return Err(Error::refused(format!("kernel NBD attach: {e}")));
                }
            }
        };
        Ok(self.add(&mut live, rec, handle))
    }

    fn add(&self, live: &mut Vec<(AttachRecord, Handle)>, rec: AttachRecord, handle: Handle) -> AttachRecord {
        tracing::info!(volume = %rec.volume, device = %rec.device, transport = %rec.transport, "volume attached");
        live.push((rec.clone(), handle));
        if let Err(e) = self.save(live) {
            tracing::error!(error = %e, "cannot save the attachment list; a restart will not recover this device");
        }
        rec
    }

    /// Attaches `export` of the NBD listener at `address` (another node's daemon, which serves
    /// `volume`) as a kernel NBD device, over TLS with this daemon's certificate; it follows the
    /// volume's primary to any of `copies` (NBD listeners too) in a failover.
    pub async fn attach_remote(
        &self,
        volume: &str,
        address: &str,
        export: &str,
        copies: Vec<String>,
    ) -> Result<AttachRecord, Error> {
        for a in std::iter::once(address).chain(copies.iter().map(String::as_str)) {
            kernel_nbd::relay_tls(self.links.tls.as_ref(), a)?;
        }
        let mut live = self.live.lock().await;
        if let Some((old, _)) = live.iter().find(|(x, _)| x.volume == volume) {
            return Err(Error::already_exists(format!("{volume} is already attached as {}", old.device)));
        }
        let rec = AttachRecord {
            volume: volume.to_owned(),
            transport: "nbd".into(),
            device: String::new(),
            index: 0,
            read_only: false,
            export: Some(export.to_owned()),
            remote: Some(address.to_owned()),
            copies,
        };
        let failed = |e: std::io::Error| Error::unavailable(format!("attaching {volume} from {address}: {e}"));
        let attached = self.links.attach(&rec).await.map_err(failed)?;
        let (rec, handle) = self.keep(rec, attached);
        Ok(self.add(&mut live, rec, handle))
    }

    /// `rec` completed with the kernel NBD device `attached` made, kept connected from now on.
    fn keep(&self, mut rec: AttachRecord, attached: kernel_nbd::Attached) -> (AttachRecord, Handle) {
        let (a, session, kernel_end) = attached;
        (rec.device, rec.index, rec.read_only) = (a.device.display().to_string(), a.index, a.read_only);
        let keeper = self.links.keep(rec.clone(), session, Some(kernel_end));
        (rec, Handle::Nbd(keeper))
    }

    /// Detaches by device path or volume name; stops the export the attach made, if any.
    pub async fn detach(&self, exports: Option<&ExportTable>, device: &str) -> Result<(), Error> {
        let mut live = self.live.lock().await;
        let Some(i) = live.iter().position(|(r, _)| r.device == device || r.volume == device) else {
            return Err(Error::not_found(format!("{device:?} is not attached by this daemon")));
        };
        let (rec, handle) = &mut live[i];
        let index = rec.index;
        let done = match handle {
            Handle::Ublk(d) => tokio::task::block_in_place(|| d.detach()),
            Handle::Nbd(keeper) => {
                keeper.stopping(true);
                let done = tokio::task::spawn_blocking(move || ferrite_nbd::kernel::detach(index))
                    .await
                    .map_err(|e| Error::internal(format!("detach task failed: {e}")))?;
                keeper.stopping(done.is_err());
                done
            }
        };
        done.map_err(|e| Error::internal(format!("detaching {}: {e}", rec.device)))?;
        let (rec, _) = live.remove(i);
        if let (Some(export), Some(exports)) = (rec.export.as_ref().filter(|_| rec.remote.is_none()), exports) {
            exports.discard(export).await;
        }
        if let Err(e) = self.save(&live) {
            tracing::error!(error = %e, "cannot save the attachment list");
        }
        tracing::info!(volume = %rec.volume, device = %rec.device, "volume detached");
        Ok(())
    }

    /// Makes the devices attached to `volume` follow its new size, and says how it went.
    pub async fn resize(&self, volume: &str, size: u64) -> Vec<String> {
        let live = self.live.lock().await;
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
                Handle::Nbd(_) => {
                    let (index, backend) = (r.index, kernel_nbd::backend(&r.volume));
                    match tokio::task::spawn_blocking(move || ferrite_nbd::kernel::resize(index, size, &backend)).await
                    {
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

    /// Gives a remote volume's device (`device` or the volume's name) the volume's current size,
    /// after its primary grew it.
    pub async fn resize_remote(&self, device: &str) -> Result<AttachRecord, Error> {
        let rec = self.list().await.into_iter().find(|r| r.device == device || r.volume == device);
        let Some(rec) = rec else {
            return Err(Error::not_found(format!("{device:?} is not attached by this daemon")));
        };
        let Some(address) = &rec.remote else {
            return Err(Error::refused(format!(
                "{} is a local volume's device: it follows its volume's size by itself",
                rec.device
            )));
        };
        let export = rec.export.as_deref().unwrap_or_default();
        let failed = |e: std::io::Error| Error::unavailable(format!("asking {address} for {}'s size: {e}", rec.volume));
        let (cfg, name) = kernel_nbd::relay_tls(self.links.tls.as_ref(), address)?;
        let size = ferrite_nbd::relay::export_size(cfg, name, address, export).await.map_err(failed)?;
        let index = rec.index;
        let now = ferrite_nbd::kernel::size(index).map_err(|e| Error::internal(format!("{}: {e}", rec.device)))?;
        if size < now {
            return Err(Error::refused(format!(
                "{} is {now} bytes but its volume on {address} only {size}; it does not shrink",
                rec.device
            )));
        }
        if size > now {
            let backend = kernel_nbd::backend(&rec.volume);
            tokio::task::spawn_blocking(move || ferrite_nbd::kernel::resize(index, size, &backend))
                .await
                .map_err(|e| Error::internal(format!("resize task failed: {e}")))?
                .map_err(|e| Error::internal(format!("resizing {}: {e}", rec.device)))?;
            tracing::info!(device = %rec.device, size, "remote volume's device resized");
        }
        Ok(rec)
    }

    /// Before the pool closes: ublk devices stop taking requests (the kernel keeps them for the
    /// next daemon) and the ones already running finish; kernel NBD devices lose their
    /// connection, unrepaired (the kernel holds their I/O for the next daemon). The returned
    /// guard keeps the list locked, so nothing attaches until the caller drops it.
    pub async fn freeze(&self) -> MutexGuard<'_, Vec<(AttachRecord, Handle)>> {
        let live = self.live.lock().await;
        tokio::task::block_in_place(|| {
            for (r, h) in live.iter() {
                match h {
                    Handle::Ublk(d) if !d.freeze(FREEZE_LIMIT) => {
                        tracing::error!(device = %r.device, "ublk requests still running after {FREEZE_LIMIT:?}");
                    }
                    Handle::Ublk(_) => {}
                    Handle::Nbd(keeper) => keeper.cut(),
                }
            }
        });
        live
    }
}

/// An attachment's record as it stands: a relayed device's remote is where its keeper follows
/// the volume's primary to.
fn current((r, h): &(AttachRecord, Handle)) -> AttachRecord {
    let mut r = r.clone();
    if let (Handle::Nbd(k), Some(_)) = (h, &r.remote) {
        r.remote = k.remote().or(r.remote);
    }
    r
}

/// Takes back a kernel NBD device a previous daemon left: a new connection, unless the device
/// is gone, or recovery dropped part of the log (then it is detached, which fails its I/O, for
/// the reason [`recover`] gives for ublk).
async fn reconnect(links: &Arc<Links>, r: AttachRecord, lost: Option<&str>) -> Option<(AttachRecord, Handle)> {
    if !Links::still_attached(&r) {
        tracing::warn!(device = %r.device, volume = %r.volume, "the kernel NBD device is gone; not reconnecting it");
        return None;
    }
    if let (Some(why), None) = (lost, &r.remote) {
        let index = r.index;
        let failed = tokio::task::spawn_blocking(move || ferrite_nbd::kernel::detach(index)).await;
        tracing::error!(device = %r.device, volume = %r.volume, reason = %why, result = ?failed,
            "not reconnecting the kernel NBD device: recovery dropped part of the log, so acknowledged \
             writes may be missing; it is detached instead (attach the volume again after checking it)");
        return None;
    }
    // The kernel noticed the old connection's end (or will): the keeper hands it a new one.
    let keeper = links.keep(r.clone(), tokio::spawn(async {}), None);
    Some((r, Handle::Nbd(keeper)))
}

/// The records a previous daemon left whose devices can be taken back. A device is never
/// resumed over a loss: where recovery dropped part of the log (a torn batch, a damaged store),
/// acknowledged writes may be missing, and every device left in recovery is failed instead.
fn recover(pool: &Pool, records: Vec<AttachRecord>, opts: &ferrite_ublk::Options) -> Vec<(AttachRecord, Handle)> {
    let mut live = Vec::new();
    let lost = pool.recovery_report().truncated.clone();
    for r in records {
        if !Path::new(&format!("/sys/class/ublk-char/ublkc{}", r.index)).exists() {
            tracing::warn!(device = %r.device, volume = %r.volume, "ublk device is gone; not recovering it");
            continue;
        }
        if let Some(why) = &lost {
            let failed = ferrite_ublk::Device::fail(r.index);
            tracing::error!(device = %r.device, volume = %r.volume, reason = %why, result = ?failed,
                "not resuming the ublk device: recovery dropped part of the log, so acknowledged writes \
                 may be missing; its I/O fails instead (attach the volume again after checking it)");
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

/// Refuses to delete `what` while an attached device (picked by `serves`, given the attached
/// volume or `volume@snapshot`) still serves it.
pub fn refuse_if_attached(
    live: &[(AttachRecord, Handle)],
    what: &str,
    serves: impl Fn(&str) -> bool,
) -> Result<(), Error> {
    let devs: Vec<&str> =
        live.iter().filter(|(r, _)| r.remote.is_none() && serves(&r.volume)).map(|(r, _)| r.device.as_str()).collect();
    if devs.is_empty() {
        return Ok(());
    }
    Err(Error::refused(format!("{what} is attached as {}; detach it first", devs.join(", "))))
}
