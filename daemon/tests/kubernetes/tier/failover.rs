//! The tier's node-loss and maintenance scenarios for a three-copy volume: (a) the primary's
//! node lost (its daemon killed, its Node not Ready); (c) its daemon stalled while the Node stays
//! Ready (only the storage heartbeat's Lease tells; a single-copy pod there stays), with (d) the controller's calls timed
//! meanwhile and (g) a publication to a third node after this second failover; (b) its node
//! cut off the network with its daemon alive; (f) the primary's node cordoned, and a drain that
//! would take a second copy refused; (e) with a second controller of a rollout beside the first,
//! one failover loop at a time and a takeover when the holder hangs. The failovers check that every acknowledged write is on the promoted
//! copy, that the node is tainted and its pod using the volume deleted (one using none stays),
//! that the volume attaches and takes a write on the new primary (timed from the fault), and
//! that the node comes back rebuilt before its fence and taints are lifted.

use std::io::Write as _;
use std::time::{Duration, Instant};

use serde_json::json;

use super::common::Daemon;
use super::common::kubelet::Pod;
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
pub fn acknowledged(d: &Daemon, vol: &str, content: &[u8]) {
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

/// The lost node `i` is fenced everywhere else and annotated. A node that is not Ready is
/// tainted fenced (NoSchedule) and, with `--out-of-service-taint=true`, out-of-service (its pods
/// are deleted, their volumes detached at once); a Ready one (`taints` None) gets no taint.
fn check_fenced(c: &mut Cluster, i: usize, taints: Option<bool>) {
    let lost = NODES[i];
    let block = format!("{}/32", c.nodes[i].ip);
    for (n, d) in NODES.iter().zip(&c.daemons).filter(|(n, _)| **n != lost) {
        assert!(d.ok(&["fence", "list"]).contains(&block), "{n} does not fence {lost}");
    }
    let node = c.cp.get(&["node", lost]);
    assert_eq!(node["metadata"]["annotations"]["failover.ferrite.dev/fenced"], block.as_str(), "{}", node["metadata"]);
    let Some(out_of_service) = taints else {
        assert_eq!(ours(&c.cp, lost), Vec::<String>::new(), "failover taints no Ready node");
        return;
    };
    let want = if out_of_service { 2 } else { 1 };
    c.cp.wait(&format!("{lost} tainted"), LONG, |cp| ours(cp, lost).len() == want);
    let taints = ours(&c.cp, lost);
    assert!(taints.iter().any(|t| t.contains("failover.ferrite.dev/fenced") && t.contains("NoSchedule")), "{taints:?}");
    let oos = taints.iter().any(|t| t.contains("node.kubernetes.io/out-of-service") && t.contains("NoExecute"));
    assert_eq!(oos, out_of_service, "{taints:?}");
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
/// can restart where the volume is; the one that used none stays. On a node that is not Ready at
/// once; on a Ready one (`graceful`) with its grace period, which its kubelet (here the test)
/// then ends.
fn check_pods_moved(c: &mut Cluster, app: &str, graceful: bool) {
    if graceful {
        let p = c.wait_field(&format!("pod {app} deleted with its grace"), &["pod", app, "-n", "default"], |p| {
            p["metadata"]["deletionTimestamp"].is_string()
        });
        assert!(p["metadata"]["deletionGracePeriodSeconds"].as_u64().is_some_and(|g| g > 0), "{}", p["metadata"]);
        c.cp.ok(&["delete", "pod", app, "-n", "default", "--grace-period=0", "--force"]);
    }
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

/// A pod on node `node` (named `name`) using the claim of a single-copy volume served there.
fn single_copy_pod(c: &Cluster, node: &str, name: &str) -> String {
    let pvs = c.cp.get(&["pv"]);
    let claim = pvs["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|pv| {
            pv["spec"]["csi"]["volumeHandle"].as_str().is_some_and(|h| h.starts_with(&format!("{node}/")))
                && pv["spec"]["claimRef"]["namespace"] == "default"
        })
        .map(|pv| pv["spec"]["claimRef"]["name"].as_str().unwrap().to_owned())
        .unwrap_or_else(|| panic!("no single-copy claim on {node}"));
    c.cp.apply(
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app.invalid/app:1"}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}})
        .to_string(),
    );
    name.to_owned()
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

/// Waits until `node`'s copy of `vol` is an in-sync member as the primary sees it.
pub fn in_sync(c: &mut Cluster, vol: &str, node: &str) {
    let ip = c.nodes[c.nodes.iter().position(|n| n.name == node).unwrap()].ip.clone();
    let names: Vec<&str> = c.daemon_pods.iter().map(|p| p.node.name.as_str()).collect();
    let at = serving(c, vol, &names).expect("a primary");
    let primary = &c.daemons[c.daemon_index(&at)];
    c.cp.wait(&format!("{node}'s copy of {vol} in sync"), LONG, |_| {
        let s = primary.json(&["replica", "status", vol]);
        s["members"].as_array().is_some_and(|ms| {
            ms.iter()
                .any(|m| m["endpoint"].as_str().is_some_and(|e| e.contains(ip.as_str())) && m["state"] == "in-sync")
        })
    });
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
    controller_metrics(c, fault.elapsed().as_secs_f64());
    check_fenced(c, i, Some(true));
    check_pods_moved(c, "app-a", false);
    assert!(super::common::nbd::read_image(c.daemon(&to), vol, content.len() as u64) == content, "lost writes");
    let claim = c.cp.get(&["pv", pv])["spec"]["claimRef"]["name"].as_str().unwrap().to_owned();
    for object in [pv, &claim] {
        let said = events(&c.cp, object, "FailedOver");
        let why = format!("node {lost} was lost (not Ready for");
        assert!(said.iter().any(|n| n.contains(&why) && n.contains(&to)), "{object}: {said:?}");
    }
    // The other survivor: publishing there makes its in-sync copy the primary (locality), once
    // it is in sync with the new primary (it may still be catching up after the promotion).
    let other = NODES.iter().find(|n| **n != lost && **n != to).unwrap();
    in_sync(c, vol, other);
    workload_back(c, vol, pv, other, fault, "failover-a");
    assert!(super::common::nbd::read_image(c.daemon(other), vol, content.len() as u64) == content, "lost writes");

    println!("== failover (a): {lost} comes back, is rebuilt, then unfenced");
    let old = c.daemon_pods[i].name().to_owned();
    c.cp.ok(&["delete", "pod", &old, "-n", NS, "--wait=false"]);
    c.daemon_pods[i] = c.start_daemon_pod(i);
    set_ready(c, lost, true);
    rejoined(c, vol, pv, i);
}

/// The controller's /metrics on its webhook port (HTTPS, its certificate names its Service):
/// it leads, it promoted, and the time from the loss to that promotion is within `since_fault`
/// plus the time the node was silent before (its Ready condition's flip).
fn controller_metrics(c: &Cluster, since_fault: f64) {
    let ca = c.pki.join("ca.pem");
    let reply = super::common::scrape_tls_as("127.0.0.1:9443", "ferrite-controller.ferrite.svc", &ca, None).unwrap();
    let body = reply.split_once("\r\n\r\n").map_or(reply.as_str(), |(_, b)| b);
    let value = |series: &str| -> f64 {
        let v = body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' '));
        v.unwrap_or_else(|| panic!("{series} not in the controller's metrics:\n{body}")).parse().unwrap()
    };
    assert_eq!(value("ferrite_failover_leader"), 1.0);
    assert!(value("ferrite_failover_promotions_total{outcome=\"promoted\"}") >= 1.0, "{body}");
    let (n, sum) = (value("ferrite_failover_recovery_seconds_count"), value("ferrite_failover_recovery_seconds_sum"));
    println!("   controller metrics: {n} promotion(s), {:.1} s from the loss on average", sum / n);
    assert!(n >= 1.0 && sum / n <= since_fault + 5.0, "{body}");
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

/// (c) The primary's daemon stalls (SIGSTOP) while its Node stays Ready (the kubelet is fine):
/// its heartbeat stops renewing the node's Lease, which expires; failover then handles the node
/// as lost, but a Ready node's kubelet is alive: only the pod whose volume moved is deleted (with
/// its grace), and a pod of a single-copy volume there stays. After 20 s the kubelet's liveness
/// probe kills the hung daemon and restarts it; the node is rebuilt and rejoins.
pub fn daemon_silent(c: &mut Cluster, vol: &str, pv: &str) {
    println!("== failover (c): the primary's daemon stalls (SIGSTOP), its Node stays Ready");
    let (i, lost, generation) = primary_of(c, vol);
    let lease = c.cp.get(&["lease", &format!("ferrite-node-{lost}"), "-n", "ferrite-node-lease"]);
    assert_eq!(lease["spec"]["holderIdentity"], lost, "the heartbeat renews the node's Lease: {lease}");
    let content = pattern(1 << 20);
    acknowledged(&c.daemons[i], vol, &content);
    place_pods(c, pv, lost, "app-c");
    attach(c, pv, lost, "app-c");
    let single = single_copy_pod(c, lost, "single-c");
    let fault = Instant::now();
    let process = c.daemon_pods[i].process("daemon");
    super::sh(&format!("kill -STOP {}", c.cp.pid(&process)));
    let to = promoted(c, vol, lost, generation);
    println!("   promoted on {to} {:?} after the fault (heartbeat lease 10 s)", fault.elapsed());
    let node = c.cp.get(&["node", lost]);
    let ready = node["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap().clone();
    assert_eq!(ready["status"], "True", "the Node stayed Ready: only the Lease said the daemon was gone");
    // A Ready node runs other applications: no taint; only the pods whose volumes moved go
    // (with their grace: the kubelet is alive), and our VolumeAttachment of that volume there.
    check_fenced(c, i, None);
    check_pods_moved(c, "app-c", true);
    let said = events(&c.cp, "app-c", "FailedOver");
    assert!(said.iter().any(|n| n.contains("(the node is Ready)")), "{said:?}");
    let untouched = |c: &Cluster| {
        let p = c.cp.get(&["pod", &single, "-n", "default"]);
        assert!(p["metadata"]["deletionTimestamp"].is_null(), "the single-copy pod was deleted: {p}");
        assert!(events(&c.cp, &single, "FailedOver").is_empty(), "the single-copy pod was failed over");
    };
    untouched(c);
    std::thread::sleep(Duration::from_secs(20).saturating_sub(fault.elapsed()));
    untouched(c);
    println!("   stalled {:?}: the liveness probe kills the daemon", fault.elapsed());
    c.cp.kill(&process);
    controller_answers(c, lost);
    c.cp.wait("the controller to delete the lost node's VolumeAttachment", LONG, |cp| {
        !cp.kubectl(&["get", "volumeattachment", "app-c"]).status.success()
    });
    assert_eq!(ours(&c.cp, lost), Vec::<String>::new(), "failover taints no Ready node");
    assert!(super::common::nbd::read_image(c.daemon(&to), vol, content.len() as u64) == content, "lost writes");
    let said = events(&c.cp, pv, "FailedOver");
    assert!(said.iter().any(|n| n.contains("storage heartbeat silent") && n.contains(&to)), "{said:?}");
    workload_back(c, vol, pv, &to, fault, "failover-c");

    println!("== failover (c): the kubelet restarts the daemon; {lost} is rebuilt, then unfenced");
    c.daemon_pods[i].start(&mut c.cp, "daemon", &c.node_bin.clone(), &[], &[], true);
    rejoined(c, vol, pv, i);
    untouched(c);
    c.cp.ok(&["delete", "pod", &single, "-n", "default", "--grace-period=0", "--force"]);

    println!("== failover (g): after this second failover the volume publishes to a third node");
    let publication = format!("csi-publish-{vol}");
    let exports = c.daemons[i].ok(&["export", "list"]);
    assert!(!exports.contains(&publication), "{lost} stepped down and ended its publication: {exports}");
    let third = NODES.iter().find(|n| **n != lost && **n != to).unwrap();
    attach(c, pv, third, "failover-g");
    c.cp.ok(&["delete", "volumeattachment", "failover-g", "--wait=true", "--timeout=60s"]);
}

/// (b) The primary's node is cut off the network whole, its daemon alive (a partition): the
/// isolated primary acknowledges no write after the cut and serves no read once it has been
/// without a majority for the ejection timeout, which is before the other side promotes a copy
/// (the node's Lease has to expire first); the rest goes as in (a). The Node stays Ready until
/// the node-monitor grace would end, here after the promotion.
pub fn partitioned(c: &mut Cluster, vol: &str, pv: &str) -> &'static str {
    use super::common::nbd::{reply, request, write_on};
    use super::common::netns::Nics;
    println!("== failover (b): the primary's node is cut off the network, its daemon alive");
    let (i, lost, generation) = primary_of(c, vol);
    let content: Vec<u8> = pattern(1 << 20).into_iter().map(|b| b.rotate_left(3)).collect();
    acknowledged(&c.daemons[i], vol, &content);
    place_pods(c, pv, lost, "app-b");
    attach(c, pv, lost, "app-b");
    // The workload's connection on the isolated side, made before the cut.
    let mut isolated = super::common::nbd::open(&c.daemons[i], vol);
    let fault = Instant::now();
    c.sw.link(i, false);
    assert_ne!(write_on(&mut isolated, 0, &[0xee; 4096]), 0, "a write acknowledged on the isolated side");
    let writes_refused = fault.elapsed();
    let reads_refused = loop {
        isolated.write_all(&request(0, 0, 9, 0, 4096, &[])).unwrap();
        if reply(&mut isolated, 4096).0 != 0 {
            break fault.elapsed();
        }
        assert!(fault.elapsed() < LONG, "the isolated primary still serves reads");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let to = promoted(c, vol, lost, generation);
    let promoted_at = fault.elapsed();
    println!(
        "   isolated side: writes refused {writes_refused:?}, reads {reads_refused:?} after the cut; \
         promoted on {to} {promoted_at:?} after it"
    );
    assert!(reads_refused < promoted_at, "the isolated side served reads after a copy was promoted");
    assert_ne!(write_on(&mut isolated, 0, &[0xee; 4096]), 0, "a write acknowledged on the isolated side");
    drop(isolated);
    set_ready(c, lost, false);
    // The controller that failed it over runs with --out-of-service-taint=false: it deletes the
    // node's VolumeAttachment itself (the attacher unpublishes; the isolated copy is skipped).
    check_fenced(c, i, Some(false));
    check_pods_moved(c, "app-b", false);
    c.cp.wait("the controller to delete the lost node's VolumeAttachment", LONG, |cp| {
        !cp.kubectl(&["get", "volumeattachment", "app-b"]).status.success()
    });
    assert!(super::common::nbd::read_image(c.daemon(&to), vol, content.len() as u64) == content, "lost writes");
    let said = events(&c.cp, pv, "FailedOver");
    assert!(said.iter().any(|n| n.contains("storage heartbeat silent") && n.contains(&to)), "{said:?}");
    workload_back(c, vol, pv, &to, fault, "failover-b");

    println!("== failover (b): the partition heals; {lost} steps down, is rebuilt, then unfenced");
    c.sw.link(i, true);
    set_ready(c, lost, true);
    // The CSI-Addons sidecar there exits three minutes after it lost the API server (by
    // design: its kubelet restarts it); the kubelet here restarts it now.
    c.restart_sidecar(i, "csi-addons");
    c.daemons[i].ok(&["export", "stop", vol]);
    rejoined(c, vol, pv, i);
    lost
}

/// The holder of the failover Lease.
fn leader(cp: &ControlPlane) -> String {
    let lease = cp.get(&["lease", "ferrite-failover", "-n", NS]);
    lease["spec"]["holderIdentity"].as_str().unwrap_or_default().to_owned()
}

/// (e) A rollout begins: a second controller pod (a new ReplicaSet's) runs beside the first,
/// its `ferrite` container only (the sidecars leader-elect on their own); its webhook on a port
/// of its own, since the tier's pods share the host's network. The first keeps the Lease.
pub fn rollout_begins(c: &mut Cluster) -> Pod {
    println!("== (e) a rollout: a second controller runs beside the first");
    let dep = c.cp.get(&["deployment", "ferrite-controller", "-n", NS]);
    let mut tpl = dep["spec"]["template"].clone();
    let containers = tpl["spec"]["containers"].as_array_mut().unwrap();
    let ferrite = containers.iter_mut().find(|c| c["name"] == "ferrite").unwrap();
    let args = ferrite["args"].as_array_mut().unwrap();
    for a in args.iter_mut() {
        if a.as_str().is_some_and(|a| a.starts_with("--webhook-listen=")) {
            *a = json!("--webhook-listen=127.0.0.1:0");
        }
    }
    // The rollout also turns the out-of-service taint off again (the failover of (b) is this one's).
    args.retain(|a| !a.as_str().is_some_and(|a| a.starts_with("--out-of-service-taint")));
    args.push(json!("--out-of-service-taint=false"));
    let rs = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "ferrite-controller-2", "namespace": NS, "labels": tpl["metadata"]["labels"],
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "ferrite-controller",
                "uid": dep["metadata"]["uid"], "controller": true}]},
        "spec": {"replicas": 1, "selector": dep["spec"]["selector"], "template": tpl}});
    c.cp.apply(&rs.to_string());
    let rs = c.cp.get(&["replicaset", "ferrite-controller-2", "-n", NS]);
    let owner = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "ferrite-controller-2",
        "uid": rs["metadata"]["uid"], "controller": true});
    let pod = Pod::run(&c.cp, NS, "ferrite-controller-2-y", &tpl, &c.nodes[1], Some(owner), &c.sw.gateway);
    let kc = c.cp.token_kubeconfig(NS, "ferrite-controller", "ferrite-2.kubeconfig");
    std::os::unix::fs::chown(&kc, Some(0), Some(65532)).unwrap();
    std::fs::set_permissions(&kc, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    let env = [("KUBECONFIG".to_owned(), kc.display().to_string())];
    pod.start(&mut c.cp, "ferrite", &c.controller_bin.clone(), &[], &env, false);
    c.cp.wait("the second controller's failover loop", LONG, |_| pod.log("ferrite").contains("automatic failover"));
    assert_eq!(leader(&c.cp), c.controller.as_ref().unwrap().name(), "the first controller keeps the Lease");
    pod
}

