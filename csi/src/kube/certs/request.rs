//! A node's side (`ferrite node-cert`): the daemon pod's init container makes sure the node has
//! a certificate for its current names, valid for a good while, before the daemon starts; the
//! pod's `node-cert --renew` container does it again whenever two thirds of the lifetime have
//! passed (the daemon's listeners reload the files). The key stays: it is made once on the node
//! (0600 in a 0700 directory) and never leaves it, so a renewal changes only `tls.crt`.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use k8s_openapi::api::core::v1::Node;
use kube::api::{ObjectMeta, PostParams};
use sha2::Digest;

use super::{SIGNER, USAGES, names_service, node_names};
use crate::shared::nodes::kubernetes::RESTRICTED_STORAGE;

/// What `ferrite node-cert` is asked for.
#[derive(Debug, Clone)]
pub struct Options {
    /// This node's name (the pod's spec.nodeName).
    pub node: String,
    /// Where tls.key, tls.crt and ca.crt live (the daemon's tls-* files).
    pub dir: PathBuf,
    /// The node Service's DNS name, which every node's certificate carries.
    pub service: String,
    /// The lifetime asked for (the signer may give less).
    pub lifetime: Duration,
    /// How long to wait for the signer's answer.
    pub wait: Duration,
    /// With renewal: how often the files are looked at between renewals (a removed
    /// certificate, a node whose address changed).
    pub check_every: Duration,
}

/// The node's certificate, as it is after a call.
#[derive(Debug, Clone, Copy)]
pub struct Held {
    /// When it should be renewed (seconds since 1970): two thirds into its lifetime.
    pub renew_at: i64,
    pub not_after: i64,
    /// Whether this call had a new one issued.
    pub issued: bool,
}

pub(super) fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The certificate in `dir` if it names exactly `names` and has a key and a CA beside it.
fn current(dir: &Path, names: &[String]) -> Option<Held> {
    if !dir.join("tls.key").exists() || !dir.join("ca.crt").exists() {
        return None;
    }
    let cert = ferrite_tls::load_certs(&dir.join("tls.crt")).ok()?.into_iter().next()?;
    let mut has = ferrite_tls::identities(&cert);
    let mut want = names.to_vec();
    has.sort();
    want.sort();
    if has != want {
        return None;
    }
    let (from, to) = ferrite_tls::validity(&cert)?;
    Some(Held { renew_at: from + (to - from) * 2 / 3, not_after: to, issued: false })
}

/// Writes `text` to `dir/name` through a file beside it and a rename, so that a reader (the
/// daemon's reload) sees the old file or the new one, never half of one.
pub(super) fn replace(dir: &Path, name: &str, text: &str, mode: u32) -> Result<()> {
    let tmp = dir.join(format!(".{name}.new"));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name)).with_context(|| format!("replacing {}", dir.join(name).display()))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// The node's key, made on first use.
