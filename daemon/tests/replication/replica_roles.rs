//! The replication state machine between two real daemons (over their admin sockets): a
//! planned switch-over (demote, final delta, promote) loses nothing and reverses the direction;
//! force-promote while both run makes a split-brain that both sides report; demote and resync
//! resolve it, crossing only what differs; force-promote with the primary gone; disable.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use common::nbd::{open, read_image, write_on};
use common::{Daemon, settled};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 8 * MIB;
/// NBD's EPERM: what a write to a read-only volume gets.
const EPERM: u32 = 1;

fn bytes(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

fn write(d: &Daemon, volume: &str, seed: u8, offset: u64, len: u64) {
    assert_eq!(write_on(&mut open(d, volume), offset, &bytes(seed, len)), 0, "write to {volume}");
}

/// A CLI call that must fail; its stderr.
fn fails(d: &Daemon, args: &[&str]) -> String {
    let o = d.cli(args);
    assert!(!o.status.success(), "ferrite {args:?} should have failed");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn read(d: &Daemon, image: &str) -> Vec<u8> {
    read_image(d, image, SIZE)
}

#[test]
fn switch_over_split_brain_resync_and_force_promote() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut pa, pb) = (Daemon::start(a.path()), Daemon::start(b.path()));
    let (sa, sb) = (pa.admin().display().to_string(), pb.admin().display().to_string());
    pa.ok(&["volume", "create", "v", "8M"]);
    write(&pa, "v", 1, 0, 2 * MIB);
    pa.ok(&["replica", "enable", "v", &sb, "--interval", "0"]);
    let first = pa.json(&["replica", "sync", "v"]);
    assert_eq!(first["data_bytes"], 2 * MIB, "{first}");

    // B holds a read-only secondary that knows its primary.
    let s = pb.replica("v");
    assert_eq!(
        (s["role"].as_str(), s["peer"].as_str(), s["remote"].as_str()),
        (Some("secondary"), Some(sa.as_str()), Some("v")),
        "{s}"
    );
    assert_eq!(pb.json(&["volume", "show", "v"])["read_only"], true);
    assert_eq!(write_on(&mut open(&pb, "v"), 0, &[1; 4096]), EPERM, "clients cannot write a secondary");
    assert_eq!(pa.replica("v")["last_snapshot"], s["last_snapshot"]);
    assert!(fails(&pa, &["volume", "delete", "v"]).contains("disable its replication"));

    // Not yet: the primary is still primary.
    let e = fails(&pb, &["replica", "promote", "v"]);
    assert!(e.contains("still primary") && e.contains("force"), "{e}");

    // Planned switch-over. A client with the volume open sees EPERM once it is demoted, and
    // every write acknowledged before reaches B in the final delta.
    let mut client = open(&pa, "v");
    assert_eq!(write_on(&mut client, 3 * MIB, &bytes(2, MIB)), 0);
    let d = pa.json(&["replica", "demote", "v"]);
    assert_eq!(
        (d["role"].as_str(), d["handover"].as_bool(), d["state"].as_str()),
        (Some("secondary"), Some(false), Some("idle")),
        "{d}"
    );
    assert_eq!(write_on(&mut client, 0, &[9; 4096]), EPERM, "a demoted volume refuses writes on open connections");
    let p = pb.json(&["replica", "promote", "v"]);
    assert_eq!(p["role"], "primary", "{p}");
    let want = read(&pa, "v");
    assert_eq!(read(&pb, "v"), want, "nothing lost in the switch-over");
    assert_eq!(&want[3 * MIB as usize..4 * MIB as usize], &bytes(2, MIB)[..]);

    // B is primary now and pushes back; A takes it as a secondary.
    write(&pb, "v", 3, 5 * MIB, MIB);
    let back = pb.json(&["replica", "sync", "v"]);
    assert_eq!(back["data_bytes"], MIB, "only the new MiB crosses back: {back}");
    let m = back["snapshot"].as_str().unwrap();
    assert_eq!(read(&pa, &format!("v@{m}")), read(&pb, &format!("v@{m}")));

    // Split-brain: A is force-promoted while B is primary. Both sides see it and say so.
    assert_eq!(pa.json(&["replica", "promote", "v", "--force"])["role"], "primary");
    write(&pa, "v", 4, 0, MIB); // A's divergent write
    write(&pb, "v", 5, 6 * MIB, 64 << 10); // B's write since the common point
    for (d, who) in [(&pa, "A"), (&pb, "B")] {
        let e = fails(d, &["replica", "sync", "v"]);
        assert!(e.contains("split-brain"), "{who}: {e}");
        let s = d.replica("v");
        assert_eq!(s["state"], "error", "{who}: {s}");
        assert!(s["error"].as_str().unwrap().contains("split-brain"), "{who}: {s}");
    }
    assert!(fails(&pa, &["replica", "resync", "v"]).contains("demote it"));

    // Resolved in B's favour: A is demoted (its final delta cannot land: B is primary) and
    // resynced. B pushes only what changed since the common point; A's divergence is discarded.
    let d = pa.json(&["replica", "demote", "v"]);
    assert_eq!(d["handover"], true, "{d}");
    let r = pa.json(&["replica", "resync", "v"]);
    assert_eq!((r["role"].as_str(), r["handover"].as_bool()), (Some("secondary"), Some(false)), "{r}");
    let start = std::time::Instant::now();
    while pa.replica("v")["resynced"] != true {
        assert!(start.elapsed().as_secs() < 30, "B did not push after the resync request: {}", pb.log());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let s = settled(&pa, &pb, "v");
    assert_eq!(s["last_sync_bytes"], 64 << 10, "only B's 64 KiB crossed: {s}");
    let m = s["last_snapshot"].as_str().unwrap();
    assert_eq!(read(&pa, &format!("v@{m}")), read(&pb, &format!("v@{m}")), "A equals B's mirror snapshot");
    assert_eq!(read(&pa, "v"), read(&pb, &format!("v@{m}")));

    // The primary (B now) is gone for good: the secondary is force-promoted.
    drop(pb);
    let e = fails(&pa, &["replica", "promote", "v"]);
    assert!(e.contains("cannot be asked") && e.contains("force"), "{e}");
    let p = pa.json(&["replica", "promote", "v", "--force"]);
    assert_eq!(p["role"], "primary");
    assert_eq!(read(&pa, "v"), read(&pa, &format!("v@{m}")), "at the last complete mirror snapshot");
    write(&pa, "v", 6, 0, MIB);

    // Disable: the relation goes with its mirror snapshots, and it survives a restart.
    pa.stop();
    let pa = Daemon::start(a.path());
    assert_eq!(pa.replica("v")["role"], "primary", "relations survive a restart");
    pa.ok(&["replica", "disable", "v"]);
    assert!(fails(&pa, &["replica", "status", "v"]).contains("not replicated"));
    // Only mirror snapshots a client reads stay (this test exported some).
    let exports = pa.json(&["export", "list"]);
    let exported: Vec<&str> = exports.as_array().unwrap().iter().map(|e| e["volume"].as_str().unwrap()).collect();
    let snaps = pa.json(&["snapshot", "list", "v"]);
    for s in snaps.as_array().unwrap() {
        let s = s["name"].as_str().unwrap();
        assert!(exported.contains(&format!("v@{s}").as_str()), "{s} stayed but is not exported: {exported:?}");
    }
    for e in exports.as_array().unwrap() {
        pa.ok(&["export", "stop", e["name"].as_str().unwrap()]);
    }
    for s in snaps.as_array().unwrap() {
        pa.ok(&["snapshot", "delete", s["name"].as_str().unwrap()]);
    }
    pa.ok(&["volume", "delete", "v"]);
}

#[test]
fn disabling_a_secondary_leaves_a_writable_copy_and_bad_requests_are_refused() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (pa, pb) = (Daemon::start(a.path()), Daemon::start(b.path()));
    let sb = pb.admin().display().to_string();
    pa.ok(&["volume", "create", "v", "8M"]);
    write(&pa, "v", 1, MIB, MIB);
    pa.ok(&["replica", "enable", "v", &sb, "--as", "copy", "--interval", "0"]);
    pa.ok(&["replica", "sync", "v"]);
    let at = pa.replica("v")["last_snapshot"].as_str().unwrap().to_owned();

    // Refusals with clear messages.
    assert!(fails(&pa, &["replica", "enable", "v", "/other.sock"]).contains("already replicates"));
    assert!(fails(&pb, &["replica", "enable", "copy", &sb]).contains("secondary"));
    assert!(fails(&pa, &["replica", "enable", "nope", &sb]).contains("nope"));
    assert!(fails(&pa, &["replica", "enable", "v", &sb, "--interval", "3x"]).contains("unit"));
    assert!(fails(&pa, &["replica", "demote", "nope"]).contains("not replicated"));
    assert!(fails(&pb, &["replica", "sync", "copy"]).contains("secondary"));

    pb.ok(&["replica", "disable", "copy"]);
    assert_eq!(pb.json(&["volume", "show", "copy"])["read_only"], false);
    assert_eq!(read(&pb, "copy"), read(&pa, &format!("v@{at}")));
    write(&pb, "copy", 2, 0, 4096);
    // The primary's next push finds a volume that is no replica any more.
    let e = fails(&pa, &["replica", "sync", "v"]);
    assert!(e.contains("\"copy\" already exists"), "{e}");
    let s = pa.replica("v");
    assert!(s["state"] == "error" && s["error"].as_str().unwrap().contains("already exists"), "{s}");

    // Enabling again changes only the interval.
    assert_eq!(pa.json(&["replica", "enable", "v", &sb, "--as", "copy", "--interval", "5m"])["interval_secs"], 300);
    let table = pa.ok(&["replica", "status"]);
    assert!(table.contains("primary") && table.contains("300s") && table.contains(&format!("{sb}:copy")), "{table}");
}