/// (e) The Lease holder hangs (SIGSTOP): the second controller takes the Lease (timed) and runs
/// the loop from then on; the first, resumed, stands by. Returns how much of the first's log
/// was written before.
pub fn takeover(c: &mut Cluster, second: &Pod) -> usize {
    println!("== (e) the Lease holder hangs; the second controller takes over");
    let first = c.controller.as_ref().unwrap();
    let pid = c.cp.pid(&first.process("ferrite")).to_string();
    let signal = |s: &str| assert!(std::process::Command::new("kill").args([s, &pid]).status().unwrap().success());
    signal("-STOP");
    let start = Instant::now();
    c.cp.wait("the second controller to take the failover Lease", LONG, |cp| leader(cp) == second.name());
    println!("   took over {:?} after the holder stopped", start.elapsed());
    signal("-CONT");
    first.log("ferrite").len()
}

/// (e) With two controllers, only the Lease holder (the second, since the takeover) acted on the
/// lost node of (b): the first, resumed, wrote nothing of it after `since`; the rejoined node
/// stays unfenced.
pub fn one_loop_at_a_time(c: &Cluster, second: &Pod, rejoined: &str, since: usize) {
    let first = c.controller.as_ref().unwrap().log("ferrite");
    assert!(second.log("ferrite").contains("fencing it"), "the holder failed the node over");
    assert!(!first[since..].contains("fencing it"), "the standby fenced too: {}", &first[since..]);
    std::thread::sleep(std::time::Duration::from_secs(7));
    let n = c.cp.get(&["node", rejoined]);
    assert!(n["metadata"]["annotations"]["failover.ferrite.dev/fenced"].is_null(), "{rejoined} re-fenced");
}

