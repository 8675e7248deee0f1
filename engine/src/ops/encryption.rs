//! Encrypted volumes: made with a fresh data key wrapped by a key-encryption key (KEK),
//! unlocked by opening their data keys with the KEKs that wrapped them, and rekeyed by wrapping
//! the same data keys with a new KEK (O(1) per volume: no block is rewritten). The engine never
//! stores a KEK; the caller's key provider hands them out by id.
//!
//! A snapshot's new head and a clone's head take their parent's data key, so a volume's whole
//! chain, its snapshots and its clones share one data key and one KEK.

use std::collections::BTreeSet;
use std::sync::Arc;

use ferrite_crypt::{DataKey, Kek, WrappedKey};

use crate::error::{Error, ErrorKind, Result};
use crate::keys::KeyEntry;
use crate::meta::CatalogOp;
use crate::ops::snapshot::{Image, snapshot_by_name};
use crate::ops::volumes::{VolumeInfo, lookup};
use crate::pool::Pool;
use crate::state::State;

/// How a volume is encrypted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encryption {
    /// The id of the KEK that wraps the volume's data key (what unlocking it needs).
    pub key_id: String,
    /// Data keys its chain reads with (1; more only for a chain put together from several).
    pub data_keys: usize,
    /// Its data keys are open: it reads and writes.
    pub unlocked: bool,
}

/// The data keys of the chain from `head` down, each once.
fn chain_keys(st: &State, head: u64) -> BTreeSet<u64> {
    let mut keys = BTreeSet::new();
    let mut at = Some(head);
    while let Some(l) = at.and_then(|id| st.layers.get(&id)) {
        keys.extend(l.key);
        at = l.parent;
    }
    keys
}

/// The layer an image reads from.
fn head_of(st: &State, image: Image<'_>) -> Result<u64> {
    Ok(match image {
        Image::Volume(v) => st.volumes[&lookup(st, v)?].rec.layer,
        Image::Snapshot(s) => st.snapshots[&snapshot_by_name(st, s)?].layer,
    })
}

/// The data keys of an image's chain, wrapped.
fn chain_wrapped(st: &State, image: Image<'_>) -> Result<Vec<(u64, ferrite_crypt::WrappedKey)>> {
    let head = head_of(st, image)?;
    Ok(chain_keys(st, head).into_iter().map(|k| (k, st.keys[&k].wrapped.clone())).collect())
}

pub(crate) fn encryption_of(st: &State, head: u64) -> Option<Encryption> {
    let keys = chain_keys(st, head);
    let entry = &st.keys[&st.layers.key_of(head).or_else(|| keys.first().copied())?];
    Some(Encryption {
        key_id: entry.wrapped.key_id.clone(),
        data_keys: keys.len(),
        unlocked: keys.iter().all(|k| st.keys[k].open.is_some()),
    })
}

/// An engine error for a key that failed, never naming key material.
pub(crate) fn key_error(name: &str, e: ferrite_crypt::Error) -> Error {
    let kind = match e {
        ferrite_crypt::Error::Io(_) | ferrite_crypt::Error::Random => ErrorKind::Io,
        _ => ErrorKind::Locked,
    };
    Error::new(kind, format!("volume {name:?}: {e}"))
}

impl Pool {
    /// Creates a thin volume whose blocks are encrypted (AES-256-XTS) with a new random data
    /// key, stored only wrapped by `kek`. It is unlocked until the pool is closed. Durable on
    /// return.
    pub fn create_encrypted_volume(&self, name: &str, size: u64, kek: &Kek) -> Result<VolumeInfo> {
        let key = DataKey::generate().map_err(|e| key_error(name, e))?;
        let wrapped = kek.wrap(&key).map_err(|e| key_error(name, e))?;
        let id = self.inner.meta.next_id()?;
        self.create_with_key(name, size, Some((id, KeyEntry { wrapped, open: Some(Arc::new(key)) })))
    }

    /// The wrapped data key an image's own blocks are encrypted with (None: plaintext): what a
    /// replica of it is made with ([`Pool::create_volume_wrapped`]).
    pub fn wrapped_key(&self, image: Image<'_>) -> Result<Option<Vec<u8>>> {
        let st = self.inner.state.read();
        let head = head_of(&st, image)?;
        Ok(st.layers.key_of(head).map(|k| st.keys[&k].wrapped.encode()))
    }

    /// The wrapped data keys of an image's chain other than its own ([`Pool::wrapped_key`]):
    /// keys its older layers read with (before a data-key rotation), which a replica's older
    /// snapshots keep.
    pub fn older_wrapped_keys(&self, image: Image<'_>) -> Result<Vec<Vec<u8>>> {
        let st = self.inner.state.read();
        let own = st.layers.key_of(head_of(&st, image)?);
        Ok(chain_wrapped(&st, image)?.into_iter().filter(|(k, _)| Some(*k) != own).map(|(_, w)| w.encode()).collect())
    }

