//! Verifies on a schedule: every `verify-every-s` of each target that sets it, a `verify-sample`
//! share of the chunks of the backups of this pool's volumes there (each daemon checks its own
//! volumes': the work is shared out).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ferrite_engine::Pool;

use crate::{BackupRef, Index, Result, Target, TargetConfig, VerifyReport};

/// What a scheduled verify hands on: its target's name and what it found.
pub type Found = Arc<dyn Fn(&str, &VerifyReport) + Send + Sync>;

/// Starts a task per target that asks for scheduled verifies; each report goes to `found`. A
/// verify that fails is logged and tried again at the next turn.
pub fn schedule_verifies(pool: Arc<Pool>, targets: &BTreeMap<String, TargetConfig>, found: Found) {
    for (name, config) in targets {
        let Some(every) = config.verify_every_s.filter(|&s| s > 0).map(Duration::from_secs) else {
            continue;
        };
        // A share of the chunks; 1 (or more): all of them.
        let sample = config.verify_sample.map_or(Some(0.1), |s| (s < 1.0).then_some(s.max(0.01)));
        let (pool, found, name, config) = (Arc::clone(&pool), Arc::clone(&found), name.clone(), config.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match verify_pool(&pool, &name, &config, sample).await {
                    Ok(report) => found(&name, &report),
                    Err(e) => {
                        tracing::warn!(target = %name, error = %e, "the scheduled verify failed; tried again next time")
                    }
                }
            }
        });
    }
}

/// Verifies a `sample` of the backups of `pool`'s volumes on target `name`.
async fn verify_pool(pool: &Pool, name: &str, config: &TargetConfig, sample: Option<f64>) -> Result<VerifyReport> {
    let target = Target::open(name, config.clone()).await?;
    let ours = pool.volumes();
    let mut backups = Vec::new();
    for v in crate::list_volumes(&target).await?.iter().filter(|v| ours.iter().any(|o| &o.name == *v)) {
        let index = Index::load(&target, v).await?;
        backups.extend(index.backups.iter().map(|e| BackupRef { volume: v.clone(), id: e.id.clone() }));
    }
    crate::verify(&target, &backups, sample, &|_| {}).await
}
