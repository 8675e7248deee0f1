//! `ferrite backup` end to end: two daemons sharing an encrypted S3 target (SeaweedFS on
//! loopback); one backs a volume up (full, then incremental, its base snapshot rotated), the
//! other restores it, byte for byte; list, show, verify, prune, and the errors a user meets.

use crate::common;
use crate::weed;

use common::{Daemon, have, metric};
use std::process::Command;

/// A store, and two daemons (a and b) sharing an encrypted target on it, `b_extra` in b's
/// target table.
struct Pair {
    _weed: weed::Weed,
    dir: tempfile::TempDir,
    a: Daemon,
    b: Daemon,
    a_metrics: u16,
    b_metrics: u16,
}

fn pair(b_extra: &str) -> Option<Pair> {
    let weed = weed::Weed::start(true)?;
    if !have("qemu-io") || !have("qemu-img") {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("offsite.key");
    std::fs::write(&key, "42".repeat(32)).unwrap();
    let a_metrics = config_with(&dir.path().join("a"), &weed, &key, "");
    let b_metrics = config_with(&dir.path().join("b"), &weed, &key, b_extra);
    let a = Daemon::start(&dir.path().join("a"));
    let b = Daemon::start(&dir.path().join("b"));
    Some(Pair { _weed: weed, dir, a, b, a_metrics, b_metrics })
}

/// Whether export `ea` of `a` and `eb` of `b` hold the same bytes (qemu-img compare).
fn same(a: &Daemon, ea: &str, b: &Daemon, eb: &str) -> bool {
    let cmp = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(a.qemu_uri(ea))
        .arg(b.qemu_uri(eb))
        .output()
        .unwrap();
    if !cmp.status.success() {
        eprintln!("qemu-img compare: {cmp:?}");
    }
    cmp.status.success()
}

/// The config, with `extra` lines in the target's table; the port of its metrics listener.
fn config_with(dir: &std::path::Path, weed: &weed::Weed, key: &std::path::Path, extra: &str) -> u16 {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    std::fs::create_dir_all(dir).unwrap();
    let creds = dir.join("s3-credentials");
    std::fs::create_dir_all(&creds).unwrap();
    std::fs::write(creds.join("access-key-id"), "ferrite").unwrap();
    std::fs::write(creds.join("secret-access-key"), "ferrite-secret").unwrap();
    let toml = format!(
        "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\nmetrics-listen = \"127.0.0.1:{port}\"\n\
         [backup-targets.offsite]\nkind = \"s3\"\nendpoint = \"{}\"\nbucket = \"ferrite-test\"\nprefix = \"prod\"\n\
         credentials = \"{}\"\nkey-file = \"{}\"\nchunk-size = \"1M\"\nconcurrency = 4\n{extra}",
        weed.endpoint(),
        creds.display(),
        key.display()
    );
    std::fs::write(dir.join("ferrite.toml"), toml).unwrap();
    port
}

fn qemu_io(d: &Daemon, export: &str, cmd: &str) {
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", cmd]).arg(d.qemu_uri(export)).output().unwrap();
    assert!(out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("fail"), "{cmd}: {out:?}");
}

#[test]
fn back_up_on_one_daemon_restore_on_another() {
    // Bound, not `..`: what a pattern leaves out is dropped at once (the store, the directory).
    let Some(Pair { _weed: _store, dir: _dir, a, b, .. }) = pair("") else { return };

    a.ok(&["volume", "create", "db", "16MiB"]);
    a.ok(&["export", "nbd", "db"]);
    for n in 0..6 {
        qemu_io(&a, "db", &format!("write -P {} {n}M 1M", 0x11 + n));
    }
    let full = a.json(&["backup", "create", "db", "--target", "offsite"]);
    assert_eq!(full["full"], true, "{full}");
    assert_eq!(full["chunks"], 6, "10 MiB never written cost nothing: {full}");
    qemu_io(&a, "db", "write -P 0x22 2M 4k");
    let inc = a.json(&["backup", "create", "db", "--target", "offsite"]);
    assert_eq!(inc["full"], false, "{inc}");
    assert_eq!(inc["previous"], full["id"]);
    assert_eq!(inc["chunks"], 6);
    assert!(inc["uploaded_bytes"].as_u64().unwrap() < 1 << 20, "only the touched chunk goes: {inc}");
    // The newest backup's snapshot is kept as the next one's base; the older one is gone.
    let snaps = a.ok(&["snapshot", "list", "db"]);
    let names: Vec<&str> = snaps.lines().skip(1).filter_map(|l| l.split_whitespace().next()).collect();
    let base = inc["snapshot"].as_str().unwrap();
    assert_eq!(names, [base], "{snaps}");

    // The other daemon sees them and restores the newest.
    let list = b.json(&["backup", "list", "--target", "offsite"]);
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    let name = inc["name"].as_str().unwrap();
    let shown = b.json(&["backup", "show", name, "--target", "offsite"]);
    assert_eq!(shown["encrypted_volume"], false);
    b.ok(&["backup", "restore", name, "db", "--target", "offsite"]);
    a.ok(&["export", "nbd", &format!("db@{base}"), "--name", "base"]);
    b.ok(&["export", "nbd", "db"]);
    assert!(same(&a, "base", &b, "db"), "restored volume differs");

    let v = b.json(&["backup", "verify", "--target", "offsite"]);
    assert_eq!(
        (v["chunks_checked"].as_u64(), v["bad"].as_array().map(Vec::len)),
        (Some(7 + 2), Some(0)),
        "7 chunks, 2 segments: {v}"
    );
    let p = b.json(&["backup", "prune", "--target", "offsite", "--keep-last", "1", "--grace-s", "0", "--no-writers"]);
    assert_eq!(p["backups_deleted"][0], full["name"], "{p}");
    assert_eq!(p["chunks_deleted"], 2, "the first version of the rewritten chunk, and of its segment: {p}");

    // Errors a user meets, each one line that says what is wrong.
    for (args, says) in [
        (vec!["backup", "list", "--target", "nowhere"], "no backup target \"nowhere\""),
        (vec!["backup", "restore", name, "db", "--target", "offsite"], "already exists"),
        (vec!["backup", "show", "db/nope", "--target", "offsite"], "not on target"),
        (vec!["backup", "create", "missing", "--target", "offsite"], "not found"),
        (vec!["backup", "show", "not-a-name", "--target", "offsite"], "VOLUME/ID"),
        (vec!["backup", "list", "../x", "--target", "offsite"], "invalid volume name"),
        (
            vec!["backup", "set-lock", "--target", "offsite", "--mode", "strict", "--days", "1"],
            "governance or compliance",
        ),
        (
            vec!["backup", "set-lock", "--target", "offsite", "--mode", "compliance", "--days", "1"],
            "has no object lock",
        ),
    ] {
        let out = b.cli(&args);
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && msg.contains(says) && msg.trim().lines().count() == 1, "{args:?}: {msg}");
    }
}

