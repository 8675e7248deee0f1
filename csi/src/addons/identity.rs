//! The CSI-Addons endpoint: its Identity, and the services the mode serves (controller:
//! ReclaimSpace, NetworkFence, VolumeGroup, Replication, EncryptionKeyRotation; node:
//! ReclaimSpace on the node).

use ferrite_proto::csi_addons::identity as id;
use tonic::{Request, Response, Status};

use crate::spec::identity::DRIVER_NAME;

#[derive(Debug)]
pub struct AddonsIdentity {
    pub controller: bool,
    pub node: bool,
}

fn cap(t: id::capability::Type) -> id::Capability {
    id::Capability { r#type: Some(t) }
}

#[tonic::async_trait]
impl id::identity_server::Identity for AddonsIdentity {
    async fn get_identity(
        &self,
        _: Request<id::GetIdentityRequest>,
    ) -> Result<Response<id::GetIdentityResponse>, Status> {
        Ok(Response::new(id::GetIdentityResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_capabilities(
        &self,
        _: Request<id::GetCapabilitiesRequest>,
    ) -> Result<Response<id::GetCapabilitiesResponse>, Status> {
        use id::capability::{
            EncryptionKeyRotation as EK, NetworkFence as F, ReclaimSpace as R, Service as S, Type as T,
            VolumeGroup as G, VolumeReplication as VR,
        };
        use id::capability::{
            encryption_key_rotation, network_fence, reclaim_space, service, volume_group, volume_replication,
        };
        let mut caps = Vec::new();
        // Served in both modes: the CSI-Addons controller calls the node the volume is attached to.
        let rotation = encryption_key_rotation::Type::Encryptionkeyrotation as i32;
        caps.push(cap(T::EncryptionKeyRotation(EK { r#type: rotation })));
        // ONLINE: NodeReclaimSpace on a staged volume; OFFLINE: ControllerReclaimSpace, which
        // needs only the storage (the manager picks the controller's sidecar by it).
        if self.node {
            caps.push(cap(T::Service(S { r#type: service::Type::NodeService as i32 })));
            caps.push(cap(T::ReclaimSpace(R { r#type: reclaim_space::Type::Online as i32 })));
        }
        if self.controller {
            caps.push(cap(T::Service(S { r#type: service::Type::ControllerService as i32 })));
            caps.push(cap(T::ReclaimSpace(R { r#type: reclaim_space::Type::Offline as i32 })));
            for t in [network_fence::Type::NetworkFence, network_fence::Type::GetClientsToFence] {
                caps.push(cap(T::NetworkFence(F { r#type: t as i32 })));
            }
            for t in [
                volume_group::Type::VolumeGroup,
                volume_group::Type::LimitVolumeToOneVolumeGroup,
                volume_group::Type::DoNotAllowVgToDeleteVolumes,
                volume_group::Type::ModifyVolumeGroup,
                volume_group::Type::GetVolumeGroup,
                volume_group::Type::ListVolumeGroups,
            ] {
                caps.push(cap(T::VolumeGroup(G { r#type: t as i32 })));
            }
            for t in
                [volume_replication::Type::VolumeReplication, volume_replication::Type::GetReplicationDestinationInfo]
            {
                caps.push(cap(T::VolumeReplication(VR { r#type: t as i32 })));
            }
        }
        Ok(Response::new(id::GetCapabilitiesResponse { capabilities: caps }))
    }

    async fn probe(&self, _: Request<id::ProbeRequest>) -> Result<Response<id::ProbeResponse>, Status> {
        // From local state, as the CSI Probe (identity.rs).
        Ok(Response::new(id::ProbeResponse { ready: Some(true) }))
    }
}
