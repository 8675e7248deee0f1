//! Writer leases: every backup or copy to a target says so there while it runs, and times
//! itself on the store's clock.
//!
//! A writer stores `gc/writers/<attempt>` before it reads anything else of the target; the
//! object's Last-Modified is when it started, on the store's clock. A writer may commit only
//! within the target's grace of that start (`Manifest::commit`), so a lease older than the grace
//! is dead whether or not its writer took it away (a crash leaves it). A prune that wants to go
//! below the grace (`--no-writers`) is refused while any lease is alive: what Proxmox Backup
//! Server does with its oldest writer's start, on the store instead of one host's memory.

use std::time::{Duration, Instant};

use futures_util::TryStreamExt;

use crate::{Result, Target};

const WRITERS: &str = "gc/writers";
/// Most leases a prune lists (one per writer running, and those crashes left for a grace).
const MAX_LEASES: u64 = 100_000;

/// A running writer's lease, named by the writer's commit attempt.
#[derive(Debug)]
pub(crate) struct Lease {
    attempt: String,
    path: String,
    /// When it was taken: the store's clock (unix seconds), and this host's monotonic one.
    started: i64,
    local: Instant,
}

impl Lease {
    /// Takes a lease for attempt `attempt` (refused under an object lock when this host's
    /// clock is off the store's).
    pub(crate) async fn take(target: &Target, attempt: &str) -> Result<Lease> {
        let (local, wall) = (Instant::now(), crate::now_unix());
        let path = format!("{WRITERS}/{attempt}");
        let started = target.stamp(&path).await?;
        let lease = Lease { attempt: attempt.to_owned(), path, started, local };
        if let Err(e) = target.check_skew(wall, started) {
            lease.end(target).await;
            return Err(e);
        }
        Ok(lease)
    }

    /// The writer's commit attempt (`Manifest::attempt`).
    pub(crate) fn attempt(&self) -> &str {
        &self.attempt
    }

    /// How long the writer has run: on the store's clock, and at least as long as this host
    /// has seen (a store's times are whole seconds; a paused host does not age, the store does).
    pub(crate) async fn ran(&self, target: &Target) -> Result<Duration> {
        let now = target.now().await?;
        let on_store = Duration::from_secs(u64::try_from(now.saturating_sub(self.started)).unwrap_or(0));
        Ok(on_store.max(self.local.elapsed()))
    }

    /// Takes the lease away (a failure to is only logged: the lease dies with the grace).
    pub(crate) async fn end(self, target: &Target) {
        if let Err(e) = target.delete(&self.path).await {
            tracing::warn!(target = %target.name, lease = %self.path, "a writer's lease stays until the grace ends: {e}");
        }
    }
}

/// The writers whose leases are alive at `now` (the store's clock): their attempt ids.
pub(crate) async fn alive(target: &Target, now: i64) -> Result<Vec<String>> {
    let grace = i64::try_from(target.grace().as_secs()).unwrap_or(i64::MAX);
    let leases: Vec<_> = target.list_stream(WRITERS, MAX_LEASES).try_collect().await?;
    Ok(leases
        .into_iter()
        .filter(|l| l.last_modified.timestamp().saturating_add(grace) > now)
        .filter_map(|l| l.location.filename().map(str::to_owned))
        .collect())
}

/// Runs `work` under a new lease for a new commit attempt, and takes the lease away after it,
/// whatever it returned.
pub(crate) async fn with_lease<T>(target: &Target, work: impl AsyncFnOnce(&Lease) -> Result<T>) -> Result<T> {
    let lease = Lease::take(target, &crate::manifest::new_attempt()).await?;
    let done = work(&lease).await;
    lease.end(target).await;
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{TargetConfig, TargetKind};

    /// A writer ages on the store's clock: a host paused (a VM stopped, a suspended laptop)
    /// sees little time pass, the store the whole pause, and the commit's limit follows it.
    #[tokio::test]
    async fn a_writer_ages_on_the_stores_clock() {
        let dir = tempfile::tempdir().unwrap();
        let config =
            TargetConfig { kind: Some(TargetKind::Dir), path: Some(dir.path().to_owned()), ..TargetConfig::default() };
        let target = Target::open("t", config).await.unwrap();
        let mut lease = Lease::take(&target, "00000000000000aa").await.unwrap();
        assert!(lease.ran(&target).await.unwrap() < Duration::from_secs(5));
        assert_eq!(alive(&target, target.now().await.unwrap()).await.unwrap(), ["00000000000000aa"]);
        // As if this host had been paused for an hour while the store's clock went on.
        lease.started -= 3600;
        assert!(lease.ran(&target).await.unwrap() >= Duration::from_secs(3600));
        let later = target.now().await.unwrap() + 86_400;
        assert!(alive(&target, later).await.unwrap().is_empty(), "a lease dies with the grace");
        lease.end(&target).await;
        assert!(alive(&target, target.now().await.unwrap()).await.unwrap().is_empty());
    }
}
