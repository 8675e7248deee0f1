//! The Backups gRPC service: backups of this pool's volumes to the targets the config names
//! (`ferrite_backup`), and restores from them into new volumes.
//!
//! Which snapshot a backup reads and which stay as bases is `ferrite_backup::plan`'s to say;
//! this service translates calls and errors, runs the jobs, and records how they went.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferrite_backup::{BackupRef, Error as BackupError, Index, Manifest, Plan, Progress, Target};
use ferrite_engine::Pool;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::kind::Kind;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::base::error::{blocking, require};

/// What a backup call maps to a status.
fn backup_status(e: BackupError) -> Status {
    let msg = e.to_string();
    match e {
        BackupError::Store { .. } | BackupError::Answer { .. } => Status::unavailable(msg),
        BackupError::Corrupt { .. } => Status::data_loss(msg),
        BackupError::Newer { .. } | BackupError::Key { .. } => Status::failed_precondition(msg),
        BackupError::NotFound(_) => Status::not_found(msg),
        BackupError::Invalid(_) => Status::invalid_argument(msg),
        BackupError::Conflict(_) => Status::aborted(msg),
        BackupError::Engine(e) => crate::base::rpc::status(e),
    }
}

type ProgressStream = crate::base::rpc::Stream<pb::BackupProgress>;

#[derive(Debug)]
pub struct BackupService {
    pub pool: Arc<Pool>,
    pub targets: BTreeMap<String, ferrite_backup::TargetConfig>,
    pub keys: crate::records::keys::KeyDir,
    /// Targets opened so far (a failed open is retried on the next call).
    opened: tokio::sync::Mutex<BTreeMap<String, Target>>,
    /// Volumes with a backup or restore running (one at a time each).
    busy: ferrite_proto::busy::Busy,
    restores: Arc<crate::records::restores::Restores>,
    outcomes: Arc<crate::records::backup_outcomes::BackupOutcomes>,
    policy: Arc<crate::authz::Policy>,
}

fn backup_msg(target: &str, m: &Manifest) -> pb::Backup {
    pb::Backup {
        chunk_size: m.chunk_size,
        encrypted_volume: m.encrypted_volume,
        full_reason: m.full_reason.clone().unwrap_or_default(),
        ..entry_msg(target, &m.volume, &m.entry())
    }
}

fn entry_msg(target: &str, volume: &str, e: &ferrite_backup::IndexEntry) -> pb::Backup {
    pb::Backup {
        target: target.to_owned(),
        name: format!("{volume}/{}", e.id),
        volume: volume.to_owned(),
        id: e.id.clone(),
        snapshot: e.snapshot.clone(),
        created_unix: e.created,
        size: e.size,
        full: e.full,
        previous: e.previous.clone().unwrap_or_default(),
        chunks: e.chunks,
        bytes: e.bytes,
        uploaded_bytes: e.uploaded_bytes,
        pool: e.source.as_ref().map(|s| s.pool.clone()).unwrap_or_default(),
        snapshot_id: e.source.as_ref().map_or(0, |s| s.id),
        copied_from: e.copied_from.clone().unwrap_or_default(),
        ..Default::default()
    }
}

fn progress_msg(p: &Progress) -> pb::BackupProgress {
    pb::BackupProgress {
        chunks_done: p.chunks_done,
        chunks_total: p.chunks_total,
        bytes_done: p.bytes_done,
        bytes_total: p.bytes_total,
        bytes_transferred: p.bytes_transferred,
        ..Default::default()
    }
}

/// Runs `job` on the runtime and streams its progress (best effort) and then its last message.
fn stream<F>(job: impl FnOnce(Box<dyn Fn(&Progress) + Send + Sync>) -> F) -> ProgressStream
where
    F: Future<Output = Result<pb::BackupProgress, Status>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let progress = tx.clone();
    let fut = job(Box::new(move |p| drop(progress.try_send(Ok(progress_msg(p))))));
    tokio::spawn(async move {
        let _ = tx.send(fut.await).await;
    });
    Box::pin(ReceiverStream::new(rx))
}

