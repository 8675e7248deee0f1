//! Opening a pool's state: load the last checkpoint, then replay the log after it.
//!
//! Recovery policy (named, and logged): **truncate at the first invalid batch**. Replay starts
//! at the checkpoint's position and sequence and accepts a batch only if its header checksum,
//! pool tag, sequence (exactly the next one) and generation (not older than the checkpoint's)
//! are right and every data block matches its crc. When a segment holds no further valid batch,
//! replay follows the chain record for the next sequence, if any. Where the store does not hold
//! the next batch, the tail file may: after a process crash it has the open batch and those in
//! flight, whole; such a batch is written to its place on the store and replayed like the rest.
//! Anything after the first failure is ignored and reported: it was never covered by a
//! completed flush, since a flush syncs every batch before it, and no process crash lost it
//! (the tail file would have it). The new generation written by the post-recovery
//! checkpoint makes sure nothing past the truncation point can be picked up later.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::map::layers::{Layer, Layers, Table};

use crate::error::{Error, Result, corrupt};
use crate::format::{BatchHeader, Superblock};
use crate::io::{AlignedBuf, BLOCK, Backend};
use crate::map::segments::{SegState, SegmentTable};
use crate::meta::Meta;
use crate::state::{ColdHead, LogPos, State, VolumeEntry, apply};
use crate::write::tailfile::TailFile;

/// What recovery did when the pool was opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Sequence number replay started from (the checkpoint's).
    pub from_seq: u64,
    /// Batches replayed from the log (those from the tail file among them).
    pub batches_replayed: u64,
    /// Batches the process had not written to the store when it stopped, taken from the tail
    /// file (acknowledged writes a process crash would otherwise have lost).
    pub batches_from_tail: u64,
    /// Data blocks those batches carried.
    pub blocks_replayed: u64,
    /// If replay stopped at a batch that looked like ours but was damaged: why and where.
    pub truncated: Option<String>,
    /// The format version the pool had, when opening it upgraded it to the current one.
    pub upgraded_from: Option<u32>,
}

/// Why a candidate batch was not accepted.
enum Stop {
    /// Nothing that looks like the next batch: the normal end of the log.
    End,
    /// The next batch is there but damaged (torn or corrupt).
    Damaged(String),
}