/// Instant restore: the volume serves as soon as the restore is asked for (a read of what is not
/// copied yet fetches it first, a write lands on top of it), no snapshot of it is taken until
/// it is whole, and a daemon killed in the middle resumes the copy on start without losing the
/// write it acknowledged.
#[test]
fn an_instant_restore_serves_at_once_and_survives_a_crash() {
    // b's copy is paced to 4 MiB/s: 24 chunks of noise take ~6 s, time for the requests below.
    let Some(Pair { _weed: _store, dir, a, mut b, a_metrics, b_metrics }) = pair("bandwidth = \"4M\"\n") else {
        return;
    };
    a.ok(&["volume", "create", "src", "24MiB"]);
    a.ok(&["export", "nbd", "src"]);
    // Incompressible, so that the pace holds the copy back.
    let noise = dir.path().join("noise");
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..24 << 17)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(&noise, &bytes).unwrap();
    qemu_io(&a, "src", &format!("write -s {} 0 24M", noise.display()));
    let backup = a.json(&["backup", "create", "src", "--target", "offsite"]);
    let name = backup["name"].as_str().unwrap();
    let at = |m: &str| metric(a_metrics, &format!("{m}{{target=\"offsite\",volume=\"src\"}}"));
    assert!(at("ferrite_backup_last_success_timestamp_seconds").is_some_and(|t| t > 1e9));
    assert_eq!(at("ferrite_backup_last_failed"), Some(0.0));
    assert!(!a.cli(&["backup", "create", "src@nope", "--target", "offsite"]).status.success());
    assert_eq!(at("ferrite_backup_last_failed"), Some(1.0));
    assert_eq!(at("ferrite_backup_failures_total"), Some(1.0));

    let start = std::time::Instant::now();
    let r = b.json(&["backup", "restore", name, "db", "--target", "offsite", "--detach"]);
    assert_eq!(r["done"], false, "{r}");
    b.ok(&["export", "nbd", "db"]);
    let out =
        Command::new("qemu-io").args(["-f", "raw", "-c", "read -v 20M 16"]).arg(b.qemu_uri("db")).output().unwrap();
    println!("first byte read {:?} after the restore was asked for", start.elapsed());
    let dump = String::from_utf8_lossy(&out.stdout);
    let want: Vec<String> = bytes[20 << 20..][..16].iter().map(|b| format!("{b:02x}")).collect();
    assert!(dump.contains(&want.join(" ")), "the chunk read on demand is not the backup's: {dump}");
    qemu_io(&b, "db", "write -P 0x77 21M 4k");
    qemu_io(&a, "src", "write -P 0x77 21M 4k");
    let out = b.cli(&["snapshot", "create", "db", "early"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("being restored"), "{out:?}");
    let left = metric(b_metrics, "ferrite_backup_restore_chunks_left{volume=\"db\"}").unwrap();
    assert!(left > 0.0 && left < 24.0, "{left}");
    assert!(metric(b_metrics, "ferrite_backup_restore_chunks_on_demand{volume=\"db\"}").unwrap() >= 2.0);
    let record = dir.path().join("b/restores.json");
    assert!(std::fs::read_to_string(&record).unwrap().contains(name), "the restore is recorded");

    b.crash();
    let b = Daemon::start(&dir.path().join("b"));
    // Asked again, the command follows the resumed restore to its end.
    let out = b.cli(&["-o", "json", "backup", "restore", name, "db", "--target", "offsite"]);
    assert!(out.status.success(), "{out:?}\n{}", b.log());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["done"].as_bool(), r["chunks"].as_u64()), (Some(true), Some(24)), "{r}");
    assert!(!std::fs::read_to_string(&record).unwrap().contains(name), "the finished restore's record stays");
    b.ok(&["export", "nbd", "db"]);
    assert!(same(&a, "src", &b, "db"), "the restored volume differs from its source plus the write");
    b.ok(&["snapshot", "create", "db", "whole"]);
    assert!(b.log().contains("an unfinished restore resumed"), "{}", b.log());
}
