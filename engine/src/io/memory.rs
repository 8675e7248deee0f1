//! The in-memory backend: a byte vector, for tests and for the crash simulator's base.

use std::io;

use parking_lot::RwLock;

use super::{Backend, check_request};

/// A store held in memory. `sync` is a no-op: nothing here survives the process.
#[derive(Debug)]
pub struct MemoryBackend {
    data: RwLock<Vec<u8>>,
}

impl MemoryBackend {
    /// A zero-filled store of `len` bytes.
    pub fn new(len: u64) -> Self {
        let len = usize::try_from(len).expect("in-memory store fits the address space");
        Self { data: RwLock::new(vec![0; len]) }
    }

    /// As [`MemoryBackend::new`], with every page touched now, as a memory device's would be:
    /// writes to a fresh part of the store then cost no page fault (benches).
    pub fn committed(len: u64) -> Self {
        let this = Self::new(len);
        for page in this.data.write().chunks_mut(4096) {
            // SAFETY: `page` is a live, exclusive slice of at least one byte; a volatile write
            // keeps the compiler from dropping a store of the value the byte already has.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
        this
    }
}

impl Backend for MemoryBackend {
    fn len(&self) -> u64 {
        self.data.read().len() as u64
    }

    fn in_memory(&self) -> bool {
        true
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let data = self.data.read();
        check_request(buf.len(), offset, data.len() as u64, buf.as_ptr())?;
        let off = usize::try_from(offset).expect("checked against the length");
        buf.copy_from_slice(&data[off..off + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut data = self.data.write();
        check_request(buf.len(), offset, data.len() as u64, buf.as_ptr())?;
        let off = usize::try_from(offset).expect("checked against the length");
        data[off..off + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
}
