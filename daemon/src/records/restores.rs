//! Instant restores as the daemon runs them: a restored volume serves from the moment it is
//! created, its chunks fetched on demand while a background copy finishes
//! (`ferrite_backup::Filling`). Each unfinished restore has a record in the data directory
//! (`restores.json`: the volume, its target and backup, the chunks done), so a restarted daemon
//! gives the volume its fill again before any export or device can serve it, and resumes the
//! copy: chunks recorded done are not fetched again, the others are (none of them took a client
//! write yet).

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ferrite_backup::{BackupRef, ChunkRef, Filling, Manifest, Progress, Saved, Target, TargetConfig};
use ferrite_engine::{Access, ErrorKind, Fill, Pool};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::base::state::RecordFile;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Record {
    volume: String,
    target: String,
    /// VOLUME/ID on the target.
    backup: String,
    /// The chunks done ([`ferrite_backup::Save`]).
    done: String,
    /// The digest of the manifest restored ([`Manifest::digest`]): the record's chunks are
    /// positions in its list, so a restore resumes only from the same manifest. Absent in
    /// records of earlier builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    manifest: Option<String>,
}

/// Where a running restore is: its progress, then how it ended.
#[derive(Debug, Clone, Default)]
pub struct State {
    pub progress: Progress,
    pub on_demand: u64,
    /// None while it runs.
    pub ended: Option<Result<(), String>>,
}

#[derive(Debug)]
struct Running {
    filling: Arc<Filling>,
    backup: String,
    state: watch::Receiver<State>,
}

#[derive(Debug)]
pub struct Restores {
    pool: Arc<Pool>,
    file: RecordFile,
    journals: Journals,
    records: Mutex<BTreeMap<String, Record>>,
    running: Mutex<BTreeMap<String, Running>>,
}

impl Restores {
    /// Loads the unfinished restores and gives each volume a fill that waits for its restore to
    /// be ready (its manifest is loaded in the background by [`Restores::resume`]): call it
    /// before exports and devices come back. A record whose volume is gone is dropped.
    pub fn load(pool: Arc<Pool>, data_dir: &std::path::Path) -> anyhow::Result<(Arc<Self>, Vec<Arc<Deferred>>)> {
        let file = RecordFile::new(data_dir, "restores");
        let mut records = BTreeMap::new();
        let (mut waiting, mut dropped) = (Vec::new(), false);
        let journals = Journals(data_dir.join("restores"));
        for r in file.load::<Record>()? {
            if pool.volume_info(&r.volume).is_err() {
                tracing::info!(volume = %r.volume, "the volume of an unfinished restore is gone; its record is dropped");
                journals.clear(&r.volume)?;
                dropped = true;
                continue;
            }
            let d = Arc::new(Deferred { volume: r.volume.clone(), ready: Mutex::default(), set: Condvar::new() });
            pool.set_fill(&r.volume, Some(Arc::clone(&d) as Arc<dyn Fill>))?;
            waiting.push(d);
            records.insert(r.volume.clone(), r);
        }
        let me = Arc::new(Self { pool, file, journals, records: Mutex::new(records), running: Mutex::default() });
        if dropped {
            me.save_all()?;
        }
        Ok((me, waiting))
    }

    /// Resumes the restores [`Restores::load`] found, each once its target answers (retried
    /// every 30 s while it fails).
    pub fn resume(self: &Arc<Self>, waiting: Vec<Arc<Deferred>>, targets: BTreeMap<String, TargetConfig>) {
        for d in waiting {
            let Some(r) = self.records.lock().get(&d.volume).cloned() else { continue };
            let (me, targets) = (Arc::clone(self), targets.clone());
            tokio::spawn(async move {
                let manifest = loop {
                    match me.manifest_of(&r, &targets).await {
                        Ok(m) => break m,
                        Err((e, true)) => {
                            tracing::warn!(volume = %r.volume, error = %e, "an unfinished restore waits for its target");
                            tokio::time::sleep(Duration::from_secs(30)).await;
                        }
                        Err((e, false)) => {
                            tracing::error!(volume = %r.volume, error = %e, "an unfinished restore cannot resume; its volume fails I/O to what is not restored");
                            return d.set(Err(e));
                        }
                    }
                };
                let (target, m, chunks) = manifest;
                let started = me
                    .journals
                    .read(&r.volume)
                    .map_err(|e| ferrite_backup::Error::Invalid(format!("reading the restore's journal: {e}")))
                    .and_then(|also| me.start(target, m, chunks, &r.volume, Some((&r.done, &also))));
                match started {
                    Ok(f) => {
                        tracing::info!(volume = %r.volume, backup = %r.backup, "an unfinished restore resumed");
                        d.set(Ok(f));
                    }
                    Err(e) => d.set(Err(e.to_string())),
                }
            });
        }
    }

