//! Layers: extent maps stacked into chains. A volume is a writable head layer over read-only
//! parent layers (its snapshots' and, for a clone, its origin's); a read walks head to root and
//! takes the first layer that says something about a block (data or a zero marker).
//!
//! Every physical block is mapped by exactly one layer, so live-space accounting needs no
//! reference counts: moving a layer's entries into its child (a merge, when a deleted
//! snapshot's layer has one dependent left) keeps the blocks the child does not shadow and
//! frees the rest.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::map::extent_map::{ExtentMap, Freed, is_zero};

/// One layer: its map and the layer under it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Layer {
    pub map: ExtentMap,
    pub parent: Option<u64>,
}

/// Layers by id. A read looks up every layer of its chain, so the hash is a single multiply
/// (ids are small integers handed out in order) rather than the default SipHash.
pub(crate) type Layers = HashMap<u64, Layer, BuildHasherDefault<IdHasher>>;

/// Hashes a `u64` id by multiplying it with a large odd constant (Fibonacci hashing): cheap,
/// and it spreads consecutive ids over the high bits the table's probing uses.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = (self.0 ^ id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// What a range of logical blocks resolves to through a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub lba: u64,
    pub blocks: u64,
    /// First physical block of the run, or None where it reads as zeros.
    pub pba: Option<u64>,
}

/// Resolves [lba, lba+blocks) through the chain from `head` to its root: runs in lba order,
/// covering the whole range (holes and zero markers as `pba: None`). A layer missing from
/// `layers` ends the chain there.
pub(crate) fn resolve(layers: &Layers, head: u64, lba: u64, blocks: u64) -> Vec<Run> {
    let mut out = Vec::new();
    // What is still unresolved, and what the current layer leaves unresolved: two buffers
    // swapped per layer, so a deep chain costs no allocation per layer.
    let mut pending = vec![(lba, blocks)];
    let mut next = Vec::new();
    let mut layer = Some(head);
    while let Some(id) = layer {
        if pending.is_empty() {
            break;
        }
        let Some(l) = layers.get(&id) else { break };
        next.clear();
        for &(at, n) in &pending {
            let mut cur = at;
            for (lo, pba, k) in l.map.entries_in(at, n) {
                if lo > cur {
                    next.push((cur, lo - cur));
                }
                out.push(Run { lba: lo, blocks: k, pba: (!is_zero(pba)).then_some(pba) });
                cur = lo + k;
            }
            if cur < at + n {
                next.push((cur, at + n - cur));
            }
        }
        std::mem::swap(&mut pending, &mut next);
        layer = l.parent;
    }
    out.extend(pending.into_iter().map(|(lba, blocks)| Run { lba, blocks, pba: None }));
    out.sort_unstable_by_key(|r| r.lba);
    out
}

/// Unmaps [lba, lba+blocks) in `layer`: where an ancestor has data, a zero marker hides it;
/// elsewhere the entries simply go.
pub(crate) fn unmap(
    layers: &mut Layers,
    layer: u64,
    lba: u64,
    blocks: u64,
    freed: &mut Freed,
    mut dirty: impl FnMut(u64),
) {
    let Some(parent) = layers.get(&layer).map(|l| l.parent) else { return };
    let shadowed: Vec<(u64, u64)> = match parent {
        Some(p) => {
            resolve(layers, p, lba, blocks).into_iter().filter(|r| r.pba.is_some()).map(|r| (r.lba, r.blocks)).collect()
        }
        None => Vec::new(),
    };
    let map = &mut layers.get_mut(&layer).expect("checked above").map;
    map.unmap(lba, blocks, freed, &mut dirty);
    for (at, n) in shadowed {
        map.set_zero(at, n, freed, &mut dirty);
    }
}

/// The parts of the listed run `(layer, lba, pba, blocks)` that `layer` still maps to the same
/// physical blocks, as (lba, pba, blocks): what a cleaner move or a scrub found may have been
/// overwritten, trimmed or moved since.
pub(crate) fn still_mapped(layers: &Layers, layer: u64, lba: u64, pba: u64, blocks: u64) -> Vec<(u64, u64, u64)> {
    let Some(l) = layers.get(&layer) else { return Vec::new() };
    l.map.entries_in(lba, blocks).into_iter().filter(|&(at, p, _)| !is_zero(p) && p == pba + (at - lba)).collect()
}

/// Layers whose parent is `id`.
pub(crate) fn children(layers: &Layers, id: u64) -> Vec<u64> {
    layers.iter().filter(|(_, l)| l.parent == Some(id)).map(|(&k, _)| k).collect()
}

