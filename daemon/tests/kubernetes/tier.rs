//! The Kubernetes tier: deploy/kubernetes (with its CSI-Addons, group snapshot and
//! snapshot-metadata components)
//! on a real control plane (etcd, kube-apiserver, kube-controller-manager as processes; no
//! scheduler, no kubelet), three nodes in network namespaces of their own, and every container
//! of the manifests run as a process: on each node the data-path daemon (after its init
//! container chose the node's pool) and the CSI node plugin with node-driver-registrar and the
//! liveness probe; the controller pod's ferrite and the kubernetes-csi and CSI-Addons sidecars;
//! the snapshot-controller and the CSI-Addons manager under their upstream RBAC; a backup tool
//! calls the snapshot-metadata sidecar with an audience-scoped token; backups go off the cluster
//! to SeaweedFS through VolumeSnapshots (`kubernetes/backup.rs`). The test plays
//! scheduler, DaemonSet controller and kubelet (`common::kubelet`): it binds pods to nodes (a
//! DaemonSet's where its nodeSelector and tolerations admit them: `kubernetes/storage_nodes.rs`),
//! makes their volumes with the modes and fsGroup the manifests give, runs each container as the
//! user and groups its securityContext names, probes readiness as the manifests say, and picks
//! the node of a WaitForFirstConsumer claim.

mod backup;
use crate::common;
mod failover;
mod storage_nodes;
mod trust;
use crate::weed;
mod zone_loss;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::kube::{ControlPlane, binaries};
use common::kubelet::{Node, Pod, base64};
use common::netns::Switch;
use common::{BIN, Daemon};
use serde_json::{Value, json};

const NS: &str = "ferrite";
const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
const LONG: Duration = Duration::from_secs(120);
/// The node whose pool is a block device its annotation names.
const DEVICE_NODE: usize = 2;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// CRDs and upstream RBAC: `FERRITE_K8S` (scripts/test.sh sets it), else ../shared/k8s.
fn upstream() -> PathBuf {
    std::env::var_os("FERRITE_K8S")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/k8s"), PathBuf::from)
}

