//! One ublk queue: its thread owns the queue's io_uring (libublk's model). Requests that complete
//! without waiting for the store (small writes, which the engine copies into its open batch, and
//! reads of a store in memory: `Request::runs_inline`) run on that thread; the others go to a
//! small pool of worker threads, because the engine's calls block (and concurrent writes must
//! reach the engine at once to share a log batch). Workers post completions to a list and wake the
//! queue thread through an eventfd it polls on the same ring (so does the members' answer to a
//! small write of a volume with synchronous replicas, which the queue thread starts itself:
//! `Request::start`, no thread waits for the members):
//!
//! ```text
//!  kernel --FETCH--> queue thread --job--> worker: Request::execute(volume, tag buffer)
//!  kernel <-COMMIT-- queue thread <--(tag, result) + eventfd-- worker
//! ```

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrite_engine::Volume;
use io_uring::{opcode, types};
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{BufDesc, UblkIORes};
use parking_lot::{Condvar, Mutex};
use rustix::event::{EventfdFlags, eventfd};

use crate::handler::Request;

/// Shared by a device's queues: lets the daemon stop taking requests before it exits. A request
/// counts from the moment the queue takes it until its completion is committed to the kernel, so
/// once frozen and drained, every request the kernel gave out was either answered or never
/// started: the next daemon gets each unanswered one once (REISSUE), none twice.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    frozen: AtomicBool,
    inflight: AtomicUsize,
}

impl Gate {
    /// Counts a request in; false (and not counted) once frozen.
    fn enter(&self) -> bool {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        if self.frozen.load(Ordering::SeqCst) {
            self.leave();
            return false;
        }
        true
    }

    fn leave(&self) {
        self.inflight.fetch_sub(1, Ordering::SeqCst);
    }

    /// Stops handing requests to the engine and waits (up to `limit`) for those already there to
    /// be answered; false if some are still running. Requests that arrive later stay with the kernel, which
    /// re-issues them to the next daemon (USER_RECOVERY_REISSUE).
    pub(crate) fn freeze(&self, limit: Duration) -> bool {
        self.frozen.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while self.inflight.load(Ordering::SeqCst) > 0 {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }
}

/// A tag's I/O buffer, lent to one worker for one request.
struct TagBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is to a tag's buffer, which the queue thread does not touch while the
// request is out (the kernel gives a tag out once until it is committed), and which outlives
// every worker (`Offload::shutdown` joins them before the buffers are dropped).
unsafe impl Send for TagBuf {}

struct Job {
    tag: u16,
    req: Request,
    buf: TagBuf,
}

#[derive(Default)]
struct Jobs {
    queue: VecDeque<Job>,
    idle: usize,
    workers: usize,
    stop: bool,
}

struct Shared {
    volume: Volume,
    jobs: Mutex<Jobs>,
    ready: Condvar,
    done: Mutex<Vec<(u16, i32)>>,
    wake: OwnedFd,
}

/// The worker pool of one queue. Workers start on demand, up to the queue depth.
struct Offload {
    shared: Arc<Shared>,
    max_workers: usize,
    threads: Vec<JoinHandle<()>>,
}

impl Offload {
    fn new(volume: Volume, max_workers: usize) -> std::io::Result<Self> {
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let shared = Shared { volume, jobs: Mutex::default(), ready: Condvar::new(), done: Mutex::default(), wake };
        Ok(Self { shared: Arc::new(shared), max_workers, threads: Vec::new() })
    }

    fn submit(&mut self, job: Job) {
        let mut jobs = self.shared.jobs.lock();
        jobs.queue.push_back(job);
        // Idle workers that have been woken but not yet run still count as idle: start a new
        // worker only when the queued jobs outnumber them.
        if jobs.queue.len() > jobs.idle && jobs.workers < self.max_workers {
            let shared = Arc::clone(&self.shared);
            match std::thread::Builder::new().name("ublk-worker".into()).spawn(move || work(&shared)) {
                Ok(t) => {
                    jobs.workers += 1;
                    self.threads.push(t);
                }
                // The job waits for a worker that exists (with none at all, the queue stalls).
                Err(e) => tracing::error!(error = %e, workers = jobs.workers, "cannot start a ublk worker thread"),
            }
        }
        self.shared.ready.notify_one();
    }

    /// Completions posted since the last call; also resets the eventfd.
    fn take_done(&self) -> Vec<(u16, i32)> {
        // Non-blocking: EAGAIN when nothing was posted since the last reset.
        let _ = rustix::io::read(&self.shared.wake, &mut [0u8; 8]);
        std::mem::take(&mut *self.shared.done.lock())
    }

