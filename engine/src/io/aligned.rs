//! A heap buffer aligned to [`BLOCK`], as O_DIRECT requires.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use super::BLOCK;

/// A zero-initialised, [`BLOCK`]-aligned byte buffer whose length is a multiple of [`BLOCK`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>; no interior mutability.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only permit reads of the owned bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to a whole number of blocks (at least one).
    pub fn new(len: usize) -> Self {
        let len = len.div_ceil(BLOCK).max(1) * BLOCK;
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (len >= BLOCK).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, BLOCK).expect("buffer size fits a Layout")
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr points to `len` initialised bytes owned by self for its lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated in `new` with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_rounded() {
        let b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 2 * BLOCK);
        assert_eq!(b.as_ptr() as usize % BLOCK, 0);
        assert!(b.iter().all(|&x| x == 0));
        assert_eq!(AlignedBuf::new(0).len(), BLOCK);
    }
}
