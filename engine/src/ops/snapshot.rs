//! Snapshots, clones and deletion: catalog changes that restructure layer chains.
//!
//! - A snapshot freezes the volume's head layer and gives the volume a new, empty head whose
//!   parent is the frozen one: O(1), no data copied. It runs as a log barrier, so every write
//!   acknowledged before the call is in the snapshot and none issued after it is; the store is
//!   synced before the catalog records it, so the snapshot is durable on return.
//! - A clone is a new volume whose head sits on a snapshot's layer (or, cloning a volume, on
//!   its head frozen as a hidden layer).
//! - Deleting a snapshot or a volume drops its reference to a layer. A layer nothing refers to
//!   is freed if no layer depends on it, merged into its child if exactly one does, and kept
//!   hidden otherwise. Merging moves map entries, never data, and is committed together with a
//!   checkpoint, so replay never crosses a restructured chain.

use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::io::BLOCK;
use crate::map::extent_map::Freed;
use crate::map::layers;
use crate::meta::{CatalogOp, SnapshotRecord, VolumeRecord};
use crate::ops::volumes::{VolumeInfo, check_overcommit, info_of, lookup, new_record, validate_name};
use crate::pool::{Inner, Pool, now_unix};
pub(crate) use crate::state::snapshot_by_name;
use crate::state::{State, Target, VolumeEntry, changed_in};
use crate::volume::Volume;

const B: u64 = BLOCK as u64;

/// A snapshot as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: u64,
    pub name: String,
    /// The volume it was taken of, if that volume still exists.
    pub volume: Option<String>,
    pub volume_id: u64,
    /// The volume's size when the snapshot was taken.
    pub size: u64,
    pub created_unix: u64,
    /// Drawn at random when it was taken (0: by an earlier build): tells it apart from a
    /// snapshot of a pool copied from the same image, which has the same uuid and ids.
    pub nonce: u64,
    /// Bytes written to the volume between the previous snapshot and this one.
    pub layer_bytes: u64,
    /// Bytes that deleting this snapshot (alone) would free.
    pub reclaimable_on_delete: u64,
}