/// A restore's progress as a stream: every change, then its end (the backup restored, or the
/// error); with `detach`, the first message only.
fn restore_stream(
    mut state: tokio::sync::watch::Receiver<crate::records::restores::State>,
    detach: bool,
    backup: Option<pb::Backup>,
) -> ProgressStream {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let s = state.borrow_and_update().clone();
            let mut msg = pb::BackupProgress { chunks_on_demand: s.on_demand, ..progress_msg(&s.progress) };
            match s.ended {
                Some(Err(e)) => return drop(tx.send(Err(Status::aborted(e))).await),
                Some(Ok(())) => {
                    msg.done = true;
                    msg.backup = backup;
                    return drop(tx.send(Ok(msg)).await);
                }
                None if detach => return drop(tx.send(Ok(msg)).await),
                None if tx.send(Ok(msg)).await.is_err() => return,
                None => {}
            }
            if state.changed().await.is_err() {
                return;
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

impl BackupService {
    pub fn new(
        pool: Arc<Pool>,
        targets: BTreeMap<String, ferrite_backup::TargetConfig>,
        keys: crate::records::keys::KeyDir,
        restores: Arc<crate::records::restores::Restores>,
        outcomes: Arc<crate::records::backup_outcomes::BackupOutcomes>,
        policy: Arc<crate::authz::Policy>,
    ) -> Self {
        Self { pool, targets, keys, opened: Default::default(), busy: Default::default(), restores, outcomes, policy }
    }

    async fn target(&self, name: &str) -> Result<Target, Status> {
        require("target", name)?;
        let mut opened = self.opened.lock().await;
        if let Some(t) = opened.get(name) {
            return Ok(t.clone());
        }
        let config = self.targets.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.targets.keys().map(String::as_str).collect();
            Kind::UnknownTarget.tag(Status::not_found(format!(
                "no backup target {name:?} in this daemon's config (it has: {})",
                known.join(", ")
            )))
        })?;
        let t = Target::open(name, config.clone()).await.map_err(backup_status)?;
        opened.insert(name.to_owned(), t.clone());
        Ok(t)
    }

    fn claim(&self, volume: &str, what: &str) -> Result<ferrite_proto::busy::Guard, Status> {
        self.busy
            .begin(volume)
            .map_err(|_| Status::aborted(format!("a backup or restore of {volume:?} is running; {what} waits for it")))
    }
}

/// A volume name as a request gives it: it becomes part of object names.
fn check_volume(volume: &str) -> Result<(), Status> {
    require("volume", volume)?;
    if !ferrite_backup::valid_component(volume) {
        return Err(Status::invalid_argument(format!("invalid volume name {volume:?}")));
    }
    Ok(())
}

/// The index of `volume`, or (empty) of every volume with backups on the target.
async fn indexes(target: &Target, volume: &str) -> Result<Vec<Index>, Status> {
    if !volume.is_empty() {
        check_volume(volume)?;
    }
    let volumes = if volume.is_empty() {
        ferrite_backup::list_volumes(target).await.map_err(backup_status)?
    } else {
        vec![volume.to_owned()]
    };
    let mut out = Vec::with_capacity(volumes.len());
    for v in volumes {
        out.push(Index::load(target, &v).await.map_err(backup_status)?);
    }
    Ok(out)
}

/// The last message of a backup stream: backup `m`, done.
fn done_msg(target: &str, m: &Manifest) -> pb::BackupProgress {
    pb::BackupProgress {
        done: true,
        backup: Some(backup_msg(target, m)),
        ..progress_msg(&Progress {
            chunks_total: m.chunk_count(),
            chunks_done: m.chunk_count(),
            bytes_total: m.read_bytes,
            bytes_done: m.read_bytes,
            bytes_transferred: m.uploaded_bytes,
        })
    }
}

