//! A layer's map from logical blocks to physical blocks, cut into fixed chunks.
//!
//! Each chunk covers [`CHUNK_BLOCKS`] logical blocks and holds a sorted, non-overlapping list
//! of extents. Chunks are also the unit of checkpointing: a write dirties the chunks it touches,
//! and a checkpoint rewrites exactly those chunks' records, so no record ever overlaps another.
//! Sequential writes stay one extent per chunk; a fully random chunk holds at most
//! `CHUNK_BLOCKS` extents, so every splice is bounded.

use std::collections::BTreeMap;

use crate::format::{le16, le64};

/// Logical blocks per chunk (4 MiB of a volume).
pub const CHUNK_BLOCKS: u64 = 1024;

/// Physical block numbers from here up are zero markers, not media: a layer over a parent
/// records "reads as zeros" (a trim) this way, so the read does not fall through to the parent.
/// A zero marker at logical block `lba` is stored as `ZERO + lba`, so splitting and merging
/// extents works the same for both kinds.
pub const ZERO: u64 = 1 << 62;

/// True for a zero marker (see [`ZERO`]).
pub fn is_zero(pba: u64) -> bool {
    pba >= ZERO
}

/// A run of logical blocks mapped to consecutive physical blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ext {
    off: u16,
    len: u16,
    pba: u64,
}

impl Ext {
    fn end(&self) -> u16 {
        self.off + self.len
    }
}

/// One chunk's extents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chunk {
    ext: Vec<Ext>,
}

/// Physical runs (pba, blocks) that a map update unmapped, for live-space accounting.
pub type Freed = Vec<(u64, u64)>;

impl Chunk {
    /// Index of the first extent that ends past `off` (extents are sorted and disjoint).
    fn first_ending_after(&self, off: u16) -> usize {
        self.ext.partition_point(|e| e.end() <= off)
    }

    #[cfg(test)]
    fn lookup(&self, off: u16) -> Option<u64> {
        let i = self.first_ending_after(off);
        self.ext.get(i).filter(|e| e.off <= off).map(|e| e.pba + u64::from(off - e.off))
    }

    /// Maps [off, off+len) to pba.. (or unmaps it), pushing replaced runs into `freed`.
    fn set(&mut self, off: u16, len: u16, pba: Option<u64>, freed: &mut Freed) {
        let end = off + len;
        let first = self.first_ending_after(off);
        let mut last = first;
        let mut keep: Vec<Ext> = Vec::with_capacity(3);
        while last < self.ext.len() && self.ext[last].off < end {
            let e = self.ext[last];
            if e.off < off {
                keep.push(Ext { off: e.off, len: off - e.off, pba: e.pba });
            }
            let lo = e.off.max(off);
            let hi = e.end().min(end);
            freed.push((e.pba + u64::from(lo - e.off), u64::from(hi - lo)));
            if e.end() > end {
                keep.push(Ext { off: end, len: e.end() - end, pba: e.pba + u64::from(end - e.off) });
            }
            last += 1;
        }
        if let Some(pba) = pba {
            let at = keep.iter().position(|e| e.off > off).unwrap_or(keep.len());
            keep.insert(at, Ext { off, len, pba });
        }
        self.ext.splice(first..last, keep);
        self.merge_around(first);
    }

