//! The request queue and its leader (group commit): concurrent requests become batches.
//!
//! ```text
//!  callers --Req--> queue --> leader (the first caller to find no leader) takes up to a batch
//!                             --> the open batch (tail.rs) or a batch of its own (batch.rs)
//!                             --> ack (FUA / FLUSH: after sync); repeats until the queue is empty
//! ```
//! There is no writer thread: at queue depth 1 the caller writes its own batch with no thread
//! hand-off, and under load one caller leads while the others' requests pile up into the next
//! batch. Only one leader runs at a time, so batches keep a single order.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::ctx::{Ctx, closed};
use crate::error::{Error, ErrorKind, Result, clone_err};
use crate::io::{AlignedBuf, BLOCK};
use crate::write::batch::{head_room_blocks, write_batch};
use crate::write::req::{Done, Req, Waiter};
use crate::write::room::MakeRoom;
use crate::write::tail::{self, Tail};
use crate::write::tailfile::TailBuf;

/// Most entries in one batch.
pub(crate) const MAX_ENTRIES: usize = 512;

/// The log: the request queue, the leader's baton (which also holds the reusable batch
/// buffer), the open batch, and what to ask when the head needs a segment and none is free.
#[derive(Debug)]
pub(crate) struct Log {
    queue: Mutex<Queue>,
    /// The open batch small writes go into (see `tail.rs`).
    pub tail: Tail,
    /// Held by the thread writing batches. A buffer reused across batches avoids an mmap and
    /// page faults per large batch.
    leader: Mutex<AlignedBuf>,
    pub room: Box<dyn MakeRoom>,
}

#[derive(Debug, Default)]
struct Queue {
    reqs: VecDeque<Req>,
    closed: bool,
}

impl Log {
    /// The log, its open batch built in `bufs` (the tail file's slots).
    pub fn new(room: Box<dyn MakeRoom>, bufs: Vec<TailBuf>) -> Self {
        Self { queue: Mutex::default(), tail: Tail::new(bufs), leader: Mutex::new(AlignedBuf::new(BLOCK)), room }
    }

    /// Refuses new requests and waits for the current leader to finish.
    pub fn close(&self) {
        self.queue.lock().closed = true;
        drop(self.leader.lock());
    }

    /// Hands a request to the log; if it is closed, completes the request with an error.
    pub fn send(&self, ctx: &Ctx, req: Req) -> Result<()> {
        self.send_all(ctx, vec![req])
    }

    /// As [`Log::send`] for several requests, which may then share a batch.
    pub fn send_all(&self, ctx: &Ctx, reqs: Vec<Req>) -> Result<()> {
        submit(ctx, self, reqs).map_err(|unsent| {
            let e = closed();
            unsent.into_iter().for_each(|r| r.fail(&e));
            e
        })
    }

    /// Runs `f` on the leader with every earlier request applied and no later one started.
    pub fn barrier<T: Send + 'static>(
        &self,
        ctx: &Ctx,
        f: impl FnOnce(&Ctx, &Log) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        ctx.check_open()?;
        let out = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&out);
        let w = Waiter::new();
        let run = Box::new(move |ctx: &Ctx, log: &Log| {
            let v = f(ctx, log)?;
            *slot.lock() = Some(v);
            Ok(())
        });
        self.send(ctx, Req::Barrier { run, done: w.add() })?;
        w.wait()?;
        let v = out.lock().take();
        Ok(v.expect("a successful barrier stores its result"))
    }

    /// Makes every write acknowledged so far durable.
    pub fn flush(&self, ctx: &Ctx) -> Result<()> {
        ctx.check_open()?;
        let w = Waiter::new();
        self.send(ctx, Req::Flush { done: w.add() })?;
        w.wait()
    }
}

/// Hands requests to the log: queues them all (so they can share a batch) and, if no other
/// thread is leading, leads until the queue is empty. On return a request may or may not have
/// completed; its callback says when. If the log is closed, the requests not queued come back.
fn submit(ctx: &Ctx, log: &Log, reqs: Vec<Req>) -> Result<(), Vec<Req>> {
    {
        let mut q = log.queue.lock();
        if q.closed {
            return Err(reqs);
        }
        q.reqs.extend(reqs);
    }
    loop {
        let Some(mut scratch) = log.leader.try_lock() else {
            // The leader takes our requests with its next batches (it only stops on an empty queue).
            return Ok(());
        };
        loop {
            let reqs = take_batch(ctx, log);
            if reqs.is_empty() {
                break;
            }
            process(ctx, log, reqs, &mut scratch);
        }
        drop(scratch);
        // A request queued between our last look and letting go would have seen us leading.
        if log.queue.lock().reqs.is_empty() {
            return Ok(());
        }
    }
}

