//! Victim choice, as a pure function of the segment table: which sealed segment a cleaning run
//! moves next. Cost-benefit (Rosenblum & Ousterhout): the highest `(1 - u) * age / (1 + u)`,
//! `u` the live fraction and `age` the sequence numbers since the segment was last written. A
//! cold segment (old, mostly live) is worth cleaning at a higher `u` than a hot one, whose
//! blocks are still dying on their own. It needs the moved (cold) blocks kept apart from fresh
//! writes, which the cold head does (`write/cold.rs`); with it, measured (`cleaner-load`, 80%
//! full): uniform traffic as greedy (2.96 against 2.97, the simulation's optimum 2.84), skewed
//! traffic lower (see docs/design/engine.md, "Cleaner").

use std::collections::BTreeSet;

use crate::map::segments::{SegState, SegmentTable};

/// The best segment of `eligible` (see the module doc) that is sealed, holds live blocks, is at
/// most `max_u` live, is not damaged and is not `pinned`; `now` is the next sequence number.
///
/// An empty sealed segment needs only a checkpoint, not cleaning. A pinned one is being read —
/// perhaps by the other cleaner, background or inline, moving it right now: cleaning it twice
/// would leave it unreleasable until that one finishes.
pub(crate) fn pick_victim(
    segs: &SegmentTable,
    now: u64,
    max_u: f64,
    eligible: &BTreeSet<usize>,
    pinned: impl Fn(usize) -> bool,
) -> Option<usize> {
    let per_seg = segs.blocks_per_seg as f64;
    segs.segs
        .iter()
        .enumerate()
        .filter(|(i, s)| s.state == SegState::Sealed && s.live > 0 && !s.damaged && eligible.contains(i) && !pinned(*i))
        .filter_map(|(i, s)| {
            let u = s.live as f64 / per_seg;
            if u > max_u {
                return None;
            }
            let age = now.saturating_sub(s.last_seq).max(1) as f64;
            Some((i, (1.0 - u) * age / (1.0 + u)))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of 8 segments of 16 blocks; `sealed` gives (segment, live blocks, last seq).
    fn table(sealed: &[(usize, u64, u64)]) -> SegmentTable {
        let mut t = SegmentTable::new(16 * 4096, 8);
        for &(i, live, seq) in sealed {
            let s = &mut t.segs[i];
            s.state = SegState::Sealed;
            s.live = live;
            s.last_seq = seq;
        }
        t
    }

    fn all() -> BTreeSet<usize> {
        (0..8).collect()
    }

    #[test]
    fn emptier_and_older_segments_win() {
        let t = table(&[(1, 12, 5), (2, 4, 9), (3, 8, 1), (4, 4, 2)]);
        // 2 and 4 are both 25% live; 4 is older.
        assert_eq!(pick_victim(&t, 10, 0.9, &all(), |_| false), Some(4));
        // An old half-live segment beats a young quarter-live one: 0.5 * 99 / 1.5 > 0.75 * 1 / 1.25.
        let t = table(&[(1, 8, 1), (2, 4, 99)]);
        assert_eq!(pick_victim(&t, 100, 0.9, &all(), |_| false), Some(1));
    }

    #[test]
    fn full_empty_open_free_damaged_pinned_and_ineligible_segments_are_never_victims() {
        let mut t = table(&[(1, 16, 1), (2, 0, 1), (3, 15, 1), (5, 2, 1), (6, 3, 1), (7, 4, 1)]);
        t.segs[0].state = SegState::Open;
        t.segs[0].live = 1;
        t.segs[5].damaged = true;
        let eligible: BTreeSet<usize> = (0..7).collect(); // not 7
        // 1 is above max_u, 2 is empty (a checkpoint frees it), 4 is free, 6 is pinned.
        assert_eq!(pick_victim(&t, 10, 0.9, &eligible, |i| i == 6), None);
        assert_eq!(pick_victim(&t, 10, 0.95, &eligible, |i| i == 6), Some(3));
        assert_eq!(pick_victim(&t, 10, 0.95, &all(), |i| i == 6), Some(7));
        assert_eq!(pick_victim(&t, 10, 0.95, &all(), |_| false), Some(6));
    }
}