    /// Merges physically contiguous neighbours around index `i` to keep chunks compact.
    fn merge_around(&mut self, i: usize) {
        let lo = i.saturating_sub(1);
        let mut j = lo;
        while j + 1 < self.ext.len() && j <= i + 2 {
            let (a, b) = (self.ext[j], self.ext[j + 1]);
            if a.end() == b.off && a.pba + u64::from(a.len) == b.pba {
                self.ext[j].len += b.len;
                self.ext.remove(j + 1);
            } else {
                j += 1;
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.ext.is_empty()
    }

    /// Blocks mapped to data (zero markers excluded).
    fn mapped_blocks(&self) -> u64 {
        self.ext.iter().filter(|e| !is_zero(e.pba)).map(|e| u64::from(e.len)).sum()
    }

    /// Serialises for the checkpoint: count, then (off u16, len u16, pba u64) each.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(2 + self.ext.len() * 12);
        v.extend_from_slice(&u16::try_from(self.ext.len()).expect("bounded by CHUNK_BLOCKS").to_le_bytes());
        for e in &self.ext {
            v.extend_from_slice(&e.off.to_le_bytes());
            v.extend_from_slice(&e.len.to_le_bytes());
            v.extend_from_slice(&e.pba.to_le_bytes());
        }
        v
    }

    /// Parses a checkpoint record; None if it is malformed.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let n = usize::from(le16(b.get(..2)?, 0));
        if b.len() != 2 + n * 12 {
            return None;
        }
        let mut ext = Vec::with_capacity(n);
        let mut prev_end = 0u16;
        for i in 0..n {
            let at = 2 + i * 12;
            let e = Ext { off: le16(b, at), len: le16(b, at + 2), pba: le64(b, at + 4) };
            if e.len == 0 || e.off < prev_end || u64::from(e.off) + u64::from(e.len) > CHUNK_BLOCKS {
                return None;
            }
            prev_end = e.end();
            ext.push(e);
        }
        Some(Self { ext })
    }
}

/// A whole layer's map.
#[derive(Debug, Clone, Default)]
pub struct ExtentMap {
    chunks: BTreeMap<u64, Chunk>,
    mapped: u64,
}

fn split(lba: u64) -> (u64, u16) {
    (lba / CHUNK_BLOCKS, u16::try_from(lba % CHUNK_BLOCKS).expect("below CHUNK_BLOCKS"))
}

impl ExtentMap {
    /// The physical block for a logical block, if mapped.
    #[cfg(test)]
    pub fn lookup(&self, lba: u64) -> Option<u64> {
        let (c, off) = split(lba);
        self.chunks.get(&c)?.lookup(off)
    }

