//! Instant restore: a volume restored from a backup serves from the start. A [`Filling`] is the
//! volume's [`ferrite_engine::Fill`]: a client request touching a chunk not restored yet
//! fetches it first (and waits for one being fetched), while [`Filling::run`] copies the rest
//! in the background, `concurrency` chunks at a time.
//!
//! Crash safety rests on one order: a chunk's data is written and flushed, then the chunk is
//! recorded as done (the caller's `save`, durable), and only then does any client request
//! touch it. So after a crash the record never claims a chunk whose data is not there, and a
//! chunk it does not claim has taken no client write yet: fetching it again (as the resumed
//! restore does) cannot undo a write a client was told is done.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferrite_engine::{Access, ErrorKind, Volume};
use futures_util::StreamExt;
use parking_lot::{Condvar, Mutex};

use crate::manifest::{ChunkRef, Manifest};
use crate::restore::{fetch_chunk, write_nonzero};
use crate::{Error, Pace, Progress, Result, Target};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Pending,
    /// A fetch of it is running (a client's or the background copy's).
    Busy,
    Done,
}

/// What a restore's record is told, to keep durably before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved<'a> {
    /// Every chunk done so far: a hex bitmap over the manifest's chunk list (`done_bitmap`).
    All(&'a str),
    /// These positions of the manifest's chunk list are done too (to append: O(1) a chunk).
    Done(&'a [usize]),
}

/// Keeps a restore's record ([`Saved`]); `All` replaces what was kept, `Done` adds to it.
pub type Save = Box<dyn Fn(Saved<'_>) -> std::io::Result<()> + Send + Sync>;

/// Most chunks one client request fetches at once (a large one goes in turns).
const ON_DEMAND: usize = 8;

/// A volume being restored while it serves.
pub struct Filling {
    target: Target,
    manifest: Manifest,
    /// Its chunk list (every segment read).
    chunks: Vec<ChunkRef>,
    /// A handle that writes past the volume's fill (and gate): the restore's own writes.
    writer: Volume,
    rt: tokio::runtime::Handle,
    pace: Arc<Pace>,
    save: Save,
    slots: Mutex<Slots>,
    changed: Condvar,
    /// Held while the record is written, one writer at a time: how many positions were added
    /// to it since it was last written whole.
    saving: Mutex<usize>,
    /// Chunks fetched because a client request needed them.
    on_demand: AtomicU64,
}

impl std::fmt::Debug for Filling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filling")
            .field("volume", &self.writer.name())
            .field("backup", &self.manifest.backup_ref())
            .finish()
    }
}

/// The chunks' states, and the count and bytes of the done ones.
struct Slots {
    state: Vec<Slot>,
    done: u64,
    done_bytes: u64,
}

/// The record of `done` (one flag per chunk of the manifest) as hex.
fn done_bitmap(done: impl Iterator<Item = bool>) -> String {
    let mut bytes = Vec::new();
    for (n, d) in done.enumerate() {
        if n % 8 == 0 {
            bytes.push(0u8);
        }
        if d {
            *bytes.last_mut().expect("pushed") |= 1 << (n % 8);
        }
    }
    crate::codec::hex(&bytes)
}