fn sh(cmd: &str) -> String {
    let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(o.status.success(), "{cmd}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().trim().to_owned()
}

/// A loop device over a sparse file of `size`; detached when dropped.
struct Loop(String);

impl Loop {
    fn new(file: &Path, size: &str) -> Self {
        sh(&format!("truncate -s {size} {}", file.display()));
        Self(sh(&format!("losetup -f --show {}", file.display())))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// Brings up the cluster: CRDs, upstream RBAC, the manifests (after a server-side dry run),
/// nodes, the data-path daemons, the node plugins, the controller pod.
struct Cluster {
    cp: ControlPlane,
    sw: Switch,
    nodes: Vec<Node>,
    daemon_pods: Vec<Pod>,
    plugin_pods: Vec<Pod>,
    controller: Option<Pod>,
    /// CLI handles on each node's daemon (its admin socket); the pods own the processes.
    daemons: Vec<Daemon>,
    /// Logs of the processes that must not be refused by RBAC.
    sidecars: Vec<PathBuf>,
    pki: PathBuf,
    loops: Vec<Loop>,
    /// The object store backups go to (on the switch's gateway).
    store: Option<weed::Weed>,
    /// The registry the images are pulled from, and the `ferrite` of each image as pulled by
    /// digest (`ferrite` for the daemon and node plugin pods, `ferrite-controller`).
    _registry: Option<common::images::Registry>,
    node_bin: PathBuf,
    controller_bin: PathBuf,
}

impl Cluster {
    fn start(dir: &Path, bin: &Path, sw: Switch) -> Self {
        let mut cp = ControlPlane::start(dir, bin, Some(&sw.gateway));
        common::kubelet::open_up(dir);
        let up = upstream();
        let crds = [
            up.join("crds/external-snapshotter"),
            up.join("crds/csi-addons"),
            up.join("crds/external-snapshot-metadata"),
        ];
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

        println!("== the manifests with the optional components, as a user enables them");
        let copy = dir.join("deploy");
        sh(&format!("cp -r {} {}", deploy().display(), copy.display()));
        let k = copy.join("kustomization.yaml");
        let text = std::fs::read_to_string(&k).unwrap();
        let enabled = text
            .replace("  # - components/csi-addons ", "  - components/csi-addons ")
            .replace("  # - components/group-snapshots ", "  - components/group-snapshots ")
            .replace("  # - components/snapshot-metadata ", "  - components/snapshot-metadata ")
            .replace("  # - components/tolerations ", "  - components/tolerations ");
        assert_eq!(
            enabled.matches("  - components/").count(),
            5,
            "kustomization.yaml lists the optional components, commented out"
        );
        let dk = copy.display().to_string();
        let registry = images(dir, &copy);
        // The monitoring component renders (its CRDs, the Prometheus Operator's, are not here to
        // apply it): the ServiceMonitor, the PrometheusRule, the dashboard's ConfigMap.
        let monitored = enabled.replace("  # - components/monitoring ", "  - components/monitoring ");
        std::fs::write(&k, &monitored).unwrap();
        let rendered = cp.ok(&["kustomize", &dk]);
        for kind in ["kind: ServiceMonitor", "kind: PrometheusRule", "name: ferrite-dashboard"] {
            assert!(rendered.contains(kind), "the monitoring component renders no {kind}");
        }
        std::fs::write(&k, enabled).unwrap();
        // A dry run does not create the namespace the other objects go to.
        cp.ok(&["apply", "-f", &copy.join("base/namespace.yaml").display().to_string()]);
        cp.ok(&["apply", "--dry-run=server", "-k", &dk]);
        cp.ok(&["apply", "-k", &dk]);
        workloads_as_shipped(&cp, &up);
        let (node_bin, controller_bin) = match &registry {
            Some(r) => {
                let node = pulled(&cp, r, dir, "daemonset/ferrite-daemon", "daemon");
                (node, pulled(&cp, r, dir, "deployment/ferrite-controller", "ferrite"))
            }
            None => (PathBuf::from(BIN), PathBuf::from(BIN)),
        };
        cp.ok(&["apply", "--dry-run=server", "-f", &deploy().join("examples").display().to_string()]);
        // Claims below name this class from the start.
        cp.ok(&["apply", "-f", &deploy().join("examples/volumeattributesclass.yaml").display().to_string()]);

        // No CA and no controller certificate are made by hand: the controller makes them on
        // its first start (`--cluster-certs`, checked in `start_controller`).
        let pki = dir.join("pki");
        // The snapshot-metadata sidecar's server certificate (the pod's address here: the host's),
        // under a CA of its own (the SnapshotMetadataService carries it, as the component's
        // steps have the operator do), and a backup tool's ServiceAccount under the sidecar's
        // upstream client RBAC.
        let smd = dir.join("pki-snapshot-metadata");
        common::csi::certs(&smd, "snapshot-metadata", &["127.0.0.1"]);
        let p = |f: &str| smd.join(f).display().to_string();
        cp.ok(&[
            "create",
            "secret",
            "tls",
            "ferrite-snapshot-metadata-tls",
            "-n",
            NS,
            &format!("--cert={}", p("snapshot-metadata.pem")),
            &format!("--key={}", p("snapshot-metadata-key.pem")),
        ]);
        let ca = sh(&format!("base64 -w0 {}", p("ca.pem")));
        let patch = json!({"spec": {"caCert": ca.trim()}}).to_string();
        cp.merge_patch("snapshotmetadataservice", "csi.ferrite.dev", &patch);
        cp.ok(&["create", "namespace", "backup-app-namespace"]);
        for r in ["service-account", "cluster-role", "cluster-role-binding"] {
            let f = up.join(format!("rbac/csi-snapshot-metadata-client-{r}.yaml"));
            cp.ok(&["apply", "-n", "backup-app-namespace", "-f", &f.display().to_string()]);
        }

        let store = backup::store(&cp, &sw.gateway, dir);
        let mut c = Self {
            cp,
            sw,
            nodes: Vec::new(),
            daemon_pods: Vec::new(),
            plugin_pods: Vec::new(),
            controller: None,
            daemons: Vec::new(),
            sidecars: Vec::new(),
            pki,
            loops: Vec::new(),
            store,
            _registry: registry,
            node_bin,
            controller_bin,
        };
        for n in NODES {
            c.join(dir, n);
        }
        // The pool files keep 2G free rather than 10% of a disk other tests share.
        let mut cm = c.cp.get(&["configmap", "ferrite-daemon", "-n", NS]);
        let text = cm["data"]["ferrite.toml"].as_str().unwrap().to_owned();
        assert!(text.contains("pool-size = \"auto\"\npool-reserve = \"10%\""), "{text}");
        cm["data"]["ferrite.toml"] = json!(text.replace("pool-reserve = \"10%\"", "pool-reserve = \"2G\""));
        cm["metadata"].as_object_mut().unwrap().retain(|k, _| k == "name" || k == "namespace");
        c.cp.apply(&cm.to_string());
        // A missing certificate is replaced within seconds here (the renewal test below).
        c.set_arg("daemonset/ferrite-daemon", "cert-renew", "--check-every=300", &["--check-every=2"]);
        // And a node's new names (storage_nodes.rs: a node without storage labelled so).
        c.set_arg("daemonset/ferrite-node-plugin", "cert-renew", "--check-every=300", &["--check-every=2"]);
        // Failover waits 20 s as shipped; the tier's nodes are lost on purpose. The out-of-service
        // taint is off as shipped: (a) turns it on, as an operator with power fencing would.
        let failover_after = format!("--failover-after={}", FAILOVER_AFTER.as_secs());
        // Replication may push to node-b, as the operator lists it for the shipped class.
        let args = [failover_after.as_str(), "--out-of-service-taint=true", "--replication-peer=node-b=node:node-b"];
        c.set_arg("deployment/ferrite-controller", "ferrite", "--failover-after=20", &args);
        // The controller first: it signs the certificates the daemons' init containers ask for.
        c.start_controller();
        for i in 0..NODES.len() {
            c.start_node_pods(i);
        }
        c.listed();
        c
    }

    /// The install was one apply: the controller made the cluster CA and its own certificate in
    /// Secrets, wrote them to its in-memory volumes (the key 0600, its user's), and set the drain
    /// guard's caBundle. The test takes the CA from its Secret (as an admin could) to issue the
    /// certificates its own clients use (a controller identity, operators').
    fn cluster_certs(&mut self, pod: &Pod) {
        let key = PathBuf::from(pod.rewrite(pod.container("ferrite"), "/etc/ferrite/tls/tls.key"));
        self.cp.wait("the controller to make its certificate", LONG, |_| key.exists());
        let cp = &self.cp;
        let meta = std::fs::metadata(&key).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o600, "tls.key");
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 65532, "the key is the controller's user's");
        let field = |secret: &str, key: &str| {
            let s = cp.get(&["secret", secret, "-n", NS]);
            base64(s["data"][key].as_str().unwrap_or_else(|| panic!("{secret} has no {key}")))
        };
        let ca = field("ferrite-ca", "ca.crt");
        assert_eq!(field("ferrite-controller-tls", "ca.crt"), ca);
        let cert = ferrite_tls::certs_from_pem(&String::from_utf8(field("ferrite-controller-tls", "tls.crt")).unwrap())
            .unwrap();
        let names = ferrite_tls::identities(&cert[0]);
        assert_eq!(names, ["spiffe://ferrite.dev/controller", "ferrite-controller", "ferrite-controller.ferrite.svc"]);
        let hook = cp.get(&["validatingwebhookconfiguration", "ferrite-drain-guard"]);
        assert_eq!(base64(hook["webhooks"][0]["clientConfig"]["caBundle"].as_str().unwrap()), ca, "the caBundle");
        std::fs::create_dir_all(&self.pki).unwrap();
        std::fs::set_permissions(&self.pki, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        std::fs::write(self.pki.join("ca.pem"), &ca).unwrap();
        let key = self.pki.join("ca-key.pem");
        std::fs::write(&key, field("ferrite-ca", "ca.key")).unwrap();
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        common::csi::certs(&self.pki, "ferrite-controller", &["spiffe://ferrite.dev/controller"]);
    }

    /// Replaces argument `from` of `container` in the pod template of `workload` (`kind/name`)
    /// by `to`, as an operator's patch would.
    fn set_arg(&mut self, workload: &str, container: &str, from: &str, to: &[&str]) {
        let mut w = self.cp.get(&[workload, "-n", NS]);
        let containers = w["spec"]["template"]["spec"]["containers"].as_array_mut().unwrap();
        let c = containers.iter_mut().find(|c| c["name"] == container).unwrap();
        let args = c["args"].as_array_mut().unwrap();
        let at = args.iter().position(|a| a == from).unwrap_or_else(|| panic!("{workload} {container} has {from}"));
        args.splice(at..=at, to.iter().map(|a| json!(a)));
        w["metadata"].as_object_mut().unwrap().retain(|k, _| k == "name" || k == "namespace");
        self.cp.apply(&w.to_string());
    }

    /// Node `name` joins: its Node object, its daemon and node plugin pods (whose init container
    /// has the node's certificate issued by the cluster).
    fn add_node(&mut self, dir: &Path, name: &str) {
        self.join(dir, name);
        self.start_node_pods(self.nodes.len() - 1);
    }

    /// Node `name`'s Node object (what the kubelet publishes, and what the administrator adds:
    /// node-c's pool is a device its annotation names, formatted on opt-in). The switch has a
    /// host for it.
    fn join(&mut self, dir: &Path, name: &str) {
        let i = self.nodes.len();
        let node = Node {
            name: name.to_owned(),
            root: dir.join("nodes").join(name),
            ip: self.sw.ip[i].clone(),
            netns: self.sw.ns[i].clone(),
        };
        if i == DEVICE_NODE {
            self.loops.push(Loop::new(&dir.join("node-c-pool.img"), "2G"));
        }
        self.nodes.push(node);
        self.register(i);
    }

    /// Node `i`'s pods of each DaemonSet that runs there (the DaemonSet controller's choice).
    fn start_node_pods(&mut self, i: usize) {
        let node = self.cp.get(&["node", &self.nodes[i].name]);
        if runs_on(&self.cp.get(&["daemonset", "ferrite-daemon", "-n", NS]), &node) {
            let d = self.start_daemon_pod(i);
            self.daemon_pods.push(d);
            self.daemons.push(Daemon { dir: self.nodes[i].host("/run/ferrite"), child: None });
        }
        assert!(
            runs_on(&self.cp.get(&["daemonset", "ferrite-node-plugin", "-n", NS]), &node),
            "the node plugin runs everywhere"
        );
        let p = self.start_plugin_pod(i);
        self.plugin_pods.push(p);
    }

    /// Node `i`'s Node object, as its kubelet registers it: one zone per node of NODES, and
    /// the nodes that join later in those three ([`zone_of`]); the storage label on every node but
    /// node-e (which holds no storage); node-d is a control-plane node (its taint).
    fn register(&mut self, i: usize) {
        let name = &self.nodes[i].name;
        let annotations = match i {
            DEVICE_NODE => json!({"pool.ferrite.dev/device": self.loops[0].0, "pool.ferrite.dev/format": "true"}),
            _ => json!({}),
        };
        let zone = format!("zone-{}", zone_of(name));
        let mut labels = json!({"kubernetes.io/hostname": name, "topology.ferrite.dev/node": name,
            "topology.kubernetes.io/zone": zone, "topology.kubernetes.io/region": "lab"});
        if name != "node-e" {
            labels[STORAGE_LABEL] = json!("true");
        }
        let taints = match name.as_str() {
            "node-d" => json!([{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]),
            _ => json!([]),
        };
        self.cp.apply(
            &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "annotations": annotations,
                "labels": labels}, "spec": {"taints": taints}})
            .to_string(),
        );
        let addresses = json!({"status": {"addresses": [{"type": "InternalIP", "address": self.nodes[i].ip}]}});
        self.cp.ok(&["patch", "node", name, "--subresource=status", "--type=merge", "-p", &addresses.to_string()]);
    }

    /// Waits for the node Service's EndpointSlices (the controller's directory) to list every
    /// node that runs a daemon.
    fn listed(&mut self) {
        let names: Vec<String> = self.daemon_pods.iter().map(|p| p.node.name.clone()).collect();
        self.cp.wait("the node Service's EndpointSlices to list every node", LONG, |cp| {
            let s = cp.get(&["endpointslices", "-n", NS, "-l", "kubernetes.io/service-name=ferrite-node"]);
            let listed = s["items"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default());
            let listed: Vec<String> = listed.filter_map(|e| e["nodeName"].as_str().map(str::to_owned)).collect();
            names.iter().all(|n| listed.contains(n))
        });
    }

    /// The data-path DaemonSet's pod on node `i`: its init container, then the daemon (host
    /// network: the node's namespace), ready when its readiness probe passes.
    fn start_daemon_pod(&mut self, i: usize) -> Pod {
        let node = &self.nodes[i];
        let ds = self.cp.get(&["daemonset", "ferrite-daemon", "-n", NS]);
        let tpl = &ds["spec"]["template"];
        let name = format!("ferrite-daemon-{}-{}", node.name, self.cp.names().len());
        let pod = Pod::run(&self.cp, NS, &name, tpl, node, Some(owner(&ds)), &node.ip);
        let (env, _) = self.init_containers(&pod, "ferrite-daemon");
        let node = &self.nodes[i];
        for c in tpl["spec"]["containers"].as_array().unwrap() {
            match c["name"].as_str().unwrap() {
                "daemon" => pod.start(&mut self.cp, "daemon", &self.node_bin, &[], &[], true),
                "cert-renew" => {
                    pod.start(&mut self.cp, "cert-renew", &self.node_bin, &[], &env, false);
                    self.sidecars.push(pod.log_path("cert-renew"));
                }
                // The storage heartbeat reaches the API server from the node, as a pod does.
                "heartbeat" => {
                    let cmd = pod.command("heartbeat", &self.node_bin, &[], &[], false);
                    let at = Some((node.netns.as_str(), self.sw.gateway.as_str()));
                    let bound = (pod.name(), pod.uid());
                    self.cp.spawn_in_bound_pod(&pod.process("heartbeat"), &cmd, (NS, "ferrite-daemon"), bound, at);
                    self.sidecars.push(pod.log_path("heartbeat"));
                }
                other => panic!("the daemon pod has a container the tier does not know: {other}"),
            }
        }
        let what = format!("the daemon on {} to pass its readiness probe", self.nodes[i].name);
        let bin = self.node_bin.clone();
        self.cp.wait(&what, LONG, |_| pod.ready("daemon", &bin, true));
        pod
    }

    /// Restarts container `name` of node `i`'s node plugin pod, as its kubelet does when it exits.
    fn restart_sidecar(&mut self, i: usize, name: &str) {
        let process = self.plugin_pods[i].process(name);
        self.cp.kill(&process);
        match name {
            "csi-addons" => start_addons_sidecar(&mut self.cp, &self.sw.gateway, &self.plugin_pods[i]),
            other => panic!("no restart for {other}"),
        }
    }

    /// Runs `pod`'s init containers to their end, as ServiceAccount `sa` (the token the kubelet
    /// projects into the pod, bound to it). Returns the environment that gives a container that
    /// token: outside the node's namespace (the API server on this host's loopback), and inside
    /// it (the API server on the switch's gateway).
    fn init_containers(&mut self, pod: &Pod, sa: &str) -> (Env, Env) {
        let file = format!("{}.kubeconfig", pod.name());
        let kc = self.cp.pod_token_kubeconfig(NS, sa, pod.name(), pod.uid(), &file);
        let port = self.cp.server.rsplit(':').next().unwrap();
        let text = std::fs::read_to_string(&kc).unwrap();
        let in_node = kc.with_extension("in-node");
        std::fs::write(&in_node, text.replace(&self.cp.server, &format!("https://{}:{port}", self.sw.gateway)))
            .unwrap();
        let env = |kc: &Path| vec![("KUBECONFIG".to_owned(), kc.display().to_string())];
        let node = &pod.node.name;
        for init in pod.template["spec"]["initContainers"].as_array().into_iter().flatten() {
            let name = init["name"].as_str().unwrap();
            let o = pod.run_to_end(name, &self.node_bin, &env(&kc), false);
            println!("   {node} init {name}: {}", String::from_utf8_lossy(&o.stdout).trim());
            assert!(o.status.success(), "init container {name} on {node}: {}", String::from_utf8_lossy(&o.stderr));
        }
        (env(&kc), env(&in_node))
    }

    /// The node plugin DaemonSet's pod on node `i` (its own network: the node's namespace stands
    /// for it), its registration socket and liveness endpoint up, and the CSINode the kubelet
    /// then writes.
    fn start_plugin_pod(&mut self, i: usize) -> Pod {
        let node = self.nodes[i].clone();
        let ds = self.cp.get(&["daemonset", "ferrite-node-plugin", "-n", NS]);
        let tpl = &ds["spec"]["template"];
        let name = format!("ferrite-node-plugin-{}-{}", node.name, self.cp.names().len());
        let pod = Pod::run(&self.cp, NS, &name, tpl, &node, Some(owner(&ds)), &node.ip);
        let (env, in_node) = self.init_containers(&pod, "ferrite-node");
        for c in tpl["spec"]["containers"].as_array().unwrap() {
            let cname = c["name"].as_str().unwrap();
            let program = match cname {
                // It reads its Node (a storage node?) from the node's network namespace.
                "ferrite-csi" => {
                    pod.start(&mut self.cp, cname, &self.node_bin, &[], &in_node, true);
                    continue;
                }
                "cert-renew" => {
                    pod.start(&mut self.cp, cname, &self.node_bin, &[], &env, false);
                    self.sidecars.push(pod.log_path(cname));
                    continue;
                }
                "node-driver-registrar" => self.cp.bin.join("csi-node-driver-registrar"),
                "liveness-probe" => self.cp.bin.join("livenessprobe"),
                "csi-addons" => {
                    start_addons_sidecar(&mut self.cp, &self.sw.gateway, &pod);
                    self.sidecars.push(pod.log_path(cname));
                    continue;
                }
                other => panic!("the node plugin pod has a container the tier does not know: {other}"),
            };
            pod.start(&mut self.cp, cname, &program, &[], &[], true);
        }
        let reg = node.host("/var/lib/kubelet/plugins_registry").join("csi.ferrite.dev-reg.sock");
        let url = format!("{}:9818", node.ip);
        self.cp.wait(
            &format!("the node plugin on {} to register and pass its liveness probe", node.name),
            LONG,
            |_| reg.exists() && healthz(&url),
        );
        self.cp.apply(
            &json!({"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": {"name": node.name},
                "spec": {"drivers": [{"name": "csi.ferrite.dev", "nodeID": node.name,
                    "topologyKeys": ["topology.ferrite.dev/node"], "allocatable": {"count": 128}}]}})
            .to_string(),
        );
        pod
    }

    /// The controller Deployment's pod (a ReplicaSet and a pod owned as the Deployment's
    /// controllers would make them) on node-a, and its containers, each as the pod's user.
    fn start_controller(&mut self) {
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
        let pod = Pod::run(cp, NS, "ferrite-controller-1-x", tpl, &self.nodes[0], Some(owner), &self.sw.gateway);
        let (uid, _, groups) = pod.user(pod.container("ferrite")).expect("the controller pod names its user");
        assert!(uid != 0 && groups.contains(&65532), "the controller runs as its image's user, with the fsGroup");
        let first = !self.pki.join("ca.pem").exists();
        for c in tpl["spec"]["containers"].as_array().unwrap() {
            let name = c["name"].as_str().unwrap();
            let program = match name {
                "ferrite" => self.controller_bin.clone(),
                "csi-provisioner" | "csi-resizer" | "csi-snapshotter" | "csi-attacher" | "csi-snapshot-metadata" => {
                    cp.bin.join(name)
                }
                "csi-addons" => cp.bin.join("csi-addons-sidecar"),
                "liveness-probe" => cp.bin.join("livenessprobe"),
                other => panic!("the controller pod has a container the tier does not know: {other}"),
            };
            // The ServiceAccount token a pod would have, as a kubeconfig its user may read.
            let kc = cp.token_kubeconfig(NS, "ferrite-controller", &format!("{name}.kubeconfig"));
            std::os::unix::fs::chown(&kc, Some(0), Some(65532)).unwrap();
            std::fs::set_permissions(&kc, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
            let kc = kc.display().to_string();
            let (mut extra, mut env) = (Vec::new(), Vec::new());
            match name {
                "ferrite" => env.push(("KUBECONFIG".to_owned(), kc)),
                // The CSI-Addons sidecar takes only the in-cluster configuration.
                "csi-addons" | "liveness-probe" => {}
                _ => extra.push(format!("--kubeconfig={kc}")),
            }
            if name != "ferrite" && name != "liveness-probe" {
                self.sidecars.push(pod.log_path(name));
            }
            let mut cmd = pod.command(name, &program, &extra, &env, false);
            if name == "csi-provisioner" {
                // Capacity objects are owned by the Deployment (through the pod and ReplicaSet).
                assert!(cmd.get_args().any(|a| a == "--capacity-ownerref-level=2"));
            }
            if name == "csi-addons" {
                cp.spawn_in_pod(&pod.process(name), &cmd, NS, "ferrite-controller", None);
            } else {
                cp.spawn_cmd(&pod.process(name), &mut cmd);
            }
        }
        if first {
            self.cluster_certs(&pod);
        }
        self.controller = Some(pod);
        // The cluster-wide controllers, each under its upstream ServiceAccount and RBAC.
        let cp = &mut self.cp;
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
        self.sidecars.push(cp.dir.join("snapshot-controller.log"));
        // The manager calls the sidecars with the token a pod has; it runs as in a pod.
        let probe = format!("--health-probe-bind-address=127.0.0.1:{}", common::csi::free_port("127.0.0.1"));
        let mut manager = Command::new(cp.bin.join("csi-addons-manager"));
        manager.args(["--namespace=csi-addons-system", &probe, "--metrics-bind-address=0"]);
        cp.spawn_in_pod("csi-addons-manager", &manager, "csi-addons-system", "csi-addons-controller-manager", None);
        self.sidecars.push(cp.dir.join("csi-addons-manager.log"));
        cp.wait("the CSI-Addons manager to connect to the controller's sidecar", LONG, |cp| {
            let n = cp.get(&["csiaddonsnodes", "-n", NS]);
            n["items"].as_array().unwrap().iter().any(|n| n["status"]["state"] == "Connected")
        });
    }

    /// What the DaemonSet controller and the kubelet do after a DaemonSet's template changed:
    /// a RollingUpdate DaemonSet's pods are replaced one node at a time; an OnDelete one's are
    /// left until someone deletes them. Returns the DaemonSets rolled.
    fn roll_daemonsets(&mut self) -> Vec<&'static str> {
        let mut rolled = Vec::new();
        for ds in ["ferrite-daemon", "ferrite-node-plugin"] {
            let d = self.cp.get(&["daemonset", ds, "-n", NS]);
            let (template, strategy) = (&d["spec"]["template"], &d["spec"]["updateStrategy"]["type"]);
            for i in 0..NODES.len() {
                let pods = if ds == "ferrite-daemon" { &self.daemon_pods } else { &self.plugin_pods };
                if pods[i].template == *template || strategy == "OnDelete" {
                    continue;
                }
                assert_eq!(strategy, "RollingUpdate", "{ds}");
                let old = pods[i].name().to_owned();
                pods[i].kill(&mut self.cp);
                self.cp.ok(&["delete", "pod", &old, "-n", NS, "--wait=false"]);
                if ds == "ferrite-daemon" {
                    self.daemon_pods[i] = self.start_daemon_pod(i);
                } else {
                    self.plugin_pods[i] = self.start_plugin_pod(i);
                }
                if !rolled.contains(&ds) {
                    rolled.push(ds);
                }
            }
        }
        rolled
    }
}

