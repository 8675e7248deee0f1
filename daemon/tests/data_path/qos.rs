//! Per-volume QoS end to end: fio over NBD against limited volumes of one daemon, the CLI, and
//! the rate measured in fio's own per-interval logs (rates, not timings, are what is asserted:
//! a limit holds the rate down, whatever the machine's speed; the unlimited volume is only
//! required to go clearly faster than the limit).

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use crate::common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Daemon;

/// fio randwrite (`rw`) on `volume` over NBD for `secs`, logging IOPS every 250 ms to
/// `<log>_iops.1.log`.
fn fio(d: &Daemon, volume: &str, rw: &str, secs: u64, log: &Path) -> Child {
    d.ok(&["export", "nbd", volume]);
    Command::new("fio")
        .args(["--name=q", "--ioengine=nbd", "--iodepth=16", "--bs=4k", "--size=32M", "--time_based"])
        .args(["--log_avg_msec=250", "--output=/dev/null", "--randrepeat=0"])
        .arg(format!("--runtime={secs}"))
        .arg(format!("--rw={rw}"))
        .arg(format!("--write_iops_log={}", log.display()))
        .arg(format!("--uri=nbd+unix:///{volume}?socket={}", d.nbd().display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// fio randwrite on `volume` for `secs`, waited for: (writes done, mean IOPS).
fn fio_json(d: &Daemon, volume: &str, secs: u64) -> (u64, f64) {
    d.ok(&["export", "nbd", volume]);
    let o = Command::new("fio")
        .args(["--name=j", "--ioengine=nbd", "--iodepth=16", "--bs=4k", "--size=32M", "--time_based"])
        .args(["--rw=randwrite", "--output-format=json", "--randrepeat=0"])
        .arg(format!("--runtime={secs}"))
        .arg(format!("--uri=nbd+unix:///{volume}?socket={}", d.nbd().display()))
        .output()
        .unwrap();
    assert!(o.status.success(), "fio: {}", String::from_utf8_lossy(&o.stderr));
    // The nbd engine may print a line of its own before the JSON.
    let text = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(&text[text.find('{').unwrap_or(0)..]).unwrap();
    let w = &v["jobs"][0]["write"];
    (w["total_ios"].as_u64().unwrap(), w["iops"].as_f64().unwrap())
}

fn done(mut c: Child) {
    assert!(c.wait().unwrap().success(), "fio failed");
}

/// (time ms, IOPS) samples of a fio iops log.
fn samples(log: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(format!("{}_iops.1.log", log.display())).unwrap();
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(str::trim);
            Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
        })
        .collect()
}

/// Mean IOPS over [from, to) ms.
fn rate(s: &[(u64, f64)], from: u64, to: u64) -> f64 {
    let w: Vec<f64> = s.iter().filter(|(t, _)| *t > from && *t <= to).map(|(_, v)| *v).collect();
    assert!(!w.is_empty(), "no samples in {from}..{to} ms: {s:?}");
    w.iter().sum::<f64>() / w.len() as f64
}

/// The metrics endpoint's body.
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

fn has_fio() -> bool {
    let ok = Command::new("fio").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        common::skip("fio (scripts/setup.sh installs it)", true);
    }
    ok
}

