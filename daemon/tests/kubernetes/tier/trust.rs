//! The Kubernetes side's trust boundaries, attacked with real credentials (docs/security.md):
//!
//! - a tenant, a ServiceAccount with the built-in `edit` role in its own namespace, writes the
//!   claims that once made the controller create any PersistentVolume (a hostPath `/` one bound
//!   to the tenant's claim), and malformed ones; the controller's own account is refused a PV of
//!   another kind by the admission policy; a record the controller itself finds that does not
//!   match its claim creates nothing either, and replacement goes on meanwhile;
//! - a node's kubelet (its `system:node:` certificate, under NodeRestriction) writes its own
//!   Node's addresses to be issued the controller's identity or another node's address, and its
//!   daemon pod's token asks for them outright: never issued, and a certificate naming the
//!   controller's old plain name is refused by the daemons; that token writes only its own
//!   node's heartbeat Lease;
//! - root on a storage node makes its daemon hold the volume a pending claim will get: the
//!   controller's placement record decides where that volume is, not the daemon's word;
//! - the CA Secret deleted while the nodes' certificates chain to it: a controller starting then
//!   makes no new CA, and says why.

use std::path::Path;

use serde_json::{Value, json};

use super::common::kubelet::Pod;
use super::{Cluster, LONG, NS, events};

const TENANT: &str = "tenant";

/// The tenant's kubectl.
fn tenant(c: &Cluster, args: &[&str]) -> std::process::Output {
    c.cp.kubectl_as(&c.cp.dir.join("tenant.kubeconfig"), args)
}

fn claim(name: &str, volume: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": TENANT},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": volume,
            "resources": {"requests": {"storage": "1Gi"}}}})
}

/// A PV as a move record names it: `name`, bound to the tenant's claim `claim` (uid `uid`).
fn pv(name: &str, claim: &str, uid: &str, source: Value) -> Value {
    let mut spec = json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
        "claimRef": {"namespace": TENANT, "name": claim, "uid": uid}});
    spec.as_object_mut().unwrap().extend(source.as_object().unwrap().clone());
    json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": spec})
}

