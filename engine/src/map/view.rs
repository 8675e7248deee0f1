//! A layer's view: for every logical block, which layer of its chain answers a read there (the
//! nearest layer, itself included, whose map has an entry for the block), or nothing (zeros).
//!
//! A read looks its range up once here and then once in the answering layer's map, so its cost
//! does not depend on how deep the chain is. Views are persistent: a radix tree of `Arc`-shared
//! nodes, so cloning one is O(1) (a snapshot's new head and a clone start from their parent's
//! view) and an update copies only the path it changes (`Arc::make_mut`). A subtree answered by
//! one layer is a single `Whole` node, so a fully written volume's view is one node until
//! snapshots diverge from it.
//!
//! Owners are layer ids, not physical blocks: a cleaner move changes a layer's map but no view,
//! and a merge (the owner's entries moving into its child) is an id forward kept by `layers`.

use std::sync::Arc;

/// Logical blocks under one leaf (256 KiB of a volume): small enough that the first write after
/// a snapshot copies little, large enough that a leaf rarely splits further.
const LEAF_BLOCKS: u64 = 64;
/// Children per branch.
const FAN: usize = 16;
const FAN_BITS: u32 = FAN.trailing_zeros();

/// One run of a leaf: blocks [off, off+len) of the leaf are answered by `owner`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ext {
    off: u8,
    len: u8,
    owner: u64,
}

impl Ext {
    fn end(self) -> u64 {
        u64::from(self.off) + u64::from(self.len)
    }
}

#[derive(Debug, Clone)]
enum Node {
    /// The whole subtree is answered by one layer.
    Whole(u64),
    /// A leaf's runs, sorted and disjoint; blocks in no run read as zeros.
    Leaf(Arc<Vec<Ext>>),
    /// `FAN` children, each covering an equal part; `None` reads as zeros.
    Branch(Arc<[Option<Node>; FAN]>),
}

/// A persistent map from logical blocks to the layer answering them (see the module doc).
#[derive(Debug, Clone, Default)]
pub(crate) struct View {
    root: Option<Node>,
    /// The root covers `span(height)` blocks from 0.
    height: u32,
}

/// Blocks covered by a node at `level` (0 = leaf).
fn span(level: u32) -> u64 {
    LEAF_BLOCKS << (FAN_BITS * level)
}

impl View {
    /// Calls `f(lba, blocks, owner)` for [lba, lba+blocks) in order, covering all of it (runs
    /// that read as zeros have `owner: None`); adjacent runs of one owner are joined.
    pub fn runs(&self, lba: u64, blocks: u64, mut f: impl FnMut(u64, u64, Option<u64>)) {
        let end = lba.saturating_add(blocks);
        let mut pending: Option<(u64, u64, Option<u64>)> = None;
        let mut emit = |at: u64, n: u64, owner: Option<u64>| match &mut pending {
            Some((pa, pn, po)) if *po == owner && *pa + *pn == at => *pn += n,
            _ => {
                if let Some((pa, pn, po)) = pending.replace((at, n, owner)) {
                    f(pa, pn, po);
                }
            }
        };
        let covered = end.min(span(self.height));
        if lba < covered {
            visit(self.root.as_ref(), self.height, 0, lba, covered, &mut emit);
        }
        if covered < end {
            emit(covered.max(lba), end - covered.max(lba), None);
        }
        if let Some((pa, pn, po)) = pending {
            f(pa, pn, po);
        }
    }

    /// True if every block of [lba, lba+blocks) is answered by an owner for which `is` holds.
    pub fn all(&self, lba: u64, blocks: u64, mut is: impl FnMut(Option<u64>) -> bool) -> bool {
        let mut yes = true;
        self.runs(lba, blocks, |_, _, o| yes &= is(o));
        yes
    }

