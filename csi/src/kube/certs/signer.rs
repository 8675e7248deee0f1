//! The controller's side: the signer `ferrite.dev/node`. It watches the CertificateSigningRequests
//! of that signer and answers each once: approved and signed when the request comes from a
//! daemon pod's own token and names exactly what that pod's node is, denied (with the reason in
//! the condition's message) otherwise. A request someone else approved is checked all the same:
//! one that fails is marked Failed, never signed. An IP address issued to a node is recorded
//! (`addresses.rs`): no other node is issued it while that Node exists, and a certificate naming
//! one lives a day at most.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

use super::{SIGNER, USAGES, addresses, names_service, node_names};
use crate::shared::nodes::kubernetes::RESTRICTED_STORAGE;

/// What a pod-bound ServiceAccount token adds to its user's extra information.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";
const NODE_NAME: &str = "authentication.kubernetes.io/node-name";
/// The shortest lifetime Kubernetes lets a request ask for.
const MIN_LIFETIME: Duration = Duration::from_secs(600);
/// The longest lifetime of a certificate that names an IP address.
const IP_LIFETIME: Duration = Duration::from_secs(86_400);

/// Who may be issued what.
#[derive(Debug, Clone)]
pub struct Signer {
    /// The CA: `ca.crt` and `ca.key` (the Secret ferrite-ca), read at every signing so that a
    /// rotated CA is used at once.
    pub ca_dir: PathBuf,
    /// The namespace and the ServiceAccounts of the pods that are issued their node's
    /// certificate (the daemons', and the node plugins' on nodes that hold no storage).
    pub namespace: String,
    pub accounts: Vec<String>,
    /// The node Service's DNS name, which every node's certificate carries.
    pub service: String,
    /// The longest lifetime given (a request asking for less gets what it asked).
    pub max_lifetime: Duration,
}

/// The answer to one request.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Sign {
        lifetime: Duration,
        node: String,
    },
    Refuse(String),
    /// Refused because `node` asked for `address`, which belongs to node `owner`.
    Claimed {
        why: String,
        node: String,
        address: String,
        owner: String,
    },
}

/// A request's condition of `kind` (Approved, Denied, Failed), saying why.
fn condition(kind: &str, message: &str) -> serde_json::Value {
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    json!({"type": kind, "status": "True", "reason": "FerriteNodeIdentity", "message": message, "lastUpdateTime": now})
}

/// The names a request asks for (none where it does not parse).
fn req_names(spec: &CertificateSigningRequestSpec) -> Vec<String> {
    let text = std::str::from_utf8(&spec.request.0).unwrap_or_default();
    ferrite_tls::certs::Request::parse(text).ok().and_then(|r| r.names().ok()).unwrap_or_default()
}

fn one<'a>(spec: &'a CertificateSigningRequestSpec, key: &str) -> Option<&'a str> {
    match spec.extra.as_ref()?.get(key)?.as_slice() {
        [v] => Some(v.as_str()),
        _ => None,
    }
}

/// The IP addresses a request names (none when it does not parse: it is refused then).
fn ip_names(spec: &CertificateSigningRequestSpec) -> Vec<String> {
    req_names(spec).into_iter().filter(|n| n.parse::<std::net::IpAddr>().is_ok()).collect()
}

impl Signer {
    fn users(&self) -> impl Iterator<Item = (String, &str)> {
        self.accounts.iter().map(|a| (format!("system:serviceaccount:{}:{a}", self.namespace), a.as_str()))
    }

