//! Opening a pool's file or block device, and the pread/pwrite backend.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use super::{Backend, check_request};

/// An open backing file or block device, with its size and whether O_DIRECT is in effect.
#[derive(Debug)]
pub(crate) struct BackingFile {
    pub file: File,
    pub len: u64,
    pub direct: bool,
    pub is_device: bool,
    /// A regular file with blocks not yet allocated (see [`super::Backend::sparse`]).
    pub sparse: bool,
    /// A file on tmpfs or ramfs: every read and write is a copy to or from memory.
    pub in_memory: bool,
}

/// Whether `path` is a regular file of a filesystem held in memory (tmpfs, ramfs); a device
/// node is not, though /dev is itself a tmpfs. Such a file's reads and writes are memory copies,
/// cheapest done on the spot: io_uring asks it for a read that cannot block, tmpfs cannot
/// promise that, and the read goes to a worker thread (a wake-up and two context switches per
/// request; see "Cost of a request" in docs/design/data-path.md).
pub(crate) fn in_memory(path: &Path) -> bool {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    regular
        && rustix::fs::statfs(path).is_ok_and(|s| {
            let magic = u64::try_from(s.f_type).unwrap_or(0);
            magic == TMPFS_MAGIC || magic == RAMFS_MAGIC
        })
}

impl BackingFile {
    /// Opens `path` read-write, with O_DIRECT where the filesystem supports it (tmpfs does not).
    /// A block device is opened exclusively (O_EXCL): one mounted, or in use by another pool or
    /// a device mapper, is refused with EBUSY.
    pub fn open(path: &Path) -> io::Result<Self> {
        let excl = if std::fs::metadata(path)?.file_type().is_block_device() { libc::O_EXCL } else { 0 };
        let open = |flags| OpenOptions::new().read(true).write(true).custom_flags(flags | excl).open(path);
        let (file, direct) = match open(libc::O_DIRECT | libc::O_CLOEXEC) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(libc::O_CLOEXEC)?, false),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                return Err(io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!("{} is in use (mounted, or held by another program)", path.display()),
                ));
            }
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        let is_device = meta.file_type().is_block_device();
        let len = if is_device { device_size(&file)? } else { meta.len() };
        let sparse = !is_device && {
            use std::os::unix::fs::MetadataExt;
            meta.blocks() * 512 < len
        };
        let in_memory = in_memory(path);
        Ok(Self { file, len, direct, is_device, sparse, in_memory })
    }

    /// fdatasync.
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Reserves blocks of a regular file (fallocate, size unchanged); a no-op on devices.
    pub fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.fallocate(0, offset, len)
    }

    /// Gives a range back: a hole punched in a regular file, BLKDISCARD on a device (which an
    /// SSD may use to erase ahead of time).
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.is_device {
            return self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len);
        }
        const BLKDISCARD: libc::c_ulong = 0x1277;
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD reads two u64s (start, length) through the pointer, which points at
        // a live local array; the fd is owned by self.file.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), BLKDISCARD, range.as_ptr()) };
        match rc {
            0 => Ok(()),
            _ => match io::Error::last_os_error() {
                // Devices without discard support: nothing to tell them.
                e if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
                e => Err(e),
            },
        }
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        if self.is_device {
            return Ok(());
        }
        let (Ok(off), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "range too large"));
        };
        // SAFETY: fallocate only reads its scalar arguments; the fd is owned by self.file.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), mode | libc::FALLOC_FL_KEEP_SIZE, off, len) };
        match rc {
            0 => Ok(()),
            _ => match io::Error::last_os_error() {
                // Filesystems without fallocate support: nothing to reserve or punch.
                e if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
                e => Err(e),
            },
        }
    }
}

fn device_size(file: &File) -> io::Result<u64> {
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at a live local.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc == 0 { Ok(size) } else { Err(io::Error::last_os_error()) }
}

/// The plain-syscall backend: pread/pwrite (O_DIRECT where possible) and fdatasync.
#[derive(Debug)]
pub struct SyncFileBackend {
    file: BackingFile,
}

impl SyncFileBackend {
    /// Opens an existing file or block device.
    pub fn open(path: &Path) -> io::Result<Self> {
        Ok(Self { file: BackingFile::open(path)? })
    }

    /// True if O_DIRECT is in effect.
    pub fn is_direct(&self) -> bool {
        self.file.direct
    }
}

impl Backend for SyncFileBackend {
    fn len(&self) -> u64 {
        self.file.len
    }

    /// None for a file in memory: a read there is a copy, cheaper here than on a ring.
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        (!self.file.in_memory).then(|| self.file.file.as_raw_fd())
    }

    fn in_memory(&self) -> bool {
        self.file.in_memory
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_request(buf.len(), offset, self.file.len, buf.as_ptr())?;
        self.file.file.read_exact_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_request(buf.len(), offset, self.file.len, buf.as_ptr())?;
        self.file.file.write_all_at(buf, offset)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_memory_filesystems_count_as_memory() {
        assert!(!in_memory(Path::new("/proc")), "procfs");
        assert!(!in_memory(Path::new("/nonexistent/pool.img")), "a path that cannot be looked up");
        assert!(!in_memory(Path::new("/dev/null")), "a device node on devtmpfs");
        if Path::new("/dev/shm").is_dir() {
            let f = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
            assert!(in_memory(f.path()), "a file on /dev/shm (tmpfs)");
        }
    }
}