/// Number of layers in the chain from `head` to its root.
pub(crate) fn depth(layers: &Layers, head: u64) -> usize {
    let mut n = 0;
    let mut at = Some(head);
    while let Some(id) = at.and_then(|i| layers.get(&i).map(|l| (i, l))) {
        n += 1;
        at = id.1.parent;
    }
    n
}

/// Moves `from`'s entries into its child `into` wherever `into` says nothing, removes `from`,
/// and gives `into` `from`'s parent. Physical blocks `into` shadows are pushed to `freed`.
/// Calls `dirty` with every chunk of `into` that changed.
pub(crate) fn merge_into(layers: &mut Layers, from: u64, into: u64, freed: &mut Freed, mut dirty: impl FnMut(u64)) {
    let Some(src) = layers.remove(&from) else { return };
    let dst = layers.get_mut(&into).expect("merge target exists");
    for (lba, pba, n) in src.map.all_entries() {
        let mut cur = lba;
        for (gap, k) in dst.map.gaps(lba, n) {
            if gap > cur && !is_zero(pba) {
                freed.push((pba + (cur - lba), gap - cur));
            }
            dst.map.set(gap, k, Some(pba + (gap - lba)), freed, &mut dirty);
            cur = gap + k;
        }
        if cur < lba + n && !is_zero(pba) {
            freed.push((pba + (cur - lba), lba + n - cur));
        }
    }
    dst.parent = src.parent;
}

/// Drops a layer with no dependents, pushing all its data to `freed`.
pub(crate) fn free(layers: &mut Layers, id: u64, freed: &mut Freed) -> Option<Layer> {
    let l = layers.remove(&id)?;
    freed.extend(l.map.runs().map(|(_, pba, n)| (pba, n)));
    Some(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(parent: Option<u64>, writes: &[(u64, u64, u64)]) -> Layer {
        let mut l = Layer { map: ExtentMap::default(), parent };
        for &(lba, n, pba) in writes {
            l.map.set(lba, n, Some(pba), &mut Vec::new(), |_| {});
        }
        l
    }

    fn read(layers: &Layers, head: u64, lba: u64) -> Option<u64> {
        resolve(layers, head, lba, 1)[0].pba
    }

    #[test]
    fn chains_resolve_head_first_and_zero_markers_hide_parents() {
        let mut ls = Layers::default();
        ls.insert(1, layer(None, &[(0, 10, 100)]));
        ls.insert(2, layer(Some(1), &[(5, 2, 200)]));
        ls.insert(3, layer(Some(2), &[]));
        assert_eq!(read(&ls, 3, 0), Some(100));
        assert_eq!(read(&ls, 3, 6), Some(201));
        assert_eq!(read(&ls, 3, 20), None);
        let runs = resolve(&ls, 3, 3, 6);
        assert_eq!(runs.iter().map(|r| r.blocks).sum::<u64>(), 6);
        assert!(runs.windows(2).all(|w| w[0].lba + w[0].blocks == w[1].lba));
        let mut freed = Vec::new();
        unmap(&mut ls, 3, 0, 4, &mut freed, |_| {});
        assert!(freed.is_empty());
        assert_eq!(read(&ls, 3, 1), None);
        assert_eq!(read(&ls, 2, 1), Some(101), "the parent is untouched");
        assert_eq!(ls[&3].map.mapped_blocks(), 0, "zero markers are not data");
        assert_eq!(depth(&ls, 3), 3);
    }

    #[test]
    fn merge_keeps_what_the_child_does_not_shadow_and_frees_the_rest() {
        let mut ls = Layers::default();
        ls.insert(1, layer(None, &[(0, 10, 100)]));
        ls.insert(2, layer(Some(1), &[(2, 3, 300)]));
        let mut freed = Vec::new();
        unmap(&mut ls, 2, 8, 1, &mut freed, |_| {});
        let before: Vec<_> = (0..12).map(|b| read(&ls, 2, b)).collect();
        merge_into(&mut ls, 1, 2, &mut freed, |_| {});
        assert!(!ls.contains_key(&1));
        assert_eq!(ls[&2].parent, None);
        let after: Vec<_> = (0..12).map(|b| read(&ls, 2, b)).collect();
        assert_eq!(before, after);
        freed.sort_unstable();
        assert_eq!(freed, vec![(102, 3), (108, 1)]);
        assert_eq!(ls[&2].map.mapped_blocks(), 9);
    }
}
