//! The Kubernetes tier: deploy/kubernetes on a real control plane (etcd, kube-apiserver,
//! kube-controller-manager as processes; no scheduler, no kubelet), with the controller pod's
//! containers (ferrite csi --mode controller and the kubernetes-csi and CSI-Addons sidecars)
//! run as processes under the manifests' arguments, ServiceAccount and RBAC, the
//! snapshot-controller and the CSI-Addons manager under their upstream RBAC, and two daemons on
//! two addresses of a network namespace standing for two nodes. The test plays scheduler and
//! kubelet only where the driver needs them: it binds pods to nodes (pod status with the
//! node's address) and picks the node of a WaitForFirstConsumer claim.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::kube::{ControlPlane, binaries};
use common::netns::Lan;
use common::{BIN, Daemon};
use serde_json::{Value, json};

const NS: &str = "ferrite";
const NODES: [&str; 2] = ["node-a", "node-b"];
const LONG: Duration = Duration::from_secs(120);

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// CRDs and upstream RBAC: `FERRITE_K8S` (scripts/test.sh sets it), else ../shared/k8s.
/// The `[roles]` table of the node ConfigMap in the manifests: every daemon of the tier grants
/// exactly what a deployment from them would.
fn manifest_roles() -> String {
    let text = std::fs::read_to_string(deploy().join("node.yaml")).unwrap();
    let table: Vec<&str> = text
        .lines()
        .skip_while(|l| l.trim() != "[roles]")
        .take_while(|l| l.starts_with("    "))
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .collect();
    assert!(table.len() > 1, "node.yaml's ConfigMap has no [roles] table");
    table.join("\n") + "\n"
}

fn upstream() -> PathBuf {
    std::env::var_os("FERRITE_K8S")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/k8s"), PathBuf::from)
}

/// Brings up the cluster: CRDs, upstream RBAC, the manifests (after a server-side dry run of
/// each), nodes, the node pods and daemons, the controller pod and its containers.
struct Cluster {
    cp: ControlPlane,
    daemons: Vec<Daemon>,
    lan: Lan,
    /// Processes whose logs must show no Forbidden.
    sidecars: Vec<String>,
}

