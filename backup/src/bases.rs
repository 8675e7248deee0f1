//! Which snapshot a backup reads, and which snapshots stay as bases.
//!
//! A backup with no snapshot named takes one, `VOLUME.backup.TARGET.ID` ([`crate::auto_snapshot`]),
//! and keeps it as the base of the volume's next incremental on that target (deleting the one
//! before). Such a snapshot newer than the volume's last backup on its target is an interrupted
//! backup: a backup of that volume to that target resumes it (same snapshot, same id, same point
//! in time; what was uploaded is found and not sent again) when it asks for that id, or, for a
//! time-named one, when the snapshot is younger than the target's grace. Older ones are not
//! resumed (a backup labelled with its snapshot's time would be days old) and go with the next
//! backup. Snapshots of other targets are never touched: each target's incrementals build on its
//! own base (and [`crate::create`] checks the base by identity, not by name).

use std::sync::Arc;

use ferrite_engine::Pool;

use crate::{BackupRef, CreateOptions, Index, Manifest, Progress, Result, Target};

/// What a backup asked for becomes: made before, or to make.
#[derive(Debug)]
pub enum Plan {
    /// A backup with the id asked for is on the target (a retry of a call that made it).
    Made(Manifest),
    /// A backup to make.
    Make(Planned),
}

/// A backup to make, its snapshot chosen (and taken, when it takes its own).
#[derive(Debug)]
pub struct Planned {
    pub volume: String,
    pub snapshot: String,
    pub id: String,
    /// The backup took `snapshot` itself: it is the next base, and the older bases go.
    own_snapshot: bool,
    /// The volume's backups on the target before this one.
    index: Index,
}

/// Plans a backup of `volume` to `target`: of `snapshot` when one is named; with a chosen `id`,
/// what an earlier call made under it, else the snapshot an interrupted backup to this target
/// took for it, else a new one; with neither, an interrupted time-named backup's to this target
/// (its snapshot newer than the last backup and younger than the target's grace), else a new
/// snapshot.
pub async fn plan(target: &Target, pool: &Arc<Pool>, volume: &str, snapshot: &str, id: &str) -> Result<Plan> {
    let index = Index::load(target, volume).await?;
    if !id.is_empty() && index.backups.iter().any(|b| b.id == id) {
        let b = BackupRef { volume: volume.to_owned(), id: id.to_owned() };
        return Ok(Plan::Made(Manifest::load(target, &b).await?));
    }
    let now_s = crate::now_unix();
    let now = if id.is_empty() { crate::new_id(now_s) } else { id.to_owned() };
    // Two backups within a second: the second is ID-2.
    let fresh = |taken: &dyn Fn(&str) -> bool| {
        (1..).map(|n| if n == 1 { now.clone() } else { format!("{now}-{n}") }).find(|id| !taken(id)).expect("unbounded")
    };
    let in_index = |id: &str| index.backups.iter().any(|b| b.id == id);
    let planned = |snapshot: String, id: String, own_snapshot| {
        Ok(Plan::Make(Planned { volume: volume.to_owned(), snapshot, id, own_snapshot, index: index.clone() }))
    };
    if !snapshot.is_empty() {
        return planned(snapshot.to_owned(), fresh(&in_index), false);
    }
    let prefix = own_prefix(volume, &target.name);
    let snaps = blocking(pool, {
        let volume = volume.to_owned();
        move |p| p.snapshots(Some(&volume))
    })
    .await?;
    let last = index.backups.last().map(|b| b.id.as_str()).unwrap_or_default();
    let grace = target.grace().as_secs();
    let pending = match id {
        "" => snaps
            .iter()
            .filter(|s| s.created_unix.saturating_add(grace) > now_s)
            .filter_map(|s| s.name.strip_prefix(&prefix))
            .filter(|id| time_id(id) && *id > last && !in_index(id))
            .max()
            .map(str::to_owned),
        id => snaps.iter().any(|s| s.name == format!("{prefix}{id}")).then(|| id.to_owned()),
    };
    if let Some(id) = pending {
        tracing::info!(volume, target = %target.name, backup = %id, "resuming an interrupted backup");
        return planned(format!("{prefix}{id}"), id, true);
    }
    let id = fresh(&|id| in_index(id) || snaps.iter().any(|s| s.name == format!("{prefix}{id}")));
    let name = format!("{prefix}{id}");
    blocking(pool, {
        let (volume, name) = (volume.to_owned(), name.clone());
        move |p| p.create_snapshot(&volume, &name)
    })
    .await?;
    planned(name, id, true)
}

impl Planned {
    /// Makes the backup (reading everything with `full`), from the index [`plan`] loaded.
    pub async fn create(
        &self,
        target: &Target,
        pool: &Pool,
        full: bool,
        progress: &(dyn Fn(&Progress) + Sync),
    ) -> Result<Manifest> {
        let opts =
            CreateOptions { volume: self.volume.clone(), snapshot: self.snapshot.clone(), id: self.id.clone(), full };
        crate::create::create_after(target, pool, &opts, &self.index, progress).await
    }

    /// After the backup is made from its own snapshot, that target's other bases go: this
    /// snapshot is its next incremental's base. An interrupted backup's with a chosen id (not in
    /// the index: the volume's backups before this one) stays, for the call that resumes it.
    /// Time-named bases of earlier builds (`VOLUME.backup.ID`, no target) go too: no backup
    /// builds on them any more.
    pub async fn drop_older_bases(self, target: &Target, pool: &Arc<Pool>) -> Result<()> {
        if !self.own_snapshot {
            return Ok(());
        }
        let (prefix, legacy) = (own_prefix(&self.volume, &target.name), format!("{}.backup.", self.volume));
        blocking(pool, move |p| {
            for s in p.snapshots(Some(&self.volume))? {
                let ours = s
                    .name
                    .strip_prefix(&prefix)
                    .is_some_and(|id| time_id(id) || self.index.backups.iter().any(|b| b.id == id));
                let old = s.name.strip_prefix(&legacy).is_some_and(time_id);
                if s.name != self.snapshot && (ours || old) {
                    p.delete_snapshot(&s.name)?;
                }
            }
            Ok(())
        })
        .await
    }
}

/// The prefix of the snapshots backups to `target` take of `volume`.
fn own_prefix(volume: &str, target: &str) -> String {
    crate::auto_snapshot(volume, target, "")
}

/// Whether `id` is one a backup is given by default (the time, `20261128T101500Z` or
/// `20261128T101500Z-2`): only those are resumed unasked; a chosen id (a CSI snapshot's)
/// resumes when asked for again.
fn time_id(id: &str) -> bool {
    id.starts_with(|c: char| c.is_ascii_digit()) && !id.contains('.')
}

/// `f` on the pool, off the runtime's threads (the pool's calls block on its metadata store).
async fn blocking<T: Send + 'static>(
    pool: &Arc<Pool>,
    f: impl FnOnce(&Pool) -> ferrite_engine::Result<T> + Send + 'static,
) -> Result<T> {
    let pool = Arc::clone(pool);
    Ok(tokio::task::spawn_blocking(move || f(&pool)).await.expect("a pool call does not panic")?)
}

#[cfg(test)]
mod tests {
    use super::time_id;

    #[test]
    fn only_time_named_ids_resume_unasked() {
        assert!(time_id("20261128T101500Z"));
        assert!(time_id("20261128T101500Z-2"));
        assert!(!time_id("csi.snap-1"));
        assert!(!time_id("nightly"));
    }
}
