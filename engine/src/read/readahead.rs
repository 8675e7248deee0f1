//! Readahead for sequential readers.
//!
//! A log-structured store scatters a range that was overwritten at random: a 128 KiB read of
//! it is then many small media reads, and a reader at queue depth 1 waits for all of them
//! before it asks for the next 128 KiB, so the device idles between requests and never sees
//! more than one request's worth of reads at once. Each volume handle watches its reads for
//! sequential streams ([`Streams`]); once a stream has gone on for a few requests, the read that
//! makes a window due resolves it and enters its blocks in the cache as being read, and one of
//! the pool's two readahead threads reads them in one batch while the reader is served from what
//! was read before.
//!
//! The cache is keyed by pool block, not by volume offset. A pool block's contents never change
//! while its segment is not free, so a write or a cleaner move over a cached range (which maps
//! the range to other blocks) needs no invalidation: the reader resolves the range as always
//! and only finds the blocks the range still maps to. Freeing a segment drops the windows read
//! from it (`maint/checkpoint.rs::release`); a window's segments are pinned from its resolve until its
//! blocks are in the cache, so no window is ever filled from a segment already freed. Every
//! block is still checked against its checksum when it is copied out (`resolve.rs::fill`).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};
use rustix::event::{EventfdFlags, eventfd};

use crate::ctx::Ctx;
use crate::io::{AlignedBuf, BLOCK};
use crate::map::segments::Pinned;
use crate::read::reads::Gather;
use crate::read::resolve::{pba_runs, resolve_ahead};
use crate::state::Target;
use crate::write::tail::{self, Tail};

/// Sequential streams one volume handle tracks at once (one per concurrent sequential reader).
const STREAMS: usize = 4;
/// Reads in a row that make a stream sequential before anything is read ahead.
const START_AFTER: u32 = 2;
/// Readahead threads per pool: one window's reads are in flight while another's complete.
pub(crate) const THREADS: usize = 2;
/// How many windows' worth of blocks the cache holds (all streams together).
const CACHE_WINDOWS: u64 = 8;

type WindowData = std::io::Result<Arc<AlignedBuf>>;

/// A window being read or read: the media blocks of `runs`, back to back.
pub(crate) struct Window {
    runs: Vec<(u64, u64)>,
    /// Segments the window read from (windows of a freed segment are dropped).
    segs: Vec<usize>,
    /// None while the read is in flight.
    data: Mutex<Option<WindowData>>,
    ready: Condvar,
    /// An eventfd made readable once `data` is set, for readers that wait on their own I/O
    /// ([`crate::Reads::submit`]) rather than on `ready`.
    signal: OwnedFd,
    /// Blocks no reader has taken yet; a window is dropped once all were taken.
    left: AtomicUsize,
}

impl Window {
    /// Waits for the read; the media, or None if it failed (the reader then reads itself).
    fn wait(&self) -> parking_lot::MutexGuard<'_, Option<WindowData>> {
        let mut g = self.data.lock();
        while g.is_none() {
            self.ready.wait(&mut g);
        }
        g
    }

    /// Sets the window's media (or its failure) and wakes its readers.
    fn complete(&self, data: WindowData) {
        *self.data.lock() = Some(data);
        self.ready.notify_all();
        // Only an eventfd counter overflow fails, and a readable one stays readable.
        let _ = rustix::io::write(&self.signal, &1u64.to_ne_bytes());
    }
}

#[derive(Default)]
struct Cache {
    /// Pool block -> its window and slot in the window's data.
    index: HashMap<u64, (Arc<Window>, usize)>,
    /// Oldest first.
    windows: VecDeque<Arc<Window>>,
}

impl Cache {
    fn insert(&mut self, w: &Arc<Window>, budget: usize) {
        let mut slot = 0;
        for &(p, n) in &w.runs {
            for pba in p..p + n {
                self.index.insert(pba, (Arc::clone(w), slot));
                slot += 1;
            }
        }
        self.windows.push_back(Arc::clone(w));
        while self.index.len() > budget {
            let Some(old) = self.windows.pop_front() else { break };
            self.remove(&old);
        }
    }

    fn remove(&mut self, w: &Arc<Window>) {
        for &(p, n) in &w.runs {
            for pba in p..p + n {
                if self.index.get(&pba).is_some_and(|(x, _)| Arc::ptr_eq(x, w)) {
                    self.index.remove(&pba);
                }
            }
        }
        self.windows.retain(|x| !Arc::ptr_eq(x, w));
    }
}

