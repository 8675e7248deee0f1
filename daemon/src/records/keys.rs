//! Key-encryption keys for encrypted volumes, as the admin API names them (`KeyRef`): given with
//! a call (a CSI request's secret), or by id from the daemon's key directory (`key-dir`, 0700,
//! one `<id>.key` file of mode 0600 each). At start the daemon unlocks every encrypted volume
//! whose key is in the directory; the others stay locked (no I/O, no export, no attach) until
//! a call brings their key. Key bytes are never logged nor put in a message.

use std::path::Path;

use ferrite_crypt::{Kek, KeyFiles, KeyProvider};
use ferrite_engine::{Image, Pool};
use ferrite_proto::ferrite::v1 as pb;

use crate::base::error::Error;

/// The largest wrapped data key a peer may send: a wrapping is a few dozen bytes and a key id
/// of at most 255.
pub const MAX_WRAPPED_KEY: usize = 512;

/// The KEK a new encrypted volume gets when the call names none.
pub const DEFAULT_KEY: &str = "default";

/// The daemon's key directory.
#[derive(Debug, Clone)]
pub struct KeyDir(KeyFiles);

fn key_error(e: ferrite_crypt::Error) -> Error {
    match e {
        ferrite_crypt::Error::Io(_) | ferrite_crypt::Error::Random => Error::internal(e.to_string()),
        _ => Error::refused(e.to_string()),
    }
}

impl KeyDir {
    pub fn new(dir: &Path) -> Self {
        Self(KeyFiles::new(dir))
    }

    /// The KEK `r` names: the bytes it carries (32), or the key file of its id; `create` makes
    /// a missing key file (a new volume's, a rekey's new key).
    pub fn kek(&self, r: &pb::KeyRef, create: bool) -> Result<Kek, Error> {
        if r.key_id.is_empty() {
            return Err(Error::invalid("a key needs its id (key_id)"));
        }
        if !r.key.is_empty() {
            let bytes: [u8; 32] =
                r.key.as_slice().try_into().map_err(|_| {
                    Error::invalid(format!("key {:?}: a key is 32 bytes, not {}", r.key_id, r.key.len()))
                })?;
            return Kek::new(&r.key_id, bytes).map_err(key_error);
        }
        match self.0.kek(&r.key_id) {
            Err(ferrite_crypt::Error::Unavailable { .. }) if create && !self.exists(&r.key_id) => {
                let kek = self.0.create(&r.key_id).map_err(key_error)?;
                tracing::info!(key = %r.key_id, "key-encryption key created in the key directory");
                Ok(kek)
            }
            r => r.map_err(key_error),
        }
    }

    pub fn exists(&self, id: &str) -> bool {
        ferrite_crypt::provider::valid_id(id) && self.0.dir().join(format!("{id}.key")).exists()
    }

    /// A lookup by id for the engine: the key a call carries (`given`), whatever id the volume
    /// records for it (a CSI Secret's id only names it); else the key directory's by id.
    pub fn lookup<'a>(&'a self, given: Option<&'a Kek>) -> impl Fn(&str) -> Result<Kek, ferrite_crypt::Error> + 'a {
        move |id| match given {
            Some(k) => k.with_id(id),
            None => self.0.kek(id),
        }
    }

    /// Unlocks every encrypted volume and snapshot whose key is here; says which stay locked.
    pub fn unlock_all(&self, pool: &Pool) {
        let images = pool
            .volumes()
            .into_iter()
            .filter(|v| v.encryption.as_ref().is_some_and(|e| !e.unlocked))
            .map(|v| (v.name, true))
            .chain(pool.snapshots(None).unwrap_or_default().into_iter().map(|s| (s.name, false)));
        for (name, volume) in images {
            let image = if volume { Image::Volume(&name) } else { Image::Snapshot(&name) };
            match pool.unlock(image, |id| self.0.kek(id)) {
                Ok(()) => {}
                Err(e) if volume => tracing::warn!(volume = %name, "stays locked: {e}"),
                Err(_) => {}
            }
        }
    }
}

impl KeyProvider for KeyDir {
    fn kind(&self) -> &'static str {
        self.0.kind()
    }

    fn kek(&self, id: &str) -> ferrite_crypt::Result<Kek> {
        self.0.kek(id)
    }
}

/// The error for exporting or attaching a volume that is locked, if it is.
pub fn refuse_if_locked(pool: &Pool, image: &str) -> Result<(), Error> {
    let volume = image.split_once('@').map_or(image, |(v, _)| v);
    let Ok(info) = pool.volume_info(volume) else { return Ok(()) };
    match info.encryption {
        Some(e) if !e.unlocked => Err(Error::refused(format!(
            "volume {volume:?} is encrypted and locked: unlock it first (ferrite volume unlock {volume}) \
             with key {:?}",
            e.key_id
        ))),
        _ => Ok(()),
    }
}

pub fn encryption_msg(
    e: Option<ferrite_engine::Encryption>,
    job: Option<crate::records::rotations::Job>,
    keys: &KeyDir,
) -> Option<pb::VolumeEncryption> {
    let rotation = job.map(|j| {
        let p = j.progress.unwrap_or(ferrite_engine::RotationProgress { done: 0, total: 0, copied: 0 });
        pb::KeyRotation {
            running: j.running,
            done: p.done,
            total: p.total,
            copied: p.copied,
            error: j.error.unwrap_or_default(),
        }
    });
    e.map(|e| {
        let provider = if keys.exists(&e.key_id) { keys.kind() } else { "request" };
        pb::VolumeEncryption { unlocked: e.unlocked, rotation, provider: provider.into(), key_id: e.key_id }
    })
}
