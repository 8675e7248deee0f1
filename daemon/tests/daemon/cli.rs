//! The daemon and its CLI, end to end: volumes, exports, pool status, errors, clean shutdown,
//! and restart with exports restored.

use crate::common;

use common::{Daemon, have};
use std::process::Command;

#[test]
fn volume_export_lifecycle_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let out = d.ok(&["volume", "create", "db", "64MiB"]);
    assert!(out.contains("db") && out.contains("64.0 MiB"), "{out}");
    let json = d.ok(&["-o", "json", "volume", "show", "db"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["size"], 64 << 20);
    assert_eq!(v["allocated"], 0);

    // Errors: one line, non-zero exit, nothing changed.
    let dup = d.cli(&["volume", "create", "db", "1G"]);
    assert!(!dup.status.success());
    let msg = String::from_utf8_lossy(&dup.stderr);
    assert_eq!(msg.trim().lines().count(), 1, "{msg}");
    assert!(msg.contains("already exists"), "{msg}");
    let bad = d.cli(&["volume", "create", "x", "12Q"]);
    assert!(!bad.status.success());
    let missing = d.cli(&["volume", "show", "nope"]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("not found"));
    let shrink = d.cli(&["volume", "resize", "db", "1M"]);
    assert!(String::from_utf8_lossy(&shrink.stderr).contains("shrinking"));

    let out = d.ok(&["export", "nbd", "db"]);
    assert!(out.contains("nbd+unix:///db?socket="), "{out}");
    // The printed nbdinfo line works as printed.
    if have("nbdinfo") {
        let uri = out.lines().find_map(|l| l.trim().strip_prefix("try:  nbdinfo '")).unwrap().trim_end_matches('\'');
        let info = Command::new("nbdinfo").arg(uri).output().unwrap();
        assert!(info.status.success(), "{}", String::from_utf8_lossy(&info.stderr));
        assert!(String::from_utf8_lossy(&info.stdout).contains("67108864"));
    }
    if have("qemu-io") {
        let w = Command::new("qemu-io")
            .args(["-f", "raw", "-c", "write -P 0x77 1M 2M", "-c", "flush"])
            .arg(d.qemu_uri("db"))
            .output()
            .unwrap();
        assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
        let v: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "volume", "show", "db"])).unwrap();
        assert_eq!(v["allocated"], 2 << 20);
    }
    let busy = d.cli(&["volume", "delete", "db"]);
    assert!(String::from_utf8_lossy(&busy.stderr).contains("stop the export first"));
    let status = d.ok(&["pool", "status"]);
    assert!(status.contains("write amplification"), "{status}");

    // Clean shutdown, restart: data and export are back.
    assert!(d.stop().success(), "{}", d.log());
    assert!(d.log().contains("shut down cleanly"), "{}", d.log());
    let d = Daemon::start(dir.path());
    let exports = d.ok(&["-o", "json", "export", "list"]);
    assert!(exports.contains("\"db\""), "{exports}");
    if have("qemu-io") {
        let r = Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read -P 0x77 1M 2M", "-c", "read -P 0 0 1M"])
            .arg(d.qemu_uri("db"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&r.stdout);
        assert!(r.status.success() && !text.contains("verification failed"), "{text}");
    }
    d.ok(&["export", "stop", "db"]);
    d.ok(&["volume", "delete", "db"]);
    assert!(d.ok(&["volume", "list"]).lines().count() == 1);
}

