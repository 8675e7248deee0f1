//! The cluster's certificates made by the controller itself (`ferrite csi --cluster-certs`), so
//! that `kubectl apply -k` is the whole install: on start, before anything reads them,
//!
//! - the CA: the Secret `ferrite-ca` (`ca.crt`, `ca.key`), made on a first install (an
//!   operator's own CA, created beforehand, is used as it is). Never made anew while a CA is in
//!   use (the controller holds one, or the drain guard's caBundle names one): the nodes'
//!   certificates chain to the old one, and a new CA would cut the controller off every daemon.
//!   A Secret deleted then is said (log, Event, `ferrite_cluster_ca_missing`, an alert) and
//!   waited for, the controller signing with the CA it holds meanwhile;
//! - the controller's certificate: the Secret `ferrite-controller-tls` (`ca.crt`, `tls.crt`,
//!   `tls.key`), naming [`IDENTITY`] (its role in the daemons' `[roles]`) and the controller
//!   Service (the drain guard's server name), issued when absent, not from the CA, or
//!   two thirds into its lifetime;
//! - the drain guard's `caBundle`, set to the CA.
//!
//! Both Secrets are written to the files the controller reads (`--signer-ca`, `--tls-*`: an
//! in-memory emptyDir in the manifests, so no key touches a node's disk), and looked at again
//! every [`EVERY`]: a renewed certificate or a rotated CA reaches the files, which the listeners
//! reload. Two replicas starting together race only through the API server: a create that finds
//! the Secret made (409) or an update that lost (409), the caBundle's patch too, re-reads it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{ObjectReference, Secret};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus_client::metrics::gauge::Gauge;

/// The Secrets and the webhook configuration, as deploy/kubernetes names them.
pub const CA_SECRET: &str = "ferrite-ca";
pub const TLS_SECRET: &str = "ferrite-controller-tls";
pub const WEBHOOK: &str = "ferrite-drain-guard";
/// The controller's identity in its certificate, which the daemons' `[roles]` give the
/// controller role: a URI, which the node signer never issues (a node's names are its Node's
/// name, which cannot hold a `:`, and IP addresses).
pub const IDENTITY: &str = "spiffe://ferrite.dev/controller";
/// The plain name releases before 0.3 bound the controller role to, which a node could be
/// issued. The controller's certificate still carries it (as its CN too), so that daemons not
/// yet restarted on the new `[roles]` keep answering it during an upgrade; the signer refuses it
/// to any node.
pub const LEGACY_IDENTITY: &str = "ferrite-controller";
/// A new CA's and a controller certificate's lifetimes.
const CA_DAYS: u32 = 3650;
const CERT_DAYS: u32 = 365;
/// How often the Secrets are looked at again.
const EVERY: Duration = Duration::from_secs(600);

/// Where the material goes and under which names.
#[derive(Debug, Clone)]
pub struct Options {
    pub namespace: String,
    /// The controller Service's DNS name (`ferrite-controller.NAMESPACE.svc`).
    pub service: String,
    /// The signer's directory (`ca.crt`, `ca.key`), and the controller's TLS files.
    pub ca_dir: PathBuf,
    pub tls_ca: PathBuf,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
}

fn field<'a>(s: &'a Secret, key: &str) -> Option<&'a str> {
    std::str::from_utf8(&s.data.as_ref()?.get(key)?.0).ok()
}

fn secret(name: &str, namespace: &str, data: &[(&str, &str)]) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([("app.kubernetes.io/part-of".to_owned(), "ferrite".to_owned())])),
            ..Default::default()
        },
        data: Some(data.iter().map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec()))).collect()),
        ..Default::default()
    }
}

/// Whether `cert_pem` names `names`, was issued by the CA `ca_pem`, and is less than two thirds
/// into its lifetime.
pub fn current(cert_pem: &str, ca_pem: &str, names: &[String]) -> bool {
    let Ok(certs) = ferrite_tls::certs_from_pem(cert_pem) else { return false };
    let Some(cert) = certs.first() else { return false };
    let has = ferrite_tls::identities(cert);
    let Some((from, to)) = ferrite_tls::validity(cert) else { return false };
    let fresh = super::request::now() < from + (to - from) * 2 / 3;
    fresh && names.iter().all(|n| has.contains(n)) && ferrite_tls::issued_by(cert, ca_pem)
}

/// 1 while the CA Secret is missing but a CA is in use (the nodes' certificates chain to it):
/// the controller waits for the operator ([`ca`]). Served with the failover metrics.
pub static CA_MISSING: std::sync::LazyLock<Gauge> = std::sync::LazyLock::new(Gauge::default);

