//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the in-suite property tests:
//! arbitrary client bytes thrown at negotiation, at the request decoder, and at a whole
//! connection in transmission on a real export.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::export::{Export, Exports};
use crate::handshake::{Client, Session, negotiate};
use crate::inbox;
use crate::limits::{Budget, Limits};
use crate::tls::{Stream, Tls};

/// Feeds `input` as everything a client sends during negotiation, against an empty export set.
/// Must never panic or hang; returns whether negotiation ended in a session (it cannot here).
pub fn handshake(input: &[u8]) -> bool {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let exports = Arc::new(Exports::default());
        let input = input.to_vec();
        let feeder = tokio::spawn(async move {
            let _ = client.write_all(&input).await;
            let _ = client.shutdown().await;
            // Drain what the server says so it never blocks on a full pipe.
            let mut sink = vec![0u8; 1 << 16];
            while matches!(client.read(&mut sink).await, Ok(n) if n > 0) {}
        });
        let mut server = Stream::Plain(server);
        let (tls, ip) = (Tls::default(), Some(std::net::Ipv4Addr::LOCALHOST.into()));
        let negotiated = negotiate(&mut server, &exports, Client { ip, tls: &tls });
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), negotiated).await;
        drop(server);
        let _ = feeder.await;
        matches!(r, Ok(Ok(Some(_))))
    })
}

/// Feeds `input` to a connection's receive side ([`inbox::split`]) as a client's request
/// stream, in receives as long as its first byte says; returns how many events came out.
pub fn requests(input: &[u8]) -> usize {
    let step = usize::from(input.first().copied().unwrap_or(1).max(1));
    inbox::split(input, step).0.len()
}

/// Serves `input[1..]` as a client's whole request stream on `export`, as a connection in
/// transmission does (its event loop, helpers, engine calls), under limits small enough that
/// backpressure comes into play. `input[0]` picks structured replies, block status (base
/// allocation, allocation depth) and the ring. Must never panic or hang; returns the bytes of replies sent.
pub fn transmission(export: &Arc<Export>, input: &[u8]) -> usize {
    let Some((&mode, stream)) = input.split_first() else { return 0 };
    let structured = mode & 1 != 0;
    let session = Session {
        export: Arc::clone(export),
        structured,
        base_allocation: structured && mode & 2 != 0,
        changed: None,
        depth: structured && mode & 8 != 0,
    };
    let limits =
        Limits { connection_bytes: 1 << 20, connection_requests: 8, memory: Budget::new(4 << 20), ..Limits::default() };
    let (mut client, server) = UnixStream::pair().expect("socket pair");
    let mut reader = client.try_clone().expect("socket clone");
    let stream = stream.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = client.write_all(&stream);
        let _ = client.shutdown(std::net::Shutdown::Write);
    });
    let drain = std::thread::spawn(move || {
        let (mut sink, mut total) = (vec![0u8; 1 << 16], 0);
        while let Ok(n @ 1..) = reader.read(&mut sink) {
            total += n;
        }
        total
    });
    let _ = crate::event_loop::serve(&server, &session, &limits, mode & 4 != 0);
    // End the replies; take in whatever the client still sends (after a bad header the server
    // reads no more), so its writes never meet a closed socket.
    let _ = server.shutdown(std::net::Shutdown::Write);
    let _ = std::io::copy(&mut &server, &mut std::io::sink());
    let _ = feeder.join();
    drain.join().unwrap_or(0)
}
