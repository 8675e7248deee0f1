//! The controller's first start, twice at once (the two replicas of deploy/kubernetes, on a real
//! API server): both make or take the same CA and set the drain guard's caBundle to it, neither
//! fails on the other's writes. Found on a real kubelet (tests/kubelet): one replica exited on
//! the caBundle's 409 and restarted.

use crate::common;

use std::path::Path;

use common::kube::ControlPlane;
use ferrite_csi::kube::certs::cluster::{CA_SECRET, Options, TLS_SECRET, WEBHOOK, make};

fn options(dir: &Path) -> Options {
    Options {
        namespace: "ferrite".into(),
        service: "ferrite-controller.ferrite.svc".into(),
        ca_dir: dir.join("ca"),
        tls_ca: dir.join("tls/ca.crt"),
        tls_cert: dir.join("tls/tls.crt"),
        tls_key: dir.join("tls/tls.key"),
    }
}

#[test]
fn two_replicas_starting_together_agree_on_the_certificates() {
    let Some(bin) = common::kube::binaries() else { return };
    let dir = tempfile::tempdir().unwrap();
    let cp = ControlPlane::start(dir.path(), &bin, None);
    cp.ok(&["create", "namespace", "ferrite"]);
    cp.ok(&["create", "serviceaccount", "ferrite-controller", "-n", "ferrite"]);
    cp.ok(&[
        "create",
        "clusterrolebinding",
        "certs",
        "--clusterrole=cluster-admin",
        "--serviceaccount=ferrite:ferrite-controller",
    ]);
    let kubeconfig = cp.token_kubeconfig("ferrite", "ferrite-controller", "controller.kubeconfig");
    // SAFETY: set before the runtime (and so any client) exists; no other thread of this test
    // process reads the environment.
    unsafe { std::env::set_var("KUBECONFIG", &kubeconfig) };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let webhook = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/base/webhook.yaml");
    // A first install, again and again: no Secret, a drain guard without a caBundle.
    for round in 0..8 {
        cp.ok(&["delete", "secret", "-n", "ferrite", CA_SECRET, TLS_SECRET, "--ignore-not-found"]);
        cp.ok(&["delete", "validatingwebhookconfiguration", WEBHOOK, "--ignore-not-found"]);
        cp.ok(&["apply", "-f", &webhook.display().to_string()]);
        let (a, b) = (dir.path().join(format!("a{round}")), dir.path().join(format!("b{round}")));
        let (oa, ob) = (options(&a), options(&b));
        let (ra, rb) = rt.block_on(async { tokio::join!(make(&oa), make(&ob)) });
        ra.unwrap_or_else(|e| panic!("round {round}, replica a: {e:#}"));
        rb.unwrap_or_else(|e| panic!("round {round}, replica b: {e:#}"));
        let ca = std::fs::read_to_string(a.join("ca/ca.crt")).unwrap();
        assert_eq!(ca, std::fs::read_to_string(b.join("ca/ca.crt")).unwrap(), "round {round}: one CA");
        let hook = cp.get(&["validatingwebhookconfiguration", WEBHOOK]);
        let bundle = common::kubelet::base64(hook["webhooks"][0]["clientConfig"]["caBundle"].as_str().unwrap());
        assert_eq!(bundle, ca.as_bytes(), "round {round}: the caBundle is the CA");
    }
}
