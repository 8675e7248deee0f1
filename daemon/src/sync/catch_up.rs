//! A member being rebuilt. Its stream, opened for the rebuild, rolled its copy back to the
//! base mark; from then on it gets every new write (whole blocks: the primary sends them so
//! while a member rebuilds) and, on the `Rebuild` call, the pieces of what changed between the
//! base and the primary's rebuild point. A write is newer than any piece of its blocks, so the
//! blocks a write touched are remembered and a piece skips them; a write and a piece of the same
//! blocks never run at once (range locks), so whichever comes second sees the first.

use std::collections::BTreeMap;
use std::sync::Mutex;

use ferrite_engine::{RangeLocks, Volume};
use ferrite_replication::{BLOCK, Piece};

const B: u64 = BLOCK as u64;

/// Disjoint block ranges, start -> end.
#[derive(Debug, Default)]
struct RangeSet(BTreeMap<u64, u64>);

impl RangeSet {
    fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        // Merge with every range that overlaps or touches [start, end).
        let touching: Vec<(u64, u64)> =
            self.0.range(..=end).rev().take_while(|&(_, &e)| e >= start).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in touching {
            self.0.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        self.0.insert(start, end);
    }

    /// The parts of [start, end) in no range.
    fn gaps(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = start;
        let first = self.0.range(..=start).next_back().map_or(start, |(&s, _)| s);
        for (&s, &e) in self.0.range(first..end) {
            if e <= at {
                continue;
            }
            if s > at {
                out.push((at, s.min(end)));
            }
            at = at.max(e);
            if at >= end {
                break;
            }
        }
        if at < end {
            out.push((at, end));
        }
        out
    }
}

/// What a member being rebuilt keeps while the pieces come.
#[derive(Debug, Default)]
pub struct CatchUp {
    written: Mutex<RangeSet>,
    locks: RangeLocks,
}

impl CatchUp {
    /// Runs a write of the stream touching bytes [offset, offset+len) (whole blocks; a trim's
    /// partial edge blocks are not touched): no piece of its blocks runs meanwhile or after.
    /// A range past 2^64 bytes (a peer's) is refused.
    pub fn write(
        &self,
        offset: u64,
        len: u64,
        whole_only: bool,
        f: impl FnOnce() -> Result<(), String>,
    ) -> Result<(), String> {
        let stop = offset.checked_add(len).ok_or_else(|| format!("a request at {offset} of {len} bytes"))?;
        let (first, end) = if whole_only { (offset.div_ceil(B), stop / B) } else { (offset / B, stop.div_ceil(B)) };
        let _held = self.locks.lock(first, end.max(first));
        self.written.lock().expect("not poisoned").insert(first, end);
        f()
    }

    /// Applies a piece of the rebuild to `volume`, except the blocks a write replaced: the data
    /// bytes it wrote. The piece's crcs are checked first.
    pub fn piece(&self, volume: &Volume, piece: &Piece) -> Result<u64, String> {
        let (offset, len) = piece.range();
        if !offset.is_multiple_of(B) || !len.is_multiple_of(B) {
            return Err(format!("a piece at {offset} of {len} bytes is not whole blocks"));
        }
        if let Piece::Data { data, crcs, .. } = piece
            && ferrite_replication::block_crcs(data) != *crcs
        {
            return Err(format!("the piece at {offset} arrived damaged (crc mismatch)"));
        }
        let (first, end) = (offset / B, (offset + len) / B);
        let _held = self.locks.lock(first, end);
        let gaps = self.written.lock().expect("not poisoned").gaps(first, end);
        let mut applied = 0;
        for (s, e) in gaps {
            let r = match piece {
                Piece::Data { data, .. } => {
                    let at = usize::try_from((s - first) * B).expect("within the piece");
                    let n = usize::try_from((e - s) * B).expect("within the piece");
                    applied += n as u64;
                    volume.write(s * B, &data[at..at + n])
                }
                Piece::Zero { .. } => volume.trim(s * B, (e - s) * B),
            };
            r.map_err(|e| e.to_string())?;
        }
        Ok(applied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_gaps_are_what_no_range_covers() {
        let mut r = RangeSet::default();
        r.insert(10, 20);
        r.insert(30, 40);
        r.insert(20, 25);
        r.insert(5, 6);
        assert_eq!(r.0.iter().map(|(&s, &e)| (s, e)).collect::<Vec<_>>(), [(5, 6), (10, 25), (30, 40)]);
        assert_eq!(r.gaps(0, 50), [(0, 5), (6, 10), (25, 30), (40, 50)]);
        assert_eq!(r.gaps(12, 35), [(25, 30)]);
        assert_eq!(r.gaps(11, 24), []);
        r.insert(0, 100);
        assert_eq!(r.0.len(), 1);
        assert!(r.gaps(0, 100).is_empty());
    }
}
