//! A connection's event loop: one thread receives the client's requests and reads the store for
//! them on one io_uring, and sleeps once for whichever completes first.
//!
//! ```text
//!  ring:  [receive into the inbox]  [store reads of batch 1]  [store reads of batch 2] ...
//!  loop:  take every request received:
//!           reads            -> started as one batch (Volume::start_reads), store reads submitted
//!           small writes, block status, cache -> run now (the engine takes a small write in memory)
//!           small writes of a volume with synchronous replicas -> started now; the members'
//!             answer posts the reply and wakes the loop (an eventfd polled on the ring)
//!           flush, FUA, trim, zeroes, large writes, writes the cleaner paces -> a helper thread
//!         send the replies that are ready (as far as the socket takes them; the sender thread
//!           writes the rest, see outbox.rs)
//!         submit, sleep until something completes; finish the read batches whose reads are done
//! ```
//! A request costs no thread hand-off: the thread that received it reads the store for it and
//! replies, and one wake-up serves whatever completed meanwhile. Requests that may wait long (a
//! flush waits for a store sync, a write may wait for the cleaner) run on helper threads started
//! on demand, which send their own replies, so they never hold up the requests behind them.
//! Without io_uring, or for a store that is not a file, the loop receives and reads with
//! blocking calls instead.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferrite_engine::io::AsyncIo;
use ferrite_engine::{Batch, Push, Reads};
use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::{Condvar, Mutex};

use crate::handshake::{MAX_REQUEST, Session};
use crate::inbox::{Event, Inbox, MAX_HELD_WRITE};
use crate::limits::{InFlight, Limits, cost};
use crate::outbox::{Cost, Outbox, Sent};
use crate::proto::*;
use crate::socket::Socket;
use crate::transmission::{DATA_AT, Reply, Started, error_reply, handle, nbd_errno, read_reply, record};

/// Submission queue entries of a connection's ring (completions: twice as many).
const RING_ENTRIES: u32 = 128;
/// Most helper threads per connection (= requests that may wait long, in flight at once).
const MAX_HELPERS: usize = 64;
/// Most reads started as one batch (one lookup, one submission; their replies go out together).
const MAX_BATCH: usize = 32;
/// Reads longer than this get a batch of their own, so short ones are not held up behind them.
const MAX_BATCHED_READ: u32 = 256 << 10;
/// Longest write run on the loop: the largest the engine takes in memory, which is also the
/// longest whose payload the inbox lends out of its buffer.
const MAX_INLINE_WRITE: u32 = MAX_HELD_WRITE;
/// The receive's completion tag; a store read's is its batch's slot and its index there.
const RECV: u64 = u64::MAX;
/// The completion tag of the poll on [`Answered`]'s eventfd.
const ANSWERED: u64 = u64::MAX - 1;

/// Writes started on the loop whose members answer later: their replies, posted by the thread
/// that reads the answers, and the eventfd that wakes the loop for them. A reply the socket takes
/// at once is written by that thread itself ([`Outbox::try_send`]) and only noted for the loop,
/// which takes the note when it next wakes (the client's next request wakes it): no wake-up of
/// the loop per reply. The replies posted during a thread's batch ([`Batch`]: an ack answering
/// many requests) go out in one write at its end. The bell rings for a reply left to the loop,
/// and for any while the loop sleeps with no receive in flight.
struct Answered {
    posted: Mutex<Posted>,
    /// Replies posted during a batch, not written yet.
    held: Mutex<Vec<(Request, Reply, Instant)>>,
    wake: OwnedFd,
    /// The connection's socket (a duplicate) and replies, for a reply written here.
    sock: OwnedFd,
    out: Arc<Outbox>,
    /// The loop sleeps with no receive in flight: only the bell wakes it.
    deaf: AtomicBool,
}

#[derive(Default)]
struct Posted {
    /// Each reply, and how long its request took if it was written already.
    replies: Vec<(Request, Reply, Instant, Option<Duration>)>,
    rung: bool,
}

