//! What mirroring a write costs the engine, with the store and the network out of the way: two
//! pools on the in-memory backend, the second a loopback member (a thread that applies what it
//! receives to its copy, a batch at a time, and acknowledges the batch). 4 KiB random writes:
//!
//! - `one-copy`: `Volume::write` of an unmirrored volume (the baseline);
//! - `mirrored-blocking`: `Volume::write` of the mirrored volume, the caller waiting for the
//!   member (what a server's helper thread did for every mirrored write);
//! - `mirrored-completion-qd32`: `Volume::start_write`, 32 in flight, each completion starting
//!   the next: no thread waits for the member.
//!
//! Criterion's "time" is the process's CPU time per request (every thread, the member's
//! included). A line per workload prints CPU and wall nanoseconds and context switches per
//! request (median of 5 runs).

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use ferrite_bench::next_random;
use ferrite_engine::io::MemoryBackend;
use ferrite_engine::{Mirror, MirrorOp, Pending, Pool, PoolOptions, Result, Volume, WriteDone};

const VOL: u64 = 256 << 20;
const POOL: u64 = 2 << 30;
const B: u64 = 4096;
const QD: usize = 32;

/// CPU time of every thread of this process, and its context switches.
fn usage() -> (Duration, i64) {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage through a pointer to a live local, zeroed first.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: getrusage succeeded, so it filled the struct (and zeroes are valid anyway).
    let ru = unsafe { ru.assume_init() };
    let t = |tv: libc::timeval| {
        Duration::new(u64::try_from(tv.tv_sec).expect("positive"), u32::try_from(tv.tv_usec).expect("small") * 1000)
    };
    (t(ru.ru_utime) + t(ru.ru_stime), ru.ru_nvcsw + ru.ru_nivcsw)
}

/// One acknowledgement: a waiting caller or a completion.
#[derive(Default)]
struct Ack {
    state: Mutex<(bool, Option<WriteDone>)>,
    acked: Condvar,
}

/// The client's side of an [`Ack`].
struct Acked(Arc<Ack>);

impl Pending for Acked {
    fn wait(self: Box<Self>) -> Result<()> {
        let mut s = self.0.state.lock().expect("not poisoned");
        while !s.0 {
            s = self.0.acked.wait(s).expect("not poisoned");
        }
        Ok(())
    }

    fn then(self: Box<Self>, done: WriteDone) {
        let mut s = self.0.state.lock().expect("not poisoned");
        if s.0 {
            drop(s);
            done(Ok(()));
        } else {
            s.1 = Some(done);
        }
    }
}

/// A write as the member receives it.
type Received = (u64, Vec<u8>, Arc<Ack>);

/// The loopback member: requests go to its thread over a channel.
struct Loopback(Mutex<mpsc::Sender<Received>>);

impl std::fmt::Debug for Loopback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Loopback")
    }
}

impl Mirror for Loopback {
    fn try_admit(&self) -> Option<Result<Box<dyn Send>>> {
        Some(self.admit())
    }

    fn send(&self, op: MirrorOp<'_>) -> Result<Box<dyn Pending>> {
        let MirrorOp::Write { offset, data, .. } = op else { panic!("the bench only writes") };
        let ack = Arc::new(Ack::default());
        self.0.lock().expect("not poisoned").send((offset, data.to_vec(), Arc::clone(&ack))).expect("member alive");
        Ok(Box::new(Acked(ack)))
    }
}

/// The member's thread: applies every request that arrived, then acknowledges them.
fn member(copy: Volume, rx: mpsc::Receiver<Received>) {
    while let Ok(first) = rx.recv() {
        let batch: Vec<_> = std::iter::once(first).chain(rx.try_iter()).collect();
        for (offset, data, _) in &batch {
            copy.write(*offset, data).expect("member write");
        }
        for (_, _, ack) in batch {
            let mut s = ack.state.lock().expect("not poisoned");
            s.0 = true;
            let then = s.1.take();
            drop(s);
            ack.acked.notify_all();
            if let Some(then) = then {
                then(Ok(()));
            }
        }
    }
}

