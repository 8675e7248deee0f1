//! Reads in two halves, so that a caller with an event loop of its own can read the store on its
//! own io_uring and sleep once for the store and its socket together.
//!
//! ```text
//!  Volume::start_reads: resolve every range (state lock), pin the segments it maps to, and
//!      gather the blocks memory holds (readahead windows, the unwritten log tail)  -> Reads
//!  the store reads left: Reads::read_media, or on the caller's own ring (io::AsyncIo):
//!      Reads::submit (with a poll for each readahead window still being read), then
//!      Reads::complete for each completion
//!  Reads::finish: check every block's crc32c, copy it into the caller's buffer, unpin
//! ```
//! [`Volume::read_sparse_many`] is the three in a row.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use crate::ctx::Ctx;
use crate::error::Result;
use crate::io::{AlignedBuf, AsyncIo, BLOCK, Backend};
use crate::map::segments::Pinned;
use crate::read::readahead::{self, Hit, Readahead};
use crate::read::resolve::{Resolved, fill, media_error, media_runs, pba_runs};
use crate::write::queue::Log;
use crate::write::tail::{self, Tail};

/// The media blocks of a read, in order: one buffer, or, when some came from readahead, each
/// block where it is (a window's buffer, or the buffer the rest were read into), uncopied.
pub(crate) enum Media {
    Whole(AlignedBuf),
    Blocks(Vec<(Arc<AlignedBuf>, usize)>),
}

impl Media {
    /// Block `slot` of the read.
    pub fn block(&self, slot: usize) -> &[u8] {
        match self {
            Media::Whole(b) => &b[slot * BLOCK..(slot + 1) * BLOCK],
            Media::Blocks(v) => {
                let (b, at) = &v[slot];
                &b[*at..*at + BLOCK]
            }
        }
    }
}

/// The media blocks of a read being gathered: those a readahead window holds are referenced,
/// the rest go into `buf` in order (copied from the log tail now, or read from the store by
/// `todo`).
pub(crate) struct Gather {
    /// Per block, when some were read ahead: the window's, or None for the next slot of `buf`.
    /// Empty when none were: all are in `buf`.
    pub hits: Vec<Option<Hit>>,
    pub buf: AlignedBuf,
    /// Store reads still to do: (pool block, blocks, first slot in `buf`), slots ascending.
    pub todo: Vec<(u64, u64, usize)>,
}

impl Gather {
    pub fn read(&mut self, backend: &dyn Backend) -> io::Result<()> {
        crate::io::read_into(backend, &mut self.buf, &self.todo)
    }

    /// The blocks, once the store reads are done: waits for the windows still being read, and
    /// reads the blocks of a window that failed here (from the log tail or the store).
    pub fn into_media(self, ctx: &Ctx, tail: &Tail) -> io::Result<Media> {
        if self.hits.is_empty() {
            return Ok(Media::Whole(self.buf));
        }
        let buf = Arc::new(self.buf);
        let mut next = 0;
        let mut failed: Vec<(usize, u64)> = Vec::new();
        let mut blocks = Vec::with_capacity(self.hits.len());
        for hit in self.hits {
            let block = match hit.map(Hit::wait) {
                None => {
                    next += BLOCK;
                    (Arc::clone(&buf), next - BLOCK)
                }
                Some(Ok(block)) => block,
                Some(Err(pba)) => {
                    failed.push((blocks.len(), pba));
                    (Arc::clone(&buf), 0) // replaced below
                }
            };
            blocks.push(block);
        }
        if !failed.is_empty() {
            let again = Arc::new(tail::read_runs(ctx, tail, &pba_runs(failed.iter().map(|f| f.1)))?);
            for (k, &(i, _)) in failed.iter().enumerate() {
                blocks[i] = (Arc::clone(&again), k * BLOCK);
            }
        }
        Ok(Media::Blocks(blocks))
    }
}

/// A store read started on a caller's [`AsyncIo`]: where its bytes go in the gather buffer.
#[derive(Debug, Clone, Copy)]
struct Started {
    at: usize,
    len: usize,
    offset: u64,
    user_data: u64,
}

/// Reads started by [`Volume::start_reads`]: resolved, their segments pinned, the blocks memory
/// holds gathered. What is left is reading the store ([`Reads::read_media`], or
/// [`Reads::submit`] on the caller's own I/O and [`Reads::complete`] as reads finish), then
/// [`Reads::finish`].
pub struct Reads<'v> {
    /// The volume's (or snapshot's) name, for errors.
    name: &'v str,
    ctx: Arc<Ctx>,
    /// The log, whose tail holds blocks not yet in the store.
    log: Arc<Log>,
    /// Segments pinned against reuse until the store reads are done.
    pinned: Vec<usize>,
    /// (offset, length) of each range.
    parts: Vec<(u64, usize)>,
    resolved: Vec<Result<Vec<Resolved>>>,
    /// Taken by [`Reads::finish`].
    gather: Option<Gather>,
    /// Reads on the caller's I/O: the gather buffer's start (computed once, so no reference to
    /// it is made while the kernel writes into it), each read, how many are left, the first error.
    base: *mut u8,
    started: Vec<Started>,
    left: usize,
    err: Option<io::Error>,
}

impl std::fmt::Debug for Reads<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reads").field("volume", &self.name).field("parts", &self.parts).finish_non_exhaustive()
    }
}

