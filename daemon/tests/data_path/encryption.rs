//! Encrypted volumes through the daemon and its CLI: made with a key from the key directory
//! (private files), served over NBD like any other, no plaintext in the pool file, locked after
//! a restart without their key (no export, clear errors, other volumes unaffected), unlocked and
//! rekeyed online (`sync_encryption.rs` and `replica.rs` show its replicas hold only ciphertext).

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use common::{Daemon, have, skip};

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A run of `n` bytes equal to `b` somewhere in `hay`.
fn has_run(hay: &[u8], b: u8, n: usize) -> bool {
    hay.windows(n).step_by(512).any(|w| w.iter().all(|&x| x == b))
}

#[test]
fn encrypted_volumes_through_the_daemon() {
    if !have("qemu-io") {
        return skip("qemu-io", true);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "db", "64MiB", "--encrypt"]);
    d.ok(&["volume", "create", "plain", "16MiB"]);
    let keys = dir.path().join("keys");
    assert_eq!((mode(&keys), mode(&keys.join("default.key"))), (0o700, 0o600));
    let v = d.json(&["volume", "show", "db"]);
    assert_eq!(v["encryption"], serde_json::json!({"key_id": "default", "unlocked": true, "provider": "file"}), "{v}");
    assert!(d.ok(&["volume", "list"]).contains("aes-xts, key default (file)"));
    assert_eq!(d.json(&["volume", "show", "plain"])["encryption"], serde_json::Value::Null);

    // Real NBD clients read and write it like any other volume.
    d.ok(&["export", "nbd", "db"]);
    d.ok(&["export", "nbd", "plain"]);
    let io = |d: &Daemon, export: &str, cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        let o = c.arg(d.qemu_uri(export)).output().unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o)))
    };
    let (ok, out) = io(&d, "db", &["write -P 0x77 1M 2M", "write -P 0x5a 4097 3000", "flush"]);
    assert!(ok, "{out}");
    let (ok, out) = io(&d, "plain", &["write -P 0x66 0 1M", "flush"]);
    assert!(ok, "{out}");
    let (ok, out) = io(&d, "db", &["read -P 0x77 1M 2M", "read -P 0x5a 4097 3000", "read -P 0 0 4097"]);
    assert!(ok && !out.contains("verification failed"), "{out}");
    assert!(d.stop().success(), "{}", d.log());

    let raw = std::fs::read(dir.path().join("pool.img")).unwrap();
    assert!(has_run(&raw, 0x66, 4096), "the control: a plaintext volume's bytes are in the pool file");
    assert!(!has_run(&raw, 0x77, 4096), "the encrypted volume's plaintext is in the pool file");
    assert!(!d.log().contains(&std::fs::read_to_string(keys.join("default.key")).unwrap().trim().to_string()));

    // Without its key the volume stays locked across a restart; the rest is served.
    std::fs::rename(keys.join("default.key"), dir.path().join("default.key")).unwrap();
    let d = Daemon::start(dir.path());
    assert!(d.log().contains("stays locked"), "{}", d.log());
    let v = d.json(&["volume", "show", "db"]);
    assert_eq!(v["encryption"]["unlocked"], false, "{v}");
    assert!(d.ok(&["volume", "show", "db"]).contains("LOCKED"));
    let (ok, out) = io(&d, "db", &["read 0 4096"]);
    assert!(!ok, "a locked volume's export served: {out}");
    let o = d.cli(&["export", "nbd", "db", "--name", "again"]);
    assert!(!o.status.success() && stderr(&o).contains("is encrypted and locked"), "{}", stderr(&o));
    let o = d.cli(&["attach", "db"]);
    assert!(!o.status.success() && stderr(&o).contains("locked"), "{}", stderr(&o));
    let (ok, out) = io(&d, "plain", &["read -P 0x66 0 1M"]);
    assert!(ok && !out.contains("verification failed"), "{out}");
    let o = d.cli(&["volume", "unlock", "db"]);
    assert!(!o.status.success() && stderr(&o).contains("default"), "{}", stderr(&o));

    // A key file others can read is refused; a private one unlocks it, and its export comes back.
    std::fs::rename(dir.path().join("default.key"), keys.join("default.key")).unwrap();
    std::fs::set_permissions(keys.join("default.key"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = d.cli(&["volume", "unlock", "db"]);
    assert!(!o.status.success() && stderr(&o).contains("chmod 600"), "{}", stderr(&o));
    std::fs::set_permissions(keys.join("default.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(d.ok(&["volume", "unlock", "db"]).contains("aes-xts, key default (file)"));
    let (ok, out) = io(&d, "db", &["read -P 0x77 1M 2M"]);
    assert!(ok && !out.contains("verification failed"), "{out}");

    // Rekey online: a new key file, the volume wrapped by it; the old file is no longer needed.
    let v = d.json(&["volume", "rekey", "db", "--key", "k2"]);
    assert_eq!(v["encryption"]["key_id"], "k2", "{v}");
    assert_eq!(mode(&keys.join("k2.key")), 0o600);
    let (ok, out) = io(&d, "db", &["write -P 0x31 0 4096", "read -P 0x77 1M 2M"]);
    assert!(ok && !out.contains("verification failed"), "{out}");
    let mut d = d;
    assert!(d.stop().success());
    std::fs::remove_file(keys.join("default.key")).unwrap();
    let d = Daemon::start(dir.path());
    assert_eq!(d.json(&["volume", "show", "db"])["encryption"]["unlocked"], true);
    let (ok, out) = io(&d, "db", &["read -P 0x31 0 4096", "read -P 0x77 1M 2M"]);
    assert!(ok && !out.contains("verification failed"), "{out}");

    // Snapshots and clones stay encrypted and read.
    d.ok(&["snapshot", "create", "db", "s1"]);
    d.ok(&["clone", "db@s1", "db-clone"]);
    assert_eq!(d.json(&["volume", "show", "db-clone"])["encryption"]["key_id"], "k2");
    d.ok(&["export", "nbd", "db-clone"]);
    let (ok, out) = io(&d, "db-clone", &["read -P 0x77 1M 2M"]);
    assert!(ok && !out.contains("verification failed"), "{out}");
}

#[test]
fn a_data_key_rotation_reencrypts_a_volume_in_use_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "db", "64MiB", "--encrypt"]);
    let data = common::pattern(9, 8 << 20);
    assert_eq!(common::nbd::write_on(&mut common::nbd::open(&d, "db"), 4 << 20, &data), 0);
    d.ok(&["snapshot", "create", "db", "before"]);
    // Shows progress until done; the volume reads the same, its snapshot keeps the old key.
    let o = d.cli(&["volume", "rekey", "db", "--data-key"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("re-encrypting: 100%"), "{}", stderr(&o));
    assert_eq!(&common::nbd::read_image(&d, "db", 64 << 20)[4 << 20..12 << 20], &data[..]);
    assert_eq!(&common::nbd::read_image(&d, "db@before", 64 << 20)[4 << 20..12 << 20], &data[..]);
    // Started and cut by a restart: it resumes by itself and finishes.
    let v = d.json(&["volume", "rekey", "db", "--data-key", "--detach"]);
    assert!(v["encryption"]["rotation"].is_object() || v["encryption"]["rotation"].is_null(), "{v}");
    assert!(d.stop().success());
    let d = Daemon::start(dir.path());
    let start = std::time::Instant::now();
    while d.json(&["volume", "show", "db"])["encryption"].get("rotation").is_some() {
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "{}", d.ok(&["volume", "show", "db"]));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(&common::nbd::read_image(&d, "db", 64 << 20)[4 << 20..12 << 20], &data[..]);
    let o = d.cli(&["volume", "rekey", "plain-nope", "--data-key"]);
    assert!(!o.status.success() && stderr(&o).contains("not found"), "{}", stderr(&o));
}
