//! Layers: extent maps stacked into chains. A volume is a writable head layer over read-only
//! parent layers (its snapshots' and, for a clone, its origin's); a block reads from the nearest
//! layer of the chain that says something about it (data or a zero marker).
//!
//! Every layer keeps a [`View`] naming that nearest layer for each block, so a read costs one
//! view lookup and one map lookup however deep the chain is. The views are kept exact here, by
//! every change to a map or a chain; a merge forwards the merged layer's id to its child (whose
//! map now holds the same entries at the same blocks) instead of rewriting the views naming it.
//!
//! Every physical block is mapped by exactly one layer, so live-space accounting needs no
//! reference counts: moving a layer's entries into its child (a merge, when a deleted
//! snapshot's layer has one dependent left) keeps the blocks the child does not shadow and
//! frees the rest.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::map::extent_map::{ExtentMap, Freed, is_zero};
use crate::map::view::View;

/// One layer: its map, the layer under it, the data key its blocks are encrypted with, and
/// which layer answers each block.
#[derive(Debug, Clone, Default)]
pub(crate) struct Layer {
    pub map: ExtentMap,
    pub parent: Option<u64>,
    /// The data key (an id in the catalog) of every block this layer maps; None: plaintext.
    pub key: Option<u64>,
    view: View,
}

impl Layer {
    /// An empty layer over `parent`, for [`Layers::load`].
    pub fn over(parent: Option<u64>, key: Option<u64>) -> Self {
        Self { parent, key, ..Self::default() }
    }
}

/// Layers by id, hashed with a single multiply (ids are small integers handed out in order).
pub(crate) type Table = HashMap<u64, Layer, BuildHasherDefault<IdHasher>>;

/// Merged layer id -> the layer that took its entries.
type Forward = HashMap<u64, u64, BuildHasherDefault<IdHasher>>;

/// The layer now holding what `owner` held (itself unless it was merged away).
fn holder(forward: &Forward, owner: u64) -> u64 {
    forward.get(&owner).copied().unwrap_or(owner)
}

/// Every layer, with the views kept exact. Reads go through `Deref` to the table; every change
/// goes through a method here.
#[derive(Debug, Default)]
pub(crate) struct Layers {
    table: Table,
    /// Merged layers' ids and the layer that now holds their entries, for views naming them.
    forward: Forward,
    /// False while recovery replays the log: the replayed batches may write layers that have
    /// children by now (snapshots taken after the checkpoint), so views are built once after.
    views: bool,
}

impl std::ops::Deref for Layers {
    type Target = Table;
    fn deref(&self) -> &Table {
        &self.table
    }
}

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
    /// The layer whose map holds the run (0 where nothing does).
    pub layer: u64,
}

impl Layers {
    /// Takes maps and parents as loaded from a checkpoint, for the log to be replayed onto
    /// (reads walk their chain until [`Layers::build_views`]). Fails with the ids of layers no
    /// root reaches: a parent cycle in corrupt metadata. A missing parent is the caller's check.
    pub fn load(table: Table) -> Result<Self, Vec<u64>> {
        let layers = Self { table, forward: Forward::default(), views: false };
        let order = layers.parents_first();
        if order.len() < layers.table.len() {
            let mut stray: Vec<u64> = layers.table.keys().filter(|id| !order.contains(id)).copied().collect();
            stray.sort_unstable();
            return Err(stray);
        }
        Ok(layers)
    }

    /// Builds every view, parents first: each costs its own entries, not its chain's.
    pub fn build_views(&mut self) {
        for id in self.parents_first() {
            let l = &self.table[&id];
            let mut view = l.parent.map(|p| self.table[&p].view.clone()).unwrap_or_default();
            for (lba, _, n) in l.map.all_entries() {
                view.set(lba, n, Some(id));
            }
            self.table.get_mut(&id).expect("listed").view = view;
        }
        self.views = true;
    }