impl Answered {
    fn new(sock: OwnedFd, out: Arc<Outbox>) -> io::Result<Arc<Self>> {
        let wake =
            rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)?;
        let held = Mutex::default();
        Ok(Arc::new(Self { posted: Mutex::default(), held, wake, sock, out, deaf: AtomicBool::new(false) }))
    }

    /// The reply of a request its members answered: written at once, or at the end of this
    /// thread's batch.
    fn post(self: &Arc<Self>, req: Request, reply: Reply, start: Instant) {
        self.held.lock().push((req, reply, start));
        Batch::push(self);
    }

    fn ring_bell(&self) {
        // Only a counter overflow fails an eventfd write, which one per batch cannot reach.
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// The replies posted so far (the eventfd reset first if it rang, so none posted after goes
    /// unseen).
    fn take(&self) -> Vec<(Request, Reply, Instant, Option<Duration>)> {
        let mut posted = self.posted.lock();
        if std::mem::take(&mut posted.rung) {
            let _ = rustix::io::read(&self.wake, &mut [0u8; 8]);
        }
        std::mem::take(&mut posted.replies)
    }

    /// The loop is about to sleep, `deaf` if with no receive in flight: whether replies wait.
    fn sleeping(&self, deaf: bool) -> bool {
        self.deaf.store(deaf, Ordering::SeqCst);
        !self.posted.lock().replies.is_empty()
    }
}

impl Push for Answered {
    /// Writes the replies held, all in one write if the socket takes them; what it does not is
    /// left to the loop.
    fn push_now(&self) {
        let held = std::mem::take(&mut *self.held.lock());
        if held.is_empty() {
            return;
        }
        let (asked, replies): (Vec<(Request, Instant)>, Vec<Reply>) =
            held.into_iter().map(|(req, reply, start)| ((req, start), reply)).unzip();
        let failed: Vec<bool> = replies.iter().map(|r| r.failed).collect();
        let (entries, needs_loop): (Vec<_>, bool) = match self.out.try_send(self.sock.as_fd(), replies) {
            Ok(rest_queued) => {
                let written = |((req, start), failed): ((Request, Instant), bool)| {
                    (req, Reply { bytes: Vec::new(), failed }, start, Some(start.elapsed()))
                };
                (asked.into_iter().zip(failed).map(written).collect(), rest_queued)
            }
            Err(replies) => {
                let left = |((req, start), reply): ((Request, Instant), Reply)| (req, reply, start, None);
                (asked.into_iter().zip(replies).map(left).collect(), true)
            }
        };
        let mut posted = self.posted.lock();
        posted.replies.extend(entries);
        if !posted.rung && (needs_loop || self.deaf.load(Ordering::SeqCst)) {
            posted.rung = true;
            self.ring_bell();
        }
    }
}

/// What the loop, its helpers and its sender share.
struct Conn<'a, S> {
    sock: &'a S,
    session: &'a Session,
    limits: &'a Limits,
    in_flight: InFlight,
    out: Arc<Outbox>,
}

impl<S: Socket> Conn<'_, S> {
    /// Sends replies from a helper (waits for the socket unless a sender runs), and releases
    /// what their requests held once they are written.
    fn send(&self, replies: Vec<Reply>, cost: Cost) {
        if let Sent::Written(cost) = self.out.send(self.sock, replies, cost, false) {
            self.release(cost);
        }
    }

    fn release(&self, (bytes, requests): Cost) {
        self.in_flight.release(self.limits, bytes, requests);
    }

    /// Runs the sender on a thread of its own, or, if none can be started, writes what was
    /// queued for it now.
    fn start_sender<'s>(&'s self, scope: &'s std::thread::Scope<'s, '_>) {
        let run = move || self.out.run_sender(self.sock, false, |cost| self.release(cost));
        match std::thread::Builder::new().name("nbd-sender".into()).spawn_scoped(scope, run) {
            Ok(_) => {
                self.session.export.metrics.senders_started.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start an NBD sender thread; the loop writes its replies itself");
                self.out.run_sender(self.sock, true, |cost| self.release(cost));
            }
        }
    }
}

