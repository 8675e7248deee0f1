//! Asynchronous replication between daemons, snapshot-based (DESIGN.md §2, docs/design/
//! replication.md). A primary volume takes a mirror snapshot every interval and pushes what changed
//! since the newest mirror snapshot its peer holds (`send.rs`); the peer's `Replica` service
//! applies it to a read-only secondary, all or nothing (`receive.rs`), once `admit.rs` has
//! checked that the pushing peer may push it; `control.rs` holds the
//! state machine (enable, demote, promote, resync, disable), the scheduler and the status. The
//! relations and resume points live in `records.rs`. [`Replication`] is what they share.

mod admit;
pub(crate) use admit::check_name;
pub mod control;
pub mod receive;
pub mod records;
pub mod send;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrite_engine::Pool;
use tokio::sync::Notify;

use crate::authz::Policy;
use crate::base::config::{Config, TlsFiles};
use crate::base::error::Error;
use crate::records::attachments::Attachments;
use crate::records::exports::ExportTable;
use records::{PendingRecord, Records, Relation};

/// The longest interval between mirror snapshots (a week); 0 means on request only.
pub const MAX_INTERVAL_SECS: u64 = 7 * 86_400;

/// The highest epoch a peer may send (a promotion a second for 30,000 years stays below it).
pub const MAX_EPOCH: u64 = 1 << 40;

/// The largest push message: a 1 MiB piece of data ([`send::PIECE`]) with its crcs, and framing.
pub const MAX_PUSH_MESSAGE: usize = send::PIECE + (16 << 10);

/// A running transfer's progress, updated by the thread that reads the pieces.
#[derive(Debug)]
pub struct Progress {
    pub started: Instant,
    pub done: AtomicU64,
    pub total: AtomicU64,
}

/// What this daemon knows of a replicated volume beyond its record: nothing here survives a
/// restart, nothing here is needed for correctness.
#[derive(Debug, Default, Clone)]
pub struct Live {
    pub running: Option<Arc<Progress>>,
    pub error: String,
    pub last_secs: f64,
    pub last_bytes: u64,
    /// When the scheduler next pushes.
    pub next_at: Option<Instant>,
    /// A delta arrived since the last resync request.
    pub resynced: bool,
    /// The highest epoch a replica asked to be resynced at, not yet taken by a push.
    pub asked_epoch: u64,
    /// Since the daemon started: data bytes pushed, transfers completed and failed.
    pub sent_bytes: u64,
    pub syncs: u64,
    pub failures: u64,
    /// Failures since the last push that succeeded: how soon the scheduler retries.
    pub failing: u32,
}

/// One shared value per key (a volume's lock, a peer's limiter), made on first use.
#[derive(Debug)]
pub struct PerKey<T>(Mutex<HashMap<String, Arc<T>>>);

impl<T> Default for PerKey<T> {
    fn default() -> Self {
        Self(Mutex::default())
    }
}

impl<T> PerKey<T> {
    pub fn get(&self, key: &str, make: impl FnOnce() -> T) -> Arc<T> {
        Arc::clone(self.0.lock().expect("not poisoned").entry(key.to_owned()).or_insert_with(|| Arc::new(make())))
    }
}

/// Paces the bytes sent to one peer: each piece takes the next free slot of `rate` bytes per
/// second and waits for its start.
#[derive(Debug)]
pub struct Limiter {
    rate: u64,
    next: Mutex<Instant>,
}

impl Limiter {
    pub fn new(rate: u64) -> Self {
        Self { rate, next: Mutex::new(Instant::now()) }
    }

    /// Blocks until `bytes` may go.
    pub fn take(&self, bytes: u64) {
        if self.rate == 0 {
            return;
        }
        let now = Instant::now();
        let start = {
            let mut next = self.next.lock().expect("not poisoned");
            let start = (*next).max(now);
            *next = start + Duration::from_secs_f64(bytes as f64 / self.rate as f64);
            start
        };
        std::thread::sleep(start - now);
    }
}

/// Everything replication shares, one per daemon.
#[derive(Debug)]
pub struct Replication {
    pub pool: Arc<Pool>,
    /// What serves snapshots to clients: a mirror snapshot in use is not pruned.
    exports: Arc<ExportTable>,
    attachments: Arc<Attachments>,
    tls: Option<TlsFiles>,
    /// How peers reach this daemon.
    endpoint: String,
    bandwidth: u64,
    pub relations: Records<Relation>,
    pending: Records<PendingRecord>,
    live: Mutex<HashMap<String, Live>>,
    /// One state change or outgoing push per volume at a time.
    ops: PerKey<tokio::sync::Mutex<()>>,
    incoming: Mutex<HashMap<String, Arc<Notify>>>,
    limiters: PerKey<Limiter>,
    /// Wakes the scheduler (a relation was enabled or promoted).
    wake: Notify,
    /// Who may call the Replica service for which relation (and every other call).
    pub policy: Arc<Policy>,
    /// An incoming push that sends nothing for this long is ended.
    idle_timeout: Duration,
    /// The overcommit cap (at least 1): a replica may be at most this many times the pool.
    overcommit: f64,
    /// Relations one peer may make here (`peer-quota`), and the share of the pool their
    /// volumes may add up to (`peer-space-percent`).
    quota: usize,
    space_percent: Option<u64>,
}