/// Loads the checkpointed state from `meta` and replays the log on `backend`.
pub(crate) fn recover(
    meta: &Meta,
    backend: &dyn Backend,
    sb: &Superblock,
    tail: &TailFile,
) -> Result<(State, RecoveryReport)> {
    let ckpt = meta.checkpoint()?;
    let mut segs = SegmentTable::new(sb.segment_size, sb.segment_count);
    let mut volumes = BTreeMap::new();
    let mut names = HashMap::new();
    let mut layers = Table::default();
    for rec in meta.volumes()? {
        names.insert(rec.name.clone(), rec.id);
        // A volume's head without a layer record (pools from before snapshots) is a root.
        layers.insert(rec.layer, Layer::over(None, None));
        volumes.insert(rec.id, VolumeEntry::new(rec));
    }
    for l in meta.layers()? {
        layers.insert(l.id, Layer::over(l.parent, l.key));
    }
    let data_keys = crate::keys::load(meta)?;
    for (&id, l) in &layers {
        if let Some(k) = l.key.filter(|k| !data_keys.contains_key(k)) {
            return Err(corrupt(format!("metadata: layer {id} names a missing data key {k}")));
        }
    }
    for (&id, l) in &layers {
        if let Some(p) = l.parent.filter(|p| !layers.contains_key(p)) {
            return Err(corrupt(format!("metadata: layer {id} names a missing parent layer {p}")));
        }
    }
    let mut snapshots = BTreeMap::new();
    for rec in meta.snapshots()? {
        if !layers.contains_key(&rec.layer) {
            return Err(corrupt(format!("metadata: snapshot {:?} names a missing layer {}", rec.name, rec.layer)));
        }
        snapshots.insert(rec.id, rec);
    }
    let mut stale_chunks = BTreeSet::new();
    meta.chunks(|layer, c, chunk| match layers.get_mut(&layer) {
        Some(l) => l.map.load_chunk(c, chunk),
        None => {
            stale_chunks.insert((layer, c));
        }
    })?;
    let bps = usize::try_from(segs.blocks_per_seg).expect("fits");
    let mut bad_table = None;
    meta.crc_tables(|seg, bytes| {
        let Some(s) = usize::try_from(seg).ok().and_then(|i| segs.segs.get_mut(i)) else {
            bad_table = Some(seg);
            return;
        };
        if bytes.len() != bps * 4 {
            bad_table = Some(seg);
            return;
        }
        s.crcs = Some(bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4"))).collect());
    })?;
    if let Some(seg) = bad_table {
        return Err(corrupt(format!("metadata: malformed crc table for segment {seg}")));
    }
    let layers =
        Layers::load(layers).map_err(|ids| corrupt(format!("metadata: layers {ids:?} form a parent cycle")))?;
    for l in layers.values() {
        for (_, pba, n) in l.map.runs() {
            let inside = pba >= segs.pba(0, 0) && pba + n <= segs.pba(segs.segs.len(), 0);
            if !inside {
                return Err(corrupt(format!("metadata: a map points outside the pool (block {pba})")));
            }
            segs.add_live(pba, n, true);
        }
    }
    let head_seg = usize::try_from(ckpt.seg).ok().filter(|&s| s < segs.segs.len());
    let Some(head_seg) = head_seg else {
        return Err(corrupt(format!("checkpoint names segment {} outside the pool", ckpt.seg)));
    };
    let mut st = State {
        volumes,
        names,
        layers,
        snapshots,
        groups: meta.groups(false)?.into_iter().map(|g| (g.id, g)).collect(),
        group_snapshots: meta.groups(true)?.into_iter().map(|g| (g.id, g)).collect(),
        segs,
        dirty_chunks: stale_chunks,
        freed_crc_tables: BTreeSet::new(),
        applied: LogPos { seq: ckpt.seq, seg: head_seg, off: ckpt.off },
        generation: ckpt.generation + 1,
        log_bytes_since_ckpt: 0,
        head_in_reserve: false,
        cold: None,
        keys: data_keys,
    };
    let report = replay(meta, backend, sb, tail, &mut st, ckpt.generation)?;
    st.layers.build_views();
    // The cold head continues where the checkpoint left it: past that, nothing was committed.
    let seg_size = sb.segment_size;
    st.cold = ckpt
        .cold
        .and_then(|(seg, off)| Some(ColdHead { seg: usize::try_from(seg).ok()?, off }))
        .filter(|c| c.seg < st.segs.segs.len() && c.seg != st.applied.seg && c.off < seg_size);
    // Segment states: the heads are open; anything with live data is sealed; the rest is free.
    let head = st.applied.seg;
    let cold = st.cold.map(|c| c.seg);
    if let Some(c) = cold {
        st.segs.segs[c].cold = true;
    }
    for (i, s) in st.segs.segs.iter_mut().enumerate() {
        s.state = if i == head || Some(i) == cold {
            SegState::Open
        } else if s.live > 0 {
            SegState::Sealed
        } else {
            if s.crcs.take().is_some() {
                st.freed_crc_tables.insert(i as u64);
            }
            SegState::Free
        };
        s.crc_dirty = s.crcs.is_some() && s.crc_dirty;
    }
    Ok((st, report))
}

fn replay(
    meta: &Meta,
    backend: &dyn Backend,
    sb: &Superblock,
    tail: &TailFile,
    st: &mut State,
    gen_floor: u64,
) -> Result<RecoveryReport> {
    let chain = meta.chain()?;
    let mut report = RecoveryReport { from_seq: st.applied.seq, ..Default::default() };
    let mut floor = gen_floor;
    // The read cursor; `st.applied` (moved by `apply`) stays after the last batch replayed.
    let mut pos = st.applied;
    // The batch last written from the tail file: read back, it must be accepted.
    let mut written_from_tail = None;
    loop {
        let stop = match read_batch(backend, sb, pos, floor) {
            Ok(h) => {
                floor = h.generation;
                report.batches_replayed += 1;
                report.blocks_replayed += h.crcs.len() as u64;
                apply(st, &h, pos);
                pos = st.applied;
                continue;
            }
            Err(stop) => stop,
        };
        // The writer records a segment move durably before writing the batch that starts the new
        // segment, so a chain record for this sequence means nothing here belongs to the log.
        match chain.get(&pos.seq).and_then(|&s| usize::try_from(s).ok()) {
            Some(seg) if seg < st.segs.segs.len() && !(seg == pos.seg && pos.off == 0) => {
                pos = LogPos { seq: pos.seq, seg, off: 0 };
            }
            _ => {
                // Not on the store: the process may have stopped before writing it. The tail
                // file's copy goes exactly where the log continues, nowhere else.
                let (found, stop) = match tail.find(pos.seq, floor, sb.uuid_tag()) {
                    Ok(f) => (f, stop),
                    Err(why) => (None, Stop::Damaged(why)),
                };
                let found = found
                    .filter(|f| f.at == pos && f.at.off + f.bytes.len() as u64 <= sb.segment_size)
                    .filter(|_| written_from_tail != Some(pos.seq));
                if let Some(f) = found {
                    let at = f.at;
                    backend.write_at(&f.bytes, sb.segment_offset(at.seg, at.off)).map_err(|e| {
                        Error::io(format!("writing batch {} from the tail file to segment {}", at.seq, at.seg), e)
                    })?;
                    tracing::info!(
                        seq = at.seq,
                        segment = at.seg,
                        offset = at.off,
                        blocks = f.header.crcs.len(),
                        "recovery took a batch the process had not written from the tail file"
                    );
                    report.batches_from_tail += 1;
                    written_from_tail = Some(at.seq);
                    continue;
                }
                if let Stop::Damaged(why) = stop {
                    tracing::warn!(seq = pos.seq, segment = pos.seg, offset = pos.off, reason = %why,
                        "recovery truncated the log here: what follows was never flushed and is dropped");
                    report.truncated = Some(why);
                }
                return Ok(report);
            }
        }
    }
}

/// Reads and verifies the batch at `pos`, if it is the next one.
fn read_batch(backend: &dyn Backend, sb: &Superblock, pos: LogPos, floor: u64) -> Result<BatchHeader, Stop> {
    let seg_size = sb.segment_size;
    if pos.off + BLOCK as u64 > seg_size {
        return Err(Stop::End);
    }
    let at = sb.segment_offset(pos.seg, pos.off);
    let io_err = |e: std::io::Error| {
        Stop::Damaged(Error::io(format!("reading segment {} at {}", pos.seg, pos.off), e).to_string())
    };
    let mut first = AlignedBuf::new(BLOCK);
    backend.read_at(&mut first, at).map_err(io_err)?;
    let Some(hb) = BatchHeader::peek_header_blocks(&first) else { return Err(Stop::End) };
    let hlen = (hb * BLOCK) as u64;
    if pos.off + hlen > seg_size {
        return Err(Stop::End);
    }
    let mut hbuf = AlignedBuf::new(hb * BLOCK);
    hbuf[..BLOCK].copy_from_slice(&first);
    if hb > 1 {
        backend.read_at(&mut hbuf[BLOCK..], at + BLOCK as u64).map_err(io_err)?;
    }
    let where_ = || format!("batch {} at segment {} offset {}", pos.seq, pos.seg, pos.off);
    let Some(h) = BatchHeader::decode(&hbuf) else {
        // Our magic but a bad header: torn if it is where the next batch should be.
        return Err(Stop::Damaged(format!("{}: header checksum mismatch (torn or corrupt)", where_())));
    };
    if h.uuid_tag != sb.uuid_tag() || h.seq != pos.seq || h.generation < floor {
        return Err(Stop::End);
    }
    if pos.off + h.batch_len() > seg_size {
        return Err(Stop::Damaged(format!("{}: batch runs past the segment end", where_())));
    }
    let mut data = AlignedBuf::new(h.crcs.len() * BLOCK);
    if !h.crcs.is_empty() {
        backend.read_at(&mut data, at + hlen).map_err(io_err)?;
    }
    for (i, (block, crc)) in data.chunks(BLOCK).zip(&h.crcs).enumerate() {
        if crate::format::block_crc(block) != *crc {
            return Err(Stop::Damaged(format!("{}: data block {i} checksum mismatch (torn write)", where_())));
        }
    }
    Ok(h)
}
