//! The workload follows the volume. Once a lost node is fenced, its pods that use one of this
//! driver's volumes are deleted, and the node's VolumeAttachments of this driver too (unless the
//! out-of-service taint has Kubernetes detach them); their controllers (StatefulSet,
//! Deployment) recreate the pods where the volumes are published next. How much is released
//! depends on the kubelet:
//!
//! - A node that is not Ready (its kubelet silent too): every such pod, at once (no grace
//!   period). The fence, not the kubelet, is what guarantees the old pod can no longer write, so
//!   there is nothing to wait for; Kubernetes alone would force-delete them only 40-50 s later.
//! - A Ready node (a stalled or dead daemon under a live kubelet): only the pods using a volume
//!   that is served elsewhere now (promoted), with their own grace period, and only those
//!   volumes' attachments. The kubelet is alive: it stops the pod as it would any other, and a
//!   pod whose volume stayed (a single copy) keeps running and resumes when its daemon does.
//!
//! Either way, nothing of a volume whose fence does not hold yet on every daemon holding it
//! (`protect.rs`): a pod using one stays, and so do that volume's attachments, until it holds.
//! Nothing else on the node is touched.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};

/// The claims (namespace, name) a pod mounts: named ones and generic ephemeral ones (whose
/// claim is named `<pod>-<volume>`).
fn claims(pod: &Pod) -> Vec<(String, String)> {
    let ns = pod.namespace().unwrap_or_default();
    let volumes = pod.spec.iter().flat_map(|s| s.volumes.iter().flatten());
    volumes
        .filter_map(|v| match (&v.persistent_volume_claim, &v.ephemeral) {
            (Some(c), _) => Some(c.claim_name.clone()),
            (None, Some(_)) => Some(format!("{}-{}", pod.name_any(), v.name)),
            (None, None) => None,
        })
        .map(|c| (ns.clone(), c))
        .collect()
}

/// What failover releases on a fenced node.
#[derive(Debug, Clone, Copy)]
pub(super) struct Release<'a> {
    /// Not Ready: every pod and attachment of our volumes, pods with no grace. Ready: those of
    /// the volumes (engine names) served elsewhere now (`moved`), pods with their grace.
    pub ready: bool,
    pub moved: &'a BTreeSet<String>,
    /// Volumes whose fence does not hold yet (with the daemons it waits for): kept.
    pub withheld: &'a BTreeMap<String, Vec<String>>,
}

impl Release<'_> {
    /// Whether `volume`'s pods and attachments go once its fence holds.
    fn wants(self, volume: &str) -> bool {
        !self.ready || self.moved.contains(volume)
    }

    /// Whether they go now.
    fn covers(self, volume: &str) -> bool {
        self.wants(volume) && !self.withheld.contains_key(volume)
    }
}

impl super::Failover {
    /// The engine volume of each PersistentVolume of this driver, by PV name and by claim.
    fn our_volumes(&self) -> Vec<(String, (String, String), String)> {
        let pvs = self.volume_store.state();
        pvs.iter()
            .filter_map(|pv| {
                let spec = pv.spec.as_ref()?;
                let csi = spec.csi.as_ref().filter(|c| c.driver == self.driver)?;
                let (_, volume) = crate::shared::ids::parse(&csi.volume_handle)?;
                let c = spec.claim_ref.clone().unwrap_or_default();
                let claim = (c.namespace.unwrap_or_default(), c.name.unwrap_or_default());
                Some((pv.name_any(), claim, volume.to_owned()))
            })
            .collect()
    }

