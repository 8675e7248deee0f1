//! TLS with real clients: nbdinfo, nbdcopy (libnbd, GnuTLS) and qemu-img / qemu-io
//! (tls-creds-x509) over `NBD_OPT_STARTTLS` with client certificates; clients without a
//! certificate, with one from another CA, without the nbd-client role, or off an export's allow
//! list are refused, and so is plaintext where TLS is required. The admin API and the metrics endpoint over TCP take only
//! mutual TLS.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::csi::{certs, free_port};
use common::{Daemon, have};

/// A directory laid out as GnuTLS clients (libnbd, qemu) expect: ca-cert.pem and, for a client
/// with an identity, client-cert.pem / client-key.pem.
fn client_dir(root: &Path, name: &str, ca: &Path, identity: Option<(&Path, &str)>) -> PathBuf {
    let d = root.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(ca, d.join("ca-cert.pem")).unwrap();
    if let Some((pki, id)) = identity {
        std::fs::copy(pki.join(format!("{id}.pem")), d.join("client-cert.pem")).unwrap();
        std::fs::copy(pki.join(format!("{id}-key.pem")), d.join("client-key.pem")).unwrap();
    }
    d
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
}

struct Setup {
    _dir: tempfile::TempDir,
    d: Daemon,
    nbd: String,
    admin: String,
    metrics: String,
    pki: PathBuf,
    /// Client directories: with client-a's (operator), client-b's (no role), client-c's
    /// (nbd-client), no, and a stranger's certificate.
    a: PathBuf,
    b: PathBuf,
    c: PathBuf,
    anonymous: PathBuf,
    stranger: PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    certs(&pki, "server", &["127.0.0.1", "localhost"]);
    certs(&pki, "client-a", &[]);
    certs(&pki, "client-b", &[]);
    certs(&pki, "client-c", &[]);
    let other = dir.path().join("other-ca");
    certs(&other, "client-a", &[]); // the same name, from another CA
    let port = || format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let (nbd, admin, metrics) = (port(), port(), port());
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let p = |f: &str| pki.join(f).display().to_string();
    std::fs::write(
        data.join("ferrite.toml"),
        format!(
            "pool-size = \"1G\"\nsegment-size = \"4M\"\nnbd-listen = \"{nbd}\"\nadmin-listen = \"{admin}\"\n\
             metrics-listen = \"{metrics}\"\n\
             tls-cert = {:?}\ntls-key = {:?}\ntls-client-ca = {:?}\n[roles]\n\"client-a\" = \"operator\"\n\"client-c\" = \"nbd-client\"\n",
            p("server.pem"),
            p("server-key.pem"),
            p("ca.pem")
        ),
    )
    .unwrap();
    let d = Daemon::start(&data);
    let ca = pki.join("ca.pem");
    let clients = dir.path().join("clients");
    Setup {
        a: client_dir(&clients, "a", &ca, Some((&pki, "client-a"))),
        b: client_dir(&clients, "b", &ca, Some((&pki, "client-b"))),
        c: client_dir(&clients, "c", &ca, Some((&pki, "client-c"))),
        anonymous: client_dir(&clients, "anonymous", &ca, None),
        stranger: client_dir(&clients, "stranger", &ca, Some((&other, "client-a"))),
        _dir: dir,
        d,
        nbd,
        admin,
        metrics,
        pki,
    }
}

impl Setup {
    fn nbdinfo(&self, export: &str, certs: &Path, extra: &[&str]) -> Output {
        let uri = format!("nbds://{}/{export}?tls-certificates={}", self.nbd, certs.display());
        Command::new("nbdinfo").args(extra).arg(uri).output().unwrap()
    }

