//! Property test of the durability contract against a reference model.
//!
//! Random sequences of create / write / trim / write-zeroes / flush / grow / delete /
//! snapshot / clone / snapshot delete / cleaner run / checkpoint / power cut / process crash /
//! clean reopen run on the crash-simulating backend. A snapshot is durable on return and reads
//! exactly what the volume held when it was taken, crash or not; a clone starts as that content.
//! The model keeps, for every block, its current content and every content it may have after a
//! power cut (the content at the last completed flush plus everything written since). After a
//! power cut the engine must show, for every block, one of those; after a process crash (the
//! kernel keeps every write issued to the store, synced or not, and the tail file's pages) and
//! after a clean reopen, exactly the current content: nothing acknowledged is lost. A power cut
//! loses the tail file's pages, or keeps some the kernel had written back. Half
//! the sequences run with discard of freed segments on, the backend zeroing them at once. Half
//! the volumes are encrypted (their clones and snapshots with them), unlocked again after every
//! reopen: the contract is the same for them.
//!
//! `FERRITE_PROPTEST_CASES` sets the number of sequences (default 1000); `FERRITE_LONG=1` runs
//! 20000.

#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)] // test arithmetic on small values

use crate::common;

use std::collections::BTreeMap;

use common::{Fixture, pattern};
use ferrite_crypt::Kek;
use ferrite_engine::io::CrashMode;
use ferrite_engine::{Discard, ErrorKind, Image, Pool, PoolOptions};
use proptest::prelude::*;

const B: usize = 4096;
const NAMES: [&str; 3] = ["a", "b", "c"];
const SNAPS: [&str; 3] = ["s0", "s1", "s2"];

#[derive(Debug, Clone)]
enum Op {
    Create { vol: usize, blocks: u64, encrypted: bool },
    Write { vol: usize, at: u64, len: usize, seed: u64, fua: bool },
    Trim { vol: usize, at: u64, len: u64 },
    Zero { vol: usize, at: u64, len: u64 },
    Flush,
    Grow { vol: usize, blocks: u64 },
    Delete { vol: usize },
    Snapshot { vol: usize, snap: usize },
    CloneSnap { snap: usize, vol: usize },
    CloneVol { from: usize, vol: usize },
    DeleteSnap { snap: usize },
    Clean,
    Checkpoint,
    Read { vol: usize },
    Crash { seed: u64 },
    Kill,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    let vol = 0..NAMES.len();
    prop_oneof![
        2 => (vol.clone(), 4u64..48, any::<bool>()).prop_map(|(vol, blocks, encrypted)| Op::Create { vol, blocks, encrypted }),
        10 => (vol.clone(), any::<u64>(), 1usize..24_000, any::<u64>(), prop::bool::weighted(0.1))
            .prop_map(|(vol, at, len, seed, fua)| Op::Write { vol, at, len, seed, fua }),
        2 => (vol.clone(), any::<u64>(), 1u64..40_000).prop_map(|(vol, at, len)| Op::Trim { vol, at, len }),
        2 => (vol.clone(), any::<u64>(), 1u64..40_000).prop_map(|(vol, at, len)| Op::Zero { vol, at, len }),
        3 => Just(Op::Flush),
        1 => (vol.clone(), 1u64..16).prop_map(|(vol, blocks)| Op::Grow { vol, blocks }),
        1 => vol.clone().prop_map(|vol| Op::Delete { vol }),
        2 => (vol.clone(), 0..SNAPS.len()).prop_map(|(vol, snap)| Op::Snapshot { vol, snap }),
        1 => (0..SNAPS.len(), vol.clone()).prop_map(|(snap, vol)| Op::CloneSnap { snap, vol }),
        1 => (vol.clone(), vol.clone()).prop_map(|(from, vol)| Op::CloneVol { from, vol }),
        1 => (0..SNAPS.len()).prop_map(|snap| Op::DeleteSnap { snap }),
        2 => Just(Op::Clean),
        1 => Just(Op::Checkpoint),
        2 => vol.prop_map(|vol| Op::Read { vol }),
        3 => any::<u64>().prop_map(|seed| Op::Crash { seed }),
        3 => Just(Op::Kill),
        1 => Just(Op::Reopen),
    ]
}