/// Why a CA is in use although its Secret is gone (None: none ever was, a first install): this
/// controller holds one in its files, or the drain guard's caBundle names one.
async fn in_use(client: &kube::Client, o: &Options) -> Result<Option<&'static str>> {
    if o.ca_dir.join("ca.crt").exists() {
        return Ok(Some("this controller has been signing with it"));
    }
    let hooks = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    let hook =
        hooks.get_opt(WEBHOOK).await.with_context(|| format!("reading ValidatingWebhookConfiguration {WEBHOOK}"))?;
    let bundles =
        hook.iter().flat_map(|w| w.webhooks.iter().flatten()).filter_map(|h| h.client_config.ca_bundle.as_ref());
    Ok(bundles.into_iter().any(|b| !b.0.is_empty()).then_some("the drain guard's caBundle names it"))
}

/// Says that the CA Secret is missing while a CA is in use (`why`): a log line, the metric, and
/// an Event about the Secret.
async fn ca_missing(client: &kube::Client, o: &Options, why: &str) -> anyhow::Error {
    CA_MISSING.set(1);
    let note = format!(
        "Secret {CA_SECRET} is missing, but the cluster's CA is in use ({why}): every node's certificate \
         chains to it, so no new CA is made. Restore the Secret (ca.crt, ca.key) from a backup; to start over \
         with a new CA instead, remove the caBundle of {WEBHOOK} and have every node's certificate issued \
         again (docs/security.md, \"The cluster CA\")"
    );
    let reporter = Reporter { controller: "ferrite-certs".into(), instance: std::env::var("POD_NAME").ok() };
    let secret = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Secret".into()),
        name: Some(CA_SECRET.into()),
        namespace: Some(o.namespace.clone()),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: "CAMissing".into(),
        note: Some(note.clone()),
        action: "Sign".into(),
        secondary: None,
    };
    if let Err(e) = Recorder::new(client.clone(), reporter).publish(&ev, &secret).await {
        tracing::warn!("publishing an event: {e}");
    }
    anyhow::anyhow!(note)
}

/// The CA Secret: the one there, or a new one when no CA was in use yet.
async fn ca(client: &kube::Client, api: &Api<Secret>, o: &Options) -> Result<(String, String)> {
    let namespace = &o.namespace;
    loop {
        if let Some(s) = api.get_opt(CA_SECRET).await.with_context(|| format!("reading Secret {CA_SECRET}"))? {
            CA_MISSING.set(0);
            match (field(&s, "ca.crt"), field(&s, "ca.key")) {
                (Some(c), Some(k)) => return Ok((c.to_owned(), k.to_owned())),
                _ => bail!("Secret {CA_SECRET} lacks ca.crt or ca.key (an operator's CA must carry both)"),
            }
        }
        if let Some(why) = in_use(client, o).await? {
            return Err(ca_missing(client, o, why).await);
        }
        let ca = ferrite_tls::certs::new_ca(CA_DAYS).context("making the cluster CA")?;
        let new = secret(CA_SECRET, namespace, &[("ca.crt", &ca.cert_pem), ("ca.key", &ca.key_pem)]);
        match api.create(&PostParams::default(), &new).await {
            Ok(_) => {
                tracing::info!("made the cluster CA (Secret {CA_SECRET}), valid {CA_DAYS} days");
                return Ok((ca.cert_pem, ca.key_pem));
            }
            // Another replica made it first: use that one.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e).with_context(|| format!("creating Secret {CA_SECRET}")),
        }
    }
}

/// The controller's certificate Secret, issued again when it is not current.
async fn controller(api: &Api<Secret>, o: &Options, ca: &(String, String)) -> Result<(String, String)> {
    let names = vec![IDENTITY.to_owned(), LEGACY_IDENTITY.to_owned(), o.service.clone()];
    loop {
        let old = api.get_opt(TLS_SECRET).await.with_context(|| format!("reading Secret {TLS_SECRET}"))?;
        if let Some(s) = &old
            && let (Some(c), Some(k), Some(a)) = (field(s, "tls.crt"), field(s, "tls.key"), field(s, "ca.crt"))
            && a == ca.0
            && current(c, &ca.0, &names)
        {
            return Ok((c.to_owned(), k.to_owned()));
        }
        let (cert, key) = issue(ca, &names)?;
        let mut new = secret(TLS_SECRET, &o.namespace, &[("ca.crt", &ca.0), ("tls.crt", &cert), ("tls.key", &key)]);
        let done = match old {
            // The resourceVersion makes the replace a compare-and-swap.
            Some(s) => {
                new.metadata.resource_version = s.metadata.resource_version;
                api.replace(TLS_SECRET, &PostParams::default(), &new).await
            }
            None => api.create(&PostParams::default(), &new).await,
        };
        match done {
            Ok(_) => {
                tracing::info!(names = ?names, "issued the controller's certificate (Secret {TLS_SECRET}), valid {CERT_DAYS} days");
                return Ok((cert, key));
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e).with_context(|| format!("writing Secret {TLS_SECRET}")),
        }
    }
}