/// A volume or a snapshot, by name: what a clone starts from, what a diff compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Image<'a> {
    Snapshot(&'a str),
    Volume(&'a str),
}

/// Whether a volume head or a snapshot names `layer`.
fn referenced(st: &State, layer: u64) -> bool {
    st.volumes.values().any(|v| v.rec.layer == layer) || st.snapshots.values().any(|s| s.layer == layer)
}

/// After a reference to `layer` went away: frees it (and then looks at its parent) if nothing
/// depends on it, merges it into its only child, or leaves it hidden (also while its child is
/// under another data key and does not yet shadow all its data: a rotation not done). Returns
/// the catalog ops.
pub(crate) fn collect(st: &mut State, mut layer: u64) -> Vec<CatalogOp> {
    let mut ops = Vec::new();
    let mut freed: Freed = Vec::new();
    let mut keys = Vec::new();
    loop {
        if !st.layers.contains_key(&layer) || referenced(st, layer) {
            break;
        }
        let kids = layers::children(&st.layers, layer);
        match kids.as_slice() {
            [] => {
                let gone = st.layers.free(layer, &mut freed);
                keys.extend(gone.as_ref().and_then(|l| l.key));
                let parent = gone.and_then(|l| l.parent);
                st.dirty_chunks.retain(|&(l, _)| l != layer);
                ops.push(CatalogOp::DeleteLayer(layer));
                match parent {
                    Some(p) => layer = p,
                    None => break,
                }
            }
            &[kid] if st.layers.key_of(kid) != st.layers.key_of(layer) && st.layers.merge_moves_data(layer, kid) => {
                break;
            }
            &[kid] => {
                let dirty = &mut st.dirty_chunks;
                st.layers.merge_into(layer, kid, &mut freed, |c| {
                    dirty.insert((kid, c));
                });
                dirty.retain(|&(l, _)| l != layer);
                ops.push(CatalogOp::DeleteLayer(layer));
                ops.push(CatalogOp::PutLayer(kid, st.layers[&kid].parent, st.layers[&kid].key));
                break;
            }
            _ => break,
        }
    }
    for (pba, n) in freed {
        st.segs.add_live(pba, n, false);
    }
    // A data key goes with the last layer encrypted with it.
    for k in keys {
        if st.keys.contains_key(&k) && !st.layers.values().any(|l| l.key == Some(k)) {
            st.keys.remove(&k);
            ops.push(CatalogOp::DeleteDataKey(k));
        }
    }
    ops
}

/// A volume with its new head, and the snapshot that freezes its old one.
pub(crate) type Planned = (VolumeRecord, SnapshotRecord);

/// Plans snapshots of volumes `(volume id, snapshot name)` (on the leader, `meta_lock` held):
/// checks the names, allocates ids, and returns the new records and the catalog ops. The
/// caller syncs the store, applies the ops, then [`apply_snapshots`].
pub(crate) fn plan_snapshots(inner: &Inner, items: &[(u64, String)]) -> Result<(Vec<Planned>, Vec<CatalogOp>)> {
    let recs: Vec<(VolumeRecord, Option<u64>)> = {
        let st = inner.state.read();
        for (i, (_, name)) in items.iter().enumerate() {
            if snapshot_by_name(&st, name).is_ok() || items[..i].iter().any(|o| &o.1 == name) {
                return Err(Error::new(ErrorKind::AlreadyExists, format!("snapshot {name:?} already exists")));
            }
        }
        if let Some((id, _)) = items.iter().find(|(id, _)| st.volumes[id].gate.fill().is_some()) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "volume {:?} is being restored; it can be snapshotted once the restore is done",
                    st.volumes[id].rec.name
                ),
            ));
        }
        items
            .iter()
            .map(|(id, _)| {
                let rec = st.volumes[id].rec.clone();
                let key = st.layers.key_of(rec.layer);
                (rec, key)
            })
            .collect()
    };
    let mut out = Vec::with_capacity(items.len());
    let mut ops = Vec::with_capacity(items.len() * 3);
    for ((mut rec, key), (_, name)) in recs.into_iter().zip(items) {
        let (sid, head) = (inner.meta.next_id()?, inner.meta.next_id()?);
        let snap = SnapshotRecord {
            id: sid,
            volume: rec.id,
            layer: rec.layer,
            size: rec.size,
            created_unix: now_unix(),
            // Never 0, which means "unknown".
            nonce: uuid::Uuid::new_v4().as_u64_pair().0 | 1,
            name: name.clone(),
        };
        rec.layer = head;
        ops.push(CatalogOp::PutLayer(head, Some(snap.layer), key));
        ops.push(CatalogOp::PutSnapshot(snap.clone()));
        ops.push(CatalogOp::PutVolume(rec.clone()));
        out.push((rec, snap));
    }
    Ok((out, ops))
}

/// Installs planned snapshots in memory: each volume gets its new head over the frozen one.
pub(crate) fn apply_snapshots(st: &mut State, planned: Vec<Planned>) -> Vec<SnapshotRecord> {
    planned
        .into_iter()
        .map(|(rec, snap)| {
            st.layers.add(rec.layer, snap.layer);
            let id = rec.id;
            st.volumes.get_mut(&id).expect("planned from a live volume").rec = rec;
            st.snapshots.insert(snap.id, snap.clone());
            snap
        })
        .collect()
}

/// Removes snapshot `id` and collects its layer; returns the catalog ops.
pub(crate) fn remove_snapshot(st: &mut State, id: u64) -> Vec<CatalogOp> {
    let Some(rec) = st.snapshots.remove(&id) else { return Vec::new() };
    let mut ops = vec![CatalogOp::DeleteSnapshot(id)];
    ops.extend(collect(st, rec.layer));
    ops
}

fn snapshot_info(st: &State, s: &SnapshotRecord) -> SnapshotInfo {
    let l = &st.layers[&s.layer];
    let layer_blocks = l.map.mapped_blocks();
    let sole = st.volumes.values().all(|v| v.rec.layer != s.layer)
        && st.snapshots.values().filter(|o| o.layer == s.layer).count() == 1;
    let reclaimable = if !sole {
        0
    } else {
        match layers::children(&st.layers, s.layer).as_slice() {
            [] => layer_blocks,
            [kid] => {
                let k = &st.layers[kid].map;
                l.map.runs().map(|(lba, _, n)| n - k.gaps(lba, n).iter().map(|g| g.1).sum::<u64>()).sum()
            }
            _ => 0,
        }
    };
    SnapshotInfo {
        id: s.id,
        name: s.name.clone(),
        volume: st.volumes.get(&s.volume).map(|v| v.rec.name.clone()),
        volume_id: s.volume,
        size: s.size,
        created_unix: s.created_unix,
        nonce: s.nonce,
        layer_bytes: layer_blocks * B,
        reclaimable_on_delete: reclaimable * B,
    }
}