/// Serves requests until the client disconnects (or breaks framing) and every request in flight
/// has replied. `ring` false receives and reads with blocking calls (also the fallback when no
/// ring can be set up).
pub fn serve<S: Socket>(sock: &S, session: &Session, limits: &Limits, ring: bool) -> io::Result<()> {
    let ring = (ring && sock.receives_raw()).then(|| IoUring::new(RING_ENTRIES)).transpose().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "io_uring unavailable; serving the NBD connection with blocking calls");
        None
    });
    let conn = Conn { sock, session, limits, in_flight: InFlight::default(), out: Arc::default() };
    let helpers = Helpers::default();
    std::thread::scope(|scope| {
        // Stops the helpers and the sender however the loop ends (a panic too), or the scope
        // would wait forever.
        let _stop = StopOnDrop(&helpers, &conn.out);
        let answered = ring.as_ref().and_then(|_| {
            sock.as_fd()
                .try_clone_to_owned()
                .and_then(|fd| Answered::new(fd, Arc::clone(&conn.out)))
                .inspect_err(|e| tracing::warn!(error = %e, "no eventfd: mirrored writes wait on helper threads"))
                .ok()
        });
        let mut l = Loop {
            conn: &conn,
            ring,
            answered,
            later: 0,
            polling: false,
            backlog: VecDeque::new(),
            submitted: 0,
            receiving: false,
            paused: false,
            inbox: Inbox::default(),
            grown: 0,
            flights: Vec::new(),
            free: Vec::new(),
            replies: Vec::new(),
            replied: (0, 0),
            end: None,
        };
        l.run(|req, payload| helpers.offload(scope, &conn, req, payload), || conn.start_sender(scope))
    })
}

struct StopOnDrop<'h>(&'h Helpers, &'h Outbox);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
        self.1.stop();
    }
}

/// Reads whose store reads are in flight.
struct Flight<'a> {
    reads: Reads<'a>,
    reqs: Vec<Request>,
    start: Instant,
}

/// The loop's ring as the engine's [`AsyncIo`]: a store read (or a wait for a readahead window)
/// goes to the backlog and is submitted with the next wait.
struct Backlog<'b>(&'b mut VecDeque<squeue::Entry>);

impl AsyncIo for Backlog<'_> {
    fn read_at(&mut self, fd: RawFd, buf: *mut u8, len: usize, offset: u64, user_data: u64) {
        let len = u32::try_from(len).expect("store reads are below 4 GiB");
        self.0.push_back(opcode::Read::new(types::Fd(fd), buf, len).offset(offset).build().user_data(user_data));
    }

    fn poll_readable(&mut self, fd: RawFd, user_data: u64) {
        self.0.push_back(opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build().user_data(user_data));
    }
}

struct Loop<'a, S: Socket> {
    conn: &'a Conn<'a, S>,
    ring: Option<IoUring>,
    /// Replies of writes started here that another thread finishes (with a ring only).
    answered: Option<Arc<Answered>>,
    /// Such writes not replied to yet, and whether the ring polls for their replies.
    later: usize,
    polling: bool,
    /// Entries the submission queue had no room for.
    backlog: VecDeque<squeue::Entry>,
    /// Entries handed to the ring whose completions are not reaped yet.
    submitted: usize,
    /// A receive is in flight (into `inbox.space()`, which must not change meanwhile).
    receiving: bool,
    /// The next request waits for what is in flight to drain (see `limits.rs`): nothing more is
    /// received meanwhile.
    paused: bool,
    inbox: Inbox,
    /// Bytes the inbox grew by, charged to `limits.receive_buffers` (given back on drop).
    grown: usize,
    flights: Vec<Option<Flight<'a>>>,
    free: Vec<usize>,
    /// Replies ready to send, and what their requests cost (bytes, requests).
    replies: Vec<Reply>,
    replied: Cost,
    /// How the connection ended, once it did (no more requests are taken).
    end: Option<io::Result<()>>,
}