/// Takes the next batch off the queue: as many requests as fit one batch.
fn take_batch(ctx: &Ctx, log: &Log) -> Vec<Req> {
    // Fill what is left of the head segment before moving on, so segments end with little
    // unused space; a request that does not fit there starts a new segment.
    let room = head_room_blocks(ctx);
    let mut q = log.queue.lock();
    let Some(first) = q.reqs.front() else { return Vec::new() };
    let limit = if first.data_blocks() <= room { room.min(ctx.max_batch_blocks) } else { ctx.max_batch_blocks };
    let mut reqs = Vec::new();
    let mut blocks = 0;
    while let Some(r) = q.reqs.front() {
        let barrier = matches!(r, Req::Barrier { .. });
        if !reqs.is_empty() && (barrier || reqs.len() == MAX_ENTRIES || blocks + r.data_blocks() > limit) {
            break;
        }
        if barrier {
            // Alone in its batch.
            reqs.push(q.reqs.pop_front().expect("front exists"));
            break;
        }
        blocks += r.data_blocks();
        reqs.push(q.reqs.pop_front().expect("front exists"));
    }
    reqs
}

fn process(ctx: &Ctx, log: &Log, reqs: Vec<Req>, scratch: &mut AlignedBuf) {
    if let Err(e) = ctx.check_open() {
        return fail_all(reqs, &e);
    }
    if let [Req::Barrier { .. }] = reqs.as_slice() {
        let Some(Req::Barrier { run, done }) = reqs.into_iter().next() else { unreachable!("matched above") };
        // The barrier sees every earlier write on the store, not only in the maps.
        return done(tail::close(ctx, log).and_then(|()| run(ctx, log)));
    }
    let mut acks: Vec<(Done, Result<()>)> = Vec::new();
    let mut after_sync: Vec<Done> = Vec::new();
    let mut batch: Vec<Req> = Vec::new();
    let mut need_sync = false;
    for r in reqs {
        match r {
            Req::Flush { done } => {
                need_sync = true;
                after_sync.push(done);
            }
            r => batch.push(r),
        }
    }
    let outcomes = if !batch.is_empty() && batch.iter().all(|r| tail::takes(ctx, r)) {
        tail::append(ctx, log, batch)
    } else {
        write_direct(ctx, log, batch, scratch)
    };
    for (r, result) in outcomes {
        let (done, fua) = match r {
            Req::Write { done, fua, .. } => (done, fua),
            Req::Unmap { done, .. } => (done, false),
            Req::Flush { .. } | Req::Barrier { .. } | Req::Move { .. } => {
                unreachable!("flushes were split out, barriers go alone, moves never queue")
            }
        };
        match (result, fua) {
            (Ok(()), true) => {
                need_sync = true;
                after_sync.push(done);
            }
            (result, _) => acks.push((done, result)),
        }
    }
    for (done, r) in acks {
        done(r);
    }
    if need_sync {
        let r = ctx.check_open().and_then(|()| tail::close(ctx, log)).and_then(|()| ctx.sync_store());
        for done in after_sync {
            done(r.as_ref().map(|_| ()).map_err(clone_err));
        }
    }
}

/// Writes `batch` as a batch of its own (after the open batch, which is closed first).
fn write_direct(ctx: &Ctx, log: &Log, mut batch: Vec<Req>, scratch: &mut AlignedBuf) -> Vec<(Req, Result<()>)> {
    if batch.is_empty() {
        return Vec::new();
    }
    if let Err(e) = tail::close(ctx, log) {
        return batch.into_iter().map(|r| (r, Err(clone_err(&e)))).collect();
    }
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut result = write_batch(ctx, log, &batch, scratch);
    if result.as_ref().is_err_and(|e| e.kind() == ErrorKind::NoSpace) {
        // Full: trims may still go (into the reserve) so that space can come back.
        let (unmaps, writes): (Vec<Req>, Vec<Req>) = batch.into_iter().partition(|r| matches!(r, Req::Unmap { .. }));
        let e = result.expect_err("checked above");
        outcomes.extend(writes.into_iter().map(|r| (r, Err(clone_err(&e)))));
        batch = unmaps;
        result = if batch.is_empty() { Ok(()) } else { write_batch(ctx, log, &batch, scratch) };
    }
    outcomes.extend(batch.into_iter().map(|r| {
        let res = result.as_ref().map(|_| ()).map_err(clone_err);
        (r, res)
    }));
    outcomes
}

fn fail_all(reqs: Vec<Req>, e: &Error) {
    for r in reqs {
        r.fail(e);
    }
}