    /// Deletes the pods on fenced node `node` that use a volume of this driver `which` covers
    /// and none it withholds, each with an Event saying why; the withheld volumes of the pods
    /// kept.
    pub(super) async fn delete_pods(&self, node: &str, which: Release<'_>) -> anyhow::Result<BTreeSet<String>> {
        let ours: BTreeMap<(String, String), String> =
            self.our_volumes().into_iter().map(|(_, claim, volume)| (claim, volume)).collect();
        let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
        let mut kept = BTreeSet::new();
        for pod in Api::<Pod>::all(self.client.clone()).list(&on_node).await? {
            let used: Vec<(String, &String)> =
                claims(&pod).into_iter().filter_map(|c| Some((c.1.clone(), ours.get(&c)?))).collect();
            // A pod already stopping with its grace is left to its kubelet, unless the node is
            // not Ready: then no kubelet will end it.
            let stopping = pod.metadata.deletion_timestamp.is_some();
            if !used.iter().any(|(_, v)| which.wants(v)) || (stopping && which.ready) {
                continue;
            }
            // Restarted elsewhere, it would use a volume the lost node may still write.
            let waits: Vec<&String> =
                used.iter().map(|(_, v)| *v).filter(|v| which.withheld.contains_key(*v)).collect();
            if !waits.is_empty() {
                kept.extend(waits.into_iter().cloned());
                continue;
            }
            let uses: Vec<String> = used.into_iter().filter(|(_, v)| which.covers(v)).map(|(c, _)| c).collect();
            let (ns, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
            self.leading().await?;
            let grace = if which.ready {
                DeleteParams::default()
            } else {
                DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() }
            };
            match Api::<Pod>::namespaced(self.client.clone(), &ns).delete(&name, &grace).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => continue,
                Err(e) => return Err(e.into()),
            }
            let how = if which.ready {
                format!("the daemon on node {node} was lost and is fenced (the node is Ready)")
            } else {
                format!("node {node} was lost and is fenced")
            };
            let note = format!(
                "{how}; deleted so that the pod restarts where its volumes ({}) are served now",
                uses.join(", ")
            );
            tracing::warn!(pod = %name, namespace = %ns, "{note}");
            let ev = Event {
                type_: EventType::Warning,
                reason: "FailedOver".into(),
                note: Some(note),
                action: "Delete".into(),
                secondary: None,
            };
            if let Err(e) = self.events.publish(&ev, &pod.object_ref(&())).await {
                tracing::warn!(pod = %name, "publishing an event: {e}");
            }
        }
        Ok(kept)
    }

    /// Deletes the VolumeAttachments to fenced node `node` of this driver's volumes `which`
    /// covers: the attacher then unpublishes them (the fenced node can no longer use them) and
    /// the volumes attach where their pods go next. Returns the withheld volumes it kept.
    pub(super) async fn detach(&self, node: &str, which: Release<'_>) -> anyhow::Result<BTreeSet<String>> {
        let volumes: BTreeMap<String, String> =
            self.our_volumes().into_iter().map(|(pv, _, volume)| (pv, volume)).collect();
        let api = Api::<VolumeAttachment>::all(self.client.clone());
        let mut kept = BTreeSet::new();
        for va in api.list(&ListParams::default()).await? {
            let pv = va.spec.source.persistent_volume_name.as_deref().unwrap_or_default();
            let Some(volume) = volumes.get(pv) else { continue };
            if va.spec.attacher != self.driver || va.spec.node_name != node || va.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            if !which.covers(volume) {
                if which.wants(volume) {
                    kept.insert(volume.clone());
                }
                continue;
            }
            self.leading().await?;
            match api.delete(&va.name_any(), &DeleteParams::default()).await {
                Ok(_) => tracing::warn!(node, attachment = %va.name_any(), "fenced node's VolumeAttachment deleted"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{EphemeralVolumeSource, PersistentVolumeClaimVolumeSource, PodSpec, Volume};
    use kube::api::ObjectMeta;

    #[test]
    fn a_ready_node_releases_only_what_moved_and_nothing_withheld() {
        let moved: BTreeSet<String> = ["v1".to_owned()].into();
        let none = BTreeMap::new();
        let all = Release { ready: false, moved: &moved, withheld: &none };
        assert!(all.covers("v1") && all.covers("v2"));
        let ready = Release { ready: true, ..all };
        assert!(ready.covers("v1") && !ready.covers("v2"));
        let withheld: BTreeMap<String, Vec<String>> = [("v1".to_owned(), vec!["b".to_owned()])].into();
        let waiting = Release { withheld: &withheld, ..all };
        assert!(!waiting.covers("v1") && waiting.covers("v2"));
    }

    #[test]
    fn finds_named_and_ephemeral_claims() {
        let pod = Pod {
            metadata: ObjectMeta { name: Some("web-0".into()), namespace: Some("shop".into()), ..Default::default() },
            spec: Some(PodSpec {
                volumes: Some(vec![
                    Volume {
                        name: "data".into(),
                        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                            claim_name: "data-web-0".into(),
                            read_only: None,
                        }),
                        ..Default::default()
                    },
                    Volume {
                        name: "scratch".into(),
                        ephemeral: Some(EphemeralVolumeSource::default()),
                        ..Default::default()
                    },
                    Volume { name: "config".into(), ..Default::default() },
                ]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let want = vec![("shop".to_owned(), "data-web-0".to_owned()), ("shop".to_owned(), "web-0-scratch".to_owned())];
        assert_eq!(claims(&pod), want);
    }
}
