//! Per replicated volume (async replication), per backed-up or restored volume, and per
//! volume with synchronous replicas.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferrite_proto::ferrite::v1 as pb;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::families::{counters, gauges};
use super::{Sources, load};
use crate::records::backup_outcomes::{BackupOutcome, PruneOutcome, VerifyOutcome};

impl Sources {
    /// Per replicated volume (labels: volume, role).
    pub(super) fn encode_replication(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows = self.replication.list("").unwrap_or_default();
        let live: Vec<_> = rows.iter().map(|r| self.replication.live(&r.volume, |l| l.clone())).collect();
        let labels: Vec<_> = rows.iter().map(|r| [("volume", r.volume.as_str()), ("role", r.role.as_str())]).collect();
        type Gauge = fn(&pb::Replication) -> f64;
        gauges(
            enc,
            &rows,
            &labels,
            &[
                (
                    "ferrite_replication_lag_seconds",
                    "Age of the newest mirror snapshot both sides hold (the recovery point).",
                    (|r| r.lag_seconds) as Gauge,
                ),
                ("ferrite_replication_syncing", "1 while a transfer runs.", |r| {
                    f64::from(u8::from(r.state == "syncing"))
                }),
                ("ferrite_replication_error", "1 while the last transfer failed.", |r| {
                    f64::from(u8::from(r.state == "error"))
                }),
                ("ferrite_replication_bytes_left", "Data bytes the running transfer still has to send.", |r| {
                    r.bytes_left as f64
                }),
                ("ferrite_replication_last_sync_seconds", "Duration of the last completed transfer.", |r| {
                    r.last_sync_seconds
                }),
                ("ferrite_replication_last_sync_bytes", "Data bytes of the last completed transfer.", |r| {
                    r.last_sync_bytes as f64
                }),
            ],
        )?;
        type Counter = fn(&crate::replica::Live) -> u64;
        counters(
            enc,
            &live,
            &labels,
            &[
                ("ferrite_replication_sent_bytes", "Data bytes pushed to the peer.", (|l| l.sent_bytes) as Counter),
                ("ferrite_replication_syncs", "Transfers completed.", |l| l.syncs),
                ("ferrite_replication_sync_failures", "Transfers that failed.", |l| l.failures),
            ],
        )?;
        Ok(())
    }
}

impl Sources {
    /// Per volume being restored (instant restore: it serves while its chunks are copied).
    pub(super) fn encode_backups(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows: Vec<_> = self.backups.backups();
        let labels: Vec<_> = rows.iter().map(|((t, v), _)| [("target", t.as_str()), ("volume", v.as_str())]).collect();
        type Value = fn(&((String, String), BackupOutcome)) -> u64;
        gauges(
            enc,
            &rows,
            &labels,
            &[
                (
                    "ferrite_backup_last_success_timestamp_seconds",
                    "When the volume's last successful backup to the target ended (Unix seconds; since the daemon started).",
                    (|(_, o)| o.last_success_unix) as Value,
                ),
                ("ferrite_backup_last_failed", "1 if the volume's last backup to the target failed.", |(_, o)| {
                    u64::from(o.last_failed)
                }),
            ],
        )?;
        counters(
            enc,
            &rows,
            &labels,
            &[("ferrite_backup_failures", "Backups that failed.", (|(_, o)| o.failures) as Value)],
        )?;
        let verifies = self.backups.verifies();
        let labels: Vec<_> = verifies.iter().map(|v| [("target", v.target.as_str())]).collect();
        type Verified = fn(&VerifyOutcome) -> u64;
        gauges(
            enc,
            &verifies,
            &labels,
            &[
                (
                    "ferrite_backup_verify_last_timestamp_seconds",
                    "When the last verify of the target's backups ended (Unix seconds).",
                    (|v| v.finished_unix) as Verified,
                ),
                (
                    "ferrite_backup_verify_bad_chunks",
                    "Chunks of the target found bad by a verify and not found good since (quarantined).",
                    |v| v.quarantined,
                ),
            ],
        )?;
        self.encode_prunes(enc)?;
        self.encode_restores(enc)
    }

