//! Ferrite's images as the tests build, serve and pull them: `deploy/images.py` over the test
//! build's binary, Debian's docker-registry on a loopback port with TLS, skopeo and umoci.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::BIN;

pub fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{cmd:?} failed:\n{out}\n{err}");
    out.into_owned()
}

/// The test build's binary without its debug information (a tenth of the size), as a release
/// build is, at `dir`/ferrite.
pub fn stripped(dir: &Path) -> PathBuf {
    let binary = dir.join("ferrite");
    run(Command::new("strip").arg("--strip-debug").arg("-o").arg(&binary).arg(BIN));
    binary
}

/// Writes the images of `binary` to `out`, tagged `tag`; (name, digest) per image as the
/// script prints them.
pub fn build(binary: &Path, out: &Path, tag: &str) -> Vec<(String, String)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/images.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script).arg("--binary").arg(binary).args(["--tag", tag]).arg("--out").arg(out);
    // A fixed time: two builds must not depend on when they ran.
    let text = run(cmd.env("SOURCE_DATE_EPOCH", "1767225600"));
    text.lines().map(|l| l.split_once(' ').map(|(n, d)| (n.to_owned(), d.to_owned())).unwrap()).collect()
}

/// Debian's docker-registry on a loopback port with TLS (a test CA's certificate).
pub struct Registry {
    child: std::process::Child,
    /// HOST:PORT.
    pub at: String,
    /// The CA for skopeo's --*-cert-dir (its "*.crt" files are CAs).
    pub certs: PathBuf,
}

impl Registry {
    pub fn start(dir: &Path) -> Self {
        let pki = dir.join("pki-registry");
        super::csi::certs(&pki, "registry", &["127.0.0.1"]);
        let port = super::csi::free_port("127.0.0.1");
        let at = format!("127.0.0.1:{port}");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog: {{level: warn}}\nstorage:\n  filesystem: {{rootdirectory: {}}}\n\
                 http:\n  addr: {at}\n  secret: ferrite-test-{port}\n  tls: {{certificate: {}, key: {}}}\n",
                dir.join("registry").display(),
                pki.join("registry.pem").display(),
                pki.join("registry-key.pem").display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let certs = dir.join("certs.d");
        std::fs::create_dir_all(&certs).unwrap();
        std::fs::copy(pki.join("ca.pem"), certs.join("ca.crt")).unwrap();
        super::until("the registry to listen", 30, || std::net::TcpStream::connect(&at).is_ok());
        Self { child, at, certs }
    }

    /// Pushes the layout `layout` (tag `tag`) as `docker://AT/repo:tag`.
    pub fn push(&self, layout: &Path, tag: &str, repo: &str) {
        let to = format!("docker://{}/{repo}:{tag}", self.at);
        let certs = self.certs.display().to_string();
        run(Command::new("skopeo")
            .args(["copy", "--dest-cert-dir", &certs])
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(to));
    }

    /// The digest the registry holds `reference` (`AT/repo:tag`) under.
    pub fn digest(&self, reference: &str) -> String {
        let certs = self.certs.display().to_string();
        let said = run(Command::new("skopeo")
            .args(["inspect", "--cert-dir", &certs, "--format", "{{.Digest}}"])
            .arg(format!("docker://{reference}")));
        said.trim().to_owned()
    }

    /// Pulls `AT/repo@digest` into the layout `out` (tag `pulled`) and unpacks it into
    /// `out`-bundle with umoci; returns the root file system.
    pub fn pull(&self, repo_at_digest: &str, out: &Path) -> PathBuf {
        let certs = self.certs.display().to_string();
        run(Command::new("skopeo")
            .args(["copy", "--src-cert-dir", &certs])
            .arg(format!("docker://{repo_at_digest}"))
            .arg(format!("oci:{}:pulled", out.display())));
        let bundle = out.with_extension("bundle");
        run(Command::new("umoci").args(["unpack", "--image"]).arg(format!("{}:pulled", out.display())).arg(&bundle));
        bundle.join("rootfs")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
