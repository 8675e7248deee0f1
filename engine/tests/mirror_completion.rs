//! Writes whose members acknowledge later (`Volume::start_write`): random overlapping writes,
//! trims, zeroes, flushes and FUA writes, some started without a waiting thread and some
//! blocking, against a member that applies and acknowledges what it received in random batches
//! and in random order. Nothing is acknowledged to the client before the member has it, and
//! both copies end equal.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small values

use crate::common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{Fixture, pattern};
use ferrite_engine::{Mirror, MirrorOp, Pending, Result, Volume, WriteDone};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const B: u64 = 4096;
/// The volume's first blocks: requests collide all the time.
const SPAN: u64 = 48 * B;

/// A request as the member received it.
enum Op {
    Write(u64, Vec<u8>, bool),
    Trim(u64, u64),
    Zero(u64, u64, bool),
    Flush,
}

/// One request's acknowledgement: a blocked waiter or a completion waits for it.
#[derive(Default)]
struct Ack {
    state: Mutex<(bool, Option<WriteDone>)>,
    acked: Condvar,
}

impl Ack {
    fn give(&self) {
        let mut s = self.state.lock().unwrap();
        s.0 = true;
        let then = s.1.take();
        drop(s);
        self.acked.notify_all();
        if let Some(then) = then {
            then(Ok(()));
        }
    }
}

/// The client's side of an [`Ack`].
struct Acked(Arc<Ack>);

impl Pending for Acked {
    fn wait(self: Box<Self>) -> Result<()> {
        let mut s = self.0.state.lock().unwrap();
        while !s.0 {
            s = self.0.acked.wait(s).unwrap();
        }
        Ok(())
    }

    fn then(self: Box<Self>, done: WriteDone) {
        let mut s = self.0.state.lock().unwrap();
        if s.0 {
            drop(s);
            done(Ok(()));
        } else {
            s.1 = Some(done);
        }
    }
}

/// The member: a copy in another pool, and what it received and has not acknowledged yet.
#[derive(Debug)]
struct Member {
    copy: Volume,
    inbox: Mutex<Vec<(Op, Arc<Ack>)>>,
    /// (offset, crc) of every write applied, so a client's acknowledgement can be checked.
    applied: Mutex<HashSet<(u64, u32)>>,
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("op")
    }
}

impl std::fmt::Debug for Ack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ack")
    }
}

impl Mirror for Member {
    fn try_admit(&self) -> Option<Result<Box<dyn Send>>> {
        Some(self.admit())
    }

    fn send(&self, op: MirrorOp<'_>) -> Result<Box<dyn Pending>> {
        let op = match op {
            MirrorOp::Write { offset, data, fua } => Op::Write(offset, data.to_vec(), fua),
            MirrorOp::Trim { offset, len } => Op::Trim(offset, len),
            MirrorOp::Zero { offset, len, fua } => Op::Zero(offset, len, fua),
            MirrorOp::Flush => Op::Flush,
        };
        let ack = Arc::new(Ack::default());
        self.inbox.lock().unwrap().push((op, Arc::clone(&ack)));
        Ok(Box::new(Acked(ack)))
    }
}