/// (f) The primary's node is cordoned (maintenance): the controller hands the primary over to an
/// in-sync copy elsewhere without a fence or a taint; every acknowledged write is there, and the
/// old primary is an in-sync replica of the new one.
pub fn cordoned(c: &mut Cluster, vol: &str, pv: &str, second: Option<&Pod>) {
    println!("== maintenance (f): the primary's node is cordoned");
    let (i, node, generation) = primary_of(c, vol);
    let content: Vec<u8> = pattern(1 << 20).into_iter().map(|b| b ^ 0x5a).collect();
    acknowledged(&c.daemons[i], vol, &content);
    let start = Instant::now();
    c.cp.ok(&["cordon", node]);
    let to = promoted(c, vol, node, generation);
    println!("   handed over to {to} {:?} after the cordon", start.elapsed());
    if let Some(second) = second {
        assert!(second.log("ferrite").contains("handed the primary over"), "the new holder runs the loop");
    }
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

    println!("== maintenance (f): a drain that would take a second copy is refused, naming the volume");
    let start = Instant::now();
    let o = c.cp.kubectl(&["drain", &to, "--ignore-daemonsets", "--timeout=30s"]);
    let said = String::from_utf8_lossy(&o.stderr);
    println!("   refused in {:?}", start.elapsed());
    assert!(!o.status.success(), "draining {to} with {node} cordoned leaves one copy of three: {said}");
    assert!(
        said.contains("ferrite drain guard") && said.contains(pv) && said.contains(&format!("{node} (cordoned)")),
        "{said}"
    );
    let cordoned = |n: &str| c.cp.get(&["node", n])["spec"]["unschedulable"] == true;
    assert!(!cordoned(&to), "the refused drain left {to} schedulable");
    c.cp.ok(&["uncordon", node]);
    // With the first node back, the same cordon is allowed (a server-side dry run asks the guard
    // and changes nothing).
    c.cp.ok(&["cordon", &to, "--dry-run=server"]);
    assert!(!cordoned(&to));
}

