//! The sender's side: which ranges a mirror snapshot ships, and the pieces that carry them.

use ferrite_engine::{Image, Pool, Result};

use crate::{BLOCK, Piece, block_crcs};

/// What shipping snapshot `to` over `base` (the newest mirror snapshot the peer holds; none
/// for a first sync) sends: runs of (offset, len, data), data false where `to` reads as zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    pub to: String,
    pub base: Option<String>,
    /// The size of the volume when `to` was taken.
    pub size: u64,
    pub runs: Vec<(u64, u64, bool)>,
}

impl Delta {
    /// Plans the delta from `base` to `to`, two snapshots of one volume (`base` earlier). No
    /// media I/O: the changed ranges come from the layers between the two.
    pub fn plan(pool: &Pool, to: &str, base: Option<&str>) -> Result<Delta> {
        let size = pool.snapshot_info(to)?.size;
        let snap = pool.open_snapshot(to)?;
        let mut runs = Vec::new();
        for (offset, len) in pool.changed_ranges(Image::Snapshot(to), base)? {
            let mut at = offset;
            for (n, mapped) in snap.allocation(offset, len)? {
                match runs.last_mut() {
                    Some((o, l, m)) if *m == mapped && *o + *l == at => *l += n,
                    _ => runs.push((at, n, mapped)),
                }
                at += n;
            }
        }
        Ok(Delta { to: to.to_owned(), base: base.map(str::to_owned), size, runs })
    }

    /// Bytes of data the delta carries (zero runs are a few bytes each on the wire).
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes_from(0)
    }

    /// Bytes of data the delta carries from byte `from` on (what a resumed transfer sends).
    pub fn data_bytes_from(&self, from: u64) -> u64 {
        self.runs.iter().filter(|r| r.2).map(|&(o, l, _)| (o + l).saturating_sub(o.max(from))).sum()
    }

    /// One past the last byte the delta touches: where a complete transfer has got to.
    pub fn end(&self) -> u64 {
        self.runs.last().map_or(0, |r| r.0 + r.1)
    }

    /// The pieces from byte `from` on (where an interrupted transfer resumes), data read from
    /// `to` in pieces of at most `max_piece` bytes (rounded down to whole blocks, at least one).
    pub fn pieces<'a>(&'a self, pool: &Pool, from: u64, max_piece: usize) -> Result<Pieces<'a>> {
        Ok(Pieces {
            delta: self,
            // An encrypted volume's blocks travel as the pool holds them: ciphertext.
            snap: pool.open_snapshot(&self.to)?.ciphertext(),
            run: 0,
            at: from,
            max: (max_piece / BLOCK).max(1) * BLOCK,
        })
    }
}

/// The pieces of a [`Delta`], read as they are taken.
#[derive(Debug)]
pub struct Pieces<'a> {
    delta: &'a Delta,
    snap: ferrite_engine::Volume,
    run: usize,
    at: u64,
    max: usize,
}

impl Iterator for Pieces<'_> {
    type Item = Result<Piece>;

    fn next(&mut self) -> Option<Result<Piece>> {
        loop {
            let &(offset, len, data) = self.delta.runs.get(self.run)?;
            let end = offset + len;
            if self.at >= end {
                self.run += 1;
                continue;
            }
            let at = self.at.max(offset);
            if !data {
                self.at = end;
                return Some(Ok(Piece::Zero { offset: at, len: end - at }));
            }
            let n = (end - at).min(self.max as u64);
            let mut buf = vec![0u8; usize::try_from(n).expect("at most max_piece")];
            if let Err(e) = self.snap.read(at, &mut buf) {
                return Some(Err(e));
            }
            self.at = at + n;
            let crcs = block_crcs(&buf);
            return Some(Ok(Piece::Data { offset: at, data: buf, crcs }));
        }
    }
}
