//! Leader election over a `coordination.k8s.io` Lease, the API server's compare-and-swap: of
//! several controller replicas only the Lease's holder runs the failover loop, so one cannot
//! re-fence a node the other has just let rejoin. The holder renews the Lease on every pass; a
//! Lease not renewed for its duration may be taken by another replica (a replace with the
//! resourceVersion read, so of two takers one wins).
//!
//! Whether another replica's Lease has expired is judged by this replica's own monotonic clock,
//! as client-go's leader election does: from when it last saw the Lease change, not from the
//! `renewTime` the holder wrote with its wall clock (a replica whose clock ran ahead would take
//! a live Lease), and only after its duration plus [`DRIFT`]. A holder acts only within a third
//! of the duration of its own renewal, so the two never overlap.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;

/// What a taker waits beyond a Lease's duration: the holders' and its own clocks may tick at
/// slightly different rates, and the holder's renewal took a moment to be seen.
const DRIFT: Duration = Duration::from_secs(3);

/// One replica's claim on a Lease.
pub struct Leadership {
    api: Api<Lease>,
    name: String,
    /// This replica (its pod's name).
    me: String,
    duration: Duration,
    /// When this replica last renewed (or took) the Lease; None while another holds it.
    renewed: std::sync::Mutex<Option<std::time::Instant>>,
    /// An annotation every renewal sets (Some) or removes (None): what the holder tells readers.
    note: Option<(&'static str, Option<String>)>,
    /// Another holder's Lease as last seen (its resourceVersion), and when it was first seen so.
    observed: std::sync::Mutex<Option<(String, std::time::Instant)>>,
}

/// Whether a write lost a race (another replica changed or made the Lease first).
fn lost_race(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl Leadership {
    pub fn new(api: Api<Lease>, name: &str, me: &str, duration: Duration) -> Self {
        Self {
            api,
            name: name.to_owned(),
            me: me.to_owned(),
            duration,
            renewed: std::sync::Mutex::default(),
            note: None,
            observed: std::sync::Mutex::default(),
        }
    }

    /// Every renewal sets annotation `key` to `value`, or removes it when None.
    #[must_use]
    pub fn with_note(mut self, key: &'static str, value: Option<String>) -> Self {
        self.note = Some((key, value));
        self
    }

    /// Whether this replica renewed the Lease less than `fresh` ago (it then holds it for at
    /// least its duration minus `fresh`, whatever the other replicas do).
    pub fn renewed_within(&self, fresh: Duration) -> bool {
        let renewed = *self.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        renewed.is_some_and(|at| at.elapsed() < fresh)
    }

    /// Whether this replica holds the Lease now (see [`Self::try_hold`]), remembering when.
    pub async fn hold(&self) -> anyhow::Result<bool> {
        // Taken before the request: the Lease runs from no later than its renewTime.
        let asked = std::time::Instant::now();
        let held = self.try_hold().await;
        let mut renewed = self.renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *renewed = matches!(held, Ok(true)).then_some(asked);
        held
    }

    /// Whether `held` (another replica's) is as this replica first saw it at least `lasts` ago,
    /// by this replica's monotonic clock.
    fn unchanged_for(&self, held: &Lease, lasts: Duration) -> bool {
        let version = held.metadata.resource_version.clone().unwrap_or_default();
        let mut observed = self.observed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*observed {
            Some((seen, since)) if *seen == version => since.elapsed() >= lasts,
            _ => {
                *observed = Some((version, std::time::Instant::now()));
                false
            }
        }
    }

    /// Whether this replica holds the Lease now: it takes a missing or expired one, renews its
    /// own, and leaves a live one of another replica alone.
    async fn try_hold(&self) -> anyhow::Result<bool> {
        let now = Timestamp::now();
        let secs = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        let Some(held) = self.api.get_opt(&self.name).await? else {
            let mut metadata = ObjectMeta { name: Some(self.name.clone()), ..Default::default() };
            if let Some((key, Some(value))) = &self.note {
                metadata.annotations = Some([((*key).to_owned(), value.clone())].into());
            }
            let lease = Lease {
                metadata,
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.me.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(e) if lost_race(&e) => Ok(false),
                Err(e) => Err(e.into()),
            };
        };
        let spec = held.spec.clone().unwrap_or_default();
        let mine = spec.holder_identity.as_deref() == Some(self.me.as_str());
        let lasts = Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(secs)).unwrap_or(0));
        if !mine && spec.renew_time.is_some() && !self.unchanged_for(&held, lasts + DRIFT) {
            return Ok(false);
        }
        let mut next = held;
        if let Some((key, value)) = &self.note {
            let annotations = next.metadata.annotations.get_or_insert_with(Default::default);
            match value {
                Some(v) => annotations.insert((*key).to_owned(), v.clone()),
                None => annotations.remove(*key),
            };
        }
        let spec = next.spec.get_or_insert_with(Default::default);
        if !mine {
            tracing::warn!(lease = %self.name, from = ?spec.holder_identity, "taking over the lease: failover runs here now");
            spec.holder_identity = Some(self.me.clone());
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        spec.lease_duration_seconds = Some(secs);
        spec.renew_time = Some(MicroTime(now));
        match self.api.replace(&self.name, &PostParams::default(), &next).await {
            Ok(_) => Ok(true),
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(version: &str, renewed: Timestamp) -> Lease {
        Lease {
            metadata: ObjectMeta { resource_version: Some(version.into()), ..Default::default() },
            spec: Some(LeaseSpec { renew_time: Some(MicroTime(renewed)), ..Default::default() }),
        }
    }

    /// Another replica's Lease expires by how long this replica has seen it unchanged, not by
    /// its `renewTime`: a holder whose clock runs an hour behind keeps a Lease it renews.
    #[tokio::test]
    async fn another_holders_lease_expires_by_our_own_clock() {
        let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
        let l = Leadership::new(Api::namespaced(client, "ns"), "l", "me", Duration::from_secs(15));
        let hour_ago = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_hours(1);
        assert!(!l.unchanged_for(&lease("1", hour_ago), Duration::ZERO), "first seen now");
        assert!(l.unchanged_for(&lease("1", hour_ago), Duration::ZERO));
        assert!(!l.unchanged_for(&lease("1", hour_ago), Duration::from_secs(60)), "seen unchanged for less");
        assert!(!l.unchanged_for(&lease("2", hour_ago), Duration::ZERO), "renewed: seen anew");
        std::thread::sleep(Duration::from_millis(20));
        assert!(l.unchanged_for(&lease("2", hour_ago), Duration::from_millis(10)));
    }
}