/// (h) The Node of the primary's node is deleted (its daemon gone with it; the primary is first
/// moved to `node-c`, which holds no other volume the tier deletes later): the controller finds
/// the copies whose primary no Node has, fences that address and promotes one; the PV's id,
/// which names no node, still expands, snapshots, modifies and publishes. Returns the node.
pub fn node_deleted(c: &mut Cluster, vol: &str, pv: &str) -> &'static str {
    println!("== (h) the primary's Node is deleted");
    let lost = "node-c";
    let i = NODES.iter().position(|n| *n == lost).unwrap();
    let ip = c.nodes[i].ip.clone();
    let primary = primary_of(c, vol).1;
    let (d, p) = (&c.daemons[i], &c.daemons[NODES.iter().position(|n| *n == primary).unwrap()]);
    c.cp.wait(&format!("{lost}'s copy in sync"), LONG, |_| {
        let s = p.json(&["replica", "status", vol]);
        let m = s["members"].as_array().unwrap().iter().find(|m| m["endpoint"].as_str().unwrap().contains(ip.as_str()));
        primary == lost
            || (d.json(&["replica", "status", vol])["role"] == "replica" && m.is_some_and(|m| m["state"] == "in-sync"))
    });
    if primary != lost {
        attach(c, pv, lost, "to-node-c");
        c.cp.ok(&["delete", "volumeattachment", "to-node-c", "--wait=true", "--timeout=60s"]);
    }
    // The others are rebuilt by the new primary: until they are in sync, losing it would lose
    // acknowledged writes, and nothing may be promoted.
    let d = &c.daemons[i];
    c.cp.wait(&format!("every copy in sync with {lost}"), LONG, |_| {
        let s = d.json(&["replica", "status", vol]);
        s["members"].as_array().unwrap().iter().all(|m| m["state"] == "primary" || m["state"] == "in-sync")
    });
    let (_, _, generation) = primary_of(c, vol);
    let content: Vec<u8> = pattern(1 << 20).into_iter().map(|b| b ^ 0x33).collect();
    acknowledged(&c.daemons[i], vol, &content);
    let fault = Instant::now();
    c.daemon_pods[i].kill(&mut c.cp);
    c.cp.ok(&["delete", "node", lost, "--wait=true", "--timeout=60s"]);
    let to = promoted(c, vol, lost, generation);
    println!("   promoted on {to} {:?} after the Node's deletion", fault.elapsed());
    assert!(super::common::nbd::read_image(c.daemon(&to), vol, content.len() as u64) == content, "lost writes");
    let said = events(&c.cp, pv, "FailedOver");
    assert!(said.iter().any(|n| n.contains("is gone") && n.contains(&to)), "{said:?}");
    let block = format!("{ip}/32");
    for (n, d) in NODES.iter().zip(&c.daemons).filter(|(n, _)| **n != lost) {
        assert!(d.ok(&["fence", "list"]).contains(&block), "{n} fences the deleted node's address");
    }

    println!("== (h) the volume whose first node is gone expands, snapshots, modifies and publishes");
    let claim = c.cp.get(&["pv", pv])["spec"]["claimRef"]["name"].as_str().unwrap().to_owned();
    c.cp.merge_patch("pvc", &claim, r#"{"spec":{"resources":{"requests":{"storage":"48Mi"}}}}"#);
    c.wait_field("the PV to grow", &["pv", pv], |v| v["spec"]["capacity"]["storage"] == "48Mi");
    c.cp.apply(
        &json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "after-h", "namespace": "default"},
            "spec": {"volumeSnapshotClassName": "ferrite", "source": {"persistentVolumeClaimName": claim}}})
        .to_string(),
    );
    c.wait_field("the snapshot to be ready", &["volumesnapshot", "after-h"], |v| v["status"]["readyToUse"] == true);
    c.cp.merge_patch("pvc", &claim, r#"{"spec":{"volumeAttributesClassName":"ferrite-gold"}}"#);
    let p = &c.daemons[NODES.iter().position(|n| *n == to).unwrap()];
    c.cp.wait("the new primary to hold the class's limits", LONG, |_| {
        p.json(&["volume", "show", vol])["limits"]["iops"] == 5000
    });
    assert_eq!(p.json(&["volume", "show", vol])["size"], 48 << 20);
    let other = NODES.iter().find(|n| **n != lost && **n != to).unwrap();
    workload_back(c, vol, pv, other, fault, "after-h");
    lost
}

