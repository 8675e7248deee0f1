//! The io_uring backend: O_DIRECT reads and writes submitted through rings.
//!
//! Each call borrows a ring from a small pool (a thread that calls again gets one back without
//! allocating), pushes its operations, and reaps every completion before returning. The buffers
//! are borrowed by the call, and the call does not return while the kernel may still touch them:
//! that is the invariant the `unsafe` pushes below rely on. Many threads calling at once keep many
//! requests in flight; `read_many` keeps a whole batch in flight from one thread, and a large
//! write goes as pieces in flight together.

use std::io;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::Mutex;

use super::file::BackingFile;
use super::{Backend, ReadOp, check_request};

const RING_ENTRIES: u32 = 64;

/// A large write goes to the device as pieces of this size, all in flight at once: a log batch
/// (up to a few MiB) then uses the device's parallelism instead of one request at a time.
const WRITE_PIECE: usize = 256 << 10;

/// io_uring backend over a file or block device.
pub struct UringBackend {
    file: BackingFile,
    rings: Mutex<Vec<IoUring>>,
}

impl std::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBackend").field("file", &self.file).finish_non_exhaustive()
    }
}

impl UringBackend {
    /// Opens an existing file or device; fails if io_uring is unavailable (callers fall back).
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = BackingFile::open(path)?;
        let ring = IoUring::new(RING_ENTRIES)?;
        Ok(Self { file, rings: Mutex::new(vec![ring]) })
    }

    /// True if O_DIRECT is in effect.
    pub fn is_direct(&self) -> bool {
        self.file.direct
    }

    fn with_ring<T>(&self, f: impl FnOnce(&mut IoUring) -> io::Result<T>) -> io::Result<T> {
        let pooled = self.rings.lock().pop();
        let mut ring = match pooled {
            Some(r) => r,
            None => IoUring::new(RING_ENTRIES)?,
        };
        let out = f(&mut ring);
        self.rings.lock().push(ring);
        out
    }

    /// Runs `spans` (pointer, length, offset) and then whatever `more` yields to completion,
    /// resubmitting short transfers. A span from `more` is submitted as soon as it is yielded,
    /// before `more` is asked for the next; completions are waited for once `more` is done (or
    /// the ring is full).
    fn run(
        &self,
        ring: &mut IoUring,
        spans: &mut Vec<Span>,
        more: &mut dyn FnMut() -> Option<Span>,
        write: bool,
    ) -> io::Result<()> {
        let fd = types::Fd(self.file.file.as_raw_fd());
        let build = |i: usize, (ptr, len, off): Span| -> squeue::Entry {
            let len32 = u32::try_from(len).expect("backend requests are below 4 GiB");
            let e = if write {
                opcode::Write::new(fd, ptr.cast_const(), len32).offset(off).build()
            } else {
                opcode::Read::new(fd, ptr, len32).offset(off).build()
            };
            e.user_data(i as u64)
        };
        let mut next = 0;
        let mut more_done = false;
        let mut in_flight = 0usize;
        let mut first_err: Option<io::Error> = None;
        let mut retry: Vec<usize> = Vec::new();
        loop {
            // Queue as much as fits: retries first, then known operations, then new ones from
            // `more` (unless failing).
            loop {
                let mut fresh = false;
                let idx = if let Some(i) = retry.pop() {
                    i
                } else if next < spans.len() && first_err.is_none() {
                    next += 1;
                    next - 1
                } else if !more_done && first_err.is_none() {
                    match more() {
                        Some(span) => {
                            spans.push(span);
                            next = spans.len();
                            fresh = true;
                            next - 1
                        }
                        None => {
                            more_done = true;
                            break;
                        }
                    }
                } else {
                    break;
                };
                let entry = build(idx, spans[idx]);
                // SAFETY: the buffer behind spans[idx] is borrowed for this whole call (the
                // caller's slices outlive it), and the loop below does not return before every
                // pushed entry's completion is reaped, so the kernel never touches it after the
                // borrow ends.
                if unsafe { ring.submission().push(&entry) }.is_err() {
                    // Queue full: put it back and submit what we have.
                    if idx + 1 == next {
                        next -= 1;
                    } else {
                        retry.push(idx);
                    }
                    break;
                }
                in_flight += 1;
                if fresh {
                    // Start it now, while the caller prepares the next one. A failure here
                    // leaves it queued for the submit below.
                    let _ = ring.submit();
                }
            }
            if in_flight == 0 {
                // Nothing queued: all done, or failing with nothing left in flight.
                break;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                // Operations in flight still own their buffers: never return before they are
                // reaped. Transient errors (EINTR, EAGAIN, EBUSY) clear on retry.
                if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) {
                    tracing::warn!(error = %e, in_flight, "io_uring_enter failed; retrying until in-flight I/O completes");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                continue;
            }
            for cqe in ring.completion() {
                in_flight -= 1;
                let idx = usize::try_from(cqe.user_data()).expect("index fits usize");
                let res = cqe.result();
                if res < 0 {
                    first_err.get_or_insert(io::Error::from_raw_os_error(-res));
                    continue;
                }
                let done = usize::try_from(res).expect("non-negative");
                let (ptr, len, off) = spans[idx];
                if done == 0 && len > 0 {
                    first_err.get_or_insert(io::Error::new(io::ErrorKind::UnexpectedEof, "short transfer"));
                } else if done < len {
                    // SAFETY: done < len, so the advanced pointer stays inside the same buffer.
                    spans[idx] = (unsafe { ptr.add(done) }, len - done, off + done as u64);
                    if first_err.is_none() {
                        retry.push(idx);
                    }
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// One operation: (pointer, length, offset).
type Span = (*mut u8, usize, u64);

/// Spans of at most [`WRITE_PIECE`] bytes for a write of `buf` at `offset`.
fn write_spans(buf: &[u8], offset: u64) -> impl Iterator<Item = Span> + '_ {
    // The kernel only reads through these pointers for a write.
    buf.chunks(WRITE_PIECE)
        .enumerate()
        .map(move |(i, piece)| (piece.as_ptr().cast_mut(), piece.len(), offset + (i * WRITE_PIECE) as u64))
}

impl Backend for UringBackend {
    fn len(&self) -> u64 {
        self.file.len
    }

    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.file.file.as_raw_fd())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_many(&mut [ReadOp { offset, buf }])
    }

    fn read_many(&self, ops: &mut [ReadOp<'_>]) -> io::Result<()> {
        let mut spans = Vec::with_capacity(ops.len());
        for op in ops.iter_mut() {
            check_request(op.buf.len(), op.offset, self.file.len, op.buf.as_ptr())?;
            spans.push((op.buf.as_mut_ptr(), op.buf.len(), op.offset));
        }
        self.with_ring(|ring| self.run(ring, &mut spans, &mut || None, false))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_request(buf.len(), offset, self.file.len, buf.as_ptr())?;
        let mut spans: Vec<Span> = write_spans(buf, offset).collect();
        self.with_ring(|ring| self.run(ring, &mut spans, &mut || None, true))
    }

    fn write_pieces(&self, pieces: &mut dyn Iterator<Item = (&[u8], u64)>) -> io::Result<()> {
        // A bad piece ends the stream; the pieces already sent still complete before we return.
        let mut bad: Option<io::Error> = None;
        let mut queued: std::collections::VecDeque<Span> = std::collections::VecDeque::new();
        let mut more = || {
            if let Some(span) = queued.pop_front() {
                return Some(span);
            }
            let (buf, offset) = pieces.next()?;
            if let Err(e) = check_request(buf.len(), offset, self.file.len, buf.as_ptr()) {
                bad = Some(e);
                return None;
            }
            queued.extend(write_spans(buf, offset));
            queued.pop_front()
        };
        let r = self.with_ring(|ring| self.run(ring, &mut Vec::new(), &mut more, true));
        match bad {
            Some(e) => Err(e),
            None => r,
        }
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync()
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.file.allocate(offset, len)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.file.discard(offset, len)
    }

    fn sparse(&self) -> bool {
        self.file.sparse
    }
}
