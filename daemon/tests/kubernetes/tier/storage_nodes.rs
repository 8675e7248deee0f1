//! Storage nodes by choice: the daemon DaemonSet runs only on nodes with the storage label, and
//! on tainted ones only where its tolerations admit them (control-plane nodes, with the
//! tolerations component); a node without the label runs the node plugin alone, which has the
//! node's certificate issued and reaches remote-access volumes with it.

use std::path::Path;

use serde_json::{Value, json};

use super::common::Daemon;
use super::{Cluster, LONG, NS, STORAGE_LABEL, claim, deploy, runs_on};

/// The names of the pods in `ferrite` on `node`.
fn pods_on(c: &Cluster, node: &str) -> Vec<String> {
    let pods = c.cp.get(&["pods", "-n", NS, "--field-selector", &format!("spec.nodeName={node}")]);
    pods["items"].as_array().unwrap().iter().map(|p| p["metadata"]["name"].as_str().unwrap().to_owned()).collect()
}

/// Node-d is a control-plane node (tainted NoSchedule) with the storage label: the tolerations
/// component lets the daemon run there, which the manifests without it would not.
pub fn tainted_node(c: &Cluster) {
    println!("== a control-plane node runs a daemon with the tolerations component, none without it");
    let node = c.cp.get(&["node", "node-d"]);
    assert!(node["spec"]["taints"].to_string().contains("node-role.kubernetes.io/control-plane"), "{node}");
    assert!(pods_on(c, "node-d").iter().any(|p| p.starts_with("ferrite-daemon-node-d")), "{:?}", pods_on(c, "node-d"));
    // The base alone, as a user who did not enable the component applies it.
    let base = deploy().join("base").display().to_string();
    let rendered = c.cp.ok(&["create", "--dry-run=client", "-o", "json", "-k", &base]);
    // One JSON document per object.
    let mut objects = serde_json::Deserializer::from_str(&rendered).into_iter::<Value>().map(Result::unwrap);
    let ds = objects.find(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == "ferrite-daemon").unwrap();
    let ds = &ds;
    assert!(!runs_on(ds, &node), "without the tolerations component no daemon runs on a control-plane node");
    assert_eq!(ds["spec"]["template"]["spec"]["nodeSelector"][STORAGE_LABEL], "true");
}

/// Node-e joins without the storage label: no daemon runs there, the node plugin alone; its
/// certificate is issued to the node plugin's ServiceAccount; it serves the node's attachments
/// on the admin socket itself; a remote-access claim whose pod runs on node-e is made on a
/// storage node, and attaching it to node-e grants node-e's certificate the volume's export.
/// (Staging it as a kernel NBD device needs the nbd module: the VM tier's
/// `a_node_without_storage_stages_it_from_its_primary` does that.)
pub fn label_less_node(c: &mut Cluster, dir: &Path) {
    println!("== a node without the storage label runs the node plugin only, and reaches remote-access volumes");
    let daemons = c.daemon_pods.len();
    c.add_node(dir, "node-e");
    let e = c.nodes.len() - 1;
    assert_eq!(c.daemon_pods.len(), daemons, "no daemon pod on node-e");
    let pods = pods_on(c, "node-e");
    assert!(pods.len() == 1 && pods[0].starts_with("ferrite-node-plugin-node-e"), "{pods:?}");
    let plugin = c.plugin_pods.last().unwrap();
    assert!(plugin.log("ferrite-csi").contains("this node holds no storage"), "{}", plugin.log("ferrite-csi"));

    let tls = c.nodes[e].host("/etc/ferrite/tls");
    let cert = ferrite_tls::load_certs(&tls.join("tls.crt")).unwrap();
    assert_eq!(ferrite_tls::identities(&cert[0]), ["node-e", c.nodes[e].ip.as_str(), "ferrite-node.ferrite.svc"]);
    let csrs = c.cp.get(&["csr", "-l", "ferrite.dev/node=node-e"]);
    let csr = &csrs["items"][0];
    assert_eq!(csr["spec"]["username"], "system:serviceaccount:ferrite:ferrite-node", "{csr}");
    assert_eq!(csr["status"]["conditions"][0]["type"], "Approved", "{}", csr["status"]);

    let here = Daemon { dir: c.nodes[e].host("/run/ferrite"), child: None };
    assert_eq!(here.json(&["attachments"]), json!([]));
    assert!(!here.cli(&["pool", "status"]).status.success(), "node-e has no pool");

    c.cp.apply(
        &json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "ferrite-anywhere"},
            "provisioner": "csi.ferrite.dev", "volumeBindingMode": "WaitForFirstConsumer",
            "parameters": {"csi.storage.k8s.io/fstype": "ext4", "remoteAccess": "true"}})
        .to_string(),
    );
    // The scheduler's capacity rule (volumebinding, WaitForFirstConsumer): a node fits a claim
    // when a CSIStorageCapacity of the claim's class whose nodeTopology selects the node has the
    // room (maximumVolumeSize if given, else capacity). The provisioner publishes them per node
    // topology from GetCapacity: node-e fits the remote-access class and not a local one.
    let fits = |cp: &super::ControlPlane, class: &str, bytes: u64| {
        let caps = cp.get(&["csistoragecapacities", "-n", NS]);
        caps["items"].as_array().unwrap().iter().any(|i| {
            let room = i["maximumVolumeSize"].as_str().or(i["capacity"].as_str()).map_or(0, quantity);
            i["storageClassName"] == class
                && i["nodeTopology"]["matchLabels"]["topology.ferrite.dev/node"] == "node-e"
                && room >= bytes
        })
    };
    c.cp.wait("capacity for the remote-access class on node-e", LONG, |cp| fits(cp, "ferrite-anywhere", 32 << 20));
    assert!(!fits(&c.cp, "ferrite-ext4", 1), "a local class has no room on a node without storage");
    claim(&c.cp, "far", "node-e", "32Mi", None, json!({}), json!({"storageClassName": "ferrite-anywhere"}));
    let handle = c.bound("far");
    let (node, _) = handle.split_once('/').unwrap();
    assert!(c.nodes[..e].iter().any(|n| n.name == node), "made on a storage node: {handle}");
    let pv = c.cp.get(&["pvc", "far", "-n", "default"])["spec"]["volumeName"].as_str().unwrap().to_owned();
    assert!(c.cp.get(&["pv", &pv])["spec"]["nodeAffinity"].is_null(), "accessible from every node");
    c.cp.apply(
        &json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": "far-e"},
            "spec": {"attacher": "csi.ferrite.dev", "nodeName": "node-e", "source": {"persistentVolumeName": pv}}})
        .to_string(),
    );
    let mut va = Value::Null;
    c.cp.wait("node-e's attach", LONG, |cp| {
        va = cp.get(&["volumeattachment", "far-e"]);
        va["status"]["attached"] == true
    });
    let meta = &va["status"]["attachmentMetadata"];
    assert_eq!(meta["primary"], node, "{meta}");
    // What node-e's plugin opens when it stages the volume, with the certificate it was issued.
    let cfg = ferrite_tls::client_config(&tls.join("ca.crt"), Some((&tls.join("tls.crt"), &tls.join("tls.key"))), &[])
        .unwrap();
    let name = ferrite_tls::server_name("ferrite-node.ferrite.svc").unwrap();
    let (nbd, export) = (meta["nbd"].as_str().unwrap(), meta["export"].as_str().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let size = rt.block_on(ferrite_nbd::relay::export_size(cfg, name, nbd, export)).unwrap();
    assert_eq!(size, 32 << 20);
    client_only(c, e, (nbd, export));
    c.cp.ok(&["delete", "volumeattachment", "far-e", "--wait=true", "--timeout=60s"]);
}

