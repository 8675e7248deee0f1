//! Data keys of encrypted layers. Every layer names the data key its blocks are encrypted with
//! (`map/layers.rs`); the catalog holds each key only wrapped by a key-encryption key
//! (`ferrite_crypt::envelope`), which the engine never sees: the pool's owner unwraps a
//! volume's keys with its key provider and opens them here ([`crate::Pool::unlock_volume`]).
//! Until then the volume is locked: its reads and writes fail with [`ErrorKind::Locked`],
//! while scrub, the cleaner and replication of its blocks go on, since checksums are over
//! ciphertext and blocks move without being re-encrypted.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferrite_crypt::{DataKey, WrappedKey};

use crate::error::{Error, ErrorKind, Result, corrupt};
use crate::meta::Meta;

/// A data key: wrapped as stored, and open once its volume was unlocked.
pub(crate) struct KeyEntry {
    pub wrapped: WrappedKey,
    pub open: Option<Arc<DataKey>>,
}

/// Data keys by id.
pub(crate) type Keys = BTreeMap<u64, KeyEntry>;

/// The catalog's data keys, none open.
pub(crate) fn load(meta: &Meta) -> Result<Keys> {
    meta.data_keys()?
        .into_iter()
        .map(|(id, bytes)| {
            let wrapped = WrappedKey::decode(&bytes).map_err(|e| corrupt(format!("metadata: data key {id}: {e}")))?;
            Ok((id, KeyEntry { wrapped, open: None }))
        })
        .collect()
}

/// The open key for blocks of a layer encrypted with `key` (None: plaintext), or why there is none.
pub(crate) fn open(keys: &Keys, key: Option<u64>, name: &str) -> Result<Option<Arc<DataKey>>> {
    let Some(id) = key else { return Ok(None) };
    match keys.get(&id) {
        Some(KeyEntry { open: Some(k), .. }) => Ok(Some(Arc::clone(k))),
        Some(KeyEntry { wrapped, open: None }) => Err(locked(name, &wrapped.key_id)),
        None => Err(corrupt(format!("{name:?}: data key {id} is missing from the catalog"))),
    }
}

/// The error for I/O on a volume whose data key is not open.
pub(crate) fn locked(name: &str, kek: &str) -> Error {
    Error::new(ErrorKind::Locked, format!("volume {name:?} is encrypted and locked: unlock it with key {kek:?} first"))
}
