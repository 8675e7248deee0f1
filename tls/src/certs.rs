//! A small certificate authority for a test or a small cluster (`ferrite certs`): one CA, and
//! certificates it signs, each valid as a server and as a client certificate, naming its
//! identities (DNS names, IP addresses) in subjectAltName. ECDSA P-256 keys.
//!
//! The CA's distinguished name is fixed, so a later run can issue more certificates from the
//! CA's key alone. Use your own PKI for anything larger.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType, DnValue, ExtendedKeyUsagePurpose,
    IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate and its private key, in PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

const DAY: u64 = 86_400;

/// At most a century: every date stays within what X.509 and `time` represent.
const MAX_DAYS: u32 = 36_500;

fn validity(params: &mut CertificateParams, days: u32) {
    lifetime(params, Duration::from_secs(u64::from(days.min(MAX_DAYS)) * DAY));
}

fn lifetime(params: &mut CertificateParams, valid: Duration) {
    let valid = valid.min(Duration::from_secs(u64::from(MAX_DAYS) * DAY));
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let at = |d: Duration| {
        time::OffsetDateTime::from_unix_timestamp(i64::try_from(d.as_secs()).expect("seconds since 1970 fit"))
            .expect("a date within a century from now is in range")
    };
    // An hour of slack for clocks a little apart.
    params.not_before = at(now.saturating_sub(Duration::from_secs(3600)));
    params.not_after = at(now + valid);
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, "Ferrite CA");
    p.distinguished_name.push(DnType::OrganizationName, "Ferrite");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    p
}

/// A new CA, valid for `days`.
pub fn new_ca(days: u32) -> Result<Issued, rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut p = ca_params();
    validity(&mut p, days);
    let cert = p.self_signed(&key)?;
    Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// Whether `name` is a URI identity (`spiffe://…`): one a role is bound to, which no DNS name
/// or IP address (a node's name, its addresses) can ever be.
pub fn is_uri(name: &str) -> bool {
    name.contains("://")
}

/// Params naming `sans`: URIs (see [`is_uri`]) as URI names, IP addresses as such, the rest as
/// DNS names.
fn params(sans: &[String]) -> Result<CertificateParams, rcgen::Error> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    for n in sans {
        p.subject_alt_names.push(match n.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) if is_uri(n) => SanType::URI(n.as_str().try_into()?),
            Err(_) => SanType::DnsName(n.as_str().try_into()?),
        });
    }
    Ok(p)
}

/// A certificate for `name`, valid for `days`, signed by the CA whose key is `ca_key_pem` (one
/// [`new_ca`] made). `sans` are its identities: DNS names, IP addresses (IPs as such) and URIs.
pub fn issue(ca_key_pem: &str, name: &str, sans: &[String], days: u32) -> Result<Issued, rcgen::Error> {
    let issuer = Issuer::new(ca_params(), KeyPair::from_pem(ca_key_pem)?);
    let mut p = params(sans)?;
    p.distinguished_name.push(DnType::CommonName, name);
    leaf(&mut p);
    validity(&mut p, days);
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer)?;
    Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// What every certificate Ferrite issues may do: serve and be a client, nothing else.
fn leaf(p: &mut CertificateParams) {
    p.is_ca = IsCa::ExplicitNoCa;
    // GnuTLS clients (qemu's tls-creds-x509) insist on keyEncipherment too, even for ECDSA.
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    p.use_authority_key_identifier_extension = true;
}

/// A new ECDSA P-256 private key, in PEM (PKCS#8).
pub fn new_key() -> Result<String, rcgen::Error> {
    Ok(KeyPair::generate()?.serialize_pem())
}

/// A certificate signing request (PKCS#10, PEM) for `name` naming `sans`, by the key `key_pem`.
pub fn request(key_pem: &str, name: &str, sans: &[String]) -> Result<String, rcgen::Error> {
    let mut p = params(sans)?;
    p.distinguished_name.push(DnType::CommonName, name);
    p.serialize_request(&KeyPair::from_pem(key_pem)?)?.pem()
}

/// A signing request read, its signature checked (proof that the requester holds the key).
#[derive(Debug)]
pub struct Request(CertificateSigningRequestParams);

