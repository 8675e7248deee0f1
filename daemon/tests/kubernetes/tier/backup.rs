//! The tier's backups off the cluster: SeaweedFS on the switch's gateway as the store, the
//! daemons' target from the optional Secret the DaemonSet mounts, a backup as the example
//! CronJob's job makes it (kubectl under the job's ServiceAccount, which may do nothing else),
//! the VolumeSnapshot's handle naming the backup on the target, a claim from it restored on
//! another node with the source's bytes, and deleting the snapshot deleting the backup.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use super::weed::Weed;
use super::{Cluster, ControlPlane, NS, claim, deploy};

/// Starts the store where the nodes reach it and creates the Secret the daemons read their
/// targets from (before they start); None (a recorded skip) without SeaweedFS.
pub fn store(cp: &ControlPlane, gateway: &str, dir: &Path) -> Option<Weed> {
    let weed = Weed::start_at(gateway, true)?;
    let files = dir.join("backup-secret");
    std::fs::create_dir_all(&files).unwrap();
    let targets = format!(
        "[offsite]\nkind = \"s3\"\nendpoint = \"{}\"\nbucket = \"ferrite-test\"\nprefix = \"k8s\"\n\
         credentials = \".\"\nkey-file = \"target.key\"\nchunk-size = \"1M\"\n",
        weed.endpoint()
    );
    for (name, text) in [
        ("targets.toml", targets.as_str()),
        ("target.key", &"5a".repeat(32)),
        ("access-key-id", "ferrite"),
        ("secret-access-key", "ferrite-secret"),
    ] {
        std::fs::write(files.join(name), text).unwrap();
    }
    let mut args = vec!["create", "secret", "generic", "ferrite-backup-targets", "-n", NS];
    let from: Vec<String> = ["targets.toml", "target.key", "access-key-id", "secret-access-key"]
        .iter()
        .map(|f| format!("--from-file={}", files.join(f).display()))
        .collect();
    args.extend(from.iter().map(String::as_str));
    cp.ok(&args);
    Some(weed)
}

/// The backups `d`'s daemon finds on the target.
fn listed(c: &Cluster, node: &str) -> Vec<Value> {
    c.daemon(node).json(&["backup", "list", "--target", "offsite"]).as_array().unwrap().clone()
}

pub fn offsite(c: &mut Cluster, data_vol: &str, dir: &Path) {
    if c.store.is_none() {
        return;
    }
    println!("== a scheduled snapshot of the backup class goes off the cluster; a claim from it restores elsewhere");
    // The example's class and nightly CronJob (with its claim `db` being `data` here).
    let text = std::fs::read_to_string(deploy().join("examples/backup.yaml")).unwrap();
    let wanted = ["VolumeSnapshotClass", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "CronJob"];
    let docs: Vec<String> = text
        .split("\n---\n")
        .filter(|d| wanted.iter().any(|k| d.contains(&format!("\nkind: {k}\n"))))
        .map(|d| d.replace("persistentVolumeClaimName: db}", "persistentVolumeClaimName: data}"))
        .collect();
    assert_eq!(docs.len(), wanted.len(), "examples/backup.yaml has its class and CronJob");
    c.cp.with_stdin(&["apply", "-n", "default", "-f", "-"], &docs.join("\n---\n"));

    // The CronJob's job, as its pod would run it: its container's command, its token, its file.
    let job = c.cp.get(&["cronjob", "db-backup", "-n", "default"]);
    let pod = &job["spec"]["jobTemplate"]["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "db-backup");
    let args: Vec<String> =
        pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let template = c.cp.get(&["configmap", "db-backup", "-n", "default"])["data"]["snapshot.yaml"].clone();
    let file = dir.join("db-backup-snapshot.yaml");
    std::fs::write(&file, template.as_str().unwrap()).unwrap();
    let kc = c.cp.token_kubeconfig("default", "db-backup", "db-backup.kubeconfig");
    let kubectl = |args: &[&str]| {
        Command::new("kubectl").arg("--kubeconfig").arg(&kc).args(["-n", "default"]).args(args).output().unwrap()
    };
    let args: Vec<String> =
        args.iter().map(|a| a.replace("/etc/db-backup/snapshot.yaml", &file.display().to_string())).collect();
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["-o", "name"]);
    let o = kubectl(&args);
    assert!(o.status.success(), "the CronJob's job: {}", String::from_utf8_lossy(&o.stderr));
    let snap = String::from_utf8(o.stdout).unwrap().trim().rsplit('/').next().unwrap().to_owned();
    assert!(snap.starts_with("db-"), "{snap}");
    let o = kubectl(&["delete", "volumesnapshot", &snap]);
    assert!(!o.status.success(), "the job's ServiceAccount may only create snapshots");

    let v = c.wait_field("the backup snapshot to be ready", &["volumesnapshot", &snap], |v| {
        v["status"]["readyToUse"] == true
    });
    let content = c.cp.get(&["volumesnapshotcontent", v["status"]["boundVolumeSnapshotContentName"].as_str().unwrap()]);
    let handle = content["status"]["snapshotHandle"].as_str().unwrap().to_owned();
    let prefix = format!("backup:offsite/{data_vol}/");
    let id = handle.strip_prefix(&prefix).unwrap_or_else(|| panic!("the handle names the backup: {handle}"));
    // Any node finds it on the target; the data's node took it from its own snapshot.
    let on_b = listed(c, "node-b");
    assert!(on_b.iter().any(|b| b["name"] == format!("{data_vol}/{id}").as_str()), "{on_b:?}");

    claim(
        &c.cp,
        "offsite",
        "node-b",
        "64Mi",
        Some(json!({"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": snap})),
        json!({}),
        json!({}),
    );
    let restored = c.bound("offsite");
    let (node, vol) = restored.split_once('/').unwrap();
    assert_eq!(node, "node-b", "restored where the claim's pod goes, not where the data was");
    let b = c.daemon("node-b");
    let got = super::common::nbd::read_image(b, vol, 16 << 20);
    let want = super::common::nbd::read_image(c.daemon("node-a"), data_vol, 16 << 20);
    assert!(got == want, "the restored claim does not hold the snapshot's bytes");
    // Asked again, the restore is followed to its end (or is over already: the volume exists).
    let o = b.cli(&["backup", "restore", &format!("{data_vol}/{id}"), vol, "--target", "offsite"]);
    let why = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() || why.contains("exists"), "{why}");

    // The example's class retains its backups: they outlive the VolumeSnapshot and its content
    // (a deleted namespace, a stolen token), until an operator deletes them.
    c.cp.ok(&["delete", "volumesnapshot", &snap, "--wait=true", "--timeout=120s"]);
    let backup = format!("{data_vol}/{id}");
    assert!(listed(c, "node-b").iter().any(|b| b["name"] == backup.as_str()), "the class retains its backups");
    let content = v["status"]["boundVolumeSnapshotContentName"].as_str().unwrap();
    c.cp.ok(&["delete", "volumesnapshotcontent", content, "--wait=true", "--timeout=120s"]);
    assert!(listed(c, "node-b").iter().any(|b| b["name"] == backup.as_str()), "its content's deletion too");
    c.daemon("node-b").ok(&["backup", "delete", &backup, "--target", "offsite"]);
    assert!(listed(c, "node-b").is_empty(), "an operator deletes it");
    let a = c.daemon("node-a");
    a.ok(&["snapshot", "delete", &format!("{data_vol}.backup.offsite.{id}")]);
    let left = a.ok(&["snapshot", "list"]);
    assert!(!left.contains(".backup."), "and the snapshot it was taken from: {left}");
}
