//! Hostile and broken clients against the real daemon: memory stays bounded however much a
//! client pipelines, listeners survive thousands of idle connections and stalled handshakes, a
//! huge zeroing request runs in bounded memory, and `export stop` cuts the export's clients.
//! Figures (peak RSS, connections held, admin latency) are printed for the report.

use crate::common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::Daemon;
use common::nbd::{connect, hello, reply, request, rss_kib};
use ferrite_nbd::proto::*;

const MIB: u64 = 1 << 20;
const CHUNK: u32 = 8 << 20;

fn daemon(dir: &std::path::Path, extra: &str) -> Daemon {
    std::fs::write(dir.join("ferrite.toml"), format!("pool-size = \"1G\"\nsegment-size = \"4M\"\n{extra}")).unwrap();
    Daemon::start(dir)
}

fn pid(d: &Daemon) -> u32 {
    d.child.as_ref().unwrap().id()
}

#[test]
fn pipelined_32m_reads_from_many_connections_stay_under_the_memory_cap() {
    const CAP_MIB: u64 = 256;
    let dir = tempfile::tempdir().unwrap();
    let mut d = daemon(dir.path(), &format!("nbd-memory = \"{CAP_MIB}M\"\nnbd-connection-memory = \"64M\"\n"));
    d.ok(&["volume", "create", "big", "512M"]);
    d.ok(&["export", "nbd", "big"]);
    // Real data in the first 64 MiB (the rest reads as holes), then a read-only snapshot export.
    let mut w = connect(&d.nbd(), "big");
    let chunk = vec![0x5Au8; CHUNK as usize];
    for i in 0..8u64 {
        w.write_all(&request(CMD_WRITE, 0, i, i * u64::from(CHUNK), CHUNK, &chunk)).unwrap();
        assert_eq!(reply(&mut w, 0).0, 0);
    }
    w.write_all(&request(CMD_FLUSH, 0, 99, 0, 0, &[])).unwrap();
    assert_eq!(reply(&mut w, 0).0, 0);
    drop(w);
    d.ok(&["snapshot", "create", "big", "s"]);
    d.ok(&["export", "nbd", "big@s"]);
    let (_, before) = rss_kib(pid(&d));

    // 8 connections each pipeline 16 reads of 32 MiB (4 GiB of replies, 8 GiB of buffers if
    // taken at once) and read nothing for a second.
    const CONNS: u64 = 8;
    const READS: u64 = 16;
    let mut conns: Vec<_> = (0..CONNS).map(|_| connect(&d.nbd(), "big@s")).collect();
    for (c, s) in conns.iter_mut().enumerate() {
        let reqs: Vec<u8> = (0..READS)
            .flat_map(|i| request(CMD_READ, 0, i, ((c as u64 * READS + i) * 32 * MIB) % (480 * MIB), 32 << 20, &[]))
            .collect();
        s.write_all(&reqs).unwrap();
    }
    std::thread::sleep(Duration::from_secs(1));
    // The admin API answers meanwhile.
    let t = Instant::now();
    d.ok(&["pool", "status"]);
    let admin = t.elapsed();
    let readers: Vec<_> = conns
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || {
                for _ in 0..READS {
                    assert_eq!(reply(&mut s, 32 << 20).0, 0);
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    let (peak, _) = rss_kib(pid(&d));
    let grew = (peak.saturating_sub(before)) / 1024;
    eprintln!(
        "hostile reads: daemon RSS {} MiB before, peak {} MiB (+{grew} MiB) with nbd-memory = {CAP_MIB}M; \
         admin answered in {admin:?} under load",
        before / 1024,
        peak / 1024
    );
    // The cap plus what is not request data (thread stacks touched, allocator slack).
    assert!(grew < CAP_MIB + 128, "RSS grew by {grew} MiB, more than the {CAP_MIB} MiB cap + 128 MiB");
    assert!(admin < Duration::from_secs(2), "the admin API took {admin:?} under load");
    assert!(d.stop().success(), "{}", d.log());
}

#[test]
fn thousands_of_idle_connections_keep_the_admin_api_responsive_and_the_rest_are_refused() {
    const LIMIT: usize = 2000;
    let dir = tempfile::tempdir().unwrap();
    let mut d = daemon(dir.path(), &format!("max-connections = {LIMIT}\n"));
    d.ok(&["volume", "create", "v", "16M"]);
    d.ok(&["export", "nbd", "v"]);
    // Every one in transmission: a thread and a ring each in the daemon.
    let held: Vec<_> = (0..LIMIT).map(|_| connect(&d.nbd(), "v")).collect();
    let threads = std::fs::read_to_string(format!("/proc/{}/status", pid(&d))).unwrap();
    let threads = threads.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().to_string();
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        d.ok(&["volume", "list"]);
        worst = worst.max(t.elapsed());
    }
    eprintln!("idle connections: {} held ({threads} daemon threads); admin API worst of 5: {worst:?}", held.len());
    assert!(worst < Duration::from_secs(1), "admin API took {worst:?} with {LIMIT} NBD connections open");
    // Past the limit: closed on arrival, no greeting.
    for _ in 0..20 {
        assert!(hello(&d.nbd()).is_none(), "a client past max-connections must be refused");
    }
    // The held connections still work, and once they go, new clients are served again.
    let mut one = held.into_iter().next().unwrap();
    one.write_all(&request(CMD_READ, 0, 1, 0, 4096, &[])).unwrap();
    assert_eq!(reply(&mut one, 4096).0, 0);
    drop(one);
    let start = Instant::now();
    let mut s = loop {
        if let Some(s) = hello(&d.nbd()) {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no slot came free");
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = s.write_all(&[0; 4]);
    d.ok(&["pool", "status"]);
    assert!(d.stop().success(), "{}", d.log());
}

#[test]
fn a_client_that_stalls_in_the_handshake_is_cut_after_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = daemon(dir.path(), "handshake-timeout-s = 1\n");
    let mut s = hello(&d.nbd()).unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 1];
    // Nothing sent after the greeting: the server ends the connection.
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
    let waited = t.elapsed();
    assert!(waited >= Duration::from_millis(800) && waited < Duration::from_secs(5), "cut after {waited:?}");
    // Half an option header counts as stalling too.
    let mut s = hello(&d.nbd()).unwrap();
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE).to_be_bytes()).unwrap();
    s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
    assert!(d.log().contains("no handshake within the timeout"), "{}", d.log());
    assert!(d.stop().success());
}

