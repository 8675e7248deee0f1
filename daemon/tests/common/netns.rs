//! Two hosts for multi-host tests: two network namespaces joined by a veth pair, each end with
//! its own address, made by the test and removed when it ends. Nothing leaves the machine.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use super::Daemon;

/// The two namespaces, their ends of the link and addresses.
pub struct Hosts {
    pub ns: [String; 2],
    pub dev: [String; 2],
    pub ip: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if o.status.success() { Ok(()) } else { Err(format!("ip {args:?}: {}", String::from_utf8_lossy(&o.stderr))) }
}

impl Hosts {
    /// Makes the pair; None (and the test skips) where namespaces cannot be made: not root, or
    /// no iproute2 (a kernel or privilege matter, not something the suite installs).
    pub fn new() -> Option<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!("f{}x{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed));
        let subnet = 10 + std::process::id() % 200;
        let n = N.load(Ordering::Relaxed) % 250;
        let h = Self {
            ns: [format!("{tag}a"), format!("{tag}b")],
            dev: [format!("{tag}a"), format!("{tag}b")],
            ip: [format!("10.{subnet}.{n}.1"), format!("10.{subnet}.{n}.2")],
        };
        let made = (|| {
            for ns in &h.ns {
                ip(&["netns", "add", ns])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
            }
            ip(&["link", "add", &h.dev[0], "type", "veth", "peer", "name", &h.dev[1]])?;
            for i in 0..2 {
                ip(&["link", "set", &h.dev[i], "netns", &h.ns[i]])?;
                ip(&["-n", &h.ns[i], "addr", "add", &format!("{}/24", h.ip[i]), "dev", &h.dev[i]])?;
                ip(&["-n", &h.ns[i], "link", "set", &h.dev[i], "up"])?;
            }
            Ok::<_, String>(())
        })();
        match made {
            Ok(()) => Some(h),
            Err(e) => {
                super::skip(&format!("network namespaces cannot be made here ({e})"), false);
                None
            }
        }
    }
}

impl Nics for Hosts {
    fn nic(&self, i: usize) -> (&str, &str, &str) {
        (&self.ns[i], &self.dev[i], &self.ip[i])
    }

    fn daemon(&self, i: usize, root: &Path, extra: &str) -> Daemon {
        host_daemon(root, &self.ns, &self.ip, i, extra)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and the pair with it.
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Several hosts on one network: one namespace holding every host's address on its end of a
/// veth pair whose other end (the gateway address) is in this namespace, so processes here
/// (a control plane, a CSI controller) reach each host and the hosts reach each other.
pub struct Lan {
    pub ns: String,
    pub dev: [String; 2],
    pub gateway: String,
    pub hosts: Vec<String>,
}

impl Lan {
    pub fn new(hosts: usize) -> Option<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!("fl{}x{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed));
        // Test processes run side by side: one at a time picks a subnet no other LAN's gateway
        // holds here, and adds its gateway address before the next one looks.
        let lock = std::fs::OpenOptions::new().create(true).append(true).open("/tmp/ferrite-test-lan.lock").ok()?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).ok()?;
        let used = Command::new("ip").args(["-o", "-4", "addr", "show"]).output().ok()?;
        let used = String::from_utf8_lossy(&used.stdout).into_owned();
        let subnet =
            (0..200).map(|i| 10 + (std::process::id() + i) % 200).find(|s| !used.contains(&format!(" 10.{s}.251.")))?;
        let net = |i: usize| format!("10.{subnet}.251.{i}");
        let lan = Self {
            ns: tag.clone(),
            dev: [format!("{tag}o"), format!("{tag}i")],
            gateway: net(1),
            hosts: (0..hosts).map(|i| net(i + 2)).collect(),
        };
        let made = (|| {
            ip(&["netns", "add", &lan.ns])?;
            ip(&["-n", &lan.ns, "link", "set", "lo", "up"])?;
            ip(&["link", "add", &lan.dev[0], "type", "veth", "peer", "name", &lan.dev[1]])?;
            ip(&["link", "set", &lan.dev[1], "netns", &lan.ns])?;
            ip(&["addr", "add", &format!("{}/24", lan.gateway), "dev", &lan.dev[0]])?;
            ip(&["link", "set", &lan.dev[0], "up"])?;
            for h in &lan.hosts {
                ip(&["-n", &lan.ns, "addr", "add", &format!("{h}/24"), "dev", &lan.dev[1]])?;
            }
            ip(&["-n", &lan.ns, "link", "set", &lan.dev[1], "up"])?;
            Ok::<_, String>(())
        })();
        match made {
            Ok(()) => Some(lan),
            Err(e) => {
                drop(lan);
                super::skip(&format!("network namespaces cannot be made here ({e})"), false);
                None
            }
        }
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.ns]);
        let _ = ip(&["link", "del", &self.dev[0]]);
    }
}