/// (i) A node joins after `lost`'s Node was deleted: the copy `lost` held, gone past the class's
/// `replace-after`, is replaced on `new` (added, rebuilt, then the lost member removed), and the
/// PV's node affinity follows the copies while its claim stays bound.
pub fn copy_replaced(c: &mut Cluster, vol: &str, pv: &str, lost: &str, new: &str) {
    println!("== (i) {new} joins; the copy {lost} held is replaced there");
    let ip = |c: &Cluster, n: &str| c.nodes.iter().find(|x| x.name == n).unwrap().ip.clone();
    let (lost_ip, new_ip) = (format!("tcp://{}:", ip(c, lost)), format!("tcp://{}:", ip(c, new)));
    let start = Instant::now();
    let survivors: Vec<&str> = ["node-a", "node-b", new].into_iter().filter(|n| *n != lost).collect();
    let mut members = json!(null);
    let at: Vec<usize> = survivors.iter().map(|n| c.nodes.iter().position(|x| x.name == *n).unwrap()).collect();
    let daemons: Vec<&Daemon> = at.iter().map(|i| &c.daemons[*i]).collect();
    c.cp.wait(&format!("a copy on {new} in sync, and {lost}'s member removed"), LONG, |_| {
        let Some(p) = daemons.iter().map(|d| d.json(&["replica", "status", vol])).find(|s| s["role"] == "primary")
        else {
            return false;
        };
        members = p["members"].clone();
        let m = members.as_array().unwrap();
        let at = |ip: &str, m: &serde_json::Value| m["endpoint"].as_str().unwrap().starts_with(ip);
        m.len() == 3
            && m.iter().any(|m| at(&new_ip, m) && m["state"] == "in-sync")
            && !m.iter().any(|m| at(&lost_ip, m))
    });
    println!("   replaced {:?} after {new} joined: {members}", start.elapsed());
    assert!(super::volumes(c.daemon(new)).contains(&vol.to_owned()), "{new} holds no copy of {vol}");
    let terms =
        |c: &mut Cluster| c.cp.get(&["pv", pv])["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"].to_string();
    // Where the affinity is immutable the PV is re-created: absent for a moment in between.
    c.cp.wait("the PV's affinity to name the copies", LONG, |cp| {
        let out = cp.kubectl(&["get", "pv", pv, "-o", "json"]);
        let Ok(p) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else { return false };
        let t = p["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"].to_string();
        survivors.iter().all(|n| t.contains(&format!("\"{n}\""))) && !t.contains(&format!("\"{lost}\""))
    });
    println!("   the PV's affinity: {}", terms(c));
    let p = c.cp.get(&["pv", pv]);
    assert_eq!(p["spec"]["persistentVolumeReclaimPolicy"], "Delete", "{p}");
    let claim = p["spec"]["claimRef"]["name"].as_str().unwrap().to_owned();
    c.cp.wait("the claim to stay bound to its PV", LONG, |cp| {
        let v = cp.get(&["pvc", &claim]);
        v["status"]["phase"] == "Bound" && v["spec"]["volumeName"] == pv
    });
    c.cp.wait("the PV to be bound again", LONG, |cp| cp.get(&["pv", pv])["status"]["phase"] == "Bound");
    let said = events(&c.cp, pv, "CopyReplaced");
    assert!(said.iter().any(|n| n.contains(new)), "{said:?}");
}