impl Filling {
    /// Restores `manifest`, whose chunk list is `chunks` ([`Manifest::chunk_list`]), from
    /// `target` into the volume `writer` writes (new or resumed: `done` is the record a previous
    /// run saved, None for a new restore). `writer` must write past
    /// the volume's fill (`Volume::past_read_only`); the runtime `rt` runs the fetches.
    /// `also_done` are positions the record added after its bitmap `done`.
    pub fn new(
        target: Target,
        manifest: Manifest,
        chunks: Vec<ChunkRef>,
        writer: Volume,
        done: Option<(&str, &[usize])>,
        save: Save,
        rt: tokio::runtime::Handle,
    ) -> Result<Arc<Self>> {
        let n = chunks.len();
        let unfit = || Error::Invalid(format!("the restore record of {:?} does not fit its backup", writer.name()));
        let mut state = vec![Slot::Pending; n];
        match done {
            None => save(Saved::All(&done_bitmap(std::iter::repeat_n(false, n))))
                .map_err(|e| Error::Invalid(format!("saving the restore record: {e}")))?,
            Some((hex, also)) => {
                let bits = crate::codec::unhex(hex).filter(|b| b.len() == n.div_ceil(8)).ok_or_else(unfit)?;
                for (i, s) in state.iter_mut().enumerate() {
                    if bits[i / 8] & (1 << (i % 8)) != 0 {
                        *s = Slot::Done;
                    }
                }
                for &p in also {
                    *state.get_mut(p).ok_or_else(unfit)? = Slot::Done;
                }
            }
        }
        let mut slots = Slots { state, done: 0, done_bytes: 0 };
        for (c, _) in chunks.iter().zip(&slots.state).filter(|(_, s)| **s == Slot::Done) {
            slots.done += 1;
            slots.done_bytes += u64::from(c.len);
        }
        let pace = Arc::new(Pace::new(target.config.bandwidth));
        Ok(Arc::new(Self {
            target,
            manifest,
            chunks,
            writer,
            rt,
            pace,
            save,
            slots: Mutex::new(slots),
            changed: Condvar::new(),
            saving: Mutex::new(0),
            on_demand: AtomicU64::new(0),
        }))
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Chunks done and in all, and how many of the done were fetched for a client request.
    pub fn counts(&self) -> (u64, u64, u64) {
        let slots = self.slots.lock();
        (slots.done, slots.state.len() as u64, self.on_demand.load(Ordering::Relaxed))
    }

    /// The positions in the manifest's chunk list of the chunks [offset, offset+len) touches.
    fn positions(&self, offset: u64, len: u64) -> std::ops::Range<usize> {
        let cs = self.manifest.chunk_size;
        let (first, end) = (offset / cs, (offset + len).div_ceil(cs));
        let chunks = &self.chunks;
        chunks.partition_point(|c| c.i < first)..chunks.partition_point(|c| c.i < end)
    }

    /// Claims the pending chunks among `positions` (marks them busy); whether any other of them
    /// is busy.
    /// `positions` are scanned only until `most` are claimed.
    fn claim(&self, positions: impl Iterator<Item = usize>, most: usize) -> (Vec<usize>, bool) {
        let mut slots = self.slots.lock();
        let (mut mine, mut busy) = (Vec::new(), false);
        for p in positions {
            match slots.state[p] {
                Slot::Pending if mine.len() < most => {
                    slots.state[p] = Slot::Busy;
                    mine.push(p);
                }
                Slot::Pending | Slot::Busy => busy = true,
                Slot::Done => {}
            }
            if mine.len() == most {
                return (mine, true);
            }
        }
        (mine, busy)
    }

    /// Gives claimed chunks back (their fetch failed).
    fn release(&self, positions: &[usize]) {
        let mut slots = self.slots.lock();
        for &p in positions {
            slots.state[p] = Slot::Pending;
        }
        self.changed.notify_all();
    }

    /// Fetches and writes the claimed chunks, flushes, records those written as done, then
    /// marks them done; releases the others. Blocking: call it off the runtime. Ok if all were
    /// done, else the first error and the positions that failed. Only the background copy is
    /// held to the target's bandwidth: a client waits for the others.
    fn restore_blocking(&self, positions: &[usize], paced: bool) -> std::result::Result<(), (Error, Vec<usize>)> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let pace = if paced { Arc::clone(&self.pace) } else { Arc::new(Pace::new(None)) };
        let chunks = positions.iter().map(|&p| (p, self.chunks[p].clone())).collect();
        let fetch = fetch_and_write(self.target.clone(), pace, self.writer.clone(), chunks, self.manifest.chunk_size);
        self.rt.spawn(async move { drop(tx.send(fetch.await)) });
        let Ok(results) = rx.recv() else {
            self.release(positions);
            let e = ferrite_engine::Error::new(ErrorKind::Closed, "the daemon is stopping");
            return Err((Error::Engine(e), positions.to_vec()));
        };
        let (written, failed): (Vec<_>, Vec<_>) = results.into_iter().partition(|(_, r)| r.is_ok());
        let written: Vec<usize> = written.into_iter().map(|(p, _)| p).collect();
        let mut first = None;
        let mut failed: Vec<usize> = failed
            .into_iter()
            .map(|(p, r)| {
                first.get_or_insert(r.expect_err("failed"));
                p
            })
            .collect();
        if let Err(e) = self.commit(&written) {
            failed.extend(&written);
            first = Some(e);
        }
        self.release(&failed);
        first.map_or(Ok(()), |e| Err((e, failed)))
    }

