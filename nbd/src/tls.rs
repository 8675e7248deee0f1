//! NBD over TLS: `NBD_OPT_STARTTLS` during negotiation (on the runtime, tokio-rustls), then a
//! blocking TLS socket for transmission (rustls driven by hand, so that the connection's loop
//! and its helper threads can receive and send at once, as they do on a plain socket).

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;

use ferrite_tls::ServerTls;
pub use ferrite_tls::Stream;
use ferrite_tls::rustls::ServerConnection;
use parking_lot::Mutex;

use crate::socket::Socket;

/// Whether a listener offers TLS, and whether it insists on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// STARTTLS is refused (`NBD_REP_ERR_POLICY`).
    #[default]
    Off,
    /// STARTTLS is accepted; plaintext clients are served too.
    Allow,
    /// Every option but STARTTLS and ABORT is refused with `NBD_REP_ERR_TLS_REQD` until TLS is up.
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "allow" => Ok(Self::Allow),
            "require" => Ok(Self::Require),
            _ => Err(format!("{s:?} is not a TLS mode (off, allow or require)")),
        }
    }
}

/// Whether a verified client certificate's identity holds the role that opens exports.
pub type RoleCheck = Arc<dyn Fn(&ferrite_tls::CertificateDer<'_>) -> bool + Send + Sync>;

/// A listener's TLS: its mode and, unless off, the acceptor (certificate, client verification).
#[derive(Clone, Default)]
pub struct Tls {
    pub mode: TlsMode,
    pub acceptor: Option<Arc<ServerTls>>,
    /// With it, a client certificate whose identity lacks the role opens only exports whose
    /// allow list names it; None: any certificate the CA signed is judged by allow lists alone.
    pub role: Option<RoleCheck>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("mode", &self.mode).field("role", &self.role.is_some()).finish_non_exhaustive()
    }
}

/// Ciphertext received per socket read.
const RECEIVE: usize = 64 << 10;

/// A blocking socket speaking TLS. The receiving side (one thread at a time: the connection's
/// loop) reads ciphertext without holding the session, then decrypts under its lock; senders
/// encrypt and write under the lock, in bounded pieces.
pub struct TlsSocket<S> {
    sock: S,
    session: Mutex<ServerConnection>,
    inbound: Mutex<Inbound>,
}

/// Ciphertext received and not yet given to the session (`buf[start..end]`).
struct Inbound {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl<S> std::fmt::Debug for TlsSocket<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSocket").finish_non_exhaustive()
    }
}

impl<S: Socket> TlsSocket<S> {
    pub fn new(sock: S, session: ServerConnection) -> Self {
        let inbound = Inbound { buf: vec![0u8; RECEIVE].into_boxed_slice(), start: 0, end: 0 };
        Self { sock, session: Mutex::new(session), inbound: Mutex::new(inbound) }
    }

    /// Writes whatever the session has to send (under its lock).
    fn flush_tls(&self, session: &mut ServerConnection) -> io::Result<()> {
        struct W<'a, S>(&'a S);
        impl<S: Socket> Write for W<'_, S> {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                self.0.write_all(buf).map(|()| buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        while session.wants_write() {
            session.write_tls(&mut W(&self.sock))?;
        }
        Ok(())
    }
}

fn tls_error(e: ferrite_tls::rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl<S: Socket> Socket for TlsSocket<S> {
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut inbound = self.inbound.lock();
        loop {
            let mut session = self.session.lock();
            match session.reader().read(buf) {
                Ok(n) => return Ok(n), // 0: the client closed the TLS session cleanly
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            // No plaintext left: decrypt more of what was received (the session takes in only
            // a bounded amount at a time), or receive more, without holding the session.
            let Inbound { buf: cipher, start, end } = &mut *inbound;
            if start == end {
                drop(session);
                let n = self.sock.read_some(cipher)?;
                if n == 0 {
                    return Ok(0);
                }
                (*start, *end) = (0, n);
                continue;
            }
            let mut rest = &cipher[*start..*end];
            let taken = session.read_tls(&mut rest)?;
            *start += taken;
            session.process_new_packets().map_err(tls_error)?;
            // Alerts, key updates: whatever the session must answer.
            self.flush_tls(&mut session)?;
        }
    }

    fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        let mut session = self.session.lock();
        while !buf.is_empty() {
            // The session buffers a bounded amount of plaintext; send it and go on.
            let n = session.writer().write(buf)?;
            if n == 0 && !session.wants_write() {
                return Err(io::ErrorKind::WriteZero.into());
            }
            buf = &buf[n..];
            self.flush_tls(&mut session)?;
        }
        Ok(())
    }

    fn write_all_vectored(&self, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        bufs.iter().try_for_each(|b| self.write_all(b))
    }

    fn receives_raw(&self) -> bool {
        false
    }
}

impl<S: AsRawFd> AsRawFd for TlsSocket<S> {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl<S: AsFd> AsFd for TlsSocket<S> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}
