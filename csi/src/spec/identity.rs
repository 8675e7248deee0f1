//! CSI Identity: who we are, which services we offer, and that we answer.

use ferrite_proto::csi::v1 as csi;
use tonic::{Request, Response, Status};

/// The plugin name Kubernetes registers us under.
pub const DRIVER_NAME: &str = "csi.ferrite.dev";

#[derive(Debug)]
pub struct Identity {
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

    /// Ready whenever this plugin answers: Probe is what the livenessprobe sidecar asks (with a
    /// 1 s timeout), so it answers from local state and never waits on a daemon. A lost node, or
    /// the node's own daemon restarting for an upgrade, must not restart the plugin too.
    async fn probe(&self, _: Request<csi::ProbeRequest>) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}