/// The zone of node `name`: one per node of NODES; node-d and node-e (which join late) in
/// node-c's; the zone-loss scenario's four in a's and b's (three nodes a zone).
fn zone_of(name: &str) -> &'static str {
    match name {
        "node-a" | "node-f" | "node-g" => "a",
        "node-b" | "node-h" | "node-i" => "b",
        _ => "c",
    }
}

/// A node plugin pod's CSI-Addons sidecar: it reads the in-cluster configuration (the pod's
/// bound token, which names its pod and node for the policy `ferrite-node-csi-addons`; the API
/// server by address: the switch's `gateway`).
fn start_addons_sidecar(cp: &mut ControlPlane, gateway: &str, pod: &Pod) {
    let cmd = pod.command("csi-addons", &cp.bin.join("csi-addons-sidecar"), &[], &[], false);
    let (account, bound) = ((NS, "ferrite-node"), (pod.name(), pod.uid()));
    cp.spawn_in_bound_pod(&pod.process("csi-addons"), &cmd, account, bound, Some((&pod.node.netns, gateway)));
}

/// Environment variables of a container.
type Env = Vec<(String, String)>;

/// The label that makes a node a storage node (the daemon DaemonSet's nodeSelector).
const STORAGE_LABEL: &str = "storage.ferrite.dev/node";

