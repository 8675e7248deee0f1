//! One ublk request against the engine, without the kernel: the descriptor's fields in, the
//! completion value (bytes done, or a negative errno) out. The queue threads call this from their
//! workers; tests and the bench call it directly.

use ferrite_engine::{Error, ErrorKind, Volume};
use libublk::sys;

/// What the kernel asked for (from `ublksrv_io_desc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write { fua: bool },
    Flush,
    Discard,
    WriteZeroes { fua: bool },
}

/// A decoded request: byte offset and length on the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub offset: u64,
    pub len: u64,
}

/// Longest write the queue thread runs itself: the longest the engine takes into its open
/// batch in memory (as the NBD event loop's inline writes).
const MAX_INLINE_WRITE: u64 = 128 << 10;

impl Request {
    /// Decodes a descriptor's `op_flags`, `start_sector` and `nr_sectors`; an operation we do not
    /// serve (WRITE_SAME, the zoned ones) is `-EOPNOTSUPP`.
    pub fn decode(op_flags: u32, start_sector: u64, nr_sectors: u32) -> Result<Self, i32> {
        let fua = op_flags & sys::UBLK_IO_F_FUA != 0;
        let op = match op_flags & 0xff {
            sys::UBLK_IO_OP_READ => Op::Read,
            sys::UBLK_IO_OP_WRITE => Op::Write { fua },
            sys::UBLK_IO_OP_FLUSH => Op::Flush,
            sys::UBLK_IO_OP_DISCARD => Op::Discard,
            sys::UBLK_IO_OP_WRITE_ZEROES => Op::WriteZeroes { fua },
            _ => return Err(-libc::EOPNOTSUPP),
        };
        if op == Op::Flush {
            // A flush's sector fields are not meaningful (the kernel leaves them at all ones).
            return Ok(Self { op, offset: 0, len: 0 });
        }
        let offset = start_sector.checked_mul(512).ok_or(-libc::EINVAL)?;
        Ok(Self { op, offset, len: u64::from(nr_sectors) << 9 })
    }

    /// Whether the request completes without waiting for the store, so that the queue thread
    /// runs it itself rather than waking a worker (two thread hand-offs per request): a small
    /// write without FUA while writes are not paced against the cleaner (the engine copies it
    /// into its open batch), or a read of a store in memory. Anything else may wait for a
    /// device, and would hold up every request behind it on the queue.
    pub fn runs_inline(&self, volume: &Volume) -> bool {
        match self.op {
            Op::Write { fua: false } => self.len <= MAX_INLINE_WRITE && !volume.writes_may_wait(),
            Op::Read => volume.store_in_memory(),
            _ => false,
        }
    }

    /// Starts a small write of a volume with synchronous replicas that its members acknowledge
    /// later ([`Volume::start_write`]): `done` gets the completion value on the thread that
    /// reads their answers, and no thread waits meanwhile. False, with nothing done, when the
    /// request cannot start so: it then runs with [`Request::execute`] on a worker.
    pub fn start(&self, volume: &Volume, buf: &[u8], done: impl FnOnce(i32) + Send + 'static) -> bool {
        let small = self.op == (Op::Write { fua: false }) && self.len <= MAX_INLINE_WRITE;
        let data = usize::try_from(self.len).ok().and_then(|n| buf.get(..n));
        let Some(data) = data.filter(|_| small && volume.is_mirrored() && !volume.is_read_only()) else {
            return false;
        };
        let me = *self;
        let name = volume.name().to_owned();
        volume.start_write(self.offset, data, Box::new(move |r| done(me.completion(&name, r)))).is_ok()
    }

    /// Runs the request on `volume`. `buf` is the tag's I/O buffer: read data lands in it, write
    /// data comes from it. Returns the value to complete the tag with.
    pub fn execute(&self, volume: &Volume, buf: &mut [u8]) -> i32 {
        if volume.is_read_only() && !matches!(self.op, Op::Read | Op::Flush) {
            return -libc::EROFS;
        }
        let data_len = usize::try_from(self.len).ok().filter(|&n| n <= buf.len()).ok_or(-libc::EINVAL);
        let res = match self.op {
            Op::Read => match data_len {
                Ok(n) => volume.read(self.offset, &mut buf[..n]),
                Err(e) => return e,
            },
            Op::Write { fua } => match data_len {
                Ok(n) if fua => volume.write_fua(self.offset, &buf[..n]),
                Ok(n) => volume.write(self.offset, &buf[..n]),
                Err(e) => return e,
            },
            Op::Flush => volume.flush(),
            Op::Discard => volume.trim(self.offset, self.len),
            Op::WriteZeroes { fua } => volume.write_zeroes(self.offset, self.len, fua),
        };
        self.completion(volume.name(), res)
    }