    /// Makes `owner` answer [lba, lba+blocks) (`None`: nothing does, it reads as zeros).
    pub fn set(&mut self, lba: u64, blocks: u64, owner: Option<u64>) {
        if blocks == 0 {
            return;
        }
        let end = lba.saturating_add(blocks);
        if owner.is_none() {
            let end = end.min(span(self.height));
            if lba < end {
                self.root = set_node(self.root.take(), self.height, 0, lba, end, None);
            }
            return;
        }
        while span(self.height) < end {
            if let Some(old) = self.root.take() {
                let mut kids: [Option<Node>; FAN] = Default::default();
                kids[0] = Some(old);
                self.root = Some(Node::Branch(Arc::new(kids)));
            }
            self.height += 1;
        }
        self.root = set_node(self.root.take(), self.height, 0, lba, end, owner);
    }
}

/// Emits the runs of `node` (at `level`, covering from `base`) inside [lo, hi).
fn visit(node: Option<&Node>, level: u32, base: u64, lo: u64, hi: u64, f: &mut impl FnMut(u64, u64, Option<u64>)) {
    match node {
        None => f(lo, hi - lo, None),
        Some(Node::Whole(o)) => f(lo, hi - lo, Some(*o)),
        Some(Node::Leaf(exts)) => {
            let mut at = lo;
            for e in exts.iter() {
                let (s, t) = ((base + u64::from(e.off)).max(lo), (base + e.end()).min(hi));
                if s >= t {
                    if base + u64::from(e.off) >= hi {
                        break;
                    }
                    continue;
                }
                if s > at {
                    f(at, s - at, None);
                }
                f(s, t - s, Some(e.owner));
                at = t;
            }
            if at < hi {
                f(at, hi - at, None);
            }
        }
        Some(Node::Branch(kids)) => {
            let child = span(level - 1);
            let first = usize::try_from((lo - base) / child).expect("below FAN");
            let last = usize::try_from((hi - 1 - base) / child).expect("below FAN");
            for (i, kid) in kids.iter().enumerate().take(last + 1).skip(first) {
                let b = base + child * i as u64;
                visit(kid.as_ref(), level - 1, b, lo.max(b), hi.min(b + child), f);
            }
        }
    }
}

/// `node` (at `level`, covering from `base`) with [lo, hi) answered by `owner`; shared nodes on
/// the way are copied, unshared ones changed in place.
fn set_node(node: Option<Node>, level: u32, base: u64, lo: u64, hi: u64, owner: Option<u64>) -> Option<Node> {
    if lo == base && hi == base + span(level) {
        return owner.map(Node::Whole);
    }
    if level == 0 {
        let mut exts = match node {
            None => return owner.map(|o| leaf(vec![ext(lo - base, hi - base, o)])),
            Some(Node::Whole(o)) => Arc::new(vec![ext(0, LEAF_BLOCKS, o)]),
            Some(Node::Leaf(e)) => e,
            Some(Node::Branch(_)) => unreachable!("branches are never at the leaf level"),
        };
        splice(Arc::make_mut(&mut exts), lo - base, hi - base, owner);
        return match exts.as_slice() {
            [] => None,
            [e] if e.off == 0 && e.end() == LEAF_BLOCKS => Some(Node::Whole(e.owner)),
            _ => Some(Node::Leaf(exts)),
        };
    }
    let mut kids = match node {
        None if owner.is_none() => return None,
        None => Arc::new(Default::default()),
        Some(Node::Whole(o)) if owner == Some(o) => return Some(Node::Whole(o)),
        Some(Node::Whole(o)) => Arc::new(std::array::from_fn(|_| Some(Node::Whole(o)))),
        Some(Node::Branch(k)) => k,
        Some(Node::Leaf(_)) => unreachable!("leaves are only at level 0"),
    };
    let child = span(level - 1);
    let k = Arc::make_mut(&mut kids);
    for (i, kid) in k.iter_mut().enumerate() {
        let b = base + child * i as u64;
        if b < hi && lo < b + child {
            *kid = set_node(kid.take(), level - 1, b, lo.max(b), hi.min(b + child), owner);
        }
    }
    // Collapse what became uniform, so views stay as small as what they say.
    match &k[0] {
        None if k.iter().all(Option::is_none) => None,
        Some(Node::Whole(o)) if k.iter().all(|x| matches!(x, Some(Node::Whole(p)) if p == o)) => Some(Node::Whole(*o)),
        _ => Some(Node::Branch(kids)),
    }
}

