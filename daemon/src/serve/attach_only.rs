//! A node that holds no storage runs no daemon (its Node lacks the storage label), yet its pods
//! use volumes of a class with remote access: the node plugin (`ferrite csi --mode node
//! --storage-label`) then attaches them itself. This is the part of the daemon it runs: the
//! node's kernel NBD devices relayed over TLS to the nodes serving their volumes
//! ([`Attachments`] without a pool), kept connected and taken back after a restart as the
//! daemon does, behind the admin RPCs the node plugin calls on the admin socket. Every other
//! admin RPC answers UNIMPLEMENTED; a local volume cannot be attached here.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_server::{Admin, AdminServer};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::base::config::TlsFiles;
use crate::base::error::require;
use crate::records::attachments::kernel_nbd::Links;
use crate::records::attachments::{Attachments, calls};

/// Where and how the node's attachments are served.
#[derive(Debug, Clone)]
pub struct Options {
    /// The admin socket the node plugin calls (the daemon's path: no daemon runs here).
    pub socket: PathBuf,
    /// Where the attachment records are kept (0700): on a tmpfs, they live as long as the
    /// kernel's devices.
    pub state_dir: PathBuf,
    /// The node's certificate: the relays' client identity.
    pub tls: TlsFiles,
    /// How long a device waits for a new connection, and when a request is re-sent.
    pub hold: Duration,
    pub request_timeout: Duration,
}

/// The running service; [`AttachOnly::stop`] before the process exits.
#[derive(Debug)]
pub struct AttachOnly {
    attachments: Arc<Attachments>,
    server: JoinHandle<Result<()>>,
    socket: PathBuf,
}

/// Takes back the devices a previous node plugin left and serves the admin socket.
pub async fn start(o: Options) -> Result<AttachOnly> {
    crate::net::unix::private_dir(&o.state_dir)?;
    // The certificate is checked now: a node plugin that cannot relay says so at once.
    let ca = o.tls.client_ca.as_deref().context("the node's CA certificate is required")?;
    ferrite_tls::client_config(ca, Some((&o.tls.cert, &o.tls.key)), &[])
        .with_context(|| format!("the node's certificate ({})", o.tls.cert.display()))?;
    let links = Links { nbd: None, tls: Some(o.tls), hold: o.hold, request_timeout: o.request_timeout };
    let hold_list = o.state_dir.join("ublk-hold.json");
    let attachments =
        Arc::new(Attachments::restore(None, &o.state_dir, hold_list, links, ferrite_ublk::Options::default()).await?);
    let listener = crate::net::unix::bind_unix(&o.socket, 0o600)?;
    let svc = AdminServer::new(Service(Arc::clone(&attachments)));
    let server = tokio::spawn(async move {
        crate::net::grpc::admin_server()
            .add_service(svc)
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await
            .context("the node's attachment service")
    });
    tracing::info!(socket = %o.socket.display(), "this node holds no storage: the node plugin attaches other nodes' volumes itself");
    Ok(AttachOnly { attachments, server, socket: o.socket })
}

impl AttachOnly {
    /// Stops serving; the devices' connections are cut unrepaired, so the kernel holds their
    /// I/O for the next node plugin, which takes them back.
    pub async fn stop(self) {
        self.server.abort();
        let _ = std::fs::remove_file(&self.socket);
        drop(self.attachments.freeze().await);
    }
}

struct Service(Arc<Attachments>);

#[tonic::async_trait]
impl Admin for Service {
    async fn attach_volume(&self, req: Request<pb::AttachVolumeRequest>) -> Result<Response<pb::Attachment>, Status> {
        let r = req.into_inner();
        require("volume", &r.volume)?;
        if r.remote.is_empty() {
            return Err(Status::failed_precondition(format!(
                "{} is not served from another node, and this node holds no storage (no daemon runs here)",
                r.volume
            )));
        }
        Ok(Response::new(calls::attach_remote(&self.0, r).await?))
    }

    async fn detach_volume(
        &self,
        req: Request<pb::DetachVolumeRequest>,
    ) -> Result<Response<pb::DetachVolumeResponse>, Status> {
        Ok(Response::new(calls::detach(&self.0, None, req.into_inner()).await?))
    }

    async fn resize_attachment(
        &self,
        req: Request<pb::ResizeAttachmentRequest>,
    ) -> Result<Response<pb::Attachment>, Status> {
        Ok(Response::new(calls::resize(&self.0, req.into_inner()).await?))
    }

    async fn list_attachments(
        &self,
        _: Request<pb::ListAttachmentsRequest>,
    ) -> Result<Response<pb::ListAttachmentsResponse>, Status> {
        let attachments = self.0.list().await.iter().map(|r| calls::remote_message(r, String::new())).collect();
        Ok(Response::new(pb::ListAttachmentsResponse { attachments }))
    }

    /// No volume is served here: none is a synchronous primary.
    async fn list_sync_replicas(
        &self,
        _: Request<pb::ListReplicationsRequest>,
    ) -> Result<Response<pb::ListSyncReplicasResponse>, Status> {
        Ok(Response::new(pb::ListSyncReplicasResponse::default()))
    }

    async fn get_volume(&self, req: Request<pb::GetVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let name = req.into_inner().name;
        Err(Status::not_found(format!("no volume {name:?} here: this node holds no storage")))
    }
}