/// (j) The deleted node's machine registers again under its name, with the copy it held: the
/// Node is adopted as fenced (failover fenced its address), the copy that was replaced while
/// it was away is told so by the primary and deleted, and with no membership left to rebuild,
/// the fence, annotation and taints are lifted.
pub fn deleted_node_returns(c: &mut Cluster, vol: &str, pv: &str, lost: &str) {
    println!("== (j) {lost} registers again with the copy that was replaced");
    let i = NODES.iter().position(|n| *n == lost).unwrap();
    let block = format!("{}/32", c.nodes[i].ip);
    let start = Instant::now();
    c.register(i);
    set_ready(c, lost, true);
    c.daemon_pods[i] = c.start_daemon_pod(i);
    c.listed();
    let daemons = &c.daemons;
    c.cp.wait(&format!("{lost}'s replaced copy deleted and its fence lifted"), LONG, |cp| {
        let fenced = daemons.iter().enumerate().any(|(j, d)| j != i && d.ok(&["fence", "list"]).contains(&block));
        let annotated = cp.get(&["node", lost])["metadata"]["annotations"]["failover.ferrite.dev/fenced"].is_string();
        !fenced && !annotated && ours(cp, lost).is_empty() && !super::volumes(&daemons[i]).contains(&vol.to_owned())
    });
    println!("   {:?} after it registered", start.elapsed());
    let said = events(&c.cp, pv, "CopyReplaced");
    assert!(said.iter().any(|n| n.contains(&format!("copy on {lost} had been replaced"))), "{said:?}");
}