#[tonic::async_trait]
impl pb::backups_server::Backups for BackupService {
    async fn create_backup(&self, req: Request<pb::CreateBackupRequest>) -> Result<Response<ProgressStream>, Status> {
        let r = req.into_inner();
        check_volume(&r.volume)?;
        if !r.id.is_empty() && !ferrite_backup::valid_component(&r.id) {
            return Err(Status::invalid_argument(format!("invalid backup id {:?}", r.id)));
        }
        let prepared = async {
            let target = self.target(&r.target).await?;
            let busy = self.claim(&r.volume, "this backup")?;
            let plan = ferrite_backup::plan(&target, &self.pool, &r.volume, &r.snapshot, &r.id).await;
            Ok::<_, Status>((target, busy, plan.map_err(backup_status)?))
        };
        let (target, busy, plan) = prepared.await.inspect_err(|_| {
            if self.targets.contains_key(&r.target) {
                self.outcomes.record(&r.target, &r.volume, false);
            }
        })?;
        let planned = match plan {
            Plan::Make(planned) => planned,
            // Made before: asked again (a CSI snapshot's retry), it is what was made.
            Plan::Made(m) => {
                let last = done_msg(&target.name, &m);
                return Ok(Response::new(stream(move |_| async move { Ok(last) })));
            }
        };
        let (pool, outcomes, full) = (Arc::clone(&self.pool), Arc::clone(&self.outcomes), r.full);
        Ok(Response::new(stream(move |progress| async move {
            let _busy = busy;
            let made = planned.create(&target, &pool, full, &*progress).await;
            outcomes.record(&target.name, &planned.volume, made.is_ok());
            let m = made.map_err(backup_status)?;
            tracing::info!(target = %target.name, backup = %m.backup_ref(), chunks = m.chunk_count(),
                read = m.read_bytes, uploaded = m.uploaded_bytes, "backup made");
            planned.drop_older_bases(&target, &pool).await.map_err(backup_status)?;
            Ok(done_msg(&target.name, &m))
        })))
    }

    async fn list_backups(
        &self,
        req: Request<pb::ListBackupsRequest>,
    ) -> Result<Response<pb::ListBackupsResponse>, Status> {
        let r = req.into_inner();
        let target = self.target(&r.target).await?;
        let backups = indexes(&target, &r.volume)
            .await?
            .iter()
            .flat_map(|i| i.backups.iter().map(|e| entry_msg(&target.name, &i.volume, e)))
            .collect();
        Ok(Response::new(pb::ListBackupsResponse { backups }))
    }

    async fn get_backup(&self, req: Request<pb::GetBackupRequest>) -> Result<Response<pb::Backup>, Status> {
        let r = req.into_inner();
        let target = self.target(&r.target).await?;
        let b: BackupRef = r.name.parse().map_err(backup_status)?;
        let m = Manifest::load(&target, &b).await.map_err(backup_status)?;
        Ok(Response::new(backup_msg(&target.name, &m)))
    }

    async fn delete_backup(
        &self,
        req: Request<pb::DeleteBackupRequest>,
    ) -> Result<Response<pb::DeleteBackupResponse>, Status> {
        let caller = crate::authz::caller_of(&req)?;
        let r = req.into_inner();
        let b: BackupRef = r.name.parse().map_err(backup_status)?;
        // The controller deletes the backups it made (a CSI snapshot's, `csi.` ids, not copied
        // here), never an operator's: a stolen controller certificate cannot wipe the copies
        // off the cluster, nor a second site's copy of a CSI snapshot's backup.
        let refuse = |why: String| self.policy.refuse(&caller, "/ferrite.v1.Backups/DeleteBackup", &why);
        if !caller.is_operator() && !ferrite_backup::is_csi_id(&b.id) {
            return Err(refuse(format!("backup {b} was not made for a CSI snapshot; only an operator deletes it")));
        }
        let target = self.target(&r.target).await?;
        if !caller.is_operator() {
            let index = Index::load(&target, &b.volume).await.map_err(backup_status)?;
            if let Some(copied) = index.backups.iter().find(|e| e.id == b.id).and_then(|e| e.copied_from.as_ref()) {
                return Err(refuse(format!(
                    "backup {b} on target {} is an operator's copy (from target {copied}); only an operator deletes it",
                    target.name
                )));
            }
        }
        ferrite_backup::delete(&target, &b).await.map_err(backup_status)?;
        tracing::info!(target = %target.name, backup = %b, "backup deleted");
        Ok(Response::new(pb::DeleteBackupResponse {}))
    }

