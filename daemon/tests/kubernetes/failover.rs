//! The tier's node-loss and maintenance scenarios for a three-copy volume: (a) the primary's
//! node lost (its daemon killed, its Node not Ready); (c) its daemon dead while the Node stays
//! Ready (only the storage heartbeat's Lease tells), with (d) the controller's calls timed
//! meanwhile and (g) a publication to a third node after this second failover; (f) the
//! primary's node cordoned. The failovers check that every acknowledged write is on the promoted
//! copy, that the node is tainted and its pod using the volume deleted (one using none stays),
//! that the volume attaches and takes a write on the new primary (timed from the fault), and
//! that the node comes back rebuilt before its fence and taints are lifted.

use std::time::Instant;

use serde_json::json;

use super::common::Daemon;
use super::{Cluster, ControlPlane, FAILOVER_AFTER, LONG, NODES, NS, events, pattern, set_ready};

/// The node holding `vol`'s primary (its index and name) and the generation it serves.
fn primary_of(c: &Cluster, vol: &str) -> (usize, &'static str, u64) {
    for (i, n) in NODES.iter().enumerate() {
        let s = c.daemons[i].json(&["replica", "status", vol]);
        if s["role"] == "primary" {
            return (i, n, s["generation"].as_u64().unwrap());
        }
    }
    panic!("no node serves {vol} as its primary");
}

/// Writes `content` at the start of `vol` on its primary (`d`): acknowledged once a majority
/// of the copies hold it.
fn acknowledged(d: &Daemon, vol: &str, content: &[u8]) {
    let mut s = super::common::nbd::open(d, vol);
    assert_eq!(super::common::nbd::write_on(&mut s, 0, content), 0);
    drop(s);
    d.ok(&["export", "stop", vol]);
}

/// Waits for a survivor of node `lost` to serve `vol` as primary in a generation after
/// `generation`; its name.
fn promoted(c: &mut Cluster, vol: &str, lost: &str, generation: u64) -> String {
    let mut to = String::new();
    let daemons = &c.daemons;
    c.cp.wait(&format!("the controller to promote a copy not on {lost}"), LONG, |_| {
        let survivor = NODES.iter().zip(daemons).filter(|(n, _)| **n != lost).find(|(_, d)| {
            let v = d.json(&["replica", "status", vol]);
            v["role"] == "primary" && v["generation"].as_u64() > Some(generation)
        });
        to = survivor.map_or(String::new(), |(n, _)| (*n).to_owned());
        !to.is_empty()
    });
    to
}

/// Our taints of `node` (`key:effect`).
fn ours(cp: &ControlPlane, node: &str) -> Vec<String> {
    let n = cp.get(&["node", node]);
    let taints = n["spec"]["taints"].as_array().cloned().unwrap_or_default();
    taints
        .iter()
        .filter(|t| t["value"] == "ferrite-failover")
        .map(|t| format!("{}:{}", t["key"], t["effect"]))
        .collect()
}

/// The lost node `i` is fenced everywhere else, annotated and tainted out-of-service (its pods
/// are deleted, their volumes detached at once) and fenced (NoSchedule).
fn check_fenced(c: &mut Cluster, i: usize) {
    let lost = NODES[i];
    let block = format!("{}/32", c.nodes[i].ip);
    for (n, d) in NODES.iter().zip(&c.daemons).filter(|(n, _)| **n != lost) {
        assert!(d.ok(&["fence", "list"]).contains(&block), "{n} does not fence {lost}");
    }
    let node = c.cp.get(&["node", lost]);
    assert_eq!(node["metadata"]["annotations"]["failover.ferrite.dev/fenced"], block.as_str(), "{}", node["metadata"]);
    c.cp.wait(&format!("{lost} tainted out-of-service and fenced"), LONG, |cp| ours(cp, lost).len() == 2);
    let taints = ours(&c.cp, lost);
    assert!(
        taints.iter().any(|t| t.contains("node.kubernetes.io/out-of-service") && t.contains("NoExecute")),
        "{taints:?}"
    );
}

/// Attaches `pv` to node `on` (VolumeAttachment `va`, as the attach-detach controller makes it)
/// and checks that its primary is there (a copy node becomes the primary when it publishes).
fn attach(c: &mut Cluster, pv: &str, on: &str, va: &str) {
    c.cp.apply(
        &json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": va},
            "spec": {"attacher": "csi.ferrite.dev", "nodeName": on, "source": {"persistentVolumeName": pv}}})
        .to_string(),
    );
    let got =
        c.wait_field(&format!("the attach to {on}"), &["volumeattachment", va], |v| v["status"]["attached"] == true);
    assert_eq!(got["status"]["attachmentMetadata"]["primary"], on, "{}", got["status"]);
}

