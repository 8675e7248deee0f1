//! Runs the real `ferrite` binary: a daemon in a temporary data directory, and CLI calls.
#![allow(dead_code)]

pub mod csi;
pub mod images;
pub mod kube;
pub mod kubelet;
pub mod log_writes;
pub mod mirror;
pub mod nbd;
pub mod netns;
pub mod push;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub use ferrite_testkit::{have, pattern, skip};

pub const BIN: &str = env!("CARGO_BIN_EXE_ferrite");

pub struct Daemon {
    pub dir: PathBuf,
    pub child: Option<Child>,
}

impl Daemon {
    /// Starts a daemon on `dir` (small pool, 4 MiB segments) and waits until it answers.
    pub fn start(dir: &Path) -> Self {
        Self::start_in(dir, None)
    }

    /// The same inside network namespace `netns` (its admin socket stays reachable from here).
    pub fn start_in(dir: &Path, netns: Option<&str>) -> Self {
        let cfg = dir.join("ferrite.toml");
        if !cfg.exists() {
            std::fs::write(&cfg, "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\n").unwrap();
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("daemon.log")).unwrap();
        let mut cmd = match netns {
            // `ip netns exec` execs the daemon: the child is the daemon itself.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, BIN]);
                c
            }
            None => Command::new(BIN),
        };
        let child = cmd
            .args(["daemon", "--config"])
            .arg(&cfg)
            .arg("--data-dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let d = Self { dir: dir.to_path_buf(), child: Some(child) };
        let start = Instant::now();
        loop {
            if d.cli(&["pool", "status"]).status.success() {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "daemon did not come up: {}", d.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    pub fn admin(&self) -> PathBuf {
        self.dir.join("admin.sock")
    }

    pub fn nbd(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(BIN).arg("--admin-socket").arg(self.admin()).args(args).output().unwrap()
    }

    /// Runs a CLI command that must succeed; returns its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(o.status.success(), "ferrite {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    /// Runs a CLI command with `-o json` that must succeed; its output.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["-o", "json"];
        all.extend_from_slice(args);
        serde_json::from_str(&self.ok(&all)).unwrap()
    }

    /// `replica status NAME`.
    pub fn replica(&self, name: &str) -> serde_json::Value {
        self.json(&["replica", "status", name])
    }

    /// `snapshot diff IMAGE [--since SINCE]`: the ranges as (offset, length), as CSI's
    /// BlockMetadata types them.
    pub fn diff(&self, image: &str, since: Option<&str>) -> Vec<(i64, i64)> {
        let mut args = vec!["snapshot", "diff", image];
        args.extend(since.iter().flat_map(|s| ["--since", s]));
        let v = self.json(&args);
        let field = |r: &serde_json::Value, k: &str| r[k].as_i64().unwrap();
        v["ranges"].as_array().unwrap().iter().map(|r| (field(r, "offset"), field(r, "length"))).collect()
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        let sent = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        assert!(sent.success());
        child.wait().unwrap()
    }

    /// kill -9.
    pub fn crash(&mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    pub fn qemu_uri(&self, export: &str) -> String {
        format!("nbd:unix:{}:exportname={export}", self.nbd().display())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `len` pseudo-random bytes from `seed` (xorshift): the same seed, the same bytes.
/// GET /metrics at `addr` (host:port) over TLS with the CA `ca`, presenting `identity`
/// (certificate, key) if given: the whole HTTP response.
pub fn scrape_tls(addr: &str, ca: &Path, identity: Option<(&Path, &Path)>) -> std::io::Result<String> {
    scrape_tls_as(addr, addr, ca, identity)
}

/// [`scrape_tls`] of a server whose certificate names `name` rather than its address.
pub fn scrape_tls_as(addr: &str, name: &str, ca: &Path, identity: Option<(&Path, &Path)>) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let cfg = ferrite_tls::client_config(ca, identity, &[b"http/1.1"])?;
    let conn = ferrite_tls::rustls::ClientConnection::new(cfg, ferrite_tls::server_name(name)?)
        .map_err(std::io::Error::other)?;
    let mut tls = ferrite_tls::rustls::StreamOwned::new(conn, std::net::TcpStream::connect(addr)?);
    tls.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut text = String::new();
    tls.read_to_string(&mut text)?;
    Ok(text)
}

/// The pushing side's replica status once it has recorded the point the receiving side holds
/// (the receiver commits before the sender hears back).
pub fn settled(receiver: &Daemon, sender: &Daemon, name: &str) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let s = sender.replica(name);
        if s["last_snapshot"] == receiver.replica(name)["last_snapshot"] {
            return s;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the sender did not record the point: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `f` holds, failing the test after `secs` seconds with what did not happen.
pub fn until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < std::time::Duration::from_secs(secs), "{what} did not happen within {secs} s");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The value of the sample `line` starts with (name and labels) on the plain-HTTP metrics
/// listener at `port`.
pub fn metric(port: u16, line: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: ferrite\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines().find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
}