#[test]
fn client_without_daemon_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(common::BIN)
        .arg("--admin-socket")
        .arg(dir.path().join("none.sock"))
        .args(["volume", "list"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("is it running"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn metrics_endpoint_reports_pool_volumes_and_traffic() {
    use prometheus_parse::{Scrape, Value};
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    std::fs::write(
        dir.path().join("ferrite.toml"),
        format!("pool-size = \"1G\"\nsegment-size = \"4M\"\nmetrics-listen = \"127.0.0.1:{port}\"\n"),
    )
    .unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "m", "16M"]);
    d.ok(&["export", "nbd", "m"]);
    let traffic = have("qemu-io");
    if traffic {
        let w = Command::new("qemu-io")
            .args(["-f", "raw", "-c", "write 0 1M", "-c", "read 0 64k"])
            .arg(d.qemu_uri("m"))
            .output()
            .unwrap();
        assert!(w.status.success());
    }
    // A replicated volume whose peer is away: one failed transfer.
    d.ok(&["replica", "enable", "m", "/nonexistent/peer.sock", "--interval", "0"]);
    assert!(!d.cli(&["replica", "sync", "m"]).status.success());
    // Returns the status line, the headers and the body.
    let request = |head: &str| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(head.as_bytes()).unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        (head.to_string(), body.to_string())
    };
    let (head, body) = request("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.to_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
    assert!(body.ends_with("# EOF\n"), "an OpenMetrics text ends with # EOF: {body}");

    let scrape = Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).unwrap();
    let find = |name: &str, labels: &[(&str, &str)]| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            .unwrap_or_else(|| panic!("no sample {name}{labels:?} in {body}"))
            .value
            .clone()
    };
    let Value::Gauge(data_area) = find("ferrite_pool_size_bytes", &[]) else { panic!("not a gauge") };
    assert!((1000e6..=1073741824.0).contains(&data_area), "a 1 GiB pool's data area: {data_area}");
    assert_eq!(find("ferrite_volume_size_bytes", &[("volume", "m")]), Value::Gauge(16.0 * 1024.0 * 1024.0));
    assert_eq!(find("ferrite_pool_volumes", &[]), Value::Gauge(1.0));
    let format = ferrite_engine::format::FORMAT_VERSION.to_string();
    let build = [("version", env!("CARGO_PKG_VERSION")), ("format", format.as_str())];
    assert_eq!(find("ferrite_build_info", &build), Value::Gauge(1.0));
    assert!(scrape.docs.contains_key("ferrite_nbd_read_seconds"), "every family has its HELP");
    let replicated = [("volume", "m"), ("role", "primary")];
    assert_eq!(find("ferrite_replication_error", &replicated), Value::Gauge(1.0));
    assert_eq!(find("ferrite_replication_lag_seconds", &replicated), Value::Gauge(0.0));
    assert_eq!(find("ferrite_replication_sync_failures_total", &replicated), Value::Untyped(1.0));
    assert_eq!(find("ferrite_replication_syncs_total", &replicated), Value::Untyped(0.0));
    // prometheus-parse reads OpenMetrics counters (`_total` samples under a TYPE without it) as untyped.
    let connections = find("ferrite_nbd_connections_total", &[]);
    if traffic {
        let export = [("export", "m"), ("volume", "m")];
        assert_eq!(connections, Value::Untyped(1.0));
        assert_eq!(find("ferrite_nbd_write_bytes_total", &export), Value::Untyped(1048576.0));
        let Value::Histogram(reads) = find("ferrite_nbd_read_seconds", &export) else { panic!("not a histogram") };
        assert_eq!(reads.last().map(|b| (b.less_than, b.count)), Some((f64::INFINITY, 1.0)), "{reads:?}");
        assert!(reads.windows(2).all(|w| w[0].count <= w[1].count), "cumulative buckets: {reads:?}");
        assert_eq!(find("ferrite_nbd_read_seconds_count", &export), Value::Untyped(1.0));
    }

    let (head, _) = request("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let (head, _) = request("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 405"), "{head}");
    let (head, _) = request("NOT HTTP\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 400") || head.is_empty(), "{head}");
    // A request head larger than the limit is refused, not buffered.
    let (head, _) = request(&format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(64 << 10)));
    assert!(!head.starts_with("HTTP/1.1 200"), "{head}");
}

/// Runs qemu-io commands against an export; returns stdout, failing on error or a mismatch.
fn qemu_io(d: &Daemon, export: &str, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    if export.contains('@') {
        c.arg("-r"); // snapshot exports are read-only
    }
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let o = c.arg(d.qemu_uri(export)).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !text.contains("verification failed"), "{cmds:?}: {text} {err}");
    text
}

