//! The upgrade from release 0.2.0, exactly as docs/operations.md writes it: a cluster runs
//! 0.2.0's manifests (a daemon on every node) under a real DaemonSet controller, this test
//! standing in for the scheduler and the kubelet (it binds the pods the controller makes, reports
//! them ready, and finishes their deletion). The documented commands then run as written, and:
//! the apply succeeds (nothing immutable changed unhandled), no daemon pod of a labelled node is
//! deleted or replaced (OnDelete), a node that joined after the labels loses its daemon (why they
//! come first), the node plugins roll over one node at a time, and deleting one node's daemon pod,
//! the next documented step, brings this release's daemon up there alone.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::kube::{self, ControlPlane};
use serde_json::json;

const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
/// A node that joins after the labels were set, so it has none.
const LATE: &str = "node-late";
const DAEMON: &str = "app.kubernetes.io/name=ferrite-daemon";
const PLUGIN: &str = "app.kubernetes.io/name=ferrite-node-plugin";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The shell block of the "From 0.2.0" part of docs/operations.md.
fn documented_commands() -> String {
    let doc = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    let part = &doc[doc.find("**From 0.2.0**").expect("docs/operations.md has an upgrade from 0.2.0")..];
    let start = part.find("```sh\n").expect("a shell block") + "```sh\n".len();
    part[start..start + part[start..].find("```").unwrap()].to_owned()
}

/// The YAML documents of a rendered manifest, by `kind/name`.
fn documents(text: &str) -> BTreeMap<String, String> {
    text.split("\n---\n")
        .filter_map(|d| {
            let field = |f: &str| d.lines().find_map(|l| l.strip_prefix(f)).map(str::trim);
            let name = d.lines().skip_while(|l| *l != "metadata:").find_map(|l| l.strip_prefix("  name: "))?;
            Some((format!("{}/{}", field("kind: ")?, name.trim()), d.to_owned()))
        })
        .collect()
}

/// The lines of `doc` from `key` (a top-level key) to the next top-level key.
fn section<'a>(doc: &'a str, key: &str) -> Vec<&'a str> {
    doc.lines().skip_while(|l| *l != key).skip(1).take_while(|l| l.starts_with(' ')).collect()
}

/// A pod as the test sees it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    uid: String,
    /// The DaemonSet revision it runs.
    revision: String,
    ready: bool,
    deleting: bool,
}

impl Seen {
    /// Ready, and not on its way out.
    fn serving(&self) -> bool {
        self.ready && !self.deleting
    }
}

/// The pods of `selector`, by node ("" for those not bound yet).
fn pods(cp: &ControlPlane, selector: &str) -> BTreeMap<String, Vec<Seen>> {
    let mut by_node: BTreeMap<String, Vec<_>> = BTreeMap::new();
    for p in cp.get(&["pods", "-n", "ferrite", "-l", selector])["items"].as_array().unwrap() {
        let node = p["spec"]["nodeName"].as_str().unwrap_or("").to_owned();
        let ready = p["status"]["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"));
        by_node.entry(node).or_default().push(Seen {
            uid: p["metadata"]["uid"].as_str().unwrap().to_owned(),
            revision: p["metadata"]["labels"]["controller-revision-hash"].as_str().unwrap_or("").to_owned(),
            ready,
            deleting: !p["metadata"]["deletionTimestamp"].is_null(),
        });
    }
    by_node
}

/// One round of what the scheduler and the kubelets would do for the namespace's pods: bind each
/// new pod to the node its DaemonSet asks for, report bound ones running and ready, and finish
/// the deletion of those being deleted.
fn stand_in(cp: &ControlPlane) {
    for p in cp.get(&["pods", "-n", "ferrite"])["items"].as_array().unwrap() {
        let name = p["metadata"]["name"].as_str().unwrap();
        if !p["metadata"]["deletionTimestamp"].is_null() {
            let _ = cp.kubectl(&["delete", "pod", name, "-n", "ferrite", "--grace-period=0", "--force"]);
        } else if p["spec"]["nodeName"].is_null() {
            let terms = &p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"];
            let Some(node) = terms["nodeSelectorTerms"][0]["matchFields"][0]["values"][0].as_str() else { continue };
            let binding = json!({"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": "ferrite"}, "target": {"kind": "Node", "name": node}});
            // A pod bound meanwhile refuses a second binding: the next round sees it bound.
            let file = cp.dir.join("binding.json");
            std::fs::write(&file, binding.to_string()).unwrap();
            let _ = cp.kubectl(&["create", "-f", &file.display().to_string()]);
        } else if !p["status"]["conditions"].as_array().is_some_and(|c| c.iter().any(|c| c["type"] == "Ready")) {
            let status = json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
            let _ = cp.kubectl(&[
                "patch",
                "pod",
                name,
                "-n",
                "ferrite",
                "--subresource=status",
                "--type=merge",
                "-p",
                &status.to_string(),
            ]);
        }
    }
}

/// A Ready node, without the not-ready taint the API server gives a new one (the node lifecycle
/// controller, off here, would take it away).
fn node(cp: &ControlPlane, name: &str) {
    cp.apply(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}).to_string());
    cp.merge_patch("node", name, r#"{"spec":{"taints":null}}"#);
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
    cp.ok(&["patch", "node", name, "--subresource=status", "--type=merge", "-p", &ready.to_string()]);
}

/// Runs the stand-in until the daemons run on `daemons` and the node plugins on `plugins`, one
/// ready pod on each, nothing being deleted or waiting for a node.
fn settle(cp: &mut ControlPlane, daemons: &[&str], plugins: &[&str], what: &str) {
    cp.wait(what, Duration::from_secs(120), |cp| {
        stand_in(cp);
        [(DAEMON, daemons), (PLUGIN, plugins)].iter().all(|(s, on)| {
            let p = pods(cp, s);
            p.len() == on.len() && on.iter().all(|n| p.get(*n).is_some_and(|v| v.len() == 1 && v[0].serving()))
        })
    });
}

