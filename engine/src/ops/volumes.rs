//! The volume catalog: create, list, describe, open and grow volumes; names and sizes are
//! checked here, and the thin overcommit cap.

use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result, invalid};
use crate::io::BLOCK;
use crate::maint::defrag::{DefragProgress, DefragReport};
use crate::meta::{CatalogOp, VolumeRecord};
use crate::pool::{Inner, Pool, now_unix};
use crate::qos::{QosLimits, QosStats};

use crate::keys::KeyEntry as NewKey;
use crate::ops::encryption::{Encryption, encryption_of};
use crate::state::{State, Target, VolumeEntry};
use crate::volume::Volume;

/// A volume as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub id: u64,
    pub name: String,
    /// Provisioned size in bytes.
    pub size: u64,
    /// Bytes of the volume that read from data in the pool (its own or its snapshots').
    pub allocated: u64,
    /// Bytes only this volume refers to (written since its last snapshot): what deleting it
    /// frees at least.
    pub exclusive: u64,
    /// Layers in the volume's chain: 1 plus the snapshots (and clone origins) under it.
    pub chain_depth: usize,
    pub created_unix: u64,
    /// Clients may not write ([`Pool::set_read_only`]).
    pub read_only: bool,
    /// IOPS and bandwidth limits ([`Pool::set_qos`]).
    pub qos: QosLimits,
    /// How the volume is encrypted, if it is ([`Pool::create_encrypted_volume`]).
    pub encryption: Option<Encryption>,
}

