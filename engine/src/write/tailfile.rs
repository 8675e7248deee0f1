//! The tail file: the memory the open batch and the sealed batches in flight are built in is a
//! shared mapping of a file in the metadata directory, so a write acknowledged from the open
//! batch is in the kernel's page cache the moment it is acknowledged, and outlives the
//! daemon's process. After a process crash, recovery finds there the batches the process had
//! not written to the store yet, and writes them where they belong before replaying them.
//!
//! ```text
//!  file: | slot 0 | slot 1 | slot 2 |         (one slot per batch buffer: the open one + FLIGHTS)
//!  slot: | header | data blocks ... | alternate header | place |
//!          `--- written to the store as one batch ---'
//! ```
//! A slot's batch is complete at every moment a write may be acknowledged from it: the leader
//! appends data, then encodes the header with every entry so far into whichever of the two
//! header places does not hold the newest copy, and only then acknowledges. A kill in the middle
//! of an encoding tears that copy; the other still describes every write acknowledged before.
//! The place block (sequence, generation, log position) is written when the batch opens, before
//! anything is acknowledged from it.
//!
//! What it does not promise: a power cut takes the page cache, and with it whatever no flush
//! covered (as the durability contract allows). Pages the kernel happened to write back are
//! checked like any batch (header crc, data crcs, sequence, generation) and taken only where
//! the log ends exactly at their sequence: never garbage, never a stale batch.

use std::fs::OpenOptions;
use std::ops::{Deref, DerefMut};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{BatchHeader, block_crc, le32, le64};
use crate::io::{AlignedBuf, BLOCK};
use crate::state::LogPos;

/// The tail file's name inside the metadata directory (RocksDB ignores names it did not make).
pub const FILE_NAME: &str = "FERRITE-TAIL";

const PLACE_MAGIC: &[u8; 8] = b"FERRTAIL";
const PLACE_CRC_AT: usize = 48;

/// Where a slot's batch goes in the log, written when it opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    seq: u64,
    generation: u64,
    seg: u64,
    off: u64,
}