    async fn verify_backups(&self, req: Request<pb::VerifyBackupsRequest>) -> Result<Response<ProgressStream>, Status> {
        let r = req.into_inner();
        let target = self.target(&r.target).await?;
        if !(0.0..1.0).contains(&r.sample) {
            return Err(Status::invalid_argument("sample is a share: 0 (everything) or more than 0 and less than 1"));
        }
        let mut names: Vec<BackupRef> =
            r.names.iter().map(|n| n.parse()).collect::<Result<_, _>>().map_err(backup_status)?;
        if names.is_empty() {
            for i in indexes(&target, &r.volume).await? {
                names.extend(i.backups.iter().map(|e| BackupRef { volume: i.volume.clone(), id: e.id.clone() }));
            }
        }
        let sample = (r.sample > 0.0).then_some(r.sample);
        let outcomes = Arc::clone(&self.outcomes);
        Ok(Response::new(stream(move |progress| async move {
            let report = ferrite_backup::verify(&target, &names, sample, &*progress).await.map_err(backup_status)?;
            outcomes.verified(&target.name, &report);
            Ok(pb::BackupProgress {
                done: true,
                chunks_done: report.chunks_checked,
                chunks_total: report.chunks_checked,
                bytes_done: report.bytes_checked,
                bytes_total: report.bytes_checked,
                bad: report.bad.into_iter().map(|(chunk, why, backups)| pb::BadChunk { chunk, why, backups }).collect(),
                ..Default::default()
            })
        })))
    }

    async fn prune_backups(
        &self,
        req: Request<pb::PruneBackupsRequest>,
    ) -> Result<Response<pb::PruneBackupsResponse>, Status> {
        let r = req.into_inner();
        let target = self.target(&r.target).await?;
        let retention = ferrite_backup::Retention {
            keep_last: r.keep_last,
            keep_daily: r.keep_daily,
            keep_weekly: r.keep_weekly,
            keep_monthly: r.keep_monthly,
            keep_yearly: r.keep_yearly,
            include_csi: r.include_csi,
        };
        let policy = retention.is_set().then_some(&retention);
        let sweep =
            ferrite_backup::Sweep { grace: r.grace_s.map(std::time::Duration::from_secs), no_writers: r.no_writers };
        let p = ferrite_backup::prune(&target, policy, sweep).await.map_err(backup_status)?;
        self.outcomes.pruned(&target.name, &p, target.config.object_lock_days);
        tracing::info!(target = %target.name, deleted = p.backups_deleted.len(), chunks_deleted = p.chunks_deleted,
            condemned = p.chunks_condemned, locks_extended = p.locks_extended,
            manifests_deleted = p.manifests_deleted, "prune finished");
        if !p.backups_recovered.is_empty() {
            tracing::warn!(target = %target.name, backups = ?p.backups_recovered, indexes_rebuilt = ?p.indexes_rebuilt,
                "the prune found backups their index did not list, and listed them again: an index update was lost \
                 or an index was deleted (check the store's access)");
        }
        Ok(Response::new(pb::PruneBackupsResponse {
            backups_deleted: p.backups_deleted,
            manifests: p.manifests,
            chunks_referenced: p.chunks_referenced,
            chunks_deleted: p.chunks_deleted,
            bytes_deleted: p.bytes_deleted,
            chunks_condemned: p.chunks_condemned,
            locks_extended: p.locks_extended,
            manifests_deleted: p.manifests_deleted,
            backups_recovered: p.backups_recovered,
            indexes_rebuilt: p.indexes_rebuilt,
        }))
    }