pub(crate) fn validate_name(name: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 128 || !name.chars().all(ok_char) || name.starts_with(['.', '-']) {
        return Err(invalid(format!(
            "invalid name {name:?}: use 1-128 letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )));
    }
    Ok(())
}

fn validate_size(size: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(BLOCK as u64) {
        return Err(invalid(format!("invalid volume size {size}: must be a non-zero multiple of 4096 bytes")));
    }
    if size > (1 << 60) {
        return Err(invalid(format!("invalid volume size {size}: larger than 1 EiB")));
    }
    Ok(())
}

impl Pool {
    /// Rewrites volume `name`'s scattered blocks in logical order (see `maint/defrag.rs`),
    /// reporting progress after every window; ends with a checkpoint.
    pub fn defrag_volume(&self, name: &str, progress: impl FnMut(DefragProgress)) -> Result<DefragReport> {
        self.inner.check_open()?;
        let i = &self.inner;
        let id = lookup(&i.state.read(), name)?;
        crate::maint::defrag::defrag(&i.ctx, &i.log, &i.cleaner, &i.readahead, id, name, progress)
    }

    /// Runs of consecutive pool blocks a full sequential read of volume `name` needs (one when
    /// its blocks are in logical order), and its mapped bytes.
    pub fn volume_layout(&self, name: &str) -> Result<(u64, u64)> {
        let id = lookup(&self.inner.state.read(), name)?;
        crate::maint::defrag::layout(&self.inner.ctx, id, name).map(|(runs, blocks)| (runs, blocks * BLOCK as u64))
    }

    /// Creates a thin volume of `size` bytes (a multiple of 4 KiB). Durable on return.
    pub fn create_volume(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        self.create_with_key(name, size, None)
    }

    /// Creates a volume, encrypted with `key` (a new data key: its id, wrapped and open) or not.
    pub(crate) fn create_with_key(&self, name: &str, size: u64, key: Option<(u64, NewKey)>) -> Result<VolumeInfo> {
        validate_name(name)?;
        validate_size(size)?;
        let inner = &self.inner;
        inner.check_open()?;
        let _m = inner.meta_lock.lock();
        {
            let st = inner.state.read();
            if st.names.contains_key(name) {
                return Err(Error::new(ErrorKind::AlreadyExists, format!("volume {name:?} already exists")));
            }
            check_overcommit(inner, &st, size)?;
        }
        let id = inner.meta.next_id()?;
        let rec = new_record(id, size, name.to_owned());
        let key_id = key.as_ref().map(|(k, _)| *k);
        let mut ops = vec![CatalogOp::PutLayer(id, None, key_id), CatalogOp::PutVolume(rec.clone())];
        if let Some((k, new)) = &key {
            ops.push(CatalogOp::PutDataKey(*k, new.wrapped.encode()));
        }
        inner.meta.apply(&ops)?;
        let mut st = inner.state.write();
        if let Some((k, new)) = key {
            st.keys.insert(k, new);
        }
        st.names.insert(rec.name.clone(), id);
        st.layers.add_keyed(rec.layer, None, key_id);
        let info = info_of(&st, &rec);
        st.volumes.insert(id, VolumeEntry::new(rec));
        Ok(info)
    }

    /// Every volume, by name.
    pub fn volumes(&self) -> Vec<VolumeInfo> {
        let st = self.inner.state.read();
        let mut v: Vec<_> = st.volumes.values().map(|e| info_of(&st, &e.rec)).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// One volume's description.
    pub fn volume_info(&self, name: &str) -> Result<VolumeInfo> {
        let st = self.inner.state.read();
        let id = lookup(&st, name)?;
        Ok(info_of(&st, &st.volumes[&id].rec))
    }

    /// A handle for I/O on a volume.
    pub fn open_volume(&self, name: &str) -> Result<Volume> {
        let st = self.inner.state.read();
        let id = lookup(&st, name)?;
        let e = &st.volumes[&id];
        let limits = Some((Arc::clone(&e.gate), Arc::clone(&e.qos)));
        Ok(Volume::new(Arc::downgrade(&self.inner), Target::Volume(id), e.rec.name.clone(), limits))
    }

    /// Sends every client write of volume `name` from now on to `mirror` as well (synchronous
    /// replicas), on every handle, open or not; None stops it. Not stored: the daemon sets it
    /// again after a restart, before it serves the volume.
    pub fn set_mirror(&self, name: &str, mirror: Option<Arc<dyn crate::mirror::Mirror>>) -> Result<()> {
        let st = self.inner.state.read();
        st.volumes[&lookup(&st, name)?].gate.set_mirror(mirror);
        Ok(())
    }

    /// Has `fill` bring each range of volume `name` to its content before any client request
    /// touches it, on every handle, open or not (an instant restore); None once it is full.
    /// While one is set the volume cannot be snapshotted or cloned (its content is not all
    /// there): [`ErrorKind::Busy`]. Not stored: the daemon sets it again after a restart,
    /// before it serves the volume.
    pub fn set_fill(&self, name: &str, fill: Option<Arc<dyn crate::fill::Fill>>) -> Result<()> {
        let st = self.inner.state.read();
        st.volumes[&lookup(&st, name)?].gate.set_fill(fill);
        Ok(())
    }

    /// Whether a [`crate::Fill`] is filling volume `name` (a restore still running).
    pub fn is_filling(&self, name: &str) -> Result<bool> {
        let st = self.inner.state.read();
        Ok(st.volumes[&lookup(&st, name)?].gate.fill().is_some())
    }

    /// Makes a volume read-only for clients (their writes fail with [`ErrorKind::ReadOnly`],
    /// EROFS, on every handle, open or not) or writable again. Made read-only, it returns only
    /// once every write already admitted is acknowledged: a snapshot taken after holds every
    /// write a client will ever have acknowledged. Durable on return.
    pub fn set_read_only(&self, name: &str, read_only: bool) -> Result<VolumeInfo> {
        let inner = &self.inner;
        inner.check_open()?;
        let gate = {
            let st = inner.state.read();
            Arc::clone(&st.volumes[&lookup(&st, name)?].gate)
        };
        if read_only {
            // Not under the catalog lock: a write inside may wait for the cleaner, which takes it.
            gate.close();
        }
        let _m = inner.meta_lock.lock();
        let mut rec = record_of(inner, name)?;
        let was = rec.read_only;
        rec.read_only = read_only;
        if let Err(e) = inner.meta.put_volume(&rec) {
            if !was {
                gate.open();
            }
            return Err(e);
        }
        if !read_only {
            gate.open();
        }
        let mut st = inner.state.write();
        let info = info_of(&st, &rec);
        if let Some(e) = st.volumes.get_mut(&rec.id) {
            e.rec.read_only = read_only;
        }
        if was != read_only {
            tracing::info!(volume = %name, read_only, "volume access changed");
        }
        Ok(info)
    }

    /// Sets a volume's limits (all 0: none), in effect for the next request on every handle,
    /// open or not; durable on return. Requests over a limit wait, never fail.
    pub fn set_qos(&self, name: &str, limits: QosLimits) -> Result<VolumeInfo> {
        let inner = &self.inner;
        inner.check_open()?;
        let _m = inner.meta_lock.lock();
        let mut rec = record_of(inner, name)?;
        rec.qos = limits;
        let info = put_record(inner, rec, |e| e.qos.set(limits))?;
        tracing::info!(volume = %name, ?limits, "volume limits set");
        Ok(info)
    }

    /// What a volume's limiter has seen: requests delayed, time waited, current rate.
    pub fn qos_stats(&self, name: &str) -> Result<QosStats> {
        let st = self.inner.state.read();
        Ok(st.volumes[&lookup(&st, name)?].qos.stats())
    }

    /// Grows a volume to `new_size` bytes (shrinking is refused). Durable on return.
    pub fn grow_volume(&self, name: &str, new_size: u64) -> Result<VolumeInfo> {
        validate_size(new_size)?;
        let inner = &self.inner;
        inner.check_open()?;
        let _m = inner.meta_lock.lock();
        let mut rec = record_of(inner, name)?;
        check_overcommit(inner, &inner.state.read(), new_size.saturating_sub(rec.size))?;
        if new_size < rec.size {
            return Err(invalid(format!(
                "volume {name:?} is {} bytes; shrinking to {new_size} is not supported",
                rec.size
            )));
        }
        rec.size = new_size;
        put_record(inner, rec, |_| {})
    }
}

/// Refuses `extra` more provisioned bytes if they would pass the overcommit cap.
pub(crate) fn check_overcommit(inner: &Inner, st: &State, extra: u64) -> Result<()> {
    let (Some(cap), Some(ratio)) = (inner.overcommit_cap(), inner.opts.overcommit_ratio) else { return Ok(()) };
    let provisioned = st.provisioned();
    if provisioned.saturating_add(extra) > cap {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "thin overcommit cap: volumes would provision {} bytes, more than {ratio} x the pool's {} bytes",
                provisioned + extra,
                inner.sb.segment_size * inner.sb.segment_count
            ),
        ));
    }
    Ok(())
}

/// A copy of volume `name`'s record, to change and [`put_record`] back (under the catalog lock).
pub(crate) fn record_of(inner: &Inner, name: &str) -> Result<VolumeRecord> {
    let st = inner.state.read();
    Ok(st.volumes[&lookup(&st, name)?].rec.clone())
}

/// Makes a changed volume record durable, then the volume's in memory (`also` sets what else
/// its entry keeps of it); the volume as it is now.
fn put_record(inner: &Inner, rec: VolumeRecord, also: impl FnOnce(&mut VolumeEntry)) -> Result<VolumeInfo> {
    inner.meta.put_volume(&rec)?;
    let mut st = inner.state.write();
    let info = info_of(&st, &rec);
    if let Some(e) = st.volumes.get_mut(&rec.id) {
        also(e);
        e.rec = rec;
    }
    Ok(info)
}

pub(crate) fn lookup(st: &State, name: &str) -> Result<u64> {
    st.names.get(name).copied().ok_or_else(|| Error::new(ErrorKind::NotFound, format!("volume {name:?} not found")))
}

/// The record of a volume made now: writable, on a layer of its own id, no limits.
pub(crate) fn new_record(id: u64, size: u64, name: String) -> VolumeRecord {
    VolumeRecord { id, layer: id, size, created_unix: now_unix(), read_only: false, qos: QosLimits::default(), name }
}

pub(crate) fn info_of(st: &State, rec: &VolumeRecord) -> VolumeInfo {
    let b = BLOCK as u64;
    let visible: u64 =
        st.layers.resolve(rec.layer, 0, rec.size / b).iter().filter(|r| r.pba.is_some()).map(|r| r.blocks).sum();
    let own = st.layers.get(&rec.layer).map_or(0, |l| l.map.mapped_blocks());
    VolumeInfo {
        id: rec.id,
        name: rec.name.clone(),
        size: rec.size,
        allocated: visible * b,
        exclusive: own * b,
        created_unix: rec.created_unix,
        read_only: rec.read_only,
        qos: rec.qos,
        chain_depth: crate::map::layers::depth(&st.layers, rec.layer),
        encryption: encryption_of(st, rec.layer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sizes_are_validated() {
        for bad in ["", ".x", "-x", "a b", "a/b", "a@b", &"x".repeat(129)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        validate_name("pvc-1234_a.b").unwrap();
        assert!(validate_size(0).is_err());
        assert!(validate_size(4097).is_err());
        validate_size(1 << 30).unwrap();
    }
}