impl Cluster {
    fn start(dir: &Path, bin: &Path, lan: Lan) -> Self {
        let mut cp = ControlPlane::start(dir, bin);
        let up = upstream();
        let crds = [up.join("crds/external-snapshotter"), up.join("crds/csi-addons")];
        for c in &crds {
            cp.ok(&["apply", "--server-side", "-f", &c.display().to_string()]);
        }
        cp.ok(&["wait", "--for", "condition=established", "crd", "--all", "--timeout=60s"]);
        cp.ok(&["create", "namespace", "csi-addons-system"]);
        for r in ["snapshot-controller.yaml", "csi-addons-manager.yaml"] {
            let text = std::fs::read_to_string(up.join("rbac").join(r)).unwrap();
            let ns = if r.starts_with("snapshot") { "kube-system" } else { "csi-addons-system" };
            cp.with_stdin(&["apply", "-n", ns, "-f", "-"], &text);
        }
        // Namespaces get their default ServiceAccount from the controller-manager; pods need it.
        cp.wait("the default ServiceAccount", LONG, |cp| cp.kubectl(&["get", "sa", "default"]).status.success());

        println!("== every manifest passes a server-side dry run, then applies");
        let dk = deploy().display().to_string();
        // A dry run does not create the namespace the other objects go to.
        cp.ok(&["apply", "-f", &deploy().join("namespace.yaml").display().to_string()]);
        cp.ok(&["apply", "--dry-run=server", "-k", &dk]);
        cp.ok(&["apply", "-k", &dk]);
        cp.ok(&["apply", "--dry-run=server", "-f", &deploy().join("examples").display().to_string()]);

        let pki = dir.join("pki");
        common::csi::certs(&pki, "ferrite-controller", &[]);
        let mut daemons = Vec::new();
        for (i, node) in NODES.iter().enumerate() {
            // What the kubelet and node-driver-registrar would publish for the node.
            cp.apply(
                &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node,
                    "labels": {"kubernetes.io/hostname": node, "topology.ferrite.dev/node": node}}})
                .to_string(),
            );
            cp.apply(
                &json!({"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": {"name": node},
                    "spec": {"drivers": [{"name": "csi.ferrite.dev", "nodeID": node,
                        "topologyKeys": ["topology.ferrite.dev/node"], "allocatable": {"count": 128}}]}})
                .to_string(),
            );
            let d = dir.join(node);
            std::fs::create_dir_all(&d).unwrap();
            // The node's own certificate, as docs/kubernetes.md issues it.
            common::csi::certs(&pki, node, &[&lan.hosts[i], "ferrite-node.ferrite.svc"]);
            let p = |f: &str| pki.join(f).display().to_string();
            let cfg = format!(
                "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\nadmin-listen = \"{}:7070\"\n\
                 tls-cert = {:?}\ntls-key = {:?}\ntls-client-ca = {:?}\n{}",
                lan.hosts[i],
                p(&format!("{node}.pem")),
                p(&format!("{node}-key.pem")),
                p("ca.pem"),
                manifest_roles()
            );
            std::fs::write(d.join("ferrite.toml"), cfg).unwrap();
            daemons.push(Daemon::start_in(&d, Some(&lan.ns)));
            // The DaemonSet's pod on this node, as the scheduler and kubelet would run it.
            let ds = cp.get(&["daemonset", "ferrite-node", "-n", NS]);
            run_pod(&mut cp, &format!("ferrite-node-{node}"), &ds["spec"]["template"], node, &lan.hosts[i], None);
        }
        cp.wait("the node Service's EndpointSlices to list both nodes", LONG, |cp| {
            let s = cp.get(&["endpointslices", "-n", NS, "-l", "kubernetes.io/service-name=ferrite-node"]);
            let listed = s["items"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default());
            let listed: Vec<String> = listed.filter_map(|e| e["nodeName"].as_str().map(str::to_owned)).collect();
            NODES.iter().all(|n| listed.iter().any(|l| l == n))
        });

        let mut c = Self { cp, daemons, lan, sidecars: Vec::new() };
        c.start_controller(dir, &pki);
        c
    }

    /// The controller Deployment's pod (a ReplicaSet and a pod owned as the Deployment's
    /// controllers would make them) bound to node-a, and its containers as processes.
    fn start_controller(&mut self, dir: &Path, pki: &Path) {
        let cp = &mut self.cp;
        let dep = cp.get(&["deployment", "ferrite-controller", "-n", NS]);
        let tpl = &dep["spec"]["template"];
        let rs = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "ferrite-controller-1", "namespace": NS, "labels": tpl["metadata"]["labels"],
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "ferrite-controller",
                    "uid": dep["metadata"]["uid"], "controller": true}]},
            "spec": {"replicas": 1, "selector": dep["spec"]["selector"], "template": tpl}});
        cp.apply(&rs.to_string());
        let rs = cp.get(&["replicaset", "ferrite-controller-1", "-n", NS]);
        let owner = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "ferrite-controller-1",
            "uid": rs["metadata"]["uid"], "controller": true});
        let pod = run_pod(cp, "ferrite-controller-1-x", tpl, "node-a", &self.lan.gateway, Some(owner));

        // The pod's mounts: the socket directory and the TLS secret.
        let (csi_dir, tls_dir) = (dir.join("csi"), dir.join("tls"));
        std::fs::create_dir_all(&csi_dir).unwrap();
        std::fs::create_dir_all(&tls_dir).unwrap();
        for (from, to) in
            [("ca.pem", "ca.crt"), ("ferrite-controller.pem", "tls.crt"), ("ferrite-controller-key.pem", "tls.key")]
        {
            std::fs::copy(pki.join(from), tls_dir.join(to)).unwrap();
        }
        let mounts =
            [("/csi/", format!("{}/", csi_dir.display())), ("/etc/ferrite/tls/", format!("{}/", tls_dir.display()))];
        for c in pod["spec"]["containers"].as_array().unwrap() {
            let name = c["name"].as_str().unwrap();
            let program = match name {
                "ferrite" => BIN.to_owned(),
                "csi-provisioner" | "csi-resizer" | "csi-snapshotter" => name.to_owned(),
                "csi-addons" => "csi-addons-sidecar".to_owned(),
                // No livenessprobe binary is built here; its arguments pass the dry run.
                "liveness-probe" => continue,
                other => panic!("the controller pod has a container the tier does not know: {other}"),
            };
            let env = container_env(c, &pod);
            let mut args: Vec<String> = c["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| {
                    let mut a = expand(a.as_str().unwrap(), &env);
                    for (from, to) in &mounts {
                        a = a.replace(from, to);
                    }
                    a
                })
                .collect();
            let kubeconfig = cp.token_kubeconfig(NS, "ferrite-controller", &format!("{name}.kubeconfig"));
            let mut envs: Vec<(String, String)> = env.clone();
            match name {
                "ferrite" => envs.push(("KUBECONFIG".into(), kubeconfig.display().to_string())),
                // The CSI-Addons sidecar takes only the in-cluster configuration.
                "csi-addons" => self.sidecars.push(name.to_owned()),
                _ => {
                    args.push(format!("--kubeconfig={}", kubeconfig.display()));
                    self.sidecars.push(name.to_owned());
                }
            }
            if name == "csi-provisioner" {
                // Capacity objects are owned by the Deployment (through the pod and ReplicaSet).
                assert!(args.iter().any(|a| a == "--capacity-ownerref-level=2"), "{args:?}");
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            if name == "csi-addons" {
                cp.spawn_in_pod(name, &program, &args, &envs, NS, "ferrite-controller");
            } else {
                cp.spawn(name, &program, &args, &envs);
            }
        }
        // The cluster-wide controllers, each under its upstream ServiceAccount and RBAC.
        let snap = cp.token_kubeconfig("kube-system", "snapshot-controller", "snapshot-controller.kubeconfig");
        cp.spawn(
            "snapshot-controller",
            "snapshot-controller",
            &[
                &format!("--kubeconfig={}", snap.display()),
                "--leader-election=false",
                "--feature-gates=CSIVolumeGroupSnapshot=true",
            ],
            &[],
        );
        self.sidecars.push("snapshot-controller".into());
        // The manager calls the sidecars with the token a pod has; it runs as in a pod.
        let probe = format!("--health-probe-bind-address=127.0.0.1:{}", common::csi::free_port("127.0.0.1"));
        let args = ["--namespace=csi-addons-system", &probe, "--metrics-bind-address=0"];
        cp.spawn_in_pod(
            "csi-addons-manager",
            "csi-addons-manager",
            &args,
            &[],
            "csi-addons-system",
            "csi-addons-controller-manager",
        );
        self.sidecars.push("csi-addons-manager".into());
        cp.wait("the CSI-Addons manager to connect to the controller's sidecar", LONG, |cp| {
            let n = cp.get(&["csiaddonsnodes", "-n", NS]);
            n["items"].as_array().unwrap().iter().any(|n| n["status"]["state"] == "Connected")
        });
    }
}