    /// The target and manifest of a record; the error and whether it may pass.
    async fn manifest_of(
        &self,
        r: &Record,
        targets: &BTreeMap<String, TargetConfig>,
    ) -> Result<(Target, Manifest, Vec<ChunkRef>), (String, bool)> {
        let config = targets
            .get(&r.target)
            .ok_or_else(|| (format!("its backup target {:?} is no longer in this daemon's config", r.target), false))?;
        let passing = |e: ferrite_backup::Error| {
            let passes = e.is_store_fault();
            (e.to_string(), passes)
        };
        let target = Target::open(&r.target, config.clone()).await.map_err(passing)?;
        let b: BackupRef = r.backup.parse().map_err(passing)?;
        let m = Manifest::load(&target, &b).await.map_err(passing)?;
        if let Some(digest) = r.manifest.as_ref().filter(|d| **d != m.digest()) {
            return Err((
                format!(
                    "the manifest of backup {b} on target {} is not the one this restore began from (digest {digest}): \
                     the target was changed under it; delete the volume and restore again",
                    r.target
                ),
                false,
            ));
        }
        let chunks = m.chunk_list(&target).await.map_err(passing)?;
        Ok((target, m, chunks))
    }

    fn save_all(&self) -> std::io::Result<()> {
        let records = self.records.lock();
        self.file.save(&records.values().collect::<Vec<_>>())
    }

    /// Starts restoring `manifest` (its chunk list `chunks`) into `volume` (created, empty; or resumed from `done`): the
    /// volume serves at once, the copy runs in the background. Returns its fill.
    pub fn start(
        self: &Arc<Self>,
        target: Target,
        manifest: Manifest,
        chunks: Vec<ChunkRef>,
        volume: &str,
        done: Option<(&str, &[usize])>,
    ) -> Result<Arc<Filling>, ferrite_backup::Error> {
        let writer = self.pool.open_volume(volume)?.past_read_only();
        let (me, record) = (
            Arc::downgrade(self),
            Record {
                volume: volume.to_owned(),
                target: target.name.clone(),
                backup: manifest.backup_ref().to_string(),
                done: String::new(),
                manifest: Some(manifest.digest()),
            },
        );
        let backup = record.backup.clone();
        let save: ferrite_backup::Save = Box::new(move |saved| {
            let me: Arc<Self> = Weak::upgrade(&me).ok_or_else(|| std::io::Error::other("the daemon is stopping"))?;
            match saved {
                // The whole record first, then the journal it now holds goes.
                Saved::All(done) => {
                    me.records.lock().insert(record.volume.clone(), Record { done: done.to_owned(), ..record.clone() });
                    me.save_all()?;
                    me.journals.clear(&record.volume)
                }
                Saved::Done(positions) => me.journals.append(&record.volume, positions),
            }
        });
        let filling = Filling::new(target, manifest, chunks, writer, done, save, tokio::runtime::Handle::current())?;
        self.pool.set_fill(volume, Some(Arc::clone(&filling) as Arc<dyn Fill>))?;
        let (tx, rx) = watch::channel(State::default());
        self.running.lock().insert(volume.to_owned(), Running { filling: Arc::clone(&filling), backup, state: rx });
        let (me, f, volume) = (Arc::clone(self), Arc::clone(&filling), volume.to_owned());
        tokio::spawn(async move {
            let progress = |p: &Progress| {
                let on_demand = f.counts().2;
                tx.send_modify(|s| {
                    s.progress = *p;
                    s.on_demand = on_demand;
                });
            };
            let ended = f.run(&progress).await;
            let ended = me.ended(&volume, &f, ended);
            tx.send_modify(|s| s.ended = Some(ended));
        });
        Ok(filling)
    }

