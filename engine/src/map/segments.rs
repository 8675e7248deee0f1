//! The segment table: state, live blocks and per-block checksums of every segment.
//!
//! Invariants (kept by the pool under its state lock):
//! - exactly one segment is `Open` (the log head) once the pool is running;
//! - a segment's `live` counts the mapped blocks pointing into it;
//! - a `Sealed` segment becomes `Free` only when a checkpoint captured while its `live` was 0
//!   is durable and no reader is between resolving a block in it and reading that block.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::format::DATA_START;
use crate::io::BLOCK;

/// Lifecycle of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegState {
    /// Holds nothing anyone needs; may be written.
    Free,
    /// The log head: batches are being appended.
    Open,
    /// Full (or left behind by the head); its live blocks are still referenced.
    Sealed,
}

#[derive(Debug)]
pub(crate) struct Segment {
    pub state: SegState,
    pub live: u64,
    /// Highest batch sequence written into it.
    pub last_seq: u64,
    /// crc32c of each block, present while the segment is not free.
    pub crcs: Option<Box<[u32]>>,
    /// crcs changed since the last checkpoint.
    pub crc_dirty: bool,
    /// Holds a block that failed its crc: never a cleaner's victim (moving would launder the
    /// damage under a fresh checksum); forgotten when the segment is freed because its data died.
    pub damaged: bool,
    /// Written by the cleaner's moves (the cold head), since it was last taken free. Not kept
    /// across a reopen.
    pub cold: bool,
}

/// Readers between resolving a block in a segment and finishing their media read, per segment.
/// Atomics outside the state lock, so a finished read unpins without taking the lock; a read
/// still pins while it holds the state lock to resolve, which is what makes the pin visible to
/// `maint/checkpoint.rs::release` before that segment can be freed.
#[derive(Debug)]
pub(crate) struct ReadPins(Box<[AtomicU32]>);

impl ReadPins {
    pub fn new(segments: u64) -> Self {
        Self((0..segments).map(|_| AtomicU32::new(0)).collect())
    }

    pub fn enter(&self, seg: usize) {
        self.0[seg].fetch_add(1, Ordering::AcqRel);
    }

    pub fn exit(&self, seg: usize) {
        self.0[seg].fetch_sub(1, Ordering::AcqRel);
    }

    pub fn any(&self, seg: usize) -> bool {
        self.0[seg].load(Ordering::Acquire) > 0
    }
}

/// Segments pinned by one reader, unpinned when it is dropped.
pub(crate) struct Pinned<'a> {
    pins: &'a ReadPins,
    segs: Vec<usize>,
}

impl<'a> Pinned<'a> {
    pub fn new(pins: &'a ReadPins) -> Self {
        Self { pins, segs: Vec::new() }
    }

    /// Pins `seg` (once when called repeatedly for the same segment in a row).
    pub fn pin(&mut self, seg: usize) {
        if self.segs.last() != Some(&seg) {
            self.pins.enter(seg);
            self.segs.push(seg);
        }
    }

    /// The segments pinned (repeats possible).
    pub fn segments(&self) -> &[usize] {
        &self.segs
    }

    /// Keeps the pins past this value (to hand them to another thread, which
    /// [`Pinned::adopt`]s them to unpin).
    pub fn into_held(mut self) -> Vec<usize> {
        std::mem::take(&mut self.segs)
    }

    /// Takes over pins kept by [`Pinned::into_held`].
    pub fn adopt(pins: &'a ReadPins, segs: Vec<usize>) -> Self {
        Self { pins, segs }
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        for &s in &self.segs {
            self.pins.exit(s);
        }
    }
}

/// Geometry plus per-segment state.
#[derive(Debug)]
pub(crate) struct SegmentTable {
    pub blocks_per_seg: u64,
    pub segs: Vec<Segment>,
}

