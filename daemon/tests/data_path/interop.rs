//! The daemon with independent clients: fio's nbd engine with crc32c verification, and an
//! nbdsh script checking multi-conn (a flush on one connection covers writes acknowledged on
//! another) and protocol errors. Each test skips where its client is missing.

use crate::common;

use std::process::Command;

use common::{Daemon, have, skip};

#[test]
fn fio_nbd_engine_verifies_crc32c() {
    if !have("fio")
        || !Command::new("fio")
            .arg("--enghelp")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("nbd"))
    {
        return skip("fio lacks the nbd engine (Debian's fio, which setup.sh installs, has it)", true);
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "f", "64M"]);
    d.ok(&["export", "nbd", "f"]);
    let uri = format!("nbd+unix:///f?socket={}", d.nbd().display());
    for (rw, bs, depth) in [("randwrite", "4k", "16"), ("write", "128k", "4"), ("randrw", "16k", "8")] {
        let out = Command::new("fio")
            .args(["--name=verify", "--ioengine=nbd", "--size=32M", "--verify=crc32c", "--do_verify=1"])
            .arg("--verify_state_save=0")
            .arg(format!("--uri={uri}"))
            .arg(format!("--rw={rw}"))
            .arg(format!("--bs={bs}"))
            .arg(format!("--iodepth={depth}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "fio {rw} failed: {text}");
        assert!(!text.contains("verify: bad"), "{text}");
        assert!(text.contains("err= 0"), "{text}");
    }
}

const NBDSH_SCRIPT: &str = r#"
import nbd, sys
uri = sys.argv[1]
a = nbd.NBD(); a.add_meta_context("base:allocation"); a.connect_uri(uri)
b = nbd.NBD(); b.connect_uri(uri)
assert a.can_multi_conn() and a.can_flush() and a.can_fua() and a.can_trim() and a.can_zero()
assert a.can_meta_context("base:allocation")
# Write on A, flush on B, read on B and on a third connection.
a.pwrite(b"\x5a" * 65536, 1 << 20)
b.flush()
assert b.pread(65536, 1 << 20) == b"\x5a" * 65536
c = nbd.NBD(); c.connect_uri(uri)
assert c.pread(4096, (1 << 20) + 4096) == b"\x5a" * 4096
# Protocol errors come back as errors, and the connection stays usable.
size = a.get_size()
for bad in (lambda: a.pread(4096, size), lambda: a.pwrite(b"x" * 4096, size - 1)):
    try:
        bad()
        raise SystemExit("out-of-range request succeeded")
    except nbd.Error as e:
        assert e.errno is not None, e
assert a.pread(16, 1 << 20) == b"\x5a" * 16
# Block status sees the data and the holes around it.
seen = []
def cb(meta, offset, entries, err):
    seen.extend(entries)
a.block_status(3 << 20, 0, cb)
assert seen[:4] == [1 << 20, 3, 65536, 0], seen  # (length, flags) pairs: hole+zero, then data
for h in (a, b, c):
    h.shutdown()
print("OK")
"#;

#[test]
fn nbdsh_multi_conn_and_errors() {
    if !std::path::Path::new("/usr/bin/python3").exists()
        || !Command::new("/usr/bin/python3").args(["-c", "import nbd"]).status().is_ok_and(|s| s.success())
    {
        return skip("python3-libnbd (nbdsh) is not installed (scripts/setup.sh installs it)", true);
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "m", "16M"]);
    d.ok(&["export", "nbd", "m"]);
    let uri = format!("nbd+unix:///m?socket={}", d.nbd().display());
    // Debian's python3 (where python3-libnbd lives), whatever python3 comes first on PATH.
    let out = Command::new("/usr/bin/python3").args(["-c", NBDSH_SCRIPT, &uri]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("OK"), "{text}");
}