/// Pods on node `node` as the scheduler bound them: `app` uses the claim of `pv`, `bystander`
/// no volume.
fn place_pods(c: &Cluster, pv: &str, node: &str, app: &str) {
    let claim = c.cp.get(&["pv", pv])["spec"]["claimRef"]["name"].as_str().unwrap().to_owned();
    for (name, volumes) in
        [(app, json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim}}])), ("bystander", json!([]))]
    {
        c.cp.apply(
            &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
                "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app.invalid/app:1"}],
                    "volumes": volumes}})
            .to_string(),
        );
    }
}

/// The lost node's pod that used the volume is deleted (with an Event saying why), so that it
/// can restart where the volume is; the one that used none stays.
fn check_pods_moved(c: &mut Cluster, app: &str) {
    c.cp.wait(&format!("pod {app} deleted from the lost node"), LONG, |cp| {
        !cp.kubectl(&["get", "pod", app, "-n", "default"]).status.success()
    });
    let said = events(&c.cp, app, "FailedOver");
    assert!(said.iter().any(|n| n.contains("deleted so that the pod restarts where its volumes")), "{said:?}");
    assert!(
        c.cp.kubectl(&["get", "pod", "bystander", "-n", "default"]).status.success(),
        "a pod without our volumes stays"
    );
    c.cp.ok(&["delete", "pod", "bystander", "-n", "default", "--grace-period=0", "--force"]);
}

/// The workload comes back on `on` (a copy node, the new primary): the volume attaches there and
/// the first write after the fault is acknowledged. Prints both times from the fault.
fn workload_back(c: &mut Cluster, vol: &str, pv: &str, on: &str, fault: Instant, va: &str) {
    attach(c, pv, on, va);
    let attached = fault.elapsed();
    let mut s = super::common::nbd::open(c.daemon(on), vol);
    assert_eq!(super::common::nbd::write_on(&mut s, 4 << 20, &pattern(4096)), 0, "the first write after failover");
    drop(s);
    c.daemon(on).ok(&["export", "stop", vol]);
    println!("   attached on {on} {attached:?}, first write acknowledged {:?} after the fault", fault.elapsed());
    c.cp.ok(&["delete", "volumeattachment", va, "--wait=true", "--timeout=60s"]);
}

/// Waits for the returned node `i` to be an in-sync member everywhere, then for its fence,
/// annotation and taints to be lifted; checks the Rejoined event on `pv`.
fn rejoined(c: &mut Cluster, vol: &str, pv: &str, i: usize) {
    let (lost, block) = (NODES[i], format!("{}/32", c.nodes[i].ip));
    let daemons = &c.daemons;
    c.cp.wait(&format!("{lost} to be in sync and its fence lifted"), LONG, |cp| {
        let fenced = NODES.iter().zip(daemons).any(|(n, d)| *n != lost && d.ok(&["fence", "list"]).contains(&block));
        let annotated = cp.get(&["node", lost])["metadata"]["annotations"]["failover.ferrite.dev/fenced"].is_string();
        !fenced && !annotated && ours(cp, lost).is_empty()
    });
    let (_, primary, _) = primary_of(c, vol);
    let s = c.daemon(primary).json(&["replica", "status", vol]);
    let ip = &c.nodes[i].ip;
    let m = s["members"].as_array().unwrap().iter().find(|m| m["endpoint"].as_str().unwrap().contains(ip.as_str()));
    assert_eq!(m.unwrap()["state"], "in-sync", "{s}");
    assert_eq!(c.daemons[i].json(&["replica", "status", vol])["role"], "replica");
    let said = events(&c.cp, pv, "Rejoined");
    assert!(said.iter().any(|n| n.contains(&format!("node {lost} came back"))), "{said:?}");
}

