//! What a client may hold of the server: bytes and requests in flight per connection, bytes in
//! flight over all connections, connections per listener, and how long a handshake or a stalled
//! reply may take.
//!
//! A request is *charged* when the connection takes it from its receive buffer (before any
//! buffer is allocated for it) and *released* once its reply was written. A connection whose
//! next request does not fit stops taking requests, and stops receiving, until replies drain:
//! backpressure, never an error. A connection with nothing in flight may always take one
//! request (waiting for the daemon-wide budget if it must), so every connection progresses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferrite_engine::ZERO_DATA_SLICE;
use parking_lot::{Condvar, Mutex};

use crate::handshake::MAX_REQUEST;
use crate::proto::{CMD_FLAG_NO_HOLE, CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES, Request};

/// What every request costs besides its data (its reply, bookkeeping).
const REQUEST_OVERHEAD: u64 = 256;

/// The limits of one server; every listener of the server shares them.
#[derive(Debug)]
pub struct Limits {
    /// Most bytes one connection holds in flight (a single request larger than this still
    /// runs, alone).
    pub connection_bytes: u64,
    /// Most requests one connection has in flight.
    pub connection_requests: usize,
    /// Bytes in flight over every connection.
    pub memory: Budget,
    /// Memory for grown receive buffers over every connection (see `inbox.rs`): a connection
    /// only ever tries for it, and keeps its small buffer when there is none left.
    pub receive_buffers: Budget,
    /// Most connections each listener serves at once; more are closed as they arrive.
    pub max_connections: usize,
    /// How long a client may take from connecting to the start of transmission.
    pub handshake_timeout: Duration,
    /// How long writing a reply may block on a client that does not read them; then the
    /// connection ends (and releases what it held).
    pub send_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connection_bytes: 64 << 20,
            connection_requests: 256,
            memory: Budget::new(1 << 30),
            receive_buffers: Budget::new(32 << 20),
            max_connections: 1024,
            handshake_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(60),
        }
    }
}

/// What a request costs while in flight: its data buffers (a read holds its store buffers and
/// its reply at once), or the slice buffer of a zeroing write, plus a fixed overhead.
pub fn cost(req: &Request) -> u64 {
    let len = u64::from(req.length);
    REQUEST_OVERHEAD
        + match req.kind {
            CMD_READ if req.length <= MAX_REQUEST => 2 * len,
            CMD_WRITE if req.length <= MAX_REQUEST => len,
            CMD_WRITE_ZEROES if req.flags & CMD_FLAG_NO_HOLE != 0 => len.min(ZERO_DATA_SLICE),
            _ => 0,
        }
}

/// A pool of bytes shared by every connection.
#[derive(Debug)]
pub struct Budget {
    cap: u64,
    used: Mutex<u64>,
    freed: Condvar,
    peak: AtomicU64,
}

impl Budget {
    pub fn new(cap: u64) -> Self {
        Self { cap, used: Mutex::new(0), freed: Condvar::new(), peak: AtomicU64::new(0) }
    }

    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Bytes in flight now, and the most ever.
    pub fn used(&self) -> u64 {
        *self.used.lock()
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes if they fit.
    pub fn try_take(&self, n: u64) -> bool {
        let mut used = self.used.lock();
        // One request more than the whole cap (a misconfiguration) is let through alone.
        if *used + n > self.cap && *used > 0 {
            return false;
        }
        *used += n;
        self.peak.fetch_max(*used, Ordering::Relaxed);
        true
    }

    /// Takes `n` bytes, waiting for other connections to release them.
    pub fn take(&self, n: u64) {
        let mut used = self.used.lock();
        while *used + n > self.cap && *used > 0 {
            self.freed.wait(&mut used);
        }
        *used += n;
        self.peak.fetch_max(*used, Ordering::Relaxed);
    }

    pub fn give(&self, n: u64) {
        let mut used = self.used.lock();
        *used -= n;
        self.freed.notify_all();
    }
}

/// What one connection has in flight, shared by its loop and its helper threads.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    used: Mutex<(u64, usize)>,
    released: Condvar,
}