/// The tolerations the DaemonSet controller gives every pod it makes.
const DAEMONSET_TOLERATES: [&str; 7] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/pid-pressure",
    "node.kubernetes.io/unschedulable",
    "node.kubernetes.io/network-unavailable",
];

/// Whether the DaemonSet controller places a pod of `ds` on `node`: the pod template's
/// nodeSelector matches the Node's labels, and it tolerates each NoSchedule and NoExecute taint.
fn runs_on(ds: &Value, node: &Value) -> bool {
    let spec = &ds["spec"]["template"]["spec"];
    let labels = &node["metadata"]["labels"];
    let selected = spec["nodeSelector"].as_object().is_none_or(|s| s.iter().all(|(k, v)| labels[k] == *v));
    let tolerations = spec["tolerations"].as_array().cloned().unwrap_or_default();
    let tolerated = |t: &Value| {
        DAEMONSET_TOLERATES.iter().any(|k| t["key"] == *k)
            || tolerations.iter().any(|x| {
                let key = x["key"].is_null() || x["key"] == t["key"];
                let value = x["operator"] == "Exists" || x["value"] == t["value"];
                key && value && (x["effect"].is_null() || x["effect"] == t["effect"])
            })
    };
    let taints = node["spec"]["taints"].as_array().cloned().unwrap_or_default();
    selected && taints.iter().filter(|t| t["effect"] != "PreferNoSchedule").all(tolerated)
}

/// The kubelet's HTTP liveness probe: GET /healthz at `addr` answers 200.
fn healthz(addr: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut reply = String::new();
    s.write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n").is_ok()
        && s.read_to_string(&mut reply).is_ok()
        && reply.starts_with("HTTP/1.")
        && reply.split(' ').nth(1) == Some("200")
}

/// The owner reference its controller gives a pod of `object` (a DaemonSet).
fn owner(object: &Value) -> Value {
    json!({"apiVersion": object["apiVersion"], "kind": object["kind"], "name": object["metadata"]["name"],
        "uid": object["metadata"]["uid"], "controller": true})
}

