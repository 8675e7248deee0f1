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

use ferrite_engine::{ErrorKind, Volume};
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

/// Records which of the manifest's chunks are done, durably, before it returns: a hex bitmap
/// over the manifest's chunk list ([`done_bitmap`]).
pub type Save = Box<dyn Fn(&str) -> std::io::Result<()> + Send + Sync>;

/// A volume being restored while it serves.
pub struct Filling {
    target: Target,
    manifest: Manifest,
    /// A handle that writes past the volume's fill (and gate): the restore's own writes.
    writer: Volume,
    rt: tokio::runtime::Handle,
    pace: Arc<Pace>,
    save: Save,
    slots: Mutex<Vec<Slot>>,
    changed: Condvar,
    /// Held while the record is written: one writer at a time, each including the others' done.
    saving: Mutex<()>,
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
    /// Restores `manifest` from `target` into the volume `writer` writes (new or resumed: `done`
    /// is the record a previous run saved, None for a new restore). `writer` must write past
    /// the volume's fill (`Volume::past_read_only`); the runtime `rt` runs the fetches.
    pub fn new(
        target: Target,
        manifest: Manifest,
        writer: Volume,
        done: Option<&str>,
        save: Save,
        rt: tokio::runtime::Handle,
    ) -> Result<Arc<Self>> {
        let n = manifest.chunks.len();
        let slots = match done {
            None => vec![Slot::Pending; n],
            Some(hex) => {
                let bits = crate::codec::unhex(hex).filter(|b| b.len() == n.div_ceil(8)).ok_or_else(|| {
                    Error::Invalid(format!("the restore record of {:?} does not fit its backup", writer.name()))
                })?;
                (0..n).map(|i| if bits[i / 8] & (1 << (i % 8)) != 0 { Slot::Done } else { Slot::Pending }).collect()
            }
        };
        if done.is_none() {
            save(&done_bitmap(std::iter::repeat_n(false, n)))
                .map_err(|e| Error::Invalid(format!("saving the restore record: {e}")))?;
        }
        let pace = Arc::new(Pace::new(target.config.bandwidth));
        Ok(Arc::new(Self {
            target,
            manifest,
            writer,
            rt,
            pace,
            save,
            slots: Mutex::new(slots),
            changed: Condvar::new(),
            saving: Mutex::new(()),
            on_demand: AtomicU64::new(0),
        }))
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Chunks done and in all, and how many of the done were fetched for a client request.
    pub fn counts(&self) -> (u64, u64, u64) {
        let slots = self.slots.lock();
        let done = slots.iter().filter(|s| **s == Slot::Done).count() as u64;
        (done, slots.len() as u64, self.on_demand.load(Ordering::Relaxed))
    }

    /// The positions in the manifest's chunk list of the chunks [offset, offset+len) touches.
    fn positions(&self, offset: u64, len: u64) -> std::ops::Range<usize> {
        let cs = self.manifest.chunk_size;
        let (first, end) = (offset / cs, (offset + len).div_ceil(cs));
        let chunks = &self.manifest.chunks;
        chunks.partition_point(|c| c.i < first)..chunks.partition_point(|c| c.i < end)
    }

    /// Claims the pending chunks among `positions` (marks them busy); whether any other of them
    /// is busy.
    fn claim(&self, positions: impl Iterator<Item = usize>, most: usize) -> (Vec<usize>, bool) {
        let mut slots = self.slots.lock();
        let (mut mine, mut busy) = (Vec::new(), false);
        for p in positions {
            match slots[p] {
                Slot::Pending if mine.len() < most => {
                    slots[p] = Slot::Busy;
                    mine.push(p);
                }
                Slot::Pending | Slot::Busy => busy = true,
                Slot::Done => {}
            }
        }
        (mine, busy)
    }

    /// Gives claimed chunks back (their fetch failed).
    fn release(&self, positions: &[usize]) {
        let mut slots = self.slots.lock();
        for &p in positions {
            slots[p] = Slot::Pending;
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
        let chunks = positions.iter().map(|&p| (p, self.manifest.chunks[p].clone())).collect();
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

    /// Flushes what was written, saves the record with `positions` done, then marks them done.
    fn commit(&self, positions: &[usize]) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        self.writer.flush()?;
        let _saving = self.saving.lock();
        let record = {
            let slots = self.slots.lock();
            done_bitmap(slots.iter().enumerate().map(|(p, s)| *s == Slot::Done || positions.contains(&p)))
        };
        (self.save)(&record).map_err(|e| Error::Invalid(format!("saving the restore record: {e}")))?;
        let mut slots = self.slots.lock();
        for &p in positions {
            slots[p] = Slot::Done;
        }
        self.changed.notify_all();
        Ok(())
    }

    /// Copies every chunk not done yet, `concurrency` at a time, then returns. A store that
    /// fails is retried (backoff up to 30 s) for as long as it takes; a corrupt chunk is left
    /// out (the copy goes on with the others, then ends with its error); an engine error (the
    /// volume deleted) ends it at once.
    pub async fn run(self: &Arc<Self>, progress: &(dyn Fn(&Progress) + Sync)) -> Result<()> {
        let group = self.target.concurrency();
        let mut backoff = Duration::from_secs(1);
        let total_bytes: u64 = self.manifest.chunks.iter().map(|c| u64::from(c.len)).sum();
        let mut corrupt: Vec<usize> = Vec::new();
        let mut first_corrupt = None;
        loop {
            let (mine, busy) = self.claim((0..self.manifest.chunks.len()).filter(|p| !corrupt.contains(p)), group);
            if mine.is_empty() {
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
                Err((e @ Error::Store { .. }, _)) => {
                    tracing::warn!(volume = %self.writer.name(), error = %e, retry_in = ?backoff, "restore: the target failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
                Err((e, _)) => return Err(e),
            }
            let (mut chunks_done, mut bytes_done) = (0, 0);
            for (c, _) in self.manifest.chunks.iter().zip(self.slots.lock().iter()).filter(|(_, s)| **s == Slot::Done) {
                chunks_done += 1;
                bytes_done += u64::from(c.len);
            }
            progress(&Progress {
                chunks_total: self.manifest.chunks.len() as u64,
                chunks_done,
                bytes_total: total_bytes,
                bytes_done,
                bytes_transferred: bytes_done,
            });
        }
    }
}

impl ferrite_engine::Fill for Filling {
    fn fill(&self, offset: u64, len: u64) -> ferrite_engine::Result<()> {
        let positions = self.positions(offset, len);
        loop {
            let (mine, busy) = self.claim(positions.clone(), usize::MAX);
            if mine.is_empty() {
                if !busy {
                    return Ok(());
                }
                // Another request or the background copy is fetching one: wait for it.
                let mut slots = self.slots.lock();
                if slots[positions.clone()].contains(&Slot::Busy) {
                    self.changed.wait_for(&mut slots, Duration::from_millis(100));
                }
                continue;
            }
            self.restore_blocking(&mine, false).map_err(|(e, _)| {
                ferrite_engine::Error::new(
                    ErrorKind::Io,
                    format!(
                        "volume {:?} is being restored from {}: {e}",
                        self.writer.name(),
                        self.manifest.backup_ref()
                    ),
                )
            })?;
            self.on_demand.fetch_add(mine.len() as u64, Ordering::Relaxed);
        }
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