/// (k) The controller killed in the middle of a PV move (`pv_move.rs`), at each step: the move
/// recorded (a ConfigMap in the controller's namespace) with the old PV still there, then with
/// the old PV deleted (the claim Lost). The leader finishes both from the record: a PV of the
/// same name, a new uid, its own reclaim policy, the claim Bound, the record removed.
pub fn pv_move_resumed(c: &mut Cluster, pv: &str) {
    println!("== (k) a PV move interrupted after each step is finished by the leader");
    for deleted in [false, true] {
        let old = c.cp.get(&["pv", pv]);
        let old_uid = old["metadata"]["uid"].as_str().unwrap().to_owned();
        let claim = old["spec"]["claimRef"]["name"].as_str().unwrap().to_owned();
        // The PV to create, as the controller records it.
        let mut again = json!({"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": pv, "labels": old["metadata"]["labels"], "annotations": old["metadata"]["annotations"],
                "finalizers": old["metadata"]["finalizers"]},
            "spec": old["spec"]});
        again["spec"]["claimRef"].as_object_mut().unwrap().remove("resourceVersion");
        c.cp.merge_patch("pv", pv, r#"{"spec":{"persistentVolumeReclaimPolicy":"Retain"}}"#);
        let record = format!("ferrite-pv-move-{pv}");
        let data = json!({"old_uid": old_uid, "pv": again}).to_string();
        let start = Instant::now();
        c.cp.apply(
            &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": record, "namespace": NS, "labels": {"failover.ferrite.dev/pv-move": "true"}},
                "data": {"move.json": data}})
            .to_string(),
        );
        if deleted {
            c.cp.ok(&["delete", "pv", pv, "--wait=false"]);
            c.cp.merge_patch("pv", pv, r#"{"metadata":{"finalizers":null}}"#);
        }
        c.cp.wait("the leader to finish the move", LONG, |cp| {
            let now = cp.kubectl(&["get", "pv", pv, "-o", "jsonpath={.metadata.uid}"]);
            let uid = String::from_utf8_lossy(&now.stdout).into_owned();
            let pvc = cp.get(&["pvc", &claim]);
            !uid.is_empty()
                && uid != old_uid
                && pvc["status"]["phase"] == "Bound"
                && !cp.kubectl(&["get", "configmap", &record, "-n", NS]).status.success()
        });
        let p = c.cp.get(&["pv", pv]);
        assert_eq!(p["spec"]["persistentVolumeReclaimPolicy"], "Delete", "its own policy again: {p}");
        let step = if deleted { "after the delete (claim Lost meanwhile)" } else { "after the record" };
        println!("   killed {step}: finished {:?} later", start.elapsed());
        c.cp.wait("the PV to be bound again", LONG, |cp| cp.get(&["pv", pv])["status"]["phase"] == "Bound");
    }
}

/// (l) Maintenance: node `node` (holding a copy of `vol`, as `others` do) is cordoned and its daemon stopped for
/// longer than the class's `replace-after` (20 s here): failover fences it as any lost node, but
/// its copy is not replaced while the node is in maintenance. Back and uncordoned, it is rebuilt
/// from what changed and unfenced.
pub fn maintenance_waits(c: &mut Cluster, vol: &str, pv: &str, node: &str, others: [&str; 2]) {
    println!("== (l) {node} in maintenance past replace-after: its copy is kept");
    let i = c.nodes.iter().position(|n| n.name == node).unwrap();
    set_ready(c, node, true);
    let ip = format!("tcp://{}:", c.nodes[i].ip);
    c.cp.ok(&["cordon", node]);
    let start = Instant::now();
    c.cp.kill(&c.daemon_pods[i].process("daemon"));
    let replaced_before = events(&c.cp, pv, "CopyReplaced").len();
    c.cp.wait(&format!("{node} fenced"), LONG, |cp| {
        cp.get(&["node", node])["metadata"]["annotations"]["failover.ferrite.dev/fenced"].is_string()
    });
    // Well past replace-after (20 s) and several looks at the copies (every 15 s).
    std::thread::sleep(std::time::Duration::from_secs(50));
    let primary = others.iter().map(|n| c.daemon(n).json(&["replica", "status", vol])).find(|s| s["role"] == "primary");
    let members = primary.expect("a copy is the primary")["members"].clone();
    let kept = members.as_array().unwrap().iter().any(|m| m["endpoint"].as_str().unwrap().starts_with(&ip));
    assert!(kept, "{node}'s copy was replaced while it was in maintenance: {members}");
    assert_eq!(events(&c.cp, pv, "CopyReplaced").len(), replaced_before, "a copy was replaced");
    println!(
        "   {:?} down and cordoned: its copy kept ({} members)",
        start.elapsed(),
        members.as_array().unwrap().len()
    );
    c.daemon_pods[i].start(&mut c.cp, "daemon", &c.node_bin.clone(), &[], &[], true);
    c.cp.ok(&["uncordon", node]);
    c.cp.wait(&format!("{node} rebuilt and unfenced"), LONG, |cp| {
        !cp.get(&["node", node])["metadata"]["annotations"]["failover.ferrite.dev/fenced"].is_string()
    });
    println!("   back, rebuilt and unfenced {:?} after it went down", start.elapsed());
}