#[test]
fn an_upgrade_from_0_2_0_as_documented_keeps_every_daemon() {
    let Some(bin) = kube::binaries() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut cp = ControlPlane::start_with(tmp.path(), &bin, None, true);
    cp.wait("the default ServiceAccount", Duration::from_secs(60), |cp| {
        cp.kubectl(&["get", "sa", "default"]).status.success()
    });
    let snapshots = std::env::var_os("FERRITE_K8S").map_or_else(|| repo().join("../shared/k8s"), PathBuf::from);
    cp.ok(&["apply", "--server-side", "-f", &snapshots.join("crds/external-snapshotter").display().to_string()]);
    cp.ok(&["wait", "--for", "condition=established", "crd", "--all", "--timeout=60s"]);

    println!("== 0.2.0's manifests on {NODES:?}");
    for n in NODES {
        node(&cp, n);
    }
    let old = include_str!("../fixtures/deploy-0.2.0.yaml");
    cp.apply(old);
    settle(&mut cp, &NODES, &NODES, "0.2.0's daemon and node plugin on every node");
    let before = pods(&cp, DAEMON);

    println!("== the documented commands");
    let commands = documented_commands();
    // Every class whose parameters changed since 0.2.0 must be re-created by them, or the apply
    // fails (Kubernetes forbids the change).
    let o = Command::new("kubectl").arg("kustomize").arg(repo().join("deploy/kubernetes")).output().unwrap();
    assert!(o.status.success(), "kubectl kustomize: {}", String::from_utf8_lossy(&o.stderr));
    let (old_docs, new_docs) = (documents(old), documents(&String::from_utf8(o.stdout).unwrap()));
    assert!(new_docs.keys().filter(|k| k.starts_with("StorageClass/")).count() >= 4, "{:?}", new_docs.keys());
    for (key, doc) in new_docs.iter().filter(|(k, _)| k.starts_with("StorageClass/")) {
        let changed = old_docs.get(key).is_some_and(|o| section(o, "parameters:") != section(doc, "parameters:"));
        let name = key.trim_start_matches("StorageClass/");
        assert!(
            !changed || commands.contains(&format!("delete storageclass {name}")),
            "{name}'s parameters changed since 0.2.0: the upgrade must re-create it"
        );
    }
    // Step 1 labels the nodes; a node that joins after it (with 0.2.0's daemon, as it was
    // applied then) has no label; then the rest.
    let (label, rest) = commands.split_at(commands.find("\n# 2.").expect("the documented steps are numbered"));
    let admin = cp.admin.clone();
    let run = |script: &str| {
        let o = Command::new("sh").args(["-euc", script]).current_dir(repo()).env("KUBECONFIG", &admin).output();
        let o = o.unwrap();
        assert!(o.status.success(), "the documented commands failed:\n{}", String::from_utf8_lossy(&o.stderr));
        println!("{}", String::from_utf8_lossy(&o.stdout));
    };
    run(label);
    node(&cp, LATE);
    let mut all = NODES.to_vec();
    all.push(LATE);
    settle(&mut cp, &all, &all, "0.2.0's pods on the late node");
    run(rest);

    // The late node lost its daemon (the new DaemonSet does not select it); the labelled ones kept
    // theirs untouched, while the node plugins rolled one node at a time.
    let plugin_before = pods(&cp, PLUGIN);
    let start = Instant::now();
    let mut fewest = usize::MAX;
    loop {
        stand_in(&cp);
        let daemons = pods(&cp, DAEMON);
        for n in NODES {
            assert_eq!(daemons.get(n), before.get(n), "the daemon pod of {n} was touched by the apply");
        }
        let plugins = pods(&cp, PLUGIN);
        let ready = all.iter().filter(|n| plugins.get(**n).is_some_and(|v| v.iter().any(Seen::serving))).count();
        fewest = fewest.min(ready);
        let rolled = all.iter().all(|n| {
            plugins
                .get(*n)
                .is_some_and(|v| v.len() == 1 && v[0].ready && v[0].revision != plugin_before[*n][0].revision)
        });
        if !daemons.contains_key(LATE) && rolled {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no end to the roll-out: {daemons:?} {plugins:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(fewest + 1 >= all.len(), "node plugins not ready on {} node(s) at once", all.len() - fewest);
    println!("== node plugins rolled in {:.1?}, never more than one node without one", start.elapsed());

    // The next documented step: one node's daemon pod deleted brings this release's daemon there.
    let old_a = &before["node-a"][0];
    let name = cp.get(&["pods", "-n", "ferrite", "-l", DAEMON, "--field-selector=spec.nodeName=node-a"])["items"][0]
        ["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    cp.ok(&["delete", "pod", &name, "-n", "ferrite", "--wait=false"]);
    settle(&mut cp, &NODES, &all, "the daemon back on node-a");
    let after = pods(&cp, DAEMON);
    let new_a = &after["node-a"][0];
    assert!(new_a.uid != old_a.uid && new_a.revision != old_a.revision, "node-a runs this release's daemon");
    for n in &NODES[1..] {
        assert_eq!(after.get(*n), before.get(*n), "the daemon pod of {n} was touched");
    }
    let ds = cp.get(&["daemonset", "-n", "ferrite", "-l", DAEMON]);
    let selector = &ds["items"][0]["spec"]["template"]["spec"]["nodeSelector"];
    assert_eq!(selector["storage.ferrite.dev/node"], "true", "{selector}");
}
