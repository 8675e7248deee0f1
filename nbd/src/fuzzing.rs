//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the in-suite property tests:
//! arbitrary client bytes thrown at negotiation and at the request decoder.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::export::Exports;
use crate::handshake::negotiate;
use crate::inbox;

/// Feeds `input` as everything a client sends during negotiation, against an empty export set.
/// Must never panic or hang; returns whether negotiation ended in a session (it cannot here).
pub fn handshake(input: &[u8]) -> bool {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        let exports = Arc::new(Exports::default());
        let input = input.to_vec();
        let feeder = tokio::spawn(async move {
            let _ = client.write_all(&input).await;
            let _ = client.shutdown().await;
            // Drain what the server says so it never blocks on a full pipe.
            let mut sink = vec![0u8; 1 << 16];
            while matches!(client.read(&mut sink).await, Ok(n) if n > 0) {}
        });
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), negotiate(&mut server, &exports)).await;
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
