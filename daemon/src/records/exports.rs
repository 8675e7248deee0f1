//! The exports this daemon serves over NBD: their records, kept in `<data-dir>/exports.json` so
//! they come back after a restart, and the NBD server's live exports made from them. A record is
//! saved before its export starts or after it stops, so the file never names less than runs.

use std::sync::Arc;

use ferrite_engine::{ErrorKind, Pool, Volume};
use ferrite_nbd::export::Allow;
use ferrite_nbd::{Export, Exports};
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, MutexGuard};

use crate::base::error::Error;
use crate::base::state::RecordFile;

/// The names of the exports that are publications (`publications.rs`): an identity on their
/// allow list needs the `nbd-client` role too.
pub const PUBLICATION_PREFIX: &str = "csi-publish-";

/// An export as persisted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExportRecord {
    pub name: String,
    /// A volume, or `volume@snapshot` (read-only).
    pub volume: String,
    pub read_only: bool,
    /// Who may open it over TCP (see `ferrite_nbd::export::Allow`); empty: any client.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
}

impl ExportRecord {
    /// The snapshot a `volume@snapshot` export serves.
    pub fn snapshot(&self) -> Option<&str> {
        snapshot_of(&self.volume)
    }
}

/// The snapshot part of `volume@snapshot`.
pub fn snapshot_of(spec: &str) -> Option<&str> {
    spec.split_once('@').map(|(_, s)| s)
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

/// The persisted exports and the NBD server's live ones.
#[derive(Debug)]
pub struct ExportTable {
    pool: Arc<Pool>,
    live: Arc<Exports>,
    file: RecordFile,
    records: Mutex<Vec<ExportRecord>>,
}

impl ExportTable {
    /// Loads the saved records and starts their exports on `live`; one that cannot start (its
    /// volume is gone, say) is logged and kept, so a later fix brings it back.
    pub fn restore(pool: Arc<Pool>, live: Arc<Exports>, data_dir: &std::path::Path) -> anyhow::Result<Self> {
        let file = RecordFile::new(data_dir, "exports");
        let records: Vec<ExportRecord> = file.load()?;
        for r in &records {
            if let Err(e) = publish(&pool, &live, r) {
                tracing::warn!(export = %r.name, volume = %r.volume, error = %e, "cannot restore export");
            }
        }
        Ok(Self { pool, live, file, records: Mutex::new(records) })
    }

    /// The records, locked: held across a deletion so that no export of what is being deleted
    /// can start meanwhile. Lock order everywhere: attachments, then exports.
    pub async fn lock(&self) -> MutexGuard<'_, Vec<ExportRecord>> {
        self.records.lock().await
    }

    pub async fn list(&self) -> Vec<ExportRecord> {
        self.records.lock().await.clone()
    }

    /// Starts the recorded exports of `volume` (and its snapshots) that are not running: those
    /// a restart could not start while the volume was locked, once it is unlocked.
    pub async fn revive(&self, volume: &str) {
        let prefix = format!("{volume}@");
        for r in self.records.lock().await.iter() {
            if (r.volume == volume || r.volume.starts_with(&prefix)) && self.live.get(&r.name).is_none() {
                match publish(&self.pool, &self.live, r) {
                    Ok(()) => tracing::info!(export = %r.name, "export started"),
                    Err(e) => tracing::warn!(export = %r.name, error = %e.message(), "cannot start export"),
                }
            }
        }
    }

    /// Names of the exports serving `volume` itself.
    pub async fn of_volume(&self, volume: &str) -> Vec<String> {
        self.records.lock().await.iter().filter(|r| r.volume == volume).map(|r| r.name.clone()).collect()
    }

    /// Starts export `rec` unless the same one runs; true if this call started it.
    pub async fn ensure(&self, rec: &ExportRecord) -> Result<bool, Error> {
        self.ensure_matching(rec, |old| old == rec).await
    }

    /// Starts `rec` (an attachment's `local` export) unless an export of that name serves the
    /// same image already, whatever its allow list: the node's own client uses the Unix socket.
    pub async fn ensure_local(&self, rec: &ExportRecord) -> Result<bool, Error> {
        self.ensure_matching(rec, |old| old.volume == rec.volume && old.read_only == rec.read_only).await
    }

    async fn ensure_matching(&self, rec: &ExportRecord, same: impl Fn(&ExportRecord) -> bool) -> Result<bool, Error> {
        let mut records = self.records.lock().await;
        if let Some(old) = records.iter().find(|x| x.name == rec.name) {
            if same(old) {
                return Ok(false);
            }
            return Err(Error::already_exists(format!("export {:?} already serves volume {:?}", old.name, old.volume)));
        }
        publish(&self.pool, &self.live, rec)?;
        records.push(rec.clone());
        if let Err(e) = self.file.save(&records) {
            records.pop();
            self.live.remove(&rec.name);
            return Err(Error::internal(format!("saving the export list: {e}")));
        }
        tracing::info!(export = %rec.name, volume = %rec.volume, "export started");
        Ok(true)
    }

    /// Stops export `name` and cuts its clients; returns how many were cut.
    pub async fn stop(&self, name: &str) -> Result<usize, Error> {
        let mut records = self.records.lock().await;
        let Some(i) = records.iter().position(|r| r.name == name) else {
            return Err(Error::not_found(format!("export {name:?} not found")));
        };
        let rec = records.remove(i);
        if let Err(e) = self.file.save(&records) {
            records.insert(i, rec);
            return Err(Error::internal(format!("saving the export list (the export still runs): {e}")));
        }
        let cut = self.live.remove(name).unwrap_or(0);
        tracing::info!(export = %name, connections_cut = cut, "export stopped");
        Ok(cut)
    }

    /// Stops an export an attachment made (best effort: the device is already gone).
    pub async fn discard(&self, name: &str) {
        if let Err(e) = self.stop(name).await
            && e.kind() != crate::base::error::Kind::NotFound
        {
            tracing::error!(export = %name, error = %e, "stopping the export of a detached device");
        }
    }
}

/// Starts an export on the NBD server. An allow list that does not parse is refused whole
/// (dropping an entry could open the export wider).
fn publish(pool: &Pool, live: &Exports, r: &ExportRecord) -> Result<(), Error> {
    let allow = r
        .allow
        .iter()
        .map(|a| a.parse::<Allow>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::invalid(format!("allow: {e}")))?;
    crate::records::keys::refuse_if_locked(pool, &r.volume)?;
    let handle = open_image(pool, &r.volume).map_err(Error::from)?;
    let what = if r.volume.contains('@') { "snapshot" } else { "volume" };
    live.add(
        Export::new(r.name.clone(), handle, r.read_only, format!("ferrite {what} {}", r.volume))
            .with_allow(allow, r.name.starts_with(PUBLICATION_PREFIX)),
    );
    Ok(())
}

/// Refuses to delete `what` while an export (picked by `serves`) still serves it.
pub fn refuse_if_exported(
    records: &[ExportRecord],
    what: &str,
    serves: impl Fn(&ExportRecord) -> bool,
) -> Result<(), Error> {
    let names: Vec<&str> = records.iter().filter(|r| serves(r)).map(|r| r.name.as_str()).collect();
    if names.is_empty() {
        return Ok(());
    }
    Err(Error::refused(format!("{what} is exported as {}; stop the export first", names.join(", "))))
}