fn ext(lo: u64, hi: u64, owner: u64) -> Ext {
    Ext { off: u8::try_from(lo).expect("inside a leaf"), len: u8::try_from(hi - lo).expect("inside a leaf"), owner }
}

fn leaf(exts: Vec<Ext>) -> Node {
    Node::Leaf(Arc::new(exts))
}

/// Replaces [lo, hi) of a leaf's runs with `owner` (or a hole), joining equal neighbours.
fn splice(exts: &mut Vec<Ext>, lo: u64, hi: u64, owner: Option<u64>) {
    let mut out: Vec<Ext> = Vec::with_capacity(exts.len() + 2);
    let mut put = |e: Ext| match out.last_mut() {
        Some(p) if p.owner == e.owner && p.end() == u64::from(e.off) => p.len += e.len,
        _ => out.push(e),
    };
    let mut placed = false;
    for &e in exts.iter() {
        if u64::from(e.off) < lo {
            put(ext(u64::from(e.off), e.end().min(lo), e.owner));
        }
        if e.end() > hi && !placed {
            placed = true;
            if let Some(o) = owner {
                put(ext(lo, hi, o));
            }
        }
        if e.end() > hi {
            put(ext(u64::from(e.off).max(hi), e.end(), e.owner));
        }
    }
    if let Some(o) = owner.filter(|_| !placed) {
        put(ext(lo, hi, o));
    }
    *exts = out;
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn owners(v: &View, lba: u64, blocks: u64) -> Vec<Option<u64>> {
        let mut out = Vec::new();
        let mut at = lba;
        v.runs(lba, blocks, |l, n, o| {
            assert_eq!(l, at, "runs are in order and cover the range");
            assert!(n > 0);
            out.extend(std::iter::repeat_n(o, n as usize));
            at = l + n;
        });
        assert_eq!(at, lba + blocks);
        out
    }

    fn nodes(n: Option<&Node>) -> usize {
        match n {
            Some(Node::Branch(k)) => 1 + k.iter().map(|k| nodes(k.as_ref())).sum::<usize>(),
            Some(_) => 1,
            None => 0,
        }
    }

    #[test]
    fn whole_subtrees_stay_one_node_and_writes_split_one_path() {
        let mut v = View::default();
        v.set(0, span(3), Some(1));
        assert!(matches!(v.root, Some(Node::Whole(1))), "{v:?}");
        let before = v.clone();
        v.set(5000, 1, Some(2));
        assert_eq!(owners(&v, 4999, 3), vec![Some(1), Some(2), Some(1)]);
        assert_eq!(owners(&before, 4999, 3), vec![Some(1); 3], "the clone is untouched");
        assert_eq!(nodes(v.root.as_ref()), 3 * FAN + 1, "one path of branches down to one leaf");
        v.set(5000, 1, Some(1));
        assert!(matches!(v.root, Some(Node::Whole(1))), "a path that became uniform collapses");
        v.set(0, span(3), None);
        assert!(v.root.is_none());
        assert_eq!(owners(&v, (1 << 40) - 2, 4), vec![None; 4], "beyond the tree reads as zeros");
    }

    proptest! {
        /// A view agrees with a per-block array under random updates, and a clone taken midway
        /// keeps what it saw.
        #[test]
        fn matches_reference(ops in prop::collection::vec((0u64..20_000, 1u64..3000, 0u64..4), 1..40), cut in 0usize..40) {
            let mut v = View::default();
            let mut model = vec![None; 23_000];
            let mut saved = None;
            for (i, (lba, n, o)) in ops.into_iter().enumerate() {
                if i == cut {
                    saved = Some((v.clone(), model.clone()));
                }
                let owner = (o > 0).then_some(o);
                v.set(lba, n, owner);
                model[lba as usize..(lba + n) as usize].fill(owner);
            }
            prop_assert_eq!(owners(&v, 0, 23_000), model);
            if let Some((sv, sm)) = saved {
                prop_assert_eq!(owners(&sv, 0, 23_000), sm);
            }
        }
    }
}