/// A window to read, with the pins on its segments (taken when it was resolved).
struct Job {
    window: Arc<Window>,
    pinned: Vec<usize>,
}

/// The pool's readahead: the block cache, the queue of windows to read and the counters.
#[derive(Default)]
pub(crate) struct Readahead {
    cache: Mutex<Cache>,
    /// Blocks in the cache (read without the lock: most reads find none and skip it).
    cached: AtomicUsize,
    /// Windows to read, and whether the threads were stopped.
    jobs: Mutex<(VecDeque<Job>, bool)>,
    wake: Condvar,
    /// Bytes read ahead, and bytes readers took from the cache.
    pub read_bytes: AtomicU64,
    pub hit_bytes: AtomicU64,
}

impl std::fmt::Debug for Readahead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readahead").field("cached_blocks", &self.cached).finish_non_exhaustive()
    }
}

impl Readahead {
    /// Stops the readahead threads after the windows they are reading; queued ones fail (their
    /// readers read for themselves).
    pub fn stop(&self) {
        self.jobs.lock().1 = true;
        self.wake.notify_all();
    }

    /// Drops every window that read from one of `segs` (they are being freed).
    pub fn forget_segments(&self, segs: &[usize]) {
        if self.cached.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut c = self.cache.lock();
        let stale: Vec<Arc<Window>> =
            c.windows.iter().filter(|w| w.segs.iter().any(|s| segs.contains(s))).cloned().collect();
        for w in &stale {
            c.remove(w);
        }
        self.cached.store(c.index.len(), Ordering::Release);
    }
}

/// Notes a read by a volume handle; if it makes a window due, resolves the window and caches
/// it as being read (so a reader that gets there first waits for it rather than reading the
/// same blocks again), and queues its read for the readahead thread.
pub(crate) fn note_read(
    ctx: &Ctx,
    ra: &Readahead,
    streams: &Mutex<Streams>,
    target: Target,
    name: &str,
    offset: u64,
    len: u64,
) {
    let max = ctx.opts.readahead;
    if max == 0 || len == 0 {
        return;
    }
    let Some((offset, len)) = streams.lock().note(offset, len, max) else { return };
    let mut pinned = Pinned::new(&ctx.pins);
    // A deleted volume, or a window past a shrunk end: nothing to read ahead.
    let Ok(blocks) = resolve_ahead(&ctx.state.read(), target, name, &mut pinned, offset, len) else { return };
    // Out of file descriptors: no readahead.
    let Ok(signal) = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK) else { return };
    let mut segs = pinned.segments().to_vec();
    segs.sort_unstable();
    segs.dedup();
    let window = {
        let mut c = ra.cache.lock();
        let fresh = blocks.iter().flatten().map(|m| m.pba).filter(|pba| !c.index.contains_key(pba));
        let runs = pba_runs(fresh);
        if runs.is_empty() {
            return;
        }
        let blocks: u64 = runs.iter().map(|r| r.1).sum();
        let w = Arc::new(Window {
            runs,
            segs,
            data: Mutex::new(None),
            ready: Condvar::new(),
            signal,
            left: AtomicUsize::new(usize::try_from(blocks).expect("fits")),
        });
        c.insert(&w, usize::try_from(max * CACHE_WINDOWS / BLOCK as u64).expect("fits"));
        ra.cached.store(c.index.len(), Ordering::Release);
        w
    };
    let mut q = ra.jobs.lock();
    if q.1 {
        drop(q);
        fail(&window);
    } else {
        q.0.push_back(Job { window, pinned: pinned.into_held() });
        ra.wake.notify_one();
    }
}

/// Completes a window that will not be read (its readers read for themselves).
fn fail(w: &Window) {
    w.complete(Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "readahead stopped")));
}

