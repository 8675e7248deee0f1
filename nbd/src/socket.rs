//! The socket a connection is served over: a Unix or TCP stream, or TLS over one
//! (`tls.rs`), read and written from different threads.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::AsRawFd;

/// A connected, blocking socket whose read and write sides can be used from different threads.
pub trait Socket: AsRawFd + std::os::fd::AsFd + Send + Sync {
    /// Reads at most `buf.len()` bytes; 0 means the peer closed its side.
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize>;
    fn write_all(&self, buf: &[u8]) -> io::Result<()>;
    /// Writes all of `bufs` (one syscall for all of them when the socket takes them).
    fn write_all_vectored(&self, bufs: &mut [IoSlice<'_>]) -> io::Result<()>;
    /// Whether the bytes on the descriptor are the protocol's own (not TLS records), so the
    /// connection's io_uring may receive them itself.
    fn receives_raw(&self) -> bool {
        true
    }
}

macro_rules! socket_impl {
    ($t:ty) => {
        impl Socket for $t {
            fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
                Read::read(&mut &*self, buf)
            }
            fn write_all(&self, buf: &[u8]) -> io::Result<()> {
                Write::write_all(&mut &*self, buf)
            }
            fn write_all_vectored(&self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
                while !bufs.is_empty() {
                    match Write::write_vectored(&mut &*self, bufs) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
        }
    };
}
socket_impl!(std::os::unix::net::UnixStream);
socket_impl!(std::net::TcpStream);