#[test]
fn limits_hold_over_ten_seconds_other_volumes_keep_their_rate_and_changes_apply_within_a_second() {
    if !has_fio() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = common::csi::free_port("127.0.0.1");
    let cfg = format!("pool-size = \"1G\"\nsegment-size = \"4M\"\nmetrics-listen = \"127.0.0.1:{port}\"\n");
    std::fs::write(dir.path().join("ferrite.toml"), cfg).unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "slow", "64M", "--write-iops", "400", "--burst", "250ms"]);
    d.ok(&["volume", "create", "fast", "64M"]);
    let shown = d.ok(&["volume", "show", "slow"]);
    assert!(shown.contains("400 IOPS write, burst 250 ms"), "{shown}");

    println!("== burst: 2 s banked at 200 IOPS go at once, then the rate");
    d.ok(&["volume", "create", "bursty", "64M", "--write-iops", "200", "--burst", "2s"]);
    let (ios, _) = fio_json(&d, "bursty", 3);
    println!("   {ios} writes in 3 s (400 banked + 3 s × 200 = 1000)");
    assert!((900..=1100).contains(&ios), "{ios}");

    let (_, alone) = fio_json(&d, "fast", 4);
    println!("== 11 s of fio on a volume limited to 400 write IOPS, and on an unlimited one ({alone:.0} IOPS alone)");
    let (ls, lf) = (dir.path().join("slow"), dir.path().join("fast"));
    let (slow, fast) = (fio(&d, "slow", "randwrite", 11, &ls), fio(&d, "fast", "randwrite", 11, &lf));
    done(slow);
    done(fast);
    let (s, f) = (samples(&ls), samples(&lf));
    let (limited, free) = (rate(&s, 1000, 11_000), rate(&f, 1000, 11_000));
    println!("   limited {limited:.0} IOPS, unlimited {free:.0} IOPS over 10 s");
    assert!((limited - 400.0).abs() <= 20.0, "400 IOPS ±5% over 10 s: {limited:.1}");
    // Both fio clients and the daemon share two cores here, with the suite's other tests, so
    // "keeps its rate" allows for the CPU the limited client takes (CI measured 0.50-0.62 of the
    // rate alone); a limit that leaked onto other volumes would hold this one near 400, a
    // hundred times below.
    assert!(
        free > 0.25 * alone && free > 10.0 * 400.0,
        "the unlimited volume keeps its rate: {free:.0} with, {alone:.0} alone"
    );
    let v = d.json(&["volume", "show", "slow"]);
    assert!(v["throttled_requests"].as_u64().unwrap() > 1000, "{v}");
    let metrics = scrape(port);
    let line = metrics.lines().find(|l| l.starts_with("ferrite_volume_throttled_requests_total{volume=\"slow\"}"));
    let n: u64 = line.and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("{metrics}"));
    assert!(n > 1000, "{line:?}");
    assert!(metrics.contains("ferrite_volume_throttled_seconds_total{volume=\"slow\"}"));
    assert!(metrics.contains("ferrite_volume_throttled_requests_total{volume=\"fast\"} 0"));

    println!("== a change during a running job takes effect within a second");
    let lc = dir.path().join("change");
    let job = fio(&d, "slow", "randwrite", 8, &lc);
    std::thread::sleep(Duration::from_millis(4500));
    let t = Instant::now();
    d.ok(&["volume", "set", "slow", "--write-iops", "1000"]);
    println!("   set took {:?}", t.elapsed());
    done(job);
    let c = samples(&lc);
    // fio's clock starts when the job has set up, a little after the spawn (up to a second on a
    // loaded 2-core machine): the change lands at 4.5 s of wall time, so before 4.5 s on fio's
    // clock, and "1 s after" is 5.5 s on fio's clock or later. Both windows keep a margin.
    let before = rate(&c, 1000, 3000);
    let after = rate(&c, 5750, 8000);
    println!("   before {before:.0} IOPS, from 1 s after the change {after:.0} IOPS");
    assert!((before - 400.0).abs() <= 20.0, "{before:.1}");
    assert!((after - 1000.0).abs() <= 50.0, "the new limit holds from one second on: {after:.1}");
    let shown = d.json(&["volume", "show", "slow"]);
    assert_eq!(shown["limits"]["write_iops"], 1000, "{shown}");
    assert_eq!(shown["limits"]["burst_ms"], 250, "limits not named keep their value");

    println!("== limits survive a restart; errors are clear");
    let mut d = d;
    d.stop();
    let d = Daemon::start(dir.path());
    assert_eq!(d.json(&["volume", "show", "slow"])["limits"]["write_iops"], 1000);
    let bad = d.cli(&["volume", "set", "slow"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("at least one limit"));
    let bad = d.cli(&["volume", "set", "slow", "--burst", "forever"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("burst"));
    let bad = d.cli(&["volume", "set", "nope", "--iops", "1"]);
    assert!(!bad.status.success());
    d.ok(&["volume", "set", "slow", "--write-iops", "0"]);
    assert!(d.ok(&["volume", "show", "slow"]).contains("none"));
}
