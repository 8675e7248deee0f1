//! What the scheduler, the DaemonSet controller and the kubelet do for the Kubernetes tier's
//! pods, as far as the driver depends on it: a pod object bound to its node and reported
//! running; its volumes made on the node (hostPath under the node's root, ConfigMap and Secret
//! files read from the API and written with the volume's mode and the pod's fsGroup, emptyDir);
//! each container's command with its environment resolved and run as the user and groups its
//! securityContext gives, in the node's network namespace.
//!
//! There are no mount namespaces here: a path inside the pod is rewritten to the host directory
//! that stands for it, in arguments, environment values and ConfigMap files alike. Programs are
//! hard-linked into the test directory, so a process that is not root can run them (the build
//! lives under root's home).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

use super::kube::ControlPlane;

/// A node: its name, the directory standing for its root file system, its address and its
/// network namespace.
#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub root: PathBuf,
    pub ip: String,
    pub netns: String,
}

impl Node {
    /// The host directory for `path` on this node (devices and sysfs are the machine's own).
    pub fn host(&self, path: &str) -> PathBuf {
        if ["/dev", "/sys"].contains(&path) {
            PathBuf::from(path)
        } else {
            self.root.join(path.trim_start_matches('/'))
        }
    }
}

/// A running pod: its object, its node and where each of its volumes is.
pub struct Pod {
    pub value: Value,
    pub node: Node,
    /// The pod template it was made from (a changed template means a new pod, for a DaemonSet
    /// that rolls).
    pub template: Value,
    volumes: BTreeMap<String, PathBuf>,
    /// Where the control plane keeps its processes' logs.
    logs: PathBuf,
}

const NS_LABEL: &str = "metadata.namespace";

/// Mode bits the kubelet adds to a Secret's or ConfigMap's files for an fsGroup (read-only
/// volumes: the group may read).
const FS_GROUP_READ: u32 = 0o440;

