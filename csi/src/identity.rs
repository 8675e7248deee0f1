//! CSI Identity: who we are, which services we offer, and whether the daemon(s) behind us answer.

use std::sync::Arc;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::nodes::{NodeDirectory, admin};

/// The plugin name Kubernetes registers us under.
pub const DRIVER_NAME: &str = "csi.ferrite.dev";

#[derive(Debug)]
pub struct Identity {
    pub nodes: Arc<dyn NodeDirectory>,
    pub controller: bool,
}

fn service(t: csi::plugin_capability::service::Type) -> csi::PluginCapability {
    let s = csi::plugin_capability::Service { r#type: t as i32 };
    csi::PluginCapability { r#type: Some(csi::plugin_capability::Type::Service(s)) }
}

#[tonic::async_trait]
impl csi::identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::service::Type;
        let mut capabilities = vec![service(Type::VolumeAccessibilityConstraints)];
        if self.controller {
            capabilities.push(service(Type::ControllerService));
            capabilities.push(service(Type::GroupControllerService));
            capabilities.push(service(Type::SnapshotMetadataService));
        }
        let online = csi::plugin_capability::VolumeExpansion {
            r#type: csi::plugin_capability::volume_expansion::Type::Online as i32,
        };
        capabilities
            .push(csi::PluginCapability { r#type: Some(csi::plugin_capability::Type::VolumeExpansion(online)) });
        Ok(Response::new(csi::GetPluginCapabilitiesResponse { capabilities }))
    }

    /// Ready when a daemon answers (any node's, for a controller); not ready is an answer, not
    /// an error.
    async fn probe(&self, _: Request<csi::ProbeRequest>) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse { ready: Some(ready(&*self.nodes).await) }))
    }
}

/// Whether any daemon of the directory answers.
pub(crate) async fn ready(nodes: &dyn NodeDirectory) -> bool {
    for node in nodes.nodes() {
        if let Ok(mut c) = admin(nodes, &node).await
            && c.pool_status(pb::PoolStatusRequest {}).await.is_ok()
        {
            return true;
        }
    }
    false
}