    /// The value the tag completes with for outcome `res`.
    fn completion(&self, volume: &str, res: Result<(), Error>) -> i32 {
        match res {
            // Lengths are bounded by the device's max_sectors (a few MiB) for data and by u32
            // sectors for the others; the kernel only reads the sign of non-data completions.
            Ok(()) => i32::try_from(self.len).unwrap_or(i32::MAX),
            Err(e) => {
                tracing::debug!(volume, op = ?self.op, offset = self.offset, error = %e, "ublk request failed");
                -errno(&e)
            }
        }
    }
}

/// The errno a block device reports for an engine error.
pub fn errno(e: &Error) -> i32 {
    match e.kind() {
        ErrorKind::NoSpace => libc::ENOSPC,
        ErrorKind::OutOfRange => libc::EINVAL,
        ErrorKind::InvalidArgument => libc::EINVAL,
        ErrorKind::Unsupported => libc::EOPNOTSUPP,
        ErrorKind::ReadOnly => libc::EROFS,
        ErrorKind::Closed | ErrorKind::NotFound => libc::ENODEV,
        _ => libc::EIO,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferrite_engine::io::MemoryBackend;
    use ferrite_engine::{Pool, PoolOptions};

    use super::*;

    fn opts() -> PoolOptions {
        PoolOptions { segment_size: 1 << 20, background_cleaner: false, ..PoolOptions::default() }
    }

    fn pool() -> (tempfile::TempDir, Pool) {
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(MemoryBackend::new(64 << 20));
        let pool = Pool::create_on(backend, &dir.path().join("meta"), opts()).unwrap();
        (dir, pool)
    }

    fn req(op: u32, sector: u64, sectors: u32) -> Request {
        Request::decode(op, sector, sectors).unwrap()
    }

    #[test]
    fn only_requests_that_never_wait_for_the_store_run_on_the_queue_thread() {
        let (dir, pool) = pool();
        pool.create_volume("v", 1 << 20).unwrap();
        let v = pool.open_volume("v").unwrap();
        let sectors = |bytes: u32| bytes >> 9;
        assert!(req(sys::UBLK_IO_OP_WRITE, 0, sectors(128 << 10)).runs_inline(&v));
        assert!(!req(sys::UBLK_IO_OP_WRITE, 0, sectors(132 << 10)).runs_inline(&v), "longer than the open batch takes");
        assert!(!req(sys::UBLK_IO_OP_WRITE | sys::UBLK_IO_F_FUA, 0, 8).runs_inline(&v), "FUA waits for a sync");
        for op in [sys::UBLK_IO_OP_FLUSH, sys::UBLK_IO_OP_DISCARD, sys::UBLK_IO_OP_WRITE_ZEROES] {
            assert!(!req(op, 0, 8).runs_inline(&v), "op {op}");
        }
        assert!(req(sys::UBLK_IO_OP_READ, 0, 8).runs_inline(&v), "a read of a store in memory is a copy");
        drop((v, pool));
        // A pool file on tmpfs: found to be memory, so its reads run on the queue thread too.
        if std::path::Path::new("/dev/shm").is_dir() {
            let shm = tempfile::tempdir_in("/dev/shm").unwrap();
            let file = Pool::create(&shm.path().join("pool.img"), &dir.path().join("meta2"), 8 << 20, opts());
            let file = file.unwrap();
            file.create_volume("v", 1 << 20).unwrap();
            let v = file.open_volume("v").unwrap();
            assert!(v.store_in_memory());
            assert!(req(sys::UBLK_IO_OP_READ, 0, 8).runs_inline(&v));
        }
    }

    #[test]
    fn decodes_ops_flags_and_units() {
        let w = req(sys::UBLK_IO_OP_WRITE | sys::UBLK_IO_F_FUA, 8, 16);
        assert_eq!(w, Request { op: Op::Write { fua: true }, offset: 4096, len: 8192 });
        assert_eq!(req(sys::UBLK_IO_OP_READ, 1, 1).op, Op::Read);
        assert_eq!(req(sys::UBLK_IO_OP_FLUSH, 0, 0).op, Op::Flush);
        // What a 6.12 kernel sends for a flush.
        assert_eq!(req(sys::UBLK_IO_OP_FLUSH, u64::MAX, 0), Request { op: Op::Flush, offset: 0, len: 0 });
        assert_eq!(req(sys::UBLK_IO_OP_DISCARD, 0, 8).op, Op::Discard);
        assert_eq!(req(sys::UBLK_IO_OP_WRITE_ZEROES, 0, 8).op, Op::WriteZeroes { fua: false });
        assert_eq!(Request::decode(sys::UBLK_IO_OP_WRITE_SAME, 0, 8), Err(-libc::EOPNOTSUPP));
        assert_eq!(Request::decode(sys::UBLK_IO_OP_ZONE_APPEND, 0, 8), Err(-libc::EOPNOTSUPP));
        assert_eq!(Request::decode(sys::UBLK_IO_OP_READ, u64::MAX, 8), Err(-libc::EINVAL));
    }

    #[test]
    fn serves_every_op_on_the_engine() {
        let (_d, pool) = pool();
        pool.create_volume("v", 8 << 20).unwrap();
        let vol = pool.open_volume("v").unwrap();
        let mut buf = vec![0u8; 64 << 10];
        buf[..8192].fill(0xab);
        // A 512-byte-aligned write that is not 4 KiB aligned.
        assert_eq!(req(sys::UBLK_IO_OP_WRITE, 3, 16).execute(&vol, &mut buf), 8192);
        assert_eq!(req(sys::UBLK_IO_OP_FLUSH, 0, 0).execute(&vol, &mut buf), 0);
        buf.fill(0);
        assert_eq!(req(sys::UBLK_IO_OP_READ, 0, 24).execute(&vol, &mut buf), 12288);
        assert!(buf[..1536].iter().all(|&b| b == 0));
        assert!(buf[1536..1536 + 8192].iter().all(|&b| b == 0xab));
        assert!(buf[1536 + 8192..12288].iter().all(|&b| b == 0));
        assert_eq!(req(sys::UBLK_IO_OP_DISCARD, 8, 8).execute(&vol, &mut buf), 4096);
        assert_eq!(req(sys::UBLK_IO_OP_WRITE_ZEROES | sys::UBLK_IO_F_FUA, 16, 8).execute(&vol, &mut buf), 4096);
        let mut back = vec![0xffu8; 12288];
        vol.read(0, &mut back).unwrap();
        assert!(back[1536..4096].iter().all(|&b| b == 0xab));
        assert!(back[4096..12288].iter().all(|&b| b == 0), "discard and write-zeroes read back as zeros");
    }

    #[test]
    fn errors_become_errnos_and_change_nothing() {
        let (_d, pool) = pool();
        pool.create_volume("v", 1 << 20).unwrap();
        let vol = pool.open_volume("v").unwrap();
        let mut buf = vec![7u8; 8192];
        // Past the end, and longer than the tag's buffer.
        assert_eq!(req(sys::UBLK_IO_OP_WRITE, 2047, 8).execute(&vol, &mut buf), -libc::EINVAL);
        assert_eq!(req(sys::UBLK_IO_OP_READ, 0, 32).execute(&vol, &mut buf), -libc::EINVAL);
        assert_eq!(req(sys::UBLK_IO_OP_WRITE, 0, 32).execute(&vol, &mut buf), -libc::EINVAL);
        assert_eq!(vol.allocation(0, 1 << 20).unwrap(), vec![(1 << 20, false)], "nothing was written");
        // A snapshot's handle is read-only.
        pool.create_snapshot("v", "s").unwrap();
        let snap = pool.open_snapshot("s").unwrap();
        assert_eq!(req(sys::UBLK_IO_OP_WRITE, 0, 8).execute(&snap, &mut buf), -libc::EROFS);
        assert_eq!(req(sys::UBLK_IO_OP_READ, 0, 8).execute(&snap, &mut buf), 4096);
        // A deleted volume's handle.
        drop(snap);
        pool.delete_volume("v").unwrap();
        assert_eq!(req(sys::UBLK_IO_OP_READ, 0, 8).execute(&vol, &mut buf), -libc::ENODEV);
    }
}
