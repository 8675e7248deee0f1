//! NBD's `ferrite:changed:<snapshot>` metadata context with real clients: `nbdinfo --map` lists
//! what `ferrite snapshot diff` lists, on a snapshot's export and on the live volume's; an
//! incremental copy driven by the map (a libnbd script, as a backup tool would run it) turns a
//! copy of the base into an exact copy of the target (`qemu-img compare`); a snapshot that is
//! not beneath the export gets no context. `ferrite:allocation-depth` says which layer of the
//! chain holds each extent.

use crate::common;

use std::io::Write;
use std::process::Command;

use common::nbd::{connect, read_image, reply, request, write_on};
use common::{Daemon, have, pattern, skip};
use ferrite_nbd::proto::{CMD_TRIM, CMD_WRITE_ZEROES};

const SIZE: u64 = 64 << 20;

/// Byte ranges, adjacent ones merged.
fn merged(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (o, n) in ranges {
        match out.last_mut() {
            Some((po, pn)) if *po + *pn == o => *pn += n,
            _ => out.push((o, n)),
        }
    }
    out
}

/// The changed extents `nbdinfo --map` reports for context `ferrite:changed:<base>` of `uri`.
fn nbdinfo_changed(uri: &str, base: &str) -> Result<Vec<(u64, u64)>, String> {
    let o = Command::new("nbdinfo").arg(format!("--map=ferrite:changed:{base}")).arg(uri).output().unwrap();
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    // Lines: offset, length, flags, description.
    let text = String::from_utf8_lossy(&o.stdout);
    let rows = text.lines().map(|l| {
        let f: Vec<u64> = l.split_whitespace().take(3).map(|x| x.parse().unwrap()).collect();
        (f[0], f[1], f[2])
    });
    Ok(merged(rows.filter(|r| r.2 & 1 == 1).map(|r| (r.0, r.1))))
}

/// Copies into `file` every extent of `uri` that context `ferrite:changed:<base>` flags.
const INCREMENTAL: &str = r#"
import nbd, sys
uri, base, path = sys.argv[1], sys.argv[2], sys.argv[3]
h = nbd.NBD()
ctx = "ferrite:changed:" + base
h.add_meta_context(ctx)
h.connect_uri(uri)
assert h.can_meta_context(ctx)
size, offset, copied = h.get_size(), 0, 0
extents = []
with open(path, "r+b") as f:
    while offset < size:
        got = []
        def cb(meta, at, entries, err):
            if meta == ctx:
                got.extend(entries)
        h.block_status(min(size - offset, 32 << 20), offset, cb)
        for i in range(0, len(got), 2):
            n, flags = got[i], got[i + 1]
            if flags & 1:
                f.seek(offset)
                f.write(h.pread(n, offset))
                copied += n
            offset += n
print(copied)
"#;

#[test]
fn the_changed_context_drives_an_incremental_copy() {
    for tool in ["nbdinfo", "qemu-img"] {
        if !have(tool) {
            return skip(&format!("{tool} is not installed (scripts/setup.sh installs it)"), true);
        }
    }
    // Debian's python3, where python3-libnbd lives, whatever python3 comes first on PATH.
    if !Command::new("/usr/bin/python3").args(["-c", "import nbd"]).status().is_ok_and(|s| s.success()) {
        return skip("python3-libnbd is not installed (scripts/setup.sh installs it)", true);
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "v", "64M"]);
    d.ok(&["volume", "create", "w", "64M"]);
    d.ok(&["export", "nbd", "v"]);
    let mut s = connect(&d.nbd(), "v");
    for i in 0..32u64 {
        assert_eq!(write_on(&mut s, i * (2 << 20), &pattern(i, 64 << 10)), 0);
    }
    d.ok(&["snapshot", "create", "v", "s1"]);
    d.ok(&["snapshot", "create", "w", "w1"]);
    // Rewrites (some of equal bytes), partial blocks, a trim and a zeroing.
    for i in (0..32u64).step_by(5) {
        assert_eq!(write_on(&mut s, i * (2 << 20) + 1000, &pattern(50 + i, 5000)), 0);
    }
    assert_eq!(write_on(&mut s, 4 << 20, &pattern(2, 64 << 10)), 0);
    s.write_all(&request(CMD_TRIM, 0, 8, 10 << 20, 1 << 20, &[])).unwrap();
    assert_eq!(reply(&mut s, 0).0, 0);
    s.write_all(&request(CMD_WRITE_ZEROES, 0, 9, 40 << 20, 64 << 10, &[])).unwrap();
    assert_eq!(reply(&mut s, 0).0, 0);
    d.ok(&["snapshot", "create", "v", "s2"]);

    // nbdinfo sees what snapshot diff says, on the snapshot's export.
    d.ok(&["export", "nbd", "v@s2"]);
    let uri = |image: &str| format!("nbd+unix:///{image}?socket={}", d.nbd().display());
    let listed = nbdinfo_changed(&uri("v@s2"), "s1").unwrap();
    let diff = d.diff("v@s2", Some("s1")).into_iter().map(|(o, n)| (o.cast_unsigned(), n.cast_unsigned()));
    assert_eq!(listed, merged(diff));
    assert!(!listed.is_empty());

    // An incremental backup: the base's copy plus the flagged extents is the target.
    let copy = dir.path().join("backup.raw");
    std::fs::write(&copy, read_image(&d, "v@s1", SIZE)).unwrap();
    d.ok(&["export", "nbd", "v@s2"]);
    let o = Command::new("/usr/bin/python3")
        .args(["-c", INCREMENTAL])
        .args([uri("v@s2"), "s1".into(), copy.display().to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let copied: u64 = String::from_utf8_lossy(&o.stdout).trim().parse().unwrap();
    assert_eq!(copied, listed.iter().map(|r| r.1).sum::<u64>(), "only the changed extents were read");
    assert!(copied < SIZE / 8, "{copied} bytes copied");
    let cmp = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&copy)
        .arg(uri("v@s2"))
        .output()
        .unwrap();
    assert!(cmp.status.success(), "{}{}", String::from_utf8_lossy(&cmp.stdout), String::from_utf8_lossy(&cmp.stderr));

    // On the live volume: what changed since s2.
    assert_eq!(write_on(&mut s, 30 << 20, &pattern(9, 8192)), 0);
    drop(s);
    assert_eq!(nbdinfo_changed(&uri("v"), "s2").unwrap(), [(30 << 20, 8192)]);

    // Allocation depth on the live volume: 1 what it wrote since s2, 2 what s2's layer holds
    // (written between s1 and s2), 3 what s1's does, 0 where nothing is.
    let o = Command::new("nbdinfo").arg("--map=ferrite:allocation-depth").arg(uri("v")).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let depth_at = |at: u64| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| l.split_whitespace().take(3).map(|x| x.parse::<u64>().unwrap()).collect::<Vec<_>>())
            .find(|f| f[0] <= at && at < f[0] + f[1])
            .map(|f| f[2])
            .unwrap()
    };
    assert_eq!([depth_at(30 << 20), depth_at(50 << 20), depth_at(2 << 20), depth_at(63 << 20)], [1, 2, 3, 0]);

    // No context against a snapshot that is not beneath the export.
    for base in ["w1", "nope", "s2"] {
        assert!(nbdinfo_changed(&uri("v@s1"), base).is_err(), "a context against {base} on v@s1");
    }
}
