//! A small certificate authority for a test or a small cluster (`ferrite certs`): one CA, and
//! certificates it signs, each valid as a server and as a client certificate, naming its
//! identities (DNS names, IP addresses) in subjectAltName. ECDSA P-256 keys.
//!
//! The CA's distinguished name is fixed, so a later run can issue more certificates from the
//! CA's key alone. Use your own PKI for anything larger.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
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
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let at = |d: Duration| {
        time::OffsetDateTime::from_unix_timestamp(i64::try_from(d.as_secs()).expect("seconds since 1970 fit"))
            .expect("a date within a century from now is in range")
    };
    // An hour of slack for clocks a little apart.
    params.not_before = at(now.saturating_sub(Duration::from_secs(3600)));
    params.not_after = at(now + Duration::from_secs(u64::from(days.min(MAX_DAYS)) * DAY));
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

/// A certificate for `name`, valid for `days`, signed by the CA whose key is `ca_key_pem` (one
/// [`new_ca`] made). `sans` are its identities: DNS names and IP addresses (IPs as such).
pub fn issue(ca_key_pem: &str, name: &str, sans: &[String], days: u32) -> Result<Issued, rcgen::Error> {
    let issuer = Issuer::new(ca_params(), KeyPair::from_pem(ca_key_pem)?);
    let mut p = CertificateParams::new(sans.to_vec())?;
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::ExplicitNoCa;
    // GnuTLS clients (qemu's tls-creds-x509) insist on keyEncipherment too, even for ECDSA.
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    p.use_authority_key_identifier_extension = true;
    validity(&mut p, days);
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer)?;
    Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
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