impl<'a, S: Socket> Loop<'a, S> {
    fn run(&mut self, offload: impl Fn(Request, Vec<u8>), start_sender: impl Fn()) -> io::Result<()> {
        loop {
            if self.later > 0 {
                self.take_answered();
            }
            if self.end.is_none() {
                self.take_requests(&offload);
            }
            // With a ring, the loop never waits for the socket (see outbox.rs).
            let replies = std::mem::take(&mut self.replies);
            match self.conn.out.send(self.conn.sock, replies, std::mem::take(&mut self.replied), self.ring.is_some()) {
                Sent::Written(cost) => self.conn.release(cost),
                Sent::Queued => {}
                Sent::StartSender => start_sender(),
            }
            let idle = self.submitted == 0 && self.backlog.is_empty() && self.later == 0;
            if self.end.is_some() && idle {
                return self.end.take().expect("checked");
            }
            if self.paused && self.flights.iter().all(Option::is_none) && self.later == 0 {
                // Only helpers hold what must drain (a receive in flight, if any, waits on the
                // ring meanwhile): wait for one to reply.
                self.conn.in_flight.wait_release(std::time::Duration::from_millis(100));
                continue;
            }
            if self.ring.is_none() {
                self.receive_blocking();
                continue;
            }
            if self.end.is_none() && !self.receiving && !self.paused {
                self.grow_inbox();
                let space = self.inbox.space();
                let entry = opcode::Recv::new(
                    types::Fd(self.conn.sock.as_raw_fd()),
                    space.as_mut_ptr(),
                    u32::try_from(space.len()).expect("small"),
                )
                .build()
                .user_data(RECV);
                self.receiving = true;
                self.backlog.push_front(entry);
            }
            self.wait();
        }
    }