    /// Maps `blocks` logical blocks from `lba` to `pba..` (or unmaps them with `None`). Calls
    /// `dirty` with every chunk index touched and pushes replaced physical runs into `freed`.
    pub fn set(&mut self, lba: u64, blocks: u64, pba: Option<u64>, freed: &mut Freed, mut dirty: impl FnMut(u64)) {
        let mut done = 0;
        while done < blocks {
            let (c, off) = split(lba + done);
            let n = (CHUNK_BLOCKS - u64::from(off)).min(blocks - done);
            let n16 = u16::try_from(n).expect("at most CHUNK_BLOCKS");
            let before = freed.len();
            match pba {
                Some(p) => {
                    self.chunks.entry(c).or_default().set(off, n16, Some(p + done), freed);
                    if !is_zero(p) {
                        self.mapped += n;
                    }
                    dirty(c);
                }
                None => {
                    if let Some(chunk) = self.chunks.get_mut(&c) {
                        chunk.set(off, n16, None, freed);
                        if chunk.is_empty() {
                            self.chunks.remove(&c);
                        }
                        dirty(c);
                    }
                }
            }
            // Replaced zero markers free no space.
            let mut i = before;
            while i < freed.len() {
                if is_zero(freed[i].0) {
                    freed.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            self.mapped -= freed[before..].iter().map(|r| r.1).sum::<u64>();
            done += n;
        }
    }

    /// Unmaps a large range efficiently, visiting only chunks that exist.
    pub fn unmap(&mut self, lba: u64, blocks: u64, freed: &mut Freed, mut dirty: impl FnMut(u64)) {
        let end = lba + blocks;
        let first = lba / CHUNK_BLOCKS;
        let last = (end - 1) / CHUNK_BLOCKS;
        let present: Vec<u64> = self.chunks.range(first..=last).map(|(&c, _)| c).collect();
        for c in present {
            let lo = (c * CHUNK_BLOCKS).max(lba);
            let hi = ((c + 1) * CHUNK_BLOCKS).min(end);
            self.set(lo, hi - lo, None, freed, &mut dirty);
        }
    }

    /// Marks `blocks` logical blocks from `lba` as reading zeros (over whatever a parent holds).
    pub fn set_zero(&mut self, lba: u64, blocks: u64, freed: &mut Freed, dirty: impl FnMut(u64)) {
        self.set(lba, blocks, Some(ZERO + lba), freed, dirty);
    }

    /// Ranges within [lba, lba+blocks) this layer says nothing about (neither data nor zero
    /// marker), as (lba, blocks): where a read falls through to the parent.
    pub fn gaps(&self, lba: u64, blocks: u64) -> Vec<(u64, u64)> {
        let end = lba + blocks;
        let mut out = Vec::new();
        let mut at = lba;
        for (lo, _, n) in self.entries_in(lba, blocks) {
            if lo > at {
                out.push((at, lo - at));
            }
            at = lo + n;
        }
        if at < end {
            out.push((at, end - at));
        }
        out
    }

    /// Entries (data and zero markers) overlapping [lba, lba+blocks), clipped to it, as
    /// (lba, pba, blocks), in order.
    pub fn entries_in(&self, lba: u64, blocks: u64) -> Vec<(u64, u64, u64)> {
        let end = lba + blocks;
        let mut out = Vec::new();
        if blocks == 0 {
            return out;
        }
        for (&c, ch) in self.chunks.range(lba / CHUNK_BLOCKS..=(end - 1) / CHUNK_BLOCKS) {
            let base = c * CHUNK_BLOCKS;
            // Skip to the first extent that ends past `lba` (a fragmented chunk holds up to a
            // thousand, and most reads want one or two); chunks after the first start at 0.
            let off = u16::try_from(lba.saturating_sub(base)).expect("inside the chunk");
            for e in &ch.ext[ch.first_ending_after(off)..] {
                let lo = (base + u64::from(e.off)).max(lba);
                let hi = (base + u64::from(e.end())).min(end);
                if lo >= hi {
                    break;
                }
                out.push((lo, e.pba + (lo - base - u64::from(e.off)), hi - lo));
            }
        }
        out
    }

    /// Every entry, data and zero markers, as (lba, pba, blocks).
    pub fn all_entries(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.entries_in_chunks(0..u64::MAX)
    }

    /// The entries of chunks `chunks` (of [`CHUNK_BLOCKS`] logical blocks each), as (lba, pba, blocks).
    fn entries_in_chunks(&self, chunks: std::ops::Range<u64>) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.chunks.range(chunks).flat_map(|(&c, ch)| {
            ch.ext.iter().map(move |e| (c * CHUNK_BLOCKS + u64::from(e.off), e.pba, u64::from(e.len)))
        })
    }

    /// Number of mapped blocks.
    pub fn mapped_blocks(&self) -> u64 {
        self.mapped
    }

    /// The chunk at index `c`, for checkpointing.
    pub fn chunk(&self, c: u64) -> Option<&Chunk> {
        self.chunks.get(&c)
    }

    /// Installs a chunk loaded from a checkpoint.
    pub fn load_chunk(&mut self, c: u64, chunk: Chunk) {
        self.mapped += chunk.mapped_blocks();
        if let Some(old) = self.chunks.insert(c, chunk) {
            self.mapped -= old.mapped_blocks();
        }
    }

    /// Every run mapped to data (zero markers excluded) as (lba, pba, blocks).
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.all_entries().filter(|e| !is_zero(e.1))
    }

