//! (z) A zone lost at once. Four storage nodes join so that three zones hold three nodes each
//! (zone-c: node-c, node-d and node-e, which has no storage). Volumes of the replicated class
//! (three copies, one per zone) have their primaries in zone-c, where their pods run. Then the
//! whole zone goes at once, as a switch or a power feed takes it: every pod there killed, the
//! nodes' cables cut (calls to them hang, as to powered-off hosts) and their Nodes not Ready.
//! The controller fails the three nodes over together; every volume gets a primary in a
//! surviving zone holding every acknowledged write, its pod on the lost node is deleted, and
//! the workload writes again from a surviving node. Prints each volume's times from the fault.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::common::netns::Nics;
use super::failover::{acknowledged, in_sync, serving};
use super::{Cluster, LONG, claim, events, pattern, set_ready};

const JOIN: [&str; 4] = ["node-f", "node-g", "node-h", "node-i"];
const LOST: [&str; 3] = ["node-c", "node-d", "node-e"];
const VOLUMES: usize = 6;

/// One volume of the scenario and what happened to it after the fault.
struct Vol {
    claim: String,
    name: String,
    pv: String,
    /// The lost node its primary and its pod were on.
    on: &'static str,
    generation: u64,
    promoted: Option<(String, Duration)>,
    written: Option<Duration>,
}

pub fn zone_lost(c: &mut Cluster, dir: &Path) {
    println!("== (z) a zone lost at once: three zones of three nodes, zone-c's go together");
    for n in JOIN {
        c.add_node(dir, n);
    }
    c.listed();
    for n in &c.nodes {
        set_ready(c, &n.name, true);
    }
    let content = pattern(1 << 20);
    let mut vols = Vec::new();
    for k in 0..VOLUMES {
        let on = LOST[k % 2];
        let name = format!("zone-{k}");
        claim(&c.cp, &name, on, "32Mi", None, json!({}), json!({"storageClassName": "ferrite-replicated"}));
        let handle = c.bound(&name);
        let vol = handle.split_once('/').unwrap().1.to_owned();
        let pv = c.cp.get(&["pvc", &name, "-n", "default"])["spec"]["volumeName"].as_str().unwrap().to_owned();
        vols.push(Vol { claim: name, name: vol, pv, on, generation: 0, promoted: None, written: None });
    }
    for v in &mut vols {
        let s = c.daemon(v.on).json(&["replica", "status", &v.name]);
        assert_eq!(s["role"], "primary", "{} on {}: {s}", v.name, v.on);
        // The copies' nodes, by the address in each member's endpoint.
        let holders: Vec<String> = s["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let e = m["endpoint"].as_str().unwrap();
                let n = c.nodes.iter().find(|n| e.contains(&format!("//{}:", n.ip))).expect("a node's endpoint");
                n.name.clone()
            })
            .collect();
        let mut zones: Vec<&str> = holders.iter().map(|n| super::zone_of(n)).collect();
        zones.sort_unstable();
        assert_eq!(zones, ["a", "b", "c"], "one copy per zone: {s}");
        v.generation = s["generation"].as_u64().unwrap();
        for n in holders.iter().filter(|n| *n != v.on) {
            in_sync(c, &v.name, n);
        }
        acknowledged(c.daemon(v.on), &v.name, &content);
        c.cp.apply(
            &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": &v.claim, "namespace": "default"},
                "spec": {"nodeName": v.on, "containers": [{"name": "app", "image": "app.invalid/app:1"}],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": &v.claim}}]}})
            .to_string(),
        );
    }

    let fault = Instant::now();
    for n in LOST {
        let i = c.nodes.iter().position(|x| x.name == n).unwrap();
        if let Some(d) = c.daemon_pods.iter().position(|p| p.node.name == n) {
            c.daemon_pods[d].kill(&mut c.cp);
        }
        let p = c.plugin_pods.iter().position(|p| p.node.name == n).unwrap();
        c.plugin_pods[p].kill(&mut c.cp);
        c.sw.link(i, false);
    }
    for n in LOST {
        set_ready(c, n, false);
    }
    let survivors: Vec<String> =
        c.daemon_pods.iter().map(|p| p.node.name.clone()).filter(|n| !LOST.contains(&n.as_str())).collect();
    let survivors: Vec<&str> = survivors.iter().map(String::as_str).collect();
    // Each volume: promoted on a survivor, then attached there (as its restarted pod's node would
    // ask) and written; all at once, each timed from the fault.
    let deadline = Instant::now() + LONG;
    while vols.iter().any(|v| v.written.is_none()) {
        assert!(Instant::now() < deadline, "not every volume took a write again within {LONG:?}");
        for v in vols.iter_mut().filter(|v| v.written.is_none()) {
            match &v.promoted {
                None => {
                    let Some(to) = serving(c, &v.name, &survivors) else { continue };
                    let g = c.daemon(&to).json(&["replica", "status", &v.name])["generation"].as_u64().unwrap();
                    assert!(g > v.generation, "{} serves {} at generation {g}", to, v.name);
                    c.cp.apply(
                        &json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
                            "metadata": {"name": format!("{}-after", v.claim)},
                            "spec": {"attacher": "csi.ferrite.dev", "nodeName": to,
                                "source": {"persistentVolumeName": v.pv}}})
                        .to_string(),
                    );
                    v.promoted = Some((to, fault.elapsed()));
                }
                Some((to, _)) => {
                    let va = c.cp.get(&["volumeattachment", &format!("{}-after", v.claim)]);
                    if va["status"]["attached"] != true {
                        continue;
                    }
                    let d = c.daemon(to);
                    assert!(super::common::nbd::read_image(d, &v.name, content.len() as u64) == content, "lost writes");
                    let mut s = super::common::nbd::open(d, &v.name);
                    assert_eq!(super::common::nbd::write_on(&mut s, 4 << 20, &pattern(4096)), 0);
                    drop(s);
                    d.ok(&["export", "stop", &v.name]);
                    v.written = Some(fault.elapsed());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    for v in &vols {
        let (to, promoted) = v.promoted.as_ref().unwrap();
        println!(
            "   {} (primary and pod on {}): promoted on {to} {promoted:.1?}, written from there {:.1?} after the fault",
            v.name,
            v.on,
            v.written.unwrap()
        );
    }
    let last = vols.iter().filter_map(|v| v.written).max().unwrap();
    println!(
        "   zone-c lost ({} of {} nodes): every one of {VOLUMES} volumes writing again within {last:.1?}",
        LOST.len(),
        c.nodes.len()
    );
    for n in LOST {
        let node = c.cp.get(&["node", n]);
        assert!(node["metadata"]["annotations"]["failover.ferrite.dev/fenced"].is_string(), "{n} not fenced");
    }
    for v in &vols {
        c.cp.wait(&format!("pod {} deleted from {}", v.claim, v.on), LONG, |cp| {
            !cp.kubectl(&["get", "pod", &v.claim, "-n", "default"]).status.success()
        });
        let said = events(&c.cp, &v.pv, "FailedOver");
        assert!(said.iter().any(|n| n.contains(&format!("node {} was lost", v.on))), "{}: {said:?}", v.pv);
    }
}