    /// Creates an encrypted volume whose data key is `wrapped` (as [`Pool::wrapped_key`] gave
    /// it), locked: a replica, written with [`crate::Volume::ciphertext`] handles, that opens
    /// with the same key-encryption key as its source.
    pub fn create_volume_wrapped(&self, name: &str, size: u64, wrapped: &[u8]) -> Result<VolumeInfo> {
        let wrapped = ferrite_crypt::WrappedKey::decode(wrapped)
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("volume {name:?}: {e}")))?;
        let id = self.inner.meta.next_id()?;
        self.create_with_key(name, size, Some((id, KeyEntry { wrapped, open: None })))
    }

    /// Makes replica volume `name`'s data keys follow its source's: `head` is the wrapped key
    /// the source's image is encrypted with now (what the replica's head is written with from
    /// now on), `others` the other data keys of its chain, as wrapped now. A rewrapping of a key
    /// the replica holds replaces that key's wrapping (a rekey at the source); another data key
    /// (a rotation there) becomes the head's own, which needs an empty head (a transfer's, right
    /// after its rollback): the blocks under the old key stay readable in the layers below.
    /// Keys cannot be checked here (no key-encryption key): a wrong wrapping only makes the
    /// replica fail to unlock. Durable on return.
    pub fn follow_wrapped_keys(&self, name: &str, head: &[u8], others: &[Vec<u8>]) -> Result<()> {
        let decode = |b: &[u8]| {
            WrappedKey::decode(b).map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("volume {name:?}: {e}")))
        };
        let w = decode(head)?;
        let others = others.iter().map(|b| decode(b)).collect::<Result<Vec<_>>>()?;
        // Version 1 wrappings cannot tell: they are taken as the same key, as before.
        let same = |a: &WrappedKey, b: &WrappedKey| a.same_key(b).unwrap_or(true);
        let inner = &self.inner;
        let _m = inner.meta_lock.lock();
        let (layer, parent, id, new, chain, orphaned) = {
            let st = inner.state.read();
            let layer = st.volumes[&lookup(&st, name)?].rec.layer;
            let id = st
                .layers
                .key_of(layer)
                .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("volume {name:?} is not encrypted")))?;
            let l = &st.layers[&layer];
            let new = !same(&st.keys[&id].wrapped, &w);
            if new && l.map.all_entries().next().is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("volume {name:?} holds blocks under its data key: a new data key starts in an empty head"),
                ));
            }
            // With a new key for the head, the old one goes unless a layer below reads with it.
            let orphaned = new && !st.layers.iter().any(|(&other, o)| other != layer && o.key == Some(id));
            (layer, l.parent, id, new, chain_wrapped(&st, Image::Volume(name))?, orphaned)
        };
        let new_key = if new { Some(inner.meta.next_id()?) } else { None };
        // Each key of the chain takes the wrapping of the same key among the given ones.
        let rewrapped: Vec<(u64, WrappedKey)> = chain
            .into_iter()
            .filter(|(k, _)| !(orphaned && *k == id))
            .filter_map(|(k, old)| {
                let now = match k == id && new_key.is_none() {
                    true => &w,
                    false => std::iter::once(&w).chain(&others).find(|o| old.same_key(o) == Some(true))?,
                };
                (*now != old).then(|| (k, now.clone()))
            })
            .collect();
        let mut ops: Vec<CatalogOp> = rewrapped.iter().map(|(k, w)| CatalogOp::PutDataKey(*k, w.encode())).collect();
        if let Some(n) = new_key {
            ops.push(CatalogOp::PutDataKey(n, w.encode()));
            ops.push(CatalogOp::PutLayer(layer, parent, Some(n)));
        }
        if orphaned {
            ops.push(CatalogOp::DeleteDataKey(id));
        }
        if ops.is_empty() {
            return Ok(());
        }
        inner.meta.apply(&ops)?;
        let mut st = inner.state.write();
        for (k, w) in rewrapped {
            st.keys.get_mut(&k).expect("keys are only dropped under the meta lock").wrapped = w;
        }
        if let Some(n) = new_key {
            st.keys.insert(n, KeyEntry { wrapped: w, open: None });
            st.layers.set_key(layer, Some(n));
            if orphaned {
                st.keys.remove(&id);
            }
            tracing::info!(volume = %name, "a new data key from the source: the replica's head is written with it");
        }
        Ok(())
    }

    /// Opens the data keys a volume or snapshot reads with, using the KEKs `kek` hands out by
    /// id; then it reads (and a volume writes). Every key is checked, even one already open: a
    /// wrong KEK fails with [`ErrorKind::Locked`] and changes nothing. A plaintext image needs
    /// nothing. Keys stay open until the pool is closed.
    pub fn unlock(
        &self,
        image: Image<'_>,
        kek: impl Fn(&str) -> std::result::Result<Kek, ferrite_crypt::Error>,
    ) -> Result<()> {
        let name = match image {
            Image::Volume(n) | Image::Snapshot(n) => n,
        };
        let wrapped = chain_wrapped(&self.inner.state.read(), image)?;
        let mut opened = Vec::with_capacity(wrapped.len());
        for (id, w) in wrapped {
            let key = kek(&w.key_id).and_then(|kek| kek.unwrap(&w)).map_err(|e| key_error(name, e))?;
            opened.push((id, key));
        }
        let mut st = self.inner.state.write();
        for (id, key) in opened {
            if let Some(e) = st.keys.get_mut(&id).filter(|e| e.open.is_none()) {
                e.open = Some(Arc::new(key));
            }
        }
        tracing::info!(image = %name, "unlocked");
        Ok(())
    }

    /// Wraps volume `name`'s data keys with `new` instead of the KEK that wraps them now
    /// (which `old` hands out by id, to prove the caller holds it): O(1) per volume, online,
    /// durable on return. Its snapshots and clones share the data keys, and so the new KEK.
    pub fn rewrap_volume(
        &self,
        name: &str,
        old: impl Fn(&str) -> std::result::Result<Kek, ferrite_crypt::Error>,
        new: &Kek,
    ) -> Result<Encryption> {
        let inner = &self.inner;
        let _m = inner.meta_lock.lock();
        let wrapped = chain_wrapped(&inner.state.read(), Image::Volume(name))?;
        if wrapped.is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("volume {name:?} is not encrypted")));
        }
        let mut rewrapped = Vec::with_capacity(wrapped.len());
        for (id, w) in wrapped {
            let key = old(&w.key_id).and_then(|kek| kek.unwrap(&w)).map_err(|e| key_error(name, e))?;
            rewrapped.push((id, new.wrap(&key).map_err(|e| key_error(name, e))?));
        }
        let ops: Vec<CatalogOp> = rewrapped.iter().map(|(id, w)| CatalogOp::PutDataKey(*id, w.encode())).collect();
        inner.meta.apply(&ops)?;
        let mut st = inner.state.write();
        for (id, w) in rewrapped {
            st.keys.get_mut(&id).expect("keys are only dropped under the meta lock").wrapped = w;
        }
        tracing::info!(volume = %name, key = %new.id(), "volume rekeyed");
        let head = st.volumes[&lookup(&st, name)?].rec.layer;
        Ok(encryption_of(&st, head).expect("encrypted"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolOptions;

    fn kek(id: &str) -> std::result::Result<Kek, ferrite_crypt::Error> {
        Kek::new(id, [3; 32])
    }

    /// A wrapped key changed in the catalog (one bit of its sealed bytes) opens with no key:
    /// the volume stays locked, with an error that says so, and nothing else is affected.
    #[test]
    fn a_corrupted_wrapped_key_keeps_the_volume_locked() {
        let dir = tempfile::tempdir().unwrap();
        let (file, meta) = (dir.path().join("pool"), dir.path().join("meta"));
        let opts = || PoolOptions { segment_size: 1 << 20, ..PoolOptions::default() };
        let pool = Pool::create(&file, &meta, 8 << 20, opts()).unwrap();
        pool.create_encrypted_volume("v", 1 << 20, &kek("k").unwrap()).unwrap();
        pool.create_encrypted_volume("w", 1 << 20, &kek("k").unwrap()).unwrap();
        let (id, mut bytes) = {
            let st = pool.inner.state.read();
            let head = st.volumes[&lookup(&st, "v").unwrap()].rec.layer;
            let id = st.layers.key_of(head).unwrap();
            (id, st.keys[&id].wrapped.encode())
        };
        let last = bytes.len() - 20;
        bytes[last] ^= 1;
        pool.inner.meta.apply(&[CatalogOp::PutDataKey(id, bytes)]).unwrap();
        pool.close().unwrap();
        let pool = Pool::open(&file, &meta, opts()).unwrap();
        let e = pool.unlock(Image::Volume("v"), kek).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Locked);
        assert!(e.to_string().contains("corrupted wrapped key"), "{e}");
        let mut buf = [0u8; 4096];
        assert_eq!(pool.open_volume("v").unwrap().read(0, &mut buf).unwrap_err().kind(), ErrorKind::Locked);
        pool.unlock(Image::Volume("w"), kek).unwrap();
        pool.open_volume("w").unwrap().read(0, &mut buf).unwrap();
    }
}