impl SegmentTable {
    pub fn new(seg_size: u64, count: u64) -> Self {
        let n = usize::try_from(count).expect("segment count fits usize");
        let segs = (0..n)
            .map(|_| Segment {
                state: SegState::Free,
                live: 0,
                last_seq: 0,
                crcs: None,
                crc_dirty: false,
                damaged: false,
                cold: false,
            })
            .collect();
        Self { blocks_per_seg: seg_size / BLOCK as u64, segs }
    }

    /// Physical block number of block `off` of segment `seg`.
    pub fn pba(&self, seg: usize, block: u64) -> u64 {
        DATA_START / BLOCK as u64 + seg as u64 * self.blocks_per_seg + block
    }

    /// (segment, block within segment) of a physical block.
    pub fn locate(&self, pba: u64) -> (usize, usize) {
        let rel = pba - DATA_START / BLOCK as u64;
        let seg = usize::try_from(rel / self.blocks_per_seg).expect("segment index fits usize");
        let blk = usize::try_from(rel % self.blocks_per_seg).expect("block index fits usize");
        (seg, blk)
    }

    /// crc of a physical block (None if its segment holds no table: a bug or a corrupt map).
    pub fn crc(&self, pba: u64) -> Option<u32> {
        let (s, b) = self.locate(pba);
        self.segs.get(s)?.crcs.as_ref().map(|c| c[b])
    }

    /// Records the crcs of blocks just written at `pba..`.
    pub fn set_crcs(&mut self, pba: u64, crcs: &[u32]) {
        let (s, b) = self.locate(pba);
        let bps = usize::try_from(self.blocks_per_seg).expect("fits");
        let seg = &mut self.segs[s];
        let table = seg.crcs.get_or_insert_with(|| vec![0; bps].into_boxed_slice());
        table[b..b + crcs.len()].copy_from_slice(crcs);
        seg.crc_dirty = true;
    }

    /// Adjusts live counts for `blocks` blocks at `pba..` (a run may cross segments).
    pub fn add_live(&mut self, pba: u64, blocks: u64, add: bool) {
        let mut done = 0;
        while done < blocks {
            let (s, b) = self.locate(pba + done);
            let n = (self.blocks_per_seg - b as u64).min(blocks - done);
            let seg = &mut self.segs[s];
            if add {
                seg.live += n;
            } else {
                debug_assert!(seg.live >= n, "live count underflow in segment {s}");
                seg.live = seg.live.saturating_sub(n);
            }
            done += n;
        }
    }

    /// Indices of the sealed segments.
    pub fn sealed(&self) -> std::collections::BTreeSet<usize> {
        self.segs.iter().enumerate().filter(|(_, s)| s.state == SegState::Sealed).map(|(i, _)| i).collect()
    }

    /// True if some sealed segment holds no live block and no reader (a checkpoint would free
    /// it). A pinned one is usually the cleaner's victim, still being read: checkpointing for it
    /// would free nothing.
    pub fn any_empty_sealed(&self, pins: &ReadPins) -> bool {
        self.segs.iter().enumerate().any(|(i, s)| s.state == SegState::Sealed && s.live == 0 && !pins.any(i))
    }

    pub fn count(&self, state: SegState) -> usize {
        self.segs.iter().filter(|s| s.state == state).count()
    }

    pub fn live_blocks(&self) -> u64 {
        self.segs.iter().map(|s| s.live).sum()
    }

    /// Takes a free segment for the log head, lowest index first; `reserve` free segments are
    /// left for unmap-only batches (and, later, the cleaner).
    pub fn take_free(&mut self, reserve: usize) -> Option<usize> {
        if self.count(SegState::Free) <= reserve {
            return None;
        }
        let i = self.segs.iter().position(|s| s.state == SegState::Free)?;
        let seg = &mut self.segs[i];
        seg.state = SegState::Open;
        seg.live = 0;
        seg.crcs = None;
        seg.crc_dirty = false;
        seg.cold = false;
        Some(i)
    }
}