impl Place {
    fn encode_into(&self, out: &mut [u8]) {
        out[..PLACE_CRC_AT + 4].fill(0);
        out[..8].copy_from_slice(PLACE_MAGIC);
        for (i, v) in [self.seq, self.generation, self.seg, self.off].into_iter().enumerate() {
            out[8 + i * 8..16 + i * 8].copy_from_slice(&v.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out[..PLACE_CRC_AT]);
        out[PLACE_CRC_AT..PLACE_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Option<Self> {
        (&b[..8] == PLACE_MAGIC && crc32c::crc32c(&b[..PLACE_CRC_AT]) == le32(b, PLACE_CRC_AT)).then(|| Place {
            seq: le64(b, 8),
            generation: le64(b, 16),
            seg: le64(b, 24),
            off: le64(b, 32),
        })
    }
}

/// A batch found whole in the tail file.
#[derive(Debug)]
pub(crate) struct Found {
    /// Where it goes in the log.
    pub at: LogPos,
    pub header: BatchHeader,
    /// The header block and the data blocks, as the store takes them.
    pub bytes: AlignedBuf,
}

/// The mapped tail file: `slots` slots of `batch_blocks + 2` blocks each.
#[derive(Debug)]
pub(crate) struct TailFile {
    ptr: NonNull<u8>,
    len: usize,
    slots: usize,
    /// Blocks of a slot's batch area: one header block and the data blocks.
    batch_blocks: usize,
}

// SAFETY: the mapping is owned by the TailFile for its whole life; each slot's bytes are reached
// mutably only through the one `TailBuf` of that slot (see `bufs`), and recovery reads them
// before any `TailBuf` exists.
unsafe impl Send for TailFile {}
// SAFETY: as for Send; shared access reads only.
unsafe impl Sync for TailFile {}

impl TailFile {
    /// Opens (creating, private to the daemon) the tail file in `meta_dir` and maps it.
    pub fn open(meta_dir: &Path, slots: usize, batch_blocks: usize) -> Result<Arc<Self>> {
        let path = meta_dir.join(FILE_NAME);
        let ctx = || format!("tail file {}", path.display());
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(ctx(), e))?;
        let len = slots * (batch_blocks + 2) * BLOCK;
        let have = f.metadata().map_err(|e| Error::io(ctx(), e))?.len();
        if have != len as u64 {
            // Another size (a pool from before the tail file, or other batch limits): what it
            // holds cannot be read as slots of this layout, and a fresh one holds nothing.
            if have != 0 {
                tracing::warn!(path = %path.display(), bytes = have, "tail file of another layout: started anew");
            }
            f.set_len(0).and_then(|()| f.set_len(len as u64)).map_err(|e| Error::io(ctx(), e))?;
        }
        // SAFETY: a fresh shared mapping of `len` bytes of an open file, at an address the kernel
        // chooses; nothing else in this process maps the file, and the result is checked.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::io(ctx(), std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(raw.cast::<u8>()).expect("mmap never returns null on success");
        Ok(Arc::new(Self { ptr, len, slots, batch_blocks }))
    }

    fn slot_len(&self) -> usize {
        (self.batch_blocks + 2) * BLOCK
    }

    /// Byte offset in a slot of its alternate header block; the place block follows it.
    fn alt_header_at(&self) -> usize {
        self.batch_blocks * BLOCK
    }

    fn place_at(&self) -> usize {
        self.alt_header_at() + BLOCK
    }

    fn slot(&self, i: usize) -> &[u8] {
        assert!(i < self.slots);
        // SAFETY: slot i lies inside the mapping, which lives as long as self; see `Sync`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(i * self.slot_len()), self.slot_len()) }
    }

    /// One buffer per slot. Call once: each slot must have exactly one writer.
    pub fn bufs(self: &Arc<Self>) -> Vec<TailBuf> {
        (0..self.slots).map(|slot| TailBuf { file: Arc::clone(self), slot, newest_at_zero: None }).collect()
    }

    /// The batch with sequence `seq` if a slot holds it whole (generation at least `floor`, pool
    /// tag `tag`, every data block matching its crc): its place in the log, its header (the
    /// newest copy) and its bytes. An error where a slot holds its header but not its data.
    pub fn find(&self, seq: u64, floor: u64, tag: u64) -> std::result::Result<Option<Found>, String> {
        (0..self.slots)
            .find_map(|i| {
                let s = self.slot(i);
                let p = Place::decode(&s[self.place_at()..])?;
                if p.seq != seq || p.generation < floor {
                    return None;
                }
                let copies = [&s[..BLOCK], &s[self.alt_header_at()..self.place_at()]];
                let h = copies
                    .into_iter()
                    .filter_map(BatchHeader::decode)
                    .filter(|h| h.seq == seq && h.generation == p.generation && h.uuid_tag == tag)
                    .filter(|h| h.header_blocks() == 1 && h.crcs.len() < self.batch_blocks)
                    .max_by_key(|h| h.crcs.len())?;
                let data = &s[BLOCK..(1 + h.crcs.len()) * BLOCK];
                if let Some(bad) = data.chunks(BLOCK).zip(&h.crcs).position(|(b, &c)| block_crc(b) != c) {
                    return Some(Err(format!("batch {seq} in the tail file: data block {bad} checksum mismatch")));
                }
                let mut bytes = AlignedBuf::new(BLOCK + data.len());
                h.encode_into(&mut bytes[..BLOCK]);
                bytes[BLOCK..].copy_from_slice(data);
                let seg = usize::try_from(p.seg).ok()?;
                Some(Ok(Found { at: LogPos { seq, seg, off: p.off }, header: h, bytes }))
            })
            .transpose()
    }
}

impl Drop for TailFile {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `open`; every TailBuf holds an Arc to self,
        // so none is left to reach it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One slot of the tail file, owned by one batch at a time: derefs to its batch area (the
/// header block, then the data blocks), which is what is written to the store.
#[derive(Debug)]
pub(crate) struct TailBuf {
    file: Arc<TailFile>,
    slot: usize,
    /// Which header place holds the newest copy: block 0 (true), the alternate (false).
    newest_at_zero: Option<bool>,
}

impl TailBuf {
    fn slot_mut(&mut self) -> &mut [u8] {
        let len = self.file.slot_len();
        // SAFETY: this TailBuf is the only one of its slot (`TailFile::bufs`), and &mut self
        // makes this the only reference to its bytes; the mapping outlives self (the Arc).
        unsafe { std::slice::from_raw_parts_mut(self.file.ptr.as_ptr().add(self.slot * len), len) }
    }

    /// Starts a new batch in this slot: records where it goes, before anything is acknowledged
    /// from it (the header copies left from an earlier batch have another sequence or place).
    pub fn start(&mut self, pos: LogPos, generation: u64) {
        let place = Place { seq: pos.seq, generation, seg: pos.seg as u64, off: pos.off };
        let at = self.file.place_at();
        place.encode_into(&mut self.slot_mut()[at..]);
        self.newest_at_zero = None;
    }

    /// Records the header of everything appended so far, keeping the previous copy intact.
    pub fn save_header(&mut self, h: &BatchHeader) {
        let at_zero = self.newest_at_zero != Some(true);
        self.encode_header(h, at_zero);
    }

    /// Puts the final header in block 0, where the store write takes it from.
    pub fn seal_header(&mut self, h: &BatchHeader) {
        if self.newest_at_zero != Some(true) {
            self.encode_header(h, true);
        }
    }

    fn encode_header(&mut self, h: &BatchHeader, at_zero: bool) {
        let at = if at_zero { 0 } else { self.file.alt_header_at() };
        h.encode_into(&mut self.slot_mut()[at..at + BLOCK]);
        self.newest_at_zero = Some(at_zero);
    }
}

impl Deref for TailBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.file.slot(self.slot)[..self.file.alt_header_at()]
    }
}

impl DerefMut for TailBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let n = self.file.alt_header_at();
        &mut self.slot_mut()[..n]
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::format::{Entry, EntryKind};

