//! The workload follows the volume. Once a lost node is fenced, its pods that use one of this
//! driver's volumes are deleted at once (no grace period): the fence, not the kubelet, is what
//! guarantees the old pod can no longer write, so there is nothing to wait for. Kubernetes alone
//! would wait: its pod garbage collector force-deletes a node's pods only once the Node is not
//! Ready (40-50 s after a power loss), and on a Ready node (a dead daemon under a live kubelet)
//! the pod waits for the kubelet to unmount a device whose daemon is gone. The node's
//! VolumeAttachments of this driver are deleted too (unless the out-of-service taint has
//! Kubernetes detach them), and their controllers (StatefulSet, Deployment) recreate the pods
//! where the volumes are published next. Nothing else on the node is touched.

use std::collections::BTreeSet;

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

impl super::Failover {
    /// Deletes the pods on fenced node `node` that use a volume of this driver, each with an
    /// Event saying why.
    pub(super) async fn delete_pods(&self, node: &str) -> anyhow::Result<()> {
        let ours: BTreeSet<(String, String)> = self
            .volume_store
            .state()
            .iter()
            .filter(|pv| pv.spec.as_ref().and_then(|s| s.csi.as_ref()).is_some_and(|c| c.driver == self.driver))
            .filter_map(|pv| pv.spec.as_ref()?.claim_ref.clone())
            .map(|c| (c.namespace.unwrap_or_default(), c.name.unwrap_or_default()))
            .collect();
        let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
        for pod in Api::<Pod>::all(self.client.clone()).list(&on_node).await? {
            let uses: Vec<String> = claims(&pod).into_iter().filter(|c| ours.contains(c)).map(|(_, c)| c).collect();
            if uses.is_empty() {
                continue;
            }
            let (ns, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
            self.leading().await?;
            let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
            match Api::<Pod>::namespaced(self.client.clone(), &ns).delete(&name, &now).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => continue,
                Err(e) => return Err(e.into()),
            }
            let note = format!(
                "node {node} was lost and is fenced; deleted so that the pod restarts where its \
                 volumes ({}) are served now",
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
        Ok(())
    }
}

impl super::Failover {
    /// Deletes the VolumeAttachments of this driver's volumes to fenced node `node`: the
    /// attacher then unpublishes them (the fenced node can no longer use them) and the volumes
    /// attach where their pods go next.
    pub(super) async fn detach(&self, node: &str) -> anyhow::Result<()> {
        let api = Api::<VolumeAttachment>::all(self.client.clone());
        for va in api.list(&ListParams::default()).await? {
            if va.spec.attacher != self.driver || va.spec.node_name != node || va.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            self.leading().await?;
            match api.delete(&va.name_any(), &DeleteParams::default()).await {
                Ok(_) => tracing::warn!(node, attachment = %va.name_any(), "fenced node's VolumeAttachment deleted"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{EphemeralVolumeSource, PersistentVolumeClaimVolumeSource, PodSpec, Volume};
    use kube::api::ObjectMeta;

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