fn key(dir: &Path) -> Result<String> {
    let path = dir.join("tls.key");
    match std::fs::read_to_string(&path) {
        Ok(k) => Ok(k),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let k = ferrite_tls::certs::new_key().context("making the node's key")?;
            replace(dir, "tls.key", &k, 0o600)?;
            Ok(k)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Splits the signer's answer: the node's certificate first, the CA after it.
fn split(pem: &str) -> Result<(String, String)> {
    const END: &str = "-----END CERTIFICATE-----";
    let at = pem.find(END).map(|i| i + END.len()).context("the issued certificate holds no PEM certificate")?;
    let (leaf, rest) = pem.split_at(at);
    if !rest.contains("-----BEGIN CERTIFICATE-----") {
        bail!("the signer sent no CA after the node's certificate");
    }
    Ok((format!("{}\n", leaf.trim()), format!("{}\n", rest.trim())))
}

/// Whether the certificate of `node` names the node Service ([`names_service`]), judged as the
/// signer does: whether any Node is labelled [`RESTRICTED_STORAGE`].
async fn storage(client: &kube::Client, node: &Node) -> Result<bool> {
    let lp = kube::api::ListParams::default().labels(RESTRICTED_STORAGE).limit(1);
    let any = kube::Api::<Node>::all(client.clone()).list_metadata(&lp).await.context("listing the Nodes")?;
    let restricted = !any.items.is_empty();
    Ok(names_service(node, restricted))
}

/// Makes sure the node has a certificate for its current names that is not due for renewal,
/// having one issued if not; the directory is locked meanwhile (two pods of the node may ask).
pub async fn ensure(o: &Options) -> Result<Held> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&o.dir)
        .with_context(|| format!("creating {}", o.dir.display()))?;
    let lock = std::fs::File::open(&o.dir).with_context(|| format!("opening {}", o.dir.display()))?;
    let lock = tokio::task::spawn_blocking(move || {
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).map(|()| lock)
    })
    .await?
    .context("locking the certificate directory")?;
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
    let node: Node =
        kube::Api::all(client.clone()).get(&o.node).await.with_context(|| format!("reading Node {}", o.node))?;
    let names = node_names(&node, &o.service, storage(&client, &node).await?);
    if let Some(h) = current(&o.dir, &names).filter(|h| h.renew_at > now()) {
        return Ok(h);
    }
    let key = key(&o.dir)?;
    let pem = ferrite_tls::certs::request(&key, &o.node, &names).context("making the signing request")?;
    // Named after the request: a retry (a restarted init container) finds its own.
    let digest = sha2::Sha256::digest(pem.as_bytes());
    let id: String = digest.iter().take(5).map(|b| format!("{b:02x}")).collect();
    let name = format!("ferrite-{}-{id}", o.node);
    let csr = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(BTreeMap::from([
                ("app.kubernetes.io/part-of".to_owned(), "ferrite".to_owned()),
                ("ferrite.dev/node".to_owned(), o.node.clone()),
            ])),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(pem.into_bytes()),
            signer_name: SIGNER.to_owned(),
            usages: Some(USAGES.iter().map(|u| (*u).to_owned()).collect()),
            expiration_seconds: Some(i32::try_from(o.lifetime.as_secs()).unwrap_or(i32::MAX)),
            ..Default::default()
        },
        status: None,
    };
    let api = kube::Api::<CertificateSigningRequest>::all(client);
    match api.create(&PostParams::default(), &csr).await {
        Ok(_) => tracing::info!(csr = %name, names = ?names, "certificate requested"),
        Err(kube::Error::Api(e)) if e.code == 409 => tracing::info!(csr = %name, "certificate request already made"),
        Err(e) => return Err(e).with_context(|| format!("creating CertificateSigningRequest {name}")),
    }
    let deadline = tokio::time::Instant::now() + o.wait;
    let issued = loop {
        let csr = api.get(&name).await.with_context(|| format!("reading CertificateSigningRequest {name}"))?;
        let status = csr.status.unwrap_or_default();
        if let Some(c) = status.conditions.iter().flatten().find(|c| c.type_ == "Denied" || c.type_ == "Failed") {
            bail!(
                "CertificateSigningRequest {name} was {}: {}",
                c.type_.to_lowercase(),
                c.message.as_deref().or(c.reason.as_deref()).unwrap_or("no reason given")
            );
        }
        if let Some(cert) = status.certificate.filter(|c| !c.0.is_empty()) {
            break String::from_utf8(cert.0).context("the issued certificate is not PEM text")?;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "CertificateSigningRequest {name} got no answer from the signer {SIGNER} in {:?} (is the controller running with --signer-ca?)",
                o.wait
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let (leaf, ca) = split(&issued)?;
    replace(&o.dir, "ca.crt", &ca, 0o644)?;
    replace(&o.dir, "tls.crt", &leaf, 0o644)?;
    let held = current(&o.dir, &names).context("the issued certificate does not carry the names asked for")?;
    drop(lock);
    Ok(Held { issued: true, ..held })
}

/// Renews the node's certificate whenever it is due (looking every `check_every`), until
/// `shutdown`; a failed attempt is tried again a minute later (the current certificate stays in
/// use meanwhile).
pub async fn renew(o: &Options, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let wait = match ensure(o).await {
            Ok(h) => {
                if h.issued {
                    tracing::info!(not_after = h.not_after, "node certificate renewed");
                }
                Duration::from_secs(u64::try_from(h.renew_at - now()).unwrap_or(0)).min(o.check_every)
            }
            Err(e) => {
                tracing::warn!("renewing the node certificate: {e:#}; trying again in a minute");
                Duration::from_secs(60)
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = &mut shutdown => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_splits_into_the_certificate_and_its_ca() {
        let ca = ferrite_tls::certs::new_ca(1).unwrap();
        let leaf = ferrite_tls::certs::issue(&ca.key_pem, "node-a", &["node-a".into()], 1).unwrap();
        let (l, c) = split(&format!("{}{}", leaf.cert_pem, ca.cert_pem)).unwrap();
        assert_eq!((l.trim(), c.trim()), (leaf.cert_pem.trim(), ca.cert_pem.trim()));
        assert!(split(&leaf.cert_pem).unwrap_err().to_string().contains("no CA"));
        assert!(split("garbage").is_err());
    }

    #[test]
    fn a_certificate_is_current_only_for_the_names_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ferrite_tls::certs::new_ca(1).unwrap();
        let names: Vec<String> = vec!["node-a".into(), "10.0.0.5".into(), "ferrite-node.ferrite.svc".into()];
        let leaf = ferrite_tls::certs::issue(&ca.key_pem, "node-a", &names, 3).unwrap();
        assert!(current(dir.path(), &names).is_none(), "nothing there yet");
        replace(dir.path(), "tls.key", &leaf.key_pem, 0o600).unwrap();
        replace(dir.path(), "tls.crt", &leaf.cert_pem, 0o644).unwrap();
        replace(dir.path(), "ca.crt", &ca.cert_pem, 0o644).unwrap();
        let h = current(dir.path(), &names).unwrap();
        assert!(h.renew_at > now() + 86_400 && h.renew_at < h.not_after, "renewed two thirds into three days");
        let moved = vec!["node-a".to_owned(), "10.0.0.6".into(), "ferrite-node.ferrite.svc".into()];
        assert!(current(dir.path(), &moved).is_none(), "a node whose address changed needs a new certificate");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir.path().join("tls.key")).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
    }
}