    fn header(seq: u64, blocks: usize) -> BatchHeader {
        BatchHeader {
            seq,
            generation: 3,
            uuid_tag: 9,
            entries: vec![Entry { layer: 1, lba: 0, blocks: u32::try_from(blocks).unwrap(), kind: EntryKind::Data }],
            crcs: (0..blocks).map(|i| block_crc(&vec![u8::try_from(i).unwrap(); BLOCK])).collect(),
        }
    }

    fn fill(b: &mut TailBuf, blocks: usize) {
        for i in 0..blocks {
            b[(1 + i) * BLOCK..(2 + i) * BLOCK].fill(u8::try_from(i).unwrap());
        }
    }

    #[test]
    fn a_batch_survives_in_the_file_and_a_torn_copy_falls_back() {
        let dir = tempfile::tempdir().unwrap();
        let pos = LogPos { seq: 7, seg: 2, off: 8192 };
        {
            let f = TailFile::open(dir.path(), 3, 9).unwrap();
            let mut bufs = f.bufs();
            let b = &mut bufs[1];
            b.start(pos, 3);
            fill(b, 2);
            b.save_header(&header(7, 2));
            fill(b, 5);
            b.save_header(&header(7, 5));
            // A kill while the next copy was being encoded: it is torn, the other one stands.
            let at = if b.newest_at_zero == Some(true) { b.file.alt_header_at() } else { 0 };
            b.slot_mut()[at..at + 64].fill(0xee);
            assert_eq!(std::fs::metadata(dir.path().join(FILE_NAME)).unwrap().permissions().mode() & 0o777, 0o600);
        }
        let f = TailFile::open(dir.path(), 3, 9).unwrap();
        let found = f.find(7, 3, 9).unwrap().unwrap();
        assert_eq!((found.at, found.header.crcs.len()), (pos, 5));
        assert_eq!(BatchHeader::decode(&found.bytes[..BLOCK]).unwrap(), found.header);
        assert!(found.bytes[5 * BLOCK..].iter().all(|&x| x == 4));
        // Another sequence, an older generation, another pool: not this batch.
        assert!(f.find(8, 3, 9).unwrap().is_none());
        assert!(f.find(7, 4, 9).unwrap().is_none());
        assert!(f.find(7, 3, 10).unwrap().is_none());
        // A data block that does not match its crc: reported, not taken.
        let mut bufs = f.bufs();
        bufs[1][3 * BLOCK] ^= 1;
        assert!(f.find(7, 3, 9).unwrap_err().contains("data block 2 checksum mismatch"));
        // Another layout: started anew, nothing found.
        drop(bufs);
        drop(f);
        assert!(TailFile::open(dir.path(), 3, 17).unwrap().find(7, 3, 9).unwrap().is_none());
    }
}