fn pool(dir: &std::path::Path, name: &str) -> (Pool, Volume) {
    let p = Pool::create_on(Arc::new(MemoryBackend::committed(POOL)), &dir.join(name), PoolOptions::default())
        .expect("create pool");
    p.create_volume("v", VOL).expect("create volume");
    let v = p.open_volume("v").expect("open volume");
    (p, v)
}

/// Runs `n` blocking writes; returns (CPU, wall, context switches).
fn blocking(vol: &Volume, n: u64, x: &mut u64, buf: &[u8]) -> (Duration, Duration, i64) {
    let ((cpu, cs), wall) = (usage(), Instant::now());
    for _ in 0..n {
        vol.write((next_random(x) % (VOL / B)) * B, buf).expect("write");
    }
    let (cpu2, cs2) = usage();
    (cpu2 - cpu, wall.elapsed(), cs2 - cs)
}

/// Runs `n` writes with [`QD`] in flight through `start_write`, as a server's loop does:
/// completions come back on a channel and each one starts the next write.
fn completion(vol: &Volume, n: u64, x: &mut u64, buf: &[u8]) -> (Duration, Duration, i64) {
    let (tx, rx) = mpsc::channel::<Result<()>>();
    let start = |x: &mut u64| {
        let tx = tx.clone();
        let done: WriteDone = Box::new(move |r| tx.send(r).expect("bench alive"));
        let offset = (next_random(x) % (VOL / B)) * B;
        if let Err(done) = vol.start_write(offset, buf, done) {
            // An overlapping write is in flight (random offsets collide now and then).
            done(vol.write(offset, buf));
        }
    };
    let ((cpu, cs), wall) = (usage(), Instant::now());
    let mut started = 0;
    while started < n.min(QD as u64) {
        start(x);
        started += 1;
    }
    for _ in 0..n {
        rx.recv().expect("a completion").expect("write");
        if started < n {
            start(x);
            started += 1;
        }
    }
    let (cpu2, cs2) = usage();
    (cpu2 - cpu, wall.elapsed(), cs2 - cs)
}

type Run = fn(&Volume, u64, &mut u64, &[u8]) -> (Duration, Duration, i64);

fn mirror_path(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(std::env::var("FERRITE_BENCH_DIR").unwrap_or_else(|_| "/dev/shm".into()))
        .expect("bench dir");
    let (one_pool, one) = pool(dir.path(), "one");
    let (primary_pool, mirrored) = pool(dir.path(), "primary");
    let (member_pool, copy) = pool(dir.path(), "member");
    let (tx, rx) = mpsc::channel();
    let applier = std::thread::spawn(move || member(copy, rx));
    primary_pool.set_mirror("v", Some(Arc::new(Loopback(Mutex::new(tx))) as Arc<dyn Mirror>)).expect("mirror");
    let buf = vec![0xA5u8; 4096];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let jobs: [(&str, &Volume, Run); 3] = [
        ("one-copy", &one, blocking),
        ("mirrored-blocking", &mirrored, blocking),
        ("mirrored-completion-qd32", &mirrored, completion),
    ];
    let mut g = c.benchmark_group("mirror_path");
    g.sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let mut lines = Vec::new();
    for (name, vol, run) in jobs {
        g.bench_function(name, |b| b.iter_custom(|n| run(vol, n, &mut x, &buf).0));
        let n = 20_000;
        let mut runs: Vec<_> = (0..5).map(|_| run(vol, n, &mut x, &buf)).collect();
        runs.sort_unstable();
        let (cpu, wall, cs) = runs[2];
        let per = |d: Duration| d.as_nanos() / u128::from(n);
        lines.push(format!(
            "mirror-path {name:<26} {:>7} ns CPU/write {:>7} ns wall/write {:>5.2} context switches/write",
            per(cpu),
            per(wall),
            cs as f64 / n as f64
        ));
    }
    g.finish();
    for l in lines {
        println!("{l}");
    }
    primary_pool.set_mirror("v", None).expect("unmirror");
    applier.join().expect("member thread");
    drop((one, mirrored));
    for p in [one_pool, primary_pool, member_pool] {
        p.close().expect("close");
    }
}

criterion_group!(benches, mirror_path);
criterion_main!(benches);
