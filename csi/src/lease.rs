//! Leader election over a `coordination.k8s.io` Lease, the API server's compare-and-swap: of
//! several controller replicas only the Lease's holder runs the failover loop, so one cannot
//! re-fence a node the other has just let rejoin. The holder renews the Lease on every pass; a
//! Lease not renewed for its duration may be taken by another replica (a replace with the
//! resourceVersion read, so of two takers one wins).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::PostParams;

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
        let lasts = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(secs)));
        let expired = spec.renew_time.as_ref().is_none_or(|t| t.0.saturating_add(lasts).is_ok_and(|end| end < now));
        if !mine && !expired {
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
