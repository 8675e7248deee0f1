//! The in-memory state every part of the engine shares behind one `RwLock`: the catalog as
//! loaded, the layers' extent maps, the segment table and the log position; and the one place a
//! batch is applied to it ([`apply`]), used by the write path and by recovery alike.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::format::{BatchHeader, Entry, EntryKind};
use crate::gate::WriteGate;
use crate::io::BLOCK;
use crate::map::layers::Layers;
use crate::map::segments::SegmentTable;
use crate::meta::{GroupRecord, SnapshotRecord, VolumeRecord};
use crate::qos::Qos;

/// What a handle reads: a volume (through its current head) or a snapshot (read-only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Volume(u64),
    Snapshot(u64),
}

impl State {
    /// The layer reads of `target` start from, and its size, as of now; None once deleted.
    pub fn head_of(&self, target: Target) -> Option<(u64, u64)> {
        match target {
            Target::Volume(id) => self.volumes.get(&id).map(|e| (e.rec.layer, e.rec.size)),
            Target::Snapshot(id) => self.snapshots.get(&id).map(|s| (s.layer, s.size)),
        }
    }

    /// Bytes the volumes provision: the sum of their sizes.
    pub fn provisioned(&self) -> u64 {
        self.volumes.values().map(|v| v.rec.size).sum()
    }
}

pub(crate) struct VolumeEntry {
    pub rec: VolumeRecord,
    /// Client writes enter here; closed while `rec.read_only`.
    pub gate: Arc<WriteGate>,
    /// Client requests wait here while over `rec.qos`.
    pub qos: Arc<Qos>,
}

impl VolumeEntry {
    pub fn new(rec: VolumeRecord) -> Self {
        let gate = WriteGate::new(rec.read_only);
        let qos = Arc::new(Qos::new(rec.qos));
        Self { rec, gate, qos }
    }
}

/// Everything the writer, readers and checkpoints share, behind one RwLock.
pub(crate) struct State {
    pub volumes: BTreeMap<u64, VolumeEntry>,
    pub names: HashMap<String, u64>,
    pub layers: Layers,
    pub snapshots: BTreeMap<u64, SnapshotRecord>,
    pub groups: BTreeMap<u64, GroupRecord>,
    pub group_snapshots: BTreeMap<u64, GroupRecord>,
    pub segs: SegmentTable,
    pub dirty_chunks: BTreeSet<(u64, u64)>,
    /// Segments whose crc table must be deleted from the store at the next checkpoint.
    pub freed_crc_tables: BTreeSet<u64>,
    /// Position after the last applied batch (and the next sequence number).
    pub applied: LogPos,
    pub generation: u64,
    pub log_bytes_since_ckpt: u64,
    /// The head segment was opened from the reserve (by the cleaner's moves or trims): client
    /// writes stay out of it while free segments are below the reserve (see `write/room.rs::reserve_room`).
    pub head_in_reserve: bool,
    /// Where the cleaner's moves go (see `write/cold.rs`); None until a move needs it.
    pub cold: Option<ColdHead>,
    /// Data keys of encrypted layers, wrapped, and open where their volume was unlocked.
    pub keys: crate::keys::Keys,
}

/// The open segment the cleaner's moves go to (`write/cold.rs`), and how far it is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ColdHead {
    pub seg: usize,
    pub off: u64,
}

/// A position in the log: the next batch's sequence number and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogPos {
    pub seq: u64,
    pub seg: usize,
    pub off: u64,
}

/// Applies a batch written (or replayed) at `pos` to the maps, crc tables and live counts, and
/// moves the applied position past it. Entries for layers that no longer exist are skipped.
pub(crate) fn apply(st: &mut State, h: &BatchHeader, pos: LogPos) {
    let hb = h.header_blocks() as u64;
    map_entries(st, &h.entries, st.segs.pba(pos.seg, pos.off / BLOCK as u64 + hb), &h.crcs);
    finish_batch(st, h.seq, pos, h.batch_len());
}

/// Maps `entries`, whose data blocks (with `crcs`) start at pool block `pba`.
pub(crate) fn map_entries(st: &mut State, entries: &[Entry], mut pba: u64, crcs: &[u32]) {
    if !crcs.is_empty() {
        st.segs.set_crcs(pba, crcs);
    }
    let mut freed = Vec::new();
    let State { layers, segs, dirty_chunks, .. } = st;
    for e in entries {
        let n = u64::from(e.blocks);
        let dirty = |c| {
            dirty_chunks.insert((e.layer, c));
        };
        match e.kind {
            EntryKind::Data => {
                if layers.map(e.layer, e.lba, n, pba, &mut freed, dirty) {
                    segs.add_live(pba, n, true);
                }
                pba += n;
            }
            EntryKind::Unmap => layers.unmap(e.layer, e.lba, n, &mut freed, dirty),
        }
    }
    for (p, n) in freed {
        segs.add_live(p, n, false);
    }
}

/// Moves the applied position past batch `seq` of `len` bytes, written at `pos`.
pub(crate) fn finish_batch(st: &mut State, seq: u64, pos: LogPos, len: u64) {
    st.segs.segs[pos.seg].last_seq = seq;
    st.applied = LogPos { seq: seq + 1, seg: pos.seg, off: pos.off + len };
    st.log_bytes_since_ckpt += len;
}

/// The id of snapshot `name`.
pub(crate) fn snapshot_by_name(st: &State, name: &str) -> Result<u64> {
    st.snapshots
        .values()
        .find(|s| s.name == name)
        .map(|s| s.id)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("snapshot {name:?} not found")))
}

const B: u64 = BLOCK as u64;

/// The ranges of the image whose head layer is `head` (`size` bytes) that changed since
/// snapshot `since` (None: its allocated ranges), within bytes [offset, offset+len) (ranges cut
/// at its edges), in bytes: in time of the window, not of the image.
pub(crate) fn changed_in(
    st: &State,
    head: u64,
    size: u64,
    since: Option<&str>,
    offset: u64,
    len: u64,
) -> Result<Vec<(u64, u64)>> {
    let end = offset.saturating_add(len).min(size);
    if offset >= end {
        return Ok(Vec::new());
    }
    let (first, blocks) = (offset / B, end.div_ceil(B) - offset / B);
    let mut runs: Vec<(u64, u64)> = match since {
        None => st
            .layers
            .resolve(head, first, blocks)
            .into_iter()
            .filter(|r| r.pba.is_some())
            .map(|r| (r.lba, r.blocks))
            .collect(),
        Some(name) => {
            let base = st.snapshots[&snapshot_by_name(st, name)?].layer;
            let mut out = Vec::new();
            let mut at = Some(head);
            loop {
                match at {
                    Some(l) if l == base => break,
                    Some(l) => {
                        let layer = &st.layers[&l];
                        out.extend(layer.map.entries_in(first, blocks).into_iter().map(|(lba, _, n)| (lba, n)));
                        at = layer.parent;
                    }
                    None => {
                        return Err(Error::new(
                            ErrorKind::InvalidArgument,
                            format!("snapshot {name:?} is not an earlier snapshot of this image"),
                        ));
                    }
                }
            }
            out
        }
    };
    runs.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (lba, n) in runs {
        match merged.last_mut() {
            Some((s, e)) if *e >= lba => *e = (*e).max(lba + n),
            _ => merged.push((lba, lba + n)),
        }
    }
    Ok(merged
        .into_iter()
        .map(|(s, e)| ((s * B).max(offset), (e * B).min(end)))
        .filter(|(s, e)| s < e)
        .map(|(s, e)| (s, e - s))
        .collect())
}