/// Several hosts, each in its own namespace, plugged into one switch (a bridge in a namespace
/// of its own) by a veth pair: a host's cable can be cut alone (its end down), a pair of hosts
/// kept apart (a blackhole route on each side). This namespace is plugged in too (`gateway`), so a test can call the hosts itself.
pub struct Switch {
    pub ns: Vec<String>,
    pub dev: Vec<String>,
    pub ip: Vec<String>,
    pub gateway: String,
    hub: String,
}

impl Switch {
    pub fn new(hosts: usize) -> Option<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let tag = format!("fs{}x{n}", std::process::id() % 100_000);
        // As for a LAN: one test process at a time picks a subnet no gateway here holds.
        let lock = std::fs::OpenOptions::new().create(true).append(true).open("/tmp/ferrite-test-lan.lock").ok()?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).ok()?;
        let used = Command::new("ip").args(["-o", "-4", "addr", "show"]).output().ok()?;
        let used = String::from_utf8_lossy(&used.stdout).into_owned();
        let net = (0..200u32)
            .map(|i| format!("10.{}.{}", 10 + (std::process::id() + i) % 200, 100 + n % 100))
            .find(|net| !used.contains(&format!(" {net}.")))?;
        let sw = Self {
            ns: (0..hosts).map(|i| format!("{tag}h{i}")).collect(),
            dev: (0..hosts).map(|i| format!("{tag}h{i}")).collect(),
            ip: (0..hosts).map(|i| format!("{net}.{}", i + 1)).collect(),
            gateway: format!("{net}.254"),
            hub: format!("{tag}sw"),
        };
        let made = (|| {
            ip(&["netns", "add", &sw.hub])?;
            ip(&["-n", &sw.hub, "link", "add", "br0", "type", "bridge"])?;
            ip(&["-n", &sw.hub, "link", "set", "br0", "up"])?;
            let gw = format!("{tag}g");
            ip(&["link", "add", &gw, "type", "veth", "peer", "name", "pg", "netns", &sw.hub])?;
            ip(&["addr", "add", &format!("{}/24", sw.gateway), "dev", &gw])?;
            ip(&["link", "set", &gw, "up"])?;
            ip(&["-n", &sw.hub, "link", "set", "pg", "master", "br0"])?;
            ip(&["-n", &sw.hub, "link", "set", "pg", "up"])?;
            for i in 0..hosts {
                let (ns, dev, port) = (&sw.ns[i], &sw.dev[i], format!("p{i}"));
                ip(&["netns", "add", ns])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
                ip(&["link", "add", dev, "netns", ns, "type", "veth", "peer", "name", &port, "netns", &sw.hub])?;
                ip(&["-n", ns, "addr", "add", &format!("{}/24", sw.ip[i]), "dev", dev])?;
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", &sw.hub, "link", "set", &port, "master", "br0"])?;
                ip(&["-n", &sw.hub, "link", "set", &port, "up"])?;
            }
            Ok::<_, String>(())
        })();
        match made {
            Ok(()) => Some(sw),
            Err(e) => {
                drop(sw);
                super::skip(&format!("network namespaces cannot be made here ({e})"), false);
                None
            }
        }
    }

    /// Keeps hosts `a` and `b` apart (each drops what it would send the other), or lets them
    /// talk again.
    pub fn part(&self, a: usize, b: usize, apart: bool) {
        for (x, y) in [(a, b), (b, a)] {
            let dst = format!("{}/32", self.ip[y]);
            ip(&["-n", &self.ns[x], "route", if apart { "add" } else { "del" }, "blackhole", &dst]).unwrap();
        }
    }
}

