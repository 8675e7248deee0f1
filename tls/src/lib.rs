//! TLS for Ferrite's listeners (NBD, admin API, metrics) and clients (CLI, CSI driver): rustls
//! with the ring provider, X.509 certificates and keys in PEM files, client certificates
//! verified against a CA (mutual TLS), and the client identities allow lists name.
//!
//! ```text
//!  ca.pem ─► roots ─► server: client certificates must chain to it (mutual TLS)
//!                 └─► client: the server's certificate must chain to it
//!  identity = a DNS name (or IP) in the certificate's subjectAltName, as webpki checks it
//! ```
//! [`certs`] makes a CA and certificates signed by it, for a test or a small cluster
//! (`ferrite certs`).

pub mod certs;
pub mod reload;
mod stream;

use std::io;
use std::path::Path;
use std::sync::Arc;

pub use reload::Reloading;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
pub use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
/// A listener's TLS config, following its files.
pub type ServerTls = Reloading<ServerConfig>;
pub use stream::Stream;
pub use tokio_rustls::{TlsAcceptor, TlsConnector};
pub use {rustls, tokio_rustls};

/// The one crypto provider every config uses (named, not process-wide, so no other crate's
/// choice can change it).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// The certificates of a PEM file (a chain: leaf first).
pub fn load_certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let read = |e: rustls::pki_types::pem::Error| invalid(format!("reading certificates from {}: {e}", path.display()));
    let certs = CertificateDer::pem_file_iter(path).map_err(read)?.collect::<Result<Vec<_>, _>>().map_err(read)?;
    if certs.is_empty() {
        return Err(invalid(format!("{} holds no PEM certificate", path.display())));
    }
    Ok(certs)
}

/// The certificates of PEM text.
pub fn certs_from_pem(text: &str) -> io::Result<Vec<CertificateDer<'static>>> {
    let read = |e: rustls::pki_types::pem::Error| invalid(format!("reading certificates: {e}"));
    CertificateDer::pem_slice_iter(text.as_bytes()).collect::<Result<Vec<_>, _>>().map_err(read)
}

/// Whether `cert` is valid now and signed by the first certificate of `ca_pem` (as a TLS
/// server's certificate).
pub fn issued_by(cert: &CertificateDer<'_>, ca_pem: &str) -> bool {
    let Some(ca) = certs_from_pem(ca_pem).ok().and_then(|c| c.into_iter().next()) else { return false };
    let (Ok(anchor), Ok(leaf)) = (webpki::anchor_from_trusted_cert(&ca), webpki::EndEntityCert::try_from(cert)) else {
        return false;
    };
    let now = rustls::pki_types::UnixTime::now();
    let algs = provider().signature_verification_algorithms.all;
    leaf.verify_for_usage(algs, &[anchor], &[], now, webpki::KeyUsage::server_auth(), None, None).is_ok()
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> io::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| invalid(format!("reading a private key from {}: {e}", path.display())))
}

fn roots(ca: &Path) -> io::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(ca)? {
        roots.add(c).map_err(|e| invalid(format!("CA certificate in {}: {e}", ca.display())))?;
    }
    Ok(roots)
}

fn tls_error(what: &str) -> impl Fn(rustls::Error) -> io::Error + '_ {
    move |e| invalid(format!("{what}: {e}"))
}

/// A server config: this certificate and key, and with `client_ca`, client certificates
/// required and verified against it. `alpn` lists the application protocols offered.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> io::Result<Arc<ServerConfig>> {
    let verifier = match client_ca {
        Some(ca) => WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
            .build()
            .map_err(|e| invalid(format!("client CA {}: {e}", ca.display())))?,
        None => WebPkiClientVerifier::no_client_auth(),
    };
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(tls_error("TLS protocol versions"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .map_err(tls_error(&format!("server certificate {} with key {}", cert.display(), key.display())))?;
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// A client config: servers must present a certificate signed by `ca`; with `identity`
/// (certificate, key), this client presents its own.
pub fn client_config(ca: &Path, identity: Option<(&Path, &Path)>, alpn: &[&[u8]]) -> io::Result<Arc<ClientConfig>> {
    let b = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(tls_error("TLS protocol versions"))?
        .with_root_certificates(roots(ca)?);
    let mut cfg = match identity {
        Some((cert, key)) => b
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(tls_error(&format!("client certificate {}", cert.display())))?,
        None => b.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// The name a client expects in the server's certificate: the host part of `host:port` (an IP
/// address or a DNS name).
pub fn server_name(addr: &str) -> io::Result<ServerName<'static>> {
    let host = match addr.rsplit_once(':') {
        Some((h, port)) if port.parse::<u16>().is_ok() => h,
        _ => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).map_err(|e| invalid(format!("{host:?} is not a host name: {e}")))
}

/// Whether a (verified) certificate names `identity`: one of its [`identities`], matched
/// exactly. A wildcard never matches: a configured name is a name, not a pattern.
pub fn names(cert: &CertificateDer<'_>, identity: &str) -> bool {
    !identity.contains('*') && identities(cert).iter().any(|n| same_name(n, identity))
}

/// Whether two names are the same identity: IP addresses compared as addresses, DNS names
/// without regard to ASCII case.
pub fn same_name(a: &str, b: &str) -> bool {
    match (a.parse::<std::net::IpAddr>(), b.parse::<std::net::IpAddr>()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a.eq_ignore_ascii_case(b),
    }
}

/// The identity function of every listener (roles, relations, publications, NBD allow lists):
/// the DNS names, IP addresses and URIs of a (verified) certificate's subjectAltName; its subject's
/// common names only when it has no such name at all (RFC 6125: a certificate with SANs is
/// identified by them alone). A wildcard name is kept as written, so it equals no configured
/// name. Empty for a certificate that does not parse.
pub fn identities(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, c)) = x509_parser::parse_x509_certificate(cert.as_ref()) else { return Vec::new() };
    let mut out = Vec::new();
    if let Ok(Some(san)) = c.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) | GeneralName::URI(d) => out.push((*d).to_owned()),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => out.push(std::net::IpAddr::from(<[u8; 4]>::try_from(*b).expect("4 bytes")).to_string()),
                    16 => out.push(std::net::IpAddr::from(<[u8; 16]>::try_from(*b).expect("16 bytes")).to_string()),
                    _ => {}
                },
                _ => {}
            }
        }
    }
    if out.is_empty() {
        out.extend(c.subject().iter_common_name().filter_map(|a| a.as_str().ok()).map(str::to_owned));
    }
    out
}

/// A certificate's validity, as seconds since 1970: (not before, not after). None if it does
/// not parse.
pub fn validity(cert: &CertificateDer<'_>) -> Option<(i64, i64)> {
    let (_, c) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    Some((c.validity().not_before.timestamp(), c.validity().not_after.timestamp()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_from_addresses() {
        assert!(matches!(server_name("127.0.0.1:7070").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("[::1]:7070").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("node-a.example:7070").unwrap(), ServerName::DnsName(_)));
        assert!(server_name("bad name:1").is_err());
    }

    #[test]
    fn unreadable_files_say_which() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        assert!(load_certs(&empty).unwrap_err().to_string().contains("empty.pem"));
        assert!(load_key(&dir.path().join("missing.pem")).unwrap_err().to_string().contains("missing.pem"));
    }
}