/// One block of the model: its content now, and every content a crash may leave.
#[derive(Debug, Clone)]
struct ModelBlock {
    cur: Vec<u8>,
    possible: Vec<Vec<u8>>,
}

impl ModelBlock {
    fn zero() -> Self {
        Self { cur: vec![0; B], possible: vec![vec![0; B]] }
    }

    fn set(&mut self, new: Vec<u8>) {
        if !self.possible.contains(&new) {
            self.possible.push(new.clone());
        }
        self.cur = new;
    }
}

#[derive(Debug, Default)]
struct Model {
    vols: BTreeMap<usize, Vec<ModelBlock>>,
    /// Each snapshot's content, block by block (durable and frozen).
    snaps: BTreeMap<usize, Vec<Vec<u8>>>,
}

impl Model {
    fn flushed(&mut self) {
        for b in self.vols.values_mut().flatten() {
            b.possible = vec![b.cur.clone()];
        }
    }

    /// Applies a byte-range change through `f`, which edits each touched block's bytes.
    fn edit(&mut self, vol: usize, at: u64, len: u64, mut f: impl FnMut(u64, &mut [u8])) {
        let blocks = self.vols.get_mut(&vol).unwrap();
        let first = at / B as u64;
        let last = (at + len - 1) / B as u64;
        for lba in first..=last {
            let mut content = blocks[lba as usize].cur.clone();
            f(lba, &mut content);
            blocks[lba as usize].set(content);
        }
    }
}

fn clip(size: u64, at: u64, len: u64) -> (u64, u64) {
    let at = at % size;
    (at, len.min(size - at).max(1))
}

const KEK_ID: &str = "model";

/// The one key-encryption key of the run's encrypted volumes.
fn kek(id: &str) -> Result<Kek, ferrite_crypt::Error> {
    Kek::new(id, [7; 32])
}

/// Checks every volume against the model (unlocking it first); `exact` after a clean reopen,
/// sets after a crash.
fn verify(pool: &Pool, model: &mut Model, exact: bool) -> Result<(), TestCaseError> {
    for &vol in model.vols.keys() {
        pool.unlock(Image::Volume(NAMES[vol]), kek).unwrap();
    }
    for &snap in model.snaps.keys() {
        pool.unlock(Image::Snapshot(SNAPS[snap]), kek).unwrap();
    }
    for (&vol, blocks) in model.vols.iter_mut() {
        let v = pool.open_volume(NAMES[vol]).unwrap();
        let mut buf = vec![0u8; blocks.len() * B];
        v.read(0, &mut buf).unwrap();
        for (i, (got, m)) in buf.chunks(B).zip(blocks.iter_mut()).enumerate() {
            if exact {
                prop_assert!(
                    got == &m.cur[..],
                    "volume {} block {i} differs from its acknowledged content",
                    NAMES[vol]
                );
            } else {
                prop_assert!(
                    m.possible.iter().any(|p| p == got),
                    "volume {} block {i}: content after crash is neither old nor new ({} candidates)",
                    NAMES[vol],
                    m.possible.len()
                );
            }
            m.cur = got.to_vec();
            m.possible = vec![m.cur.clone()];
        }
    }
    for (&snap, blocks) in &model.snaps {
        let s = pool.open_snapshot(SNAPS[snap]).unwrap();
        let mut buf = vec![0u8; blocks.len() * B];
        s.read(0, &mut buf).unwrap();
        for (i, (got, want)) in buf.chunks(B).zip(blocks).enumerate() {
            prop_assert!(got == &want[..], "snapshot {} block {i} changed", SNAPS[snap]);
        }
    }
    Ok(())
}