/// The label kubelets cannot write that makes storage nodes, once the cluster uses it.
const RESTRICTED_STORAGE: &str = "node-restriction.kubernetes.io/ferrite-storage";

/// The cluster labels its storage nodes with [`RESTRICTED_STORAGE`]: node `e` (no storage) is
/// then issued `client.<Service>` instead of the Service's name, still opens the export
/// `(nbd, export)` published to it, and may not act as a replication peer. The labels off, it
/// is issued the Service's name again.
fn client_only(c: &mut Cluster, e: usize, (nbd, export): (&str, &str)) {
    println!("== storage nodes labelled {RESTRICTED_STORAGE}: a node without storage is no replication peer");
    let storage: Vec<String> = c.daemon_pods.iter().map(|p| p.node.name.clone()).collect();
    for n in &storage {
        c.cp.ok(&["label", "node", n, &format!("{RESTRICTED_STORAGE}=true")]);
    }
    let (name, ip) = (c.nodes[e].name.clone(), c.nodes[e].ip.clone());
    let tls = c.nodes[e].host("/etc/ferrite/tls");
    let names = |tls: &Path| ferrite_tls::identities(&ferrite_tls::load_certs(&tls.join("tls.crt")).unwrap()[0]);
    let client = [name.as_str(), ip.as_str(), "client.ferrite-node.ferrite.svc"];
    c.cp.wait(&format!("{name}'s certificate to name the client"), LONG, |_| names(&tls) == client);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let cfg = ferrite_tls::client_config(&tls.join("ca.crt"), Some((&tls.join("tls.crt"), &tls.join("tls.key"))), &[])
        .unwrap();
    let svc = ferrite_tls::server_name("ferrite-node.ferrite.svc").unwrap();
    let size = rt.block_on(ferrite_nbd::relay::export_size(cfg, svc, nbd, export)).unwrap();
    assert_eq!(size, 32 << 20, "the export published to it opens with the client's name");
    let peer = rt.block_on(async {
        let id = ferrite_proto::admin_tls(&tls.join("ca.crt"), Some((&tls.join("tls.crt"), &tls.join("tls.key"))))?;
        let endpoint = format!("tcp://{}:7070", c.nodes[0].ip);
        let ch = ferrite_proto::connect_as(&endpoint, Some(id), Some("ferrite-node.ferrite.svc")).await?;
        let mut replica = ferrite_proto::ferrite::v1::replica_client::ReplicaClient::new(ch);
        let r = ferrite_proto::ferrite::v1::ReplicaPositionRequest { replica: "any".into() };
        anyhow::Ok(replica.position(r).await)
    });
    let refused = peer.unwrap().unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
    println!("   as a replication peer: {}", refused.message());
    for n in &storage {
        c.cp.ok(&["label", "node", n, &format!("{RESTRICTED_STORAGE}-")]);
    }
    let service = [name.as_str(), ip.as_str(), "ferrite-node.ferrite.svc"];
    c.cp.wait(&format!("{name}'s certificate to name the Service again"), LONG, |_| names(&tls) == service);
}

/// A resource quantity's bytes ("1234", "64Mi", "2Gi", "1G"); 0 for what it cannot read.
fn quantity(q: &str) -> u64 {
    let at = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(at);
    let scale: u64 = match unit {
        "" => 1,
        "k" => 1_000,
        "Ki" => 1 << 10,
        "M" => 1_000_000,
        "Mi" => 1 << 20,
        "G" => 1_000_000_000,
        "Gi" => 1 << 30,
        "T" => 1_000_000_000_000,
        "Ti" => 1 << 40,
        _ => return 0,
    };
    n.parse::<u64>().map_or(0, |n| n.saturating_mul(scale))
}