    /// Takes every request received and runs, starts or hands off each.
    fn take_requests(&mut self, offload: &impl Fn(Request, Vec<u8>)) {
        let (session, conn) = (self.conn.session, self.conn);
        let st = session.structured;
        // Gathered while the inbox lends out payloads, then queued and started.
        let mut replies: Vec<(Request, Reply, Instant)> = Vec::new();
        let mut later = 0;
        let answered = self.answered.clone();
        // The writes started here reach the volume's replicas together, when this returns.
        let _sends = answered.as_ref().map(|_| Batch::hold());
        let mut batches: Vec<Vec<Request>> = Vec::new();
        let mut reads = Vec::new();
        self.paused = false;
        let mut refused = false;
        let mut admit = |r: &Request| {
            refused = !conn.in_flight.admit(conn.limits, r);
            !refused
        };
        while let Some(event) = self.inbox.next_event_with(&mut admit) {
            let req = match event {
                Event::Request(req, _) if !flags_valid(req.kind, req.flags, st) => {
                    let reply =
                        error_reply(st, req.cookie, EINVAL, "the request carries flags its command does not take");
                    replies.push((req, reply, Instant::now()));
                    continue;
                }
                Event::Request(req, payload) if req.kind != CMD_READ => {
                    let start = Instant::now();
                    if runs_now(conn, &req) {
                        replies.push((req, handle(session, req, &payload), start));
                        continue;
                    }
                    if let Some(a) = answered.as_ref().filter(|_| starts_later(conn, &req)) {
                        let a = Arc::clone(a);
                        match crate::transmission::start_write(session, req, &payload, move |r| a.post(req, r, start)) {
                            Started::Later => later += 1,
                            Started::Now(reply) => replies.push((req, reply, start)),
                            Started::Blocking => offload(req, payload.into_owned()),
                        }
                        continue;
                    }
                    offload(req, payload.into_owned());
                    continue;
                }
                Event::Request(req, _) => req,
                Event::Oversized(req) => {
                    let reply = error_reply(st, req.cookie, EOVERFLOW, "write larger than 32 MiB");
                    replies.push((req, reply, Instant::now()));
                    continue;
                }
                Event::Disconnect => {
                    self.end = Some(Ok(()));
                    break;
                }
                Event::BadMagic(m) => {
                    let e = io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {m:#x}"));
                    self.end = Some(Err(e));
                    break;
                }
            };
            if req.length > MAX_REQUEST {
                let reply = error_reply(st, req.cookie, if st { EOVERFLOW } else { EINVAL }, "read larger than 32 MiB");
                replies.push((req, reply, Instant::now()));
            } else if req.length > MAX_BATCHED_READ {
                batches.push(vec![req]);
            } else {
                reads.push(req);
                if reads.len() == MAX_BATCH {
                    batches.push(std::mem::take(&mut reads));
                }
            }
        }
        self.paused = refused;
        self.later += later;
        for (req, reply, start) in replies {
            self.reply(&req, reply, start);
        }
        if !reads.is_empty() {
            batches.push(reads);
        }
        for batch in batches {
            self.start_reads(batch);
        }
    }

    /// Takes the replies of writes the members answered: those written already are done.
    fn take_answered(&mut self) {
        for (req, reply, start, written) in self.answered.as_ref().map(|a| a.take()).unwrap_or_default() {
            self.later -= 1;
            if let Some(took) = written {
                record(self.conn.session, &req, &reply, took);
                self.conn.release((cost(&req), 1));
            } else {
                self.reply(&req, reply, start);
            }
        }
    }

    fn reply(&mut self, req: &Request, reply: Reply, start: Instant) {
        record(self.conn.session, req, &reply, start.elapsed());
        self.replies.push(reply);
        self.replied.0 += cost(req);
        self.replied.1 += 1;
    }

    /// Starts `reqs` (reads) as one batch; their store reads go on the ring, or are done now.
    fn start_reads(&mut self, reqs: Vec<Request>) {
        let session = self.conn.session;
        let start = Instant::now();
        let parts: Vec<(u64, usize)> = reqs.iter().map(|r| (r.offset, r.length as usize)).collect();
        let mut reads = match session.export.volume.start_reads(&parts) {
            Ok(r) => r,
            Err(e) => {
                for req in &reqs {
                    self.reply(req, error_reply(session.structured, req.cookie, nbd_errno(&e), &e.to_string()), start);
                }
                return;
            }
        };
        let slot = self.free.pop().unwrap_or_else(|| {
            self.flights.push(None);
            self.flights.len() - 1
        });
        let started =
            if self.ring.is_some() { reads.submit(&mut Backlog(&mut self.backlog), |i| tag(slot, i)) } else { None };
        match started {
            Some(n) if n > 0 => self.flights[slot] = Some(Flight { reads, reqs, start }),
            _ => {
                self.free.push(slot);
                // Nothing left to read, or a store that is not a file: read it here.
                let media = if started.is_none() { reads.read_media() } else { Ok(()) };
                self.finish(reads, &reqs, media, start);
            }
        }
    }

    /// Completes a batch whose store reads are done, and queues its replies.
    fn finish(&mut self, reads: Reads<'_>, reqs: &[Request], media: io::Result<()>, start: Instant) {
        let st = self.conn.session.structured;
        let at = if st { DATA_AT } else { SIMPLE_REPLY_LEN };
        let mut outs: Vec<Vec<u8>> = reqs.iter().map(|r| vec![0u8; at + r.length as usize]).collect();
        let results = reads.finish(media, &mut outs.iter_mut().map(|o| &mut o[at..]).collect::<Vec<_>>());
        for ((req, out), result) in reqs.iter().zip(outs).zip(results) {
            let reply = match result {
                Ok(runs) => read_reply(st, req, out, &runs),
                Err(e) => error_reply(st, req.cookie, nbd_errno(&e), &e.to_string()),
            };
            self.reply(req, reply, start);
        }
    }

    /// Hands queued entries to the ring (as many as it has room for, keeping completions within
    /// its completion queue), sleeps until at least one completes, and handles what completed.
    fn wait(&mut self) {
        if let Some(a) = self.answered.as_ref().filter(|_| self.later > 0)
            && a.sleeping(!self.receiving)
        {
            return; // replies to take first
        }
        if let Some(a) = self.answered.as_ref().filter(|_| self.later > 0 && !self.polling) {
            let poll = opcode::PollAdd::new(types::Fd(a.wake.as_raw_fd()), libc::POLLIN as u32);
            self.backlog.push_back(poll.build().user_data(ANSWERED));
            self.polling = true;
        }
        let ring = self.ring.as_mut().expect("the ring loop");
        while self.submitted < 2 * RING_ENTRIES as usize {
            let Some(entry) = self.backlog.pop_front() else { break };
            // SAFETY: every entry's buffer outlives its completion: a receive's is the inbox's
            // space, untouched while `receiving` is set (cleared only when its completion is
            // reaped); a store read's belongs to its batch's `Reads` (as does the readahead
            // window whose eventfd a poll waits on), which stays in `flights` until all of its
            // operations were reported complete (the `AsyncIo` contract). The loop
            // never returns with entries submitted (see `run`), and on failure the entry is put
            // back, not dropped.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                self.backlog.push_front(entry);
                break;
            }
            self.submitted += 1;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            // Transient errors (EINTR, EAGAIN, EBUSY) clear on retry; entries in flight still
            // own their buffers, so the loop goes on either way.
            if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) {
                tracing::warn!(error = %e, "io_uring_enter failed on an NBD connection; retrying");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            return;
        }
        let done: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (tag, res) in done {
            self.submitted -= 1;
            if tag == RECV {
                self.receiving = false;
                self.received(usize::try_from(res).map_err(|_| io::Error::from_raw_os_error(-res)));
            } else if tag == ANSWERED {
                self.polling = false;
                self.take_answered();
            } else {
                self.read_done(tag, res);
            }
        }
    }

