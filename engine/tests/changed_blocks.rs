//! Changed-block listings against the bytes themselves. After random writes (partial blocks
//! too), trims, zeroings, snapshots, a grow and cleaner runs, for every pair of snapshots (and
//! each snapshot against the live volume):
//! - every byte that differs between the two lies in a range `changed_ranges` reports, and in
//!   the runs a window of `Volume::changed` flags (the rule: a range may be reported changed
//!   though its bytes are equal, e.g. rewritten with the same data, never the other way round);
//! - every non-zero byte of an image lies in its allocated ranges;
//! - both listings are sorted, disjoint, block-aligned (or cut at the window) and inside the
//!   image.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use common::{Fixture, pattern};
use ferrite_engine::{Image, Volume};
use proptest::prelude::*;

const B: u64 = 4096;
const SIZE: u64 = 256 * B;

#[derive(Debug, Clone)]
enum Op {
    Write {
        at: u64,
        len: u64,
        seed: u64,
    },
    /// Writes what is there already: a change by the log, not by the bytes.
    Rewrite {
        block: u64,
        blocks: u64,
    },
    Trim {
        at: u64,
        len: u64,
    },
    Zero {
        at: u64,
        len: u64,
    },
    Snapshot,
    Grow,
    Clean,
}

fn op() -> impl Strategy<Value = Op> {
    let span = (0..SIZE, 1..16 * B);
    prop_oneof![
        4 => (span.clone(), any::<u64>()).prop_map(|((at, len), seed)| Op::Write { at, len, seed }),
        1 => (0..SIZE / B, 1..8u64).prop_map(|(block, blocks)| Op::Rewrite { block, blocks }),
        1 => span.clone().prop_map(|(at, len)| Op::Trim { at, len }),
        1 => span.prop_map(|(at, len)| Op::Zero { at, len }),
        2 => Just(Op::Snapshot),
        1 => Just(Op::Grow),
        1 => Just(Op::Clean),
    ]
}

fn image(v: &Volume) -> Vec<u8> {
    let mut buf = vec![0u8; v.size().unwrap() as usize];
    v.read(0, &mut buf).unwrap();
    buf
}

/// Fails unless every byte where `a` and `b` differ (the shorter read as zeros past its end)
/// is inside `ranges`, and the ranges are ordered, disjoint and inside `size`.
fn covers(ranges: &[(u64, u64)], a: &[u8], b: &[u8], size: u64, what: &str) -> Result<(), TestCaseError> {
    let mut last = 0;
    for &(o, n) in ranges {
        prop_assert!(n > 0 && o >= last && o + n <= size, "{what}: bad range ({o}, {n}) after {last}");
        last = o + n;
    }
    let byte = |v: &[u8], i: usize| v.get(i).copied().unwrap_or(0);
    let mut r = ranges.iter().peekable();
    for i in 0..a.len().max(b.len()) {
        if byte(a, i) == byte(b, i) {
            continue;
        }
        while r.peek().is_some_and(|&&(o, n)| o + n <= i as u64) {
            r.next();
        }
        prop_assert!(r.peek().is_some_and(|&&(o, _)| o <= i as u64), "{what}: byte {i} differs, unreported");
    }
    Ok(())
}

/// The changed runs of windows of `v` since `base`, as ranges.
fn changed_by_windows(v: &Volume, base: &str, window: u64) -> Vec<(u64, u64)> {
    let size = v.size().unwrap();
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut at = 0;
    while at < size {
        let n = window.min(size - at);
        let runs = v.changed(base, at, n).unwrap();
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), n, "the runs cover the window");
        let mut o = at;
        for (len, changed) in runs {
            if changed {
                match out.last_mut() {
                    Some((po, pn)) if *po + *pn == o => *pn += len,
                    _ => out.push((o, len)),
                }
            }
            o += len;
        }
        at += n;
    }
    out
}

