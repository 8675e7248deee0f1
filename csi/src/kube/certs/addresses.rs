//! Which node each IP address was first issued to: the signer's record, a ConfigMap in the
//! controller's namespace that only the controller's account writes (`ferrite-node-addresses`,
//! one key per address). An address recorded for a node stays that node's while the Node
//! exists, whatever another Node lists in its status: a later claimant is refused, never the
//! owner. The address of a Node that is gone is free again.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};

/// The record's name.
pub const RECORD: &str = "ferrite-node-addresses";

/// An address as a ConfigMap key (keys take no `:`; no IP address holds a `_`).
fn key(address: &str) -> String {
    address.replace(':', "_")
}

fn address(key: &str) -> String {
    canonical(&key.replace('_', ":"))
}

/// One spelling per IP address (`::ffff:10.0.0.1` is 10.0.0.1); a name is kept as it is.
fn canonical(a: &str) -> String {
    a.parse::<std::net::IpAddr>().map_or_else(|_| a.to_owned(), |ip| ip.to_canonical().to_string())
}

/// Address → node, as recorded, of the nodes in `existing` only.
pub fn owners(record: Option<&ConfigMap>, existing: impl Fn(&str) -> bool) -> BTreeMap<String, String> {
    let data = record.and_then(|r| r.data.as_ref()).into_iter().flatten();
    data.filter(|(_, node)| existing(node)).map(|(k, node)| (address(k), node.clone())).collect()
}

/// The addresses node `node` may not be issued, each with the node it belongs to: those recorded
/// for another node, and those another Node lists (`listed`: address → node) that are not
/// recorded for `node`.
pub fn others(
    node: &str,
    recorded: &BTreeMap<String, String>,
    listed: impl IntoIterator<Item = (String, String)>,
) -> BTreeMap<String, String> {
    let listed = listed.into_iter().map(|(a, n)| (canonical(&a), n));
    let mut others: BTreeMap<String, String> =
        listed.filter(|(a, n)| n != node && recorded.get(a).is_none_or(|o| o != node)).collect();
    others.extend(recorded.iter().filter(|(_, o)| *o != node).map(|(a, o)| (a.clone(), o.clone())));
    others
}

/// Reads the record in `namespace` (None: none yet).
pub async fn read(client: &kube::Client, namespace: &str) -> Result<Option<ConfigMap>> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    api.get_opt(RECORD).await.with_context(|| format!("reading ConfigMap {namespace}/{RECORD}"))
}

/// Records `addresses` as `node`'s in `record` (read just before), keeping what it holds: a
/// replace at the version read, so a change meanwhile fails (the request is answered again at
/// the watch's next resync) rather than being lost.
pub async fn record(
    client: &kube::Client,
    namespace: &str,
    record: Option<ConfigMap>,
    node: &str,
    addresses: &[String],
) -> Result<()> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let mut cm = record.unwrap_or_else(|| ConfigMap {
        metadata: ObjectMeta { name: Some(RECORD.into()), ..Default::default() },
        ..Default::default()
    });
    let data = cm.data.get_or_insert_with(BTreeMap::new);
    let mut changed = false;
    for a in addresses {
        changed |= data.insert(key(&canonical(a)), node.to_owned()).as_deref() != Some(node);
    }
    if !changed {
        return Ok(());
    }
    let pp = PostParams::default();
    let done = match cm.metadata.resource_version.is_some() {
        true => api.replace(RECORD, &pp, &cm).await,
        false => api.create(&pp, &cm).await,
    };
    done.with_context(|| format!("recording {addresses:?} as node {node}'s in ConfigMap {namespace}/{RECORD}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_stays_with_the_node_first_issued_it() {
        let cm = ConfigMap {
            data: Some(BTreeMap::from([
                ("10.0.0.1".into(), "node-a".into()),
                ("fd00__1".into(), "node-a".into()),
                ("10.0.0.9".into(), "gone".into()),
            ])),
            ..Default::default()
        };
        let recorded = owners(Some(&cm), |n| n != "gone");
        assert_eq!(recorded.get("fd00::1").map(String::as_str), Some("node-a"), "keys hold no ':'");
        assert!(!recorded.contains_key("10.0.0.9"), "a Node that is gone frees its addresses");
        // node-b lists node-a's address: node-a keeps it, node-b is refused it.
        let listed =
            || vec![("10.0.0.1".to_owned(), "node-b".to_owned()), ("10.0.0.2".to_owned(), "node-b".to_owned())];
        let for_a = others("node-a", &recorded, listed());
        assert_eq!(for_a, BTreeMap::from([("10.0.0.2".into(), "node-b".into())]));
        let for_b = others("node-b", &recorded, listed());
        assert_eq!(for_b.get("10.0.0.1").map(String::as_str), Some("node-a"));
        assert_eq!(for_b.get("fd00::1").map(String::as_str), Some("node-a"), "even where node-a lists it no more");
        // Unrecorded, listed by two: neither gets it until one is recorded.
        let for_c = others("node-c", &BTreeMap::new(), listed());
        assert_eq!(for_c.len(), 2);
    }
}
