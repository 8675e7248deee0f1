//! Backups to several targets keep to their own point in time: each target's incrementals build
//! on that target's own base snapshot, a backup interrupted longer ago than the target's grace is
//! not resumed (it would carry a stale time), and a backup's time is its snapshot's.

mod common;

use common::{Daemon, have};
use std::process::Command;

/// A daemon with two directory targets, `a` and `b`, whose grace is `grace_s`.
fn daemon(dir: &std::path::Path, grace_s: u64) -> Daemon {
    std::fs::create_dir_all(dir).unwrap();
    let mut toml = String::from("pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\n");
    for t in ["a", "b"] {
        let path = dir.join(format!("target-{t}"));
        toml += &format!(
            "[backup-targets.{t}]\nkind = \"dir\"\npath = \"{}\"\nchunk-size = \"1M\"\ngrace-s = {grace_s}\n",
            path.display()
        );
    }
    std::fs::write(dir.join("ferrite.toml"), toml).unwrap();
    Daemon::start(dir)
}

/// Runs qemu-io command `cmd` on export `export`; whether it succeeded (a pattern read that
/// does not match fails).
fn qemu_io(d: &Daemon, export: &str, cmd: &str) -> bool {
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", cmd]).arg(d.qemu_uri(export)).output().unwrap();
    out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("fail")
}

fn snapshots(d: &Daemon) -> Vec<String> {
    let out = d.ok(&["snapshot", "list", "db"]);
    out.lines().skip(1).filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect()
}

/// A restore of `name` from `target` as volume `volume` holds `byte` over the first MiB.
fn restores(d: &Daemon, target: &str, name: &str, volume: &str, byte: u8) -> bool {
    d.ok(&["backup", "restore", name, volume, "--target", target]);
    d.ok(&["export", "nbd", volume]);
    qemu_io(d, volume, &format!("read -P {byte} 0 1M"))
}

#[test]
fn each_target_builds_on_its_own_snapshot() {
    if !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut d = daemon(dir.path(), 86_400);
    d.ok(&["volume", "create", "db", "8MiB"]);
    d.ok(&["export", "nbd", "db"]);
    assert!(qemu_io(&d, "db", "write -P 51 0 1M"));
    let on_a = d.json(&["backup", "create", "db", "--target", "a"]);
    assert!(qemu_io(&d, "db", "write -P 68 0 1M"));
    let on_b = d.json(&["backup", "create", "db", "--target", "b"]);
    assert_eq!(on_b["full"], true, "b has no backup to build on: {on_b}");
    assert!(on_b["full_reason"].as_str().is_some_and(str::is_empty), "b's first backup: {on_b}");
    // Each target keeps its own base.
    let bases = snapshots(&d);
    assert_eq!(bases.len(), 2, "{bases:?}");
    assert!(bases.iter().any(|s| s.starts_with("db.backup.a.")) && bases.iter().any(|s| s.starts_with("db.backup.b.")));
    assert!(restores(&d, "b", on_b["name"].as_str().unwrap(), "from-b", 68), "b's backup holds 68");
    assert!(restores(&d, "a", on_a["name"].as_str().unwrap(), "from-a", 51), "a's backup still holds 51");

    // a's next backup is an incremental on a's own base, and holds what the volume holds now.
    assert!(qemu_io(&d, "db", "write -P 85 1M 1M"));
    let again = d.json(&["backup", "create", "db", "--target", "a"]);
    assert_eq!((again["full"].as_bool(), again["previous"].as_str()), (Some(false), on_a["id"].as_str()), "{again}");
    d.ok(&["backup", "restore", again["name"].as_str().unwrap(), "again", "--target", "a"]);
    d.ok(&["export", "nbd", "again"]);
    assert!(qemu_io(&d, "again", "read -P 68 0 1M") && qemu_io(&d, "again", "read -P 85 1M 1M"));
    let bases = snapshots(&d);
    assert_eq!(bases.iter().filter(|s| s.starts_with("db.backup.b.")).count(), 1, "b's base stays: {bases:?}");
    assert!(bases.contains(&format!("db.backup.a.{}", again["id"].as_str().unwrap())), "{bases:?}");

    // With no daemon at all, the target's config is enough to export a backup's raw image: to
    // a sparse file qemu reads, or to stdout.
    d.stop();
    let (config, img) = (dir.path().join("ferrite.toml"), dir.path().join("again.img"));
    let export = |file: &std::path::Path| {
        let mut cmd = Command::new(common::BIN);
        cmd.args(["backup", "export", again["name"].as_str().unwrap(), "--target", "a", "--config"]);
        cmd.arg(&config).arg("--file").arg(file).output().unwrap()
    };
    let out = export(&img);
    assert!(out.status.success(), "{out:?}");
    let info = Command::new("qemu-img").args(["info", "--output", "json", "-f", "raw"]).arg(&img).output().unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["virtual-size"], 8 << 20, "{info}");
    assert!(info["actual-size"].as_u64().unwrap() < 4 << 20, "the zeros are holes: {info}");
    let read = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 68 0 1M", "-c", "read -P 85 1M 1M", "-c", "read -P 0 2M 6M"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(read.status.success() && !String::from_utf8_lossy(&read.stdout).contains("fail"), "{read:?}");
    let piped = export(std::path::Path::new("-"));
    assert!(piped.status.success() && piped.stdout == std::fs::read(&img).unwrap(), "stdout holds the same image");
    let twice = export(&img);
    assert!(!twice.status.success() && String::from_utf8_lossy(&twice.stderr).contains("exists"), "{twice:?}");
}

/// An interrupted backup (its snapshot taken, nothing on the target yet) older than the grace is
/// not resumed: the next backup takes a new snapshot, holds the volume as it is then, and its
/// time is that snapshot's. Within the grace it is resumed, at the interrupted snapshot's time.
#[test]
fn a_stale_interrupted_backup_is_not_resumed() {
    if !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), 3);
    d.ok(&["volume", "create", "db", "8MiB"]);
    d.ok(&["export", "nbd", "db"]);
    assert!(qemu_io(&d, "db", "write -P 17 0 1M"));
    // What an interrupted backup leaves: its snapshot, named by its time (a later one than any
    // backup on the target).
    d.ok(&["snapshot", "create", "db", "db.backup.a.29990101T000000Z"]);
    assert!(qemu_io(&d, "db", "write -P 34 0 1M"));
    std::thread::sleep(std::time::Duration::from_secs(4));
    let made = d.json(&["backup", "create", "db", "--target", "a"]);
    assert_ne!(made["id"], "29990101T000000Z", "{made}");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let created = made["created_unix"].as_u64().unwrap();
    assert!(created + 10 > now && created <= now, "its time is its snapshot's, now: {made}");
    assert!(restores(&d, "a", made["name"].as_str().unwrap(), "fresh", 34), "it holds the volume as it is now");
    assert!(!snapshots(&d).iter().any(|s| s.ends_with("29990101T000000Z")), "the stale snapshot went");

    // Within the grace, it is resumed: the interrupted snapshot's data and time.
    d.ok(&["snapshot", "create", "db", "db.backup.a.29990102T000000Z"]);
    assert!(qemu_io(&d, "db", "write -P 85 0 1M"));
    let resumed = d.json(&["backup", "create", "db", "--target", "a"]);
    assert_eq!(resumed["id"], "29990102T000000Z", "{resumed}");
    assert!(restores(&d, "a", resumed["name"].as_str().unwrap(), "resumed", 34), "the interrupted point in time");
}
