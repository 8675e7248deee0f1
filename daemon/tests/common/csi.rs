//! A `ferrite csi` process and request builders shared by the CSI tests.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferrite_proto::csi::v1 as csi;
use tonic::transport::Channel;

use super::{BIN, Daemon};

pub struct Csi {
    child: Child,
}

impl Drop for Csi {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `ferrite csi ARGS` on `dir/csi.sock` with a node directory of `nodes`' admin sockets.
pub fn start_csi(dir: &Path, nodes: &[(&str, &Daemon)], args: &[&str]) -> Csi {
    let nodes: Vec<(&str, String)> = nodes.iter().map(|(n, d)| (*n, d.admin().display().to_string())).collect();
    start_csi_with(dir, &nodes, args)
}

/// The same with a node directory of admin endpoints (socket paths or `tcp://host:port`; an
/// empty one: a node without storage).
pub fn start_csi_with(dir: &Path, nodes: &[(&str, String)], args: &[&str]) -> Csi {
    let directory = dir.join("nodes.toml");
    let without: Vec<&str> = nodes.iter().filter(|(_, e)| e.is_empty()).map(|(n, _)| *n).collect();
    let mut text = format!("without-storage = {without:?}\n[nodes]\n");
    for (name, endpoint) in nodes.iter().filter(|(_, e)| !e.is_empty()) {
        text.push_str(&format!("{name} = {endpoint:?}\n"));
    }
    std::fs::write(&directory, text).unwrap();
    let log = std::fs::File::create(dir.join("csi.log")).unwrap();
    // With the test's PKI (see `tcp_node`), the driver reaches the daemons over mutual TLS.
    let pki = dir.join("pki");
    let tls: Vec<std::path::PathBuf> = if pki.join("csi.pem").exists() {
        vec![
            "--tls-ca".into(),
            pki.join("ca.pem"),
            "--tls-cert".into(),
            pki.join("csi.pem"),
            "--tls-key".into(),
            pki.join("csi-key.pem"),
        ]
    } else {
        Vec::new()
    };
    let child = Command::new(BIN)
        .args(tls)
        .arg("csi")
        .args(args)
        .arg("--endpoint")
        .arg(dir.join("csi.sock"))
        .arg("--node-directory")
        .arg(&directory)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    Csi { child }
}

pub async fn channel(sock: &Path) -> Channel {
    let start = Instant::now();
    loop {
        if let Ok(c) = ferrite_proto::connect_unix(sock).await {
            return c;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "CSI endpoint did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn mount_cap(mode: csi::volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(csi::volume_capability::AccessType::Mount(csi::volume_capability::MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    }
}

pub fn on_node(node: &str) -> Option<csi::TopologyRequirement> {
    let t = csi::Topology { segments: HashMap::from([("topology.ferrite.dev/node".into(), node.into())]) };
    Some(csi::TopologyRequirement { requisite: vec![t.clone()], preferred: vec![t] })
}

pub fn create(name: &str, bytes: i64, node: Option<&str>) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
        volume_capabilities: vec![mount_cap(csi::volume_capability::access_mode::Mode::SingleNodeWriter)],
        accessibility_requirements: node.and_then(on_node),
        ..Default::default()
    }
}

pub fn block_cap(mode: csi::volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(csi::volume_capability::AccessType::Block(Default::default())),
    }
}

/// The status code of a call that must fail.
pub fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
    r.unwrap_err().code()
}

/// A client channel to the admin API at `addr` (host:port) over mutual TLS, presenting
/// certificate `who` from `pki` (made by [`certs`]).
pub async fn tls_channel(addr: &str, pki: &Path, who: &str) -> Channel {
    let (cert, key) = (pki.join(format!("{who}.pem")), pki.join(format!("{who}-key.pem")));
    let tls = ferrite_proto::admin_tls(&pki.join("ca.pem"), Some((&cert, &key))).unwrap();
    ferrite_proto::connect(&format!("tcp://{addr}"), Some(tls)).await.unwrap()
}

