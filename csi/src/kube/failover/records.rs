//! The fences failover made, recorded where only the controller's account writes: one ConfigMap
//! per fenced node in the controller's namespace (`ferrite-fence-<node>`), holding the blocks it
//! fenced and the blocks still to lift on daemons that missed the unfence. The Node's annotations
//! ([`FENCED`], [`UNFENCE`]) mirror the record for people and tools, but a kubelet may write its
//! own Node's annotations as it likes: nothing is lifted, adopted or judged fenced on their word.

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;

use k8s_openapi::api::core::v1::ConfigMap;

use super::lost::UNFENCE;
use super::{FENCED, Failover};

/// The label of every fence record (the records the controller watches).
pub(super) const LABEL: &str = "failover.ferrite.dev/fence";
const PREFIX: &str = "ferrite-fence-";

/// The record's key for an annotation ([`FENCED`] or [`UNFENCE`]): a ConfigMap key has no `/`.
fn key(annotation: &str) -> &'static str {
    if annotation == UNFENCE { "unfence" } else { "fenced" }
}

fn blocks(v: &str) -> Vec<String> {
    v.split(',').filter(|b| !b.is_empty()).map(str::to_owned).collect()
}

impl Failover {
    /// The blocks failover recorded for `node` under `annotation` ([`FENCED`], [`UNFENCE`]).
    pub(super) fn recorded(&self, node: &str, annotation: &str) -> Option<Vec<String>> {
        let at = ObjectRef::new(&format!("{PREFIX}{node}")).within(&self.namespace);
        let cm = self.fence_records.get(&at)?;
        cm.data.as_ref()?.get(key(annotation)).map(|v| blocks(v))
    }

    /// Every block recorded as fenced, with the node it was fenced for.
    pub(super) fn recorded_blocks(&self) -> Vec<(String, String)> {
        let records = self.fence_records.state();
        let of = |cm: &ConfigMap| {
            let node = cm.name_any().strip_prefix(PREFIX).unwrap_or_default().to_owned();
            let fenced = cm.data.as_ref().and_then(|d| d.get(key(FENCED))).map(|v| blocks(v)).unwrap_or_default();
            fenced.into_iter().map(move |b| (b, node.clone()))
        };
        records.iter().flat_map(|cm| of(cm)).collect()
    }

    /// Sets (Some) or removes (None) `values` (annotation, blocks) in node `node`'s record, then
    /// mirrors them on its annotations. The record goes when it holds nothing.
    pub(super) async fn annotate(&self, node: &str, values: &[(&str, Option<String>)]) -> anyhow::Result<()> {
        self.leading().await?;
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let name = format!("{PREFIX}{node}");
        let old = api.get_opt(&name).await?;
        let mut data = old.as_ref().and_then(|c| c.data.clone()).unwrap_or_default();
        for (annotation, v) in values {
            match v {
                Some(v) => data.insert(key(annotation).to_owned(), v.clone()),
                None => data.remove(key(annotation)),
            };
        }
        match old {
            Some(_) if data.is_empty() => match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            },
            None if data.is_empty() => {}
            Some(mut cm) => {
                // A compare-and-swap on the resourceVersion read.
                cm.data = Some(data);
                api.replace(&name, &PostParams::default(), &cm).await?;
            }
            None => {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(name),
                        labels: Some([(LABEL.to_owned(), "true".to_owned())].into()),
                        ..Default::default()
                    },
                    data: Some(data),
                    ..Default::default()
                };
                api.create(&PostParams::default(), &cm).await?;
            }
        }
        let annotations: serde_json::Map<String, serde_json::Value> =
            values.iter().map(|(k, v)| ((*k).to_owned(), serde_json::json!(v))).collect();
        let patch = serde_json::json!({"metadata": {"annotations": annotations}});
        self.nodes.patch(node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn records_keep_blocks_under_keys_a_configmap_allows() {
        assert_eq!(super::key(super::FENCED), "fenced");
        assert_eq!(super::key(super::UNFENCE), "unfence");
        assert_eq!(super::blocks("10.0.0.5/32,fd00::5/128"), ["10.0.0.5/32", "fd00::5/128"]);
        assert!(super::blocks("").is_empty());
    }
}
