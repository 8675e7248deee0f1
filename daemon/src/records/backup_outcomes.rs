//! How backups and verifies went: what the Backups service records and the metrics endpoint reports.

/// How the backups of each (target, volume) went, as the Backups service records them, and
/// what the last verify of each target found (kept in `backup-verify.json` in the data
/// directory, so that a restart does not forget damage found).
#[derive(Debug, Default)]
pub struct BackupOutcomes {
    backups: std::sync::Mutex<std::collections::BTreeMap<(String, String), BackupOutcome>>,
    verifies: std::sync::Mutex<std::collections::BTreeMap<String, VerifyOutcome>>,
    prunes: std::sync::Mutex<std::collections::BTreeMap<String, PruneOutcome>>,
    file: Option<std::path::PathBuf>,
}

/// What the last prune of a target this daemon ran found (since the daemon started).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PruneOutcome {
    pub target: String,
    pub finished_unix: u64,
    /// Manifests and distinct chunks the target's backups list.
    pub manifests: u64,
    pub chunks_referenced: u64,
    /// Under an object lock: its days, and since when everything kept is locked for them.
    pub lock_days: Option<u64>,
    pub locked_at: Option<i64>,
    /// Backups whose index had lost them, listed again (summed over this daemon's prunes).
    pub recovered: u64,
}

/// What a verify of a target found.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VerifyOutcome {
    pub target: String,
    pub finished_unix: u64,
    pub backups: u64,
    pub chunks_checked: u64,
    /// The chunks it found bad (quarantined), with why.
    pub bad: Vec<(String, String)>,
    /// Chunks in quarantine after it: found bad and not found good since.
    pub quarantined: u64,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct BackupOutcome {
    pub last_success_unix: u64,
    pub failures: u64,
    pub last_failed: bool,
}

impl BackupOutcomes {
    /// With the verify outcomes kept in `data_dir` (none if it has none, or if they cannot be
    /// read: they are a report, not state the daemon needs).
    pub fn load(data_dir: &std::path::Path) -> Self {
        let file = crate::base::state::RecordFile::new(data_dir, "backup-verify");
        let kept = file.load::<VerifyOutcome>().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the outcomes of earlier backup verifies are unreadable; starting without them");
            Vec::new()
        });
        let verifies = kept.into_iter().map(|v| (v.target.clone(), v)).collect();
        Self { verifies: std::sync::Mutex::new(verifies), file: Some(file.path().to_owned()), ..Self::default() }
    }

    /// Logs what a verify of `target` found, records it, and keeps it.
    pub fn verified(&self, target: &str, report: &ferrite_backup::VerifyReport) {
        if report.bad.is_empty() {
            tracing::info!(target, chunks = report.chunks_checked, quarantined = report.quarantined, "verify finished");
        } else {
            tracing::error!(
                target,
                chunks = report.chunks_checked,
                bad = report.bad.len(),
                "verify found damaged chunks; they are quarantined and the next backups upload them again"
            );
        }
        self.keep(VerifyOutcome {
            target: target.to_owned(),
            finished_unix: ferrite_backup::now_unix(),
            backups: report.backups,
            chunks_checked: report.chunks_checked,
            bad: report.bad.iter().map(|(chunk, why, _)| (chunk.clone(), why.clone())).collect(),
            quarantined: report.quarantined,
        });
    }

    /// Records what a prune of `target` (locked for `lock_days`, if at all) found.
    pub fn pruned(&self, target: &str, report: &ferrite_backup::PruneReport, lock_days: Option<u64>) {
        let mut all = self.prunes.lock().expect("not poisoned");
        let recovered = all.get(target).map_or(0, |o| o.recovered) + report.backups_recovered.len() as u64;
        let outcome = PruneOutcome {
            target: target.to_owned(),
            finished_unix: ferrite_backup::now_unix(),
            manifests: report.manifests,
            chunks_referenced: report.chunks_referenced,
            lock_days,
            locked_at: report.locked_at.or_else(|| all.get(target).and_then(|o| o.locked_at)),
            recovered,
        };
        all.insert(target.to_owned(), outcome);
    }

    /// The last prune of each target.
    pub fn prunes(&self) -> Vec<PruneOutcome> {
        self.prunes.lock().expect("not poisoned").values().cloned().collect()
    }

    fn keep(&self, outcome: VerifyOutcome) {
        let mut all = self.verifies.lock().expect("not poisoned");
        all.insert(outcome.target.clone(), outcome);
        let list: Vec<&VerifyOutcome> = all.values().collect();
        if let Some(Err(e)) = self.file.as_deref().map(|f| crate::base::state::save_json(f, &list)) {
            tracing::warn!(error = %e, "could not keep the outcome of a backup verify");
        }
    }

    pub fn record(&self, target: &str, volume: &str, ok: bool) {
        let mut all = self.backups.lock().expect("not poisoned");
        let o = all.entry((target.to_owned(), volume.to_owned())).or_default();
        o.last_failed = !ok;
        if ok {
            o.last_success_unix = ferrite_backup::now_unix();
        } else {
            o.failures += 1;
        }
    }
}

impl BackupOutcomes {
    /// The last outcome of each (target, volume).
    pub fn backups(&self) -> Vec<((String, String), BackupOutcome)> {
        self.backups.lock().expect("not poisoned").clone().into_iter().collect()
    }

    /// The last verify of each target.
    pub fn verifies(&self) -> Vec<VerifyOutcome> {
        self.verifies.lock().expect("not poisoned").values().cloned().collect()
    }
}
