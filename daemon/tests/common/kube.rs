//! A real Kubernetes control plane as plain processes (etcd, kube-apiserver,
//! kube-controller-manager; no scheduler, no kubelet), for the Kubernetes tier. The binaries
//! come from `FERRITE_K8S_BIN` (scripts/test.sh builds them from ../shared/k8s, once).
//! Everything lives under one test directory and stops when the value is dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::csi::free_port;

pub struct ControlPlane {
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub server: String,
    pub admin: PathBuf,
    procs: Vec<(String, Child)>,
}

/// The binaries' directory, or None (the test skips, saying how to provide them).
pub fn binaries() -> Option<PathBuf> {
    let Some(dir) = std::env::var_os("FERRITE_K8S_BIN").map(PathBuf::from) else {
        super::skip(
            "Kubernetes tier: FERRITE_K8S_BIN names no directory of Kubernetes binaries (scripts/test.sh \
             builds them from ../shared/k8s; elsewhere set FERRITE_K8S_BIN to a directory with mini-etcd, \
             kube-apiserver, kube-controller-manager and the CSI sidecars, and FERRITE_K8S to one with \
             their crds/ and rbac/)",
            [concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/k8s"), "/work/shared/k8s"]
                .iter()
                .any(|d| Path::new(d).join("build.sh").exists()),
        );
        return None;
    };
    if Command::new("kubectl").arg("version").arg("--client").output().is_err() {
        super::skip("Kubernetes tier: no kubectl on this machine", false);
        return None;
    }
    Some(dir)
}

fn openssl(args: &[&str]) {
    let o = Command::new("openssl").args(args).output().expect("openssl");
    assert!(o.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

/// Issues `<pki>/<name>.crt` (and its key) from the CA in `pki` for subject `subj`, with the
/// subjectAltNames `sans` (openssl's syntax).
fn issue(pki: &Path, name: &str, subj: &str, sans: Option<&str>) {
    let p = |f: &str| pki.join(f).display().to_string();
    openssl(
        &["req", "-newkey", "rsa:2048", "-nodes", "-keyout", &p(&format!("{name}.key"))]
            .into_iter()
            .chain(["-subj", subj, "-out", &p(&format!("{name}.csr"))])
            .collect::<Vec<_>>(),
    );
    let ext = pki.join(format!("{name}.ext"));
    std::fs::write(&ext, sans.map(|s| format!("subjectAltName={s}\n")).unwrap_or_default()).unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &p(&format!("{name}.csr")),
        "-CA",
        &p("ca.crt"),
        "-CAkey",
        &p("ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &ext.display().to_string(),
        "-out",
        &p(&format!("{name}.crt")),
    ]);
}

/// A kubeconfig for `server`: a client certificate, or a bearer token.
pub fn kubeconfig(path: &Path, server: &str, ca: &Path, user: &str) -> PathBuf {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    \
         certificate-authority: {}\ncontexts:\n- name: test\n  context: {{cluster: test, user: u}}\n\
         current-context: test\nusers:\n- name: u\n  user:\n{user}\n",
        ca.display()
    );
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

impl ControlPlane {
    /// `also`: another address of this machine (a network's gateway) on which processes in
    /// other network namespaces reach the API server.
    pub fn start(dir: &Path, bin: &Path, also: Option<&str>) -> Self {
        Self::start_with(dir, bin, also, false)
    }

    /// The same, with the DaemonSet controller on where `daemon_sets` (for a test that binds and
    /// readies the pods it makes itself).
    pub fn start_with(dir: &Path, bin: &Path, also: Option<&str>, daemon_sets: bool) -> Self {
        let pki = dir.join("kpki");
        std::fs::create_dir_all(&pki).unwrap();
        let p = |f: &str| pki.join(f).display().to_string();
        openssl(
            &["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", &p("ca.key"), "-out", &p("ca.crt")]
                .into_iter()
                .chain(["-subj", "/CN=ferrite-test-ca", "-days", "2"])
                .collect::<Vec<_>>(),
        );
        let issue = |name: &str, subj: &str, sans: Option<&str>| issue(&pki, name, subj, sans);
        issue(
            "apiserver",
            "/CN=kube-apiserver",
            Some(&format!(
                "IP:127.0.0.1,IP:10.0.0.1,DNS:kubernetes.default.svc,DNS:localhost{}",
                also.map(|a| format!(",IP:{a}")).unwrap_or_default()
            )),
        );
        issue("admin", "/O=system:masters/CN=admin", None);
        issue("kcm", "/CN=system:kube-controller-manager", None);
        openssl(&["genrsa", "-out", &p("sa.key"), "2048"]);
        openssl(&["rsa", "-in", &p("sa.key"), "-pubout", "-out", &p("sa.pub")]);

        let ip = "127.0.0.1";
        let (etcd, peer, api, kcm) = (free_port(ip), free_port(ip), free_port(ip), free_port(ip));
        let server = format!("https://127.0.0.1:{api}");
        let cert_user = |n: &str| {
            format!("    client-certificate: {}\n    client-key: {}", p(&format!("{n}.crt")), p(&format!("{n}.key")))
        };
        let admin = kubeconfig(&dir.join("admin.kubeconfig"), &server, &pki.join("ca.crt"), &cert_user("admin"));
        let kcm_cfg = kubeconfig(&dir.join("kcm.kubeconfig"), &server, &pki.join("ca.crt"), &cert_user("kcm"));
        let mut cp = Self { dir: dir.to_path_buf(), bin: bin.to_path_buf(), server, admin, procs: Vec::new() };
        cp.spawn(
            "etcd",
            "mini-etcd",
            &[
                "-data-dir",
                &dir.join("etcd").display().to_string(),
                "-listen-client-urls",
                &format!("http://127.0.0.1:{etcd}"),
                "-listen-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
            ],
            &[],
        );
        cp.spawn(
            "apiserver",
            "kube-apiserver",
            &[
                &format!("--etcd-servers=http://127.0.0.1:{etcd}"),
                // Every address when others must reach it (it takes one bind address).
                if also.is_some() { "--bind-address=0.0.0.0" } else { "--bind-address=127.0.0.1" },
                "--advertise-address=127.0.0.1",
                &format!("--secure-port={api}"),
                &format!("--tls-cert-file={}", p("apiserver.crt")),
                &format!("--tls-private-key-file={}", p("apiserver.key")),
                &format!("--client-ca-file={}", p("ca.crt")),
                &format!("--service-account-key-file={}", p("sa.pub")),
                &format!("--service-account-signing-key-file={}", p("sa.key")),
                "--service-account-issuer=https://kubernetes.default.svc",
                "--allow-privileged=true",
                "--authorization-mode=Node,RBAC",
                // What every production cluster runs: a kubelet's credentials reach its own Node
                // and the pods bound to it, no other (the tier attacks as a node).
                "--enable-admission-plugins=NodeRestriction",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--enable-priority-and-fairness=false",
                // Webhooks reached through their Service's endpoints: there is no kube-proxy here.
                "--enable-aggregator-routing=true",
                &format!("--cert-dir={}", dir.join("apiserver-certs").display()),
            ],
            &[],
        );
        cp.wait("the API server to be ready", Duration::from_secs(90), |cp| {
            cp.kubectl(&["get", "--raw", "/readyz"]).stdout.starts_with(b"ok")
        });
        let kcm_cfg = kcm_cfg.display().to_string();
        // No kubelet and no scheduler: the controllers that would act on their absence (node
        // lifecycle evictions) or run pods (daemon sets unless asked, deployments, replica sets)
        // are off; the test stands in for the scheduler and kubelet where the driver needs them.
        cp.spawn(
            "controller-manager",
            "kube-controller-manager",
            &[
                &format!("--kubeconfig={kcm_cfg}"),
                &format!("--authentication-kubeconfig={kcm_cfg}"),
                &format!("--authorization-kubeconfig={kcm_cfg}"),
                "--leader-elect=false",
                &format!("--service-account-private-key-file={}", p("sa.key")),
                &format!("--root-ca-file={}", p("ca.crt")),
                "--use-service-account-credentials=true",
                "--bind-address=127.0.0.1",
                &format!("--secure-port={kcm}"),
                &format!(
                    "--controllers=*,-node-lifecycle-controller,{}-deployment-controller,-replicaset-controller",
                    if daemon_sets { "" } else { "-daemonset-controller," }
                ),
            ],
            &[],
        );
        cp
    }

    /// Starts `program` (a name in the binaries' directory, or a path) with its log in
    /// `<dir>/<name>.log`.
    pub fn spawn(&mut self, name: &str, program: &str, args: &[&str], env: &[(&str, &str)]) {
        let exe = if program.contains('/') { PathBuf::from(program) } else { self.bin.join(program) };
        self.spawn_cmd(name, Command::new(exe).args(args).envs(env.iter().copied()));
    }

    pub fn spawn_cmd(&mut self, name: &str, cmd: &mut Command) {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).unwrap();
        let child = cmd.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap();
        self.procs.push((name.to_owned(), child));
    }

    /// Starts `cmd` as a pod's container would see the API: in a private mount namespace whose
    /// /run holds ServiceAccount `ns/sa`'s token and the cluster CA where client-go's in-cluster
    /// configuration reads them, and KUBERNETES_SERVICE_HOST/PORT naming the server (some
    /// sidecars know no other way to the API).
    /// `netns`: the network namespace it runs in, and the address there it reaches the API
    /// server at (see [`ControlPlane::start`]).
    pub fn spawn_in_pod(&mut self, name: &str, cmd: &Command, ns: &str, sa: &str, netns: Option<(&str, &str)>) {
        self.spawn_with_token(name, cmd, ns, &["create", "token", sa, "-n", ns, "--duration=2h"], netns);
    }

    /// The same with the token the kubelet projects into pod `pod` (name, uid): bound to it, so
    /// that the API server knows the pod and its node from it.
    pub fn spawn_in_bound_pod(
        &mut self,
        name: &str,
        cmd: &Command,
        (ns, sa): (&str, &str),
        (pod, uid): (&str, &str),
        netns: Option<(&str, &str)>,
    ) {
        let (pod, uid) = (format!("--bound-object-name={pod}"), format!("--bound-object-uid={uid}"));
        let args = ["create", "token", sa, "-n", ns, "--duration=2h", "--bound-object-kind=Pod", &pod, &uid];
        self.spawn_with_token(name, cmd, ns, &args, netns);
    }

    fn spawn_with_token(&mut self, name: &str, cmd: &Command, ns: &str, create: &[&str], netns: Option<(&str, &str)>) {
        let account = self.dir.join(format!("{name}.serviceaccount"));
        std::fs::create_dir_all(&account).unwrap();
        let token = self.ok(create);
        std::fs::write(account.join("token"), token.trim()).unwrap();
        std::fs::write(account.join("namespace"), ns).unwrap();
        std::fs::copy(self.dir.join("kpki/ca.crt"), account.join("ca.crt")).unwrap();
        let port = self.server.rsplit(':').next().unwrap().to_owned();
        // In the namespace first: `ip netns exec` finds it under /run, which the pod's tmpfs hides.
        let mut wrapped = match netns {
            Some((n, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", n, "unshare"]);
                c
            }
            None => Command::new("unshare"),
        };
        wrapped
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(
                "mount -t tmpfs tmpfs /run && mkdir -p /run/secrets/kubernetes.io && \
                 cp -r \"$0\" /run/secrets/kubernetes.io/serviceaccount && \
                 chmod -R a+rX /run/secrets && exec \"$@\"",
            )
            .arg(&account)
            .arg(cmd.get_program())
            .args(cmd.get_args())
            .envs(cmd.get_envs().filter_map(|(k, v)| Some((k, v?))))
            .env("KUBERNETES_SERVICE_HOST", netns.map_or("127.0.0.1", |(_, at)| at))
            .env("KUBERNETES_SERVICE_PORT", port);
        self.spawn_cmd(name, &mut wrapped);
    }

    /// Kills (SIGKILL) and forgets the processes whose names start with `prefix`.
    pub fn kill(&mut self, prefix: &str) {
        for (_, c) in self.procs.iter_mut().filter(|(n, _)| n.starts_with(prefix)) {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.procs.retain(|(n, _)| !n.starts_with(prefix));
    }

    /// The pid of process `name`.
    pub fn pid(&self, name: &str) -> u32 {
        self.procs.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no process {name}")).1.id()
    }

    /// The log of a process started with `spawn`.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    pub fn names(&self) -> Vec<String> {
        self.procs.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Panics (with every log's tail) if a process has exited.
    pub fn check_alive(&mut self) {
        for (name, c) in &mut self.procs {
            if let Ok(Some(st)) = c.try_wait() {
                let log = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
                let tail: String =
                    log.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
                panic!("{name} exited ({st}):\n{tail}");
            }
        }
    }

    pub fn kubectl(&self, args: &[&str]) -> Output {
        Command::new("kubectl").arg("--kubeconfig").arg(&self.admin).args(args).output().unwrap()
    }

    /// kubectl that must succeed: its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.kubectl(args);
        assert!(o.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    /// kubectl ARGS -o json.
    pub fn get(&self, args: &[&str]) -> Value {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        serde_json::from_str(&self.ok(&all)).unwrap()
    }

    /// `kubectl patch KIND NAME --type=merge -p PATCH`.
    pub fn merge_patch(&self, kind: &str, name: &str, patch: &str) -> String {
        self.ok(&["patch", kind, name, "--type=merge", "-p", patch])
    }

    /// `kubectl apply -f -` of a YAML or JSON text.
    pub fn apply(&self, text: &str) -> String {
        self.with_stdin(&["apply", "-f", "-"], text)
    }

    pub fn with_stdin(&self, args: &[&str], text: &str) -> String {
        use std::io::Write as _;
        let mut c = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.admin)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "kubectl {args:?}: {}\n{text}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    /// kubectl with the credentials of kubeconfig `kc` (another user than the admin).
    pub fn kubectl_as(&self, kc: &Path, args: &[&str]) -> Output {
        Command::new("kubectl").arg("--kubeconfig").arg(kc).args(args).output().unwrap()
    }

    /// A kubeconfig with what node `node`'s kubelet holds: a client certificate of the cluster's
    /// CA for `system:node:<node>` in group `system:nodes` (what the Node authorizer and
    /// NodeRestriction admit to its own Node and pods).
    pub fn node_kubeconfig(&self, node: &str) -> PathBuf {
        let pki = self.dir.join("kpki");
        let name = format!("kubelet-{node}");
        issue(&pki, &name, &format!("/O=system:nodes/CN=system:node:{node}"), None);
        let p = |f: &str| pki.join(f).display().to_string();
        let (crt, key) = (p(&format!("{name}.crt")), p(&format!("{name}.key")));
        let user = format!("    client-certificate: {crt}\n    client-key: {key}");
        kubeconfig(&self.dir.join(format!("kubelet-{node}.kubeconfig")), &self.server, &pki.join("ca.crt"), &user)
    }

    /// A kubeconfig with a fresh token of ServiceAccount `ns/sa`, for one process.
    pub fn token_kubeconfig(&self, ns: &str, sa: &str, file: &str) -> PathBuf {
        self.kubeconfig_for(&["create", "token", sa, "-n", ns, "--duration=2h"], file)
    }

    /// The same, with the token bound to pod `name` (uid `uid`) as the kubelet projects a pod's
    /// token: the API server then records the pod and its node with every request it makes.
    pub fn pod_token_kubeconfig(&self, ns: &str, sa: &str, name: &str, uid: &str, file: &str) -> PathBuf {
        let (name, uid) = (format!("--bound-object-name={name}"), format!("--bound-object-uid={uid}"));
        let args = ["create", "token", sa, "-n", ns, "--duration=2h", "--bound-object-kind=Pod", &name, &uid];
        self.kubeconfig_for(&args, file)
    }

    fn kubeconfig_for(&self, create_token: &[&str], file: &str) -> PathBuf {
        let token = self.ok(create_token);
        let ca = self.dir.join("kpki/ca.crt");
        kubeconfig(&self.dir.join(file), &self.server, &ca, &format!("    token: {}", token.trim()))
    }

    /// Polls `f` until it holds; panics after `limit` with what it waited for.
    pub fn wait(&mut self, what: &str, limit: Duration, mut f: impl FnMut(&mut Self) -> bool) {
        let start = Instant::now();
        loop {
            if f(self) {
                return;
            }
            self.check_alive();
            if start.elapsed() > limit {
                let events = String::from_utf8_lossy(&self.kubectl(&["get", "events", "-A"]).stdout).into_owned();
                let tail: Vec<&str> = events.lines().rev().take(25).collect();
                panic!("timed out after {limit:?} waiting for {what}; the newest events:\n{}", tail.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // The driver's processes first, the API server and etcd last.
        for (_, c) in self.procs.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The version of each sidecar image the kit builds (`V_*=` in its build.sh), by image name:
/// the tags the manifests must name.
pub fn sidecar_versions(build_sh: &str) -> Vec<(&'static str, String)> {
    let version = |var: &str| {
        let line = build_sh.lines().find(|l| l.starts_with(&format!("{var}="))).unwrap_or_else(|| panic!("{var}"));
        let v = line.split_once('=').unwrap().1.split_whitespace().next().unwrap();
        v.split('-').next().unwrap().to_owned()
    };
    [
        ("csi-provisioner", "V_PROV"),
        ("csi-attacher", "V_ATT"),
        ("csi-resizer", "V_RES"),
        ("csi-snapshotter", "V_SNAP"),
        ("csi-snapshot-metadata", "V_SMD"),
        ("csi-node-driver-registrar", "V_REG"),
        ("livenessprobe", "V_LIVE"),
        ("k8s-sidecar", "V_ADDONS"),
    ]
    .into_iter()
    .map(|(image, var)| (image, version(var)))
    .collect()
}