/// An incoming transfer in flight (promoting or disabling the replica cancels it through
/// `cancelled`); dropping it clears the mark.
#[derive(Debug)]
pub struct Incoming<'a> {
    hub: &'a Replication,
    replica: String,
    pub cancelled: Arc<Notify>,
}

impl Drop for Incoming<'_> {
    fn drop(&mut self) {
        self.hub.incoming.lock().expect("not poisoned").remove(&self.replica);
    }
}

impl Replication {
    pub fn new(
        pool: Arc<Pool>,
        exports: Arc<ExportTable>,
        attachments: Arc<Attachments>,
        cfg: &Config,
        policy: Arc<Policy>,
    ) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            pool,
            exports,
            attachments,
            tls: cfg.tls.clone(),
            endpoint: cfg.replication_endpoint.clone(),
            bandwidth: cfg.replication_bandwidth,
            relations: Records::load(&cfg.data_dir, "replication")?,
            pending: Records::load(&cfg.data_dir, "replica-transfers")?,
            live: Mutex::default(),
            ops: PerKey::default(),
            incoming: Mutex::default(),
            limiters: PerKey::default(),
            wake: Notify::new(),
            policy,
            idle_timeout: cfg.replication_idle_timeout,
            overcommit: cfg.overcommit_ratio.unwrap_or(1.0).max(1.0),
            quota: cfg.peer_quota,
            space_percent: cfg.peer_space_percent,
        }))
    }

    /// The lock that orders state changes and pushes of `volume`.
    fn op_lock(&self, volume: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.ops.get(volume, Default::default)
    }

    /// Reads or updates the live status of `volume`.
    pub fn live<R>(&self, volume: &str, f: impl FnOnce(&mut Live) -> R) -> R {
        f(self.live.lock().expect("not poisoned").entry(volume.to_owned()).or_default())
    }

    fn limiter(&self, peer: &str) -> Arc<Limiter> {
        self.limiters.get(peer, || Limiter::new(self.bandwidth))
    }

    /// Marks an incoming transfer into `replica`; a second one at once is Aborted.
    fn claim_incoming(&self, replica: &str) -> Result<Incoming<'_>, Error> {
        let mut m = self.incoming.lock().expect("not poisoned");
        if m.contains_key(replica) {
            return Err(Error::busy(format!("a transfer to replica {replica:?} is already in flight")));
        }
        let cancelled = Arc::new(Notify::new());
        m.insert(replica.to_owned(), Arc::clone(&cancelled));
        Ok(Incoming { hub: self, replica: replica.to_owned(), cancelled })
    }

    /// The identity the peer at `endpoint` proves with its certificate, both when this daemon
    /// connects to it and when it calls here: `peer-server-name` where set, else the endpoint's
    /// host. None for a local endpoint (a socket path), which only an operator may act as.
    pub fn peer_identity(&self, endpoint: &str) -> Option<String> {
        identity_of(self.tls.as_ref(), endpoint)
    }

    /// Cancels an incoming transfer into `replica`, if one runs, and waits until it has stopped.
    async fn cancel_incoming(&self, replica: &str) {
        let Some(n) = self.incoming.lock().expect("not poisoned").get(replica).cloned() else { return };
        n.notify_one();
        while self.incoming.lock().expect("not poisoned").contains_key(replica) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The identity the daemon at `endpoint` proves with its certificate: `peer-server-name` where
/// set, else the endpoint's host, as a TLS client names it when connecting there. None for a
/// local endpoint (a socket path).
pub fn identity_of(tls: Option<&TlsFiles>, endpoint: &str) -> Option<String> {
    let addr = endpoint.strip_prefix("tcp://")?;
    if let Some(name) = tls.and_then(|t| t.peer_name.clone()) {
        return Some(name);
    }
    ferrite_tls::server_name(addr).ok().map(|n| n.to_str().into_owned())
}

/// The largest volume a peer may make here: the pool's size times its overcommit cap.
pub fn largest_replica(pool: &Pool, overcommit: f64) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let most = (pool.stats().size as f64 * overcommit) as u64;
    most
}

/// Refuses `adding` bytes of volumes made by one peer that holds `held` here already, past
/// `percent` of what the pool may hold (its size times the `overcommit` cap), where a percent is
/// set. Err says why.
pub fn check_peer_space(
    pool: &Pool,
    overcommit: f64,
    percent: Option<u64>,
    held: u64,
    adding: u64,
) -> Result<(), String> {
    let Some(percent) = percent else { return Ok(()) };
    let room = u128::from(largest_replica(pool, overcommit)) * u128::from(percent) / 100;
    let total = u128::from(held) + u128::from(adding);
    if total > room {
        return Err(format!(
            "its volumes here would add up to {total} bytes, past its share ({percent}% of the {} the pool may hold: \
             peer-space-percent)",
            largest_replica(pool, overcommit)
        ));
    }
    Ok(())
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limiter_paces_to_its_rate() {
        let l = Limiter::new(10 << 20);
        let t = Instant::now();
        for _ in 0..6 {
            l.take(1 << 20);
        }
        // The first MiB goes at once, the other five take half a second at 10 MiB/s.
        let s = t.elapsed().as_secs_f64();
        assert!((0.45..0.7).contains(&s), "{s}");
        let free = Limiter::new(0);
        let t = Instant::now();
        free.take(u64::MAX);
        assert!(t.elapsed() < Duration::from_millis(10));
    }
}
