//! The transmission phase, served by a small pool of threads per connection (the engine API
//! blocks, and a thread that does its own socket I/O costs no hand-off between a reactor and a
//! worker: each request is one read, one engine call and one write on the same thread).
//!
//! ```text
//!  worker: [read lock: header + payload, + what is already buffered behind it]
//!          -> engine calls -> [write lock: replies] -> again
//! ```
//! The worker that holds the read lock starts another worker when none is waiting for the lock
//! (up to `MAX_WORKERS`), so a connection has as many threads as it has requests in flight.
//! Reads and small writes the client queued behind the first request run with it as one batch
//! (see [`run`]): one engine lookup and media submission for the reads, one `writev` for the
//! replies, where each request used to cost its own syscalls and thread wake-ups.
//! Replies go out in whatever order requests finish. A request the protocol lets us refuse gets
//! an error reply and the connection goes on; one that breaks framing (bad magic, a payload we
//! cannot read) ends the connection once the requests in flight have replied. A client that
//! disconnects in the middle of a write payload changes nothing: a write reaches the engine only
//! with its whole payload.

use std::io::{self, IoSlice, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ferrite_engine::{Error, ErrorKind, Volume};
use parking_lot::Mutex;

use crate::handshake::{BASE_ALLOCATION_ID, MAX_REQUEST, Session};
use crate::inbox::{Inbox, Source};
use crate::proto::*;

/// Most requests of one connection in flight at once (= worker threads).
const MAX_WORKERS: usize = 64;
/// Most requests one worker takes from the socket's buffer and runs together.
const MAX_BATCH: usize = 32;
/// Longest read that joins a batch (a batch's replies are held until all are read).
const MAX_BATCHED_READ: u32 = 256 << 10;
/// Longest write that joins a batch (the largest the engine acknowledges from memory).
const MAX_BATCHED_WRITE: u32 = 128 << 10;
/// Where a structured read reply's data starts: behind one data chunk's header and offset.
const DATA_AT: usize = STRUCTURED_HEADER_LEN + 8;
/// Most descriptors in one block status reply.
const MAX_EXTENTS: usize = 1 << 16;

/// A connected, blocking socket whose read and write sides can be used from different threads.
pub trait Socket: Source + Send + Sync {
    fn write_all(&self, buf: &[u8]) -> io::Result<()>;
    /// Writes all of `bufs` (one syscall for all of them when the socket takes them).
    fn write_all_vectored(&self, bufs: &mut [IoSlice<'_>]) -> io::Result<()>;
}

macro_rules! socket_impl {
    ($t:ty) => {
        impl Source for $t {
            fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
                Read::read(&mut &*self, buf)
            }
        }
        impl Socket for $t {
            fn write_all(&self, buf: &[u8]) -> io::Result<()> {
                Write::write_all(&mut &*self, buf)
            }
            fn write_all_vectored(&self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
                while !bufs.is_empty() {
                    match Write::write_vectored(&mut &*self, bufs) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
        }
    };
}
socket_impl!(std::os::unix::net::UnixStream);
socket_impl!(std::net::TcpStream);

/// The NBD error for an engine error.
pub fn nbd_errno(e: &Error) -> u32 {
    match e.kind() {
        ErrorKind::NoSpace => ENOSPC,
        ErrorKind::InvalidArgument | ErrorKind::OutOfRange => EINVAL,
        ErrorKind::Closed | ErrorKind::NotFound => ESHUTDOWN,
        ErrorKind::Unsupported => ENOTSUP,
        _ => EIO,
    }
}

/// One reply, ready to write, and whether it reports an error.
struct Reply {
    bytes: Vec<u8>,
    failed: bool,
}

impl Reply {
    fn success(bytes: Vec<u8>) -> Self {
        Self { bytes, failed: false }
    }
}

/// Builds the reply of a request that failed with `error`.
fn error_reply(structured: bool, cookie: u64, error: u32, msg: &str) -> Reply {
    let bytes = if structured { structured_error(cookie, error, msg) } else { simple_reply(error, cookie).to_vec() };
    Reply { bytes, failed: true }
}

fn ok_reply(structured: bool, cookie: u64) -> Reply {
    if structured {
        Reply::success(structured_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0).to_vec())
    } else {
        Reply::success(simple_reply(0, cookie).to_vec())
    }
}

/// One connection's shared state.
struct Conn<'a, S> {
    sock: &'a S,
    session: &'a Session,
    /// The receive side. std's futex mutex, not parking_lot's: idle workers queue here, and
    /// parking_lot's spin phase yields the CPU over and over (a tenth of the server's CPU at
    /// QD32 in a profile).
    reading: std::sync::Mutex<Inbox>,
    writing: Mutex<()>,
    /// Set once the client disconnected or broke framing; workers stop taking requests.
    done: AtomicBool,
    /// How the connection ended (the first reader to see the end records it).
    end: Mutex<Option<io::Result<()>>>,
    waiting: AtomicUsize,
    workers: AtomicUsize,
    /// Batches being run (taken from the socket, not yet replied to).
    busy: AtomicUsize,
}

/// What the reader got from the socket.
enum Next {
    Run(Request, Vec<u8>),
    /// Handled without the engine (an oversized write, skipped and refused).
    Refused(Reply),
    End(io::Result<()>),
}

/// Serves requests until the client disconnects (or breaks framing) and every request in flight
/// has replied.
pub fn serve<S: Socket>(sock: &S, session: &Session) -> io::Result<()> {
    let conn = Conn {
        sock,
        session,
        reading: std::sync::Mutex::new(Inbox::default()),
        writing: Mutex::new(()),
        done: AtomicBool::new(false),
        end: Mutex::new(None),
        waiting: AtomicUsize::new(0),
        workers: AtomicUsize::new(1),
        busy: AtomicUsize::new(0),
    };
    std::thread::scope(|scope| worker(scope, &conn));
    conn.end.into_inner().unwrap_or(Ok(()))
}

fn worker<'s, 'a: 's, S: Socket>(scope: &'s std::thread::Scope<'s, '_>, conn: &'s Conn<'a, S>) {
    // The read lock, when this worker kept it through a request it ran itself (see `alone`).
    let mut kept = None;
    loop {
        let mut inbox = kept.take().unwrap_or_else(|| {
            conn.waiting.fetch_add(1, Ordering::SeqCst);
            let inbox = conn.reading.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            conn.waiting.fetch_sub(1, Ordering::SeqCst);
            inbox
        });
        if conn.done.load(Ordering::SeqCst) {
            return;
        }
        let (req, payload) = match next(&mut inbox, conn.sock, conn.session) {
            Next::Run(req, payload) => (req, payload),
            Next::Refused(reply) => {
                drop(inbox);
                conn.send(vec![reply]);
                continue;
            }
            Next::End(r) => {
                conn.done.store(true, Ordering::SeqCst);
                *conn.end.lock() = Some(r);
                return;
            }
        };
        // Requests already in the buffer behind this one run with it (see `batchable`).
        let mut batch = vec![(req, payload)];
        while batchable(&req) && batch.len() < MAX_BATCH {
            match inbox.next_buffered(batchable) {
                Some(next) => batch.push(next),
                None => break,
            }
        }
        // A client at queue depth 1: nothing else in flight or buffered, and a request that is
        // quick to serve (a read, or a write while the cleaner is not pacing writes). This
        // worker keeps the read lock through it, so the request costs no wake-up of another
        // worker (who would only block in `recv` for the next one); one sent meanwhile waits at
        // most this request's service time.
        let alone = batch.len() == 1
            && batchable(&req)
            && inbox.is_empty()
            && conn.busy.load(Ordering::SeqCst) == 0
            && (req.kind == CMD_READ || !conn.session.export.volume.writes_may_wait());
        if !alone && conn.waiting.load(Ordering::SeqCst) == 0 && conn.workers.load(Ordering::SeqCst) < MAX_WORKERS {
            conn.workers.fetch_add(1, Ordering::SeqCst);
            let spawned = std::thread::Builder::new().name("nbd-worker".into()).spawn_scoped(scope, move || {
                worker(scope, conn);
            });
            match spawned {
                Ok(_) => {
                    conn.session.export.metrics.workers_started.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    conn.workers.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!(error = %e, "cannot start another NBD worker thread; serving with fewer");
                }
            }
        }
        conn.busy.fetch_add(1, Ordering::SeqCst);
        if alone {
            kept = Some(inbox);
        } else {
            drop(inbox);
        }
        let start = std::time::Instant::now();
        let replies = run(conn.session, batch);
        let took = start.elapsed();
        for (req, reply) in &replies {
            record(conn.session, req, reply, took);
        }
        conn.send(replies.into_iter().map(|(_, reply)| reply).collect());
        conn.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether a request may run in a batch with others found in the socket buffer: reads (up to
/// [`MAX_BATCHED_READ`]), and writes of up to 128 KiB without FUA, which the engine acknowledges
/// once they are in memory, so they hold up the reads behind them for no more than a copy.
fn batchable(r: &Request) -> bool {
    match r.kind {
        CMD_READ => r.length <= MAX_BATCHED_READ,
        CMD_WRITE => r.length <= MAX_BATCHED_WRITE && r.flags & CMD_FLAG_FUA == 0,
        _ => false,
    }
}

/// Runs a batch: writes first, in order (so a read sees a write sent before it), then all the
/// reads in one engine call (one lookup, one media submission). One reply per request.
fn run(s: &Session, batch: Vec<(Request, Vec<u8>)>) -> Vec<(Request, Reply)> {
    let (reads, others): (Vec<_>, Vec<_>) = batch.into_iter().partition(|(r, _)| r.kind == CMD_READ);
    let mut out: Vec<(Request, Reply)> = others.into_iter().map(|(r, payload)| (r, handle(s, r, payload))).collect();
    let reads: Vec<Request> = reads.into_iter().map(|(r, _)| r).collect();
    if !reads.is_empty() {
        out.extend(reads.iter().copied().zip(self::reads(s, &reads)));
    }
    out
}

impl<S: Socket> Conn<'_, S> {
    fn send(&self, replies: Vec<Reply>) {
        let _w = self.writing.lock();
        let sent = match replies.as_slice() {
            [one] => self.sock.write_all(&one.bytes),
            many => self.sock.write_all_vectored(&mut many.iter().map(|r| IoSlice::new(&r.bytes)).collect::<Vec<_>>()),
        };
        if let Err(e) = sent {
            // The client is gone; the reader will see it too.
            tracing::debug!(error = %e, "writing an NBD reply failed");
        }
    }
}

/// Reads the next request (and its payload) from the socket.
fn next<S: Socket>(inbox: &mut Inbox, sock: &S, session: &Session) -> Next {
    let mut h = [0u8; REQUEST_LEN];
    match inbox.read_exact(sock, &mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Next::End(Ok(())),
        Err(e) => return Next::End(Err(e)),
    }
    let req = match Request::decode(&h) {
        Ok(r) => r,
        Err(DecodeError::BadMagic(m)) => {
            return Next::End(Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {m:#x}"))));
        }
    };
    if req.kind == CMD_DISC {
        return Next::End(Ok(()));
    }
    if req.kind != CMD_WRITE {
        return Next::Run(req, Vec::new());
    }
    if req.length > MAX_REQUEST {
        // Too big to hold: skip the payload so framing survives, and refuse.
        let mut left = u64::from(req.length);
        let mut sink = vec![0u8; 64 << 10];
        while left > 0 {
            let n = usize::try_from(left.min(sink.len() as u64)).expect("bounded");
            if let Err(e) = inbox.read_exact(sock, &mut sink[..n]) {
                return Next::End(Err(e));
            }
            left -= n as u64;
        }
        return Next::Refused(error_reply(session.structured, req.cookie, EOVERFLOW, "write larger than 32 MiB"));
    }
    let mut payload = vec![0u8; req.length as usize];
    match inbox.read_exact(sock, &mut payload) {
        Ok(()) => Next::Run(req, payload),
        Err(e) => Next::End(Err(e)),
    }
}

/// Counts a finished request in its export's metrics.
fn record(s: &Session, req: &Request, reply: &Reply, took: std::time::Duration) {
    let m = &s.export.metrics;
    if reply.failed {
        m.errors.fetch_add(1, Ordering::Relaxed);
        return;
    }
    match req.kind {
        CMD_READ => {
            m.read_bytes.fetch_add(u64::from(req.length), Ordering::Relaxed);
            m.read_latency.observe(took);
        }
        CMD_WRITE => {
            m.write_bytes.fetch_add(u64::from(req.length), Ordering::Relaxed);
            m.write_latency.observe(took);
        }
        _ => {
            m.other_ops.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Checks `offset + length` against the export size.
fn in_range(vol: &Volume, req: &Request) -> Result<bool, Error> {
    let size = vol.size()?;
    Ok(req.offset.checked_add(u64::from(req.length)).is_some_and(|end| end <= size))
}

/// Runs one request other than a read (reads go through [`reads`]) on the engine (blocking)
/// and builds its reply.
fn handle(s: &Session, req: Request, payload: Vec<u8>) -> Reply {
    let st = s.structured;
    let vol = &s.export.volume;
    let err = |e: u32, msg: &str| error_reply(st, req.cookie, e, msg);
    let engine_err = |e: Error| error_reply(st, req.cookie, nbd_errno(&e), &e.to_string());
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && s.export.read_only {
        return err(EPERM, "export is read-only");
    }
    // Reads are checked by the engine (OutOfRange is EINVAL too), in the lookup they need anyway.
    let ranged = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES | CMD_CACHE | CMD_BLOCK_STATUS);
    if ranged {
        match in_range(vol, &req) {
            Ok(true) => {}
            Ok(false) if matches!(req.kind, CMD_WRITE | CMD_WRITE_ZEROES) => {
                return err(ENOSPC, "request reaches past the end of the export");
            }
            Ok(false) => return err(EINVAL, "request reaches past the end of the export"),
            Err(e) => return engine_err(e),
        }
    }
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let done = |r: Result<(), Error>| r.map_or_else(engine_err, |()| ok_reply(st, req.cookie));
    match req.kind {
        CMD_WRITE => done(vol.write_vec(req.offset, payload, fua)),
        CMD_FLUSH => done(vol.flush()),
        CMD_TRIM => {
            done(vol.trim(req.offset, u64::from(req.length)).and_then(|()| if fua { vol.flush() } else { Ok(()) }))
        }
        CMD_WRITE_ZEROES => {
            if req.flags & CMD_FLAG_NO_HOLE != 0 {
                done(write_real_zeroes(vol, req.offset, u64::from(req.length), fua))
            } else {
                // Unmapping is always fast, so FAST_ZERO needs nothing special.
                done(vol.write_zeroes(req.offset, u64::from(req.length), fua))
            }
        }
        CMD_CACHE => ok_reply(st, req.cookie),
        CMD_BLOCK_STATUS => block_status(s, req),
        _ => err(EINVAL, "unknown command"),
    }
}

fn write_real_zeroes(vol: &Volume, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
    let zeros = vec![0u8; usize::try_from(len.min(4 << 20)).expect("bounded")];
    let mut at = offset;
    while at < offset + len {
        let n = (offset + len - at).min(zeros.len() as u64);
        vol.write(at, &zeros[..usize::try_from(n).expect("bounded")])?;
        at += n;
    }
    if fua { vol.flush() } else { Ok(()) }
}

/// Runs reads together: one engine call resolves them all and reads their blocks as one batch.
/// Each reply's data is read in place, behind the room for its header: a simple reply's, or
/// one data chunk's (all most structured reads need).
fn reads(s: &Session, reqs: &[Request]) -> Vec<Reply> {
    let st = s.structured;
    let at = if st { DATA_AT } else { SIMPLE_REPLY_LEN };
    let mut outs: Vec<Option<Vec<u8>>> =
        reqs.iter().map(|r| (r.length <= MAX_REQUEST).then(|| vec![0u8; at + r.length as usize])).collect();
    let mut parts: Vec<(u64, &mut [u8])> =
        reqs.iter().zip(&mut outs).filter_map(|(r, out)| Some((r.offset, &mut out.as_mut()?[at..]))).collect();
    let mut results = s.export.volume.read_sparse_many(&mut parts).into_iter();
    reqs.iter()
        .zip(outs)
        .map(|(req, out)| match out {
            None => error_reply(st, req.cookie, if st { EOVERFLOW } else { EINVAL }, "read larger than 32 MiB"),
            Some(out) => match results.next().expect("one result per part") {
                Ok(runs) => read_reply(st, req, out, &runs),
                Err(e) => error_reply(st, req.cookie, nbd_errno(&e), &e.to_string()),
            },
        })
        .collect()
}

/// The reply to a read whose data is in `out` behind the header room; `runs` is its
/// allocation: holes go out as OFFSET_HOLE chunks, unless the client asked for one data chunk
/// (DF).
fn read_reply(st: bool, req: &Request, mut out: Vec<u8>, runs: &[(u64, bool)]) -> Reply {
    if !st {
        out[..SIMPLE_REPLY_LEN].copy_from_slice(&simple_reply(0, req.cookie));
        return Reply::success(out);
    }
    if req.flags & CMD_FLAG_DF != 0 || req.length == 0 || matches!(runs, [(_, true)]) {
        out[..STRUCTURED_HEADER_LEN].copy_from_slice(&structured_header(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            req.cookie,
            8 + req.length,
        ));
        out[STRUCTURED_HEADER_LEN..DATA_AT].copy_from_slice(&req.offset.to_be_bytes());
        return Reply::success(out);
    }
    let data = &out[DATA_AT..];
    let mut chunks = Vec::with_capacity(data.len() + 32 * runs.len());
    let mut at = 0usize;
    for (i, &(n, mapped)) in runs.iter().enumerate() {
        let flags = if i + 1 == runs.len() { REPLY_FLAG_DONE } else { 0 };
        let n32 = u32::try_from(n).expect("within a 32 MiB read");
        let offset = req.offset + at as u64;
        if mapped {
            chunks.extend_from_slice(&structured_header(flags, REPLY_TYPE_OFFSET_DATA, req.cookie, 8 + n32));
            chunks.extend_from_slice(&offset.to_be_bytes());
            chunks.extend_from_slice(&data[at..at + n32 as usize]);
        } else {
            chunks.extend_from_slice(&structured_header(flags, REPLY_TYPE_OFFSET_HOLE, req.cookie, 12));
            chunks.extend_from_slice(&offset.to_be_bytes());
            chunks.extend_from_slice(&n32.to_be_bytes());
        }
        at += n32 as usize;
    }
    Reply::success(chunks)
}

fn block_status(s: &Session, req: Request) -> Reply {
    let st = s.structured;
    if !st || !s.base_allocation {
        return error_reply(st, req.cookie, EINVAL, "no metadata context negotiated");
    }
    if req.length == 0 {
        return error_reply(st, req.cookie, EINVAL, "zero-length block status");
    }
    let runs = match s.export.volume.allocation(req.offset, u64::from(req.length)) {
        Ok(r) => r,
        Err(e) => return error_reply(true, req.cookie, nbd_errno(&e), &e.to_string()),
    };
    let limit = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
    let mut body = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
    for &(n, mapped) in runs.iter().take(limit) {
        let flags = if mapped { 0 } else { STATE_HOLE | STATE_ZERO };
        body.extend_from_slice(&u32::try_from(n).expect("request length is a u32").to_be_bytes());
        body.extend_from_slice(&flags.to_be_bytes());
    }
    let len = u32::try_from(body.len()).expect("bounded by MAX_EXTENTS");
    let mut out = structured_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, req.cookie, len).to_vec();
    out.extend_from_slice(&body);
    Reply::success(out)
}
