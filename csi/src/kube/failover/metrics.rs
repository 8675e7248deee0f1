//! What the failover controller did (and whether the cluster CA's Secret is missing), for
//! Prometheus: served as `GET /metrics` on the webhook listener (`webhook.rs`) by every replica;
//! only the leader's move. The alerts on them are in
//! deploy/kubernetes/components/monitoring.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// `promoted`, or `pending` (no copy could be promoted yet).
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Change {
    /// `fence` or `lift`.
    pub change: &'static str,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub leader: Gauge,
    pub passes: Counter,
    pub lost_nodes: Gauge,
    pub nodes_lost: Counter,
    pub promotions: Family<Outcome, Counter>,
    pub fence_rounds: Family<Change, Counter>,
    pub errors: Counter,
    pub recovery: Histogram,
    pub release_withheld: Gauge,
}

/// Seconds from a node's loss to a writable primary elsewhere: the goal is a minute.
const RECOVERY_BUCKETS: [f64; 10] = [5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0];

impl Default for Metrics {
    fn default() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            leader: Gauge::default(),
            passes: Counter::default(),
            lost_nodes: Gauge::default(),
            nodes_lost: Counter::default(),
            promotions: Family::default(),
            fence_rounds: Family::default(),
            errors: Counter::default(),
            recovery: Histogram::new(RECOVERY_BUCKETS),
            release_withheld: Gauge::default(),
        };
        // Every labelled series from the start, at 0: a rate over them needs a first sample.
        for ok in [true, false] {
            let _ = m.promotions.get_or_create(&Outcome { outcome: if ok { "promoted" } else { "pending" } });
            let _ = m.fence_rounds.get_or_create(&Change { change: if ok { "fence" } else { "lift" } });
        }
        let r = &mut m.registry;
        r.register("ferrite_failover_leader", "1 on the replica holding the failover Lease.", m.leader.clone());
        r.register("ferrite_failover_passes", "Failover passes run by this replica as leader.", m.passes.clone());
        r.register("ferrite_failover_lost_nodes", "Nodes the last pass found lost.", m.lost_nodes.clone());
        r.register("ferrite_failover_nodes_lost", "Nodes fenced as lost.", m.nodes_lost.clone());
        r.register(
            "ferrite_failover_promotions",
            "Volumes whose primary was on a lost node: a copy promoted, or none yet (pending).",
            m.promotions.clone(),
        );
        r.register(
            "ferrite_failover_fence_rounds",
            "Fences set on (or lifted from) the daemons, one per round of calls.",
            m.fence_rounds.clone(),
        );
        r.register("ferrite_failover_errors", "Failover steps that failed (each also an Event).", m.errors.clone());
        r.register(
            "ferrite_failover_release_withheld",
            "Volumes of lost nodes whose pods and attachments wait for the fence on a daemon holding them \
             (retried every pass; a FenceIncomplete Event on the Node names the daemons).",
            m.release_withheld.clone(),
        );
        r.register(
            "ferrite_cluster_ca_missing",
            "1 while the Secret ferrite-ca is missing but the cluster's CA is in use (no new CA is made).",
            crate::kube::certs::cluster::CA_MISSING.clone(),
        );
        r.register(
            "ferrite_failover_recovery_seconds",
            "From a node's loss (not Ready, or its heartbeat's last renewal) to a promoted primary elsewhere.",
            m.recovery.clone(),
        );
        m
    }
}

impl crate::kube::webhook::Exposition for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }
}

impl Metrics {
    /// The text exposition (OpenMetrics).
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }

    pub fn promoted(&self, ok: bool) {
        let outcome = if ok { "promoted" } else { "pending" };
        self.promotions.get_or_create(&Outcome { outcome }).inc();
    }

    pub fn fence_round(&self, on: bool) {
        self.fence_rounds.get_or_create(&Change { change: if on { "fence" } else { "lift" } }).inc();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_family_is_served_before_anything_happened() {
        let m = super::Metrics::default();
        m.promoted(true);
        m.recovery.observe(12.0);
        let text = m.render();
        for family in [
            "ferrite_failover_leader",
            "ferrite_failover_passes",
            "ferrite_failover_lost_nodes",
            "ferrite_failover_nodes_lost",
            "ferrite_failover_promotions",
            "ferrite_failover_fence_rounds",
            "ferrite_failover_errors",
            "ferrite_failover_release_withheld",
            "ferrite_failover_recovery_seconds",
            "ferrite_cluster_ca_missing",
        ] {
            assert!(text.contains(&format!("# TYPE {family} ")), "{family} missing:\n{text}");
        }
        assert!(text.contains("ferrite_failover_promotions_total{outcome=\"promoted\"} 1"), "{text}");
        assert!(text.contains("ferrite_failover_recovery_seconds_bucket{le=\"15.0\"} 1"), "{text}");
    }
}