/// Creates pod `name` from `template` bound to `node`, and sets its status as the kubelet would
/// once it runs (address `ip`, Ready). Returns the pod.
fn run_pod(cp: &mut ControlPlane, name: &str, template: &Value, node: &str, ip: &str, owner: Option<Value>) -> Value {
    let mut spec = template["spec"].clone();
    spec["nodeName"] = json!(node);
    let mut meta = json!({"name": name, "namespace": NS, "labels": template["metadata"]["labels"]});
    if let Some(o) = owner {
        meta["ownerReferences"] = json!([o]);
    }
    cp.apply(&json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}).to_string());
    let now = "2026-01-01T00:00:00Z";
    let status = json!({"status": {"phase": "Running", "hostIP": ip, "hostIPs": [{"ip": ip}], "podIP": ip,
        "podIPs": [{"ip": ip}], "startTime": now,
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": "True", "lastTransitionTime": now}]}});
    cp.ok(&["patch", "pod", name, "-n", NS, "--subresource=status", "--type=merge", "-p", &status.to_string()]);
    cp.get(&["pod", name, "-n", NS])
}

/// A container's environment as the kubelet gives it: values and the pod fields it names.
fn container_env(c: &Value, pod: &Value) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for e in c["env"].as_array().cloned().unwrap_or_default() {
        let name = e["name"].as_str().unwrap().to_owned();
        let value = match (&e["value"], e["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
            (Value::String(v), _) => v.clone(),
            (_, Some("metadata.name")) => pod["metadata"]["name"].as_str().unwrap().to_owned(),
            (_, Some("metadata.namespace")) => NS.to_owned(),
            (_, Some("metadata.uid")) => pod["metadata"]["uid"].as_str().unwrap().to_owned(),
            (_, Some("spec.nodeName")) => pod["spec"]["nodeName"].as_str().unwrap().to_owned(),
            (_, Some("status.hostIP")) => pod["status"]["hostIP"].as_str().unwrap().to_owned(),
            other => panic!("env {name}: {other:?} is not something the tier resolves"),
        };
        env.push((name, value));
    }
    env
}

/// `$(VAR)` references in an argument, as the kubelet expands them.
fn expand(arg: &str, env: &[(String, String)]) -> String {
    let mut out = arg.to_owned();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// A claim of `class` on `node` (the scheduler's choice for a WaitForFirstConsumer claim), from
/// `source` (a dataSource) if given, labelled `labels`.
fn claim(cp: &ControlPlane, name: &str, node: &str, size: &str, source: Option<Value>, labels: Value) {
    let mut spec = json!({"storageClassName": "ferrite-ext4", "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": size}}});
    if let Some(s) = source {
        spec["dataSource"] = s;
    }
    cp.apply(
        &json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": "default",
            "labels": labels, "annotations": {"volume.kubernetes.io/selected-node": node}}, "spec": spec})
        .to_string(),
    );
}