/// A readahead thread (there are [`THREADS`]): reads queued windows one at a time.
pub(crate) fn readahead_loop(ctx: &Ctx, ra: &Readahead, tail: &Tail) {
    loop {
        let job = {
            let mut q = ra.jobs.lock();
            while q.0.is_empty() && !q.1 {
                ra.wake.wait(&mut q);
            }
            if q.1 {
                for job in q.0.drain(..) {
                    fail(&job.window);
                    drop(Pinned::adopt(&ctx.pins, job.pinned));
                }
                return;
            }
            q.0.pop_front().expect("not empty")
        };
        let w = &job.window;
        let data = tail::read_runs(ctx, tail, &w.runs).map(Arc::new);
        if data.is_ok() {
            ra.read_bytes.fetch_add(w.runs.iter().map(|r| r.1).sum::<u64>() * BLOCK as u64, Ordering::Relaxed);
        }
        w.complete(data);
        // The window's blocks are cached (or failed) before its segments are unpinned.
        drop(Pinned::adopt(&ctx.pins, job.pinned));
    }
}

/// A block of a read that a readahead window holds.
pub(crate) enum Hit {
    /// Read: the window's buffer and the block's byte offset there.
    Ready(Arc<AlignedBuf>, usize),
    /// Still being read: the window, the block's slot in it, and its pool block.
    Pending(Arc<Window>, usize, u64),
}

impl Hit {
    /// The eventfd that becomes readable once a pending block's window is read.
    pub fn pending_fd(&self) -> Option<RawFd> {
        match self {
            Hit::Ready(..) => None,
            Hit::Pending(w, ..) => Some(w.signal.as_raw_fd()),
        }
    }

    /// The block's buffer and byte offset once its window is read; its pool block if the window
    /// failed (the reader reads it itself).
    pub fn wait(self) -> Result<(Arc<AlignedBuf>, usize), u64> {
        match self {
            Hit::Ready(buf, at) => Ok((buf, at)),
            Hit::Pending(w, slot, pba) => match w.wait().as_ref() {
                Some(Ok(data)) => Ok((Arc::clone(data), slot * BLOCK)),
                _ => Err(pba),
            },
        }
    }
}

/// Gathers the media blocks of `runs` (as `tail::gather`), taking those read ahead from the
/// cache. It never waits: a block whose window is still being read is left [`Hit::Pending`],
/// for the caller to wait on with its own I/O (a poll of the window's eventfd, see
/// `Reads::submit`), or when it finishes the read. An event loop that slept on a window here
/// could neither send replies nor start other reads meanwhile (read-1m-qd16 went to two
/// readahead threads' pace, 0.7-0.8x qemu-nbd).
pub(crate) fn gather(ra: &Readahead, tail: &Tail, runs: &[(u64, u64)]) -> Gather {
    let all = |runs: &[(u64, u64)]| {
        let (buf, todo) = tail::gather(tail, runs);
        Gather { hits: Vec::new(), buf, todo }
    };
    if ra.cached.load(Ordering::Acquire) == 0 {
        return all(runs);
    }
    // Each block's window and slot there, or None.
    let found: Vec<Option<(Arc<Window>, usize)>> = {
        let c = ra.cache.lock();
        runs.iter().flat_map(|&(p, n)| p..p + n).map(|pba| c.index.get(&pba).cloned()).collect()
    };
    if found.iter().all(Option::is_none) {
        return all(runs);
    }
    // Each block's hit, or None: gathered below with the rest.
    let mut hits: Vec<Option<Hit>> = Vec::with_capacity(found.len());
    let mut missing: Vec<u64> = Vec::new();
    let mut done: Vec<Arc<Window>> = Vec::new();
    let pbas = runs.iter().flat_map(|&(p, n)| p..p + n);
    for (pba, hit) in pbas.zip(found) {
        let here = hit.and_then(|(w, slot)| {
            let hit = match w.data.lock().as_ref() {
                None => Hit::Pending(Arc::clone(&w), slot, pba),
                Some(Ok(data)) => Hit::Ready(Arc::clone(data), slot * BLOCK),
                Some(Err(_)) => return None,
            };
            if w.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                done.push(w);
            }
            Some(hit)
        });
        if here.is_none() {
            missing.push(pba);
        }
        hits.push(here);
    }
    let taken = hits.iter().flatten().count();
    ra.hit_bytes.fetch_add((taken * BLOCK) as u64, Ordering::Relaxed);
    if !done.is_empty() {
        let mut c = ra.cache.lock();
        for w in &done {
            c.remove(w);
        }
        ra.cached.store(c.index.len(), Ordering::Release);
    }
    // The missing blocks take the slots of `buf` in order, so runs may span the hits between.
    let Gather { buf, todo, .. } = all(&pba_runs(missing));
    Gather { hits, buf, todo }
}

