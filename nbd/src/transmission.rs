//! The transmission phase: what each request does and how it is answered. The connection's
//! event loop (`event_loop.rs`) receives the requests and decides where each runs.
//!
//! Replies go out in whatever order requests finish. A request the protocol lets us refuse gets
//! an error reply and the connection goes on; one that breaks framing (bad magic) ends the
//! connection once the requests in flight have replied. A client that disconnects in the middle
//! of a write payload changes nothing: a write reaches the engine only with its whole payload.

use std::sync::atomic::Ordering;

use ferrite_engine::{Error, ErrorKind, Volume};

use crate::handshake::{BASE_ALLOCATION_ID, CHANGED_ID, DEPTH_ID, Session};
use crate::proto::*;

/// Where a structured read reply's data starts: behind one data chunk's header and offset.
pub(crate) const DATA_AT: usize = STRUCTURED_HEADER_LEN + 8;
/// Most descriptors in one block status reply.
const MAX_EXTENTS: usize = 1 << 16;

/// The NBD error for an engine error.
pub fn nbd_errno(e: &Error) -> u32 {
    match e.kind() {
        ErrorKind::NoSpace => ENOSPC,
        ErrorKind::InvalidArgument | ErrorKind::OutOfRange => EINVAL,
        ErrorKind::Closed | ErrorKind::NotFound => ESHUTDOWN,
        ErrorKind::Unsupported => ENOTSUP,
        ErrorKind::ReadOnly | ErrorKind::Locked => EPERM,
        _ => EIO,
    }
}

/// One reply, ready to write, and whether it reports an error.
pub(crate) struct Reply {
    pub bytes: Vec<u8>,
    pub failed: bool,
}

impl Reply {
    fn success(bytes: Vec<u8>) -> Self {
        Self { bytes, failed: false }
    }
}

/// Builds the reply of a request that failed with `error`.
pub(crate) fn error_reply(structured: bool, cookie: u64, error: u32, msg: &str) -> Reply {
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

/// Counts a finished request in its export's metrics.
pub(crate) fn record(s: &Session, req: &Request, reply: &Reply, took: std::time::Duration) {
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

/// Runs one request other than a read (reads go through `event_loop.rs`) on the engine
/// (blocking) and builds its reply.
pub(crate) fn handle(s: &Session, req: Request, payload: &[u8]) -> Reply {
    let st = s.structured;
    let vol = &s.export.volume;
    let err = |e: u32, msg: &str| error_reply(st, req.cookie, e, msg);
    let engine_err = |e: Error| error_reply(st, req.cookie, nbd_errno(&e), &e.to_string());
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && s.export.is_read_only() {
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
        CMD_WRITE => done(if fua { vol.write_fua(req.offset, payload) } else { vol.write(req.offset, payload) }),
        CMD_FLUSH => done(vol.flush()),
        CMD_TRIM => {
            done(vol.trim(req.offset, u64::from(req.length)).and_then(|()| if fua { vol.flush() } else { Ok(()) }))
        }
        CMD_WRITE_ZEROES => {
            if req.flags & CMD_FLAG_NO_HOLE != 0 {
                done(vol.write_zero_data(req.offset, u64::from(req.length), fua))
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

/// How [`start_write`] went.
pub(crate) enum Started {
    /// The finish gets the reply later.
    Later,
    /// The request failed its checks: its reply.
    Now(Reply),
    /// It cannot start without waiting: run it with [`handle`] where it may block.
    Blocking,
}

/// Starts a small write (not FUA) of a volume with synchronous replicas whose members answer
/// later ([`Volume::start_write`]): `finish` gets its reply on the thread that reads their
/// answers, and no thread waits meanwhile.
pub(crate) fn start_write(
    s: &Session,
    req: Request,
    payload: &[u8],
    finish: impl FnOnce(Reply) + Send + 'static,
) -> Started {
    let (st, vol) = (s.structured, &s.export.volume);
    if s.export.is_read_only() {
        return Started::Now(error_reply(st, req.cookie, EPERM, "export is read-only"));
    }
    match in_range(vol, &req) {
        Ok(true) => {}
        Ok(false) => {
            return Started::Now(error_reply(st, req.cookie, ENOSPC, "request reaches past the end of the export"));
        }
        Err(e) => return Started::Now(error_reply(st, req.cookie, nbd_errno(&e), &e.to_string())),
    }
    let reply = move |r: Result<(), Error>| {
        finish(r.map_or_else(
            |e| error_reply(st, req.cookie, nbd_errno(&e), &e.to_string()),
            |()| ok_reply(st, req.cookie),
        ));
    };
    match vol.start_write(req.offset, payload, Box::new(reply)) {
        Ok(()) => Started::Later,
        Err(_) => Started::Blocking,
    }
}

/// The reply to a read whose data is in `out` behind the header room; `runs` is its
/// allocation: holes go out as OFFSET_HOLE chunks, unless the client asked for one data chunk
/// (DF).
pub(crate) fn read_reply(st: bool, req: &Request, mut out: Vec<u8>, runs: &[(u64, bool)]) -> Reply {
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
    if !st || (!s.base_allocation && s.changed.is_none() && !s.depth) {
        return error_reply(st, req.cookie, EINVAL, "no metadata context negotiated");
    }
    if req.length == 0 {
        return error_reply(st, req.cookie, EINVAL, "zero-length block status");
    }
    let (offset, len) = (req.offset, u64::from(req.length));
    // One chunk per selected context, each a run of (length, flags).
    let mut contexts: Vec<(u32, Vec<(u64, u32)>)> = Vec::with_capacity(2);
    if s.base_allocation {
        match s.export.volume.allocation(offset, len) {
            Ok(runs) => contexts.push((
                BASE_ALLOCATION_ID,
                runs.into_iter().map(|(n, mapped)| (n, if mapped { 0 } else { STATE_HOLE | STATE_ZERO })).collect(),
            )),
            Err(e) => return error_reply(true, req.cookie, nbd_errno(&e), &e.to_string()),
        }
    }
    if s.depth {
        match s.export.volume.allocation_depth(offset, len) {
            Ok(runs) => contexts.push((DEPTH_ID, runs)),
            Err(e) => return error_reply(true, req.cookie, nbd_errno(&e), &e.to_string()),
        }
    }
    if let Some(snap) = &s.changed {
        match s.export.volume.changed(snap, offset, len) {
            Ok(runs) => contexts.push((
                CHANGED_ID,
                runs.into_iter().map(|(n, changed)| (n, if changed { STATE_CHANGED } else { 0 })).collect(),
            )),
            Err(e) => return error_reply(true, req.cookie, nbd_errno(&e), &e.to_string()),
        }
    }
    let limit = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
    let last = contexts.len() - 1;
    let mut out = Vec::new();
    for (i, (id, runs)) in contexts.into_iter().enumerate() {
        let mut body = id.to_be_bytes().to_vec();
        for (n, flags) in runs.into_iter().take(limit) {
            body.extend_from_slice(&u32::try_from(n).expect("request length is a u32").to_be_bytes());
            body.extend_from_slice(&flags.to_be_bytes());
        }
        let len = u32::try_from(body.len()).expect("bounded by MAX_EXTENTS");
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        out.extend_from_slice(&structured_header(flags, REPLY_TYPE_BLOCK_STATUS, req.cookie, len));
        out.extend_from_slice(&body);
    }
    Reply::success(out)
}