impl Cluster {
    /// Waits for claim `name` to bind; its PV's volume handle (`node/volume`).
    fn bound(&mut self, name: &str) -> String {
        self.cp.wait(&format!("claim {name} to bind"), LONG, |cp| {
            cp.get(&["pvc", name, "-n", "default"])["status"]["phase"] == "Bound"
        });
        let pv = self.cp.get(&["pvc", name, "-n", "default"])["spec"]["volumeName"].as_str().unwrap().to_owned();
        self.cp.get(&["pv", &pv])["spec"]["csi"]["volumeHandle"].as_str().unwrap().to_owned()
    }

    fn daemon(&self, node: &str) -> &Daemon {
        &self.daemons[NODES.iter().position(|n| *n == node).unwrap()]
    }

    fn wait_field(&mut self, what: &str, args: &[&str], ok: impl Fn(&Value) -> bool) -> Value {
        let mut last = Value::Null;
        self.cp.wait(what, LONG, |cp| {
            last = cp.get(args);
            ok(&last)
        });
        last
    }
}

fn volumes(d: &Daemon) -> Vec<String> {
    d.json(&["volume", "list"]).as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_owned()).collect()
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| u8::try_from((i * 7 + i / 4096) % 251).unwrap()).collect()
}

#[test]
fn ferrite_on_kubernetes() {
    let Some(bin) = binaries() else { return };
    let Some(lan) = Lan::new(2) else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(dir.path(), &bin, lan);

    println!("== capacity per node, published by the provisioner");
    c.cp.wait("CSIStorageCapacity for both nodes", LONG, |cp| {
        let caps = cp.get(&["csistoragecapacities", "-n", NS]);
        let items = caps["items"].as_array().unwrap().clone();
        NODES.iter().all(|n| {
            items.iter().any(|i| {
                i["nodeTopology"]["matchLabels"]["topology.ferrite.dev/node"] == *n && i["capacity"].as_str().is_some()
            })
        })
    });

    println!("== claims bind on the node the scheduler picked");
    claim(&c.cp, "data", "node-a", "64Mi", None, json!({"app": "shop"}));
    claim(&c.cp, "logs", "node-b", "32Mi", None, json!({}));
    let data = c.bound("data");
    let logs = c.bound("logs");
    let (node, data_vol) = data.split_once('/').unwrap();
    assert_eq!(node, "node-a", "{data}");
    assert!(logs.starts_with("node-b/"), "{logs}");
    assert!(volumes(c.daemon("node-a")).contains(&data_vol.to_owned()));
    assert!(!volumes(c.daemon("node-b")).contains(&data_vol.to_owned()));
    let pv = c.cp.get(&["pv", c.cp.get(&["pvc", "data"])["spec"]["volumeName"].as_str().unwrap()]);
    let terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"].to_string();
    assert!(terms.contains("topology.ferrite.dev/node") && terms.contains("node-a"), "{terms}");
    assert_eq!(pv["spec"]["mountOptions"], json!(["discard"]), "the class's mount options reach the PV");

    let data_vol = data_vol.to_owned();
    let content = pattern(1 << 20);
    let mut s = common::nbd::open(c.daemon("node-a"), &data_vol);
    assert_eq!(common::nbd::write_on(&mut s, 0, &content), 0);
    drop(s);
    c.daemon("node-a").ok(&["export", "stop", &data_vol]);

    println!("== snapshot, restore and clone carry the source's data");
    c.cp.apply(
        &json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "snap", "namespace": "default"},
            "spec": {"volumeSnapshotClassName": "ferrite", "source": {"persistentVolumeClaimName": "data"}}})
        .to_string(),
    );
    c.wait_field("the snapshot to be ready", &["volumesnapshot", "snap"], |v| v["status"]["readyToUse"] == true);
    claim(
        &c.cp,
        "restore",
        "node-a",
        "64Mi",
        Some(json!({"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"})),
        json!({}),
    );
    claim(
        &c.cp,
        "copy",
        "node-a",
        "64Mi",
        Some(json!({"kind": "PersistentVolumeClaim", "name": "data"})),
        json!({"app": "shop"}),
    );
    for name in ["restore", "copy"] {
        let handle = c.bound(name);
        let (node, vol) = handle.split_once('/').unwrap();
        assert_eq!(node, "node-a");
        let got = common::nbd::read_image(c.daemon(node), vol, 1 << 20);
        assert!(got == content, "claim {name} does not hold the source's data");
    }

    println!("== expansion");
    c.cp.ok(&[
        "patch",
        "pvc",
        "data",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#,
    ]);
    let pv_name = c.cp.get(&["pvc", "data"])["spec"]["volumeName"].as_str().unwrap().to_owned();
    c.wait_field("the PV to grow", &["pv", &pv_name], |v| v["spec"]["capacity"]["storage"] == "128Mi");
    let info = c.daemon("node-a").json(&["volume", "show", &data_vol]);
    assert_eq!(info["size"], 128 << 20, "{info}");

    println!("== a VolumeAttributesClass sets the volume's limits online (ControllerModifyVolume)");
    c.cp.ok(&["apply", "-f", &deploy().join("examples/volumeattributesclass.yaml").display().to_string()]);
    c.cp.ok(&[
        "patch",
        "pvc",
        "data",
        "--type=merge",
        "-p",
        r#"{"spec":{"volumeAttributesClassName":"ferrite-gold"}}"#,
    ]);
    let a = &c.daemons[0];
    c.cp.wait("the daemon to hold the class's limits", LONG, |_| {
        let l = &a.json(&["volume", "show", &data_vol])["limits"];
        l["iops"] == 5000 && l["bps"] == 200 << 20
    });
    c.wait_field("the claim to report the class", &["pvc", "data"], |v| {
        v["status"]["currentVolumeAttributesClassName"] == "ferrite-gold"
    });

    println!("== group snapshot of the claims labelled app=shop");
    c.cp.apply(
        &json!({"apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshot", "metadata": {"name": "shop", "namespace": "default"},
            "spec": {"volumeGroupSnapshotClassName": "ferrite", "source": {"selector": {"matchLabels": {"app": "shop"}}}}})
        .to_string(),
    );
    let g = c.wait_field("the group snapshot to be ready", &["volumegroupsnapshot", "shop"], |v| {
        v["status"]["readyToUse"] == true
    });
    println!("   {}", g["status"]);

    println!("== CSI-Addons: reclaim, fence, replication");
    c.cp.apply(
        &json!({"apiVersion": "csiaddons.openshift.io/v1alpha1", "kind": "ReclaimSpaceJob", "metadata": {"name": "reclaim", "namespace": "default"},
            "spec": {"target": {"persistentVolumeClaim": "data"}}})
        .to_string(),
    );
    let r = c.wait_field("the reclaim job to finish", &["reclaimspacejob", "reclaim"], |v| {
        v["status"]["result"].is_string()
    });
    assert_eq!(r["status"]["result"], "Succeeded", "{}", r["status"]);

    c.cp.apply(
        &json!({"apiVersion": "csiaddons.openshift.io/v1alpha1", "kind": "NetworkFence", "metadata": {"name": "fence"},
            "spec": {"networkFenceClassName": "ferrite", "fenceState": "Fenced", "cidrs": ["192.0.2.0/24"]}})
        .to_string(),
    );
    let f = c.wait_field("the fence", &["networkfence", "fence"], |v| v["status"]["result"].is_string());
    assert_eq!(f["status"]["result"], "Succeeded", "{}", f["status"]);
    for d in &c.daemons {
        assert!(d.ok(&["fence", "list"]).contains("192.0.2.0/24"), "every daemon is fenced");
    }
    c.cp.ok(&["patch", "networkfence", "fence", "--type=merge", "-p", r#"{"spec":{"fenceState":"Unfenced"}}"#]);
    let nodes: Vec<&Daemon> = c.daemons.iter().collect();
    c.cp.wait("the daemons to lift the fence", LONG, |_| {
        nodes.iter().all(|d| !d.ok(&["fence", "list"]).contains("192.0.2.0/24"))
    });
    let f = c.cp.get(&["networkfence", "fence"]);
    assert_eq!(f["status"]["result"], "Succeeded", "{}", f["status"]);

    c.cp.apply(
        &json!({"apiVersion": "replication.storage.openshift.io/v1alpha1", "kind": "VolumeReplication", "metadata": {"name": "data", "namespace": "default"},
            "spec": {"volumeReplicationClass": "ferrite-to-node-b", "replicationState": "primary", "autoResync": false,
                "dataSource": {"apiGroup": "", "kind": "PersistentVolumeClaim", "name": "data"}}})
        .to_string(),
    );
    let v = c
        .wait_field("replication to be enabled", &["volumereplication", "data"], |v| v["status"]["state"] == "Primary");
    println!("   {}", v["status"]["conditions"]);
    let rel = c.daemon("node-a").replica(&data_vol);
    assert_eq!(rel["role"], "primary", "{rel}");
    let a = &c.daemons[0];
    c.cp.wait("the first sync to reach node-b", LONG, |_| {
        a.replica(&data_vol)["last_snapshot"].as_str().is_some_and(|s| !s.is_empty())
    });

    println!("== deletes clean up");
    for (kind, name) in [("volumereplication", "data"), ("volumegroupsnapshot", "shop"), ("volumesnapshot", "snap")] {
        c.cp.ok(&["delete", kind, name, "--wait=true", "--timeout=120s"]);
    }
    c.cp.ok(&["delete", "networkfence", "fence", "--wait=true", "--timeout=120s"]);
    c.cp.ok(&["delete", "pvc", "--all", "--wait=true", "--timeout=120s"]);
    c.cp.wait("every PV to go", LONG, |cp| cp.get(&["pv"])["items"].as_array().unwrap().is_empty());
    let a = c.daemon("node-a");
    assert!(volumes(a).is_empty(), "node-a keeps {:?}", volumes(a));
    assert!(a.json(&["snapshot", "list"]).as_array().unwrap().is_empty(), "{}", a.json(&["snapshot", "list"]));
    // node-b keeps only the replica, which disabling replication left as a writable copy.
    let left = volumes(c.daemon("node-b"));
    assert!(left.iter().all(|v| *v == data_vol), "node-b keeps {left:?}");

    println!("== no component was refused by RBAC");
    for name in &c.sidecars {
        let log = c.cp.log(name);
        let bad: Vec<&str> = log.lines().filter(|l| l.contains("forbidden") || l.contains("Forbidden")).collect();
        assert!(bad.is_empty(), "{name} was refused:\n{}", bad.join("\n"));
    }
    println!("== each identity did only what its role allows");
    for d in &c.daemons {
        let refused: Vec<String> = d.log().lines().filter(|l| l.contains("call refused")).map(str::to_owned).collect();
        assert!(refused.is_empty(), "a component was refused a call:\n{}", refused.join("\n"));
    }
    // A node's certificate (a replication peer) may not make an operator's call.
    let pki = dir.path().join("pki");
    let (cert, key) = (pki.join("node-b.pem"), pki.join("node-b-key.pem"));
    let tls = ferrite_proto::admin_tls(&pki.join("ca.pem"), Some((&cert, &key))).unwrap();
    let endpoint = format!("tcp://{}:7070", c.lan.hosts[0]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let refused = rt.block_on(async {
        let ch = ferrite_proto::connect_as(&endpoint, Some(tls), Some("ferrite-node.ferrite.svc")).await.unwrap();
        let mut admin = ferrite_proto::ferrite::v1::admin_client::AdminClient::new(ch);
        admin.scrub_pool(ferrite_proto::ferrite::v1::ScrubPoolRequest {}).await.map(drop).unwrap_err()
    });
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
    assert!(
        refused.message().contains("ferrite-node.ferrite.svc") && refused.message().contains("ScrubPool"),
        "{refused}"
    );
    c.cp.check_alive();
    println!("KUBERNETES_TIER_OK");
}