/// One sequential stream: where it has read up to, how many reads in a row, and how far the
/// windows queued for it reach.
#[derive(Debug, Default, Clone, Copy)]
struct Stream {
    next: u64,
    run: u32,
    ahead: u64,
    used: u64,
}

/// The sequential streams of one volume handle (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct Streams {
    s: [Stream; STREAMS],
    clock: u64,
}

impl Streams {
    /// Notes a read of `[offset, offset + len)`; returns the range to read ahead now, if any.
    /// A read continues a stream if it starts near where the stream has read up to (readers
    /// with several requests in flight are served out of order). The window grows with the
    /// stream, from four reads' worth up to `max`, and is topped up once a quarter of it was
    /// used. Offsets are not checked yet (a read past the end fails later): arithmetic saturates.
    pub fn note(&mut self, offset: u64, len: u64, max: u64) -> Option<(u64, u64)> {
        self.clock += 1;
        let near = len.saturating_mul(4).max(256 << 10);
        let end = offset.saturating_add(len);
        let found = self
            .s
            .iter()
            .position(|s| s.used > 0 && offset.saturating_add(near) >= s.next && offset <= s.next.saturating_add(near));
        let Some(i) = found else {
            let lru = (0..STREAMS).min_by_key(|&i| self.s[i].used).expect("streams");
            self.s[lru] = Stream { next: end, run: 0, ahead: 0, used: self.clock };
            return None;
        };
        let s = &mut self.s[i];
        s.used = self.clock;
        s.next = s.next.max(end);
        s.run = s.run.saturating_add(1);
        if s.run < START_AFTER {
            return None;
        }
        let window = len.saturating_mul(1 << (s.run - START_AFTER + 2).min(20)).min(max).max(len);
        let from = s.ahead.max(s.next);
        if from >= s.next.saturating_add(window / 4 * 3) {
            return None;
        }
        let to = s.next.saturating_add(window);
        s.ahead = to;
        Some((from, to - from))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1024;

    #[test]
    fn a_stream_is_read_ahead_after_a_few_reads_and_topped_up_as_it_goes() {
        let mut s = Streams::default();
        assert_eq!(s.note(0, 128 * K, 2048 * K), None);
        assert_eq!(s.note(128 * K, 128 * K, 2048 * K), None);
        // Third read in a row: four reads' worth ahead.
        assert_eq!(s.note(256 * K, 128 * K, 2048 * K), Some((384 * K, 512 * K)));
        let mut ahead = 896 * K;
        let mut queued = 0;
        for i in 3..64 {
            if let Some((from, len)) = s.note(i * 128 * K, 128 * K, 2048 * K) {
                assert_eq!(from, ahead, "windows follow each other without gaps or overlap");
                ahead = from + len;
                queued += 1;
            }
            assert!(ahead > (i + 1) * 128 * K, "always something read ahead");
            assert!(ahead <= (i + 1) * 128 * K + 2048 * K, "never more than the window");
        }
        assert!(queued < 20, "topped up in large steps, not per read: {queued}");
    }

    #[test]
    fn reads_at_the_end_of_the_offset_range_do_not_overflow() {
        let mut s = Streams::default();
        for i in 0..8 {
            let _ = s.note(u64::MAX - 4096 + i * 512, 1 << 20, 2048 * K);
        }
    }

    #[test]
    fn random_reads_read_nothing_ahead() {
        let mut s = Streams::default();
        let mut x = 12345u64;
        for _ in 0..1000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let offset = (x >> 20) % (1 << 30) / 4096 * 4096;
            assert_eq!(s.note(offset, 4096, 2048 * K), None, "at {offset}");
        }
    }

    #[test]
    fn interleaved_streams_are_told_apart_and_reordered_reads_still_count() {
        let mut s = Streams::default();
        let mut due = [0; 2];
        for i in 0..16u64 {
            for (k, base) in [0u64, 1 << 30].into_iter().enumerate() {
                // Pairs of reads arrive swapped, as from a client with two in flight.
                let j = i ^ 1;
                if s.note(base + j * 64 * K, 64 * K, 1024 * K).is_some() {
                    due[k] += 1;
                }
            }
        }
        assert!(due.iter().all(|&d| d > 0), "both streams read ahead: {due:?}");
    }
}
