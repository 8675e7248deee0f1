//! The CSI-Addons EncryptionKeyRotation service: a volume's key-encryption key replaced by the
//! one the call carries, or its data key replaced and every block re-encrypted (the keys
//! themselves: `shared/keys.rs`).

use std::sync::Arc;

use ferrite_proto::csi_addons::encryptionkeyrotation as ekr;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::shared::args::require;
use crate::shared::keys::{DEFAULT_ID, KEY_ID, key_ref, required};
use crate::shared::nodes::NodeDirectory;

/// EncryptionKeyRotationController, on the controller and on the nodes (the CSI-Addons
/// controller calls the node where the volume is attached, with the PV's node-stage secret):
/// - with `encryption_key`: the volume's daemon wraps its data key with that key instead of the
///   secrets' one (online, O(1), no data rewritten); the Secret is then updated to the new key
///   by whoever rotates it. A repeat after the Secret already holds the new key succeeds.
/// - without (what an EncryptionKeyRotationJob sends): the data key itself is replaced, every
///   block re-encrypted in the background under a new one wrapped by the same Secret's key; the
///   call returns once that has started (a repeat while it runs changes nothing).
#[derive(Debug)]
pub struct KeyRotation {
    pub nodes: Arc<dyn NodeDirectory>,
    pub busy: ferrite_proto::busy::Busy,
}

#[tonic::async_trait]
impl ekr::encryption_key_rotation_controller_server::EncryptionKeyRotationController for KeyRotation {
    async fn encryption_key_rotate(
        &self,
        req: Request<ekr::EncryptionKeyRotateRequest>,
    ) -> Result<Response<ekr::EncryptionKeyRotateResponse>, Status> {
        let r = req.into_inner();
        require("volume_id", &r.volume_id)?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let old = required(&r.secrets, "key rotation")?;
        if r.encryption_key.is_empty() {
            let (node, mut c, v) = crate::shared::copies::volume(&*self.nodes, &r.volume_id).await?;
            if v.encryption.is_none() {
                return Err(Status::failed_precondition(format!("volume {:?} is not encrypted", r.volume_id)));
            }
            let req = pb::RekeyVolumeRequest { name: v.name, old_key: Some(old), new_key: None, data_key: true };
            c.rekey_volume(req).await.map_err(|e| match e.code() {
                tonic::Code::FailedPrecondition => Status::unauthenticated(e.message().to_owned()),
                _ => e,
            })?;
            tracing::info!(volume_id = %r.volume_id, node, "volume data key rotation started");
            return Ok(Response::new(ekr::EncryptionKeyRotateResponse {}));
        }
        let new_id = r.parameters.get(KEY_ID).cloned().unwrap_or_else(|| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            format!("{DEFAULT_ID}-{}", now.as_secs())
        });
        let new = key_ref(&new_id, &r.encryption_key, "encryption_key")?;
        let (node, mut c, v) = crate::shared::copies::volume(&*self.nodes, &r.volume_id).await?;
        if v.encryption.is_none() {
            return Err(Status::failed_precondition(format!("volume {:?} is not encrypted", r.volume_id)));
        }
        let req = pb::RekeyVolumeRequest {
            name: v.name.clone(),
            old_key: Some(old),
            new_key: Some(new.clone()),
            data_key: false,
        };
        match c.rekey_volume(req).await {
            Ok(_) => {}
            // Already rotated (the volume records the new key's id, and the Secret holds the new
            // key now): the new key opens it.
            Err(e)
                if e.code() == tonic::Code::FailedPrecondition
                    && v.encryption.as_ref().is_some_and(|enc| enc.key_id == new_id) =>
            {
                let again = pb::UnlockVolumeRequest { name: v.name.clone(), key: Some(new) };
                c.unlock_volume(again).await.map_err(|_| Status::unauthenticated(e.message().to_owned()))?;
            }
            Err(e) if e.code() == tonic::Code::FailedPrecondition => {
                return Err(Status::unauthenticated(e.message().to_owned()));
            }
            Err(e) => return Err(e),
        }
        tracing::info!(volume_id = %r.volume_id, node, key = %new_id, "volume key-encryption key rotated");
        Ok(Response::new(ekr::EncryptionKeyRotateResponse {}))
    }
}