impl InFlight {
    /// Charges `req` to this connection and the daemon; false (nothing charged) when it must
    /// wait for replies to drain first.
    pub fn admit(&self, limits: &Limits, req: &Request) -> bool {
        let c = cost(req);
        let mut used = self.used.lock();
        let idle = used.1 == 0;
        if !idle && (used.1 >= limits.connection_requests || used.0 + c > limits.connection_bytes) {
            return false;
        }
        if !limits.memory.try_take(c) {
            if !idle {
                return false;
            }
            // Nothing of ours to wait for: wait for the other connections.
            limits.memory.take(c);
        }
        used.0 += c;
        used.1 += 1;
        true
    }

    /// Releases requests whose replies were written.
    pub fn release(&self, limits: &Limits, bytes: u64, requests: usize) {
        if requests == 0 {
            return;
        }
        let mut used = self.used.lock();
        used.0 -= bytes;
        used.1 -= requests;
        limits.memory.give(bytes);
        self.released.notify_all();
    }

    /// Waits until something is released (or `timeout` passes).
    pub fn wait_release(&self, timeout: Duration) {
        let mut used = self.used.lock();
        if used.1 > 0 {
            self.released.wait_for(&mut used, timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(kind: u16, length: u32) -> Request {
        Request { flags: 0, kind, cookie: 0, offset: 0, length }
    }

    #[test]
    fn a_connection_is_held_to_its_caps_but_always_takes_one() {
        let limits = Limits { connection_bytes: 10 << 20, connection_requests: 3, ..Limits::default() };
        let f = InFlight::default();
        let big = req(CMD_READ, 32 << 20);
        assert!(f.admit(&limits, &big), "alone, a request larger than the cap runs");
        assert!(!f.admit(&limits, &req(CMD_READ, 4096)), "but nothing joins it");
        f.release(&limits, cost(&big), 1);
        for _ in 0..3 {
            assert!(f.admit(&limits, &req(CMD_WRITE, 4096)));
        }
        assert!(!f.admit(&limits, &req(CMD_WRITE, 4096)), "request cap");
        f.release(&limits, 3 * cost(&req(CMD_WRITE, 4096)), 3);
        assert_eq!(limits.memory.used(), 0);
        assert_eq!(limits.memory.peak(), cost(&big));
    }

    #[test]
    fn the_daemon_budget_is_shared_and_waited_for() {
        let limits = std::sync::Arc::new(Limits { memory: Budget::new(8 << 20), ..Limits::default() });
        let (a, b) = (std::sync::Arc::new(InFlight::default()), InFlight::default());
        let r = req(CMD_READ, 3 << 20);
        assert!(a.admit(&limits, &r));
        assert!(!a.admit(&limits, &r), "over the daemon's budget with something in flight: wait");
        // An idle connection waits for the budget instead of refusing.
        let (l2, a2) = (std::sync::Arc::clone(&limits), std::sync::Arc::clone(&a));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            a2.release(&l2, cost(&req(CMD_READ, 3 << 20)), 1);
        });
        assert!(b.admit(&limits, &r));
        t.join().unwrap();
        assert_eq!(limits.memory.used(), cost(&r));
        assert!(limits.memory.peak() <= 8 << 20);
    }

    #[test]
    fn costs() {
        assert_eq!(cost(&req(CMD_READ, 1 << 20)), (2 << 20) + REQUEST_OVERHEAD);
        assert_eq!(cost(&req(CMD_WRITE, MAX_REQUEST + 1)), REQUEST_OVERHEAD, "refused unread");
        let mut z = req(CMD_WRITE_ZEROES, u32::MAX);
        assert_eq!(cost(&z), REQUEST_OVERHEAD);
        z.flags = CMD_FLAG_NO_HOLE;
        assert_eq!(cost(&z), ZERO_DATA_SLICE + REQUEST_OVERHEAD);
    }
}