/// A certificate and key for `names` signed by `ca` (certificate, key): through a request, so
/// that the issuer is the CA certificate's own name (an operator's CA need not be one
/// `ferrite certs` made).
fn issue(ca: &(String, String), names: &[String]) -> Result<(String, String)> {
    use ferrite_tls::certs::{Request, new_key, request};
    let key = new_key().context("making the controller's key")?;
    let csr = request(&key, LEGACY_IDENTITY, names).context("a request for the controller's certificate")?;
    let valid = Duration::from_secs(u64::from(CERT_DAYS) * 86_400);
    let cert = Request::parse(&csr)
        .and_then(|r| r.sign(&ca.0, &ca.1, valid))
        .context("signing the controller's certificate")?;
    Ok((cert, key))
}

/// Writes `text` to `path` (mode `mode`) unless it holds it already, through a new file renamed
/// over it: a reader never sees half a key.
fn put(path: &Path, text: &str, mode: u32) -> Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    let dir = path.parent().context("a file path has a directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = path.file_name().and_then(|n| n.to_str()).context("a file path has a name")?;
    super::request::replace(dir, name, text, mode)
}

/// The drain guard's caBundle, set to `ca` unless it is: a merge patch of its webhooks with the
/// resourceVersion read, so a concurrent change (the other replica setting the same CA on its
/// first start, or an apply) fails it with 409, and it reads again.
async fn ca_bundle(client: &kube::Client, ca: &str) -> Result<()> {
    let api = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    loop {
        let read =
            api.get_opt(WEBHOOK).await.with_context(|| format!("reading ValidatingWebhookConfiguration {WEBHOOK}"))?;
        let Some(w) = read else {
            tracing::warn!("no ValidatingWebhookConfiguration {WEBHOOK}: the drain guard is not installed");
            return Ok(());
        };
        let mut hooks = w.webhooks.unwrap_or_default();
        if hooks.iter().all(|h| h.client_config.ca_bundle.as_ref().is_some_and(|b| b.0 == ca.as_bytes())) {
            return Ok(());
        }
        for h in &mut hooks {
            h.client_config.ca_bundle = Some(ByteString(ca.as_bytes().to_vec()));
        }
        let patch =
            serde_json::json!({"metadata": {"resourceVersion": w.metadata.resource_version}, "webhooks": hooks});
        match api.patch(WEBHOOK, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {
                tracing::info!("the drain guard's caBundle is the cluster CA");
                return Ok(());
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e).with_context(|| format!("setting the caBundle of {WEBHOOK}")),
        }
    }
}

/// One round: the Secrets made or renewed as needed, the files and the caBundle brought in line.
async fn round(client: &kube::Client, o: &Options) -> Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), &o.namespace);
    let ca = ca(client, &api, o).await?;
    let (cert, key) = controller(&api, o, &ca).await?;
    put(&o.ca_dir.join("ca.key"), &ca.1, 0o600)?;
    put(&o.ca_dir.join("ca.crt"), &ca.0, 0o644)?;
    put(&o.tls_key, &key, 0o600)?;
    put(&o.tls_ca, &ca.0, 0o644)?;
    put(&o.tls_cert, &cert, 0o644)?;
    ca_bundle(client, &ca.0).await
}

/// Makes what is missing and writes the files, before the controller reads them.
pub async fn make(o: &Options) -> Result<()> {
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
    round(&client, o).await
}

/// Keeps them current, every [`EVERY`], for as long as the runtime runs.
pub fn keep(o: Options) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(EVERY).await;
            let done = async { round(&kube::Client::try_default().await?, &o).await };
            if let Err(e) = done.await {
                tracing::warn!("keeping the cluster certificates: {e:#}");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_certificate_is_current_when_named_issued_by_the_ca_and_young() {
        use ferrite_tls::certs::{issue, new_ca};
        let (a, b) = (new_ca(10).unwrap(), new_ca(10).unwrap());
        let names = vec![super::IDENTITY.to_owned(), "ferrite-controller.ferrite.svc".to_owned()];
        let cert = issue(&a.key_pem, super::LEGACY_IDENTITY, &names, 30).unwrap().cert_pem;
        assert!(super::current(&cert, &a.cert_pem, &names));
        assert!(!super::current(&cert, &b.cert_pem, &names), "another CA's");
        let more = [names.clone(), vec!["ferrite-controller.other.svc".to_owned()]].concat();
        assert!(!super::current(&cert, &a.cert_pem, &more), "a name missing");
        assert!(!super::current("not pem", &a.cert_pem, &names));
        // What the controller issues chains to the CA it was given.
        let (cert, _) = super::issue(&(b.cert_pem.clone(), b.key_pem.clone()), &names).unwrap();
        assert!(super::current(&cert, &b.cert_pem, &names) && !super::current(&cert, &a.cert_pem, &names));
    }
}
