//! Scrub: read every live block, verify its crc32c, and name what a damaged block belongs to.
//!
//! The live blocks are listed once (every layer's data runs), sorted by physical position so the
//! store is read sequentially, and read a chunk at a time. Each chunk pins its segments and then
//! keeps only the blocks still mapped where the listing found them (the cleaner or a write may
//! have moved them meanwhile); a pinned segment cannot be freed, so what is read is what the
//! crc table describes. No lock is held during I/O.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::format::block_crc;
use crate::io::BLOCK;
use crate::map::layers::still_mapped;
use crate::map::segments::Pinned;
use crate::pool::Pool;
use crate::state::State;

/// A listed run still mapped where it was: (pba, layer, lba, blocks, crc of each block).
type Checked = (u64, u64, u64, u64, Vec<Option<u32>>);

/// Blocks read per chunk (1 MiB).
const CHUNK_BLOCKS: u64 = 256;

/// A damaged block and what reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// Byte offset in the images that read the block.
    pub offset: u64,
    /// Pool block number.
    pub pool_block: u64,
    /// Volumes (`name`) and snapshots (`volume@snapshot`, or `@snapshot` once the volume is
    /// gone) whose content includes this block.
    pub images: Vec<String>,
}

/// Progress of a scrub, reported after every chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrubProgress {
    pub checked_bytes: u64,
    pub total_bytes: u64,
    pub damaged_blocks: u64,
}

/// What a scrub found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrubReport {
    pub checked_bytes: u64,
    pub damaged: Vec<Damage>,
}

/// Names of the volumes and snapshots whose chain contains `layer`.
fn images_of(st: &State, layer: u64) -> Vec<String> {
    let has = |mut at: Option<u64>| {
        while let Some(l) = at {
            if l == layer {
                return true;
            }
            at = st.layers.get(&l).and_then(|x| x.parent);
        }
        false
    };
    let mut out: Vec<String> =
        st.volumes.values().filter(|v| has(Some(v.rec.layer))).map(|v| v.rec.name.clone()).collect();
    for s in st.snapshots.values().filter(|s| has(Some(s.layer))) {
        let vol = st.volumes.get(&s.volume).map(|v| v.rec.name.as_str()).unwrap_or("");
        out.push(format!("{vol}@{}", s.name));
    }
    out.sort();
    out
}

impl Pool {
    /// Verifies the checksum of every live block; `progress` is called after every chunk.
    pub fn scrub(&self, progress: &mut dyn FnMut(ScrubProgress)) -> Result<ScrubReport> {
        let inner = &self.inner;
        inner.check_open()?;
        // (pba, layer, lba, blocks), by physical position.
        let mut runs: Vec<(u64, u64, u64, u64)> = {
            let st = inner.state.read();
            st.layers.iter().flat_map(|(&id, l)| l.map.runs().map(move |(lba, pba, n)| (pba, id, lba, n))).collect()
        };
        runs.sort_unstable();
        let total: u64 = runs.iter().map(|r| r.3).sum();
        let mut report = ScrubReport::default();
        let mut p = ScrubProgress { checked_bytes: 0, total_bytes: total * BLOCK as u64, damaged_blocks: 0 };
        progress(p);
        // Split into chunks of about CHUNK_BLOCKS.
        let mut chunk: Vec<(u64, u64, u64, u64)> = Vec::new();
        let mut blocks = 0;
        let mut i = 0;
        while i < runs.len() || !chunk.is_empty() {
            if i < runs.len() && blocks < CHUNK_BLOCKS {
                let (pba, layer, lba, n) = runs[i];
                let k = n.min(CHUNK_BLOCKS - blocks);
                chunk.push((pba, layer, lba, k));
                blocks += k;
                if k == n {
                    i += 1;
                } else {
                    runs[i] = (pba + k, layer, lba + k, n - k);
                }
                continue;
            }
            self.scrub_chunk(&chunk, &mut report)?;
            p.checked_bytes += blocks * BLOCK as u64;
            p.damaged_blocks = report.damaged.len() as u64;
            progress(p);
            chunk.clear();
            blocks = 0;
        }
        report.checked_bytes = p.checked_bytes;
        Ok(report)
    }

    fn scrub_chunk(&self, chunk: &[(u64, u64, u64, u64)], report: &mut ScrubReport) -> Result<()> {
        let inner = &self.inner;
        let mut pinned = Pinned::new(&inner.pins);
        {
            let st = inner.state.read();
            let segs: BTreeSet<usize> =
                chunk.iter().flat_map(|c| st.segs.locate(c.0).0..=st.segs.locate(c.0 + c.3 - 1).0).collect();
            segs.into_iter().for_each(|s| pinned.pin(s));
        }
        // Still mapped where listed? Then the crc table describes what we are about to read.
        let mut keep: Vec<Checked> = Vec::new();
        {
            let st = inner.state.read();
            for &(pba, layer, lba, n) in chunk {
                for (at, p, k) in still_mapped(&st.layers, layer, lba, pba, n) {
                    keep.push((p, layer, at, k, (p..p + k).map(|b| st.segs.crc(b)).collect()));
                }
            }
        }
        let runs: Vec<(u64, u64)> = keep.iter().map(|k| (k.0, k.3)).collect();
        let media = crate::write::tail::read_runs(&inner.ctx, &inner.log.tail, &runs)
            .map_err(|e| Error::io("scrub: reading live blocks", e))?;
        drop(pinned);
        let mut blocks = media.chunks(BLOCK);
        for (pba, layer, lba, _, crcs) in keep {
            for (j, crc) in crcs.into_iter().enumerate() {
                let data = blocks.next().expect("one buffer block per listed block");
                if crc != Some(block_crc(data)) {
                    let images = images_of(&inner.state.read(), layer);
                    report.damaged.push(Damage {
                        offset: (lba + j as u64) * BLOCK as u64,
                        pool_block: pba + j as u64,
                        images,
                    });
                }
            }
        }
        Ok(())
    }
}
