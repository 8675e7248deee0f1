//! Replication between two hosts: two daemons in network namespaces this test makes, joined by
//! a veth pair, talking over the real mutual-TLS link. Steady replication under fio writes, a
//! cable cut in the middle of a large transfer, `kill -9` of the primary then force-promote,
//! failback (demote, resync: only what differs crosses), a planned switch-over, `kill -9` of
//! the secondary while it applies a delta, and a volume group that replicates as one unit.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::nbd::{open, read_image, try_read_image, write_on};
use common::netns::{Hosts, Nics};
use common::{Daemon, settled, until};

const MIB: u64 = 1 << 20;
/// Each daemon sends at most this much per second to its peer, so transfers take seconds.
const BANDWIDTH: &str = "replication-bandwidth = \"16M\"";

/// Waits up to `secs` for `f` to hold.
/// fio on `volume` of `d` over NBD: `rw` with `bs` blocks over `size`, for `secs` if given.
fn fio(d: &Daemon, volume: &str, rw: &str, bs: &str, size: &str, secs: Option<u64>) -> Child {
    d.ok(&["export", "nbd", volume]);
    let mut c = Command::new("fio");
    c.args(["--name=w", "--ioengine=nbd", "--iodepth=8", "--refill_buffers", "--output=/dev/null"])
        .arg(format!("--uri=nbd+unix:///{volume}?socket={}", d.nbd().display()))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={bs}"))
        .arg(format!("--size={size}"));
    if let Some(s) = secs {
        c.args(["--time_based", &format!("--runtime={s}")]);
    }
    c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
}

fn fio_done(mut c: Child) {
    assert!(c.wait().unwrap().success(), "fio failed");
}