#[test]
fn snapshots_clones_and_snapshot_exports() {
    if !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "db", "16MiB"]);
    d.ok(&["export", "nbd", "db"]);
    qemu_io(&d, "db", &["write -P 0x11 0 4M", "flush"]);
    let out = d.ok(&["snapshot", "create", "db", "nightly"]);
    assert!(out.contains("nightly"), "{out}");
    qemu_io(&d, "db", &["write -P 0x22 0 1M", "discard 2M 1M"]);
    // The snapshot, exported read-only as volume@snapshot, still holds what was there.
    let e: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "export", "nbd", "db@nightly"])).unwrap();
    assert_eq!(e["read_only"], true);
    qemu_io(&d, "db@nightly", &["read -P 0x11 0 4M", "read -P 0 4M 1M"]);
    let w = Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k"]).arg(d.qemu_uri("db@nightly")).output();
    assert!(!w.unwrap().status.success(), "a snapshot export refuses writes");
    // Clones: from the snapshot and from the live volume.
    d.ok(&["clone", "db@nightly", "restore"]);
    d.ok(&["clone", "db", "copy"]);
    d.ok(&["export", "nbd", "restore"]);
    d.ok(&["export", "nbd", "copy"]);
    qemu_io(&d, "restore", &["read -P 0x11 0 4M"]);
    qemu_io(&d, "copy", &["read -P 0x22 0 1M", "read -P 0x11 1M 1M", "read -P 0 2M 1M", "read -P 0x11 3M 1M"]);
    let snaps: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "snapshot", "list", "db"])).unwrap();
    assert_eq!(snaps[0]["name"], "nightly");
    assert_eq!(snaps[0]["size"], 16 << 20);
    assert_eq!(snaps[0]["layer_bytes"], 4 << 20);
    // What changed in db since the snapshot: the 1 MiB written and the 1 MiB discarded.
    let diff: serde_json::Value =
        serde_json::from_str(&d.ok(&["-o", "json", "snapshot", "diff", "db", "--since", "nightly"])).unwrap();
    assert_eq!(diff["bytes"], 2 << 20, "{diff}");
    assert_eq!(diff["ranges"][0]["offset"], 0);
    assert_eq!(diff["ranges"][1]["offset"], 2 << 20);
    let alloc: serde_json::Value =
        serde_json::from_str(&d.ok(&["-o", "json", "snapshot", "diff", "db@nightly"])).unwrap();
    assert_eq!(alloc["bytes"], 4 << 20, "{alloc}");
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "volume", "show", "restore"])).unwrap();
    assert_eq!((v["chain_depth"].as_u64(), v["allocated"].as_u64()), (Some(2), Some(4 << 20)));
    // Live data: the snapshot's 4 MiB and db's 1 MiB rewrite (clones share, discards are markers).
    let scrub: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "pool", "scrub"])).unwrap();
    assert_eq!(
        (scrub["damaged_blocks"].as_u64(), scrub["checked_bytes"].as_u64()),
        (Some(0), Some(5 << 20)),
        "{scrub}"
    );
    // Deleting an exported snapshot is refused; after the export stops, deletion always works.
    let busy = d.cli(&["snapshot", "delete", "nightly"]);
    assert!(String::from_utf8_lossy(&busy.stderr).contains("stop the export first"));
    d.ok(&["export", "stop", "db@nightly"]);
    d.ok(&["snapshot", "delete", "nightly"]);
    qemu_io(&d, "restore", &["read -P 0x11 0 4M"]);
    let missing = d.cli(&["snapshot", "show", "nightly"]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("not found"));
    // Reclaim through the CLI: deleting the volume and clones frees their data; the cleaner
    // and a checkpoint give the segments back.
    for e in ["db", "restore", "copy"] {
        d.ok(&["export", "stop", e]);
    }
    for v in ["db", "restore", "copy"] {
        d.ok(&["volume", "delete", v]);
    }
    let r: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "pool", "reclaim"])).unwrap();
    assert_eq!(r["live"], 0, "{r}");
    assert!(r["used_after"].as_u64() <= Some(4 << 20), "only the head segment stays: {r}");
    let status = d.ok(&["pool", "status"]);
    assert!(status.contains("cleaner") && status.contains("runs"), "{status}");
    let scrub = d.ok(&["pool", "scrub"]);
    assert!(scrub.contains("0 damaged blocks"), "{scrub}");
    let bad = d.cli(&["clone", "nope@x", "y"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("not found"));
}