impl Nics for Switch {
    fn nic(&self, i: usize) -> (&str, &str, &str) {
        (&self.ns[i], &self.dev[i], &self.ip[i])
    }

    fn daemon(&self, i: usize, root: &Path, extra: &str) -> Daemon {
        host_daemon(root, &self.ns, &self.ip, i, extra)
    }
}

/// What a test does with the hosts of [`Hosts`] and [`Switch`]: host `i` is namespace `ns`,
/// plugged in by its veth end `dev`, at address `ip`.
pub trait Nics {
    /// Host `i`'s namespace, device and address.
    fn nic(&self, i: usize) -> (&str, &str, &str);

    /// A daemon on host `i`: its admin API on `<ip>:7070` with mutual TLS (certificates
    /// `host-<i>` from one CA in `<root>/pki`), `extra` added to its configuration.
    fn daemon(&self, i: usize, root: &Path, extra: &str) -> Daemon;

    /// Host `i`'s cable: cut (down) or back (up).
    fn link(&self, i: usize, up: bool) {
        let (ns, dev, _) = self.nic(i);
        ip(&["-n", ns, "link", "set", dev, if up { "up" } else { "down" }]).unwrap();
    }

    /// Bytes host `i` has sent on its cable.
    fn sent(&self, i: usize) -> u64 {
        let (ns, dev, _) = self.nic(i);
        let p = format!("/sys/class/net/{dev}/statistics/tx_bytes");
        let o = Command::new("ip").args(["netns", "exec", ns, "cat", &p]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
    }

    /// Host `i`'s admin endpoint, as the other hosts reach it.
    fn endpoint(&self, i: usize) -> String {
        format!("tcp://{}:7070", self.nic(i).2)
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        // The gateway's pair goes with the switch's namespace.
        for ns in self.ns.iter().chain([&self.hub]) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// A daemon on host `i` of hosts in namespaces `ns` with addresses `ip`: its admin API on
/// `<ip>:7070` with mutual TLS (certificates `host-<i>` from one CA in `<root>/pki`), every host
/// a replication peer and NBD client, `extra` added to its configuration.
fn host_daemon(root: &Path, ns: &[String], ips: &[String], i: usize, extra: &str) -> Daemon {
    let dir = root.join(&ns[i]);
    std::fs::create_dir_all(&dir).unwrap();
    let pki = root.join("pki");
    let name = format!("host-{i}");
    super::csi::certs(&pki, &name, &[&ips[i]]);
    let p = |f: &str| pki.join(f).display().to_string();
    let roles: String = (0..ns.len())
        .map(|h| format!("\"host-{h}\" = [\"replication-peer\", \"nbd-client\", \"metrics\"]\n"))
        .collect();
    let cfg = format!(
        "pool-size = \"2G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\nadmin-listen = \"{}:7070\"\n\
         tls-cert = {:?}\ntls-key = {:?}\ntls-client-ca = {:?}\n{extra}\n[roles]\n{roles}",
        ips[i],
        p(&format!("{name}.pem")),
        p(&format!("{name}-key.pem")),
        p("ca.pem")
    );
    std::fs::write(dir.join("ferrite.toml"), cfg).unwrap();
    Daemon::start_in(&dir, Some(&ns[i]))
}