fn run(ops: &[Op], window: u64) -> Result<(), TestCaseError> {
    let (_f, pool) = Fixture::new(256);
    pool.create_volume("v", SIZE).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut snaps: Vec<(String, Vec<u8>)> = Vec::new();
    for op in ops {
        let size = v.size().unwrap();
        let clip = |at: u64, len: u64| (at.min(size - 1), len.min(size - at.min(size - 1)));
        match *op {
            Op::Write { at, len, seed } => {
                let (at, len) = clip(at, len);
                v.write(at, &pattern(seed, len as usize)).unwrap();
            }
            Op::Rewrite { block, blocks } => {
                let (at, len) = clip(block * B, blocks * B);
                let mut same = vec![0u8; len as usize];
                v.read(at, &mut same).unwrap();
                v.write(at, &same).unwrap();
            }
            Op::Trim { at, len } => {
                let (at, len) = clip(at, len);
                v.trim(at, len).unwrap();
            }
            Op::Zero { at, len } => {
                let (at, len) = clip(at, len);
                v.write_zeroes(at, len, false).unwrap();
            }
            Op::Snapshot => {
                let name = format!("s{}", snaps.len());
                pool.create_snapshot("v", &name).unwrap();
                snaps.push((name, image(&v)));
            }
            Op::Grow if size < 2 * SIZE => drop(pool.grow_volume("v", size + 64 * B).unwrap()),
            Op::Grow => {}
            Op::Clean => drop(pool.reclaim().unwrap()),
        }
    }
    let live = image(&v);
    let size = v.size().unwrap();
    for (i, (name, content)) in snaps.iter().enumerate() {
        let snap_size = content.len() as u64;
        let allocated = pool.changed_ranges(Image::Snapshot(name), None).unwrap();
        covers(&allocated, content, &[], snap_size, &format!("allocated {name}"))?;
        for (later, later_content) in &snaps[i + 1..] {
            let later_size = later_content.len() as u64;
            let delta = pool.changed_ranges(Image::Snapshot(later), Some(name)).unwrap();
            covers(&delta, content, later_content, later_size, &format!("{name} -> {later}"))?;
            let by_windows = changed_by_windows(&pool.open_snapshot(later).unwrap(), name, window);
            prop_assert_eq!(&by_windows, &merge(&delta), "{} -> {}: windows of {} bytes", name, later, window);
        }
        let delta = pool.changed_ranges(Image::Volume("v"), Some(name)).unwrap();
        covers(&delta, content, &live, size, &format!("{name} -> live"))?;
        prop_assert_eq!(changed_by_windows(&v, name, window), merge(&delta));
        // A later snapshot is not beneath an earlier one.
        if let Some((later, _)) = snaps.get(i + 1) {
            prop_assert!(pool.changed_ranges(Image::Snapshot(name), Some(later)).is_err());
        }
    }
    covers(&pool.changed_ranges(Image::Volume("v"), None).unwrap(), &live, &[], size, "allocated live")?;
    Ok(())
}

/// Ranges with adjacent ones merged (windows cut ranges at their edges).
fn merge(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(o, n) in ranges {
        match out.last_mut() {
            Some((po, pn)) if *po + *pn == o => *pn += n,
            _ => out.push((o, n)),
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn listings_never_miss_a_changed_or_allocated_byte(
        ops in prop::collection::vec(op(), 1..40),
        window in prop_oneof![Just(B), Just(7 * B + 512), Just(SIZE)],
    ) {
        run(&ops, window)?;
    }
}

#[test]
fn a_rewrite_of_equal_bytes_is_reported_changed() {
    let (_f, pool) = Fixture::new(64);
    pool.create_volume("v", SIZE).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(1, 8 * B as usize)).unwrap();
    pool.create_snapshot("v", "a").unwrap();
    v.write(2 * B, &pattern(1, 8 * B as usize)[2 * B as usize..3 * B as usize]).unwrap();
    pool.create_snapshot("v", "b").unwrap();
    assert_eq!(pool.changed_ranges(Image::Snapshot("b"), Some("a")).unwrap(), [(2 * B, B)]);
    let snap: Volume = pool.open_snapshot("b").unwrap();
    assert_eq!(snap.changed("a", B + 100, 3 * B).unwrap(), [(B - 100, false), (B, true), (B + 100, false)]);
    // Depth: b's own layer holds block 2, a's the rest of the first 8, nothing after them.
    assert_eq!(snap.allocation_depth(0, 10 * B).unwrap(), [(2 * B, 2), (B, 1), (5 * B, 2), (2 * B, 0)]);
    assert_eq!(v.allocation_depth(2 * B + 1, 100).unwrap(), [(100, 2)], "from the live head, b is its parent");
}