/// What an operator relies on in every workload of the manifests, as applied: each container
/// asks for its CPU and memory (the scheduler places it, nothing starves it), each sidecar image
/// is the version the tier runs (the kit's build script names them), and the snapshot-metadata
/// sidecar's Secret is optional so that it does not hold the controller pod.
fn workloads_as_shipped(cp: &ControlPlane, up: &Path) {
    // Only the controller may write the failover Lease (the node plugins' CSI-Addons sidecars
    // elect no leader: their account has no Lease rights in the driver's namespace).
    for (account, may) in [("ferrite-controller", "yes"), ("ferrite-node", "no")] {
        let out = cp.kubectl(&[
            "auth",
            "can-i",
            "update",
            "leases/ferrite-failover",
            "-n",
            NS,
            "--as",
            &format!("system:serviceaccount:{NS}:{account}"),
        ]);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), may, "{account} may update the failover Lease");
    }
    // A daemon's planned restart never outlasts its heartbeat's restart grace: a slow stop
    // (SIGKILL at terminationGracePeriodSeconds) plus a minute to start is not a lost node.
    let ds = cp.get(&["daemonset", "ferrite-daemon", "-n", NS]);
    let stop = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap();
    let help = Command::new(common::BIN).args(["heartbeat", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let grace = help.split("--restart-grace").nth(1).and_then(|h| h.split("[default: ").nth(1)).unwrap();
    let grace: u64 = grace.split(']').next().unwrap().parse().unwrap();
    assert!(stop + 60 <= grace, "terminationGracePeriodSeconds {stop} + 60 s outlasts the restart grace {grace} s");
    // Its preStop hook (the hand-over of its primaries) leaves the daemon its 150 s to stop.
    let containers = ds["spec"]["template"]["spec"]["containers"].as_array().unwrap();
    let daemon = containers.iter().find(|c| c["name"] == "daemon").unwrap();
    let hook: Vec<&str> = daemon["lifecycle"]["preStop"]["exec"]["command"]
        .as_array()
        .expect("the daemon container has a preStop hook")
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(hook[..3], ["ferrite", "replica", "hand-over"], "{hook:?}");
    let wait: u64 = hook.iter().find_map(|a| a.strip_prefix("--timeout=")).unwrap().parse().unwrap();
    assert!(wait + 150 <= stop, "the preStop hook's {wait} s leave the daemon less than 150 s of {stop} s to stop");
    let images = common::kube::sidecar_versions(&std::fs::read_to_string(up.join("build.sh")).unwrap());
    for (kind, name) in
        [("deployment", "ferrite-controller"), ("daemonset", "ferrite-daemon"), ("daemonset", "ferrite-node-plugin")]
    {
        let w = cp.get(&[kind, name, "-n", NS]);
        let spec = &w["spec"]["template"]["spec"];
        let all = spec["initContainers"].as_array().into_iter().chain(spec["containers"].as_array()).flatten();
        for c in all {
            let what = format!("{name}/{}", c["name"].as_str().unwrap());
            let req = &c["resources"]["requests"];
            assert!(req["cpu"].is_string() && req["memory"].is_string(), "{what} asks for no CPU or memory: {c}");
            let image = c["image"].as_str().unwrap();
            let (repo, tag) = image.rsplit_once(':').unwrap();
            let base = repo.rsplit('/').next().unwrap();
            if let Some((_, tested)) = images.iter().find(|(b, _)| *b == base) {
                assert_eq!(tag, tested, "{what}: {image} is not the version the tier tests");
            } else {
                assert!(base.starts_with("ferrite"), "{what}: {image} is no image the tier knows");
            }
        }
        if kind == "daemonset" {
            let t = spec["tolerations"].as_array().unwrap();
            let cp =
                json!({"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"});
            assert!(t.contains(&cp), "{name}: the tolerations component admits control-plane nodes: {t:?}");
        }
        for v in spec["volumes"].as_array().unwrap() {
            if v["secret"]["secretName"] == "ferrite-snapshot-metadata-tls" {
                assert_eq!(v["secret"]["optional"], true, "the snapshot-metadata Secret holds the controller pod");
            }
        }
    }
}

/// Ferrite's images, written by deploy/images.py from this build, pushed to a registry the test
/// starts, which the copy of the manifests (`copy`) is set to. None (the test build's binary is
/// run instead) where the image tools are missing outside CI.
fn images(dir: &Path, copy: &Path) -> Option<common::images::Registry> {
    use common::images::{Registry, build, stripped};
    if !["python3", "strip", "umoci", "skopeo", "docker-registry"].iter().all(|t| common::have(t)) {
        return None;
    }
    println!("== Ferrite's images, built by deploy/images.py and pushed to a registry");
    let out = dir.join("images");
    let version = env!("CARGO_PKG_VERSION");
    let built = build(&stripped(dir), &out, version);
    let registry = Registry::start(dir);
    for (name, _) in &built {
        registry.push(&out.join(name), version, name);
    }
    let k = copy.join("components/registry/kustomization.yaml");
    let text = std::fs::read_to_string(&k).unwrap();
    std::fs::write(&k, text.replace("registry=ferrite-registry.invalid", &format!("registry={}", registry.at)))
        .unwrap();
    Some(registry)
}

/// The `ferrite` of the image `workload`'s (`kind/name`) `container` names, as a kubelet gets
/// it: the tag resolved to a digest, pulled by digest, unpacked.
fn pulled(
    cp: &ControlPlane,
    registry: &common::images::Registry,
    dir: &Path,
    workload: &str,
    container: &str,
) -> PathBuf {
    let w = cp.get(&[workload, "-n", NS]);
    let containers = w["spec"]["template"]["spec"]["containers"].as_array().unwrap();
    let c =
        containers.iter().find(|c| c["name"] == container).unwrap_or_else(|| panic!("{workload} has no {container}"));
    let image = c["image"].as_str().unwrap().to_owned();
    assert!(image.starts_with(&format!("{}/", registry.at)), "{workload} names {image}, not from the registry");
    let digest = registry.digest(&image);
    let repo = image.rsplit_once(':').unwrap().0;
    let out = dir.join(format!("pulled-{}", workload.replace('/', "-")));
    let rootfs = registry.pull(&format!("{repo}@{digest}"), &out);
    println!("   {workload}: {image} is {digest}");
    rootfs.join("usr/bin/ferrite")
}

/// Node-d joined after the install: its certificate came through the CertificateSigningRequest
/// API with nobody copying a file (it already serves: the copy replaced onto it used it), for its
/// own names. Its daemon pod's token is refused a certificate for another node's names, and a
/// token bound to no pod is refused any.
fn certificates_by_the_cluster(c: &mut Cluster, dir: &Path) {
    println!("== a node that joined late got its certificate from the cluster, for its own names only");
    let d = c.nodes.iter().position(|n| n.name == "node-d").unwrap();
    let tls = c.nodes[d].host("/etc/ferrite/tls");
    let cert = ferrite_tls::load_certs(&tls.join("tls.crt")).unwrap();
    assert_eq!(ferrite_tls::identities(&cert[0]), ["node-d", c.nodes[d].ip.as_str(), "ferrite-node.ferrite.svc"]);
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(tls.join("tls.key")).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the node's key is private");
    let pod = &c.daemon_pods[d];
    let forged = c.cp.pod_token_kubeconfig(NS, "ferrite-daemon", pod.name(), pod.uid(), "node-d-forged.kubeconfig");
    let unbound = c.cp.token_kubeconfig(NS, "ferrite-daemon", "unbound-daemon.kubeconfig");
    for (kc, node, why) in [(&forged, "node-a", "not CN=node-d"), (&unbound, "node-d", "not bound to a pod")] {
        let out = dir.join(format!("forged-{node}"));
        let o = Command::new(BIN)
            .args(["node-cert", &format!("--node={node}"), &format!("--dir={}", out.display()), "--wait=60"])
            .env("KUBECONFIG", kc)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        println!("   {node} asked with {}: {}", kc.display(), err.trim());
        assert!(!o.status.success() && err.contains("was denied") && err.contains(why), "{err}");
        assert!(!out.join("tls.crt").exists(), "no certificate was written");
    }
}

/// The certificate `addr` presents, by a TLS handshake with the CA `ca` (and a client identity).
fn presented(addr: &str, ca: &Path, identity: (&Path, &Path)) -> Vec<u8> {
    let cfg = ferrite_tls::client_config(ca, Some(identity), &[b"h2"]).unwrap();
    let name = ferrite_tls::server_name(addr).unwrap();
    let mut conn = ferrite_tls::rustls::ClientConnection::new(cfg, name).unwrap();
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp).unwrap();
    }
    conn.peer_certificates().unwrap()[0].to_vec()
}

/// A claim of `class` on `node` (the scheduler's choice for a WaitForFirstConsumer claim), from
/// `source` (a dataSource) if given, labelled `labels`, `extra` merged into its spec.
fn claim(cp: &ControlPlane, name: &str, node: &str, size: &str, source: Option<Value>, labels: Value, extra: Value) {
    let mut spec = json!({"storageClassName": "ferrite-ext4", "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": size}}});
    if let Some(s) = source {
        spec["dataSource"] = s;
    }
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
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
        &self.daemons[self.daemon_index(node)]
    }

    /// Where node `node`'s daemon (and its pod) is in `daemons` (and `daemon_pods`): nodes
    /// without storage have none.
    fn daemon_index(&self, node: &str) -> usize {
        self.daemon_pods.iter().position(|p| p.node.name == node).unwrap_or_else(|| panic!("{node} runs no daemon"))
    }

    fn wait_field(&mut self, what: &str, args: &[&str], ok: impl Fn(&Value) -> bool) -> Value {
        let mut last = Value::Null;
        self.cp.wait(what, LONG, |cp| {
            last = cp.get(args);
            ok(&last)
        });
        last
    }

    /// Every log of the daemons' pods.
    fn daemon_logs(&self) -> String {
        self.daemon_pods.iter().map(|p| p.log("daemon")).collect()
    }
}

fn volumes(d: &Daemon) -> Vec<String> {
    d.json(&["volume", "list"]).as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_owned()).collect()
}

/// How long the tier's controller waits before failing a lost node's volumes over.
const FAILOVER_AFTER: Duration = Duration::from_secs(4);

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| u8::try_from((i * 7 + i / 4096) % 251).unwrap()).collect()
}