/// The node of `holders` whose daemon serves `vol` as its primary, if one answers.
pub fn serving(c: &Cluster, vol: &str, holders: &[&str]) -> Option<String> {
    holders
        .iter()
        .find(|n| {
            let out = c.daemon(n).cli(&["-o", "json", "replica", "status", vol]);
            out.status.success()
                && serde_json::from_slice::<serde_json::Value>(&out.stdout).is_ok_and(|s| s["role"] == "primary")
        })
        .map(|n| (*n).to_owned())
}

/// (m) A rolling upgrade of the daemons: the DaemonSet's template changes and each node's daemon
/// pod is replaced in turn (once the volume's other copies are in sync, as the runbook says), the
/// slowest way a planned stop goes: its heartbeat gets SIGTERM (as the kubelet sends it; it
/// renews the node's Lease for the restart grace and marks it stopping), the daemon container's
/// preStop hook runs (`ferrite replica hand-over`: the controller hands the unpublished primary
/// over to an in-sync copy elsewhere meanwhile), the daemon is killed (SIGKILL at the end of the
/// grace period), a new pod starts. `vol` takes writes while each node is down, the primary's
/// too: it moved before the stop. No node is taken for lost: no fence, no failover.
pub fn rolling_upgrade(c: &mut Cluster, vol: &str, pv: &str, holders: [&str; 3]) {
    println!("== (m) a rolling upgrade of the daemons keeps {vol} writable; its primary is handed over first");
    let failed_over = events(&c.cp, pv, "FailedOver").len();
    c.cp.ok(&["set", "env", "daemonset/ferrite-daemon", "-n", NS, "-c", "daemon", "FERRITE_UPGRADE_TEST=2"]);
    let mut handed_over = 0;
    for i in 0..c.daemon_pods.len() {
        let node = c.daemon_pods[i].node.name.clone();
        let primary = serving(c, vol, &holders).expect("a primary before the restart");
        for h in holders.iter().filter(|h| **h != primary) {
            in_sync(c, vol, h);
        }
        let fault = Instant::now();
        let old = c.daemon_pods[i].name().to_owned();
        let heartbeat = c.cp.pid(&c.daemon_pods[i].process("heartbeat")).to_string();
        assert!(std::process::Command::new("kill").args(["-TERM", &heartbeat]).status().unwrap().success());
        // The kubelet runs the daemon container's preStop hook, then sends its SIGTERM.
        let hook = c.daemon_pods[i].pre_stop("daemon", &c.node_bin, true);
        let said = String::from_utf8_lossy(&hook.stderr).trim().to_owned();
        assert!(hook.status.success(), "the preStop hook on {node}: {said}");
        println!("   {node} stopping: preStop hook done {:?} after the SIGTERM: {said:?}", fault.elapsed());
        if primary == node {
            let now = serving(c, vol, &holders).expect("a primary after the hand-over");
            assert_ne!(now, node, "{node} still holds the primary after its preStop hook: {said}");
            let notes = events(&c.cp, pv, "HandedOver");
            let why =
                format!("node {node} is restarting its daemon: handed the primary over to the in-sync copy on {now}");
            assert!(notes.iter().any(|n| n.contains(&why)), "{notes:?}");
            handed_over += 1;
        }
        let gone = || {
            !std::path::Path::new(&format!("/proc/{heartbeat}/status")).exists()
                || std::fs::read_to_string(format!("/proc/{heartbeat}/status")).is_ok_and(|s| s.contains("State:\tZ"))
        };
        for _ in 0..100 {
            if gone() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        c.daemon_pods[i].kill(&mut c.cp);
        // Gone at once (no kubelet here to finish a graceful delete): its name may come again.
        c.cp.ok(&["delete", "pod", &old, "-n", NS, "--grace-period=0", "--force"]);
        if let Some(p) = serving(c, vol, &holders).filter(|p| *p != node) {
            acknowledged(c.daemon(&p), vol, &pattern(4096));
            println!("   {node} down: a write acknowledged on {p} {:?} after the SIGTERM", fault.elapsed());
        } else {
            assert!(
                !holders.contains(&node.as_str()),
                "{node} holds a copy, and {vol} took no write while it was down"
            );
        }
        c.daemon_pods[i] = c.start_daemon_pod(i);
        let back = fault.elapsed();
        let mut now_primary = None;
        for _ in 0..600 {
            now_primary = serving(c, vol, &holders);
            if now_primary.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let now_primary = now_primary.expect("a primary after the restart");
        acknowledged(c.daemon(&now_primary), vol, &pattern(4096));
        println!(
            "   {node} restarted (new daemon ready {back:?}); a write on {now_primary} {:?} after the SIGTERM",
            fault.elapsed()
        );
    }
    assert!(handed_over > 0, "no restart of (m) was the primary's: the hand-over went untested");
    assert_eq!(events(&c.cp, pv, "FailedOver").len(), failed_over, "an upgrade failed a volume over");
    for n in &c.nodes {
        let n = c.cp.get(&["node", &n.name]);
        assert!(
            n["metadata"]["annotations"]["failover.ferrite.dev/fenced"].is_null(),
            "{} was fenced",
            n["metadata"]["name"]
        );
    }
}