    /// Layer ids, each after its parent; layers no root reaches are left out.
    fn parents_first(&self) -> Vec<u64> {
        let mut kids: HashMap<Option<u64>, Vec<u64>> = HashMap::new();
        for (&id, l) in &self.table {
            kids.entry(l.parent).or_default().push(id);
        }
        let mut order = kids.remove(&None).unwrap_or_default();
        let mut i = 0;
        while let Some(&id) = order.get(i) {
            order.extend(kids.remove(&Some(id)).unwrap_or_default());
            i += 1;
        }
        order
    }

    /// Adds an empty layer over `parent`, encrypted with its parent's data key: a new head
    /// after a snapshot, a clone's head. O(1): the view is the parent's, shared.
    pub fn add(&mut self, id: u64, parent: u64) {
        let key = self.key_of(parent);
        self.add_keyed(id, Some(parent), key);
    }

    /// Adds an empty layer over `parent` (or a root) whose blocks `key` encrypts.
    pub fn add_keyed(&mut self, id: u64, parent: Option<u64>, key: Option<u64>) {
        let view = parent.and_then(|p| self.table.get(&p)).map(|p| p.view.clone()).unwrap_or_default();
        self.table.insert(id, Layer { map: ExtentMap::default(), parent, key, view });
    }

    /// Gives `layer`, which maps nothing yet, the data key `key` (a replica's head that starts
    /// its source's new data key).
    pub fn set_key(&mut self, layer: u64, key: Option<u64>) {
        if let Some(l) = self.table.get_mut(&layer) {
            debug_assert!(l.map.all_entries().next().is_none(), "a layer with blocks changes its key");
            l.key = key;
        }
    }

    /// The data key of `layer`'s blocks (None: plaintext, or no such layer).
    pub fn key_of(&self, layer: u64) -> Option<u64> {
        self.table.get(&layer).and_then(|l| l.key)
    }

    /// Resolves [lba, lba+blocks) through the chain from `head`: runs in lba order, covering
    /// the whole range (holes and zero markers as `pba: None`). An unknown head reads as zeros.
    pub fn resolve(&self, head: u64, lba: u64, blocks: u64) -> Vec<Run> {
        if !self.views {
            return self.walk(head, lba, blocks);
        }
        let mut out = Vec::new();
        let Some(h) = self.table.get(&head) else {
            out.push(Run { lba, blocks, pba: None, layer: 0 });
            return out;
        };
        h.view.runs(lba, blocks, |at, n, owner| {
            let id = owner.map(|o| holder(&self.forward, o));
            let Some((id, l)) = id.and_then(|id| Some((id, self.table.get(&id)?))) else {
                out.push(Run { lba: at, blocks: n, pba: None, layer: 0 });
                return;
            };
            let mut cur = at;
            for (lo, pba, k) in l.map.entries_in(at, n) {
                debug_assert_eq!(lo, cur, "a view names a layer for blocks its map does not hold");
                if lo > cur {
                    out.push(Run { lba: cur, blocks: lo - cur, pba: None, layer: 0 });
                }
                out.push(Run { lba: lo, blocks: k, pba: (!is_zero(pba)).then_some(pba), layer: id });
                cur = lo + k;
            }
            debug_assert_eq!(cur, at + n, "a view names a layer for blocks its map does not hold");
            if cur < at + n {
                out.push(Run { lba: cur, blocks: at + n - cur, pba: None, layer: 0 });
            }
        });
        out
    }

    /// [`Layers::resolve`] by walking the chain from `head`, layer by layer: what a view stands
    /// for, and what reads do while there are none.
    fn walk(&self, head: u64, lba: u64, blocks: u64) -> Vec<Run> {
        let mut out = Vec::new();
        // What is still unresolved, and what the current layer leaves unresolved.
        let mut pending = vec![(lba, blocks)];
        let mut next = Vec::new();
        let mut layer = Some(head);
        while let Some((id, l)) = layer.and_then(|id| Some((id, self.table.get(&id)?))) {
            if pending.is_empty() {
                break;
            }
            next.clear();
            for &(at, n) in &pending {
                let mut cur = at;
                for (lo, pba, k) in l.map.entries_in(at, n) {
                    if lo > cur {
                        next.push((cur, lo - cur));
                    }
                    out.push(Run { lba: lo, blocks: k, pba: (!is_zero(pba)).then_some(pba), layer: id });
                    cur = lo + k;
                }
                if cur < at + n {
                    next.push((cur, at + n - cur));
                }
            }
            std::mem::swap(&mut pending, &mut next);
            layer = l.parent;
        }
        out.extend(pending.into_iter().map(|(lba, blocks)| Run { lba, blocks, pba: None, layer: 0 }));
        out.sort_unstable_by_key(|r| r.lba);
        out
    }