    /// The runs mapped to data in chunks `chunks` (of [`CHUNK_BLOCKS`] logical blocks each).
    pub fn runs_in_chunks(&self, chunks: std::ops::Range<u64>) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.entries_in_chunks(chunks).filter(|e| !is_zero(e.1))
    }

    /// One past the last chunk index in use.
    pub fn chunk_end(&self) -> u64 {
        self.chunks.keys().next_back().map_or(0, |c| c + 1)
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn overwrite_splits_and_frees() {
        let mut m = ExtentMap::default();
        let mut freed = Vec::new();
        m.set(0, 10, Some(100), &mut freed, |_| {});
        assert!(freed.is_empty());
        m.set(3, 2, Some(500), &mut freed, |_| {});
        assert_eq!(freed, vec![(103, 2)]);
        assert_eq!(m.lookup(2), Some(102));
        assert_eq!(m.lookup(3), Some(500));
        assert_eq!(m.lookup(5), Some(105));
        assert_eq!(m.lookup(10), None);
        assert_eq!(m.mapped_blocks(), 10);
        freed.clear();
        m.unmap(0, 1 << 40, &mut freed, |_| {});
        assert_eq!(m.mapped_blocks(), 0);
        assert_eq!(freed.iter().map(|r| r.1).sum::<u64>(), 10);
    }

    #[test]
    fn sequential_writes_merge() {
        let mut m = ExtentMap::default();
        let mut freed = Vec::new();
        for i in 0..100 {
            m.set(i, 1, Some(1000 + i), &mut freed, |_| {});
        }
        assert_eq!(m.chunk(0).unwrap().ext.len(), 1);
        let enc = m.chunk(0).unwrap().encode();
        assert_eq!(Chunk::decode(&enc).as_ref(), m.chunk(0));
        assert_eq!(Chunk::decode(&enc[1..]), None);
    }

    proptest! {
        /// The map agrees with a plain per-block array under random updates, and the freed runs
        /// account for exactly the blocks that were replaced.
        #[test]
        fn matches_reference(
            ops in prop::collection::vec((0u64..3000, 1u64..1500, any::<bool>()), 1..60),
            queries in prop::collection::vec((0u64..4400, 1u64..100), 1..8),
        ) {
            let mut m = ExtentMap::default();
            let mut reference = vec![None; 4500];
            let mut next_pba = 1u64 << 20;
            for (lba, n, map) in ops {
                let mut freed = Vec::new();
                let pba = map.then_some(next_pba);
                let was: u64 = reference[lba as usize..(lba + n) as usize].iter().filter(|x| x.is_some()).count() as u64;
                if map { m.set(lba, n, pba, &mut freed, |_| {}) } else { m.unmap(lba, n, &mut freed, |_| {}) }
                for i in 0..n {
                    reference[(lba + i) as usize] = pba.map(|p| p + i);
                }
                next_pba += n + 7;
                prop_assert_eq!(freed.iter().map(|r| r.1).sum::<u64>(), was);
            }
            for (i, r) in reference.iter().enumerate() {
                prop_assert_eq!(m.lookup(i as u64), *r);
            }
            prop_assert_eq!(m.mapped_blocks(), reference.iter().filter(|x| x.is_some()).count() as u64);
            for (at, len) in queries.into_iter().chain([(100, 4000)]) {
                let len = len.min(4500 - at);
                let mut mapped = vec![false; 4500];
                let mut last_end = at;
                for (l, p, n) in m.entries_in(at, len) {
                    prop_assert!(l >= last_end && l + n <= at + len, "in order, inside the range");
                    last_end = l + n;
                    for i in 0..n {
                        prop_assert_eq!(reference[(l + i) as usize], Some(p + i));
                        mapped[(l + i) as usize] = true;
                    }
                }
                for (l, n) in m.gaps(at, len) {
                    for i in l..l + n {
                        prop_assert!(!mapped[i as usize]);
                    }
                }
                for i in at..at + len {
                    prop_assert_eq!(mapped[i as usize], reference[i as usize].is_some(), "block {}", i);
                }
            }
        }
    }

    proptest! {
        /// The chunk decoder takes arbitrary bytes without panicking.
        #[test]
        fn chunk_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..9000)) {
            let _ = Chunk::decode(&bytes);
        }
    }
}