    /// Flushes what was written, adds `positions` to the record, then marks them done. The
    /// record is written whole only once some 1/32 of the chunks were added since it last was:
    /// O(1) a chunk in all.
    fn commit(&self, positions: &[usize]) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        self.writer.flush()?;
        let mut added = self.saving.lock();
        let n = self.chunks.len();
        let saved = if *added + positions.len() > n / 32 + 64 {
            let record = {
                let slots = self.slots.lock();
                let mut done: Vec<bool> = slots.state.iter().map(|s| *s == Slot::Done).collect();
                positions.iter().for_each(|&p| done[p] = true);
                done_bitmap(done.into_iter())
            };
            *added = 0;
            (self.save)(Saved::All(&record))
        } else {
            *added += positions.len();
            (self.save)(Saved::Done(positions))
        };
        saved.map_err(|e| Error::Invalid(format!("saving the restore record: {e}")))?;
        let mut slots = self.slots.lock();
        for &p in positions {
            slots.state[p] = Slot::Done;
            slots.done += 1;
            slots.done_bytes += u64::from(self.chunks[p].len);
        }
        self.changed.notify_all();
        Ok(())
    }

    /// Marks the pending chunks wholly inside [offset, offset+len) done without fetching them:
    /// a trim is about to discard them (their content is not needed; they read as zeros).
    fn trimmed(&self, offset: u64, len: u64) -> Result<()> {
        let cs = self.manifest.chunk_size;
        let (first, end) = (offset.div_ceil(cs), (offset + len) / cs);
        if first >= end {
            return Ok(());
        }
        let positions = self.positions(first * cs, (end - first) * cs);
        let whole = |p: &usize| {
            let c = &self.chunks[*p];
            offset <= c.i * cs && c.i * cs + u64::from(c.len) <= offset + len
        };
        // Those being fetched are left to their fetch (the trim then discards them).
        let (mine, _) = self.claim(positions.filter(whole), usize::MAX);
        self.commit(&mine).inspect_err(|_| self.release(&mine))
    }

    /// Copies every chunk not done yet, `concurrency` at a time, then returns. A store that
    /// fails is retried (backoff up to 30 s) for as long as it takes; a corrupt chunk is left
    /// out (the copy goes on with the others, then ends with its error); an engine error (the
    /// volume deleted) ends it at once.
    pub async fn run(self: &Arc<Self>, progress: &(dyn Fn(&Progress) + Sync)) -> Result<()> {
        let group = self.target.concurrency();
        let n = self.chunks.len();
        let mut backoff = Duration::from_secs(1);
        let total_bytes: u64 = self.chunks.iter().map(|c| u64::from(c.len)).sum();
        let mut corrupt = std::collections::HashSet::new();
        let mut first_corrupt = None;
        // Claims go on from where the last one stopped: one pass over the chunks, then passes
        // over what was released (failed) or left busy meanwhile.
        let mut next = 0;
        loop {
            let (mine, busy) = self.claim((next..n).filter(|p| !corrupt.contains(p)), group);
            if let Some(&last) = mine.last() {
                next = last + 1;
            }
            if mine.is_empty() {
                if next > 0 {
                    next = 0;
                    continue;
                }
                if !busy {
                    return first_corrupt.map_or(Ok(()), Err);
                }
                // Only chunks clients are fetching are left.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let this = Arc::clone(self);
            let done = tokio::task::spawn_blocking(move || this.restore_blocking(&mine, true))
                .await
                .expect("restoring does not panic");
            match done {
                Ok(()) => backoff = Duration::from_secs(1),
                Err((e @ Error::Corrupt { .. }, failed)) => {
                    tracing::error!(volume = %self.writer.name(), error = %e, "restore: a chunk is corrupt; its range fails I/O");
                    corrupt.extend(failed);
                    first_corrupt.get_or_insert(e);
                }
                Err((e, _)) if e.is_store_fault() => {
                    tracing::warn!(volume = %self.writer.name(), error = %e, retry_in = ?backoff, "restore: the target failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
                Err((e, _)) => return Err(e),
            }
            let (chunks_done, bytes_done) = {
                let slots = self.slots.lock();
                (slots.done, slots.done_bytes)
            };
            progress(&Progress {
                chunks_total: n as u64,
                chunks_done,
                bytes_total: total_bytes,
                bytes_done,
                bytes_transferred: bytes_done,
            });
        }
    }
}

impl ferrite_engine::Fill for Filling {
    fn fill(&self, offset: u64, len: u64, access: Access) -> ferrite_engine::Result<()> {
        let failed = |e: Error| {
            ferrite_engine::Error::new(
                ErrorKind::Io,
                format!("volume {:?} is being restored from {}: {e}", self.writer.name(), self.manifest.backup_ref()),
            )
        };
        if access == Access::Trim {
            self.trimmed(offset, len).map_err(failed)?;
        }
        let positions = self.positions(offset, len);
        loop {
            let (mine, busy) = self.claim(positions.clone(), ON_DEMAND);
            if mine.is_empty() {
                if !busy {
                    return Ok(());
                }
                // Another request or the background copy is fetching one: wait for it.
                let mut slots = self.slots.lock();
                if slots.state[positions.clone()].contains(&Slot::Busy) {
                    self.changed.wait_for(&mut slots, Duration::from_millis(100));
                }
                continue;
            }
            self.restore_blocking(&mine, false).map_err(|(e, _)| failed(e))?;
            self.on_demand.fetch_add(mine.len() as u64, Ordering::Relaxed);
        }
    }

    fn pending(&self, offset: u64, len: u64) -> ferrite_engine::Result<Vec<(u64, u64)>> {
        let cs = self.manifest.chunk_size;
        let end = offset.saturating_add(len);
        let slots = self.slots.lock();
        let chunks = &self.chunks;
        Ok(self
            .positions(offset, len)
            .filter(|&p| slots.state[p] != Slot::Done)
            .map(|p| {
                let from = (chunks[p].i * cs).max(offset);
                (from, (chunks[p].i * cs + u64::from(chunks[p].len)).min(end) - from)
            })
            .collect())
    }
}

/// Fetches `chunks` (tagged with their positions; all at once) and writes each one's non-zero
/// blocks at its offset: each one's outcome.
async fn fetch_and_write(
    target: Target,
    pace: Arc<Pace>,
    writer: Volume,
    chunks: Vec<(usize, ChunkRef)>,
    chunk_size: u64,
) -> Vec<(usize, Result<()>)> {
    let n = chunks.len();
    futures_util::stream::iter(chunks)
        .map(|(p, c)| {
            let (target, pace, writer) = (target.clone(), Arc::clone(&pace), writer.clone());
            async move {
                let written = async {
                    let plain = fetch_chunk(&target, &c, &pace).await?;
                    let offset = c.i * chunk_size;
                    tokio::task::spawn_blocking(move || write_nonzero(&writer, offset, &plain))
                        .await
                        .expect("writing a chunk does not panic")?;
                    Ok(())
                };
                (p, written.await)
            }
        })
        .buffer_unordered(n.max(1))
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_is_one_bit_per_chunk() {
        assert_eq!(done_bitmap([true, false, false, true, false, false, false, false, true].into_iter()), "0901");
        assert_eq!(done_bitmap(std::iter::empty()), "");
    }
}
