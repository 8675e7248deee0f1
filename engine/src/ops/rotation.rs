//! Data-key rotation: every block a volume reads re-encrypted under a new data key, online, for
//! a data key that may have leaked (rewrapping, [`Pool::rewrap_volume`], only replaces the key
//! that wraps it).
//!
//! [`Pool::start_data_key_rotation`] gives the volume a new empty head layer encrypted with a
//! new key (its old head stays under it, hidden), while no client request runs: none encrypted
//! with the old key can land in the new layer. [`Pool::run_data_key_rotation`] then copies, a
//! chunk at a time under the chunk's range lock (client requests lock their ranges while it
//! runs), every block the volume resolves to a layer under another key into the head: read with
//! its layer's key, written with the head's. When every block is copied the old head, fully
//! shadowed, merges away and its key goes with it; snapshots keep their layers and the old key
//! until they are deleted.
//!
//! Crash-safe without a cursor: every layer names its key, so any block reads under the one it
//! was written with, copied or not. Resuming is running again: blocks already in a layer under
//! the head's key are skipped.

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;

use ferrite_crypt::{DataKey, Kek};

use crate::error::{Error, ErrorKind, Result};
use crate::io::BLOCK;
use crate::keys::KeyEntry;
use crate::meta::CatalogOp;
use crate::ops::encryption::key_error;
use crate::ops::snapshot::collect;
use crate::ops::volumes::{lookup, record_of};
use crate::pool::Pool;

const B: u64 = BLOCK as u64;
/// Blocks looked at (and at most copied) under one range lock.
const CHUNK: u64 = 256;

/// How far a data-key rotation has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotationProgress {
    /// Bytes of the volume looked at, of `total`.
    pub done: u64,
    pub total: u64,
    /// Bytes re-encrypted so far.
    pub copied: u64,
}

impl Pool {
    /// Starts replacing volume `name`'s data key: a new random key, wrapped by the KEK that
    /// wraps the current one (`kek` hands it out by id: the caller must hold it), encrypts
    /// everything written from now on. Then [`Pool::run_data_key_rotation`] re-encrypts the
    /// rest. Durable on return.
    pub fn start_data_key_rotation(
        &self,
        name: &str,
        kek: impl Fn(&str) -> std::result::Result<Kek, ferrite_crypt::Error>,
    ) -> Result<()> {
        let (gate, head, wrapped) = {
            let st = self.inner.state.read();
            let e = &st.volumes[&lookup(&st, name)?];
            let key = st
                .layers
                .key_of(e.rec.layer)
                .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("volume {name:?} is not encrypted")))?;
            (Arc::clone(&e.gate), e.rec.layer, st.keys[&key].wrapped.clone())
        };
        if gate.mirror().is_some() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "volume {name:?} has synchronous replicas: its data key cannot be replaced while they hold its \
                     ciphertext (remove them first; a new key-encryption key needs no rotation)"
                ),
            ));
        }
        let kek = kek(&wrapped.key_id).map_err(|e| key_error(name, e))?;
        kek.unwrap(&wrapped).map_err(|e| key_error(name, e))?;
        let key = DataKey::generate().map_err(|e| key_error(name, e))?;
        let new_wrapped = kek.wrap(&key).map_err(|e| key_error(name, e))?;
        let name = name.to_owned();
        // No client request runs from here until the new head is in place.
        let _alone = gate.rekey.write();
        let key = Arc::new(key);
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let mut rec = record_of(inner, &name)?;
            if rec.layer != head {
                return Err(Error::new(ErrorKind::Unsupported, format!("volume {name:?} changed; try again")));
            }
            let (key_id, layer) = (inner.meta.next_id()?, inner.meta.next_id()?);
            rec.layer = layer;
            inner.meta.apply(&[
                CatalogOp::PutDataKey(key_id, new_wrapped.encode()),
                CatalogOp::PutLayer(layer, Some(head), Some(key_id)),
                CatalogOp::PutVolume(rec.clone()),
            ])?;
            let mut st = inner.state.write();
            st.keys.insert(key_id, KeyEntry { wrapped: new_wrapped, open: Some(key) });
            st.layers.add_keyed(layer, Some(head), Some(key_id));
            let id = rec.id;
            st.volumes.get_mut(&id).expect("looked up above").rec = rec;
            tracing::info!(volume = %name, "data key rotation started");
            Ok(())
        })
    }

    /// Re-encrypts under volume `name`'s head key every block it reads from a layer under
    /// another key, reporting progress; when done, the old head merges away (its key with it,
    /// unless a snapshot still uses it). Online; resumable (run it again after a crash or an
    /// error). The volume must be unlocked. A volume with nothing to re-encrypt finishes at once.
    pub fn run_data_key_rotation(&self, name: &str, mut progress: impl FnMut(RotationProgress)) -> Result<()> {
        let (gate, size) = {
            let st = self.inner.state.read();
            let e = &st.volumes[&lookup(&st, name)?];
            (Arc::clone(&e.gate), e.rec.size)
        };
        {
            let _alone = gate.rekey.write();
            gate.rekeying.store(true, SeqCst);
        }
        let run = self.copy_up(name, size, &gate, &mut progress);
        gate.rekeying.store(false, SeqCst);
        run?;
        let name = name.to_owned();
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let ops = {
                let mut st = inner.state.write();
                let head = st.volumes[&lookup(&st, &name)?].rec.layer;
                match st.layers[&head].parent {
                    Some(old) => collect(&mut st, old),
                    None => Vec::new(),
                }
            };
            inner.commit_restructure(ops)?;
            tracing::info!(volume = %name, "data key rotation done");
            Ok(())
        })
    }

    /// Copies, chunk by chunk under its range lock, the blocks of `name` under another key
    /// than its head's into the head.
    fn copy_up(
        &self,
        name: &str,
        size: u64,
        gate: &crate::gate::WriteGate,
        progress: &mut impl FnMut(RotationProgress),
    ) -> Result<()> {
        // Past the gate: this handle's writes do not wait for the range lock it holds.
        let vol = self.open_volume(name)?.past_read_only();
        let blocks = size / B;
        let mut p = RotationProgress { done: 0, total: size, copied: 0 };
        let mut buf = Vec::new();
        for first in (0..blocks).step_by(usize::try_from(CHUNK).expect("small")) {
            self.inner.check_open()?;
            let n = CHUNK.min(blocks - first);
            let _held = gate.ranges.lock(first, first + n);
            let stale: Vec<(u64, u64)> = {
                let st = self.inner.state.read();
                let head = st.volumes[&lookup(&st, name)?].rec.layer;
                let key = st.layers.key_of(head);
                st.layers
                    .resolve(head, first, n)
                    .into_iter()
                    .filter(|r| r.pba.is_some() && st.layers.key_of(r.layer) != key)
                    .map(|r| (r.lba, r.blocks))
                    .collect()
            };
            for (lba, k) in stale {
                buf.resize(usize::try_from(k * B).expect("a chunk"), 0);
                vol.read(lba * B, &mut buf)?;
                vol.write(lba * B, &buf)?;
                p.copied += k * B;
            }
            p.done = (first + n) * B;
            progress(p);
        }
        vol.flush()
    }
}