    fn shutdown(&mut self) {
        self.shared.jobs.lock().stop = true;
        self.shared.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn work(shared: &Shared) {
    loop {
        let job = {
            let mut jobs = shared.jobs.lock();
            loop {
                if let Some(j) = jobs.queue.pop_front() {
                    break j;
                }
                if jobs.stop {
                    return;
                }
                jobs.idle += 1;
                shared.ready.wait(&mut jobs);
                jobs.idle -= 1;
            }
        };
        // SAFETY: see `TagBuf`: this worker is the buffer's only user until it posts the result.
        let buf = unsafe { std::slice::from_raw_parts_mut(job.buf.ptr, job.buf.len) };
        let res = job.req.execute(&shared.volume, buf);
        tracing::trace!(tag = job.tag, req = ?job.req, res, "ublk request done");
        shared.post(job.tag, res);
    }
}

impl Shared {
    /// Posts a request's completion for the queue thread, and wakes it.
    fn post(&self, tag: u16, res: i32) {
        let mut done = self.done.lock();
        done.push((tag, res));
        // Only the first completion of a batch needs to wake the queue thread: it takes them all.
        if done.len() == 1 {
            // An eventfd write only fails on counter overflow, which one per batch cannot reach.
            let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        }
    }
}

/// Arms a one-shot poll of the eventfd on the queue's ring, as a "target I/O".
fn arm_wake(q: &UblkQueue, fd: i32) {
    let user_data = UblkIOCtx::build_user_data(0, u32::from(opcode::PollAdd::CODE), 0, true);
    let sqe = opcode::PollAdd::new(types::Fd(fd), u32::from(libc::POLLIN.unsigned_abs())).build().user_data(user_data);
    if let Err(e) = q.ublk_submit_sqe_sync(sqe) {
        tracing::error!(error = ?e, "ublk: cannot arm the completion eventfd");
    }
}

/// Serves queue `qid` until the device stops (run on the queue's own thread by libublk).
pub(crate) fn serve(qid: u16, dev: &UblkDev, volume: Volume, gate: Arc<Gate>) {
    let bufs = dev.alloc_queue_io_bufs();
    let mut offload = match Offload::new(volume, usize::from(dev.dev_info.queue_depth)) {
        Ok(o) => o,
        Err(e) => {
            tracing::error!(queue = qid, error = %e, "ublk: cannot create the completion eventfd");
            return;
        }
    };
    let queue = match UblkQueue::new(qid, dev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
    {
        Ok(q) => q,
        Err(e) => {
            tracing::error!(queue = qid, error = ?e, "ublk: cannot set up the queue");
            return;
        }
    };
    let wake_fd = offload.shared.wake.as_raw_fd();
    arm_wake(&queue, wake_fd);
    let complete = |q: &UblkQueue, tag: u16, res: i32| {
        let buf = BufDesc::Slice(bufs[usize::from(tag)].as_slice());
        if let Err(e) = q.complete_io_cmd_unified(tag, buf, Ok(UblkIORes::Result(res))) {
            tracing::error!(queue = qid, tag, error = ?e, "ublk: cannot complete a request");
        }
    };
    queue.wait_and_handle_io(|q, tag, ctx| {
        if ctx.is_tgt_io() {
            for (tag, res) in offload.take_done() {
                complete(q, tag, res);
                gate.leave();
            }
            arm_wake(q, wake_fd);
            return;
        }
        if !gate.enter() {
            return; // frozen for a daemon exit: the kernel keeps the request for the next one
        }
        let iod = q.get_iod(tag);
        match Request::decode(iod.op_flags, iod.start_sector, iod.nr_sectors) {
            Ok(req)
                if req.start(&offload.shared.volume, bufs[usize::from(tag)].as_slice(), {
                    let shared = Arc::clone(&offload.shared);
                    move |res| shared.post(tag, res)
                }) => {}
            Ok(req) if req.runs_inline(&offload.shared.volume) => {
                let b = &bufs[usize::from(tag)];
                // SAFETY: the tag's buffer is not lent to a worker (the kernel gives a tag out
                // once until it is committed, and this request is not offloaded); nothing else
                // touches it until the completion below.
                let buf = unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr(), b.len()) };
                let res = req.execute(&offload.shared.volume, buf);
                complete(q, tag, res);
                gate.leave();
            }
            Ok(req) => {
                let b = &bufs[usize::from(tag)];
                offload.submit(Job { tag, req, buf: TagBuf { ptr: b.as_mut_ptr(), len: b.len() } });
            }
            Err(res) => {
                tracing::debug!(queue = qid, tag, op_flags = iod.op_flags, res, "ublk request refused");
                complete(q, tag, res);
                gate.leave();
            }
        }
    });
    // Workers may still hold tag buffers: join them before `bufs` goes.
    offload.shutdown();
}