/// A new volume in the model with `content` (durable).
fn cloned(content: Vec<Vec<u8>>) -> Vec<ModelBlock> {
    content.into_iter().map(|c| ModelBlock { possible: vec![c.clone()], cur: c }).collect()
}

fn run(ops: Vec<Op>, discard: bool) -> Result<(), TestCaseError> {
    // With discard on, freed segments are discarded as on a device pool (`pool-discard = on`),
    // and the crash backend drops their content at once, as an SSD may after TRIM.
    // Segments of 64 KiB: a sequence's writes move the log head into new segments a few times,
    // so crashes fall between a segment move and the sync that makes it durable.
    let opts = PoolOptions {
        discard: if discard { Discard::On } else { Discard::Off },
        segment_size: 64 << 10,
        ..common::small_opts()
    };
    let (f, mut pool) = Fixture::with_opts(128, opts);
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Create { vol, blocks, encrypted } => {
                let size = blocks * B as u64;
                let r = if encrypted {
                    pool.create_encrypted_volume(NAMES[vol], size, &kek(KEK_ID).unwrap())
                } else {
                    pool.create_volume(NAMES[vol], size)
                };
                if let std::collections::btree_map::Entry::Vacant(e) = model.vols.entry(vol) {
                    r.unwrap();
                    e.insert(vec![ModelBlock::zero(); blocks as usize]);
                } else {
                    prop_assert_eq!(r.unwrap_err().kind(), ErrorKind::AlreadyExists);
                }
            }
            Op::Write { vol, at, len, seed, fua } => {
                let Some(blocks) = model.vols.get(&vol) else { continue };
                let (at, len) = clip((blocks.len() * B) as u64, at, len as u64);
                let data = pattern(seed, len as usize);
                let v = pool.open_volume(NAMES[vol]).unwrap();
                if fua {
                    v.write_fua(at, &data).unwrap()
                } else {
                    v.write(at, &data).unwrap()
                }
                model.edit(vol, at, len, |lba, content| {
                    let bs = lba * B as u64;
                    let lo = at.max(bs);
                    let hi = (at + len).min(bs + B as u64);
                    content[(lo - bs) as usize..(hi - bs) as usize]
                        .copy_from_slice(&data[(lo - at) as usize..(hi - at) as usize]);
                });
                if fua {
                    // FUA makes this write durable; earlier unflushed writes elsewhere are not
                    // promised, but this write's blocks are.
                    let blocks = model.vols.get_mut(&vol).unwrap();
                    for lba in at / B as u64..=(at + len - 1) / B as u64 {
                        let b = &mut blocks[lba as usize];
                        b.possible = vec![b.cur.clone()];
                    }
                }
            }
            Op::Trim { vol, at, len } | Op::Zero { vol, at, len } => {
                let Some(blocks) = model.vols.get(&vol) else { continue };
                let (at, len) = clip((blocks.len() * B) as u64, at, len);
                let v = pool.open_volume(NAMES[vol]).unwrap();
                let zero_all = matches!(op, Op::Zero { .. });
                if zero_all {
                    v.write_zeroes(at, len, false).unwrap()
                } else {
                    v.trim(at, len).unwrap()
                }
                model.edit(vol, at, len, |lba, content| {
                    let bs = lba * B as u64;
                    let (lo, hi) = (at.max(bs), (at + len).min(bs + B as u64));
                    if zero_all || (lo == bs && hi == bs + B as u64) {
                        content[(lo - bs) as usize..(hi - bs) as usize].fill(0);
                    }
                });
            }
            Op::Flush => {
                pool.flush().unwrap();
                model.flushed();
            }
            Op::Grow { vol, blocks } => {
                let Some(m) = model.vols.get_mut(&vol) else { continue };
                let new = m.len() as u64 + blocks;
                pool.grow_volume(NAMES[vol], new * B as u64).unwrap();
                m.resize(new as usize, ModelBlock::zero());
            }
            Op::Delete { vol } => {
                let r = pool.delete_volume(NAMES[vol]);
                if model.vols.remove(&vol).is_some() { r.unwrap() } else { prop_assert!(r.is_err()) }
            }
            Op::Snapshot { vol, snap } => {
                let r = pool.create_snapshot(NAMES[vol], SNAPS[snap]);
                match model.vols.get(&vol) {
                    Some(blocks) if !model.snaps.contains_key(&snap) => {
                        r.unwrap();
                        let content = blocks.iter().map(|b| b.cur.clone()).collect();
                        model.snaps.insert(snap, content);
                        // The snapshot synced the store: everything acknowledged is durable.
                        model.flushed();
                    }
                    _ => prop_assert!(r.is_err()),
                }
            }
            Op::CloneSnap { snap, vol } => {
                let r = pool.clone_volume(Image::Snapshot(SNAPS[snap]), NAMES[vol]);
                match model.snaps.get(&snap) {
                    Some(content) if !model.vols.contains_key(&vol) => {
                        r.unwrap();
                        model.vols.insert(vol, cloned(content.clone()));
                    }
                    _ => prop_assert!(r.is_err()),
                }
            }
            Op::CloneVol { from, vol } => {
                let r = pool.clone_volume(Image::Volume(NAMES[from]), NAMES[vol]);
                match model.vols.get(&from) {
                    Some(blocks) if !model.vols.contains_key(&vol) => {
                        r.unwrap();
                        let content = blocks.iter().map(|b| b.cur.clone()).collect();
                        model.flushed();
                        model.vols.insert(vol, cloned(content));
                    }
                    _ => prop_assert!(r.is_err()),
                }
            }
            Op::DeleteSnap { snap } => {
                let r = pool.delete_snapshot(SNAPS[snap]);
                if model.snaps.remove(&snap).is_some() { r.unwrap() } else { prop_assert!(r.is_err()) }
            }
            // Moves are ordinary batches: they change no content, and the checkpoint that ends the
            // run syncs the store, so everything acknowledged before it is durable afterwards.
            Op::Clean => {
                if pool.reclaim().unwrap().segments_cleaned > 0 {
                    model.flushed();
                }
            }
            Op::Checkpoint => pool.checkpoint().unwrap(),
            Op::Read { vol } => {
                let Some(blocks) = model.vols.get(&vol) else { continue };
                let v = pool.open_volume(NAMES[vol]).unwrap();
                let mut buf = vec![0u8; blocks.len() * B];
                v.read(0, &mut buf).unwrap();
                for (i, (got, m)) in buf.chunks(B).zip(blocks).enumerate() {
                    prop_assert!(got == &m.cur[..], "live read of {} block {i}", NAMES[vol]);
                }
            }
            Op::Crash { seed } => {
                f.backend.crash();
                drop(pool);
                f.backend.restart(CrashMode::Random(seed));
                if seed % 2 == 0 {
                    f.lose_tail_file();
                }
                pool = f.reopen();
                verify(&pool, &mut model, false)?;
            }
            Op::Kill => {
                f.backend.crash();
                drop(pool);
                f.backend.restart(CrashMode::KeepAll);
                pool = f.reopen();
                verify(&pool, &mut model, true)?;
            }
            Op::Reopen => {
                pool.close().unwrap();
                pool = f.reopen();
                verify(&pool, &mut model, true)?;
            }
        }
    }
    // Finally: a crash after a flush loses nothing.
    pool.flush().unwrap();
    model.flushed();
    f.backend.crash();
    drop(pool);
    f.backend.restart(CrashMode::Random(7));
    let pool = f.reopen();
    verify(&pool, &mut model, true)
}

fn cases() -> u32 {
    if std::env::var("FERRITE_LONG").is_ok_and(|v| v == "1") {
        return 20_000;
    }
    std::env::var("FERRITE_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn durability_contract_holds(ops in prop::collection::vec(op(), 1..40), discard in any::<bool>()) {
        run(ops, discard)?;
    }
}