impl Request {
    pub fn parse(pem: &str) -> Result<Self, rcgen::Error> {
        CertificateSigningRequestParams::from_pem(pem).map(Self)
    }

    /// The subject's common name, if it has exactly one and nothing else.
    pub fn common_name(&self) -> Option<String> {
        let dn = &self.0.params.distinguished_name;
        if dn.iter().count() != 1 {
            return None;
        }
        match dn.get(&DnType::CommonName)? {
            DnValue::Utf8String(s) => Some(s.clone()),
            DnValue::PrintableString(s) => Some(s.as_str().to_owned()),
            _ => None,
        }
    }

    /// The DNS names and IP addresses it asks for; an error names any other kind of name (a URI
    /// among them: what roles are bound to is never asked for).
    pub fn names(&self) -> Result<Vec<String>, String> {
        self.0
            .params
            .subject_alt_names
            .iter()
            .map(|n| match n {
                SanType::DnsName(d) => Ok(d.as_str().to_owned()),
                SanType::IpAddress(ip) => Ok(ip.to_string()),
                other => Err(format!("a subjectAltName that is no DNS name or IP address: {other:?}")),
            })
            .collect()
    }

    /// Signs it with the CA `ca_cert_pem`/`ca_key_pem` for `valid`: its subject and names as
    /// asked, the usages of every certificate Ferrite issues (whatever the request asked).
    pub fn sign(mut self, ca_cert_pem: &str, ca_key_pem: &str, valid: Duration) -> Result<String, rcgen::Error> {
        let issuer = Issuer::from_ca_cert_pem(ca_cert_pem, KeyPair::from_pem(ca_key_pem)?)?;
        leaf(&mut self.0.params);
        lifetime(&mut self.0.params, valid);
        Ok(self.0.signed_by(&issuer)?.pem())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{CertificateDer, client_config, names, server_config};

    fn der(pem: &str) -> CertificateDer<'static> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    /// A whole handshake in memory; the server's side once done.
    fn handshake(
        client: Arc<rustls::ClientConfig>,
        server: Arc<rustls::ServerConfig>,
    ) -> Result<rustls::ServerConnection, rustls::Error> {
        let mut c = rustls::ClientConnection::new(client, "node-a".try_into().unwrap())?;
        let mut s = rustls::ServerConnection::new(server)?;
        while c.is_handshaking() || s.is_handshaking() {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets()?;
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets()?;
        }
        Ok(s)
    }

    #[test]
    fn a_signed_request_carries_its_names_and_only_leaf_usages() {
        let ca = new_ca(30).unwrap();
        let key = new_key().unwrap();
        let pem =
            request(&key, "node-a", &["node-a".into(), "10.0.0.5".into(), "ferrite-node.ferrite.svc".into()]).unwrap();
        let r = Request::parse(&pem).unwrap();
        assert_eq!(r.common_name().as_deref(), Some("node-a"));
        assert_eq!(r.names().unwrap(), ["node-a", "10.0.0.5", "ferrite-node.ferrite.svc"]);
        let cert = r.sign(&ca.cert_pem, &ca.key_pem, Duration::from_secs(3 * DAY)).unwrap();
        let der = der(&cert);
        assert_eq!(crate::identities(&der), ["node-a", "10.0.0.5", "ferrite-node.ferrite.svc"]);
        let (from, to) = crate::validity(&der).unwrap();
        assert_eq!(to - from, 3 * 86_400 + 3600, "the lifetime asked, plus the hour of clock slack");
        let (_, c) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
        assert!(!c.is_ca(), "a signed request never makes a CA, whatever it asked");
        // A request whose signature does not match its key (tampered with) is refused.
        use rustls::pki_types::CertificateSigningRequestDer as Der;
        use rustls::pki_types::pem::PemObject;
        let mut bytes = Der::from_pem_slice(pem.as_bytes()).unwrap().as_ref().to_vec();
        let at = bytes.windows(6).position(|w| w == b"node-a").unwrap();
        bytes[at + 5] = b'b';
        let forged = CertificateSigningRequestParams::from_der(&Der::from(bytes));
        assert!(forged.is_err(), "a request whose signature does not verify is refused");
        // A request for a CA, or for an e-mail name, is read but its names say so.
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.subject_alt_names.push(SanType::Rfc822Name("a@b.c".try_into().unwrap()));
        let odd = p.serialize_request(&KeyPair::from_pem(&key).unwrap()).unwrap().pem().unwrap();
        assert!(Request::parse(&odd).unwrap().names().is_err());
    }

    #[test]
    fn a_certificate_is_its_sans_alone_and_no_wildcard_matches() {
        use crate::identities;
        let ca = new_ca(30).unwrap();
        let both = der(&issue(&ca.key_pem, "csi", &["not-csi".into(), "10.0.0.7".into()], 30).unwrap().cert_pem);
        assert_eq!(identities(&both), ["not-csi", "10.0.0.7"], "the CN of a certificate with SANs is no identity");
        assert!(!names(&both, "csi") && names(&both, "NOT-CSI") && names(&both, "10.0.0.7"));
        let cn_only = der(&issue(&ca.key_pem, "csi", &[], 30).unwrap().cert_pem);
        assert_eq!(identities(&cn_only), ["csi"]);
        let wild = der(&issue(&ca.key_pem, "w", &["*.cluster.test".into()], 30).unwrap().cert_pem);
        assert!(!names(&wild, "node-a.cluster.test") && !names(&wild, "*.cluster.test"));
    }

    #[test]
    fn a_uri_identity_is_issued_but_never_asked_for() {
        use crate::identities;
        let ca = new_ca(30).unwrap();
        let sans = ["spiffe://ferrite.dev/controller".to_owned(), "ferrite-controller.ferrite.svc".to_owned()];
        let cert = der(&issue(&ca.key_pem, "ferrite-controller", &sans, 30).unwrap().cert_pem);
        assert_eq!(identities(&cert), sans);
        assert!(names(&cert, "spiffe://ferrite.dev/controller") && !names(&cert, "ferrite-controller"));
        // A node's request naming it is read, and refused by its names.
        let key = new_key().unwrap();
        let asked = request(&key, "node-a", &["node-a".into(), sans[0].clone()]).unwrap();
        let e = Request::parse(&asked).unwrap().names().unwrap_err();
        assert!(e.contains("no DNS name or IP address"), "{e}");
    }

    #[test]
    fn issued_certificates_carry_their_names_and_make_working_configs() {
        let dir = tempfile::tempdir().unwrap();
        let ca = new_ca(30).unwrap();
        let srv = issue(&ca.key_pem, "node-a", &["node-a".into(), "127.0.0.1".into()], 30).unwrap();
        let cli = issue(&ca.key_pem, "csi", &["csi".into()], 30).unwrap();
        assert!(names(&der(&srv.cert_pem), "node-a") && names(&der(&srv.cert_pem), "127.0.0.1"));
        assert!(!names(&der(&srv.cert_pem), "csi") && names(&der(&cli.cert_pem), "csi"));
        assert!(!names(&der(&cli.cert_pem), "not a name"));
        let w = |n: &str, s: &str| {
            let p = dir.path().join(n);
            std::fs::write(&p, s).unwrap();
            p
        };
        let (ca_pem, sc, sk, cc, ck) = (
            w("ca.pem", &ca.cert_pem),
            w("s.pem", &srv.cert_pem),
            w("s.key", &srv.key_pem),
            w("c.pem", &cli.cert_pem),
            w("c.key", &cli.key_pem),
        );
        let server = server_config(&sc, &sk, Some(&ca_pem), &[]).unwrap();
        let client = client_config(&ca_pem, Some((&cc, &ck)), &[]).unwrap();
        let s = handshake(client, Arc::clone(&server)).unwrap();
        assert!(names(&s.peer_certificates().unwrap()[0], "csi"), "the server sees the verified client");
        // A client certificate from another CA is refused.
        let other = new_ca(30).unwrap();
        let stranger = issue(&other.key_pem, "csi", &["csi".into()], 30).unwrap();
        let (xc, xk) = (w("x.pem", &stranger.cert_pem), w("x.key", &stranger.key_pem));
        let client = client_config(&ca_pem, Some((&xc, &xk)), &[]).unwrap();
        assert!(handshake(client, server).is_err());
    }
}