/// Whether the daemon at `addr` closes `who`'s connection right after its TLS handshake (an
/// identity with no role): the channel does not open, or its first call finds it closed.
pub async fn closed_for(addr: &str, pki: &Path, who: &str) -> bool {
    use ferrite_proto::ferrite::v1::{ListVolumesRequest, admin_client::AdminClient};
    let (cert, key) = (pki.join(format!("{who}.pem")), pki.join(format!("{who}-key.pem")));
    let tls = ferrite_proto::admin_tls(&pki.join("ca.pem"), Some((&cert, &key))).unwrap();
    match ferrite_proto::connect(&format!("tcp://{addr}"), Some(tls)).await {
        Err(_) => true,
        // Closed under it: a transport error, whichever code the client gives it; a refusal or
        // an answer means the call reached the daemon.
        Ok(ch) => match AdminClient::new(ch).list_volumes(ListVolumesRequest {}).await {
            Ok(_) => false,
            Err(e) => {
                eprintln!("{who} at {addr}: {e}");
                matches!(
                    e.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Internal
                )
            }
        },
    }
}

/// A raw TLS connection to `addr` with `who`'s certificate, handshaken, held open by the caller.
pub async fn tls_connection(
    addr: &str,
    pki: &Path,
    who: &str,
) -> std::io::Result<ferrite_tls::tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let (cert, key) = (pki.join(format!("{who}.pem")), pki.join(format!("{who}-key.pem")));
    let cfg = ferrite_tls::client_config(&pki.join("ca.pem"), Some((&cert, &key)), &[b"h2"])?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ferrite_tls::server_name(addr)?;
    ferrite_tls::TlsConnector::from(cfg).connect(name, tcp).await
}

pub fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap().port()
}

/// `ferrite certs DIR NAME SANS...`: a certificate (and the CA, the first time) in `dir`.
pub fn certs(dir: &Path, name: &str, sans: &[&str]) {
    if dir.join(format!("{name}.pem")).exists() {
        return;
    }
    let o = Command::new(BIN).arg("certs").arg(dir).arg(name).args(sans).output().unwrap();
    assert!(o.status.success(), "ferrite certs: {}", String::from_utf8_lossy(&o.stderr));
}

/// The `[roles]` of every daemon of a test cluster: the CSI driver's certificate (`csi`) is the
/// controller, the nodes of `tcp_node` (127.0.0.2 to 127.0.0.9) replicate with each other and
/// open the publications made for them.
pub fn cluster_roles() -> String {
    let mut t = String::from("[roles]\n\"csi\" = \"controller\"\n");
    for i in 2..10 {
        t.push_str(&format!("\"node-127-0-0-{i}\" = [\"replication-peer\", \"nbd-client\"]\n"));
    }
    t
}

/// A daemon whose admin API and NBD server also listen on `ip` (a loopback address standing for
/// a node), with mutual TLS on both: its certificate, and the CSI driver's (`csi`), come from
/// one CA in `<dir>/../pki`. Returns the daemon, its admin and NBD addresses.
pub fn tcp_node(dir: &Path, ip: &str) -> (Daemon, SocketAddr, SocketAddr) {
    tcp_node_with(dir, ip, "")
}

/// [`tcp_node`] with `extra` configuration lines (before its `[roles]`).
pub fn tcp_node_with(dir: &Path, ip: &str, extra: &str) -> (Daemon, SocketAddr, SocketAddr) {
    std::fs::create_dir_all(dir).unwrap();
    let pki = dir.parent().unwrap().join("pki");
    let name = format!("node-{}", ip.replace('.', "-"));
    certs(&pki, &name, &[ip]);
    certs(&pki, "csi", &[]);
    let (admin, nbd): (SocketAddr, SocketAddr) =
        (format!("{ip}:{}", free_port(ip)).parse().unwrap(), format!("{ip}:{}", free_port(ip)).parse().unwrap());
    let p = |f: &str| pki.join(f).display().to_string();
    let cfg = format!(
        "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\nadmin-listen = \"{admin}\"\nnbd-listen = \"{nbd}\"\n\
         tls-cert = {:?}\ntls-key = {:?}\ntls-client-ca = {:?}\n{extra}\n{}",
        p(&format!("{name}.pem")),
        p(&format!("{name}-key.pem")),
        p("ca.pem"),
        cluster_roles()
    );
    std::fs::write(dir.join("ferrite.toml"), cfg).unwrap();
    (Daemon::start(dir), admin, nbd)
}
