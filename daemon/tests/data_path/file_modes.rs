//! Every file the daemon writes is private to it: the data and metadata directories 0700, the
//! pool file, the catalog's files and the JSON state files 0600 (no group or other bits), the
//! sockets as documented (admin 0600, NBD 0660). Looser modes left by an older daemon are
//! tightened at start.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::Daemon;

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

/// Every path under `dir` the daemon wrote (the test's own config and log excluded).
fn written(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if matches!(p.file_name().and_then(|n| n.to_str()), Some("ferrite.toml" | "daemon.log")) {
            continue;
        }
        if p.is_dir() {
            written(&p, out);
        }
        out.push(p);
    }
}

fn check_private(dir: &Path) {
    assert_eq!(mode(dir), 0o700, "data directory");
    let mut paths = Vec::new();
    written(dir, &mut paths);
    assert!(paths.iter().any(|p| p.ends_with("meta/CURRENT")), "{paths:?}");
    for p in &paths {
        let m = mode(p);
        let want = match p.file_name().and_then(|n| n.to_str()) {
            Some("admin.sock") => 0o600,
            Some("nbd.sock") => 0o660,
            _ if p.is_dir() => 0o700,
            _ => 0o600,
        };
        assert!(m & !want == 0, "{} has mode {m:o}, more than {want:o}", p.display());
    }
}

#[test]
fn every_file_the_daemon_writes_is_private() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "db", "64MiB"]);
    d.ok(&["export", "nbd", "db"]);
    d.ok(&["fence", "add", "192.0.2.0/24"]);
    for f in ["pool.img", "meta", "exports.json", "fences.json", "attachments.json"] {
        assert!(dir.path().join(f).exists(), "{f} was not written");
    }
    check_private(dir.path());
    assert!(d.stop().success(), "{}", d.log());
    // The log went to a file: plain text, no terminal escape sequences.
    let log = d.log();
    assert!(log.contains("ferrite daemon ready") && !log.contains('\x1b'), "{log}");

    // A pool whose modes were loosened (by hand, or an older daemon) is tightened at start.
    for (p, m) in [("", 0o755), ("pool.img", 0o644), ("meta", 0o755), ("meta/CURRENT", 0o644)] {
        std::fs::set_permissions(dir.path().join(p), std::fs::Permissions::from_mode(m)).unwrap();
    }
    let mut d = Daemon::start(dir.path());
    check_private(dir.path());
    assert!(d.log().contains("tightening permissions"), "{}", d.log());
    assert!(d.stop().success());
}
