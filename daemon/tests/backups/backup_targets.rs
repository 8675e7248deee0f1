//! Backups to several targets keep to their own point in time: each target's incrementals build
//! on that target's own base snapshot, a backup interrupted longer ago than the target's grace is
//! not resumed (it would carry a stale time), and a backup's time is its snapshot's. A backup
//! exports without a daemon; a scheduled verify finds damage, keeps it, and sees it healed; a
//! lost index is rebuilt by a prune, reported and counted.

use crate::common;

use common::{Daemon, have, metric};
use std::process::Command;

/// A daemon with two directory targets, `a` and `b`, whose grace is `grace_s`; `top` and
/// `a_extra` are more lines for the config and for `a`'s table.
fn daemon(dir: &std::path::Path, grace_s: u64, top: &str, a_extra: &str) -> Daemon {
    std::fs::create_dir_all(dir).unwrap();
    let mut toml = format!("pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\n{top}");
    for t in ["a", "b"] {
        let path = dir.join(format!("target-{t}"));
        toml += &format!(
            "[backup-targets.{t}]\nkind = \"dir\"\npath = \"{}\"\nchunk-size = \"1M\"\ngrace-s = {grace_s}\n{}",
            path.display(),
            if t == "a" { a_extra } else { "" }
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
    let mut d = daemon(dir.path(), 86_400, "", "");
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
    let d = daemon(dir.path(), 10, "", "");
    d.ok(&["volume", "create", "db", "8MiB"]);
    d.ok(&["export", "nbd", "db"]);
    assert!(qemu_io(&d, "db", "write -P 17 0 1M"));
    // What an interrupted backup leaves: its snapshot, named by its time (a later one than any
    // backup on the target).
    d.ok(&["snapshot", "create", "db", "db.backup.a.29990101T000000Z"]);
    assert!(qemu_io(&d, "db", "write -P 34 0 1M"));
    std::thread::sleep(std::time::Duration::from_secs(11));
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

/// A target verified on a schedule: a chunk damaged in the store is found (the metric, the kept
/// record naming it), quarantined, uploaded again by the next backup, and the verify after
/// that clears the metric.
#[test]
fn a_scheduled_verify_finds_damage_and_sees_it_healed() {
    if !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let top = format!("metrics-listen = \"127.0.0.1:{port}\"\n");
    let d = daemon(dir.path(), 86_400, &top, "verify-every-s = 1\nverify-sample = 1\n");
    d.ok(&["volume", "create", "db", "8MiB"]);
    d.ok(&["export", "nbd", "db"]);
    assert!(qemu_io(&d, "db", "write -P 51 0 2M"));
    let made = d.json(&["backup", "create", "db", "--target", "a"]);
    let bad = |n: f64| move || metric(port, "ferrite_backup_verify_bad_chunks{target=\"a\"}") == Some(n);
    common::until("a clean verify", 20, bad(0.0));

    // The store damages a chunk of the backup.
    let chunks = dir.path().join("target-a/chunks");
    let victim = std::fs::read_dir(&chunks)
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .next()
        .unwrap();
    let mut data = std::fs::read(victim.path()).unwrap();
    data[40] ^= 1;
    std::fs::write(victim.path(), data).unwrap();
    common::until("the verify to find the damage", 20, bad(1.0));
    let kept = dir.path().join("backup-verify.json");
    let name = victim.file_name().into_string().unwrap();
    assert!(std::fs::read_to_string(&kept).unwrap().contains(&name), "the record names the chunk");
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(std::fs::metadata(&kept).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(d.log().contains("verify found damaged chunks"), "{}", d.log());

    // The next backup (nothing changed) uploads it again; the backup restores whole.
    let again = d.json(&["backup", "create", "db", "--target", "a"]);
    assert!(again["uploaded_bytes"].as_u64().unwrap() > 0, "{again}");
    common::until("the verify to see it healed", 20, bad(0.0));
    assert!(restores(&d, "a", made["name"].as_str().unwrap(), "healed", 51), "the damaged backup restores again");
}

/// An index deleted under the daemon: `backup prune` deletes nothing, lists the backups again
/// (and says so), the metrics count them for the alert, and the backups restore. A prune asked
/// for a grace below the target's without `--no-writers` is refused.
#[test]
fn a_lost_index_is_rebuilt_and_reported() {
    if !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let top = format!("metrics-listen = \"127.0.0.1:{port}\"\n");
    // A backup commits within 0.9 x grace on the store's whole-second clock: 3 s, not 1.
    let d = daemon(dir.path(), 3, &top, "");
    d.ok(&["volume", "create", "db", "8MiB"]);
    d.ok(&["export", "nbd", "db"]);
    assert!(qemu_io(&d, "db", "write -P 51 0 1M"));
    let made = d.json(&["backup", "create", "db", "--target", "a"]);
    let name = made["name"].as_str().unwrap();
    std::fs::remove_file(dir.path().join("target-a/volumes/db/index")).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(4100));
    let p = d.json(&["backup", "prune", "--target", "a"]);
    assert_eq!((p["indexes_rebuilt"][0].as_str(), p["backups_recovered"][0].as_str()), (Some("db"), Some(name)), "{p}");
    assert_eq!((p["manifests_deleted"].as_u64(), p["chunks_deleted"].as_u64()), (Some(0), Some(0)), "{p}");
    assert_eq!(metric(port, "ferrite_backup_recovered_total{target=\"a\"}"), Some(1.0));
    assert_eq!(metric(port, "ferrite_backup_manifests{target=\"a\"}"), Some(1.0));
    assert!(d.log().contains("listed them again"), "{}", d.log());
    assert!(restores(&d, "a", name, "back", 51), "the backup its index had lost restores");
    let out = d.cli(&["backup", "prune", "--target", "a", "--grace-s", "0"]);
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && msg.contains("--no-writers"), "{msg}");
}
