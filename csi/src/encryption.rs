//! Encrypted volumes through CSI: the StorageClass parameter `encrypted: "true"`, the key in the
//! request's secrets (a Kubernetes Secret named by the class's `csi.storage.k8s.io/*-secret-name`
//! parameters), and the CSI-Addons EncryptionKeyRotation service.
//!
//! The secret holds `encryptionKey` (64 hex digits: `openssl rand -hex 32`) and optionally
//! `encryptionKeyID` (what the volume records as its key's id; default `csi`). The daemon keeps
//! only the data key wrapped by it; CreateVolume needs it to wrap a new volume's key,
//! ControllerPublish to open the volume on its primary, NodeStage on the node's daemon.

use std::collections::HashMap;
use std::sync::Arc;

use ferrite_proto::csi_addons::encryptionkeyrotation as ekr;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::args::require;
use crate::nodes::{self, NodeDirectory};

const KEY: &str = "encryptionKey";
const KEY_ID: &str = "encryptionKeyID";
const DEFAULT_ID: &str = "csi";

/// The key `value` (64 hex digits) under `id`, for the daemon.
fn key_ref(id: &str, value: &str, what: &str) -> Result<pb::KeyRef, Status> {
    let key = ferrite_crypt::provider::parse_hex(value).map(|k| k.to_vec()).ok_or_else(|| {
        Status::invalid_argument(format!("{what} must be 64 hex digits (32 random bytes: openssl rand -hex 32)"))
    })?;
    Ok(pb::KeyRef { key_id: id.to_owned(), key })
}

/// The key the secrets carry, if any.
pub fn from_secrets(secrets: &HashMap<String, String>) -> Result<Option<pb::KeyRef>, Status> {
    let Some(value) = secrets.get(KEY) else { return Ok(None) };
    let id = secrets.get(KEY_ID).map_or(DEFAULT_ID, String::as_str);
    key_ref(id, value, &format!("secret {KEY:?}")).map(Some)
}

/// The key the secrets must carry for an encrypted volume.
pub fn required(secrets: &HashMap<String, String>, call: &str) -> Result<pb::KeyRef, Status> {
    from_secrets(secrets)?.ok_or_else(|| {
        Status::invalid_argument(format!(
            "an encrypted volume's {call} needs its key in the secrets ({KEY:?}; set the StorageClass's \
             csi.storage.k8s.io/*-secret-name parameters)"
        ))
    })
}

/// Opens volume `name` on the daemon `c` with the secrets' key, if it is encrypted and they
/// carry one; an encrypted volume without a key in them is refused.
pub async fn unlock(
    c: &mut pb::admin_client::AdminClient<tonic::transport::Channel>,
    v: &pb::Volume,
    secrets: &HashMap<String, String>,
    call: &str,
) -> Result<(), Status> {
    if v.encryption.is_none() {
        return Ok(());
    }
    let key = required(secrets, call)?;
    c.unlock_volume(pb::UnlockVolumeRequest { name: v.name.clone(), key: Some(key) }).await?;
    Ok(())
}

/// Opens the copies of replicated volume `v` (other than its primary's) with the secrets' key,
/// where their daemons answer: keys held in memory there, never stored. A copy that cannot be
/// opened now is opened by the publish or stage that needs it.
pub async fn unlock_copies(
    dir: &dyn NodeDirectory,
    view: &pb::SyncVolume,
    v: &pb::Volume,
    secrets: &HashMap<String, String>,
) {
    for node in crate::copies::nodes_of(dir, view).into_iter().skip(1) {
        let opened = async {
            let mut c = nodes::admin(dir, &node).await?;
            unlock(&mut c, v, secrets, "ControllerPublishVolume").await
        };
        if let Err(e) = opened.await {
            tracing::warn!(volume = %v.name, node, "its copy stays locked for now: {}", e.message());
        }
    }
}

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
            let (node, mut c, v) = crate::copies::volume(&*self.nodes, &r.volume_id).await?;
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
        let (node, mut c, v) = crate::copies::volume(&*self.nodes, &r.volume_id).await?;
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