    /// A store read or a wait for a readahead window completed with `res` (the engine starts a
    /// short read again for the rest); the batch is finished once all of them are done.
    fn read_done(&mut self, tag: u64, res: i32) {
        let (slot, i) =
            (usize::try_from(tag >> 32).expect("fits"), usize::try_from(tag & u64::from(u32::MAX)).expect("fits"));
        let f = self.flights[slot].as_mut().expect("a store read's batch is in flight");
        if let Some(media) = f.reads.complete(&mut Backlog(&mut self.backlog), i, res) {
            let f = self.flights[slot].take().expect("checked");
            self.free.push(slot);
            self.finish(f.reads, &f.reqs, media, f.start);
        }
    }

    /// Bytes (or the end) came in from the client.
    fn received(&mut self, got: io::Result<usize>) {
        match got {
            Ok(0) => self.end = Some(Ok(())),
            Ok(n) => self.inbox.received(n),
            Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) => {}
            Err(e) => self.end = Some(Err(e)),
        }
    }

    /// Grows the inbox once the client sends writes it would hold, if the budget for grown
    /// buffers has room (a connection's buffer is memory a client makes the daemon keep).
    fn grow_inbox(&mut self) {
        let n = self.inbox.growth();
        if n > 0 && self.conn.limits.receive_buffers.try_take(n as u64) {
            self.grown += self.inbox.grow();
        }
    }

    fn receive_blocking(&mut self) {
        if self.paused {
            return;
        }
        self.grow_inbox();
        let got = self.conn.sock.read_some(self.inbox.space());
        self.received(got);
    }
}

