//! The synchronous-replica hook: every client request of a mirrored volume reaches its mirror as
//! the same request (trims and zeroes as such), the client's answer waits for both copies, a
//! refusing mirror refuses the request before it runs here, and overlapping writes from many
//! threads leave both copies equal.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small values

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Fixture, pattern};
use ferrite_engine::{Error, ErrorKind, Mirror, MirrorOp, Pending, Pool, Result, Volume};

const MIB: u64 = 1 << 20;
const B: usize = 4096;

/// What a mirror received, in a form a test can compare.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Write { offset: u64, len: usize, fua: bool },
    Trim { offset: u64, len: u64 },
    Zero { offset: u64, len: u64, fua: bool },
    Flush,
}

/// Applies every request to a volume of another pool, on a thread of its own, after `delay`.
#[derive(Debug)]
struct ToPool {
    copy: Volume,
    seen: Mutex<Vec<Seen>>,
    refuse: AtomicBool,
    fail: AtomicBool,
    whole: AtomicBool,
    delay: Duration,
}

struct Applying(std::thread::JoinHandle<Result<()>>);

impl Pending for Applying {
    fn wait(self: Box<Self>) -> Result<()> {
        self.0.join().expect("no panic")
    }
}

impl Mirror for ToPool {
    fn whole_blocks(&self) -> bool {
        self.whole.load(Ordering::Relaxed)
    }

    fn send(&self, op: MirrorOp<'_>) -> Result<Box<dyn Pending>> {
        if self.refuse.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Io, "no majority"));
        }
        self.seen.lock().unwrap().push(match op {
            MirrorOp::Write { offset, data, fua } => Seen::Write { offset, len: data.len(), fua },
            MirrorOp::Trim { offset, len } => Seen::Trim { offset, len },
            MirrorOp::Zero { offset, len, fua } => Seen::Zero { offset, len, fua },
            MirrorOp::Flush => Seen::Flush,
        });
        let (copy, delay, fail) = (self.copy.clone(), self.delay, self.fail.load(Ordering::Relaxed));
        let owned = match op {
            MirrorOp::Write { data, .. } => data.to_vec(),
            _ => Vec::new(),
        };
        let op = match op {
            MirrorOp::Write { offset, fua, .. } => (0, offset, 0, fua),
            MirrorOp::Trim { offset, len } => (1, offset, len, false),
            MirrorOp::Zero { offset, len, fua } => (2, offset, len, fua),
            MirrorOp::Flush => (3, 0, 0, false),
        };
        Ok(Box::new(Applying(std::thread::spawn(move || {
            std::thread::sleep(delay);
            if fail {
                return Err(Error::new(ErrorKind::Io, "member failed"));
            }
            match op {
                (0, offset, _, false) => copy.write(offset, &owned),
                (0, offset, _, true) => copy.write_fua(offset, &owned),
                (1, offset, len, _) => copy.trim(offset, len),
                (2, offset, len, fua) => copy.write_zeroes(offset, len, fua),
                _ => copy.flush(),
            }
        }))))
    }
}

fn mirrored(delay: Duration) -> (Fixture, Pool, Fixture, Pool, Arc<ToPool>) {
    let (fa, a) = Fixture::new(32);
    let (fb, b) = Fixture::new(32);
    a.create_volume("v", 8 * MIB).unwrap();
    b.create_volume("v", 8 * MIB).unwrap();
    let m = Arc::new(ToPool {
        copy: b.open_volume("v").unwrap(),
        seen: Mutex::default(),
        refuse: AtomicBool::new(false),
        fail: AtomicBool::new(false),
        whole: AtomicBool::new(false),
        delay,
    });
    a.set_mirror("v", Some(m.clone() as Arc<dyn Mirror>)).unwrap();
    (fa, a, fb, b, m)
}

fn image(p: &Pool) -> Vec<u8> {
    let mut buf = vec![0u8; 8 * MIB as usize];
    p.open_volume("v").unwrap().read(0, &mut buf).unwrap();
    buf
}