    /// What the last prune of each target found: the counts an alert watches for a drop, the
    /// age of the object lock's last extension, backups an index had lost.
    fn encode_prunes(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let prunes = self.backups.prunes();
        let labels: Vec<_> = prunes.iter().map(|p| [("target", p.target.as_str())]).collect();
        type Pruned = fn(&PruneOutcome) -> u64;
        gauges(
            enc,
            &prunes,
            &labels,
            &[
                (
                    "ferrite_backup_prune_last_timestamp_seconds",
                    "When this daemon's last prune of the target ended (Unix seconds).",
                    (|p| p.finished_unix) as Pruned,
                ),
                ("ferrite_backup_manifests", "Manifests on the target, as the last prune counted them.", |p| {
                    p.manifests
                }),
                (
                    "ferrite_backup_chunks_referenced",
                    "Distinct chunks the target's backups list, as the last prune counted them.",
                    |p| p.chunks_referenced,
                ),
            ],
        )?;
        let locked: Vec<&PruneOutcome> = prunes.iter().filter(|p| p.lock_days.is_some()).collect();
        let lock_labels: Vec<_> = locked.iter().map(|p| [("target", p.target.as_str())]).collect();
        type Locked = fn(&&PruneOutcome) -> u64;
        gauges(
            enc,
            &locked,
            &lock_labels,
            &[
                (
                    "ferrite_backup_lock_extended_timestamp_seconds",
                    "Since when every object the target keeps is locked for its object-lock-days (Unix seconds, the store's clock; 0: never).",
                    (|p| p.locked_at.and_then(|t| u64::try_from(t).ok()).unwrap_or(0)) as Locked,
                ),
                ("ferrite_backup_lock_days", "The target's object-lock-days.", |p| p.lock_days.unwrap_or(0)),
            ],
        )?;
        counters(
            enc,
            &prunes,
            &labels,
            &[(
                "ferrite_backup_recovered",
                "Backups whose index had lost them (a lost update, a deleted index), listed again by a prune.",
                (|p| p.recovered) as Pruned,
            )],
        )
    }

    fn encode_restores(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows: Vec<_> = self.restores.counts().into_iter().collect();
        let labels: Vec<_> = rows.iter().map(|(volume, _)| [("volume", volume.as_str())]).collect();
        type Value = fn(&(String, (u64, u64, u64))) -> u64;
        gauges(
            enc,
            &rows,
            &labels,
            &[
                (
                    "ferrite_backup_restore_chunks_left",
                    "Chunks of the backup a volume is restored from that are not copied yet.",
                    (|(_, (done, total, _))| total - done) as Value,
                ),
                (
                    "ferrite_backup_restore_chunks_on_demand",
                    "Chunks fetched because a client read or wrote them before the copy got there.",
                    |(_, (_, _, on_demand))| *on_demand,
                ),
            ],
        )
    }

    /// Per volume with synchronous replicas (labels: volume, and this daemon's role in it).
    pub(super) fn encode_sync(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let rows = self.sync.list(None);
        let labels: Vec<_> = rows.iter().map(|r| [("volume", r.volume.as_str()), ("role", r.role.as_str())]).collect();
        let mut m = enc.encode_descriptor(
            "ferrite_sync_generation",
            "Generation of the membership this daemon holds.",
            None,
            MetricType::Gauge,
        )?;
        for (r, l) in rows.iter().zip(&labels) {
            m.encode_family(l)?.encode_gauge(&r.generation)?;
        }
        let mut m = enc.encode_descriptor(
            "ferrite_sync_members",
            "Members of the volume in each state (primary, in-sync, rebuilding, ejected, witness).",
            None,
            MetricType::Gauge,
        )?;
        for r in &rows {
            for state in ["primary", "in-sync", "rebuilding", "ejected", "witness"] {
                let n = r.members.iter().filter(|m| m.state == state).count() as u64;
                m.encode_family(&[("volume", r.volume.as_str()), ("state", state)])?.encode_gauge(&n)?;
            }
        }
        // The rest only where this daemon is the primary.
        let primaries: Vec<_> = rows.iter().filter_map(|r| self.sync.primary(&r.volume)).collect();
        let labels: Vec<_> = primaries.iter().map(|p| [("volume", p.volume.as_str())]).collect();
        let mut m = enc.encode_descriptor(
            "ferrite_sync_refusing_writes",
            "1 while the primary refuses writes (it lost the majority of its members, or stepped down).",
            None,
            MetricType::Gauge,
        )?;
        for (p, l) in primaries.iter().zip(&labels) {
            m.encode_family(l)?.encode_gauge(&u64::from(p.refused().is_some()))?;
        }
        let mut m = enc.encode_descriptor(
            "ferrite_sync_rebuild_bytes_left",
            "Data bytes the running rebuild still has to send.",
            None,
            MetricType::Gauge,
        )?;
        for (p, l) in primaries.iter().zip(&labels) {
            let left = p
                .progress
                .lock()
                .expect("not poisoned")
                .as_ref()
                .map_or(0, |(_, done, total)| total.saturating_sub(done.load(Ordering::Relaxed)));
            m.encode_family(l)?.encode_gauge(&left)?;
        }
        type Counter = fn(&Arc<crate::sync::primary::Primary>) -> u64;
        counters(
            enc,
            &primaries,
            &labels,
            &[
                (
                    "ferrite_sync_ejections",
                    "Members ejected for failing or not answering.",
                    (|p| load(&p.ejections)) as Counter,
                ),
                ("ferrite_sync_rebuild_sent_bytes", "Data bytes rebuilds sent to members.", |p| load(&p.rebuilt_bytes)),
            ],
        )?;
        let mut m = enc.encode_descriptor(
            "ferrite_sync_added_seconds",
            "Time a mirrored request waited for its members after the local write (the _count is the mirrored requests).",
            None,
            MetricType::Histogram,
        )?;
        for (p, l) in primaries.iter().zip(&labels) {
            let h = p.added.snapshot();
            m.encode_family(l)?.encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?;
        }
        Ok(())
    }
}