impl Member {
    /// Applies a random batch of what arrived, in random order, then acknowledges it.
    fn apply_some(&self, rng: &mut u64) -> usize {
        let batch: Vec<(Op, Arc<Ack>)> = {
            let mut inbox = self.inbox.lock().unwrap();
            let n = if inbox.is_empty() { 0 } else { 1 + next(rng) as usize % inbox.len() };
            (0..n)
                .map(|_| {
                    let at = next(rng) as usize % inbox.len();
                    inbox.swap_remove(at)
                })
                .collect()
        };
        let n = batch.len();
        let mut acks = Vec::with_capacity(n);
        for (op, ack) in batch {
            match op {
                Op::Write(offset, data, fua) => {
                    if fua { self.copy.write_fua(offset, &data) } else { self.copy.write(offset, &data) }.unwrap();
                    self.applied.lock().unwrap().insert((offset, crc(&data)));
                }
                Op::Trim(offset, len) => self.copy.trim(offset, len).unwrap(),
                Op::Zero(offset, len, fua) => self.copy.write_zeroes(offset, len, fua).unwrap(),
                Op::Flush => self.copy.flush().unwrap(),
            }
            acks.push(ack);
        }
        // One acknowledgement for the batch, its requests completed in yet another order.
        while !acks.is_empty() {
            acks.swap_remove(next(rng) as usize % acks.len()).give();
        }
        n
    }
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn crc(data: &[u8]) -> u32 {
    data.iter().fold(0u32, |h, &b| h.rotate_left(5) ^ u32::from(b)).wrapping_mul(0x9E37_79B9)
}

fn image(v: &Volume) -> Vec<u8> {
    let mut buf = vec![0u8; SPAN as usize];
    v.read(0, &mut buf).unwrap();
    buf
}

/// A client request: what (0..10: a started write mostly), where, how long.
fn requests() -> impl Strategy<Value = Vec<(u8, u64, u64)>> {
    proptest::collection::vec((0u8..10, 0..SPAN - 1, 1..3 * B), 20..120)
}

/// Runs `reqs`; returns how many writes started without a waiting thread.
fn run(reqs: &[(u8, u64, u64)], seed: u64) -> usize {
    let (_fa, a) = Fixture::new(256);
    let (_fb, b) = Fixture::new(256);
    a.create_volume("v", 8 * MIB).unwrap();
    b.create_volume("v", 8 * MIB).unwrap();
    let member =
        Arc::new(Member { copy: b.open_volume("v").unwrap(), inbox: Mutex::default(), applied: Mutex::default() });
    a.set_mirror("v", Some(member.clone() as Arc<dyn Mirror>)).unwrap();
    let v = a.open_volume("v").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let applier = {
        let (member, stop) = (Arc::clone(&member), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut rng = seed | 1;
            while !stop.load(Ordering::SeqCst) {
                if member.apply_some(&mut rng) == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        })
    };
    // Requests that block run on a thread of their own each, as a server's helpers do.
    let outstanding = Arc::new(AtomicUsize::new(0));
    let mut blocking = Vec::new();
    let mut started = 0;
    for (i, &(kind, offset, len)) in reqs.iter().enumerate() {
        let len = len.min(SPAN - offset);
        let data = pattern(seed.wrapping_mul(1000).wrapping_add(i as u64), len as usize);
        if kind < 6 {
            outstanding.fetch_add(1, Ordering::SeqCst);
            let (m, out, sum) = (Arc::clone(&member), Arc::clone(&outstanding), crc(&data));
            let done: WriteDone = Box::new(move |r| {
                r.unwrap();
                assert!(m.applied.lock().unwrap().contains(&(offset, sum)), "acknowledged before the member had it");
                out.fetch_sub(1, Ordering::SeqCst);
            });
            match v.start_write(offset, &data, done) {
                Ok(()) => started += 1,
                // An overlapping write is in flight: this one blocks, as a server's helper would.
                Err(done) => {
                    let v = v.clone();
                    blocking.push(std::thread::spawn(move || {
                        v.write(offset, &data).unwrap();
                        done(Ok(()));
                    }));
                }
            }
            continue;
        }
        let v = v.clone();
        blocking.push(std::thread::spawn(move || match kind {
            6 => v.trim(offset, len).unwrap(),
            7 => v.write_zeroes(offset, len, false).unwrap(),
            8 => v.write_fua(offset, &data).unwrap(),
            _ => v.flush().unwrap(),
        }));
    }
    for t in blocking {
        t.join().unwrap();
    }
    while outstanding.load(Ordering::SeqCst) > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::SeqCst);
    applier.join().unwrap();
    assert!(member.inbox.lock().unwrap().is_empty());
    assert!(image(&v) == image(&member.copy), "the copies differ ({started} writes started without waiting)");
    started
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn completed_writes_are_on_both_copies_and_the_copies_end_equal(reqs in requests(), seed in 1u64..u64::MAX) {
        run(&reqs, seed);
    }
}

#[test]
fn most_writes_start_without_a_waiting_thread() {
    // Disjoint writes: none waits for another, so every one starts on the caller's thread.
    let reqs: Vec<(u8, u64, u64)> = (0..40).map(|i| (0, i * B, B)).collect();
    assert_eq!(run(&reqs, 7), 40);
}