#[test]
fn every_request_reaches_the_mirror_as_itself_and_waits_for_it() {
    let delay = Duration::from_millis(40);
    let (_fa, a, _fb, b, m) = mirrored(delay);
    // A handle opened before the mirror was set sees it too.
    let v = a.open_volume("v").unwrap();
    assert!(v.is_mirrored() && v.writes_may_wait());
    let t = std::time::Instant::now();
    v.write(0, &pattern(1, 3 * B)).unwrap();
    assert!(t.elapsed() >= delay, "the write was acknowledged before its mirror had it");
    v.write_fua(100, &pattern(2, 10)).unwrap();
    v.trim(B as u64, B as u64).unwrap();
    v.write_zeroes(5000, 9000, true).unwrap();
    v.flush().unwrap();
    assert_eq!(
        *m.seen.lock().unwrap(),
        vec![
            Seen::Write { offset: 0, len: 3 * B, fua: false },
            Seen::Write { offset: 100, len: 10, fua: true },
            Seen::Trim { offset: B as u64, len: B as u64 },
            Seen::Zero { offset: 5000, len: 9000, fua: true },
            Seen::Flush,
        ]
    );
    assert!(image(&a) == image(&b), "the copies differ");
    // Out of range: refused here, the mirror never sees it.
    assert_eq!(v.write(8 * MIB, &[1]).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(m.seen.lock().unwrap().len(), 5);
    // Unmirrored again: nothing more goes there.
    a.set_mirror("v", None).unwrap();
    v.write(0, &[9]).unwrap();
    assert!(!v.is_mirrored());
    assert_eq!(m.seen.lock().unwrap().len(), 5);
}

#[test]
fn a_refusing_mirror_refuses_the_write_and_a_failing_one_fails_it() {
    let (_fa, a, _fb, _b, m) = mirrored(Duration::ZERO);
    let v = a.open_volume("v").unwrap();
    v.write(0, &pattern(1, B)).unwrap();
    m.refuse.store(true, Ordering::Relaxed);
    let e = v.write(0, &pattern(2, B)).unwrap_err();
    assert!(e.to_string().contains("no majority"), "{e}");
    assert_eq!(image(&a)[..B], pattern(1, B)[..], "a refused write ran here");
    m.refuse.store(false, Ordering::Relaxed);
    m.fail.store(true, Ordering::Relaxed);
    let e = v.trim(0, B as u64).unwrap_err();
    assert!(e.to_string().contains("member failed"), "{e}");
    assert!(v.flush().is_err(), "a flush the mirror failed was acknowledged");
}

#[test]
fn overlapping_writes_from_many_threads_leave_equal_copies() {
    let (_fa, a, _fb, b, _m) = mirrored(Duration::ZERO);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let v = a.open_volume("v").unwrap();
            std::thread::spawn(move || {
                let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                for i in 0..300u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // 64 blocks: threads collide all the time, partial blocks included.
                    let offset = x % (64 * B as u64);
                    let len = (x >> 20) as usize % (3 * B) + 1;
                    match i % 10 {
                        0 => v.trim(offset, len as u64).unwrap(),
                        1 => v.write_zeroes(offset, len as u64, false).unwrap(),
                        _ => v.write(offset, &pattern(t * 1000 + i, len)).unwrap(),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(image(&a) == image(&b), "the copies differ after overlapping writes");
}

#[test]
fn while_a_member_rebuilds_partial_blocks_reach_it_whole() {
    let (_fa, a, _fb, b, m) = mirrored(Duration::ZERO);
    let v = a.open_volume("v").unwrap();
    v.write(0, &pattern(1, 4 * B)).unwrap();
    m.whole.store(true, Ordering::Relaxed);
    m.seen.lock().unwrap().clear();
    // The copy's block 0 is stale (as a rebuilding member's may be): whole blocks overwrite it.
    b.open_volume("v").unwrap().write(0, &pattern(9, B)).unwrap();
    v.write(100, &pattern(2, 10)).unwrap();
    v.write_zeroes(B as u64 + 5, 2 * B as u64, false).unwrap();
    v.write(2 * B as u64, &pattern(3, B)).unwrap();
    assert_eq!(
        *m.seen.lock().unwrap(),
        vec![
            Seen::Write { offset: 0, len: B, fua: false },
            Seen::Write { offset: B as u64, len: B, fua: false },
            Seen::Zero { offset: 2 * B as u64, len: B as u64, fua: false },
            Seen::Write { offset: 3 * B as u64, len: B, fua: false },
            Seen::Write { offset: 2 * B as u64, len: B, fua: false },
        ]
    );
    assert!(image(&a)[..4 * B] == image(&b)[..4 * B], "the copies differ");
}

/// Power lost on either copy, or both, at a point chosen by the seed, while a client writes
/// with FUA and flushes: after restart, every write that was acknowledged durable (FUA, or
/// before an acknowledged flush) is on both copies. Neither copy can hold less than the client
/// was told, whichever store stopped first.
#[test]
fn a_crash_of_either_copy_keeps_every_acknowledged_durable_write_on_both() {
    use ferrite_engine::io::CrashMode;
    let (mut checked, mut cut_short) = (0, 0);
    for seed in 0..12u64 {
        let (fa, a, fb, b, m) = mirrored(Duration::ZERO);
        let after = 20 + (seed * 37) % 200;
        match seed % 3 {
            0 => fa.backend.crash_after_writes(after),
            1 => fb.backend.crash_after_writes(after),
            _ => {
                fa.backend.crash_after_writes(after);
                fb.backend.crash_after_writes(after + seed % 7);
            }
        }
        let v = a.open_volume("v").unwrap();
        // (block, acknowledged durable) for every acknowledged write; each block is written once.
        let mut acked: Vec<(u64, bool)> = Vec::new();
        for i in 0..600u64 {
            let r = if i % 16 == 15 {
                v.flush().map(|()| acked.iter_mut().for_each(|w| w.1 = true))
            } else {
                let fua = i % 5 == 0;
                let data = pattern(seed * 10_000 + i, B);
                let r = if fua { v.write_fua(i * B as u64, &data) } else { v.write(i * B as u64, &data) };
                r.map(|()| acked.push((i, fua)))
            };
            if r.is_err() {
                cut_short += 1;
                break;
            }
        }
        // Then both lose power, if they still had it.
        fa.backend.crash();
        fb.backend.crash();
        drop((v, m, a, b));
        fa.backend.restart(CrashMode::Random(seed));
        fb.backend.restart(CrashMode::Random(seed + 100));
        let (a, b) = (fa.reopen(), fb.reopen());
        let (ia, ib) = (image(&a), image(&b));
        let durable: Vec<u64> = acked.iter().filter(|w| w.1).map(|w| w.0).collect();
        checked += durable.len();
        for i in durable {
            let at = i as usize * B;
            let want = pattern(seed * 10_000 + i, B);
            assert!(ia[at..at + B] == want[..], "seed {seed}: durable block {i} lost on the primary");
            assert!(ib[at..at + B] == want[..], "seed {seed}: durable block {i} lost on the member");
        }
    }
    assert!(cut_short >= 6 && checked > 100, "{cut_short} runs cut short by a crash, {checked} durable blocks checked");
}