/// (a) The node holding the primary is lost (its daemon killed, its Node not Ready): the
/// controller fences it and promotes another copy, which holds every acknowledged write; the
/// volume publishes elsewhere; the node comes back fenced, is rebuilt, and is an in-sync
/// replica before its fence is lifted.
pub fn node_lost(c: &mut Cluster, vol: &str, pv: &str) {
    println!("== failover (a): the primary's node is lost");
    let (i, lost, generation) = primary_of(c, vol);
    for n in NODES {
        set_ready(c, n, true);
    }
    let content: Vec<u8> = pattern(2 << 20).into_iter().rev().collect();
    acknowledged(&c.daemons[i], vol, &content);
    place_pods(c, pv, lost, "app-a");
    let fault = Instant::now();
    c.daemon_pods[i].kill(&mut c.cp); // kill -9 of every container of the pod
    set_ready(c, lost, false);
    let to = promoted(c, vol, lost, generation);
    println!("   promoted on {to} {:?} after the fault (--failover-after={FAILOVER_AFTER:?})", fault.elapsed());
    check_fenced(c, i);
    check_pods_moved(c, "app-a");
    assert!(super::common::nbd::read_image(c.daemon(&to), vol, content.len() as u64) == content, "lost writes");
    let claim = c.cp.get(&["pv", pv])["spec"]["claimRef"]["name"].as_str().unwrap().to_owned();
    for object in [pv, &claim] {
        let said = events(&c.cp, object, "FailedOver");
        let why = format!("node {lost} was lost (not Ready for");
        assert!(said.iter().any(|n| n.contains(&why) && n.contains(&to)), "{object}: {said:?}");
    }
    // The other survivor: publishing there makes its in-sync copy the primary (locality).
    let other = NODES.iter().find(|n| **n != lost && **n != to).unwrap();
    workload_back(c, vol, pv, other, fault, "failover-a");
    assert!(super::common::nbd::read_image(c.daemon(other), vol, content.len() as u64) == content, "lost writes");

    println!("== failover (a): {lost} comes back, is rebuilt, then unfenced");
    let old = c.daemon_pods[i].name().to_owned();
    c.cp.ok(&["delete", "pod", &old, "-n", NS, "--wait=false"]);
    c.daemon_pods[i] = c.start_daemon_pod(i);
    set_ready(c, lost, true);
    rejoined(c, vol, pv, i);
}

/// (d) While node `lost`'s daemon is down, the controller's calls that ask every node answer
/// without it, and Probe from local state: each is timed (the livenessprobe gives Probe 1 s);
/// the controller process is still the same one afterwards.
fn controller_answers(c: &mut Cluster, lost: &str) {
    use ferrite_proto::csi::v1 as csi;
    use ferrite_proto::csi::v1::controller_client::ControllerClient;
    use ferrite_proto::csi::v1::identity_client::IdentityClient;
    let ctl = c.controller.as_ref().unwrap();
    let sock = std::path::PathBuf::from(ctl.rewrite(ctl.container("ferrite"), "/csi/csi.sock"));
    let process = ctl.process("ferrite");
    let pid = c.cp.pid(&process);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let bound = std::time::Duration::from_secs(10);
    let times = rt.block_on(async {
        let ch = super::common::csi::channel(&sock).await;
        let (mut id, mut ctl) = (IdentityClient::new(ch.clone()), ControllerClient::new(ch));
        let timed = async |what: &str, f: std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + '_>>| {
            let t = Instant::now();
            let r = tokio::time::timeout(bound, f).await.unwrap_or_else(|_| panic!("{what} hung with {lost} down"));
            r.unwrap_or_else(|e| panic!("{what} with {lost} down: {e}"));
            format!("{what} {:?}", t.elapsed())
        };
        let mut out = vec![timed("Probe", Box::pin(async { id.probe(csi::ProbeRequest {}).await.map(drop) })).await];
        let listed = timed(
            "ListVolumes",
            Box::pin(async {
                let r = ctl.list_volumes(csi::ListVolumesRequest::default()).await?;
                let unread = r.metadata().get("ferrite-unread-nodes").map(|v| v.to_str().unwrap().to_owned());
                assert!(unread.is_some_and(|u| u.contains(lost)), "ListVolumes says which node it could not read");
                Ok(())
            }),
        );
        out.push(listed.await);
        let capacity = Box::pin(async { ctl.get_capacity(csi::GetCapacityRequest::default()).await.map(drop) });
        out.push(timed("GetCapacity", capacity).await);
        let create = Box::pin(async {
            let v = ctl.create_volume(super::common::csi::create("while-lost", 1 << 20, None)).await?;
            let volume_id = v.into_inner().volume.unwrap().volume_id;
            ctl.delete_volume(csi::DeleteVolumeRequest { volume_id, ..Default::default() }).await.map(drop)
        });
        out.push(timed("CreateVolume+DeleteVolume", create).await);
        out
    });
    println!("   with {lost}'s daemon down, the controller answered: {}", times.join(", "));
    c.cp.check_alive();
    assert_eq!(c.cp.pid(&process), pid, "the controller was not restarted");
}