/// `replica sync VOLUME` running in the background.
fn sync_in_background(d: &Daemon, volume: &str) -> Child {
    Command::new(common::BIN)
        .arg("--admin-socket")
        .arg(d.admin())
        .args(["-o", "json", "replica", "sync", volume])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Retries `replica sync` until it succeeds (a peer that has not yet noticed the last, cut
/// stream answers Aborted for a while); its result.
fn sync_until_done(d: &Daemon, volume: &str, secs: u64) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let o = d.cli(&["-o", "json", "replica", "sync", volume]);
        if o.status.success() {
            return serde_json::from_slice(&o.stdout).unwrap();
        }
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(start.elapsed() < Duration::from_secs(secs), "sync kept failing: {err}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn have_tools() -> bool {
    common::have("fio")
}

#[test]
fn replication_between_two_hosts_survives_cuts_crashes_and_failback() {
    if !have_tools() {
        return;
    }
    let Some(hosts) = Hosts::new() else { return };
    let root = tempfile::tempdir().unwrap();
    let (mut pa, pb) = (hosts.daemon(0, root.path(), BANDWIDTH), hosts.daemon(1, root.path(), BANDWIDTH));
    let size = 32 * MIB;

    // Steady state: fio writes while the volume replicates every 2 s; every mirror snapshot
    // seen complete reads the same on both hosts.
    pa.ok(&["volume", "create", "v", "32M"]);
    pa.ok(&["replica", "enable", "v", &hosts.endpoint(1), "--interval", "2s"]);
    let writer = fio(&pa, "v", "randwrite", "4k", "32M", Some(10));
    let (mut compared, mut seen) = (0, String::new());
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let m = pa.replica("v")["last_snapshot"].as_str().unwrap().to_owned();
        if !m.is_empty() && m != seen {
            let image = format!("v@{m}");
            // A snapshot the next push pruned meanwhile is skipped.
            if let (Some(a), Some(b)) = (try_read_image(&pa, &image, size), try_read_image(&pb, &image, size)) {
                assert!(a == b, "mirror snapshot {m} differs between the hosts");
                compared += 1;
            }
            seen = m;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    fio_done(writer);
    assert!(compared >= 2, "only {compared} mirror snapshots compared during the writes");
    let last = pa.json(&["replica", "sync", "v"]);
    let m = last["snapshot"].as_str().unwrap();
    assert_eq!(read_image(&pb, &format!("v@{m}"), size), read_image(&pa, "v", size));

    // A cable cut in the middle of a large transfer; it resumes once the link is back, and the
    // bytes on the wire stay within 10% of the delta.
    pa.ok(&["volume", "create", "big", "128M"]);
    fio_done(fio(&pa, "big", "write", "1M", "96M", None));
    pa.ok(&["replica", "enable", "big", &hosts.endpoint(1), "--interval", "0"]);
    let wire = hosts.sent(0);
    let cut = sync_in_background(&pa, "big");
    until("a quarter of the transfer", 60, || pa.replica("big")["bytes_done"].as_u64().unwrap() > 24 * MIB);
    hosts.link(0, false);
    let out = cut.wait_with_output().unwrap();
    assert!(!out.status.success(), "the transfer cannot finish over a cut link");
    hosts.link(0, true);
    let done = sync_until_done(&pa, "big", 90);
    assert_eq!(done["resumed"], true, "{done}");
    let sent = hosts.sent(0) - wire;
    eprintln!("cut transfer: {sent} bytes on the wire for {} bytes of delta", 96 * MIB);
    assert!(
        sent < 96 * MIB * 11 / 10,
        "{sent} bytes on the wire for a 96 MiB delta; {done}\n{}\n{}",
        pa.log().lines().filter(|l| l.contains("big") || l.contains("push")).collect::<Vec<_>>().join("\n"),
        pb.log().lines().filter(|l| l.contains("big") || l.contains("replica")).collect::<Vec<_>>().join("\n")
    );
    let m = done["snapshot"].as_str().unwrap();
    assert_eq!(read_image(&pb, &format!("big@{m}"), 128 * MIB), read_image(&pa, "big", 128 * MIB));
    for d in [&pa, &pb] {
        d.ok(&["replica", "disable", "big"]);
    }

    // kill -9 of the primary during writes; the secondary is force-promoted at its last
    // complete mirror snapshot and takes writes.
    let writer = fio(&pa, "v", "randwrite", "4k", "32M", Some(30));
    std::thread::sleep(Duration::from_millis(4500));
    pa.crash();
    let _ = writer.wait_with_output();
    // The point is the one the promotion names: a push the crash left in flight may complete
    // on B after a status read, and the promotion prunes every mirror snapshot but its point.
    let t = Instant::now();
    let promotion = pb.json(&["replica", "promote", "v", "--force"]);
    eprintln!("force-promote took {:?}", t.elapsed());
    assert_eq!(promotion["role"], "primary");
    let m = promotion["last_snapshot"].as_str().unwrap().to_owned();
    let promoted = read_image(&pb, "v", size);
    assert_eq!(promoted, read_image(&pb, &format!("v@{m}"), size));
    assert_eq!(write_on(&mut open(&pb, "v"), 0, &[0x5a; MIB as usize]), 0);

    // Failback: the old primary returns (still primary: a split-brain, reported), is checked
    // against what the replica had, demoted and resynced; only B's 1 MiB crosses.
    let pa = hosts.daemon(0, root.path(), BANDWIDTH);
    until("split-brain reported", 30, || {
        let s = pa.replica("v");
        s["error"].as_str().unwrap().contains("split-brain")
    });
    assert_eq!(read_image(&pa, &format!("v@{m}"), size), promoted, "the replica was exactly mirror snapshot {m}");
    pa.ok(&["replica", "demote", "v"]);
    let wire = hosts.sent(1);
    pa.ok(&["replica", "resync", "v"]);
    until("A resynced", 60, || pa.replica("v")["resynced"] == true);
    let s = settled(&pa, &pb, "v");
    assert_eq!(s["last_sync_bytes"], MIB, "only the blocks B changed cross: {s}");
    let sent = hosts.sent(1) - wire;
    eprintln!("failback resync: {sent} bytes on the wire for 1 MiB changed");
    assert!(sent < MIB + MIB / 4, "{sent} bytes on the wire for a 1 MiB resync");
    // B keeps pushing every 2 s and prunes older mirror snapshots: compare with the newest one
    // A holds, taken again if B pruned it meanwhile (nothing writes now, so all read the same).
    let mut m2 = s["last_snapshot"].as_str().unwrap().to_owned();
    let b = loop {
        if let Some(b) = try_read_image(&pb, &format!("v@{m2}"), size) {
            break b;
        }
        m2 = settled(&pa, &pb, "v")["last_snapshot"].as_str().unwrap().to_owned();
    };
    assert_eq!(read_image(&pa, "v", size), b);

    // Planned switch-over back to A: demote B (final delta), promote A; nothing is lost.
    assert_eq!(write_on(&mut open(&pb, "v"), 4 * MIB, &[0x77; 65536]), 0);
    let d = pb.json(&["replica", "demote", "v"]);
    assert_eq!((d["role"].as_str(), d["handover"].as_bool()), (Some("secondary"), Some(false)), "{d}");
    assert_eq!(pa.json(&["replica", "promote", "v"])["role"], "primary");
    assert_eq!(read_image(&pa, "v", size), read_image(&pb, "v", size));
    assert_eq!(write_on(&mut open(&pa, "v"), 0, &[1; 4096]), 0);
    assert_ne!(write_on(&mut open(&pb, "v"), 0, &[1; 4096]), 0, "B is a secondary again");
}

#[test]
fn a_secondary_killed_while_applying_keeps_its_last_mirror_snapshot() {
    if !have_tools() {
        return;
    }
    let Some(hosts) = Hosts::new() else { return };
    let root = tempfile::tempdir().unwrap();
    let (pa, mut pb) = (hosts.daemon(0, root.path(), BANDWIDTH), hosts.daemon(1, root.path(), BANDWIDTH));
    pa.ok(&["volume", "create", "v", "128M"]);
    assert_eq!(write_on(&mut open(&pa, "v"), 0, &[3; MIB as usize]), 0);
    pa.ok(&["replica", "enable", "v", &hosts.endpoint(1), "--interval", "0"]);
    let m0 = pa.json(&["replica", "sync", "v"])["snapshot"].as_str().unwrap().to_owned();
    let at_m0 = read_image(&pa, &format!("v@{m0}"), 128 * MIB);

    fio_done(fio(&pa, "v", "write", "1M", "96M", None));
    let push = sync_in_background(&pa, "v");
    until("a quarter of the transfer", 60, || pa.replica("v")["bytes_done"].as_u64().unwrap() > 24 * MIB);
    pb.crash();
    assert!(!push.wait_with_output().unwrap().status.success());

    let pb = hosts.daemon(1, root.path(), BANDWIDTH);
    assert_eq!(pb.replica("v")["last_snapshot"], m0.as_str());
    assert_eq!(read_image(&pb, &format!("v@{m0}"), 128 * MIB), at_m0, "the previous mirror snapshot is intact");
    let done = sync_until_done(&pa, "v", 90);
    let m1 = done["snapshot"].as_str().unwrap();
    assert_eq!(read_image(&pb, &format!("v@{m1}"), 128 * MIB), read_image(&pa, "v", 128 * MIB));
}

/// `len` bytes of `seed` at `offset` of `volume`, over NBD.
fn write(d: &Daemon, volume: &str, seed: u8, offset: u64, len: u64) {
    assert_eq!(write_on(&mut open(d, volume), offset, &vec![seed; len as usize]), 0, "write to {volume}");
}

#[test]
fn a_group_replicates_as_one_unit_and_promotes_at_one_point() {
    let Some(hosts) = Hosts::new() else { return };
    let root = tempfile::tempdir().unwrap();
    // The primary sends at most 16 MiB/s, so a transfer can be caught in the middle.
    let (mut pa, pb) = (hosts.daemon(0, root.path(), BANDWIDTH), hosts.daemon(1, root.path(), ""));
    let sb = hosts.endpoint(1);
    for v in ["a1", "a2"] {
        pa.ok(&["volume", "create", v, "32M"]);
    }
    pa.ok(&["group", "create", "app", "a1", "a2"]);
    write(&pa, "a1", 1, 0, MIB);
    write(&pa, "a2", 2, MIB, MIB);
    pa.ok(&["replica", "enable", "app", &sb, "--group", "--interval", "0"]);
    let first = pa.json(&["replica", "sync", "app"]);
    assert_eq!(first["data_bytes"], 2 * MIB, "{first}");
    let g1 = first["snapshot"].as_str().unwrap().to_owned();
    let s = pb.replica("app");
    assert_eq!(
        (s["role"].as_str(), s["group"].as_bool(), s["last_snapshot"].as_str()),
        (Some("secondary"), Some(true), Some(g1.as_str())),
        "{s}"
    );
    assert_eq!(s["members"], serde_json::json!(["a1", "a2"]));
    let at_g1: Vec<Vec<u8>> = ["a1", "a2"]
        .iter()
        .map(|v| {
            let theirs = read_image(&pb, &format!("{v}@{g1}.{v}"), 32 * MIB);
            assert_eq!(theirs, read_image(&pa, &format!("{v}@{g1}.{v}"), 32 * MIB), "{v} at {g1}");
            assert_ne!(write_on(&mut open(&pb, v), 0, &[1; 4096]), 0, "members of a secondary are read-only");
            theirs
        })
        .collect();

    // 24 MiB more on each member; the primary dies once a1 holds the new point and a2 does not.
    for v in ["a1", "a2"] {
        for i in 0..3 {
            write(&pa, v, 3 + i as u8, 4 * MIB + i * 8 * MIB, 8 * MIB);
        }
    }
    let push = std::process::Command::new(common::BIN)
        .arg("--admin-socket")
        .arg(pa.admin())
        .args(["replica", "sync", "app"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while pb.ok(&["snapshot", "list", "a1"]).matches(".mirror.").count() < 2 {
        assert!(start.elapsed().as_secs() < 30, "a1 did not get the new point");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    pa.crash();
    drop(push);
    assert_eq!(pb.replica("app")["last_snapshot"], g1.as_str(), "the new point is not complete");

    // Force-promoted, every member is at the last complete point, and the group is there.
    let p = pb.json(&["replica", "promote", "app", "--force"]);
    assert_eq!(p["role"], "primary", "{p}");
    for (v, want) in ["a1", "a2"].iter().zip(&at_g1) {
        assert!(read_image(&pb, v, 32 * MIB) == *want, "{v} is not at {g1}");
    }
    assert!(pb.ok(&["group", "list"]).contains("app"));
    write(&pb, "a1", 9, 0, 4096);

    // Failback: the old primary returns, is demoted and resynced as a group; both sides end at
    // B's new point, A's unfinished one discarded.
    let pa = hosts.daemon(0, root.path(), BANDWIDTH);
    pa.ok(&["replica", "demote", "app"]);
    pa.ok(&["replica", "resync", "app"]);
    let start = std::time::Instant::now();
    while pa.replica("app")["resynced"] != true {
        assert!(start.elapsed().as_secs() < 30, "A did not take B's point: {}", pb.log());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let s = settled(&pa, &pb, "app");
    assert_eq!(s["last_sync_bytes"], 4096, "only B's one block crossed: {s}");
    let g2 = s["last_snapshot"].as_str().unwrap();
    for v in ["a1", "a2"] {
        assert_eq!(read_image(&pa, v, 32 * MIB), read_image(&pb, &format!("{v}@{g2}.{v}"), 32 * MIB), "{v}");
    }
}
