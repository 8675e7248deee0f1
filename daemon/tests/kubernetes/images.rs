//! The OCI images `deploy/images.py` writes: the same inputs give the same digests; umoci (a
//! real consumer of the layout) unpacks each; its `ferrite` runs from the root file system
//! (chroot, as the image's user), a daemon serves from it, and the node image's staging tools
//! format and identify file systems; each goes through a real registry (Debian's
//! docker-registry, on loopback with TLS) with skopeo and comes back by digest, unchanged.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::have;
use common::images::{Registry, build, run, stripped};

const BIN: &str = env!("CARGO_BIN_EXE_ferrite");
const IMAGES: [&str; 2] = ["ferrite", "ferrite-controller"];

/// `args` run in `rootfs` as `user`, as a container runtime would start them: /proc and /dev
/// mounted, in a mount namespace of their own that ends with them.
fn chroot(rootfs: &Path, user: &str, args: &[&str]) -> Command {
    let script = r#"mount -t proc proc "$1/proc" && mount --bind /dev "$1/dev" && r=$1 u=$2 && shift 2 &&
        exec chroot --userspec="$u" "$r" "$@""#;
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "--fork", "sh", "-c", script, "sh"]).arg(rootfs).arg(user);
    c.args(args).env_clear().env("PATH", "/usr/sbin:/usr/bin");
    c
}

/// Kills every process whose root directory is `rootfs` (what a chroot started there).
fn kill_in(rootfs: &Path) {
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if e.file_name().to_str().is_some_and(|n| n.parse::<u32>().is_ok())
            && std::fs::read_link(e.path().join("root")).is_ok_and(|r| r == rootfs)
        {
            let _ = Command::new("kill").arg("-9").arg(e.file_name()).status();
        }
    }
}

/// A daemon started from the image's root file system, as the image's user, on a file pool in
/// its /data; the host's CLI talks to it over the admin socket there.
fn daemon_serves(rootfs: &Path, user: &str) {
    let data = rootfs.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("ferrite.toml"), "pool-size = \"256M\"\nsegment-size = \"4M\"\n").unwrap();
    let uid = user.split(':').next().unwrap();
    run(Command::new("chown").arg("-R").arg(format!("{uid}:{uid}")).arg(&data));
    let log = std::fs::File::create(rootfs.join("daemon.log")).unwrap();
    let child =
        chroot(rootfs, user, &["/usr/bin/ferrite", "daemon", "--config", "/data/ferrite.toml", "--data-dir", "/data"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
    let mut child = InRoot(rootfs.canonicalize().unwrap(), child);
    let cli = |args: &[&str]| {
        Command::new(BIN).arg("--admin-socket").arg(data.join("admin.sock")).args(args).output().unwrap()
    };
    let start = Instant::now();
    while !cli(&["pool", "status"]).status.success() {
        let log = std::fs::read_to_string(rootfs.join("daemon.log")).unwrap_or_default();
        assert!(child.1.try_wait().unwrap().is_none(), "the daemon in {} exited: {log}", rootfs.display());
        assert!(start.elapsed() < Duration::from_secs(60), "the daemon in {} did not come up: {log}", rootfs.display());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(cli(&["volume", "create", "v", "64M"]).status.success());
    let listed = String::from_utf8(cli(&["volume", "list"]).stdout).unwrap();
    assert!(listed.contains('v'), "{listed}");
}

/// What runs in a root file system, killed when dropped (the test passed or not).
struct InRoot(PathBuf, std::process::Child);

impl Drop for InRoot {
    fn drop(&mut self) {
        kill_in(&self.0);
        let _ = self.1.wait();
    }
}

/// The node image's staging tools work from its root file system.
fn tools_work(rootfs: &Path) {
    for (fs, mkfs) in
        [("ext4", &["mkfs.ext4", "-q", "-F", "/tmp/fs.img"][..]), ("xfs", &["mkfs.xfs", "-q", "-f", "/tmp/fs.img"])]
    {
        std::fs::File::create(rootfs.join("tmp/fs.img")).unwrap().set_len(320 << 20).unwrap();
        run(&mut chroot(rootfs, "0:0", mkfs));
        let said = run(&mut chroot(rootfs, "0:0", &["blkid", "-o", "value", "-s", "TYPE", "/tmp/fs.img"]));
        assert_eq!(said.trim(), fs);
    }
    for tool in ["mount", "umount", "blockdev", "fstrim", "resize2fs", "xfs_growfs"] {
        // Each starts: its loader finds every library it links (resize2fs has no -V and prints
        // its usage instead).
        let o = chroot(rootfs, "0:0", &[tool, "-V"]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("error while loading shared libraries") && !err.contains("not found"), "{tool}: {err}");
    }
}

#[test]
fn images_are_reproducible_run_from_their_rootfs_and_go_through_a_registry() {
    let root = run(Command::new("id").arg("-u")).trim() == "0";
    if !root {
        // chroot and the image's users need root; CI runs as root.
        return common::skip("images: unpacking and running images needs root", false);
    }
    if !(have("python3")
        && have("strip")
        && have("umoci")
        && have("skopeo")
        && have("docker-registry")
        && have("mkfs.xfs"))
    {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let binary = stripped(tmp.path());
    let first = build(&binary, &a, "test");
    assert_eq!(first.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), IMAGES);
    assert_eq!(build(&binary, &b, "test"), first, "two builds of the same inputs differ");
    println!("images: {first:?}");

    let version = run(Command::new(BIN).arg("--version"));
    let registry = Registry::start(tmp.path());
    for (name, digest) in &first {
        let layout = a.join(name);
        let bundle = tmp.path().join(format!("bundle-{name}"));
        run(Command::new("umoci").args(["unpack", "--image"]).arg(format!("{}:test", layout.display())).arg(&bundle));
        let rootfs = bundle.join("rootfs");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(bundle.join("config.json")).unwrap()).unwrap();
        let user = format!("{}:{}", config["process"]["user"]["uid"], config["process"]["user"]["gid"]);
        assert_eq!(user, if name == "ferrite" { "0:0" } else { "65532:65532" }, "{name} runs as");
        assert_eq!(config["process"]["args"][0], "/usr/bin/ferrite");
        assert_eq!(run(&mut chroot(&rootfs, &user, &["/usr/bin/ferrite", "--version"])), version);
        daemon_serves(&rootfs, &user);
        if name == "ferrite" {
            tools_work(&rootfs);
        }

        let repo = format!("ferrite/{name}");
        registry.push(&layout, "test", &repo);
        let held = registry.digest(&format!("{}/{repo}:test", registry.at));
        assert_eq!(&held, digest, "the registry holds {name} under another digest");
        let back = tmp.path().join(format!("pulled-{name}"));
        let pulled = registry.pull(&format!("{}/{repo}@{digest}", registry.at), &back);
        assert!(pulled.join("usr/bin/ferrite").exists());
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(back.join("index.json")).unwrap()).unwrap();
        assert_eq!(index["manifests"][0]["digest"], digest.as_str(), "pulled back by digest, {name} changed");
    }
}