/// Before a replacement runs: the tenant writes its claims, and a record in the controller's
/// namespace names a volume no daemon holds.
pub fn tenant_attacks(c: &mut Cluster) {
    println!("== a tenant with edit in its namespace: claims that would make the controller create any PV");
    c.cp.ok(&["create", "namespace", TENANT]);
    c.cp.ok(&["create", "serviceaccount", "app", "-n", TENANT]);
    c.cp.ok(&["create", "rolebinding", "app-edit", "--clusterrole=edit", "--serviceaccount=tenant:app", "-n", TENANT]);
    let kc = c.cp.token_kubeconfig(TENANT, "app", "tenant.kubeconfig");
    assert_eq!(kc, c.cp.dir.join("tenant.kubeconfig"));
    let as_tenant = |args: &[&str], input: &Value| {
        let path = c.cp.dir.join("tenant-object.json");
        std::fs::write(&path, input.to_string()).unwrap();
        let mut all = args.to_vec();
        let p = path.display().to_string();
        all.extend(["-f", &p]);
        let o = tenant(c, &all);
        assert!(o.status.success(), "the tenant may {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    // The claim of the attack as it was tried: bound (by name) to a hostPath PV its record names.
    as_tenant(&["create"], &claim("grab", "grab"));
    let uid =
        String::from_utf8(tenant(c, &["get", "pvc", "grab", "-n", TENANT, "-o", "jsonpath={.metadata.uid}"]).stdout)
            .unwrap();
    let hostpath = pv("grab", "grab", &uid, json!({"hostPath": {"path": "/"}}));
    let ours = pv("grab", "grab", &uid, json!({"csi": {"driver": "csi.ferrite.dev", "volumeHandle": "_/pvc-victim"}}));
    // Then malformed ones: a record that is no JSON, a PV the API server refuses (no capacity).
    as_tenant(&["create"], &claim("junk", "junk"));
    as_tenant(&["create"], &claim("no-capacity", "no-capacity"));
    let mut refused = pv("no-capacity", "no-capacity", "x", json!({"hostPath": {"path": "/"}}));
    refused["spec"].as_object_mut().unwrap().remove("capacity");
    for (name, record) in [
        ("grab", json!({"old_uid": "none", "pv": hostpath}).to_string()),
        ("junk", "{not a move".to_owned()),
        ("no-capacity", json!({"old_uid": "none", "pv": refused}).to_string()),
    ] {
        let got = tenant(c, &["get", "pvc", name, "-n", TENANT, "-o", "json"]);
        let mut obj: Value = serde_json::from_slice(&got.stdout).unwrap();
        for key in ["failover.ferrite.dev/moving-pv", "failover.ferrite.dev/pv-move"] {
            obj["metadata"]["labels"][key] = json!("true");
            obj["metadata"]["annotations"][key] = json!(record);
        }
        as_tenant(&["replace"], &obj);
    }
    // Where the controller keeps its records, the tenant may write nothing.
    for verb in ["create", "update", "delete"] {
        let o = tenant(c, &["auth", "can-i", verb, "configmaps", "-n", NS]);
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "no", "the tenant may {verb} configmaps in {NS}");
    }
    // The controller's own account is refused any PV but this driver's, whatever it was made to
    // believe (the admission policy; RBAC lets it create PVs).
    let path = c.cp.dir.join("controller-hostpath.json");
    let as_controller = |verb: &str, object: &Value| {
        std::fs::write(&path, object.to_string()).unwrap();
        c.cp.kubectl(&[
            verb,
            "--as=system:serviceaccount:ferrite:ferrite-controller",
            "-f",
            &path.display().to_string(),
        ])
    };
    let o = as_controller("create", &pv("by-the-controller", "grab", &uid, json!({"hostPath": {"path": "/"}})));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("only PersistentVolumes of csi.ferrite.dev"), "{err}");
    // Nor one of this driver that names a secret outside `ferrite` (a tenant's, handed to a node).
    let csi = |ns: &str| json!({"csi": {"driver": "csi.ferrite.dev", "volumeHandle": "node-a/none", "nodeStageSecretRef": {"name": "key", "namespace": ns}}});
    // (bound to no claim that exists, so nothing binds them)
    let nobody = "00000000-0000-0000-0000-000000000000";
    let o = as_controller("create", &pv("by-the-controller", "nobody", nobody, csi(TENANT)));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("secrets in the ferrite namespace only"), "{err}");
    let o = as_controller("create", &pv("by-the-controller", "nobody", nobody, csi(NS)));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    c.cp.ok(&["delete", "pv", "by-the-controller"]);
    // Nor may it delete another driver's PV (made here by the administrator).
    let not_ours = pv("not-ours", "nobody", nobody, json!({"hostPath": {"path": "/tmp"}}));
    c.cp.with_stdin(&["create", "-f", "-"], &not_ours.to_string());
    let o = as_controller("delete", &not_ours);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("only PersistentVolumes of csi.ferrite.dev"), "{err}");
    c.cp.ok(&["delete", "pv", "not-ours"]);
    // A record in the controller's namespace (written by nobody but it: here by the admin) for
    // the claim's PV, of this driver, but of a volume no daemon holds: not created either.
    let record = json!({"old_uid": "none", "pv": ours}).to_string();
    c.cp.apply(
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "ferrite-pv-move-grab", "namespace": NS, "labels": {"failover.ferrite.dev/pv-move": "true"}},
            "data": {"move.json": record}})
        .to_string(),
    );
}

/// After a replacement ran (and re-created a PV of ours): nothing came of the tenant's claims,
/// which the controller never touched, and the mismatched record says why in an Event.
pub fn tenant_gained_nothing(c: &mut Cluster) {
    c.cp.wait("the controller to refuse the mismatched record (a MoveFailed Event)", LONG, |cp| {
        !events(cp, "ferrite-pv-move-grab", "MoveFailed").is_empty()
    });
    let why = events(&c.cp, "ferrite-pv-move-grab", "MoveFailed");
    assert!(why.iter().any(|n| n.contains("not created")), "{why:?}");
    println!("   the record was refused: {}", why[0]);
    for pv in ["grab", "junk", "no-capacity", "by-the-controller"] {
        assert!(!c.cp.kubectl(&["get", "pv", pv]).status.success(), "PersistentVolume {pv} was created");
    }
    for name in ["grab", "junk", "no-capacity"] {
        let claim = c.cp.get(&["pvc", name, "-n", TENANT]);
        assert_eq!(claim["status"]["phase"], "Pending", "{claim}");
        assert_eq!(claim["metadata"]["labels"]["failover.ferrite.dev/moving-pv"], "true", "untouched: {claim}");
    }
    c.cp.ok(&["delete", "configmap", "ferrite-pv-move-grab", "-n", NS]);
    c.cp.ok(&["delete", "namespace", TENANT, "--wait=false"]);
}

