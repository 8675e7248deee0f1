//! The keys of encrypted volumes through CSI: the StorageClass parameter `encrypted: "true"`, the
//! key in the request's secrets (a Kubernetes Secret named by the class's
//! `csi.storage.k8s.io/*-secret-name` parameters). The CSI-Addons EncryptionKeyRotation service
//! is `addons/key_rotation.rs`.
//!
//! The secret holds `encryptionKey` (64 hex digits: `openssl rand -hex 32`) and optionally
//! `encryptionKeyID` (what the volume records as its key's id; default `csi`). The daemon keeps
//! only the data key wrapped by it; CreateVolume needs it to wrap a new volume's key,
//! ControllerPublish to open the volume on its primary, NodeStage on the node's daemon.

use std::collections::HashMap;

use ferrite_proto::ferrite::v1 as pb;
use tonic::Status;

use crate::shared::nodes::{self, NodeDirectory};

const KEY: &str = "encryptionKey";
pub(crate) const KEY_ID: &str = "encryptionKeyID";
pub(crate) const DEFAULT_ID: &str = "csi";

/// The key `value` (64 hex digits) under `id`, for the daemon.
pub(crate) fn key_ref(id: &str, value: &str, what: &str) -> Result<pb::KeyRef, Status> {
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
    for node in crate::shared::copies::nodes_of(dir, view).into_iter().skip(1) {
        let opened = async {
            let mut c = nodes::admin(dir, &node).await?;
            unlock(&mut c, v, secrets, "ControllerPublishVolume").await
        };
        if let Err(e) = opened.await {
            tracing::warn!(volume = %v.name, node, "its copy stays locked for now: {}", e.message());
        }
    }
}