/// (c) The primary's daemon dies while its Node stays Ready (the kubelet is fine): its heartbeat
/// stops renewing the node's Lease, which expires; failover then handles the node as lost. The
/// kubelet restarts the daemon container; the node is rebuilt and rejoins.
pub fn daemon_silent(c: &mut Cluster, vol: &str, pv: &str) {
    println!("== failover (c): the primary's daemon dies, its Node stays Ready");
    let (i, lost, generation) = primary_of(c, vol);
    let lease = c.cp.get(&["lease", &format!("ferrite-node-{lost}"), "-n", "ferrite-node-lease"]);
    assert_eq!(lease["spec"]["holderIdentity"], lost, "the heartbeat renews the node's Lease: {lease}");
    let content = pattern(1 << 20);
    acknowledged(&c.daemons[i], vol, &content);
    place_pods(c, pv, lost, "app-c");
    attach(c, pv, lost, "app-c");
    let fault = Instant::now();
    c.cp.kill(&c.daemon_pods[i].process("daemon"));
    let to = promoted(c, vol, lost, generation);
    println!("   promoted on {to} {:?} after the fault (heartbeat lease 10 s)", fault.elapsed());
    let node = c.cp.get(&["node", lost]);
    let ready = node["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap().clone();
    assert_eq!(ready["status"], "True", "the Node stayed Ready: only the Lease said the daemon was gone");
    check_fenced(c, i);
    controller_answers(c, lost);
    check_pods_moved(c, "app-c");
    // The pod is gone and the node out of service: the attach-detach controller detaches at once.
    c.cp.ok(&["delete", "volumeattachment", "app-c", "--wait=true", "--timeout=60s"]);
    assert!(super::common::nbd::read_image(c.daemon(&to), vol, content.len() as u64) == content, "lost writes");
    let said = events(&c.cp, pv, "FailedOver");
    assert!(said.iter().any(|n| n.contains("storage heartbeat silent") && n.contains(&to)), "{said:?}");
    workload_back(c, vol, pv, &to, fault, "failover-c");

    println!("== failover (c): the kubelet restarts the daemon; {lost} is rebuilt, then unfenced");
    c.daemon_pods[i].start(&mut c.cp, "daemon", std::path::Path::new(super::common::BIN), &[], &[], true);
    rejoined(c, vol, pv, i);

    println!("== failover (g): after this second failover the volume publishes to a third node");
    let publication = format!("csi-publish-{vol}");
    let exports = c.daemons[i].ok(&["export", "list"]);
    assert!(!exports.contains(&publication), "{lost} stepped down and ended its publication: {exports}");
    let third = NODES.iter().find(|n| **n != lost && **n != to).unwrap();
    attach(c, pv, third, "failover-g");
    c.cp.ok(&["delete", "volumeattachment", "failover-g", "--wait=true", "--timeout=60s"]);
}

/// (f) The primary's node is cordoned (maintenance): the controller hands the primary over to an
/// in-sync copy elsewhere without a fence or a taint; every acknowledged write is there, and the
/// old primary is an in-sync replica of the new one.
pub fn cordoned(c: &mut Cluster, vol: &str, pv: &str) {
    println!("== maintenance (f): the primary's node is cordoned");
    let (i, node, generation) = primary_of(c, vol);
    let content: Vec<u8> = pattern(1 << 20).into_iter().map(|b| b ^ 0x5a).collect();
    acknowledged(&c.daemons[i], vol, &content);
    let start = Instant::now();
    c.cp.ok(&["cordon", node]);
    let to = promoted(c, vol, node, generation);
    println!("   handed over to {to} {:?} after the cordon", start.elapsed());
    let block = format!("{}/32", c.nodes[i].ip);
    for d in &c.daemons {
        assert!(!d.ok(&["fence", "list"]).contains(&block), "a planned handover fences nothing");
    }
    assert!(ours(&c.cp, node).is_empty(), "a planned handover taints nothing");
    assert!(super::common::nbd::read_image(c.daemon(&to), vol, content.len() as u64) == content, "lost writes");
    let said = events(&c.cp, pv, "HandedOver");
    assert!(said.iter().any(|n| n.contains(&format!("node {node} is cordoned")) && n.contains(&to)), "{said:?}");
    let (d, ip) = (&c.daemons[i], c.nodes[i].ip.clone());
    let primary = &c.daemons[NODES.iter().position(|n| *n == to).unwrap()];
    c.cp.wait(&format!("{node} to be an in-sync replica of {to}"), LONG, |_| {
        let s = primary.json(&["replica", "status", vol]);
        let m = s["members"].as_array().unwrap().iter().find(|m| m["endpoint"].as_str().unwrap().contains(ip.as_str()));
        d.json(&["replica", "status", vol])["role"] == "replica" && m.is_some_and(|m| m["state"] == "in-sync")
    });
    c.cp.ok(&["uncordon", node]);
}