#[test]
fn ferrite_on_kubernetes() {
    let Some(bin) = binaries() else { return };
    // Spare hosts for the nodes that join late: node-d (failover (i)), node-e (no storage).
    // NODES, node-d and node-e joining later, the zone-loss scenario's four.
    let Some(sw) = Switch::new(NODES.len() + 6) else { return };
    if !common::have("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(dir.path(), &bin, sw);

    println!("== each node's pool: node-c's is the device its annotation names, formatted on opt-in");
    let dev = c.loops[0].0.clone();
    assert_eq!(c.daemon("node-c").json(&["pool", "status"])["path"], dev.as_str());
    for n in ["node-a", "node-b"] {
        let status = c.daemon(n).json(&["pool", "status"]);
        let path = status["path"].as_str().unwrap().to_owned();
        assert!(path.ends_with("var/lib/ferrite/pool.img"), "{n}: {path}");
        // pool-size "auto": the filesystem's free space less the reserve (2G here), never more
        // (give or take what the tests beside this one wrote since).
        let fs = sh(&format!("df -B1 --output=avail {} | tail -1", Path::new(&path).parent().unwrap().display()));
        let avail: u64 = fs.trim().parse().unwrap();
        let file = std::fs::metadata(&path).unwrap().len();
        assert!(file > 0 && file <= avail + (4 << 30) - (2 << 30), "{n}: a {file}-byte pool with {avail} free");
    }
    println!("== the daemons listen on their node's address, not on every interface");
    for node in &c.nodes {
        let listening = sh(&format!("ip netns exec {} ss -ltnH", node.netns));
        for port in [":7070", ":10809", ":9200"] {
            let on: Vec<&str> =
                listening.lines().filter_map(|l| l.split_whitespace().nth(3)).filter(|a| a.ends_with(port)).collect();
            assert_eq!(on, [format!("{}{port}", node.ip)], "{}: {listening}", node.name);
        }
    }
    pool_refusals(&mut c, dir.path());
    trust::ca_kept(&mut c);

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
    claim(&c.cp, "data", "node-a", "64Mi", None, json!({"app": "shop"}), json!({}));
    claim(&c.cp, "logs", "node-b", "32Mi", None, json!({}), json!({}));
    // A claim that names a VolumeAttributesClass from the start (the provisioner reads it).
    claim(&c.cp, "gold", "node-c", "32Mi", None, json!({}), json!({"volumeAttributesClassName": "ferrite-gold"}));
    // A replicated class: a copy on every node, the primary where the scheduler put the claim.
    // The shipped class, its lost copies replaced after 20 s rather than minutes (failover (i)),
    // one copy per zone.
    let mut class = c.cp.get(&["storageclass", "ferrite-replicated"]);
    assert_eq!(class["parameters"]["replace-after"], "10m", "{class}");
    class["parameters"]["replace-after"] = json!("20s");
    class["parameters"]["zoneSpread"] = json!("required");
    for n in NODES {
        let s = c.daemon(n).json(&["pool", "status"]);
        assert_eq!((&s["zone"], &s["region"]), (&json!(format!("zone-{}", &n[5..])), &json!("lab")), "{n}: {s}");
    }
    class["metadata"].as_object_mut().unwrap().retain(|k, _| k == "name");
    c.cp.ok(&["delete", "storageclass", "ferrite-replicated"]);
    c.cp.apply(&class.to_string());
    claim(&c.cp, "triple", "node-b", "32Mi", None, json!({}), json!({"storageClassName": "ferrite-replicated"}));
    let triple = c.bound("triple");
    let (node, triple_vol) = triple.split_once('/').unwrap();
    assert_eq!(node, "_", "a replicated volume's id names no node: {triple}");
    for n in NODES {
        assert!(volumes(c.daemon(n)).contains(&triple_vol.to_owned()), "{n} holds no copy of {triple_vol}");
    }
    let s = c.daemon("node-b").json(&["replica", "status", triple_vol]);
    assert_eq!((s["role"].as_str(), s["members"].as_array().map(Vec::len)), (Some("primary"), Some(3)), "{s}");
    // Its pods may run where any copy is; attaching it to node-c moves the primary there.
    let triple_pv = c.cp.get(&["pvc", "triple"])["spec"]["volumeName"].as_str().unwrap().to_owned();
    let terms = c.cp.get(&["pv", &triple_pv])["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"].to_string();
    assert!(NODES.iter().all(|n| terms.contains(n)), "{terms}");
    let start = std::time::Instant::now();
    loop {
        let s = c.daemon("node-b").json(&["replica", "status", triple_vol]);
        if s["members"].as_array().unwrap().iter().all(|m| m["state"] == "primary" || m["state"] == "in-sync") {
            break;
        }
        assert!(start.elapsed() < LONG, "{triple_vol}'s copies did not get in sync: {s}");
        std::thread::sleep(Duration::from_millis(200));
    }
    c.cp.apply(
        &json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": "triple-c"},
            "spec": {"attacher": "csi.ferrite.dev", "nodeName": "node-c", "source": {"persistentVolumeName": triple_pv}}})
        .to_string(),
    );
    let va = c.wait_field("node-c's attach", &["volumeattachment", "triple-c"], |v| v["status"]["attached"] == true);
    assert_eq!(va["status"]["attachmentMetadata"]["primary"], "node-c", "{}", va["status"]);
    assert_eq!(c.daemon("node-c").json(&["replica", "status", triple_vol])["role"], "primary");
    c.cp.ok(&["delete", "volumeattachment", "triple-c", "--wait=true", "--timeout=60s"]);
    let gold = c.bound("gold");
    let (node, gold_vol) = gold.split_once('/').unwrap();
    assert_eq!(node, "node-c");
    let l = &c.daemon("node-c").json(&["volume", "show", gold_vol])["limits"];
    assert!(l["iops"] == 5000 && l["bps"] == 200 << 20, "the class's limits from the start: {l}");
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
    trust::daemon_claims(&mut c, (triple_vol, &NODES), (data_vol, "node-a"), "node-b");

    let data_vol = data_vol.to_owned();
    let content = pattern(1 << 20);
    let mut s = common::nbd::open(c.daemon("node-a"), &data_vol);
    assert_eq!(common::nbd::write_on(&mut s, 0, &content), 0);
    drop(s);
    c.daemon("node-a").ok(&["export", "stop", &data_vol]);

    println!("== attach: where its copy is, recorded on the daemon serving the volume");
    let data_pv = c.cp.get(&["pvc", "data"])["spec"]["volumeName"].as_str().unwrap().to_owned();
    let attach = |cp: &ControlPlane, name: &str, node: &str| {
        cp.apply(
            &json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": name},
                "spec": {"attacher": "csi.ferrite.dev", "nodeName": node, "source": {"persistentVolumeName": data_pv}}})
            .to_string(),
        );
    };
    attach(&c.cp, "data-a", "node-a");
    let va = c.wait_field("the attacher to publish the volume", &["volumeattachment", "data-a"], |v| {
        v["status"]["attached"] == true
    });
    assert_eq!(va["status"]["attachmentMetadata"]["primary"], "node-a", "{}", va["status"]);
    // Where another node would reach it: the daemon's NBD listener at the node's address.
    assert_eq!(va["status"]["attachmentMetadata"]["nbd"], format!("{}:10809", c.nodes[0].ip).as_str());
    let publication = format!("csi-publish-{data_vol}");
    assert!(c.daemon("node-a").ok(&["export", "list"]).contains(&publication));
    // node-b holds no copy of this local volume: refused whatever its labels say (the volume's
    // context says it is not remote-access).
    attach(&c.cp, "data-b", "node-b");
    let va = c.wait_field("a second node's attach to be refused", &["volumeattachment", "data-b"], |v| {
        v["status"]["attachError"]["message"].is_string()
    });
    let why = va["status"]["attachError"]["message"].as_str().unwrap();
    assert!(why.contains("node node-b holds none") && va["status"]["attached"] != true, "{why}");
    for va in ["data-b", "data-a"] {
        c.cp.ok(&["delete", "volumeattachment", va, "--wait=true", "--timeout=60s"]);
    }
    assert!(!c.daemon("node-a").ok(&["export", "list"]).contains(&publication), "detach ends the publication");

    println!("== snapshot, restore and clone carry the source's data");
    c.cp.apply(
        &json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "snap", "namespace": "default"},
            "spec": {"volumeSnapshotClassName": "ferrite", "source": {"persistentVolumeClaimName": "data"}}})
        .to_string(),
    );
    c.wait_field("the snapshot to be ready", &["volumesnapshot", "snap"], |v| v["status"]["readyToUse"] == true);
    backup_tool(&mut c, &data_vol);
    claim(
        &c.cp,
        "restore",
        "node-a",
        "64Mi",
        Some(json!({"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"})),
        json!({}),
        json!({}),
    );
    claim(
        &c.cp,
        "copy",
        "node-a",
        "64Mi",
        Some(json!({"kind": "PersistentVolumeClaim", "name": "data"})),
        json!({"app": "shop"}),
        json!({}),
    );
    for name in ["restore", "copy"] {
        let handle = c.bound(name);
        let (node, vol) = handle.split_once('/').unwrap();
        assert_eq!(node, "node-a");
        let got = common::nbd::read_image(c.daemon(node), vol, 1 << 20);
        assert!(got == content, "claim {name} does not hold the source's data");
    }
    backup::offsite(&mut c, &data_vol, dir.path());

    println!("== a node certificate lost on the node is issued again through the API, served without a restart");
    let pki = c.pki.clone();
    let (ca, id) = (pki.join("ca.pem"), (pki.join("ferrite-controller.pem"), pki.join("ferrite-controller-key.pem")));
    let addr = format!("{}:7070", c.nodes[0].ip);
    let tls = c.nodes[0].host("/etc/ferrite/tls");
    let leaf = || ferrite_tls::load_certs(&tls.join("tls.crt")).ok().map(|c| c[0].to_vec());
    let old = leaf().unwrap();
    assert!(presented(&addr, &ca, (&id.0, &id.1)) == old);
    let pid = c.cp.pid(&c.daemon_pods[0].process("daemon"));
    std::fs::remove_file(tls.join("tls.crt")).unwrap();
    c.cp.wait("node-a's daemon to present a newly issued certificate", LONG, |_| {
        leaf().is_some_and(|l| l != old && presented(&addr, &ca, (&id.0, &id.1)) == l)
    });
    assert_eq!(c.cp.pid(&c.daemon_pods[0].process("daemon")), pid, "no restart");
    let csrs = c.cp.get(&["csr", "-l", "ferrite.dev/node=node-a"]);
    let csrs = csrs["items"].as_array().unwrap();
    assert!(csrs.len() >= 2, "node-a asked twice: {csrs:?}");
    for r in csrs {
        assert_eq!(r["spec"]["signerName"], "ferrite.dev/node");
        assert_eq!(r["status"]["conditions"][0]["type"], "Approved", "{}", r["status"]);
    }

    println!("== a new node plugin image rolls its DaemonSet; the data path is not touched");
    let fio_vol = "fio";
    c.daemon("node-a").ok(&["volume", "create", fio_vol, "64M"]);
    c.daemon("node-a").ok(&["export", "nbd", fio_vol]);
    let uri = format!("nbd+unix:///{fio_vol}?socket={}", c.daemon("node-a").nbd().display());
    // fio writes and verifies, run after run, for 20 s; any error ends it with a failure.
    let mut fio = Command::new("sh")
        .arg("-c")
        .arg(
            "end=$(( $(date +%s) + 20 )); while [ $(date +%s) -lt $end ]; do \
             fio --name=io --ioengine=nbd --uri=\"$0\" --rw=randwrite --bs=4k --size=16M --iodepth=8 \
             --verify=crc32c --output-format=terse >/dev/null || exit 1; done",
        )
        .arg(&uri)
        .spawn()
        .unwrap();
    let daemons: Vec<u32> = c.daemon_pods.iter().map(|p| c.cp.pid(&p.process("daemon"))).collect();
    let plugins: Vec<u32> = c.plugin_pods.iter().map(|p| c.cp.pid(&p.process("ferrite-csi"))).collect();
    c.cp.ok(&[
        "set",
        "image",
        "daemonset/ferrite-node-plugin",
        "-n",
        NS,
        "node-driver-registrar=ferrite-registry.invalid/sig-storage/csi-node-driver-registrar:v2.16.0",
    ]);
    assert_eq!(c.roll_daemonsets(), ["ferrite-node-plugin"]);
    let after: Vec<u32> = c.daemon_pods.iter().map(|p| c.cp.pid(&p.process("daemon"))).collect();
    assert_eq!(after, daemons, "the data-path daemons were not restarted");
    let rolled: Vec<u32> = c.plugin_pods.iter().map(|p| c.cp.pid(&p.process("ferrite-csi"))).collect();
    assert!(rolled.iter().zip(&plugins).all(|(a, b)| a != b), "every node plugin pod was replaced");
    assert!(fio.wait().unwrap().success(), "fio's writes and verification went on through the roll");
    c.daemon("node-a").ok(&["export", "stop", fio_vol]);
    c.daemon("node-a").ok(&["volume", "delete", fio_vol]);

    println!("== expansion");
    c.cp.merge_patch("pvc", "data", r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#);
    let pv_name = c.cp.get(&["pvc", "data"])["spec"]["volumeName"].as_str().unwrap().to_owned();
    c.wait_field("the PV to grow", &["pv", &pv_name], |v| v["spec"]["capacity"]["storage"] == "128Mi");
    let info = c.daemon("node-a").json(&["volume", "show", &data_vol]);
    assert_eq!(info["size"], 128 << 20, "{info}");

    println!("== a VolumeAttributesClass sets the volume's limits online (ControllerModifyVolume)");
    c.cp.ok(&["apply", "-f", &deploy().join("examples/volumeattributesclass.yaml").display().to_string()]);
    c.cp.merge_patch("pvc", "data", r#"{"spec":{"volumeAttributesClassName":"ferrite-gold"}}"#);
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
    c.cp.merge_patch("networkfence", "fence", r#"{"spec":{"fenceState":"Unfenced"}}"#);
    let nodes: Vec<&Daemon> = c.daemons.iter().collect();
    c.cp.wait("the daemons to lift the fence", LONG, |_| {
        nodes.iter().all(|d| !d.ok(&["fence", "list"]).contains("192.0.2.0/24"))
    });
    let f = c.cp.get(&["networkfence", "fence"]);
    assert_eq!(f["status"]["result"], "Succeeded", "{}", f["status"]);
    // A fence of everyone (whoever asks: the manager here) is refused by the driver, and no
    // daemon fences anything.
    c.cp.apply(
        &json!({"apiVersion": "csiaddons.openshift.io/v1alpha1", "kind": "NetworkFence", "metadata": {"name": "everyone"},
            "spec": {"networkFenceClassName": "ferrite", "fenceState": "Fenced", "cidrs": ["0.0.0.0/0"]}})
        .to_string(),
    );
    let f = c.wait_field("the fence of everyone", &["networkfence", "everyone"], |v| v["status"]["result"].is_string());
    assert_eq!(f["status"]["result"], "Failed", "{}", f["status"]);
    assert!(f["status"]["message"].as_str().unwrap_or("").contains("fence refused"), "{}", f["status"]);
    for d in &c.daemons {
        assert!(!d.ok(&["fence", "list"]).contains("0.0.0.0/0"), "a daemon fenced everyone");
    }
    c.cp.ok(&["delete", "networkfence", "everyone", "--wait=true", "--timeout=120s"]);

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
    // A failed push is retried within seconds; what it said shows if it never succeeds.
    let mut said = String::new();
    c.cp.wait("the first sync to reach node-b", LONG, |_| {
        let r = a.replica(&data_vol);
        if let Some(e) = r["error"].as_str().filter(|e| !e.is_empty() && *e != said) {
            println!("   the push failed: {e}");
            said = e.to_owned();
        }
        r["last_snapshot"].as_str().is_some_and(|s| !s.is_empty())
    });

    failover::node_lost(&mut c, triple_vol, &triple_pv);
    failover::daemon_silent(&mut c, triple_vol, &triple_pv);
    let second = failover::rollout_begins(&mut c);
    let since = failover::takeover(&mut c, &second);
    let cut = failover::partitioned(&mut c, triple_vol, &triple_pv);
    failover::one_loop_at_a_time(&c, &second, cut, since);
    failover::cordoned(&mut c, triple_vol, &triple_pv, Some(&second));
    second.kill(&mut c.cp);
    let deleted = failover::node_deleted(&mut c, triple_vol, &triple_pv);
    c.add_node(dir.path(), "node-d");
    c.listed();
    certificates_by_the_cluster(&mut c, dir.path());
    trust::node_climbs(&mut c, "node-d");
    storage_nodes::tainted_node(&c);
    trust::tenant_attacks(&mut c);
    failover::copy_replaced(&mut c, triple_vol, &triple_pv, deleted, "node-d");
    trust::tenant_gained_nothing(&mut c);
    failover::pv_move_resumed(&mut c, &triple_pv);
    failover::deleted_node_returns(&mut c, triple_vol, &triple_pv, deleted);
    failover::maintenance_waits(&mut c, triple_vol, &triple_pv, "node-b", ["node-a", "node-d"]);
    failover::rolling_upgrade(&mut c, triple_vol, &triple_pv, ["node-a", "node-b", "node-d"]);
    storage_nodes::label_less_node(&mut c, dir.path());

    println!("== deletes clean up");
    for (kind, name) in [
        ("volumereplication", "data"),
        ("volumegroupsnapshot", "shop"),
        ("volumesnapshot", "snap"),
        ("volumesnapshot", "snap2"),
        ("volumesnapshot", "after-h"),
    ] {
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
    // The deleted node's daemon is gone with it; the copies of the triple volume on the others
    // went with its claim.
    assert_eq!(deleted, "node-c");
    for n in ["node-b", "node-d"] {
        assert!(volumes(c.daemon(n)).iter().all(|v| v != triple_vol), "{n} keeps a copy of {triple_vol}");
    }

    zone_loss::zone_lost(&mut c, dir.path());

    println!("== no component was refused by RBAC");
    for log in &c.sidecars {
        let text = std::fs::read_to_string(log).unwrap();
        let bad: Vec<&str> = text.lines().filter(|l| l.contains("forbidden") || l.contains("Forbidden")).collect();
        assert!(bad.is_empty(), "{} was refused:\n{}", log.display(), bad.join("\n"));
    }
    println!("== each identity did only what its role allows");
    let logs = c.daemon_logs();
    // (But node-e's attempt as a replication peer with a client's certificate: storage_nodes.rs.)
    let attack = |l: &str| l.contains("\"client.ferrite-node.ferrite.svc\" call=/ferrite.v1.Replica/Position");
    let refused: Vec<&str> = logs.lines().filter(|l| l.contains("call refused") && !attack(l)).collect();
    assert!(refused.is_empty(), "a component was refused a call:\n{}", refused.join("\n"));
    // A node's certificate (a replication peer) may not make an operator's call.
    let node_b = c.nodes[1].host("/etc/ferrite/tls");
    let (cert, key) = (node_b.join("tls.crt"), node_b.join("tls.key"));
    let tls = ferrite_proto::admin_tls(&pki.join("ca.pem"), Some((&cert, &key))).unwrap();
    let endpoint = format!("tcp://{}:7070", c.nodes[0].ip);
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

/// Marks Node `node` Ready or not as its kubelet would (the tier has none), from now.
/// A backup tool's view, through the external-snapshot-metadata sidecar in the controller pod:
/// a second snapshot of `data` after a few writes, then its allocated ranges and the ranges
/// changed since `snap`, asked with an audience-scoped token of the upstream client's
/// ServiceAccount, equal to what the daemon's `snapshot diff` says. A token for another audience
/// is refused, and so is a ServiceAccount that may not read the snapshots.
fn backup_tool(c: &mut Cluster, data_vol: &str) {
    use ferrite_proto::snapshot_metadata as sm;
    println!("== changed blocks for a backup tool, through the snapshot-metadata sidecar");
    let mut s = common::nbd::open(c.daemon("node-a"), data_vol);
    for at in [4u64 << 20, 9 << 20, 9 << 20 | 4096] {
        assert_eq!(common::nbd::write_on(&mut s, at, &pattern(8192)), 0);
    }
    drop(s);
    c.daemon("node-a").ok(&["export", "stop", data_vol]);
    c.cp.apply(
        &json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "snap2", "namespace": "default"},
            "spec": {"volumeSnapshotClassName": "ferrite", "source": {"persistentVolumeClaimName": "data"}}})
        .to_string(),
    );
    let handle = |c: &mut Cluster, snap: &str| {
        let v =
            c.wait_field("the snapshot to be ready", &["volumesnapshot", snap], |v| v["status"]["readyToUse"] == true);
        let content =
            c.cp.get(&["volumesnapshotcontent", v["status"]["boundVolumeSnapshotContentName"].as_str().unwrap()]);
        content["status"]["snapshotHandle"].as_str().unwrap().to_owned()
    };
    let (base, target) = (handle(c, "snap"), handle(c, "snap2"));
    let engine_name = |h: &str| h.split_once('/').unwrap().1.to_owned();
    let image = format!("{data_vol}@{}", engine_name(&target));
    let a = c.daemon("node-a");
    let allocated_here = a.diff(&image, None);
    let delta_here = a.diff(&image, Some(&engine_name(&base)));
    assert!(!delta_here.is_empty());
    let token = |ns: &str, sa: &str, audience: &str| {
        c.cp.ok(&["create", "token", sa, "-n", ns, "--audience", audience, "--duration=10m"]).trim().to_owned()
    };
    let backup = token("backup-app-namespace", "backup-app-service-account", "ferrite-snapshot-metadata");
    let elsewhere = token("backup-app-namespace", "backup-app-service-account", "another-service");
    let stranger = token("default", "default", "ferrite-snapshot-metadata");
    // The sidecar's certificate is of the CA its SnapshotMetadataService names (`Cluster::start`).
    let ca = c.pki.with_file_name("pki-snapshot-metadata").join("ca.pem");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let tls = ferrite_tls::client_config(&ca, None, &[b"h2"]).unwrap();
        let start = std::time::Instant::now();
        let ch = loop {
            match ferrite_proto::connect("tcp://127.0.0.1:50051", Some(std::sync::Arc::clone(&tls))).await {
                Ok(ch) => break ch,
                Err(e) => assert!(start.elapsed() < LONG, "the sidecar does not answer: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let mut cl = sm::snapshot_metadata_client::SnapshotMetadataClient::new(ch);
        let allocated = |token: &str| sm::GetMetadataAllocatedRequest {
            security_token: token.to_owned(),
            namespace: "default".into(),
            snapshot_name: "snap2".into(),
            max_results: 2,
            ..Default::default()
        };
        let mut got = Vec::new();
        let mut st = cl.get_metadata_allocated(allocated(&backup)).await.unwrap().into_inner();
        while let Some(m) = st.message().await.unwrap() {
            assert!(m.block_metadata.len() <= 2);
            assert_eq!(m.block_metadata_type, sm::BlockMetadataType::VariableLength as i32);
            got.extend(m.block_metadata.iter().map(|b| (b.byte_offset, b.size_bytes)));
        }
        assert_eq!(got, allocated_here, "the sidecar's allocated ranges differ from the daemon's");
        let delta = sm::GetMetadataDeltaRequest {
            security_token: backup.clone(),
            namespace: "default".into(),
            base_snapshot_id: base.clone(),
            target_snapshot_name: "snap2".into(),
            ..Default::default()
        };
        let mut got = Vec::new();
        let mut st = cl.get_metadata_delta(delta).await.unwrap().into_inner();
        while let Some(m) = st.message().await.unwrap() {
            got.extend(m.block_metadata.iter().map(|b| (b.byte_offset, b.size_bytes)));
        }
        assert_eq!(got, delta_here, "the sidecar's delta differs from the daemon's");
        for (token, code) in [(&elsewhere, tonic::Code::Unauthenticated), (&stranger, tonic::Code::PermissionDenied)] {
            let refused = match cl.get_metadata_allocated(allocated(token)).await {
                Err(e) => e,
                Ok(r) => r.into_inner().message().await.unwrap_err(),
            };
            assert_eq!(refused.code(), code, "{refused}");
        }
    });
}

fn set_ready(c: &Cluster, node: &str, ready: bool) {
    let ip = &c.nodes.iter().find(|n| n.name == node).unwrap().ip;
    let now = sh("date -u +%Y-%m-%dT%H:%M:%SZ");
    let (status, reason) = if ready { ("True", "KubeletReady") } else { ("Unknown", "NodeStatusUnknown") };
    let patch = json!({"status": {"addresses": [{"type": "InternalIP", "address": ip}],
        "conditions": [{"type": "Ready", "status": status, "reason": reason, "lastTransitionTime": now.trim(),
            "lastHeartbeatTime": now.trim()}]}});
    c.cp.ok(&["patch", "node", node, "--subresource=status", "--type=merge", "-p", &patch.to_string()]);
}

/// The events.k8s.io Events about `object` (a PV, or a claim in `default`) with `reason`.
fn events(cp: &ControlPlane, object: &str, reason: &str) -> Vec<String> {
    let list = cp.get(&["events.v1.events.k8s.io", "-A", "--field-selector", &format!("regarding.name={object}")]);
    let items = list["items"].as_array().cloned().unwrap_or_default();
    items.iter().filter(|e| e["reason"] == reason).map(|e| e["note"].as_str().unwrap_or("").to_owned()).collect()
}

/// The pool init container refuses what it must: a device holding a filesystem, and a blank
/// one without the opt-in (node-d has no daemon; its annotations alone are read).
fn pool_refusals(c: &mut Cluster, dir: &Path) {
    let ext4 = Loop::new(&dir.join("ext4.img"), "64M");
    sh(&format!("mkfs.ext4 -q {}", ext4.0));
    let blank = Loop::new(&dir.join("blank.img"), "64M");
    let cfg = c.daemon_pods[0].rewrite(c.daemon_pods[0].container("pool"), "/etc/ferrite/ferrite.toml");
    let kc = c.cp.token_kubeconfig(NS, "ferrite-daemon", "node-d.kubeconfig");
    for (dev, format, why) in
        [(&ext4.0, "true", "holds an ext2/3/4 filesystem"), (&blank.0, "false", "pool.ferrite.dev/format=\"true\"")]
    {
        c.cp.apply(
            &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-d",
                "annotations": {"pool.ferrite.dev/device": dev, "pool.ferrite.dev/format": format}}})
            .to_string(),
        );
        let out = dir.join("node-d.toml");
        let o = Command::new(BIN)
            .args(["pool", "node", "--node=node-d", &format!("--config={cfg}"), &format!("--out={}", out.display())])
            .env("KUBECONFIG", &kc)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(why), "{dev} (format {format}): {err}");
        assert!(!out.exists(), "no configuration is written for a refused device");
    }
    c.cp.ok(&["delete", "node", "node-d"]);
}

/// The tier's own kubelet stand-in: path rewriting and Secret decoding.
mod kubelet {
    use super::common::kubelet::{base64, rewrite};
    use std::path::PathBuf;

    #[test]
    fn rewrites_whole_paths_only() {
        let m =
            vec![("/run/ferrite".to_owned(), PathBuf::from("/t/run")), ("/csi".to_owned(), PathBuf::from("/t/csi"))];
        assert_eq!(rewrite(&m, "/csi/csi.sock"), "/t/csi/csi.sock");
        assert_eq!(rewrite(&m, "--config=/run/ferrite/x.toml"), "--config=/t/run/x.toml");
        assert_eq!(rewrite(&m, "a = \"/run/ferrite\"\n"), "a = \"/t/run\"\n");
        assert_eq!(rewrite(&m, "/run/ferrite2/x /csix"), "/run/ferrite2/x /csix");
    }

    #[test]
    fn decodes_base64() {
        assert_eq!(base64("aGVsbG8gd29ybGQ="), b"hello world");
        assert_eq!(base64("YWJj"), b"abc");
        assert_eq!(base64("YQ=="), b"a");
    }
}
