//! A server-side connection that starts in plaintext and may switch to TLS.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::TlsAcceptor;

use crate::ServerTls;
use tokio_rustls::server::TlsStream;

/// A server-side connection: plaintext, or TLS once its handshake succeeded (at once, or after
/// a protocol's STARTTLS).
#[derive(Debug)]
pub enum Stream<S> {
    Plain(S),
    Tls(Box<TlsStream<S>>),
    /// Only while the TLS handshake runs (and after it failed).
    Broken,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Stream<S> {
    /// Runs the TLS handshake as the server, with the certificate `tls` holds now.
    pub async fn start_tls(&mut self, tls: &ServerTls) -> io::Result<()> {
        let acceptor = TlsAcceptor::from(tls.current());
        let Self::Plain(s) = std::mem::replace(self, Self::Broken) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "TLS is already on"));
        };
        *self = Self::Tls(Box::new(acceptor.accept(s).await?));
        Ok(())
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Self::Tls(_))
    }

    /// The application protocol the TLS handshake chose (ALPN), if any.
    pub fn alpn(&self) -> Option<&[u8]> {
        match self {
            Self::Tls(t) => t.get_ref().1.alpn_protocol(),
            _ => None,
        }
    }

    /// The client's certificate, verified against the CA, if it presented one over TLS.
    pub fn peer_certificate(&self) -> Option<&CertificateDer<'static>> {
        match self {
            Self::Tls(t) => t.get_ref().1.peer_certificates().and_then(|c| c.first()),
            _ => None,
        }
    }
}

fn broken() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the TLS handshake failed")
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(t) => Pin::new(t).poll_read(cx, buf),
            Self::Broken => Poll::Ready(Err(broken())),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(t) => Pin::new(t).poll_write(cx, buf),
            Self::Broken => Poll::Ready(Err(broken())),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(t) => Pin::new(t).poll_flush(cx),
            Self::Broken => Poll::Ready(Err(broken())),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(t) => Pin::new(t).poll_shutdown(cx),
            Self::Broken => Poll::Ready(Err(broken())),
        }
    }
}
