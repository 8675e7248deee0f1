//! Synchronous replicas of an encrypted volume, between daemons in network namespaces: members
//! hold its ciphertext and no key (no plaintext in their pool files, against a plaintext volume
//! as the control; locked, so not exported), follow the primary's rekey, are rebuilt from
//! ciphertext, and a promoted member opens with the primary's current key and serves the same
//! bytes. A data-key rotation of a mirrored volume, and a rekey on a member, are refused.

use crate::common;

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

use common::Daemon;
use common::mirror::state_of;
use common::nbd::read_image;
use common::netns::{Nics, Switch};
use common::until;
use serde_json::Value;

const MIB: u64 = 1 << 20;

fn run(d: &Daemon, program: &str, args: &[&str], volume: &str) {
    d.ok(&["export", "nbd", volume]);
    let uri = d.qemu_uri(volume);
    let fio_uri = format!("--uri=nbd+unix:///{volume}?socket={}", d.nbd().display());
    let mut c = Command::new(program);
    match program {
        "fio" => c.args(["--name=w", "--ioengine=nbd", "--output=/dev/null", &fio_uri]).args(args),
        _ => c.args(["-f", "raw"]).args(args.iter().flat_map(|a| ["-c", a])).arg(&uri),
    };
    let o = c.stdin(Stdio::null()).output().unwrap();
    assert!(o.status.success(), "{program} {args:?}: {}{}", String::from_utf8_lossy(&o.stderr), d.log());
}

/// Whether the pool file of `d` holds a run of 4096 bytes equal to `b` (read a slice at a time:
/// the file is as large as the pool).
fn pool_has_run(d: &Daemon, b: u8) -> bool {
    let mut f = std::fs::File::open(d.dir.join("pool.img")).unwrap();
    let mut buf = vec![0u8; 16 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return false;
        }
        // Runs are block-aligned in the pool: a block at a time is enough.
        if buf[..n].chunks_exact(4096).any(|c| c.iter().all(|&x| x == b)) {
            return true;
        }
    }
}

/// Copies key `id` from `from`'s key directory to `to`'s, private as the daemon wants it.
fn copy_key(from: &Daemon, to: &Daemon, id: &str) {
    let dir = to.dir.join("keys");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let file = dir.join(format!("{id}.key"));
    std::fs::copy(from.dir.join("keys").join(format!("{id}.key")), &file).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn stderr_of(d: &Daemon, args: &[&str]) -> String {
    let o = d.cli(args);
    assert!(!o.status.success(), "{args:?} was not refused");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn an_encrypted_volume_mirrors_its_ciphertext_and_opens_where_it_is_promoted() {
    if !common::have("fio") || !common::have("qemu-io") {
        return common::skip("fio or qemu-io", true);
    }
    let root = tempfile::tempdir().unwrap();
    let extra = "sync-timeout-ms = 1000\nsync-mark-interval-ms = 500";
    let Some(sw) = Switch::new(3) else { return };
    let mut d: Vec<Daemon> = (0..3).map(|i| sw.daemon(i, root.path(), extra)).collect();
    let (e1, e2) = (sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&[
        "volume",
        "create",
        "v",
        "64M",
        "--encrypt",
        "--key",
        "k1",
        "--replicas",
        "3",
        "--peer",
        &e1,
        "--peer",
        &e2,
    ]);
    d[0].ok(&["volume", "create", "p", "16M", "--replicas", "2", "--peer", &e1]);
    let on_member: Value = d[1].json(&["volume", "show", "v"]);
    assert_eq!(on_member["encryption"]["key_id"], "k1", "{on_member}");
    assert_eq!(on_member["encryption"]["unlocked"], false, "a member holds no key: {on_member}");

    // Whole blocks, partial ones, zeroes and trims, verified through the primary.
    run(&d[0], "qemu-io", &["write -P 0x77 0 4M", "write -P 0x5a 4194816 3000", "write -z 5M 1M", "flush"], "v");
    run(&d[0], "fio", &["--rw=randwrite", "--bsrange=512-16k", "--offset=8M", "--size=24M", "--verify=crc32c"], "v");
    run(&d[0], "qemu-io", &["discard 6M 1M", "write -P 0x66 0 4M", "flush"], "p");
    let image = read_image(&d[0], "v", 64 * MIB);
    assert!(image[..4 << 20].iter().all(|&b| b == 0x77));

    // The members hold ciphertext only (the plaintext volume is the scan's control), and a
    // locked copy is not exported.
    assert!(pool_has_run(&d[1], 0x66), "the control: the plaintext replica's bytes are in the pool file");
    for m in &d[1..] {
        assert!(!pool_has_run(m, 0x77), "a member's pool file holds the encrypted volume's plaintext");
        assert!(!m.dir.join("keys/k1.key").exists());
    }
    assert!(stderr_of(&d[1], &["export", "nbd", "v"]).contains("locked"));

    // A rekey reaches the members (a new generation with the new wrapping); what a member or a
    // mirrored volume must not do is refused.
    let g = d[0].json(&["replica", "status", "v"])["generation"].as_u64().unwrap();
    d[0].ok(&["volume", "rekey", "v", "--key", "k2"]);
    assert_eq!(d[1].json(&["replica", "status", "v"])["generation"].as_u64(), Some(g + 1));
    assert!(stderr_of(&d[1], &["volume", "rekey", "v", "--key", "k3"]).contains("rekey it on its primary"));
    assert!(stderr_of(&d[0], &["volume", "rekey", "v", "--data-key"]).contains("synchronous replicas"));

    // A member away while partial blocks change is rebuilt from ciphertext.
    d[2].crash();
    run(&d[0], "fio", &["--rw=randwrite", "--bsrange=512-16k", "--size=8M", "--iodepth=4"], "v");
    d[2] = sw.daemon(2, root.path(), extra);
    until("the returning member is in sync", 60, || state_of(&d[0], "v", &e2) == "in-sync");
    let image = read_image(&d[0], "v", 64 * MIB);

    // The primary dies; a member holding only the new key file is promoted, opens with it and
    // serves what the primary acknowledged. The other member, given the key, reads the same.
    copy_key(&d[0], &d[1], "k2");
    d[0].crash();
    let p = d[1].json(&["replica", "promote", "v"]);
    assert_eq!(p["role"], "primary", "{p}");
    assert_eq!(d[1].json(&["volume", "show", "v"])["encryption"]["unlocked"], true, "{}", d[1].log());
    assert!(read_image(&d[1], "v", 64 * MIB) == image, "the promoted copy differs from what the primary held");
    run(&d[1], "qemu-io", &["write -P 0x31 1000 5000", "read -P 0x31 1000 5000"], "v");
    // The other member is brought to the new primary's content (from ciphertext) first.
    until("the other member is reconciled", 60, || state_of(&d[1], "v", &e2) == "in-sync");
    copy_key(&d[1], &d[2], "k2");
    d[2].ok(&["volume", "unlock", "v"]);
    assert!(read_image(&d[2], "v", 64 * MIB) == read_image(&d[1], "v", 64 * MIB), "the members differ");
}