impl<S: Socket> Drop for Loop<'_, S> {
    /// A loop that ends with entries in flight (only a panic does) waits for them, as their
    /// buffers must outlive them; shutting the socket down completes a pending receive.
    fn drop(&mut self) {
        self.conn.limits.receive_buffers.give(self.grown as u64);
        let Some(ring) = self.ring.as_mut().filter(|_| self.submitted > 0) else { return };
        let _ = rustix::net::shutdown(self.conn.sock.as_fd(), rustix::net::Shutdown::Both);
        if let Some(a) = &self.answered {
            a.ring_bell(); // completes the poll, if one is armed
        }
        while self.submitted > 0 {
            if ring.submit_and_wait(1).is_ok() {
                self.submitted -= ring.completion().count();
            }
        }
    }
}

/// Whether a request other than a read is quick enough to run on the loop.
fn runs_now<S: Socket>(conn: &Conn<'_, S>, req: &Request) -> bool {
    match req.kind {
        CMD_WRITE => {
            req.length <= MAX_INLINE_WRITE
                && req.flags & CMD_FLAG_FUA == 0
                && !conn.session.export.volume.writes_may_wait()
        }
        CMD_FLUSH | CMD_TRIM | CMD_WRITE_ZEROES => false,
        // Block status and cache are answered from memory; anything else is refused.
        _ => true,
    }
}

/// Whether a request is a write the loop starts and the members of its volume's synchronous
/// replicas finish (see [`crate::transmission::start_write`]).
fn starts_later<S: Socket>(conn: &Conn<'_, S>, req: &Request) -> bool {
    req.kind == CMD_WRITE
        && req.length <= MAX_INLINE_WRITE
        && req.flags & CMD_FLAG_FUA == 0
        && conn.session.export.volume.is_mirrored()
}

fn tag(slot: usize, i: usize) -> u64 {
    ((slot as u64) << 32) | u64::try_from(i).expect("fits")
}

/// Helper threads for the requests that may wait long, started on demand.
#[derive(Default)]
struct Helpers {
    queue: Mutex<Queue>,
    wake: Condvar,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<(Request, Vec<u8>)>,
    /// Helpers waiting for a job, and helpers running.
    idle: usize,
    threads: usize,
    stop: bool,
}

impl Helpers {
    /// Queues a request; starts another helper when every one is busy.
    fn offload<'s, S: Socket>(
        &'s self,
        scope: &'s std::thread::Scope<'s, '_>,
        conn: &'s Conn<'s, S>,
        req: Request,
        payload: Vec<u8>,
    ) {
        let mut q = self.queue.lock();
        q.jobs.push_back((req, payload));
        if q.jobs.len() <= q.idle || q.threads == MAX_HELPERS {
            self.wake.notify_one();
            return;
        }
        q.threads += 1;
        drop(q);
        let spawned =
            std::thread::Builder::new().name("nbd-helper".into()).spawn_scoped(scope, move || self.work(conn));
        match spawned {
            Ok(_) => {
                conn.session.export.metrics.helpers_started.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start an NBD helper thread; the running ones take the request");
                let mut q = self.queue.lock();
                q.threads -= 1;
                if q.threads == 0 {
                    // Nobody would ever take it: run it here.
                    let job = q.jobs.pop_back().expect("just queued");
                    drop(q);
                    run_job(conn, job);
                }
            }
        }
    }

    fn work<S: Socket>(&self, conn: &Conn<'_, S>) {
        loop {
            let job = {
                let mut q = self.queue.lock();
                q.idle += 1;
                while q.jobs.is_empty() && !q.stop {
                    self.wake.wait(&mut q);
                }
                q.idle -= 1;
                match q.jobs.pop_front() {
                    Some(job) => job,
                    None => return,
                }
            };
            run_job(conn, job);
        }
    }

    /// Lets the helpers end once the queued requests have run.
    fn stop(&self) {
        self.queue.lock().stop = true;
        self.wake.notify_all();
    }
}

fn run_job<S: Socket>(conn: &Conn<'_, S>, (req, payload): (Request, Vec<u8>)) {
    let start = Instant::now();
    let reply = handle(conn.session, req, &payload);
    record(conn.session, &req, &reply, start.elapsed());
    conn.send(vec![reply], (cost(&req), 1));
}