    /// Maps [lba, lba+blocks) of `layer` to `pba..` (a write, or a cleaner move). Entries for a
    /// layer that no longer exists are dropped (false).
    pub fn map(
        &mut self,
        layer: u64,
        lba: u64,
        blocks: u64,
        pba: u64,
        freed: &mut Freed,
        dirty: impl FnMut(u64),
    ) -> bool {
        let forward = &self.forward;
        let Some(l) = self.table.get_mut(&layer) else { return false };
        l.map.set(lba, blocks, Some(pba), freed, dirty);
        // A move leaves the view as it was; test first so a shared view is not copied for it.
        if self.views && !l.view.all(lba, blocks, |o| o.map(|o| holder(forward, o)) == Some(layer)) {
            l.view.set(lba, blocks, Some(layer));
        }
        true
    }

    /// Unmaps [lba, lba+blocks) in `layer`: where an ancestor has data, a zero marker hides it;
    /// elsewhere the entries simply go, and the parent answers again.
    pub fn unmap(&mut self, layer: u64, lba: u64, blocks: u64, freed: &mut Freed, mut dirty: impl FnMut(u64)) {
        let Some(parent) = self.table.get(&layer).map(|l| l.parent) else { return };
        let shadowed: Vec<(u64, u64)> = match parent {
            Some(p) => self
                .resolve(p, lba, blocks)
                .into_iter()
                .filter(|r| r.pba.is_some())
                .map(|r| (r.lba, r.blocks))
                .collect(),
            None => Vec::new(),
        };
        let below = parent.and_then(|p| self.table.get(&p)).map(|p| p.view.clone()).unwrap_or_default();
        let l = self.table.get_mut(&layer).expect("checked above");
        if l.map.entries_in(lba, blocks).is_empty() && shadowed.is_empty() {
            return;
        }
        l.map.unmap(lba, blocks, freed, &mut dirty);
        if self.views {
            below.runs(lba, blocks, |at, n, owner| l.view.set(at, n, owner));
        }
        for (at, n) in shadowed {
            l.map.set_zero(at, n, freed, &mut dirty);
            if self.views {
                l.view.set(at, n, Some(layer));
            }
        }
    }

    /// Whether merging `from` into `into` would move data blocks (not only zero markers): blocks
    /// `into` does not shadow. A merge of layers under different data keys may move none.
    pub fn merge_moves_data(&self, from: u64, into: u64) -> bool {
        let (Some(src), Some(dst)) = (self.table.get(&from), self.table.get(&into)) else { return false };
        src.map.all_entries().any(|(lba, pba, n)| !is_zero(pba) && !dst.map.gaps(lba, n).is_empty())
    }

    /// Moves `from`'s entries into its child `into` wherever `into` says nothing, removes
    /// `from`, and gives `into` `from`'s parent. Physical blocks `into` shadows are pushed to
    /// `freed`. Calls `dirty` with every chunk of `into` that changed.
    pub fn merge_into(&mut self, from: u64, into: u64, freed: &mut Freed, mut dirty: impl FnMut(u64)) {
        let Some(src) = self.table.remove(&from) else { return };
        let dst = self.table.get_mut(&into).expect("merge target exists");
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
        // Views naming `from` (`into`'s and its descendants') now find the same entries in `into`.
        for to in self.forward.values_mut().filter(|to| **to == from) {
            *to = into;
        }
        self.forward.insert(from, into);
    }

