//! Synchronous replicas between hosts: daemons in network namespaces this test makes, plugged into
//! one switch, over the real mutual-TLS streams. Every write reaches every in-sync copy (trims and
//! zeroes as such, not as zero data on the wire), a killed replica is ejected and writes go on, a
//! partition never leaves two sides writing (majority of the members, a witness for two copies), a
//! killed primary loses no acknowledged flushed write once an in-sync replica is promoted, a stale
//! replica is refused promotion, a returning replica (or failed-over primary) is rebuilt by what
//! changed while writes go on, a replica that stops answering is ejected after the timeout instead
//! of waited on, and a member refuses what a peer may not do (called here over the switch with each
//! host's certificate).

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;
use crate::weed;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::mirror::{membership, state_of, stream_write};
use common::nbd::{connect, read_image, request, write_on};
use common::netns::{Nics, Switch};
use common::{Daemon, pattern, until};
use ferrite_nbd::proto::{CMD_FLAG_FUA, CMD_FLUSH, CMD_WRITE};
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::mirror_client::MirrorClient;
use ferrite_proto::ferrite::v1::mirror_message::Op;
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// Short, so ejections in the tests take about a second.
const TIMEOUT: &str = "sync-timeout-ms = 1000";

/// GET /metrics of host `i` (its metrics listener on port 9100, mutual TLS), as host 1 would.
fn metrics(sw: &Switch, root: &std::path::Path, i: usize) -> String {
    let pki = root.join("pki");
    let host = (pki.join("host-1.pem"), pki.join("host-1-key.pem"));
    common::scrape_tls(&format!("{}:9100", sw.ip[i]), &pki.join("ca.pem"), Some((&host.0, &host.1))).unwrap()
}

/// The value of the sample `line` starts with (name and labels).
fn sample(text: &str, line: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
}

fn status(d: &Daemon, volume: &str) -> Value {
    d.json(&["replica", "status", volume])
}