    /// Who asked: the ServiceAccount, and the pod whose bound token made the request (its name
    /// and uid).
    fn requester<'a>(&self, spec: &'a CertificateSigningRequestSpec) -> Result<(&str, &'a str, &'a str), String> {
        let user = spec.username.as_deref().unwrap_or("");
        let Some((_, account)) = self.users().find(|(u, _)| u == user) else {
            let may: Vec<String> = self.users().map(|(u, _)| u).collect();
            return Err(format!("requested by {user:?}; only {} may ask for a node certificate", may.join(" or ")));
        };
        match (one(spec, POD_NAME), one(spec, POD_UID)) {
            (Some(pod), Some(uid)) => Ok((account, pod, uid)),
            _ => Err("the requester's token is not bound to a pod (a pod's projected ServiceAccount token is)".into()),
        }
    }

    /// Whether the request asks for what `node` is, by the pod `pod` running there as `account`;
    /// `others`: the addresses other Nodes list (never issued to this one).
    fn check(
        &self,
        spec: &CertificateSigningRequestSpec,
        (account, pod, uid): (&str, &Pod, &str),
        (node, restricted): (&Node, bool),
        others: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        let pod_name = pod.metadata.name.as_deref().unwrap_or("");
        if pod.metadata.uid.as_deref() != Some(uid) {
            return Err(format!("pod {pod_name} is not the one whose token asked (it was replaced)"));
        }
        if pod.spec.as_ref().and_then(|s| s.service_account_name.as_deref()) != Some(account) {
            return Err(format!("pod {pod_name} does not run as {account}, whose token asked"));
        }
        let node_name = node.metadata.name.as_deref().unwrap_or("");
        if let Some(n) = one(spec, NODE_NAME).filter(|n| *n != node_name) {
            return Err(format!("the token was issued on node {n}, pod {pod_name} runs on {node_name}"));
        }
        if let Some(why) = super::refused_node_name(node_name, &self.service) {
            return Err(why);
        }
        let usages = spec.usages.iter().flatten();
        if let Some(u) = usages.clone().find(|u| !USAGES.contains(&u.as_str())) {
            return Err(format!("usage {u:?} is not one a node certificate has"));
        }
        let text = std::str::from_utf8(&spec.request.0).map_err(|_| "the request is not PEM text".to_owned())?;
        let req = ferrite_tls::certs::Request::parse(text).map_err(|e| format!("the request does not verify: {e}"))?;
        let cn = req.common_name().unwrap_or_default();
        if cn != node_name {
            return Err(format!(
                "the request's subject is CN={cn:?}, not CN={node_name} alone (the node pod {pod_name} runs on)"
            ));
        }
        let names = req.names()?;
        // An address another Node lists too is the other node's identity to its peers: a
        // kubelet that wrote it into its own status gets nothing for it.
        if let Some((n, owner)) =
            names.iter().find_map(|n| Some((n, others.iter().find(|(a, _)| ferrite_tls::same_name(a, n))?.1)))
        {
            return Err(format!("{n:?} is also an address of node {owner}: not issued to {node_name}"));
        }
        let mut allowed = node_names(node, &self.service, names_service(node, restricted));
        allowed.retain(|a| !others.keys().any(|o| ferrite_tls::same_name(o, a)));
        if let Some(n) = names.iter().find(|n| !allowed.iter().any(|a| ferrite_tls::same_name(a, n))) {
            return Err(format!("{n:?} is not a name of node {node_name} (it may have {})", allowed.join(", ")));
        }
        if !names.iter().any(|n| n == node_name) {
            return Err(format!("the request does not name its node {node_name}"));
        }
        Ok(())
    }

    async fn decide(&self, client: &kube::Client, csr: &CertificateSigningRequest) -> Result<Verdict> {
        let spec = &csr.spec;
        let (account, pod_name, uid) = match self.requester(spec) {
            Ok(p) => p,
            Err(why) => return Ok(Verdict::Refuse(why)),
        };
        let pods = Api::<Pod>::namespaced(client.clone(), &self.namespace);
        let Some(pod) = pods.get_opt(pod_name).await.context("reading the requester's pod")? else {
            return Ok(Verdict::Refuse(format!("pod {pod_name} no longer exists")));
        };
        let Some(node_name) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            return Ok(Verdict::Refuse(format!("pod {pod_name} runs on no node")));
        };
        let all = Api::<Node>::all(client.clone()).list(&Default::default()).await.context("listing the Nodes")?;
        let Some(node) = all.items.iter().find(|n| n.metadata.name.as_deref() == Some(&node_name)) else {
            return Ok(Verdict::Refuse(format!("node {node_name} does not exist")));
        };
        // Once any Node carries the label kubelets cannot write, only it makes a storage node.
        let restricted = all.items.iter().any(|n| n.labels().contains_key(RESTRICTED_STORAGE));
        let record = addresses::read(client, &self.namespace).await?;
        let exists = |n: &str| all.items.iter().any(|o| o.metadata.name.as_deref() == Some(n));
        let recorded = addresses::owners(record.as_ref(), exists);
        let listed =
            all.iter().flat_map(|n| super::ip_addresses(n).map(|a| (a, n.metadata.name.clone().unwrap_or_default())));
        let others = addresses::others(&node_name, &recorded, listed);
        if let Err(why) = self.check(spec, (account, &pod, uid), (node, restricted), &others) {
            let claimed = req_names(spec).into_iter().find_map(|n| {
                let (a, owner) = others.iter().find(|(a, _)| ferrite_tls::same_name(a, &n))?;
                Some((a.clone(), owner.clone()))
            });
            return Ok(match claimed {
                Some((address, owner)) => Verdict::Claimed { why, node: node_name, address, owner },
                None => Verdict::Refuse(why),
            });
        }
        let asked =
            spec.expiration_seconds.map_or(self.max_lifetime, |s| Duration::from_secs(s.max(0).unsigned_abs().into()));
        let mut lifetime = asked.clamp(MIN_LIFETIME, self.max_lifetime.max(MIN_LIFETIME));
        // An address can pass to another machine (a lease, a replaced node): a certificate naming
        // one is issued for a day at most, so an address's old holder is not its identity for long.
        let ips = ip_names(spec);
        if !ips.is_empty() {
            lifetime = lifetime.min(IP_LIFETIME);
        }
        addresses::record(client, &self.namespace, record, &node_name, &ips).await?;
        Ok(Verdict::Sign { lifetime, node: node_name })
    }

    /// Issues the certificate: the request's names, signed by the CA, then the CA itself.
    fn sign(&self, csr: &CertificateSigningRequest, lifetime: Duration) -> Result<String> {
        let read = |f: &str| {
            let p = self.ca_dir.join(f);
            std::fs::read_to_string(&p).with_context(|| format!("reading the CA's {}", p.display()))
        };
        let (ca_cert, ca_key) = (read("ca.crt")?, read("ca.key")?);
        let req = ferrite_tls::certs::Request::parse(std::str::from_utf8(&csr.spec.request.0)?)?;
        let leaf = req.sign(&ca_cert, &ca_key, lifetime).context("signing")?;
        Ok(format!("{}\n{}\n", leaf.trim(), ca_cert.trim()))
    }

    /// Answers one request not answered yet.
    async fn answer(&self, client: &kube::Client, csr: &CertificateSigningRequest) -> Result<()> {
        let name = csr.metadata.name.as_deref().unwrap_or("");
        let conditions = csr.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        let approved = conditions.iter().any(|c| c.type_ == "Approved");
        let api = Api::<CertificateSigningRequest>::all(client.clone());
        let pp = PatchParams::default();
        match self.decide(client, csr).await? {
            Verdict::Sign { lifetime, node } => {
                if !approved {
                    let msg =
                        format!("names node {node}'s own addresses and the node Service; asked by its daemon pod");
                    let c = condition("Approved", &msg);
                    api.patch_approval(name, &pp, &Patch::Merge(json!({"status": {"conditions": [c]}}))).await?;
                }
                let cert = self.sign(csr, lifetime)?;
                let status = json!({"status": {"certificate": ByteString(cert.into_bytes())}});
                api.patch_status(name, &pp, &Patch::Merge(status)).await?;
                tracing::info!(csr = name, node, ?lifetime, "node certificate issued");
            }
            Verdict::Claimed { why, node, address, owner } => {
                self.claimed(client, &node, &address, &owner).await;
                self.refuse(&api, csr, &why).await?;
            }
            Verdict::Refuse(why) => self.refuse(&api, csr, &why).await?,
        }
        Ok(())
    }

    /// Marks request `name` refused for `why`: Denied, or Failed where someone else approved it.
    async fn refuse(
        &self,
        api: &Api<CertificateSigningRequest>,
        csr: &CertificateSigningRequest,
        why: &str,
    ) -> Result<()> {
        let name = csr.metadata.name.as_deref().unwrap_or("");
        tracing::warn!(csr = name, reason = %why, "node certificate refused");
        let conditions = csr.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        let pp = PatchParams::default();
        if conditions.iter().any(|c| c.type_ == "Approved") {
            // Approved by someone else: not signed, and marked so.
            let mut all = serde_json::to_value(&conditions)?;
            all.as_array_mut().expect("a list").push(condition("Failed", why));
            api.patch_status(name, &pp, &Patch::Merge(json!({"status": {"conditions": all}}))).await?;
        } else {
            let c = condition("Denied", why);
            api.patch_approval(name, &pp, &Patch::Merge(json!({"status": {"conditions": [c]}}))).await?;
        }
        Ok(())
    }

    /// An Event on Node `node`, which asked for `address`, node `owner`'s: the operator sees who
    /// claims whose address (the owner keeps it).
    async fn claimed(&self, client: &kube::Client, node: &str, address: &str, owner: &str) {
        let note = format!(
            "node {node} asked for a certificate naming {address}, which was issued to node {owner} first: refused \
             (a Node listing another's address is misconfigured or compromised)"
        );
        let reporter = Reporter { controller: "ferrite-signer".into(), instance: std::env::var("POD_NAME").ok() };
        let on = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            ..Default::default()
        };
        let ev = Event {
            type_: EventType::Warning,
            reason: "AddressClaimed".into(),
            note: Some(note),
            action: "Sign".into(),
            secondary: None,
        };
        if let Err(e) = Recorder::new(client.clone(), reporter).publish(&ev, &on).await {
            tracing::warn!(node, "publishing an event: {e}");
        }
    }

    /// Answers the signer's requests as they come, until the task is dropped. A request whose
    /// answer failed (an API error) is tried again at the watch's next resync.
    pub async fn run(self, client: kube::Client) {
        let api = Api::<CertificateSigningRequest>::all(client.clone());
        let cfg = watcher::Config::default().fields(&format!("spec.signerName={SIGNER}"));
        let mut events = std::pin::pin!(watcher(api, cfg).default_backoff().applied_objects());
        tracing::info!(signer = SIGNER, "signing the nodes' certificate requests");
        while let Some(ev) = events.next().await {
            let csr = match ev {
                Ok(csr) => csr,
                Err(e) => {
                    tracing::warn!("watching CertificateSigningRequests: {e}");
                    continue;
                }
            };
            let status = csr.status.as_ref();
            let answered = status.and_then(|s| s.certificate.as_ref()).is_some_and(|c| !c.0.is_empty())
                || status.and_then(|s| s.conditions.as_ref()).into_iter().flatten().any(|c| c.type_ != "Approved");
            if answered {
                continue;
            }
            if let Err(e) = self.answer(&client, &csr).await {
                tracing::warn!(
                    csr = csr.metadata.name.as_deref().unwrap_or(""),
                    "answering a certificate request: {e:#}"
                );
            }
        }
    }
}