    /// Drops a layer with no dependents, pushing all its data to `freed`.
    pub fn free(&mut self, id: u64, freed: &mut Freed) -> Option<Layer> {
        let l = self.table.remove(&id)?;
        freed.extend(l.map.runs().map(|(_, pba, n)| (pba, n)));
        // Only `id`'s own view could name layers merged into it.
        self.forward.retain(|_, to| *to != id);
        Some(l)
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layer(parent: Option<u64>, writes: &[(u64, u64, u64)]) -> Layer {
        let mut l = Layer { parent, ..Layer::default() };
        for &(lba, n, pba) in writes {
            l.map.set(lba, n, Some(pba), &mut Vec::new(), |_| {});
        }
        l
    }

    fn layers(list: Vec<(u64, Layer)>) -> Layers {
        let mut ls = Layers::load(list.into_iter().collect()).expect("no cycles");
        ls.build_views();
        ls
    }

    fn read(layers: &Layers, head: u64, lba: u64) -> Option<u64> {
        layers.resolve(head, lba, 1)[0].pba
    }

    fn walk(layers: &Layers, head: u64, lba: u64) -> Option<u64> {
        layers.walk(head, lba, 1)[0].pba
    }

    #[test]
    fn chains_resolve_head_first_and_zero_markers_hide_parents() {
        let mut ls = layers(vec![(1, layer(None, &[(0, 10, 100)])), (2, layer(Some(1), &[(5, 2, 200)]))]);
        ls.add(3, 2);
        assert_eq!(read(&ls, 3, 0), Some(100));
        assert_eq!(read(&ls, 3, 6), Some(201));
        assert_eq!(read(&ls, 3, 20), None);
        let runs = ls.resolve(3, 3, 6);
        assert_eq!(runs.iter().map(|r| r.blocks).sum::<u64>(), 6);
        assert!(runs.windows(2).all(|w| w[0].lba + w[0].blocks == w[1].lba));
        let mut freed = Vec::new();
        ls.unmap(3, 0, 4, &mut freed, |_| {});
        assert!(freed.is_empty());
        assert_eq!(read(&ls, 3, 1), None);
        assert_eq!(read(&ls, 2, 1), Some(101), "the parent is untouched");
        assert_eq!(ls[&3].map.mapped_blocks(), 0, "zero markers are not data");
        assert_eq!(depth(&ls, 3), 3);
    }

    #[test]
    fn merge_keeps_what_the_child_does_not_shadow_and_frees_the_rest() {
        let mut ls = layers(vec![(1, layer(None, &[(0, 10, 100)])), (2, layer(Some(1), &[(2, 3, 300)]))]);
        let mut freed = Vec::new();
        ls.unmap(2, 8, 1, &mut freed, |_| {});
        let before: Vec<_> = (0..12).map(|b| read(&ls, 2, b)).collect();
        ls.merge_into(1, 2, &mut freed, |_| {});
        assert!(!ls.contains_key(&1));
        assert_eq!(ls[&2].parent, None);
        let after: Vec<_> = (0..12).map(|b| read(&ls, 2, b)).collect();
        assert_eq!(before, after);
        freed.sort_unstable();
        assert_eq!(freed, vec![(102, 3), (108, 1)]);
        assert_eq!(ls[&2].map.mapped_blocks(), 9);
    }

    #[test]
    fn a_parent_cycle_is_reported() {
        let table = [(1, layer(Some(2), &[])), (2, layer(Some(1), &[])), (3, layer(None, &[]))].into_iter().collect();
        assert_eq!(Layers::load(table).unwrap_err(), vec![1, 2]);
    }

    /// One step on a forest of layers.
    #[derive(Debug, Clone)]
    enum Op {
        /// A new layer over the `n`th existing one (a snapshot's new head, or a clone).
        Add(usize),
        Write(usize, u64, u64),
        Unmap(usize, u64, u64),
        /// The `n`th layer's entries at lba move to new physical blocks (a cleaner move).
        Move(usize, u64),
        /// The `n`th layer goes: merged into its only child, freed if it has none.
        Drop(usize),
        /// Views rebuilt from the maps (a restart).
        Reload,
    }

    fn op() -> impl Strategy<Value = Op> {
        let at = 0u64..3000;
        prop_oneof![
            3 => any::<usize>().prop_map(Op::Add),
            4 => (any::<usize>(), at.clone(), 1u64..300).prop_map(|(l, a, n)| Op::Write(l, a, n)),
            2 => (any::<usize>(), at.clone(), 1u64..900).prop_map(|(l, a, n)| Op::Unmap(l, a, n)),
            1 => (any::<usize>(), at).prop_map(|(l, a)| Op::Move(l, a)),
            2 => any::<usize>().prop_map(Op::Drop),
            1 => Just(Op::Reload),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// Through snapshots, clones, writes, trims, moves, merges, frees and reloads, every
        /// layer resolves every block exactly as walking its chain does.
        #[test]
        fn views_agree_with_walking_the_chain(ops in prop::collection::vec(op(), 1..120)) {
            let mut ls = layers(vec![(1, layer(None, &[(0, 3000, 10_000)]))]);
            let (mut next_id, mut next_pba) = (2u64, 100_000u64);
            // Replay (views off) writes any layer; otherwise only heads (layers with no children)
            // take writes and trims, as in the engine.
            let mut replaying = 0;
            let pick = |ls: &Layers, n: usize, heads: bool| {
                let mut ids: Vec<u64> = ls.keys().copied().filter(|&id| !heads || children(ls, id).is_empty()).collect();
                ids.sort_unstable();
                ids[n % ids.len()]
            };
            for op in ops {
                if replaying > 0 {
                    replaying -= 1;
                    if replaying == 0 {
                        ls.build_views();
                    }
                }
                let heads = replaying == 0;
                let mut freed = Vec::new();
                match op {
                    Op::Add(n) => {
                        let p = pick(&ls, n, false);
                        ls.add(next_id, p);
                        next_id += 1;
                    }
                    Op::Write(n, lba, k) => {
                        let l = pick(&ls, n, heads);
                        let mapped = ls.map(l, lba, k, next_pba, &mut freed, |_| {});
                        prop_assert!(mapped, "the layer exists");
                        next_pba += k;
                    }
                    Op::Unmap(n, lba, k) => ls.unmap(pick(&ls, n, heads), lba, k, &mut freed, |_| {}),
                    Op::Move(n, lba) => {
                        let l = pick(&ls, n, false);
                        for (at, p, k) in ls[&l].map.entries_in(lba, 64) {
                            if !is_zero(p) {
                                ls.map(l, at, k, next_pba, &mut freed, |_| {});
                                next_pba += k;
                            }
                        }
                    }
                    Op::Drop(n) if heads => {
                        let l = pick(&ls, n, false);
                        match children(&ls, l).as_slice() {
                            [] if ls.len() > 1 => drop(ls.free(l, &mut freed)),
                            &[kid] => ls.merge_into(l, kid, &mut freed, |_| {}),
                            _ => {}
                        }
                    }
                    Op::Drop(_) => {}
                    Op::Reload => {
                        ls = Layers::load(ls.table.clone()).expect("no cycles");
                        replaying = 4;
                    }
                }
                for &id in ls.keys() {
                    for b in (0..3300).step_by(7) {
                        prop_assert_eq!(read(&ls, id, b), walk(&ls, id, b), "layer {} block {}", id, b);
                    }
                }
            }
            ls.build_views();
            for &id in ls.keys() {
                let runs = ls.resolve(id, 0, 3300);
                let mut at = 0;
                for r in &runs {
                    prop_assert_eq!(r.lba, at);
                    for b in 0..r.blocks {
                        prop_assert_eq!(r.pba.map(|p| p + b), walk(&ls, id, r.lba + b));
                    }
                    at += r.blocks;
                }
                prop_assert_eq!(at, 3300);
            }
        }
    }
}
