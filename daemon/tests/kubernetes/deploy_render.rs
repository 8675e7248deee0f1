//! deploy/kubernetes rendered as a user installs it, every optional component on and a real
//! registry set in components/registry: every image of every container and init container names
//! that registry (none keeps the placeholder), Ferrite's images carry the release's version, and
//! each sidecar's tag is the version the Kubernetes tier builds and tests (../shared/k8s). A
//! build with changes since a release does not carry that release's version (its images would
//! carry the release's tag, which nodes that cached it keep).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

const PLACEHOLDER: &str = "ferrite-registry.invalid";
const REGISTRY: &str = "registry.example.test:5000";

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// The images of the rendered manifests, in order.
fn images(rendered: &str) -> Vec<String> {
    rendered
        .lines()
        .filter_map(|l| l.trim_start().trim_start_matches("- ").strip_prefix("image: "))
        .map(|i| i.trim().trim_matches('"').to_owned())
        .collect()
}

/// The rendered object of `kind` named `name`.
fn document<'a>(rendered: &'a str, kind: &str, name: &str) -> &'a str {
    rendered
        .split("\n---\n")
        .find(|d| d.contains(&format!("kind: {kind}\n")) && d.contains(&format!("\n  name: {name}\n")))
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

#[test]
fn every_image_follows_the_registry_and_the_tested_versions() {
    if Command::new("kubectl").args(["version", "--client"]).output().is_err() {
        return common::skip("deploy render: no kubectl (its kustomize renders the manifests)", false);
    }
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("kubernetes");
    assert!(Command::new("cp").arg("-r").arg(deploy()).arg(&copy).status().unwrap().success());
    let k = copy.join("kustomization.yaml");
    let text = std::fs::read_to_string(&k).unwrap();
    let all = text.replace("  # - components/", "  - components/");
    assert_eq!(all.matches("  - components/").count(), 6, "kustomization.yaml lists every optional component");
    std::fs::write(&k, all).unwrap();
    let reg = copy.join("components/registry/kustomization.yaml");
    let text = std::fs::read_to_string(&reg).unwrap();
    assert!(text.contains(&format!("registry={PLACEHOLDER}")));
    std::fs::write(&reg, text.replace(&format!("registry={PLACEHOLDER}"), &format!("registry={REGISTRY}"))).unwrap();

    let o = Command::new("kubectl").arg("kustomize").arg(&copy).output().unwrap();
    assert!(o.status.success(), "kubectl kustomize: {}", String::from_utf8_lossy(&o.stderr));
    let rendered = String::from_utf8(o.stdout).unwrap();
    assert!(!rendered.contains(PLACEHOLDER), "the placeholder registry is left in:\n{}", {
        rendered.lines().filter(|l| l.contains(PLACEHOLDER)).collect::<Vec<_>>().join("\n")
    });
    let images = images(&rendered);
    let containers = rendered.lines().filter(|l| l.trim_start().starts_with("- name: ")).count();
    assert!(images.len() >= 15, "{images:?} ({containers} named list items)");
    let version = env!("CARGO_PKG_VERSION");
    for image in &images {
        let rest =
            image.strip_prefix(&format!("{REGISTRY}/")).unwrap_or_else(|| panic!("{image} is not from {REGISTRY}"));
        let (repo, tag) = rest.rsplit_once(':').unwrap();
        if repo == "ferrite" || repo == "ferrite-controller" {
            assert_eq!(tag, version, "{image}: Ferrite's images carry the release's version");
        }
    }

    // Both node DaemonSets on the host's network (node.yaml says why) and in its PID namespace
    // (daemon.yaml: some kernels' ublk refuses a server in a pod's; found on a real kubelet).
    for daemon_set in ["ferrite-daemon", "ferrite-node-plugin"] {
        let doc = document(&rendered, "DaemonSet", daemon_set);
        assert!(doc.contains("\n      hostNetwork: true\n"), "{daemon_set} is not on the host's network");
        assert!(doc.contains("\n      hostPID: true\n"), "{daemon_set} is not in the host's PID namespace");
    }

    // Each CSI driver's liveness: the kubelet waits longer than the sidecar's Probe does (a
    // busy node's driver answers in seconds; a 1 s limit restarted it mid-call on a real kubelet).
    for (kind, name) in [("Deployment", "ferrite-controller"), ("DaemonSet", "ferrite-node-plugin")] {
        let doc = document(&rendered, kind, name);
        assert!(doc.contains("--probe-timeout=9s") && doc.contains("timeoutSeconds: 10"), "{name}: probe timeouts");
    }

    // Only the CSI-Addons manager reaches the controller's sidecar (which takes any token); the
    // drain guard and the liveness port stay open.
    let policy: String =
        document(&rendered, "NetworkPolicy", "ferrite-controller").split_whitespace().collect::<Vec<_>>().concat();
    for part in [
        "podSelector:matchLabels:app.kubernetes.io/name:ferrite-controllerpolicyTypes:-Ingress",
        "-from:-namespaceSelector:matchLabels:kubernetes.io/metadata.name:csi-addons-system\
         podSelector:matchLabels:app.kubernetes.io/name:csi-addonscontrol-plane:controller-managerports:-port:9070",
    ] {
        assert!(policy.contains(part), "the controller's NetworkPolicy lacks {part}: {policy}");
    }
    let sidecar = document(&rendered, "Deployment", "ferrite-controller");
    assert!(sidecar.contains("--controller-port=9070"), "the policy's port is the sidecar's");

    // The sidecar tags are the versions the tier runs, where its kit is at hand.
    let kit = ["FERRITE_K8S", "../../shared/k8s", "/work/shared/k8s"]
        .iter()
        .filter_map(|k| if k.starts_with("FERRITE") { std::env::var(k).ok() } else { Some((*k).to_owned()) })
        .map(PathBuf::from)
        .find(|k| k.join("build.sh").exists());
    let Some(kit) = kit else {
        return common::skip("deploy render: the sidecar tags (no ../shared/k8s here)", false);
    };
    let build_sh = std::fs::read_to_string(kit.join("build.sh")).unwrap();
    for (name, tested) in common::kube::sidecar_versions(&build_sh) {
        let found: Vec<&String> =
            images.iter().filter(|i| i.rsplit_once(':').unwrap().0.ends_with(&format!("/{name}"))).collect();
        assert!(!found.is_empty(), "no {name} image rendered");
        for image in found {
            assert!(image.ends_with(&format!(":{tested}")), "{image}: the tier tests {name} {tested}");
        }
    }
}

/// Whether `version` is a release CHANGELOG.md names while it also lists unreleased changes
/// (Some(true): the images of this build would carry the tag of a release they are not, and a
/// node that cached that release's image would keep running it), a release commit (Some(false)),
/// or none (None: a version still to be released).
fn released_or_unreleased(version: &str) -> Option<bool> {
    let log = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../CHANGELOG.md")).unwrap();
    let unreleased = log.split("\n## ").find(|s| s.starts_with("Unreleased")).unwrap_or_default();
    let changes = unreleased.lines().skip(1).any(|l| !l.trim().is_empty());
    let released = log.lines().any(|l| l.strip_prefix("## ") == Some(version));
    released.then_some(changes)
}

#[test]
fn a_build_with_unreleased_changes_does_not_carry_a_releases_version() {
    assert_eq!(released_or_unreleased("0.2.0"), Some(true), "0.2.0 is released and main has changes since");
    let version = env!("CARGO_PKG_VERSION");
    assert_ne!(
        released_or_unreleased(version),
        Some(true),
        "{version} is a release, and CHANGELOG lists changes since"
    );
}