impl Pod {
    /// Creates pod `name` of namespace `ns` from `template` on `node` (as the scheduler binds it),
    /// makes its volumes and sets its status as the kubelet would once it runs.
    pub fn run(
        cp: &ControlPlane,
        ns: &str,
        name: &str,
        template: &Value,
        node: &Node,
        owner: Option<Value>,
        pod_ip: &str,
    ) -> Self {
        let mut spec = template["spec"].clone();
        spec["nodeName"] = json!(node.name);
        let mut meta = json!({"name": name, "namespace": ns, "labels": template["metadata"]["labels"]});
        if let Some(o) = owner {
            meta["ownerReferences"] = json!([o]);
        }
        cp.apply(&json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}).to_string());
        let host_ip = &node.ip;
        let now = "2026-01-01T00:00:00Z";
        let status = json!({"status": {"phase": "Running", "hostIP": host_ip, "hostIPs": [{"ip": host_ip}],
            "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": now}]}});
        cp.ok(&["patch", "pod", name, "-n", ns, "--subresource=status", "--type=merge", "-p", &status.to_string()]);
        let value = cp.get(&["pod", name, "-n", ns]);
        let dir = cp.dir.join("pods").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        open_up(&dir);
        let mut pod = Self {
            value,
            node: node.clone(),
            template: template.clone(),
            volumes: BTreeMap::new(),
            logs: cp.dir.clone(),
        };
        pod.make_volumes(cp, &dir.join("volumes"));
        pod
    }

    fn spec(&self) -> &Value {
        &self.value["spec"]
    }

    pub fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap()
    }

    pub fn uid(&self) -> &str {
        self.value["metadata"]["uid"].as_str().unwrap()
    }

    fn fs_group(&self) -> Option<u32> {
        self.spec()["securityContext"]["fsGroup"].as_u64().map(|g| u32::try_from(g).unwrap())
    }

    fn make_volumes(&mut self, cp: &ControlPlane, root: &Path) {
        std::fs::create_dir_all(root).unwrap();
        open_up(root);
        let ns = self.value["metadata"]["namespace"].as_str().unwrap().to_owned();
        let fs_group = self.fs_group();
        let volumes = self.spec()["volumes"].as_array().cloned().unwrap_or_default();
        // Where each volume is first: a ConfigMap's files are rewritten by every mount.
        for v in &volumes {
            let name = v["name"].as_str().unwrap().to_owned();
            let path = match v["hostPath"]["path"].as_str() {
                Some(p) => self.node.host(p),
                None => root.join(&name),
            };
            std::fs::create_dir_all(&path).unwrap();
            self.volumes.insert(name, path);
        }
        for v in &volumes {
            let path = self.volumes[v["name"].as_str().unwrap()].clone();
            let mode = |m: &Value| m["defaultMode"].as_u64().map_or(0o644, |m| u32::try_from(m).unwrap());
            if v.get("hostPath").is_some() {
                // The node's own directory, made above.
            } else if v.get("projected").is_some() {
                // The ServiceAccount token admission adds: processes get it as a kubeconfig.
            } else if v.get("emptyDir").is_some() {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
                if let Some(g) = fs_group {
                    chown(&path, None, Some(g));
                }
            } else if let Some(s) = v.get("secret") {
                let name = s["secretName"].as_str().unwrap();
                // An optional Secret that does not exist is an empty directory.
                if s["optional"] == true && !cp.kubectl(&["get", "secret", name, "-n", &ns]).status.success() {
                    continue;
                }
                let secret = cp.get(&["secret", name, "-n", &ns]);
                let files = secret["data"].as_object().cloned().unwrap_or_default().into_iter();
                let files = files.map(|(k, b64)| (k, base64(b64.as_str().unwrap()))).collect();
                self.write_files(&path, files, mode(s));
            } else if let Some(c) = v.get("configMap") {
                let map = cp.get(&["configmap", c["name"].as_str().unwrap(), "-n", &ns]);
                let files = map["data"].as_object().cloned().unwrap_or_default().into_iter();
                let files = files.map(|(k, v)| (k, self.rewrite_all(v.as_str().unwrap()).into_bytes())).collect();
                self.write_files(&path, files, mode(c));
            } else {
                panic!("pod volume {v} is of a kind the tier does not make");
            }
        }
    }

    /// Writes a Secret's or ConfigMap's files: root's, mode `mode`, and with an fsGroup that
    /// group's, readable by it (what the kubelet does for such volumes).
    fn write_files(&self, dir: &Path, files: Vec<(String, Vec<u8>)>, mode: u32) {
        open_up(dir);
        let fs_group = self.fs_group();
        for (k, data) in files {
            let f = dir.join(k);
            std::fs::write(&f, data).unwrap();
            let mode = if fs_group.is_some() { mode | FS_GROUP_READ } else { mode };
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            chown(&f, Some(0), Some(fs_group.unwrap_or(0)));
        }
    }

    pub fn container(&self, name: &str) -> &Value {
        let all = self.spec()["initContainers"].as_array().into_iter().chain(self.spec()["containers"].as_array());
        all.flatten()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("pod {} has no container {name}", self.name()))
    }

    /// Container `c`'s mounts: path inside → path on the host, longest first.
    fn mounts(&self, c: &Value) -> Vec<(String, PathBuf)> {
        let mut m: Vec<(String, PathBuf)> = c["volumeMounts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|m| {
                let base = &self.volumes[m["name"].as_str().unwrap()];
                let host = match m["subPath"].as_str() {
                    Some(sub) => base.join(sub),
                    None => base.clone(),
                };
                (m["mountPath"].as_str().unwrap().trim_end_matches('/').to_owned(), host)
            })
            .collect();
        m.sort_by_key(|(inside, _)| std::cmp::Reverse(inside.len()));
        m
    }

    /// `text` with every path under one of `c`'s mounts rewritten to the host's.
    pub fn rewrite(&self, c: &Value, text: &str) -> String {
        rewrite(&self.mounts(c), text)
    }

    /// The same over every container's mounts (for the ConfigMap files they share).
    fn rewrite_all(&self, text: &str) -> String {
        let all = self.spec()["initContainers"].as_array().into_iter().chain(self.spec()["containers"].as_array());
        let mut mounts: Vec<(String, PathBuf)> = Vec::new();
        for c in all.flatten() {
            for m in self.mounts(c) {
                if !mounts.iter().any(|(i, _)| *i == m.0) {
                    mounts.push(m);
                }
            }
        }
        mounts.sort_by_key(|(inside, _)| std::cmp::Reverse(inside.len()));
        rewrite(&mounts, text)
    }

    /// Container `c`'s environment as the kubelet gives it (values, the pod fields it names),
    /// paths rewritten.
    pub fn env(&self, c: &Value) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = Vec::new();
        for e in c["env"].as_array().cloned().unwrap_or_default() {
            let name = e["name"].as_str().unwrap().to_owned();
            let value = match (&e["value"], e["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
                (Value::String(v), _) => expand(v, &env),
                (_, Some("metadata.name")) => self.name().to_owned(),
                (_, Some(NS_LABEL)) => self.value["metadata"]["namespace"].as_str().unwrap().to_owned(),
                (_, Some("metadata.uid")) => self.value["metadata"]["uid"].as_str().unwrap().to_owned(),
                (_, Some("spec.nodeName")) => self.node.name.clone(),
                (_, Some("status.hostIP")) => self.node.ip.clone(),
                other => panic!("env {name}: {other:?} is not something the tier resolves"),
            };
            env.push((name, self.rewrite(c, &value)));
        }
        env
    }

    /// Container `c`'s arguments, `$(VAR)` expanded and paths rewritten.
    pub fn args(&self, c: &Value) -> Vec<String> {
        let env = self.env(c);
        let all = c["command"].as_array().into_iter().chain(c["args"].as_array()).flatten();
        all.map(|a| self.rewrite(c, &expand(a.as_str().unwrap(), &env))).collect()
    }

    /// (uid, gid, supplementary groups) the container runs as: the container's securityContext
    /// over the pod's, the fsGroup and supplementalGroups added; None runs as root.
    pub fn user(&self, c: &Value) -> Option<(u32, u32, Vec<u32>)> {
        let (pod, own) = (&self.spec()["securityContext"], &c["securityContext"]);
        let pick = |k: &str| own[k].as_u64().or_else(|| pod[k].as_u64()).map(|v| u32::try_from(v).unwrap());
        let uid = pick("runAsUser")?;
        let gid = pick("runAsGroup").unwrap_or(0);
        let mut groups: Vec<u32> = pod["supplementalGroups"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|g| u32::try_from(g.as_u64().unwrap()).unwrap())
            .chain(self.fs_group())
            .collect();
        groups.dedup();
        Some((uid, gid, groups))
    }

    /// The command that runs container `name` as `program` (a path), in the node's network
    /// namespace if `netns`, as its user and groups; `extra` arguments appended, `extra_env`
    /// added (what stands for a ServiceAccount token mount).
    pub fn command(
        &self,
        name: &str,
        program: &Path,
        extra: &[String],
        extra_env: &[(String, String)],
        netns: bool,
    ) -> Command {
        let c = self.container(name);
        let mut args = self.args(c);
        args.extend_from_slice(extra);
        self.exec(c, program, &args, extra_env, netns)
    }

    /// `program args` as container `c` runs it.
    fn exec(&self, c: &Value, program: &Path, args: &[String], extra_env: &[(String, String)], netns: bool) -> Command {
        let program = linked(program, &self.logs.join("bin"));
        let mut cmd = if netns {
            let mut x = Command::new("ip");
            x.args(["netns", "exec", &self.node.netns]);
            x
        } else {
            Command::new("env")
        };
        if let Some((uid, gid, groups)) = self.user(c) {
            let groups: Vec<String> = groups.iter().map(u32::to_string).collect();
            let groups =
                if groups.is_empty() { "--clear-groups".to_owned() } else { format!("--groups={}", groups.join(",")) };
            cmd.args(["setpriv", &format!("--reuid={uid}"), &format!("--regid={gid}"), &groups, "--"]);
        }
        cmd.arg(program).args(args);
        cmd.env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
        cmd.envs(self.env(c)).envs(extra_env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Starts container `name` (see [`Pod::command`]) among the control plane's processes, as
    /// `<pod>.<container>`.
    pub fn start(
        &self,
        cp: &mut ControlPlane,
        name: &str,
        program: &Path,
        extra: &[String],
        env: &[(String, String)],
        netns: bool,
    ) {
        cp.spawn_cmd(&self.process(name), &mut self.command(name, program, extra, env, netns));
    }

    /// The control plane's name for container `name`'s process.
    pub fn process(&self, container: &str) -> String {
        format!("{}.{container}", self.name())
    }

    /// Runs container `name` to its end (an init container).
    pub fn run_to_end(&self, name: &str, program: &Path, env: &[(String, String)], netns: bool) -> Output {
        self.command(name, program, &[], env, netns).output().unwrap()
    }

    pub fn log_path(&self, container: &str) -> PathBuf {
        self.logs.join(format!("{}.log", self.process(container)))
    }

    pub fn log(&self, container: &str) -> String {
        std::fs::read_to_string(self.log_path(container)).unwrap_or_default()
    }

    /// Container `name`'s exec handler at `at` (its readiness probe, its preStop hook), as the
    /// container runs it; the handler's program is the image's, here `program`.
    fn handler(&self, name: &str, at: &[&str], program: &Path, netns: bool) -> Command {
        let c = self.container(name);
        let argv: Vec<String> = at.iter().fold(c, |v, k| &v[*k])["exec"]["command"]
            .as_array()
            .unwrap_or_else(|| panic!("{name} has no exec {at:?}"))
            .iter()
            .map(|a| self.rewrite(c, a.as_str().unwrap()))
            .collect();
        self.exec(c, program, &argv[1..], &[], netns)
    }

    /// Runs the container's exec readiness probe once: whether it passed.
    pub fn ready(&self, name: &str, program: &Path, netns: bool) -> bool {
        self.handler(name, &["readinessProbe"], program, netns).output().is_ok_and(|o| o.status.success())
    }

    /// Runs the container's preStop hook to its end, as the kubelet does before its SIGTERM.
    pub fn pre_stop(&self, name: &str, program: &Path, netns: bool) -> Output {
        self.handler(name, &["lifecycle", "preStop"], program, netns).output().unwrap()
    }

    /// Stops every container (SIGKILL), as a deleted pod's are once its grace period ends.
    pub fn kill(&self, cp: &mut ControlPlane) {
        cp.kill(&format!("{}.", self.name()));
    }
}

/// Rewrites paths under the mounts' paths (longest first) where they start a path: at the
/// start, or after `=`, `"`, `:`, `'` or a space, and followed by `/`, a quote or the end.
pub fn rewrite(mounts: &[(String, PathBuf)], text: &str) -> String {
    let mut out = text.to_owned();
    for (inside, host) in mounts {
        let host = host.display().to_string();
        let mut at = 0;
        while let Some(i) = out[at..].find(inside.as_str()).map(|i| i + at) {
            let before = out[..i].chars().last();
            let after = out[i + inside.len()..].chars().next();
            let starts = before.is_none_or(|b| matches!(b, '=' | '"' | ':' | '\'' | ' ' | '\n'));
            let whole = after.is_none_or(|a| matches!(a, '/' | '"' | '\'' | '\n' | ' '));
            if starts && whole {
                out.replace_range(i..i + inside.len(), &host);
                at = i + host.len();
            } else {
                at = i + inside.len();
            }
        }
    }
    out
}

/// `$(VAR)` references, as the kubelet expands them.
fn expand(arg: &str, env: &[(String, String)]) -> String {
    let mut out = arg.to_owned();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// `program` hard-linked (or copied) into `dir`, so any user may run it.
fn linked(program: &Path, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    open_up(dir);
    let to = dir.join(program.file_name().unwrap());
    if !to.exists() && std::fs::hard_link(program, &to).is_err() {
        std::fs::copy(program, &to).unwrap();
    }
    to
}

/// Lets every user traverse `dir` and the test directories above it (the tier's processes run
/// as the manifests' users).
pub fn open_up(dir: &Path) {
    for d in dir.ancestors() {
        if d == Path::new("/tmp") || d.parent().is_none() {
            break;
        }
        let mode = std::fs::metadata(d).unwrap().permissions().mode();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o755)).unwrap();
    }
}

fn chown(p: &Path, uid: Option<u32>, gid: Option<u32>) {
    std::os::unix::fs::chown(p, uid, gid).unwrap();
}

/// Decodes standard base64 (a Secret's data).
pub fn base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let digits: Vec<u8> = text.bytes().filter(|&c| c != b'=').map(value).collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &d)| n | u32::from(d) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}