    /// After `f`'s copy of `volume` ended: done, its fill and record go; the volume deleted,
    /// its record goes; another error stays (the fill fails I/O to what it could not restore;
    /// a restart tries again).
    fn ended(&self, volume: &str, f: &Arc<Filling>, r: ferrite_backup::Result<()>) -> Result<(), String> {
        let mine = self.running.lock().get(volume).is_some_and(|run| Arc::ptr_eq(&run.filling, f));
        let gone = matches!(&r, Err(ferrite_backup::Error::Engine(e)) if e.kind() == ErrorKind::NotFound);
        if mine && (r.is_ok() || gone) {
            self.running.lock().remove(volume);
            self.records.lock().remove(volume);
            if let Err(e) = self.save_all().and_then(|()| self.journals.clear(volume)) {
                tracing::warn!(volume, error = %e, "could not drop a finished restore's record");
            }
            if r.is_ok() {
                let _ = self.pool.set_fill(volume, None);
                let (_, chunks, on_demand) = f.counts();
                tracing::info!(volume, backup = %f.manifest().backup_ref(), chunks, on_demand, "restore finished");
            }
        }
        r.map_err(|e| {
            tracing::error!(volume, error = %e, "restore stopped");
            e.to_string()
        })
    }

    /// A running restore of `volume` from `backup` (VOLUME/ID): its state.
    pub fn watch(&self, volume: &str, backup: &str) -> Option<watch::Receiver<State>> {
        self.running.lock().get(volume).filter(|r| r.backup == backup).map(|r| r.state.clone())
    }

    /// As [`Restores::watch`], waiting (up to a minute) for a restore recorded before a restart
    /// to resume.
    pub async fn watch_when_resumed(&self, volume: &str, backup: &str) -> Option<watch::Receiver<State>> {
        for _ in 0..600 {
            let w = self.watch(volume, backup);
            if w.is_some() || self.records.lock().get(volume).is_none_or(|r| r.backup != backup) {
                return w;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// Restores running now: volume -> (chunks done, chunks, fetched on demand).
    pub fn counts(&self) -> BTreeMap<String, (u64, u64, u64)> {
        self.running.lock().iter().map(|(v, r)| (v.clone(), r.filling.counts())).collect()
    }
}

/// What each restore's record added since it was last written whole (`Saved::Done`): one file
/// a volume, `restores/<volume>.done` in the data directory, the chunks' positions as 4-byte
/// little-endian numbers, appended and synced (O(1) a chunk; `restores.json` is rewritten only
/// now and then). A torn last number (a crash while appending) is ignored: its chunk was not
/// recorded, so it is fetched again.
#[derive(Debug)]
struct Journals(std::path::PathBuf);

impl Journals {
    fn path(&self, volume: &str) -> std::path::PathBuf {
        self.0.join(format!("{volume}.done"))
    }

    fn read(&self, volume: &str) -> std::io::Result<Vec<usize>> {
        match std::fs::read(self.path(volume)) {
            Ok(data) => {
                Ok(data.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize).collect())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn append(&self, volume: &str, positions: &[usize]) -> std::io::Result<()> {
        use std::io::Write as _;
        use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.0)?;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(self.path(volume))?;
        let bytes: Vec<u8> = positions
            .iter()
            .flat_map(|&p| u32::try_from(p).expect("a manifest lists fewer than 2^32 chunks").to_le_bytes())
            .collect();
        f.write_all(&bytes)?;
        f.sync_data()
    }

    fn clear(&self, volume: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(volume)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The fill of a volume whose restore resumes after a restart, until it is ready: requests
/// wait for it (up to a minute), then go through it.
#[derive(Debug)]
pub struct Deferred {
    volume: String,
    ready: Mutex<Option<Result<Arc<Filling>, String>>>,
    set: Condvar,
}

impl Deferred {
    fn set(&self, r: Result<Arc<Filling>, String>) {
        *self.ready.lock() = Some(r);
        self.set.notify_all();
    }

    /// The restore once it is ready (waiting up to a minute for it).
    fn ready(&self) -> ferrite_engine::Result<Arc<Filling>> {
        let io = |why: String| {
            ferrite_engine::Error::new(ErrorKind::Io, format!("volume {:?} is being restored: {why}", self.volume))
        };
        let mut ready = self.ready.lock();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while ready.is_none() {
            if self.set.wait_until(&mut ready, deadline).timed_out() {
                return Err(io("its backup is not reachable yet".into()));
            }
        }
        ready.clone().expect("set").map_err(io)
    }
}

impl Fill for Deferred {
    fn fill(&self, offset: u64, len: u64, access: Access) -> ferrite_engine::Result<()> {
        self.ready()?.fill(offset, len, access)
    }

    fn pending(&self, offset: u64, len: u64) -> ferrite_engine::Result<Vec<(u64, u64)>> {
        self.ready()?.pending(offset, len)
    }
}