/// Starts the signer with the client configuration kube-rs infers.
pub async fn start(signer: Signer) -> Result<tokio::task::JoinHandle<()>> {
    for f in ["ca.crt", "ca.key"] {
        let p = signer.ca_dir.join(f);
        anyhow::ensure!(p.exists(), "the signer's CA file {} does not exist (the Secret ferrite-ca)", p.display());
    }
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
    Ok(tokio::spawn(signer.run(client)))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::PodSpec;
    use kube::api::ObjectMeta;

    use super::*;
    use crate::kube::certs::tests::node;

    fn signer() -> Signer {
        Signer {
            ca_dir: PathBuf::new(),
            namespace: "ferrite".into(),
            accounts: vec!["ferrite-daemon".into(), "ferrite-node".into()],
            service: "ferrite-node.ferrite.svc".into(),
            max_lifetime: Duration::from_secs(30 * 86_400),
        }
    }

    fn pod(node: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("ferrite-daemon-x".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                service_account_name: Some("ferrite-daemon".into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn spec(user: &str, cn: &str, names: &[&str], extra: &[(&str, &str)]) -> CertificateSigningRequestSpec {
        let key = ferrite_tls::certs::new_key().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let pem = ferrite_tls::certs::request(&key, cn, &names).unwrap();
        CertificateSigningRequestSpec {
            request: ByteString(pem.into_bytes()),
            signer_name: SIGNER.into(),
            username: Some(user.into()),
            usages: Some(USAGES.iter().map(|u| (*u).to_owned()).collect()),
            extra: Some(
                extra.iter().map(|(k, v)| ((*k).to_owned(), vec![(*v).to_owned()])).collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        }
    }

    const SA: &str = "system:serviceaccount:ferrite:ferrite-daemon";
    const SVC: &str = "ferrite-node.ferrite.svc";

    #[test]
    fn only_a_daemon_pods_own_node_names_are_signed() {
        let s = signer();
        let none = BTreeMap::new();
        let a = node("node-a", &[("InternalIP", "10.0.0.5")]);
        let bound = [(POD_NAME, "ferrite-daemon-x"), (POD_UID, "u1"), (NODE_NAME, "node-a")];
        let good = spec(SA, "node-a", &["node-a", "10.0.0.5", SVC], &bound);
        assert_eq!(s.requester(&good), Ok(("ferrite-daemon", "ferrite-daemon-x", "u1")));
        assert_eq!(s.check(&good, ("ferrite-daemon", &pod("node-a"), "u1"), (&a, false), &none), Ok(()));
        // Once the cluster labels its storage nodes, a node without the label is no replication
        // peer: the node Service's name is refused, the client's name issued.
        let e = s.check(&good, ("ferrite-daemon", &pod("node-a"), "u1"), (&a, true), &none).unwrap_err();
        assert!(e.contains("\"ferrite-node.ferrite.svc\" is not a name of node node-a"), "{e}");
        let client = spec(SA, "node-a", &["node-a", "10.0.0.5", "client.ferrite-node.ferrite.svc"], &bound);
        assert_eq!(s.check(&client, ("ferrite-daemon", &pod("node-a"), "u1"), (&a, true), &none), Ok(()));
        let mut storage = a.clone();
        storage.metadata.labels = Some([(RESTRICTED_STORAGE.to_owned(), "true".to_owned())].into());
        assert_eq!(s.check(&good, ("ferrite-daemon", &pod("node-a"), "u1"), (&storage, true), &none), Ok(()));

        let refused = |sp: &CertificateSigningRequestSpec, p: &Pod, n: &Node| {
            s.check(sp, ("ferrite-daemon", p, "u1"), (n, false), &none).unwrap_err()
        };
        // Another node's address, or another node's name.
        let other_ip = spec(SA, "node-a", &["node-a", "10.0.0.6", SVC], &bound);
        assert!(refused(&other_ip, &pod("node-a"), &a).contains("\"10.0.0.6\" is not a name of node node-a"));
        let other_cn = spec(SA, "node-b", &["node-b", SVC], &bound);
        assert!(refused(&other_cn, &pod("node-a"), &a).contains("not CN=node-a"));
        let no_node_name = spec(SA, "node-a", &["10.0.0.5", SVC], &bound);
        assert!(refused(&no_node_name, &pod("node-a"), &a).contains("does not name its node"));
        // The pod replaced since its token asked, a token issued on another node.
        assert!(
            s.check(&good, ("ferrite-daemon", &pod("node-a"), "u2"), (&a, false), &none)
                .unwrap_err()
                .contains("replaced")
        );
        // The node plugin's token asking for a pod that runs as the daemon: refused.
        let plugin = spec("system:serviceaccount:ferrite:ferrite-node", "node-a", &["node-a", SVC], &bound);
        let (account, _, _) = s.requester(&plugin).unwrap();
        let e = s.check(&plugin, (account, &pod("node-a"), "u1"), (&a, false), &none).unwrap_err();
        assert!(e.contains("does not run as ferrite-node"), "{e}");
        let elsewhere =
            spec(SA, "node-a", &["node-a", SVC], &[(POD_NAME, "p"), (POD_UID, "u1"), (NODE_NAME, "node-b")]);
        assert!(refused(&elsewhere, &pod("node-a"), &a).contains("issued on node node-b"));
        // A usage a node certificate does not have.
        let mut signing = good.clone();
        signing.usages = Some(vec!["cert sign".into()]);
        assert!(refused(&signing, &pod("node-a"), &a).contains("cert sign"));
        // Other requesters: a user, another ServiceAccount, a token bound to no pod.
        assert!(s.requester(&spec("admin", "node-a", &["node-a"], &bound)).unwrap_err().contains("only system:"));
        let controller = spec("system:serviceaccount:ferrite:ferrite-controller", "node-a", &["node-a"], &bound);
        assert!(s.requester(&controller).is_err());
        assert!(s.requester(&spec(SA, "node-a", &["node-a"], &[])).unwrap_err().contains("not bound to a pod"));
        // A tampered request does not verify.
        let mut forged = good.clone();
        let at = forged.request.0.len() / 2;
        forged.request.0[at] ^= 1;
        assert!(refused(&forged, &pod("node-a"), &a).contains("request"));
    }

    #[test]
    fn a_kubelet_writing_its_status_is_issued_no_role_and_no_other_node() {
        let s = signer();
        let bound = [(POD_NAME, "ferrite-daemon-x"), (POD_UID, "u1"), (NODE_NAME, "node-a")];
        let who = ("ferrite-daemon", &pod("node-a"), "u1");
        // Names a kubelet wrote among its addresses: left out of the node's names, refused when asked.
        let a = node(
            "node-a",
            &[("InternalIP", "10.0.0.5"), ("InternalIP", "ferrite-controller"), ("ExternalIP", "10.0.0.6")],
        );
        let none = BTreeMap::new();
        for name in ["ferrite-controller", "ferrite-controller.ferrite.svc", "spiffe://ferrite.dev/controller"] {
            let asked = spec(SA, "node-a", &["node-a", "10.0.0.5", name, SVC], &bound);
            assert!(s.check(&asked, who, (&a, false), &none).is_err(), "{name}");
        }
        // Another node's address, written into this node's status.
        let b = BTreeMap::from([("10.0.0.6".to_owned(), "node-b".to_owned())]);
        let theirs = spec(SA, "node-a", &["node-a", "10.0.0.5", "10.0.0.6", SVC], &bound);
        assert!(s.check(&theirs, who, (&a, false), &none).is_ok(), "an address no other node lists");
        let e = s.check(&theirs, who, (&a, false), &b).unwrap_err();
        assert!(e.contains("also an address of node node-b"), "{e}");
        // A Node named like a role's identity or a Service gets nothing.
        for name in ["ferrite-controller", "ferrite-node.ferrite.svc", "10.0.0.9"] {
            let n = node(name, &[("InternalIP", "10.0.0.5")]);
            let asked =
                spec(SA, name, &[name, "10.0.0.5", SVC], &[(POD_NAME, "p"), (POD_UID, "u1"), (NODE_NAME, name)]);
            let e = s.check(&asked, ("ferrite-daemon", &pod(name), "u1"), (&n, false), &none).unwrap_err();
            assert!(e.contains("no certificate names it"), "{name}: {e}");
        }
    }
}