    fn qemu_io(&self, export: &str, certs: &Path, cmds: &[&str]) -> Output {
        let (host, port) = self.nbd.split_once(':').unwrap();
        let mut c = Command::new("qemu-io");
        c.args(["--object", &format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", certs.display())]);
        c.args(["--image-opts", &format!("driver=nbd,host={host},port={port},export={export},tls-creds=tls0")]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        c.output().unwrap()
    }

    fn admin_cli(&self, tls: &[&str], args: &[&str]) -> Output {
        Command::new(common::BIN).args(["--admin-tcp", &self.admin]).args(tls).args(args).output().unwrap()
    }
}

#[test]
fn nbd_over_tls_with_real_clients_and_who_is_refused() {
    if !have("nbdinfo") || !have("qemu-io") || !have("nbdcopy") {
        return;
    }
    let mut s = setup();
    s.d.ok(&["volume", "create", "db", "64M"]);
    let out = s.d.ok(&["export", "nbd", "db"]);
    assert!(out.contains(&format!("nbds://{}/db", s.nbd)), "TLS is required, so the URI is nbds://: {out}");
    s.d.ok(&["volume", "create", "secret", "16M"]);
    s.d.ok(&["export", "nbd", "secret", "--allow", "client-b"]);
    s.d.ok(&["volume", "create", "elsewhere", "16M"]);
    s.d.ok(&["export", "nbd", "elsewhere", "--allow", "10.9.0.0/16"]);
    let bad = s.d.cli(&["export", "nbd", "db", "--name", "x", "--allow", "not a name"]);
    assert!(!bad.status.success() && text(&bad).contains("allow"), "{}", text(&bad));

    // nbdinfo with a client certificate.
    let o = s.nbdinfo("db", &s.a, &["--size"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), (64u64 << 20).to_string());

    // qemu-io writes and reads back a pattern; nbdcopy copies the export out and back in.
    let o = s.qemu_io("db", &s.a, &["write -P 0x3c 1M 2M", "flush", "read -P 0x3c 1M 2M"]);
    assert!(o.status.success() && !text(&o).contains("Pattern verification failed"), "{}", text(&o));
    let copy = s._dir.path().join("copy.img");
    let uri = format!("nbds://{}/db?tls-certificates={}", s.nbd, s.a.display());
    let o = Command::new("nbdcopy").arg(&uri).arg(&copy).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let data = std::fs::read(&copy).unwrap();
    assert!(data[1 << 20..3 << 20].iter().all(|&b| b == 0x3c) && data[..1 << 20].iter().all(|&b| b == 0));
    let o = Command::new("nbdcopy").arg(&copy).arg(&uri).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    // Refused: plaintext, no client certificate, a certificate from another CA.
    let plain = Command::new("nbdinfo").arg(format!("nbd://{}/db", s.nbd)).output().unwrap();
    assert!(!plain.status.success(), "plaintext must be refused: {}", text(&plain));
    assert!(!s.nbdinfo("db", &s.anonymous, &[]).status.success(), "no client certificate");
    assert!(!s.nbdinfo("db", &s.stranger, &[]).status.success(), "a certificate from another CA");
    assert!(!s.qemu_io("db", &s.stranger, &["read 0 4k"]).status.success());

    // Allow lists: by identity, and by network; listing shows only what the client may open.
    // client-b has no role: it opens only what names it, never an export open to every client.
    assert!(!s.nbdinfo("secret", &s.a, &[]).status.success(), "client-a is not on secret's list");
    let o = s.nbdinfo("secret", &s.b, &["--size"]);
    assert!(o.status.success(), "client-b is: {}", text(&o));
    assert!(!s.nbdinfo("db", &s.b, &[]).status.success(), "client-b has no nbd-client role");
    assert!(!s.qemu_io("db", &s.b, &["read 0 4k"]).status.success(), "client-b has no nbd-client role");
    assert!(!s.nbdinfo("elsewhere", &s.a, &[]).status.success(), "127.0.0.1 is not in 10.9.0.0/16");
    let listed = |dir: &Path| {
        let o = s.nbdinfo("", dir, &["--list", "--json"]);
        assert!(o.status.success(), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let mut names: Vec<String> =
            v["exports"].as_array().unwrap().iter().map(|e| e["export-name"].as_str().unwrap().to_string()).collect();
        names.sort();
        names
    };
    assert_eq!(listed(&s.a), ["db"]);
    assert_eq!(listed(&s.b), ["secret"]);
    assert_eq!(listed(&s.c), ["db"]);
    assert!(s.d.stop().success(), "{}", s.d.log());
}

/// A publication (the export a controller makes for one node) opens only for that node, and
/// only while its identity holds nbd-client: a controller cannot open a volume to a certificate
/// without the role, as an operator's own allow list can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_opens_only_for_its_node_holding_nbd_client() {
    use ferrite_proto::ferrite::v1::{PublishVolumeRequest, admin_client::AdminClient};
    if !have("nbdinfo") {
        return;
    }
    let mut s = setup();
    let mut op = AdminClient::new(common::csi::tls_channel(&s.admin, &s.pki, "client-a").await);
    for (volume, node) in [("to-b", "client-b"), ("to-c", "client-c")] {
        s.d.ok(&["volume", "create", volume, "16M"]);
        let req = PublishVolumeRequest { volume: volume.into(), node: node.into(), local: false, read_only: false };
        op.publish_volume(req).await.unwrap();
    }
    let o = s.nbdinfo("csi-publish-to-c", &s.c, &["--size"]);
    assert!(o.status.success(), "client-c holds nbd-client and is named: {}", text(&o));
    assert!(!s.nbdinfo("csi-publish-to-c", &s.a, &[]).status.success(), "client-a is not the node named");
    let o = s.nbdinfo("csi-publish-to-b", &s.b, &[]);
    assert!(!o.status.success(), "client-b is named but holds no nbd-client: {}", text(&o));
    assert!(s.d.stop().success(), "{}", s.d.log());
}

#[test]
fn the_admin_api_over_tcp_takes_only_mutual_tls() {
    let mut s = setup();
    let p = |f: &str| s.pki.join(f).display().to_string();
    let (ca, cert, key) = (p("ca.pem"), p("client-a.pem"), p("client-a-key.pem"));
    let o = s.admin_cli(&["--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key], &["volume", "create", "t", "1M"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = s.admin_cli(&["--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key], &["volume", "list"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains('t'), "{}", text(&o));
    // Without a client certificate, in plaintext, or with another CA's certificate: refused.
    let other = s._dir.path().join("other-ca");
    let (ocert, okey) = (other.join("client-a.pem"), other.join("client-a-key.pem"));
    for tls in [
        vec!["--tls-ca", &ca],
        vec![],
        vec!["--tls-ca", &ca, "--tls-cert", ocert.to_str().unwrap(), "--tls-key", okey.to_str().unwrap()],
    ] {
        let o = s.admin_cli(&tls, &["volume", "list"]);
        assert!(!o.status.success(), "admin over TCP with {tls:?} must be refused");
    }
    // A certificate of the cluster CA that no role names may call nothing.
    let (bcert, bkey) = (p("client-b.pem"), p("client-b-key.pem"));
    let o = s.admin_cli(&["--tls-ca", &ca, "--tls-cert", &bcert, "--tls-key", &bkey], &["volume", "list"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("ListVolumes"), "a certificate with no role reached a call: {err}");
    // The volume made over mutual TLS is really there.
    assert!(s.d.ok(&["volume", "list"]).contains('t'));
    assert!(s.d.stop().success(), "{}", s.d.log());
}

#[test]
fn the_metrics_endpoint_takes_only_mutual_tls() {
    use std::io::{Read, Write};
    let mut s = setup();
    let p = |f: &str| s.pki.join(f);
    let scrape = |identity: Option<(&Path, &Path)>| common::scrape_tls(&s.metrics, &p("ca.pem"), identity);
    // A certificate with no role (client-b) calling the admin API.
    let (ca, bcert, bkey) = (p("ca.pem"), p("client-b.pem"), p("client-b-key.pem"));
    let tls = [ca.to_str().unwrap(), bcert.to_str().unwrap(), bkey.to_str().unwrap()];
    let o = s.admin_cli(&["--tls-ca", tls[0], "--tls-cert", tls[1], "--tls-key", tls[2]], &["volume", "list"]);
    assert!(!o.status.success());
    let (cert, key) = (p("client-a.pem"), p("client-a-key.pem"));
    let m = scrape(Some((&cert, &key))).unwrap();
    assert!(m.starts_with("HTTP/1.1 200") && m.contains("ferrite_pool_size_bytes"), "{m}");
    // ... it was closed right after its handshake, and counted.
    // (the client may have opened it more than once).
    let closed =
        m.lines().find_map(|l| l.strip_prefix("ferrite_admin_connections_no_role_total ")?.parse::<u64>().ok());
    assert!(closed.is_some_and(|n| n >= 1), "{m}");
    // No client certificate: the handshake (or the first read after it) fails.
    assert!(scrape(None).map_or(true, |t| !t.contains("200 OK")), "a scrape without a certificate must fail");
    // Plaintext: no HTTP answer.
    let mut plain = std::net::TcpStream::connect(&s.metrics).unwrap();
    plain.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    let _ = plain.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut text = String::new();
    let _ = plain.read_to_string(&mut text);
    assert!(!text.contains("HTTP/1.1"), "{text}");
    assert!(s.d.stop().success(), "{}", s.d.log());
}