#[test]
fn a_huge_write_zeroes_with_no_hole_runs_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = daemon(dir.path(), "");
    d.ok(&["volume", "create", "z", "640M"]);
    d.ok(&["export", "nbd", "z"]);
    let (_, before) = rss_kib(pid(&d));
    let mut s = connect(&d.nbd(), "z");
    // One 28-byte request: 640 MiB of zeroes that must stay allocated.
    s.write_all(&request(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, 1, 0, 640 << 20, &[])).unwrap();
    assert_eq!(reply(&mut s, 0), (0, 1));
    let (peak, _) = rss_kib(pid(&d));
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "volume", "show", "z"])).unwrap();
    assert_eq!(v["allocated"], 640u64 << 20, "NO_HOLE zeroes are allocated");
    let grew = peak.saturating_sub(before) / 1024;
    eprintln!("write-zeroes 640 MiB NO_HOLE: RSS +{grew} MiB");
    assert!(grew < 64, "RSS grew by {grew} MiB zeroing 640 MiB");
    // The same without NO_HOLE unmaps instead.
    s.write_all(&request(CMD_WRITE_ZEROES, 0, 2, 0, 640 << 20, &[])).unwrap();
    assert_eq!(reply(&mut s, 0), (0, 2));
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "volume", "show", "z"])).unwrap();
    assert_eq!(v["allocated"], 0);
    assert!(d.stop().success());
}

#[test]
fn export_stop_cuts_the_exports_connections_and_keeps_acknowledged_writes() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = daemon(dir.path(), "");
    d.ok(&["volume", "create", "a", "16M"]);
    d.ok(&["volume", "create", "b", "16M"]);
    d.ok(&["export", "nbd", "a"]);
    d.ok(&["export", "nbd", "b"]);
    let mut a = connect(&d.nbd(), "a");
    let mut b = connect(&d.nbd(), "b");
    a.write_all(&request(CMD_WRITE, 0, 1, 0, 4096, &[7u8; 4096])).unwrap();
    assert_eq!(reply(&mut a, 0).0, 0);
    d.ok(&["export", "stop", "a"]);
    let mut buf = [0u8; 1];
    assert_eq!(a.read(&mut buf).unwrap_or(0), 0, "the stopped export's client is cut");
    // The other export's client goes on; the write acknowledged before the stop is there.
    b.write_all(&request(CMD_READ, 0, 2, 0, 4096, &[])).unwrap();
    assert_eq!(reply(&mut b, 4096).0, 0);
    d.ok(&["export", "nbd", "a"]);
    let mut a = connect(&d.nbd(), "a");
    a.write_all(&request(CMD_READ, 0, 3, 0, 4096, &[])).unwrap();
    let mut h = [0u8; 16];
    a.read_exact(&mut h).unwrap();
    let mut data = vec![0u8; 4096];
    a.read_exact(&mut data).unwrap();
    assert!(data.iter().all(|&x| x == 7));
    assert!(d.stop().success());
}