impl<'v> Reads<'v> {
    /// Gathers what `ra` and the log's `tail` hold of the `resolved` ranges' blocks.
    pub(crate) fn new(
        name: &'v str,
        ctx: Arc<Ctx>,
        (ra, log): (&Readahead, &Arc<Log>),
        parts: &[(u64, usize)],
        resolved: Vec<Result<Vec<Resolved>>>,
        pinned: Vec<usize>,
    ) -> Self {
        let runs = media_runs(resolved.iter().flatten().flatten());
        let gather = readahead::gather(ra, &log.tail, &runs);
        Self {
            name,
            ctx,
            log: Arc::clone(log),
            pinned,
            parts: parts.to_vec(),
            resolved,
            gather: Some(gather),
            base: std::ptr::null_mut(),
            started: Vec::new(),
            left: 0,
            err: None,
        }
    }

    /// Starts the store reads on `io`, and a wait for each readahead window still being read,
    /// operation `i` tagged `user_data(i)`; returns how many were started (0: memory held every
    /// block, finish now), or None when the store is not a file (then use
    /// [`Reads::read_media`]). The buffers belong to this `Reads` and stay where they are (moving
    /// it does not move them): keep it until every operation was [`Reads::complete`]d.
    pub fn submit(&mut self, io: &mut dyn AsyncIo, user_data: impl Fn(usize) -> u64) -> Option<usize> {
        let fd = self.ctx.backend.raw_fd()?;
        let g = self.gather.as_mut().expect("not finished");
        self.base = g.buf.as_mut_ptr();
        self.started = g
            .todo
            .iter()
            .enumerate()
            .map(|(i, &(pba, n, slot))| Started {
                at: slot * BLOCK,
                len: usize::try_from(n).expect("a read fits memory") * BLOCK,
                offset: pba * BLOCK as u64,
                user_data: user_data(i),
            })
            .collect();
        for s in &self.started {
            io.read_at(fd, self.base.wrapping_add(s.at), s.len, s.offset, s.user_data);
        }
        let mut windows: Vec<RawFd> = g.hits.iter().flatten().filter_map(Hit::pending_fd).collect();
        windows.sort_unstable();
        windows.dedup();
        for (k, &w) in windows.iter().enumerate() {
            io.poll_readable(w, user_data(self.started.len() + k));
        }
        self.left = self.started.len() + windows.len();
        Some(self.left)
    }

    /// Operation `i` (of [`Reads::submit`]) completed with `res`. A short store read is started
    /// again on `io` for the rest; a window's wait needs nothing more (its blocks are taken
    /// when the reads are finished). Once the last is done, returns how the store reads went,
    /// for [`Reads::finish`].
    pub fn complete(&mut self, io: &mut dyn AsyncIo, i: usize, res: i32) -> Option<io::Result<()>> {
        if let Some(s) = self.started.get_mut(i) {
            match usize::try_from(res) {
                Err(_) => {
                    self.err.get_or_insert(io::Error::from_raw_os_error(-res));
                }
                Ok(0) => {
                    self.err.get_or_insert(io::Error::new(io::ErrorKind::UnexpectedEof, "short read from the store"));
                }
                Ok(n) if n < s.len => {
                    (s.at, s.len, s.offset) = (s.at + n, s.len - n, s.offset + n as u64);
                    let fd = self.ctx.backend.raw_fd().expect("submitted reads are from a file");
                    io.read_at(fd, self.base.wrapping_add(s.at), s.len, s.offset, s.user_data);
                    return None;
                }
                Ok(_) => {}
            }
        }
        self.left -= 1;
        (self.left == 0).then(|| self.err.take().map_or(Ok(()), Err))
    }

    /// Does the store reads here, all in flight at once.
    pub fn read_media(&mut self) -> io::Result<()> {
        self.gather.as_mut().expect("not finished").read(self.ctx.backend.as_ref())
    }

    /// Completes the reads once the store reads are done (`media` says how they went): copies
    /// each range into its buffer in `bufs` (as long as the range), checking every block's
    /// checksum. Each range gets its own outcome, with its allocation as
    /// [`Volume::read_sparse`] returns it; a store read error fails every range that had blocks
    /// to read.
    pub fn finish(mut self, media: io::Result<()>, bufs: &mut [&mut [u8]]) -> Vec<Result<Vec<(u64, bool)>>> {
        assert_eq!(bufs.len(), self.parts.len(), "one buffer per range");
        let gather = self.gather.take().expect("finished once");
        let media = media.and_then(|()| gather.into_media(&self.ctx, &self.log.tail));
        self.unpin();
        let resolved = std::mem::take(&mut self.resolved);
        // Each range's media blocks follow the previous range's; `next` counts blocks.
        let mut next = 0;
        self.parts
            .iter()
            .zip(resolved)
            .zip(bufs)
            .map(|((&(offset, len), blocks), buf)| {
                assert_eq!(buf.len(), len, "a buffer as long as its range");
                let blocks = blocks?;
                let at = next;
                next += blocks.iter().flatten().count();
                let media = match &media {
                    Ok(m) => Some(m),
                    Err(e) if at < next => return Err(media_error(self.name, offset, len, e)),
                    Err(_) => None,
                };
                let mut alloc = Vec::new();
                fill(self.name, offset, buf, &blocks, media.map(|m| (m, at)), &mut alloc).inspect_err(|e| {
                    if e.kind() == crate::ErrorKind::Corrupt {
                        self.ctx.checksum_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                })?;
                Ok(alloc)
            })
            .collect()
    }

    fn unpin(&mut self) {
        drop(Pinned::adopt(&self.ctx.pins, std::mem::take(&mut self.pinned)));
    }
}

impl Drop for Reads<'_> {
    fn drop(&mut self) {
        self.unpin();
    }
}
