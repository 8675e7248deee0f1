//! The log of the kernel's dm-log-writes target (drivers/md/dm-log-writes.c; its format in
//! Documentation/admin-guide/device-mapper/log-writes.rst), read and replayed.
//!
//! The log device holds, in blocks of the data device's logical block size (`sectorsize`): a
//! super block (magic, version, entry count, sectorsize), then one entry after another: a
//! header block (sector, sector count, flags, data length; a mark's text after it), then the
//! written data (none for a discard or a flush). Sectors and counts are in `sectorsize` units.
//!
//! The target logs a write only once a flush covers it: a write that completed goes on a list,
//! and a flush request is logged after every write that completed before it was issued; a FUA
//! write is logged when it completes. So replaying the log up to a FLUSH or FUA entry gives what
//! a device must hold once that flush completed, and the writes between two flush entries are
//! those that device may have kept in any subset if the power went before the second.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const MAGIC: u64 = 0x006a_7366_7773_6872;
pub const FLUSH: u64 = 1 << 0;
pub const FUA: u64 = 1 << 1;
pub const DISCARD: u64 = 1 << 2;
pub const MARK: u64 = 1 << 3;

/// One logged request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Where it went on the data device, in bytes.
    pub offset: u64,
    pub len: u64,
    pub flags: u64,
    /// A mark's text.
    pub mark: Option<String>,
    /// Where its data is in the log (bytes).
    data_at: u64,
}

impl Entry {
    /// A FLUSH or FUA entry: a point a device guarantees.
    pub fn is_flush_point(&self) -> bool {
        self.flags & (FLUSH | FUA) != 0
    }

    /// A write or discard that changes the data device.
    pub fn changes(&self) -> bool {
        self.len > 0 && self.flags & MARK == 0
    }
}

#[derive(Debug)]
pub struct Log {
    file: File,
    pub sectorsize: u64,
    pub entries: Vec<Entry>,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn bad(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

impl Log {
    /// Reads the super block and every entry's header.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        let mut sb = [0u8; 32];
        file.read_exact_at(&mut sb, 0)?;
        if u64_at(&sb, 0) != MAGIC {
            return Err(bad(format!("{}: not a dm-log-writes log (magic {:#x})", path.display(), u64_at(&sb, 0))));
        }
        if u64_at(&sb, 8) != 1 {
            return Err(bad(format!("{}: log version {}, not 1", path.display(), u64_at(&sb, 8))));
        }
        let count = u64_at(&sb, 16);
        let sectorsize = u64::from(u32::from_le_bytes(sb[24..28].try_into().unwrap()));
        if !(512..=65536).contains(&sectorsize) || !sectorsize.is_power_of_two() {
            return Err(bad(format!("{}: sector size {sectorsize}", path.display())));
        }
        let size = file.metadata()?.len();
        let mut entries = Vec::with_capacity(usize::try_from(count).unwrap_or(0).min(1 << 20));
        let mut at = sectorsize;
        let mut header = vec![0u8; usize::try_from(sectorsize).unwrap()];
        for i in 0..count {
            if at + sectorsize > size {
                return Err(bad(format!("{}: entry {i} of {count} lies past the log's end", path.display())));
            }
            file.read_exact_at(&mut header, at)?;
            let (sector, sectors, flags, data_len) =
                (u64_at(&header, 0), u64_at(&header, 8), u64_at(&header, 16), u64_at(&header, 24));
            let mark = (flags & MARK != 0).then(|| {
                let len = usize::try_from(data_len).unwrap_or(usize::MAX).min(header.len() - 32);
                String::from_utf8_lossy(&header[32..32 + len]).into_owned()
            });
            let data_at = at + sectorsize;
            let stored = if flags & (DISCARD | MARK) != 0 { 0 } else { sectors * sectorsize };
            entries.push(Entry { offset: sector * sectorsize, len: sectors * sectorsize, flags, mark, data_at });
            at = data_at + stored;
            if at > size {
                return Err(bad(format!("{}: entry {i}'s data lies past the log's end", path.display())));
            }
        }
        Ok(Self { file, sectorsize, entries })
    }

    /// The index of the entry marked `name`.
    pub fn mark(&self, name: &str) -> Option<usize> {
        self.entries.iter().position(|e| e.mark.as_deref() == Some(name))
    }

    /// Applies entry `i` to `target` (a file or device as large as the data device): its data
    /// written, or zeros where it discarded (what the replay's device reads after a discard).
    pub fn apply(&self, i: usize, target: &File) -> io::Result<()> {
        let e = &self.entries[i];
        if !e.changes() {
            return Ok(());
        }
        let mut buf = vec![0u8; usize::try_from(e.len.min(1 << 20)).unwrap()];
        let mut done = 0;
        while done < e.len {
            let n = (e.len - done).min(buf.len() as u64);
            let chunk = &mut buf[..usize::try_from(n).unwrap()];
            if e.flags & DISCARD == 0 {
                self.file.read_exact_at(chunk, e.data_at + done)?;
            } else {
                chunk.fill(0);
            }
            target.write_all_at(chunk, e.offset + done)?;
            done += n;
        }
        Ok(())
    }

    /// Applies entries `from..to` to `target`, in order.
    pub fn replay(&self, from: usize, to: usize, target: &File) -> io::Result<()> {
        (from..to).try_for_each(|i| self.apply(i, target))
    }
}