    async fn restore_backup(&self, req: Request<pb::RestoreBackupRequest>) -> Result<Response<ProgressStream>, Status> {
        let r = req.into_inner();
        require("volume", &r.volume)?;
        let target = self.target(&r.target).await?;
        let b: BackupRef = r.name.parse().map_err(backup_status)?;
        if let Some(state) = self.restores.watch_when_resumed(&r.volume, &b.to_string()).await {
            return Ok(Response::new(restore_stream(state, r.detach, None)));
        }
        let m = Manifest::load(&target, &b).await.map_err(backup_status)?;
        let chunks = m.chunk_list(&target).await.map_err(backup_status)?;
        let kek = match (m.encrypted_volume, r.encryption) {
            (false, _) => None,
            (true, Some(k)) if !(k.key_id.is_empty() && k.key.is_empty()) => Some(self.keys.kek(&k, true)?),
            (true, _) => Some(
                self.keys.kek(&pb::KeyRef { key_id: crate::records::keys::DEFAULT_KEY.into(), key: vec![] }, true)?,
            ),
        };
        let _busy = self.claim(&r.volume, "this restore")?;
        let (pool, name, size) = (Arc::clone(&self.pool), r.volume.clone(), m.size);
        blocking(move || match &kek {
            Some(kek) => pool.create_encrypted_volume(&name, size, kek),
            None => pool.create_volume(&name, size),
        })
        .await?;
        let backup = backup_msg(&target.name, &m);
        if let Err(e) = self.restores.start(target, m, chunks, &r.volume, None) {
            // A restore that cannot start leaves no volume behind.
            let (p, n) = (Arc::clone(&self.pool), r.volume.clone());
            if let Err(d) = blocking(move || p.delete_volume(&n)).await {
                tracing::warn!(volume = %r.volume, error = %d.message(), "could not delete a failed restore's volume");
            }
            return Err(backup_status(e));
        }
        tracing::info!(backup = %b, volume = %r.volume, "restore started: the volume serves");
        let state = self.restores.watch(&r.volume, &b.to_string()).expect("just started");
        Ok(Response::new(restore_stream(state, r.detach, Some(backup))))
    }

    async fn list_backup_targets(
        &self,
        _: Request<pb::ListBackupTargetsRequest>,
    ) -> Result<Response<pb::ListBackupTargetsResponse>, Status> {
        let targets = self
            .targets
            .iter()
            .map(|(name, t)| {
                let (kind, location) = match t.kind {
                    Some(ferrite_backup::TargetKind::Dir) => {
                        ("dir", t.path.as_ref().map(|p| p.display().to_string()).unwrap_or_default())
                    }
                    _ => ("s3", format!("{}/{}", t.bucket.as_deref().unwrap_or(""), t.prefix.as_deref().unwrap_or(""))),
                };
                let key_fingerprint = match &t.key_file {
                    Some(path) => ferrite_backup::key_fingerprint(path).unwrap_or_else(|e| e),
                    None => String::new(),
                };
                pb::BackupTarget {
                    name: name.clone(),
                    kind: kind.into(),
                    location,
                    encrypted: t.key_file.is_some(),
                    key_fingerprint,
                }
            })
            .collect();
        Ok(Response::new(pb::ListBackupTargetsResponse { targets }))
    }

    async fn set_backup_lock(
        &self,
        req: Request<pb::SetBackupLockRequest>,
    ) -> Result<Response<pb::SetBackupLockResponse>, Status> {
        let r = req.into_inner();
        require("target", &r.target)?;
        let mode: ferrite_backup::LockMode = r.mode.parse().map_err(Status::invalid_argument)?;
        let config = self.targets.get(&r.target).ok_or_else(|| {
            Kind::UnknownTarget
                .tag(Status::not_found(format!("no backup target {:?} in this daemon's config", r.target)))
        })?;
        let config = ferrite_backup::TargetConfig {
            object_lock_mode: Some(mode),
            object_lock_days: Some(r.days),
            ..config.clone()
        };
        let before = ferrite_backup::Target::set_lock(&r.target, config).await.map_err(backup_status)?;
        // Opened again at its next use: refused until this daemon's config names the new lock.
        self.opened.lock().await.remove(&r.target);
        tracing::warn!(
            target = r.target,
            mode = r.mode,
            days = r.days,
            ?before,
            "a backup target's object lock was set"
        );
        let (previous_mode, previous_days) = before.map_or((String::new(), 0), |(m, d)| (m.name().to_owned(), d));
        Ok(Response::new(pb::SetBackupLockResponse { previous_mode, previous_days }))
    }
}