/// Submits a CertificateSigningRequest for `names` (CN `cn`) with the credentials of `kc`, and
/// returns the condition the signer answered with (type, message).
fn ask(c: &mut Cluster, kc: &Path, name: &str, cn: &str, names: &[&str]) -> (String, String) {
    let key = ferrite_tls::certs::new_key().unwrap();
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let pem = ferrite_tls::certs::request(&key, cn, &names).unwrap();
    let pem_file = c.cp.dir.join(format!("{name}.pem"));
    std::fs::write(&pem_file, pem).unwrap();
    let request = super::sh(&format!("base64 -w0 {}", pem_file.display()));
    let csr = json!({"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": {"request": request, "signerName": "ferrite.dev/node",
            "usages": ["digital signature", "key encipherment", "server auth", "client auth"]}});
    let path = c.cp.dir.join(format!("{name}.json"));
    std::fs::write(&path, csr.to_string()).unwrap();
    let o = c.cp.kubectl_as(kc, &["create", "-f", &path.display().to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut answer = (String::new(), String::new());
    c.cp.wait(&format!("the signer to answer {name}"), LONG, |cp| {
        let r = cp.get(&["csr", name]);
        let Some(cond) = r["status"]["conditions"].as_array().and_then(|a| a.last().cloned()) else { return false };
        answer = (cond["type"].as_str().unwrap_or("").to_owned(), cond["message"].as_str().unwrap_or("").to_owned());
        true
    });
    answer
}

/// Root on node `node` (its kubelet's credentials, its daemon pod's token) gains no identity
/// beyond the node's, and no other node's heartbeat.
pub fn node_climbs(c: &mut Cluster, node: &str) {
    println!("== root on {node}: its kubelet writes its Node's addresses; it is issued no other identity");
    let d = c.nodes.iter().position(|n| n.name == node).unwrap();
    let (ip, other_ip) = (c.nodes[d].ip.clone(), c.nodes[0].ip.clone());
    let kubelet = c.cp.node_kubeconfig(node);
    // As the kubelet writes its status: an update of the Node's status subresource.
    let write_status = |c: &Cluster, n: &str, addresses: Value| loop {
        let mut obj = c.cp.get(&["node", n]);
        obj["status"]["addresses"] = addresses.clone();
        let path = c.cp.dir.join(format!("{n}-status.json"));
        std::fs::write(&path, obj.to_string()).unwrap();
        let raw = format!("/api/v1/nodes/{n}/status");
        let o = c.cp.kubectl_as(&kubelet, &["replace", "--raw", &raw, "-f", &path.display().to_string()]);
        // The controller changed the Node meanwhile (its resourceVersion): read it again.
        if !String::from_utf8_lossy(&o.stderr).contains("the object has been modified") {
            break o;
        }
    };
    // NodeRestriction: its own Node's status, no other's.
    let other = write_status(c, "node-a", json!([]));
    assert!(!other.status.success(), "a kubelet wrote another Node's status");
    let forged = json!([{"type": "InternalIP", "address": ip}, {"type": "InternalIP", "address": "ferrite-controller"},
        {"type": "ExternalIP", "address": other_ip}, {"type": "Hostname", "address": "ferrite-controller.ferrite.svc"}]);
    let label = format!("ferrite.dev/node={node}");
    let names = |r: &Value| r["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    let asked_before: Vec<String> =
        c.cp.get(&["csr", "-l", &label])["items"].as_array().unwrap().iter().map(names).collect();
    let o = write_status(c, node, forged);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The node's renewal (its cert-renew container looks every 2 s) asks for its new names: the
    // other node's address among them, refused.
    let tls = c.nodes[d].host("/etc/ferrite/tls");
    let held = &ferrite_tls::load_certs(&tls.join("tls.crt")).unwrap()[0];
    let before = ferrite_tls::identities(held);
    assert_eq!(before, [node, ip.as_str(), "ferrite-node.ferrite.svc"]);
    let (from, to) = ferrite_tls::validity(held).unwrap();
    // A day, and the hour of slack it starts with.
    assert!(to - from <= 86_400 + 3_600 + 60, "a certificate naming an IP address lives a day: {}", to - from);
    // The signer's record: each address with the node first issued it.
    let record = c.cp.get(&["configmap", "ferrite-node-addresses", "-n", NS]);
    assert_eq!(record["data"][ip.as_str()], node, "{record}");
    assert_eq!(record["data"][other_ip.as_str()], "node-a", "{record}");
    let mut denied = String::new();
    c.cp.wait(&format!("{node}'s renewal with another node's address to be denied"), LONG, |cp| {
        let csrs = cp.get(&["csr", "-l", &label]);
        let new = csrs["items"].as_array().unwrap().iter().filter(|r| !asked_before.contains(&names(r)));
        let found = new.into_iter().find_map(|r| {
            let c = r["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "Denied")?.clone();
            Some(c["message"].as_str()?.to_owned())
        });
        found.map(|m| denied = m).is_some()
    });
    assert!(denied.contains("also an address of node node-a"), "{denied}");
    println!("   denied: {denied}");
    // What the operator sees: an Event on the claimant's Node naming both.
    let claimed = |cp: &super::common::kube::ControlPlane| events(cp, node, "AddressClaimed");
    c.cp.wait(&format!("an AddressClaimed Event on {node}"), LONG, |cp| !claimed(cp).is_empty());
    let note = claimed(&c.cp).remove(0);
    assert!(note.contains(&format!("node {node} asked")) && note.contains("to node node-a first"), "{note}");
    println!("   event: {note}");
    // Its daemon pod's token asking outright: the controller's identities, refused.
    let pod = &c.daemon_pods[d];
    let token = c.cp.pod_token_kubeconfig(NS, "ferrite-daemon", pod.name(), pod.uid(), "node-d-climb.kubeconfig");
    let svc = "ferrite-node.ferrite.svc";
    for (i, name) in
        ["ferrite-controller", "ferrite-controller.ferrite.svc", "spiffe://ferrite.dev/controller"].iter().enumerate()
    {
        let (kind, why) = ask(c, &token, &format!("climb-{node}-{i}"), node, &[node, &ip, name, svc]);
        assert_eq!(kind, "Denied", "{name}: {why}");
        println!("   {name}: {why}");
    }
    let after = ferrite_tls::identities(&ferrite_tls::load_certs(&tls.join("tls.crt")).unwrap()[0]);
    assert_eq!(after, before, "the node's certificate names what it did");
    // The name it could once be issued binds no role on any daemon now: a certificate of the
    // cluster CA naming it is closed after its handshake, one naming the URI is served.
    super::common::csi::certs(&c.pki, "legacy-controller", &["ferrite-controller"]);
    let list = |who: &str| {
        let (cert, key) = (c.pki.join(format!("{who}.pem")), c.pki.join(format!("{who}-key.pem")));
        let tls = ferrite_proto::admin_tls(&c.pki.join("ca.pem"), Some((&cert, &key))).unwrap();
        let endpoint = format!("tcp://{}:7070", c.nodes[0].ip);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let ch = ferrite_proto::connect_as(&endpoint, Some(tls), Some(svc)).await.unwrap();
            let mut admin = ferrite_proto::ferrite::v1::admin_client::AdminClient::new(ch);
            admin.list_volumes(ferrite_proto::ferrite::v1::ListVolumesRequest::default()).await.map(drop)
        })
    };
    // Closed after its handshake: the call sees the connection go, as a transport error (reset
    // or closed) or as a cancelled call, depending on when the close arrives.
    let refused = list("legacy-controller").unwrap_err();
    let closed = refused.message().contains("transport error") || refused.code() == tonic::Code::Cancelled;
    assert!(closed, "{refused}");
    list("ferrite-controller").expect("the controller's identity (its URI) is served");
    let o = write_status(c, node, json!([{"type": "InternalIP", "address": ip}]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    println!("== root on {node}: its daemon's token renews its own heartbeat Lease, no other's");
    let unbound = c.cp.token_kubeconfig(NS, "ferrite-daemon", "unbound-heartbeat.kubeconfig");
    let theirs = touch_lease(c, &token, "node-a");
    assert!(theirs.contains("only its own node's heartbeat Lease"), "{theirs}");
    assert_eq!(touch_lease(c, &token, node), "", "its own Lease");
    let err = touch_lease(c, &unbound, node);
    assert!(err.contains("only its own node's heartbeat Lease"), "a token bound to no pod names no node: {err}");

    println!("== root on {node}: its node plugin's token writes only its own node's CSIAddonsNode");
    let plugin = &c.plugin_pods[d];
    let kc = c.cp.pod_token_kubeconfig(NS, "ferrite-node", plugin.name(), plugin.uid(), "node-d-addons.kubeconfig");
    let own_endpoint = format!("pod://{}.{NS}:9071", plugin.name());
    let write = |verb: &str, obj: &Value| {
        let path = c.cp.dir.join("csiaddonsnode.json");
        std::fs::write(&path, obj.to_string()).unwrap();
        let o = c.cp.kubectl_as(&kc, &[verb, "-f", &path.display().to_string()]);
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let entry = |name: &str, node_id: &str, endpoint: &str| {
        json!({"apiVersion": "csiaddons.openshift.io/v1alpha1", "kind": "CSIAddonsNode",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"driver": {"name": "csi.ferrite.dev", "nodeID": node_id, "endpoint": endpoint}}})
    };
    // An entry for another node, pointing the manager at itself: refused.
    let err = write("create", &entry("forged-node-a", "node-a", &own_endpoint));
    assert!(err.contains("names its own node, csi.ferrite.dev and its own pod's endpoint"), "{err}");
    // Another node's entry (the controller's sidecar registers node-a's), taken over: refused.
    let all = c.cp.get(&["csiaddonsnodes", "-n", NS]);
    let mut theirs =
        all["items"].as_array().unwrap().iter().find(|o| o["spec"]["driver"]["nodeID"] == "node-a").cloned();
    let theirs = theirs.as_mut().expect("node-a's CSIAddonsNode (the controller's sidecar)");
    let name = theirs["metadata"]["name"].as_str().unwrap().to_owned();
    theirs["spec"]["driver"]["endpoint"] = json!(own_endpoint);
    assert!(write("replace", theirs).contains("only its own node's CSIAddonsNode"));
    let o = c.cp.kubectl_as(&kc, &["delete", "csiaddonsnode", &name, "-n", NS]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("only its own node's CSIAddonsNode"), "{o:?}");
    // Its own, naming its own pod: taken, and removed.
    let own = entry(&format!("{node}-check"), node, &own_endpoint);
    assert_eq!(write("create", &own), "");
    let o = c.cp.kubectl_as(&kc, &["delete", "csiaddonsnode", &format!("{node}-check"), "-n", NS]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A token bound to no pod names none: refused.
    let unbound = c.cp.token_kubeconfig(NS, "ferrite-node", "unbound-addons.kubeconfig");
    let path = c.cp.dir.join("csiaddonsnode.json");
    std::fs::write(&path, own.to_string()).unwrap();
    let o = c.cp.kubectl_as(&unbound, &["create", "-f", &path.display().to_string()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("only with its pod's token"), "{o:?}");
}

/// Writes (updates, as the heartbeat does) node `n`'s heartbeat Lease with the credentials of
/// `kc`, its holder unchanged: "" when it was written, else why not.
fn touch_lease(c: &Cluster, kc: &Path, n: &str) -> String {
    let args = ["-n", "ferrite-node-lease"];
    for _ in 0..20 {
        let got =
            c.cp.kubectl_as(kc, &[&["get", "lease", &format!("ferrite-node-{n}"), "-o", "json"][..], &args].concat());
        assert!(got.status.success(), "{}", String::from_utf8_lossy(&got.stderr));
        let path = c.cp.dir.join(format!("lease-{n}.json"));
        std::fs::write(&path, &got.stdout).unwrap();
        let o = c.cp.kubectl_as(kc, &[&["replace", "-f", &path.display().to_string()][..], &args].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        match o.status.success() {
            true => return String::new(),
            // The heartbeat renewed it meanwhile: read it again.
            false if err.contains("Conflict") || err.contains("the object has been modified") => continue,
            false => return err,
        }
    }
    panic!("the Lease of {n} kept changing under the update");
}

/// The Secret `ferrite-ca` deleted (by mistake) in a running cluster: a controller that starts
/// then (a restart, a rollout) makes no new CA, which would cut it off from every daemon; it
/// stops with why, an Event about the Secret says so, and the Secret restored is used again.
pub fn ca_kept(c: &mut Cluster) {
    println!("== the CA Secret deleted: a controller starting then makes no new CA");
    let mut secret = c.cp.get(&["secret", "ferrite-ca", "-n", NS]);
    secret["metadata"].as_object_mut().unwrap().retain(|k, _| ["name", "namespace", "labels"].contains(&k.as_str()));
    c.cp.ok(&["delete", "secret", "ferrite-ca", "-n", NS]);
    let dep = c.cp.get(&["deployment", "ferrite-controller", "-n", NS]);
    let tpl = dep["spec"]["template"].clone();
    let pod = Pod::run(&c.cp, NS, "ferrite-controller-ca-check", &tpl, &c.nodes[1], None, &c.sw.gateway);
    let kc = c.cp.token_kubeconfig(NS, "ferrite-controller", "ferrite-ca-check.kubeconfig");
    std::os::unix::fs::chown(&kc, Some(0), Some(65532)).unwrap();
    std::fs::set_permissions(&kc, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    let env = [("KUBECONFIG".to_owned(), kc.display().to_string())];
    let o = pod.run_to_end("ferrite", &c.controller_bin.clone(), &env, false);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no new CA is made"), "{err}");
    assert!(!c.cp.kubectl(&["get", "secret", "ferrite-ca", "-n", NS]).status.success(), "a new CA was made");
    let said = events(&c.cp, "ferrite-ca", "CAMissing");
    assert!(said.iter().any(|n| n.contains("Restore the Secret")), "{said:?}");
    println!("   {}", err.lines().last().unwrap_or_default());
    c.cp.apply(&secret.to_string());
    c.cp.ok(&["delete", "pod", pod.name(), "-n", NS, "--grace-period=0", "--force"]);
}

/// The controller's placement record of `volume`: (copies, witness).
fn placed(c: &Cluster, volume: &str) -> (Vec<String>, String) {
    let cm = c.cp.get(&["configmap", &format!("ferrite-volume-{volume}"), "-n", NS]);
    assert_eq!(cm["metadata"]["labels"]["storage.ferrite.dev/placement"], "true", "{cm}");
    assert_eq!(cm["data"]["volume"], volume, "{cm}");
    let copies = cm["data"]["copies"].as_str().unwrap_or_default().split(',').map(str::to_owned).collect();
    (copies, cm["data"]["witness"].as_str().unwrap_or_default().to_owned())
}

/// Each volume's nodes are the controller's record (`replicated`: a volume with a copy on every
/// node of `nodes`; `local`: one on `node`); root on `liar`, through its own daemon, makes the
/// volume a pending claim will get, under the name the provisioner will ask for: the claim
/// binds where the scheduler put it, not on the liar, and the controller says why.
pub fn daemon_claims(c: &mut Cluster, replicated: (&str, &[&str]), local: (&str, &str), liar: &str) {
    println!("== the controller's record says where each volume lives");
    let (copies, _) = placed(c, replicated.0);
    let mut sorted = copies.clone();
    sorted.sort();
    assert_eq!(sorted, replicated.1, "the record of {}", replicated.0);
    assert_eq!(placed(c, local.0), (vec![local.1.to_owned()], String::new()));

    println!("== root on {liar}: its daemon holds the volume of a pending claim first");
    let spec = json!({"storageClassName": "ferrite-ext4", "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "32Mi"}}});
    c.cp.apply(
        &json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "lure", "namespace": "default"}, "spec": spec})
        .to_string(),
    );
    let uid = c.cp.get(&["pvc", "lure", "-n", "default"])["metadata"]["uid"].as_str().unwrap().to_owned();
    let volume = format!("pvc-{uid}");
    c.daemon(liar).ok(&["volume", "create", &volume, "32MiB"]);
    let target = if liar == "node-a" { "node-b" } else { "node-a" };
    c.cp.ok(&["annotate", "pvc", "lure", "-n", "default", &format!("volume.kubernetes.io/selected-node={target}")]);
    assert_eq!(c.bound("lure"), format!("{target}/{volume}"), "the claim binds where the scheduler put it");
    assert_eq!(placed(c, &volume), (vec![target.to_owned()], String::new()));
    let log = c.controller.as_ref().unwrap().log("ferrite");
    let said = log.lines().find(|l| l.contains("a node holds a volume it was never given") && l.contains(&volume));
    println!("   {}", said.unwrap_or_else(|| panic!("the controller said nothing of {liar}'s claim:\n{log}")));
    c.cp.ok(&["delete", "pvc", "lure", "-n", "default", "--wait=true", "--timeout=60s"]);
    c.cp.wait("the lure's PV to go", LONG, |cp| {
        !cp.get(&["pv"])["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["spec"]["csi"]["volumeHandle"].as_str().is_some_and(|h| h.ends_with(&volume)))
    });
    c.cp.wait("the lure's record to go", LONG, |cp| {
        !cp.get(&["configmap", "-n", NS])["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["data"]["volume"] == volume.as_str())
    });
    c.daemon(liar).ok(&["volume", "delete", &volume]);
}