impl Pool {
    /// Ranges of `image` that differ from snapshot `since` (an earlier snapshot of the same
    /// chain), as (offset, length) in bytes, in order; with no `since`, the allocated ranges of
    /// `image`. No media I/O: the layers between the two *are* the change set. What a trim or
    /// write-zeroes touched counts as changed (it reads as zeros now). Fails with
    /// InvalidArgument if `since` is not beneath `image`.
    pub fn changed_ranges(&self, image: Image<'_>, since: Option<&str>) -> Result<Vec<(u64, u64)>> {
        let st = self.inner.state.read();
        let (head, size) = match image {
            Image::Volume(v) => {
                let rec = &st.volumes[&lookup(&st, v)?].rec;
                (rec.layer, rec.size)
            }
            Image::Snapshot(s) => {
                let rec = &st.snapshots[&snapshot_by_name(&st, s)?];
                (rec.layer, rec.size)
            }
        };
        changed_in(&st, head, size, since, 0, u64::MAX)
    }

    /// Snapshots a volume: O(1), durable on return, containing every write acknowledged before
    /// the call. Snapshot names are unique in the pool.
    pub fn create_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotInfo> {
        validate_name(name)?;
        let (volume, name) = (volume.to_owned(), name.to_owned());
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let id = lookup(&inner.state.read(), &volume)?;
            let (snaps, ops) = plan_snapshots(inner, &[(id, name)])?;
            inner.sync_store()?;
            inner.meta.apply(&ops)?;
            let mut st = inner.state.write();
            let snap = apply_snapshots(&mut st, snaps).pop().expect("one snapshot");
            tracing::info!(volume = %volume, snapshot = %snap.name, "snapshot created");
            Ok(snapshot_info(&st, &snap))
        })
    }

    /// Snapshots, by name; only those of `volume` if given.
    pub fn snapshots(&self, volume: Option<&str>) -> Result<Vec<SnapshotInfo>> {
        let st = self.inner.state.read();
        let of = volume.map(|v| lookup(&st, v)).transpose()?;
        let mut v: Vec<_> = st
            .snapshots
            .values()
            .filter(|s| of.is_none_or(|id| s.volume == id))
            .map(|s| snapshot_info(&st, s))
            .collect();
        // Ids are handed out in increasing order: this is creation order (s2 before s10).
        v.sort_by_key(|s| s.id);
        Ok(v)
    }

    /// One snapshot's description.
    pub fn snapshot_info(&self, name: &str) -> Result<SnapshotInfo> {
        let st = self.inner.state.read();
        let id = snapshot_by_name(&st, name)?;
        Ok(snapshot_info(&st, &st.snapshots[&id]))
    }

    /// A read-only handle on a snapshot.
    pub fn open_snapshot(&self, name: &str) -> Result<Volume> {
        let st = self.inner.state.read();
        let id = snapshot_by_name(&st, name)?;
        Ok(Volume::new(Arc::downgrade(&self.inner), Target::Snapshot(id), name.to_owned(), None))
    }

    /// Deletes a snapshot, whatever depends on it: what clones or later snapshots still need
    /// stays (hidden); the rest is freed. Metadata work only. Durable on return.
    pub fn delete_snapshot(&self, name: &str) -> Result<()> {
        let name = name.to_owned();
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let ops = {
                let mut st = inner.state.write();
                let id = snapshot_by_name(&st, &name)?;
                if let Some(g) = st.group_snapshots.values().find(|g| g.members.contains(&id)) {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!("snapshot {name:?} belongs to group snapshot {:?}; delete that instead", g.name),
                    ));
                }
                remove_snapshot(&mut st, id)
            };
            inner.commit_restructure(ops)?;
            tracing::info!(snapshot = %name, "snapshot deleted");
            Ok(())
        })
    }

    /// Creates a writable volume `name` from a snapshot or (through a hidden, implicit
    /// snapshot) from a volume's current content. O(1); durable on return. The clone has the
    /// source's size.
    pub fn clone_volume(&self, source: Image<'_>, name: &str) -> Result<VolumeInfo> {
        validate_name(name)?;
        let name = name.to_owned();
        let source = match source {
            Image::Snapshot(s) => Ok(s.to_owned()),
            Image::Volume(v) => Err(v.to_owned()),
        };
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let st = inner.state.read();
            if st.names.contains_key(&name) {
                return Err(Error::new(ErrorKind::AlreadyExists, format!("volume {name:?} already exists")));
            }
            let (parent, size, origin) = match &source {
                Ok(snap) => {
                    let s = &st.snapshots[&snapshot_by_name(&st, snap)?];
                    (s.layer, s.size, None)
                }
                Err(vol) => {
                    let rec = st.volumes[&lookup(&st, vol)?].rec.clone();
                    (rec.layer, rec.size, Some(rec))
                }
            };
            check_overcommit(inner, &st, size)?;
            // A clone reads its origin's blocks and writes its own with the origin's data key.
            let key = st.layers.key_of(parent);
            drop(st); // no catalog I/O under the state lock
            let mut ops = Vec::new();
            let origin = match origin {
                Some(mut rec) => {
                    // The source's head freezes (hidden) under a new head of its own.
                    rec.layer = inner.meta.next_id()?;
                    ops.push(CatalogOp::PutLayer(rec.layer, Some(parent), key));
                    ops.push(CatalogOp::PutVolume(rec.clone()));
                    Some(rec)
                }
                None => None,
            };
            let id = inner.meta.next_id()?;
            let rec = new_record(id, size, name.clone());
            ops.push(CatalogOp::PutLayer(id, Some(parent), key));
            ops.push(CatalogOp::PutVolume(rec.clone()));
            if origin.is_some() {
                inner.sync_store()?;
            }
            inner.meta.apply(&ops)?;
            let mut st = inner.state.write();
            if let Some(o) = origin {
                st.layers.add(o.layer, parent);
                let id = o.id;
                st.volumes.get_mut(&id).expect("looked up above").rec = o;
            }
            st.layers.add(id, parent);
            st.names.insert(name.clone(), id);
            st.volumes.insert(id, VolumeEntry::new(rec.clone()));
            tracing::info!(volume = %name, "clone created");
            Ok(info_of(&st, &rec))
        })
    }

    /// Deletes a volume, whatever depends on it (its snapshots and their clones keep what they
    /// need). Durable on return.
    pub fn delete_volume(&self, name: &str) -> Result<()> {
        let name = name.to_owned();
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let ops = {
                let mut st = inner.state.write();
                let id = lookup(&st, &name)?;
                let rec = st.volumes.remove(&id).expect("looked up above").rec;
                st.names.remove(&rec.name);
                let mut ops = vec![CatalogOp::DeleteVolume(id)];
                for g in st.groups.values_mut().filter(|g| g.members.contains(&id)) {
                    g.members.retain(|&m| m != id);
                    ops.push(CatalogOp::PutGroup(g.clone()));
                }
                ops.extend(collect(&mut st, rec.layer));
                ops
            };
            inner.commit_restructure(ops)?;
            tracing::info!(volume = %name, "volume deleted");
            Ok(())
        })
    }

    /// Rolls `volume` back to `snapshot`, one of its own snapshots: the volume reads (and is
    /// sized) as the snapshot does, and what was written since its last snapshot is dropped.
    /// O(1): the volume gets a new empty head over the snapshot's layer; the old head is
    /// collected like a deleted volume's. Every snapshot stays (a later one can be rolled
    /// forward to). Durable on return.
    pub fn rollback_volume(&self, volume: &str, snapshot: &str) -> Result<VolumeInfo> {
        let (volume, snapshot) = (volume.to_owned(), snapshot.to_owned());
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let (snap, mut rec) = {
                let st = inner.state.read();
                let rec = st.volumes[&lookup(&st, &volume)?].rec.clone();
                let snap = st.snapshots[&snapshot_by_name(&st, &snapshot)?].clone();
                if snap.volume != rec.id {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!("snapshot {snapshot:?} is not a snapshot of volume {volume:?}"),
                    ));
                }
                (snap, rec)
            };
            let old = rec.layer;
            rec.layer = inner.meta.next_id()?;
            rec.size = snap.size;
            let ops = {
                let mut st = inner.state.write();
                st.layers.add(rec.layer, snap.layer);
                st.volumes.get_mut(&rec.id).expect("looked up above").rec = rec.clone();
                let key = st.layers.key_of(snap.layer);
                let mut ops =
                    vec![CatalogOp::PutLayer(rec.layer, Some(snap.layer), key), CatalogOp::PutVolume(rec.clone())];
                ops.extend(collect(&mut st, old));
                ops
            };
            inner.commit_restructure(ops)?;
            tracing::info!(volume = %volume, snapshot = %snapshot, "volume rolled back");
            Ok(info_of(&inner.state.read(), &rec))
        })
    }
}
