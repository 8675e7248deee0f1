//! Generated gRPC code: Ferrite's admin API, and the CSI 1.12 and CSI-Addons protocols.

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
    pub mod fence {
        tonic::include_proto!("fence");
    }
    pub mod volumegroup {
        tonic::include_proto!("volumegroup");
    }
}

/// A gRPC channel to a server on a Unix socket (the daemon's admin API, a CSI endpoint).
pub async fn connect_unix(path: &std::path::Path) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::from_static("http://ferrite.invalid")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}

/// A gRPC channel to `endpoint`: `tcp://host:port` (a daemon's `admin-listen`), or a Unix socket
/// path (optionally `unix://`-prefixed).
pub async fn connect(endpoint: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    match endpoint.strip_prefix("tcp://") {
        Some(addr) => tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?.connect().await,
        None => connect_unix(std::path::Path::new(endpoint.strip_prefix("unix://").unwrap_or(endpoint))).await,
    }
}