fn fio(d: &Daemon, volume: &str, args: &[&str]) -> std::process::Child {
    d.ok(&["export", "nbd", volume]);
    Command::new("fio")
        .args(["--name=w", "--ioengine=nbd", "--output=/dev/null"])
        .arg(format!("--uri=nbd+unix:///{volume}?socket={}", d.nbd().display()))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn qemu_io(d: &Daemon, volume: &str, cmds: &[&str]) {
    d.ok(&["export", "nbd", volume]);
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let o = c.arg(d.qemu_uri(volume)).output().unwrap();
    assert!(o.status.success(), "qemu-io {cmds:?}: {}", String::from_utf8_lossy(&o.stderr));
}

fn cluster(n: usize, root: &std::path::Path, extra: &str) -> Option<(Switch, Vec<Daemon>)> {
    if !common::have("fio") || !common::have("qemu-io") {
        return None;
    }
    let sw = Switch::new(n)?;
    let d = (0..n).map(|i| sw.daemon(i, root, extra)).collect();
    Some((sw, d))
}

#[test]
fn every_write_reaches_every_copy_and_a_killed_replica_is_ejected() {
    let root = tempfile::tempdir().unwrap();
    let extra = format!("{TIMEOUT}\nmetrics-listen = \"0.0.0.0:9100\"");
    let Some((sw, mut d)) = cluster(3, root.path(), &extra) else { return };
    let (e0, e1, e2) = (sw.endpoint(0), sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "v", "64M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    let s = status(&d[0], "v");
    assert_eq!(s["role"], "primary");
    assert_eq!(s["generation"], 3, "{s}");
    for (e, want) in [(&e0, "primary"), (&e1, "in-sync"), (&e2, "in-sync")] {
        assert_eq!(state_of(&d[0], "v", e), want);
    }
    assert_eq!(status(&d[1], "v")["role"], "replica");
    assert_eq!(status(&d[2], "v")["generation"], 3, "every member holds the generation");

    // A replica is read-only to its own clients.
    d[1].ok(&["export", "nbd", "v"]);
    let mut s1 = connect(&d[1].nbd(), "v");
    assert_ne!(write_on(&mut s1, 0, &[1u8; 4096]), 0, "a replica took a client write");
    drop(s1);

    // fio writes and verifies through the primary; every copy then reads the same.
    let f = fio(&d[0], "v", &["--rw=randwrite", "--bs=4k", "--size=32M", "--iodepth=16", "--verify=crc32c"]);
    assert!(f.wait_with_output().unwrap().status.success(), "fio failed: {}", d[0].log());
    let image = read_image(&d[0], "v", 64 * MIB);
    for r in &d[1..] {
        assert!(read_image(r, "v", 64 * MIB) == image, "a replica differs from the primary");
    }

    // Trims and zeroes cross as requests: a few KiB on the wire for 48 MiB.
    let before = sw.sent(0);
    qemu_io(&d[0], "v", &["discard 0 32M", "write -z 32M 16M"]);
    let sent = sw.sent(0) - before;
    assert!(sent < 512 << 10, "{sent} bytes sent to two replicas for a trim and a zeroing");
    let image = read_image(&d[0], "v", 64 * MIB);
    assert!(image[..48 << 20].iter().all(|&b| b == 0));
    for r in &d[1..] {
        assert!(read_image(r, "v", 64 * MIB) == image, "a replica differs after trim and zeroes");
    }

    // kill -9 of a replica during writes: they go on once it is ejected (after the timeout),
    // and the other replica keeps every one.
    let f = fio(&d[0], "v", &["--rw=randwrite", "--bs=4k", "--size=64M", "--iodepth=8", "--time_based", "--runtime=6"]);
    std::thread::sleep(Duration::from_secs(2));
    d[2].crash();
    assert!(f.wait_with_output().unwrap().status.success(), "fio failed after a replica died: {}", d[0].log());
    let s = status(&d[0], "v");
    assert_eq!(state_of(&d[0], "v", &e2), "ejected", "{s}");
    assert_eq!(s["generation"], 4, "{s}");
    assert!(s["members"][2]["reason"].as_str().unwrap().len() > 5, "the ejection says why: {s}");
    assert_eq!(status(&d[1], "v")["generation"], 4, "the ejection is recorded on the other member");
    assert!(read_image(&d[1], "v", 64 * MIB) == read_image(&d[0], "v", 64 * MIB));

    // The same in the metrics, on the primary and on a replica.
    let m = metrics(&sw, root.path(), 0);
    for (line, want) in [
        (r#"ferrite_sync_generation{volume="v",role="primary"}"#, 4.0),
        (r#"ferrite_sync_members{volume="v",state="in-sync"}"#, 1.0),
        (r#"ferrite_sync_members{volume="v",state="ejected"}"#, 1.0),
        (r#"ferrite_sync_ejections_total{volume="v"}"#, 1.0),
        (r#"ferrite_sync_refusing_writes{volume="v"}"#, 0.0),
    ] {
        assert_eq!(sample(&m, line), Some(want), "{line} in\n{m}");
    }
    let mirrored = sample(&m, r#"ferrite_sync_added_seconds_count{volume="v"}"#).unwrap_or(0.0);
    assert!(mirrored > 8192.0, "{mirrored} mirrored requests counted:\n{m}");
    let m = metrics(&sw, root.path(), 1);
    assert_eq!(sample(&m, r#"ferrite_sync_generation{volume="v",role="replica"}"#), Some(4.0), "{m}");
    assert!(!m.contains("ferrite_sync_added_seconds_count"), "a replica has no primary's metrics:\n{m}");
}

/// One FUA write of `data` at `offset`: its NBD error (0: done).
fn fua_write(s: &mut UnixStream, offset: u64, data: &[u8]) -> u32 {
    send(s, CMD_WRITE, CMD_FLAG_FUA, offset, data).unwrap_or(u32::MAX)
}

/// One request and its reply's error; None if the connection broke (the daemon was killed).
fn send(s: &mut UnixStream, kind: u16, flags: u16, offset: u64, data: &[u8]) -> Option<u32> {
    s.write_all(&request(kind, flags, 9, offset, data.len() as u32, data)).ok()?;
    let mut h = [0u8; 16];
    s.read_exact(&mut h).ok()?;
    Some(u32::from_be_bytes(h[4..8].try_into().unwrap()))
}

#[test]
fn a_partition_never_leaves_two_sides_writing() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, d)) = cluster(3, root.path(), TIMEOUT) else { return };
    let (e0, e1, e2) = (sw.endpoint(0), sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "v", "16M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    d[0].ok(&["export", "nbd", "v"]);
    let mut s0 = connect(&d[0].nbd(), "v");
    assert_eq!(fua_write(&mut s0, 0, &pattern(1, 4096)), 0);

    // The primary alone on its side: it cannot record an ejection on a majority, so it takes
    // no write; the other side promotes an in-sync replica and takes writes.
    sw.link(0, false);
    let t = Instant::now();
    assert_ne!(fua_write(&mut s0, 4096, &pattern(2, 4096)), 0, "the cut-off primary acknowledged a write");
    assert!(t.elapsed() < Duration::from_secs(10));
    let refused = status(&d[0], "v")["refused"].as_str().unwrap().to_owned();
    assert!(refused.contains("majority"), "{refused}");
    assert_ne!(fua_write(&mut s0, 8192, &pattern(3, 4096)), 0, "the cut-off primary took a later write");
    let p = d[1].json(&["replica", "promote", "v"]);
    assert_eq!(p["role"], "primary", "{p}");
    assert_eq!(p["generation"], 4, "{p}");
    assert_eq!(state_of(&d[1], "v", &e0), "ejected");
    d[1].ok(&["export", "nbd", "v"]);
    let mut s1 = connect(&d[1].nbd(), "v");
    assert_eq!(fua_write(&mut s1, 4096, &pattern(4, 4096)), 0, "the new primary refused a write");
    let image = read_image(&d[1], "v", 16 * MIB);
    assert_eq!(&image[..4096], &pattern(1, 4096)[..], "an acknowledged write was lost in the failover");
    assert_eq!(&image[4096..8192], &pattern(4, 4096)[..]);
    // The other replica is brought to the new primary's content before it is in sync again.
    until("the replica is reconciled", 30, || state_of(&d[1], "v", &e2) == "in-sync");
    assert!(read_image(&d[2], "v", 16 * MIB) == image, "the new primary's replica differs");

    // The old primary's cable comes back: it finds the newer generation and steps down.
    sw.link(0, true);
    until("the old primary steps down", 20, || status(&d[0], "v")["role"] == "replica");
    assert_ne!(fua_write(&mut s0, 8192, &pattern(5, 4096)), 0, "the old primary took a write after the failover");
    until("the old primary records the new one", 30, || status(&d[0], "v")["primary"] == e1.as_str());
    assert!(read_image(&d[1], "v", 16 * MIB) == image, "the old primary's attempts reached the new primary");
    // ... and is rebuilt as a replica of the new one, without anyone asking.
    until("the old primary is rebuilt as a replica", 30, || state_of(&d[1], "v", &e0) == "in-sync");
    assert!(read_image(&d[0], "v", 16 * MIB) == image, "the rebuilt old primary differs");

    // Primary and one replica kept apart: the primary ejects it with the other's vote and
    // goes on; the ejected one is refused promotion as stale, naming the generation.
    d[1].ok(&["volume", "create", "w", "16M", "--replicas", "3", "--peer", &e0, "--peer", &e2]);
    sw.part(1, 2, true);
    d[1].ok(&["export", "nbd", "w"]);
    let mut w1 = connect(&d[1].nbd(), "w");
    assert_eq!(fua_write(&mut w1, 0, &pattern(6, 4096)), 0, "the primary stopped with a majority");
    assert_eq!(state_of(&d[1], "w", &e2), "ejected");
    sw.part(1, 2, false);
    let o = d[2].cli(&["replica", "promote", "w"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("stale") && err.contains("generation 4"), "{err}");
    assert_eq!(status(&d[1], "w")["role"], "primary");
}

#[test]
fn a_replica_that_stops_answering_is_ejected_after_the_timeout_not_waited_on() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, d)) = cluster(3, root.path(), TIMEOUT) else { return };
    let (e1, e2) = (sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "v", "16M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    d[0].ok(&["export", "nbd", "v"]);
    let mut c = connect(&d[0].nbd(), "v");
    assert_eq!(fua_write(&mut c, 0, &pattern(1, 4096)), 0);

    // Host 2's daemon stops answering while its connections stay open (SIGSTOP: the kernel
    // still acknowledges the bytes, as for a hung daemon or a disk that stalls; netem delays
    // are not in this kernel).
    let pid = d[2].child.as_ref().unwrap().id().to_string();
    let signal = |sig: &str| assert!(Command::new("kill").args([sig, &pid]).status().unwrap().success());
    signal("-STOP");
    let t = Instant::now();
    assert_eq!(fua_write(&mut c, 4096, &pattern(2, 4096)), 0, "the write failed: {}", d[0].log());
    let first = t.elapsed();
    assert!(first >= Duration::from_millis(900) && first < Duration::from_secs(4), "the first write took {first:?}");
    let s = status(&d[0], "v");
    assert_eq!(state_of(&d[0], "v", &e2), "ejected", "{s}");
    assert!(s["members"][2]["reason"].as_str().unwrap().contains("did not answer"), "{s}");
    let t = Instant::now();
    for i in 2..20 {
        assert_eq!(fua_write(&mut c, i * 4096, &pattern(i + 1, 4096)), 0);
    }
    assert!(t.elapsed() < Duration::from_secs(1), "writes still wait for the slow replica: {:?}", t.elapsed());

    // Once it answers again it is rebuilt and back in sync, with every write.
    signal("-CONT");
    until("the slow replica is back in sync", 60, || state_of(&d[0], "v", &e2) == "in-sync");
    assert!(read_image(&d[2], "v", 16 * MIB) == read_image(&d[0], "v", 16 * MIB));
}

#[test]
fn two_copies_keep_writing_with_a_witness_and_stop_without_one() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, mut d)) = cluster(3, root.path(), TIMEOUT) else { return };
    let (e1, e2) = (sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "a", "16M", "--replicas", "2", "--peer", &e1, "--witness", &e2]);
    d[0].ok(&["volume", "create", "b", "16M", "--replicas", "2", "--peer", &e1]);
    assert_eq!(status(&d[2], "a")["role"], "witness");
    d[1].crash();
    for v in ["a", "b"] {
        d[0].ok(&["export", "nbd", v]);
    }
    let mut a = connect(&d[0].nbd(), "a");
    assert_eq!(fua_write(&mut a, 0, &pattern(1, 4096)), 0, "two copies and a witness stopped");
    assert_eq!(state_of(&d[0], "a", &e1), "ejected");
    let mut b = connect(&d[0].nbd(), "b");
    assert_ne!(fua_write(&mut b, 0, &pattern(2, 4096)), 0, "two copies without a witness kept writing alone");
    let refused = status(&d[0], "b")["refused"].as_str().unwrap().to_owned();
    assert!(refused.contains("1 of 2"), "{refused}");
    // The replica comes back: the primary records its ejection with it and writes again.
    d[1] = sw.daemon(1, root.path(), TIMEOUT);
    until("b takes writes again", 20, || status(&d[0], "b")["refused"] == "");
    assert_eq!(fua_write(&mut b, 0, &pattern(3, 4096)), 0);
}

#[test]
fn members_are_removed_and_without_them_the_volume_is_local_again() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, mut d)) = cluster(3, root.path(), TIMEOUT) else { return };
    let (e0, e1, e2) = (sw.endpoint(0), sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "v", "16M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    d[0].ok(&["export", "nbd", "v"]);
    let mut c = connect(&d[0].nbd(), "v");
    assert_eq!(fua_write(&mut c, 0, &pattern(1, 4096)), 0);

    // Growing: on the primary only; every copy grows first (the next generation carries the
    // size), so a write past the old end reaches them all.
    let o = d[1].cli(&["volume", "resize", "v", "32M"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("on its primary"));
    d[0].ok(&["volume", "resize", "v", "32M"]);
    for h in &d {
        assert_eq!(h.json(&["volume", "show", "v"])["size"], 32 * MIB, "{}", h.log());
    }
    assert_eq!(status(&d[0], "v")["generation"], 4);
    drop(c);
    let mut c = connect(&d[0].nbd(), "v");
    assert_eq!(fua_write(&mut c, 24 * MIB, &pattern(9, 4096)), 0);
    drop(c);
    for h in &d[1..] {
        assert!(read_image(h, "v", 32 * MIB) == read_image(&d[0], "v", 32 * MIB), "a copy differs after growing");
    }
    d[0].ok(&["export", "nbd", "v"]);
    let mut c = connect(&d[0].nbd(), "v");

    // Only the primary removes, and not itself.
    let o = d[1].cli(&["replica", "remove", "v", &e2]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("on its primary"));
    let o = d[0].cli(&["replica", "remove", "v", &e0]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("promote another member"));
    let o = d[0].cli(&["volume", "delete", "v"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("remove them first"));

    // Removing host 2: the next generation without it; it forgets the membership and may
    // delete its copy; writes go on with host 1.
    d[0].ok(&["replica", "remove", "v", &e2]);
    let s = status(&d[0], "v");
    assert_eq!(s["generation"], 5, "{s}");
    assert_eq!(s["members"].as_array().unwrap().len(), 2, "{s}");
    assert_eq!(status(&d[1], "v")["generation"], 5);
    assert!(d[2].json(&["replica", "status"]).to_string().find("\"v\"").is_none(), "host 2 still lists v");
    d[2].ok(&["volume", "delete", "v"]);
    assert_eq!(fua_write(&mut c, 4096, &pattern(2, 4096)), 0);
    assert!(read_image(&d[1], "v", 32 * MIB) == read_image(&d[0], "v", 32 * MIB));

    // Removing the last one: a local volume, which writes without anyone and can be deleted.
    d[0].ok(&["replica", "remove", "v", &e1]);
    d[1].crash();
    d[0].ok(&["export", "nbd", "v"]); // read_image ended the export
    let mut c = connect(&d[0].nbd(), "v");
    let t = Instant::now();
    assert_eq!(fua_write(&mut c, 8192, &pattern(3, 4096)), 0, "{}", d[0].log());
    assert!(t.elapsed() < Duration::from_millis(500), "a local volume waited {:?}", t.elapsed());
    drop(c);
    assert!(d[0].json(&["replica", "status"]).to_string().find("\"v\"").is_none());
    d[0].ok(&["export", "stop", "v"]);
    d[0].ok(&["volume", "delete", "v"]);
}

/// A copy replaced while its host was down (a copy added elsewhere, then it removed) still
/// holds the old membership when it comes back: removing it again on the primary tells it, it
/// forgets the membership, and its copy can be deleted. A host that holds nothing is NotFound.
#[test]
fn a_replaced_member_that_comes_back_forgets_the_membership() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, mut d)) = cluster(4, root.path(), TIMEOUT) else { return };
    let (e1, e2, e3) = (sw.endpoint(1), sw.endpoint(2), sw.endpoint(3));
    d[0].ok(&["volume", "create", "v", "16M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    d[0].ok(&["export", "nbd", "v"]);
    let mut c = connect(&d[0].nbd(), "v");
    assert_eq!(fua_write(&mut c, 0, &pattern(1, 4096)), 0);
    d[2].crash();
    assert_eq!(fua_write(&mut c, 4096, &pattern(2, 4096)), 0);
    let o = d[0].cli(&["replica", "remove", "v", &e3]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("holds no membership"));
    // Replaced: a copy on host 3 first, then host 2 removed (3 of the 4 members record it).
    d[0].ok(&["replica", "add", "v", &e3, "--sync"]);
    until("the new copy is in sync", 60, || state_of(&d[0], "v", &e3) == "in-sync");
    d[0].ok(&["replica", "remove", "v", &e2]);
    assert_eq!(fua_write(&mut c, 8192, &pattern(3, 4096)), 0);
    let now = status(&d[0], "v")["generation"].as_u64().unwrap();

    d[2] = sw.daemon(2, root.path(), TIMEOUT);
    let held = status(&d[2], "v");
    assert!(held["generation"].as_u64().unwrap() < now, "{held}");
    let o = d[2].cli(&["volume", "delete", "v"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("remove them first"));
    d[0].ok(&["replica", "remove", "v", &e2]);
    assert!(d[2].json(&["replica", "status"]).to_string().find("\"v\"").is_none(), "host 2 still lists v");
    d[2].ok(&["volume", "delete", "v"]);
    // The membership is unchanged, and writes go on.
    assert_eq!(status(&d[0], "v")["generation"].as_u64().unwrap(), now);
    assert_eq!(fua_write(&mut c, 12288, &pattern(4, 4096)), 0);
    drop(c);
    assert!(read_image(&d[3], "v", 16 * MIB) == read_image(&d[0], "v", 16 * MIB), "the new copy differs");
}

#[test]
fn a_killed_primary_loses_no_acknowledged_flushed_write() {
    let root = tempfile::tempdir().unwrap();
    let extra = format!("{TIMEOUT}\nnbd-listen = \"0.0.0.0:10809\"");
    let Some((sw, mut d)) = cluster(3, root.path(), &extra) else { return };
    let (e1, e2) = (sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "v", "64M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    d[0].ok(&["export", "nbd", "v"]);
    // The writer's own log: block i holds pattern(i); FUA for odd i, and a FLUSH after every
    // 8th, so the acknowledged-durable set is exact.
    let nbd = d[0].nbd();
    let writer = std::thread::spawn(move || {
        let mut s = connect(&nbd, "v");
        let (mut durable, mut flushed) = (0u64, 0u64);
        for i in 0..16_384u64 {
            let flags = if i % 2 == 1 { CMD_FLAG_FUA } else { 0 };
            if send(&mut s, CMD_WRITE, flags, i * 4096, &pattern(i, 4096)) != Some(0) {
                break;
            }
            if i % 2 == 1 {
                durable = durable.max(i + 1);
            }
            if i % 8 == 7 {
                if send(&mut s, CMD_FLUSH, 0, 0, &[]) != Some(0) {
                    break;
                }
                (durable, flushed) = (i + 1, i + 1);
            }
        }
        (durable, flushed)
    });
    std::thread::sleep(Duration::from_secs(2));
    d[0].crash();
    let (durable, flushed) = writer.join().unwrap();
    assert!(durable > 50, "only {durable} writes were acknowledged before the kill");
    let t = Instant::now();
    let p = d[1].json(&["replica", "promote", "v"]);
    assert_eq!(p["role"], "primary", "{p}");
    eprintln!("promotion took {:?}; {durable} blocks acknowledged durable", t.elapsed());
    until("the other replica is reconciled", 60, || state_of(&d[1], "v", &e2) == "in-sync");
    let image = read_image(&d[1], "v", 64 * MIB);
    for i in 0..durable {
        let at = (i * 4096) as usize;
        // A FUA makes only its own write durable; a flush every write before it.
        if i % 2 == 1 || i < flushed {
            assert!(image[at..at + 4096] == pattern(i, 4096)[..], "acknowledged durable block {i} is missing");
        }
    }
    assert!(read_image(&d[2], "v", 64 * MIB)[..(durable * 4096) as usize] == image[..(durable * 4096) as usize]);

    // A client goes to the new primary over NBD with TLS (its certificate from the same CA):
    // it reads what was acknowledged and writes, and the write reaches the other replica.
    d[1].ok(&["export", "nbd", "v"]);
    let certs = root.path().join("client");
    std::fs::create_dir_all(&certs).unwrap();
    let pki = root.path().join("pki");
    for (from, to) in
        [("ca.pem", "ca-cert.pem"), ("host-2.pem", "client-cert.pem"), ("host-2-key.pem", "client-key.pem")]
    {
        std::fs::copy(pki.join(from), certs.join(to)).unwrap();
    }
    let o = Command::new("qemu-io")
        .args(["--object", &format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", certs.display())])
        .args(["--image-opts", &format!("driver=nbd,host={},port=10809,export=v,tls-creds=tls0", sw.ip[1])])
        .args(["-c", "read 0 4k", "-c", "write -P 0x5a 60M 64k", "-c", "flush"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let done = out.contains("read 4096/4096") && out.contains("wrote 65536/65536");
    assert!(o.status.success() && done, "{out}{}{}", String::from_utf8_lossy(&o.stderr), d[1].log());
    let at = (60 * MIB) as usize;
    assert!(
        read_image(&d[2], "v", 64 * MIB)[at..at + 65536].iter().all(|&b| b == 0x5a),
        "the write missed the replica"
    );
}

/// Calls the Mirror service of host `to` with the certificate of `who`.
async fn mirror_as(
    sw: &Switch,
    root: &std::path::Path,
    to: usize,
    who: &str,
) -> MirrorClient<tonic::transport::Channel> {
    let addr = format!("{}:7070", sw.ip[to]);
    MirrorClient::new(common::csi::tls_channel(&addr, &root.join("pki"), who).await)
}

/// A framed mirror connection (the primaries' wire: ALPN ferrite-mirror/1, u32 length + message)
/// to host `to` with `who`'s certificate: sends `frames` (raw bytes), then returns the acks that
/// come back until the member closes the connection or 2 s pass.
async fn framed(sw: &Switch, root: &std::path::Path, to: usize, who: &str, frames: Vec<u8>) -> Vec<pb::MirrorAck> {
    use prost::Message;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = root.join("pki");
    let cfg = ferrite_tls::client_config(
        &pki.join("ca.pem"),
        Some((&pki.join(format!("{who}.pem")), &pki.join(format!("{who}-key.pem")))),
        &[b"ferrite-mirror/1"],
    )
    .unwrap();
    let tcp = tokio::net::TcpStream::connect((sw.ip[to].as_str(), 7070)).await.unwrap();
    let name = ferrite_tls::server_name(&sw.ip[to]).unwrap();
    let mut c = ferrite_tls::TlsConnector::from(cfg).connect(name, tcp).await.unwrap();
    c.write_all(&frames).await.unwrap();
    c.flush().await.unwrap();
    let mut acks = Vec::new();
    let read = async {
        while let Ok(len) = c.read_u32().await {
            let mut buf = vec![0u8; len as usize];
            if c.read_exact(&mut buf).await.is_err() {
                break;
            }
            acks.push(pb::MirrorAck::decode(buf.as_slice()).unwrap());
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), read).await;
    acks
}

/// One frame of `m`.
fn frame(m: &pb::MirrorMessage) -> Vec<u8> {
    let body = prost::Message::encode_to_vec(m);
    [(body.len() as u32).to_be_bytes().as_slice(), &body].concat()
}

/// An open of `volume` at `generation`, then a 4 KiB write whose crc is `crc` (None: right).
fn open_and_write(volume: &str, generation: u64, crc: Option<u32>) -> Vec<u8> {
    let open = pb::MirrorOpen { volume: volume.into(), generation, ..Default::default() };
    let data = prost::bytes::Bytes::from(vec![7u8; 4096]);
    let crc = crc.unwrap_or_else(|| crc32c::crc32c(&data));
    let write = pb::MirrorWrite { offset: 0, crc, data, fua: false };
    [
        frame(&pb::MirrorMessage { seq: 0, op: Some(Op::Open(open)) }),
        frame(&pb::MirrorMessage { seq: 1, op: Some(Op::Write(write)) }),
    ]
    .concat()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_refuse_what_a_peer_may_not_do() {
    let root = tempfile::tempdir().unwrap();
    let Some((sw, d)) = cluster(3, root.path(), TIMEOUT) else { return };
    let (e0, e1, e2) = (sw.endpoint(0), sw.endpoint(1), sw.endpoint(2));
    let cli = |i: usize, args: Vec<String>| {
        let dir = d[i].dir.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let o =
                    Command::new(common::BIN).arg("--admin-socket").arg(dir.join("admin.sock")).args(&args).output();
                o.unwrap()
            })
            .await
            .unwrap()
        }
    };
    let ok = |o: std::process::Output| assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    ok(cli(0, args(&["volume", "create", "v", "16M", "--replicas", "2", "--peer", &e1])).await);
    ok(cli(0, args(&["volume", "create", "w", "16M", "--replicas", "3", "--peer", &e1, "--peer", &e2])).await);
    ok(cli(1, args(&["volume", "create", "plain", "16M"])).await);

    // host-2 is no member of v: it learns nothing of its membership (answered as if none were
    // held), and may not write to it or rewrite it.
    let mut as2 = mirror_as(&sw, root.path(), 1, "host-2").await;
    let m = as2.get(pb::MembershipRequest { volume: "v".into() }).await.unwrap().into_inner();
    assert_eq!(m, pb::Membership::default(), "a non-member was shown the membership");
    let e = stream_write(&mut as2, "v", 3).await;
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    let take = membership("v", 99, &e2, &[(&e2, "in-sync"), (&e1, "in-sync")]);
    let e = as2.record(take).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    // A member that is not the primary may not write either.
    let e = stream_write(&mut as2, "w", 3).await;
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    // Nobody makes a member primary but the member itself.
    let mut as1 = mirror_as(&sw, root.path(), 1, "host-1").await;
    let e = as1.record(membership("w", 50, &e1, &[(&e1, "in-sync"), (&e0, "in-sync"), (&e2, "in-sync")])).await;
    assert_eq!(e.unwrap_err().code(), tonic::Code::PermissionDenied);
    // The primary may not make a member of a volume the member has outside any membership.
    let mut as0 = mirror_as(&sw, root.path(), 1, "host-0").await;
    let e = as0.record(membership("plain", 2, &e0, &[(&e0, "in-sync"), (&e1, "in-sync")])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e}");
    // Nor send a membership that does not hold together, or a stale generation's writes.
    let mut bad = membership("w", 9, &e0, &[(&e0, "in-sync"), (&e1, "boss")]);
    assert_eq!(as0.record(bad.clone()).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    bad.members[1].state = "in-sync".into();
    bad.members.extend((0..8).map(|i| pb::Member { endpoint: format!("tcp://10.0.0.{i}:1"), ..Default::default() }));
    assert_eq!(as0.record(bad).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    let e = stream_write(&mut as0, "w", 2).await;
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("stale generation 2"), "{e}");

    // The same over the framed wire: the first ack says why the open was refused, and nothing
    // after it is applied.
    let acks = framed(&sw, root.path(), 1, "host-2", open_and_write("w", 3, None)).await;
    assert!(acks.len() == 1 && acks[0].seq == 0 && acks[0].error.contains("may not call Stream"), "{acks:?}");
    let acks = framed(&sw, root.path(), 1, "host-0", open_and_write("w", 2, None)).await;
    assert!(acks.len() == 1 && acks[0].error.contains("stale generation 2"), "{acks:?}");
    // A damaged write is refused by its ack; a frame longer than any message ends the stream.
    let acks = framed(&sw, root.path(), 1, "host-0", open_and_write("w", 3, Some(1))).await;
    assert!(acks.len() == 2 && acks[0].error.is_empty() && acks[1].error.contains("damaged"), "{acks:?}");
    let huge = [open_and_write("w", 3, None), u32::MAX.to_be_bytes().to_vec(), vec![0; 64]].concat();
    let acks = framed(&sw, root.path(), 1, "host-0", huge).await;
    assert_eq!(acks.len(), 2, "{acks:?}");
    assert!(acks[1].error.is_empty(), "the good write before the long frame is taken: {acks:?}");
    // With cumulative acks, an older request after a newer one ends the stream: an ack of the
    // newer one would answer the older one unseen.
    let open = pb::MirrorOpen { volume: "w".into(), generation: 3, cumulative_acks: true, ..Default::default() };
    let data = prost::bytes::Bytes::from(vec![5u8; 4096]);
    let write = |seq| {
        let w = pb::MirrorWrite { offset: 0, crc: crc32c::crc32c(&data), data: data.clone(), fua: false };
        frame(&pb::MirrorMessage { seq, op: Some(Op::Write(w)) })
    };
    let frames = [frame(&pb::MirrorMessage { seq: 0, op: Some(Op::Open(open)) }), write(2), write(1)].concat();
    let acks = framed(&sw, root.path(), 1, "host-0", frames).await;
    assert!(acks.len() == 3 && acks[1].through == 2, "{acks:?}");
    assert!(acks[2].error.contains("request 1 came after a newer one"), "{acks:?}");

    // A replica ejected while it was away cannot make itself primary by telling the others.
    sw.link(2, false);
    ok(cli(0, args(&["export", "nbd", "w"])).await);
    let nbd = d[0].nbd();
    let err =
        tokio::task::spawn_blocking(move || fua_write(&mut connect(&nbd, "w"), 0, &pattern(1, 4096))).await.unwrap();
    assert_eq!(err, 0, "the primary stopped with a majority");
    sw.link(2, true);
    let g = status(&d[1], "w")["generation"].as_u64().unwrap();
    let mut as2 = mirror_as(&sw, root.path(), 1, "host-2").await;
    let coup = membership("w", g + 10, &e2, &[(&e2, "in-sync"), (&e1, "in-sync"), (&e0, "ejected")]);
    let r = as2.record(coup).await.unwrap().into_inner();
    assert!(!r.stored, "a stale member took the primary's place");
    assert_eq!(r.held.unwrap().primary, e0);
    assert_eq!(status(&d[1], "w")["primary"], e0.as_str());
}

#[test]
fn a_returning_replica_gets_only_what_changed_while_writes_go_on() {
    let root = tempfile::tempdir().unwrap();
    let extra = format!("{TIMEOUT}\nsync-mark-interval-ms = 500\nreplication-bandwidth = \"8M\"");
    let Some((sw, mut d)) = cluster(3, root.path(), &extra) else { return };
    let (e1, e2) = (sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "v", "64M", "--replicas", "3", "--peer", &e1, "--peer", &e2]);
    let f = fio(&d[0], "v", &["--rw=write", "--bs=1M", "--size=32M", "--iodepth=4"]);
    assert!(f.wait_with_output().unwrap().status.success());
    // A mark follows the writes (the last one within a second and a half of them); the
    // replica that goes away holds it.
    let mark_of = |d: &Daemon| status(d, "v")["members"][2]["mark"].as_str().unwrap().to_owned();
    let mut last = String::new();
    until("a mark after the last write", 15, || {
        std::thread::sleep(Duration::from_secs(2));
        let now = mark_of(&d[0]);
        std::mem::replace(&mut last, now.clone()) == now && !now.is_empty()
    });

    // Away while 4 MiB of distinct blocks change: it comes back and only those cross.
    d[2].crash();
    let f = fio(&d[0], "v", &["--rw=randwrite", "--bs=4k", "--size=4M", "--iodepth=8"]);
    assert!(f.wait_with_output().unwrap().status.success());
    assert_eq!(state_of(&d[0], "v", &e2), "ejected");
    let before = sw.sent(0);
    d[2] = sw.daemon(2, root.path(), &extra);
    until("the returning replica is rebuilt", 30, || state_of(&d[0], "v", &e2) == "in-sync");
    let sent = sw.sent(0) - before;
    let changed = 4 * MIB;
    eprintln!("rebuild: {sent} bytes on the wire for {changed} bytes changed ({:.3}x)", sent as f64 / changed as f64);
    assert!(sent as f64 <= 1.05 * changed as f64, "{sent} bytes crossed for {changed} changed");
    assert!(sent >= changed, "{sent} bytes cannot carry {changed} changed");
    let image = read_image(&d[0], "v", 64 * MIB);
    for r in &d[1..] {
        assert!(read_image(r, "v", 64 * MIB) == image, "a copy differs after the rebuild");
    }

    // Away again; it comes back while writes go on (partial blocks included), is rebuilt at
    // 8 MiB/s meanwhile, and every copy ends equal.
    d[2].crash();
    let f = fio(&d[0], "v", &["--rw=randwrite", "--bs=64k", "--size=16M", "--iodepth=8"]);
    assert!(f.wait_with_output().unwrap().status.success());
    d[2] = sw.daemon(2, root.path(), &extra);
    let f = fio(
        &d[0],
        "v",
        &["--rw=randwrite", "--bsrange=512-16k", "--size=64M", "--iodepth=4", "--time_based", "--runtime=5"],
    );
    until("a rebuild starts", 15, || state_of(&d[0], "v", &e2) == "rebuilding");
    let s = status(&d[0], "v");
    assert!(s["members"][2]["reason"].as_str().unwrap().contains("copied"), "progress is shown: {s}");
    assert!(f.wait_with_output().unwrap().status.success());
    until("the replica is in sync again", 60, || state_of(&d[0], "v", &e2) == "in-sync");
    let image = read_image(&d[0], "v", 64 * MIB);
    for r in &d[1..] {
        assert!(read_image(r, "v", 64 * MIB) == image, "a copy differs after a rebuild under writes");
    }
}

/// A volume restored from a backup is restored once, on the daemon that will be its primary,
/// and its replicas are made from it: adding one is refused while the restore runs (the
/// daemons that hold them have no backup target at all), then they join and hold its bytes.
#[test]
fn a_restored_volume_is_restored_once_then_replicated() {
    let root = tempfile::tempdir().unwrap();
    if !common::have("qemu-io") || !common::have("qemu-img") {
        return;
    }
    let Some(sw) = Switch::new(3) else { return };
    let Some(store) = weed::Weed::start_at(&sw.gateway, false) else { return };
    // Paced, so that the restore is still running when a replica is asked for.
    let with_target = format!(
        "{TIMEOUT}\n[backup-targets.offsite]\nkind = \"s3\"\nendpoint = \"{}\"\nbucket = \"ferrite-test\"\n\
         chunk-size = \"1M\"\nbandwidth = \"4M\"\n",
        store.endpoint()
    );
    let d: Vec<Daemon> =
        (0..3).map(|i| sw.daemon(i, root.path(), if i == 0 { &with_target } else { TIMEOUT })).collect();
    let (e1, e2) = (sw.endpoint(1), sw.endpoint(2));
    d[0].ok(&["volume", "create", "src", "24M"]);
    let noise = root.path().join("noise");
    let bytes: Vec<u8> = (0..24u64).flat_map(|n| pattern(n + 1, MIB as usize)).collect();
    std::fs::write(&noise, bytes).unwrap();
    qemu_io(&d[0], "src", &[&format!("write -s {} 0 24M", noise.display())]);
    let b = d[0].json(&["backup", "create", "src", "--target", "offsite"]);
    let name = b["name"].as_str().unwrap();

    d[0].ok(&["backup", "restore", name, "v", "--target", "offsite", "--detach"]);
    let o = d[0].cli(&["replica", "add", "v", &e1, "--sync"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("being restored"), "{o:?}");
    d[0].ok(&["backup", "restore", name, "v", "--target", "offsite"]);
    d[0].ok(&["replica", "add", "v", &e1, "--sync"]);
    d[0].ok(&["replica", "add", "v", &e2, "--sync"]);
    for e in [&e1, &e2] {
        until("the replica is in sync", 60, || state_of(&d[0], "v", e) == "in-sync");
    }
    d[0].ok(&["export", "nbd", "src"]);
    for r in &d[1..] {
        r.ok(&["export", "nbd", "v"]);
        let cmp = Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(d[0].qemu_uri("src"))
            .arg(r.qemu_uri("v"))
            .output()
            .unwrap();
        assert!(cmp.status.success(), "a replica of the restored volume differs from the source: {cmp:?}");
    }
}