#[test]
fn scrub_shows_progress_on_a_terminal_and_in_logs() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "v", "8MiB"]);
    // Not a terminal (a log, CI): plain lines, the last at 100%.
    let o = d.cli(&["pool", "scrub"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.lines().last().is_some_and(|l| l.starts_with("scrub: 100%")), "{err}");
    // On a terminal (script(1) gives the CLI a pseudo-terminal): the indicatif bar, left at 100%.
    let cmd = format!("{} --admin-socket {} pool scrub", common::BIN, d.admin().display());
    let o = Command::new("script").args(["-qec", &cmd, "/dev/null"]).output().unwrap();
    let tty = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && tty.contains("scrub: [") && tty.contains("100%"), "{tty}");
    // The result starts a line of its own after the bar.
    assert!(tty.lines().any(|l| l.starts_with("scrub: ") && l.contains("0 damaged blocks")), "{tty}");
}

/// `volume defrag` after random writes: progress, far fewer runs, the same data.
#[test]
fn defrag_puts_a_scattered_volume_back_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "v", "16MiB"]);
    let mut s = common::nbd::open(&d, "v");
    assert_eq!(common::nbd::write_on(&mut s, 0, &vec![1u8; 16 << 20]), 0);
    let mut x = 5u64;
    for i in 0..2000u32 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let block = (i % 251) as u8;
        assert_eq!(common::nbd::write_on(&mut s, (x % 4096) * 4096, &[block; 4096]), 0);
    }
    drop(s);
    d.ok(&["export", "stop", "v"]);
    // Other traffic after them: the random writes are no longer in the segment being written
    // (whose blocks are hot, and stay where they are).
    d.ok(&["volume", "create", "w", "8MiB"]);
    let mut s = common::nbd::open(&d, "w");
    assert_eq!(common::nbd::write_on(&mut s, 0, &vec![2u8; 8 << 20]), 0);
    drop(s);
    d.ok(&["export", "stop", "w"]);
    let before = common::nbd::read_image(&d, "v", 16 << 20);
    let o = d.cli(&["volume", "defrag", "v"]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && err.lines().last().is_some_and(|l| l.starts_with("defrag: 100%")), "{err}");
    assert!(out.contains("contiguous runs"), "{out}");
    let r = d.json(&["volume", "defrag", "v"]);
    assert_eq!(r["mapped_bytes"], 16 << 20);
    assert!(r["runs_after"].as_u64().unwrap() < 64, "{r}");
    assert_eq!(r["moved_bytes"], 0, "a second pass has nothing to do: {r}");
    assert!(common::nbd::read_image(&d, "v", 16 << 20) == before, "defrag changed the data");
    let bad = d.cli(&["volume", "defrag", "nope"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("not found"));
}

#[test]
fn groups_and_group_snapshots_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    for v in ["db", "log", "web"] {
        d.ok(&["volume", "create", v, "8MiB"]);
    }
    d.ok(&["group", "create", "app", "db", "log"]);
    d.ok(&["group", "add", "app", "web"]);
    d.ok(&["group", "remove", "app", "log"]);
    let g: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "group", "list"])).unwrap();
    assert_eq!(g[0]["volumes"], serde_json::json!(["db", "web"]));
    let taken = d.ok(&["group", "snapshot", "app", "nightly"]);
    assert!(taken.contains("nightly.db") && taken.contains("nightly.web"), "{taken}");
    let snaps: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "snapshot", "list"])).unwrap();
    assert_eq!(snaps.as_array().unwrap().len(), 2);
    d.ok(&["group", "clone", "nightly", "restore"]);
    assert!(d.ok(&["volume", "list"]).contains("restore.db"));
    let busy = d.cli(&["snapshot", "delete", "nightly.db"]);
    assert!(String::from_utf8_lossy(&busy.stderr).contains("group snapshot"), "{busy:?}");
    d.ok(&["group", "delete-snapshot", "nightly"]);
    assert!(d.ok(&["group", "snapshots"]).lines().count() == 1);
    let dup = d.cli(&["group", "create", "other", "db"]);
    assert!(String::from_utf8_lossy(&dup.stderr).contains("already in group"));
    d.ok(&["group", "delete", "app"]);
    d.ok(&["group", "create", "other", "db"]);
}

#[test]
fn a_closed_pipe_ends_a_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    // `ferrite pool status | true`: its stdout a pipe whose reader is gone before it prints.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = Command::new(common::BIN)
        .arg("--admin-socket")
        .arg(d.admin())
        .args(["pool", "status"])
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.is_empty(), "{:?}: {err}", o.status);
}
