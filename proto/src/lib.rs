//! Generated gRPC code: Ferrite's admin API, the CSI 1.12 and CSI-Addons protocols, and the
//! snapshot-metadata sidecar's API.

/// `ferrite.v1`: the daemon's admin API.
pub mod ferrite {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic, missing_debug_implementations)]
        tonic::include_proto!("ferrite.v1");
    }
}

/// `csi.v1`: the Container Storage Interface 1.12.
pub mod csi {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic, missing_debug_implementations)]
        tonic::include_proto!("csi.v1");
    }
}

/// The CSI-Addons services, one proto package each (as the CSI-Addons spec names them).
pub mod csi_addons {
    #![allow(clippy::all, clippy::pedantic, missing_debug_implementations)]
    // The generated code names CSI types as `super::csi::v1::...`.
    pub use crate::csi;
    pub mod identity {
        tonic::include_proto!("identity");
    }
    pub mod reclaimspace {
        tonic::include_proto!("reclaimspace");
    }
    pub mod encryptionkeyrotation {
        tonic::include_proto!("encryptionkeyrotation");
    }
    pub mod fence {
        tonic::include_proto!("fence");
    }
    pub mod volumegroup {
        tonic::include_proto!("volumegroup");
    }
    pub mod replication {
        tonic::include_proto!("replication");
    }
}

/// `snapshotmetadata`: the API of the kubernetes-csi external-snapshot-metadata sidecar, as
/// backup tools call it.
pub mod snapshot_metadata {
    #![allow(clippy::all, clippy::pedantic, missing_debug_implementations)]
    tonic::include_proto!("snapshotmetadata");
}

pub mod busy;
pub mod hand_over;
pub mod kind;
pub mod version;

/// A gRPC channel to a server on a Unix socket (the daemon's admin API, a CSI endpoint).
pub async fn connect_unix(path: &std::path::Path) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::from_static("http://ferrite.invalid")
        .user_agent(version::user_agent())?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}

/// A TLS client configuration (rustls).
pub type ClientTls = ferrite_tls::rustls::ClientConfig;

/// How long connecting to a daemon may take, and how soon a connection that stopped answering
/// is noticed (HTTP/2 keepalive), so a dead node costs seconds. Calls themselves have no
/// deadline: some (reclaim, scrub) are long by nature.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(10);

/// A gRPC channel to `endpoint`: `tcp://host:port` (a daemon's `admin-listen`), over TLS when
/// `tls` is given (the server's certificate checked against its CA, this client's presented),
/// or a Unix socket path (optionally `unix://`-prefixed).
pub async fn connect(
    endpoint: &str,
    tls: Option<std::sync::Arc<ClientTls>>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    connect_as(endpoint, tls, None).await
}

/// [`connect`], checking the server's certificate for `server_name` instead of the endpoint's
/// host (daemons reached by address whose certificates all carry one service name).
pub async fn connect_as(
    endpoint: &str,
    tls: Option<std::sync::Arc<ClientTls>>,
    server_name: Option<&str>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return connect_unix(std::path::Path::new(endpoint.strip_prefix("unix://").unwrap_or(endpoint))).await;
    };
    let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .user_agent(version::user_agent())?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_keepalive(Some(KEEPALIVE))
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(CONNECT_TIMEOUT)
        .keep_alive_while_idle(true);
    let Some(cfg) = tls else { return ep.connect().await };
    let addr = addr.to_string();
    let named = server_name.map(str::to_owned);
    ep.connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
        let (cfg, addr, named) = (std::sync::Arc::clone(&cfg), addr.clone(), named.clone());
        async move {
            let name = ferrite_tls::server_name(named.as_deref().unwrap_or(&addr))?;
            let tcp = tokio::net::TcpStream::connect(&addr).await?;
            tcp.set_nodelay(true)?;
            let tls = ferrite_tls::TlsConnector::from(cfg).connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    }))
    .await
}

/// The TLS client config for the admin API (HTTP/2 over TLS): the CA that signed the daemons'
/// certificates, and this client's certificate and key.
pub fn admin_tls(
    ca: &std::path::Path,
    identity: Option<(&std::path::Path, &std::path::Path)>,
) -> std::io::Result<std::sync::Arc<ClientTls>> {
    ferrite_tls::client_config(ca, identity, &[b"h2"])
}

/// [`admin_tls`], following its files (a long-running client: the CSI controller).
pub fn admin_tls_reloading(
    ca: &std::path::Path,
    identity: Option<(&std::path::Path, &std::path::Path)>,
) -> std::io::Result<ferrite_tls::Reloading<ClientTls>> {
    ferrite_tls::reload::client(ca, identity, &[b"h2"])
}
