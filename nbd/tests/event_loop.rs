//! The connection's event loop in each of its ways of doing I/O — store reads on its io_uring,
//! store reads through the engine (a store that is not a file), and blocking calls (no
//! io_uring) — serves one pipelined script of every request kind with the same, exact results;
//! and again under limits so tight that the loop stops taking requests again and again until
//! replies drain (backpressure changes when requests run, never what they return).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use ferrite_engine::io::MemoryBackend;
use ferrite_engine::{Pool, PoolOptions};
use ferrite_nbd::Export;
use ferrite_nbd::event_loop::serve;
use ferrite_nbd::handshake::Session;
use ferrite_nbd::limits::{Budget, Limits};
use ferrite_nbd::proto::*;

const SIZE: u64 = 64 << 20;
const BLOCK: u64 = 4096;

fn byte(offset: u64, seed: u64) -> u8 {
    u8::try_from((offset / 512 + seed * 7) % 251).expect("below 251") + 1
}

/// `[offset, offset + len)` as an index range of the model.
fn span(offset: u64, len: u64) -> std::ops::Range<usize> {
    usize::try_from(offset).unwrap()..usize::try_from(offset + len).unwrap()
}

/// The client: sends a batch of requests at once, then reads every reply (simple replies, so a
/// read's data follows its header), and checks each against the model of the volume.
struct Client {
    sock: UnixStream,
    model: Vec<u8>,
    cookie: u64,
}

enum Op {
    Write { offset: u64, len: u64, seed: u64, fua: bool },
    Read { offset: u64, len: u64 },
    Trim { offset: u64, len: u64 },
    Zeroes { offset: u64, len: u64 },
    Flush,
}

impl Client {
    /// Sends `ops` pipelined, then checks every reply: all succeed, reads return the model as it
    /// was before the batch (a batch never reads what it writes).
    fn batch(&mut self, ops: &[Op]) {
        let mut bytes = Vec::new();
        let mut reads = HashMap::new();
        let before = self.model.clone();
        for op in ops {
            self.cookie += 1;
            let (kind, flags, offset, len) = match *op {
                Op::Write { offset, len, seed, fua } => {
                    let data: Vec<u8> = (offset..offset + len).map(|o| byte(o, seed)).collect();
                    self.model[span(offset, len)].copy_from_slice(&data);
                    let r = Request {
                        flags: if fua { CMD_FLAG_FUA } else { 0 },
                        kind: CMD_WRITE,
                        cookie: self.cookie,
                        offset,
                        length: u32::try_from(len).unwrap(),
                    };
                    bytes.extend_from_slice(&r.encode());
                    bytes.extend_from_slice(&data);
                    continue;
                }
                Op::Read { offset, len } => {
                    reads.insert(self.cookie, (offset, len));
                    (CMD_READ, 0, offset, len)
                }
                Op::Trim { offset, len } | Op::Zeroes { offset, len } => {
                    self.model[span(offset, len)].fill(0);
                    (if matches!(op, Op::Trim { .. }) { CMD_TRIM } else { CMD_WRITE_ZEROES }, 0, offset, len)
                }
                Op::Flush => (CMD_FLUSH, 0, 0, 0),
            };
            let length = u32::try_from(len).unwrap();
            bytes.extend_from_slice(&Request { flags, kind, cookie: self.cookie, offset, length }.encode());
        }
        let mut writer = self.sock.try_clone().unwrap();
        let sender = std::thread::spawn(move || writer.write_all(&bytes).unwrap());
        for _ in 0..ops.len() {
            let mut h = [0u8; 16];
            self.sock.read_exact(&mut h).unwrap();
            assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), SIMPLE_REPLY_MAGIC);
            let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
            let cookie = u64::from_be_bytes(h[8..].try_into().unwrap());
            assert_eq!(error, 0, "cookie {cookie}");
            if let Some((offset, len)) = reads.remove(&cookie) {
                let mut data = vec![0u8; span(0, len).len()];
                self.sock.read_exact(&mut data).unwrap();
                let want = &before[span(offset, len)];
                assert!(data == want, "read of {len} bytes at {offset} (cookie {cookie}) differs");
            }
        }
        assert!(reads.is_empty());
        sender.join().unwrap();
    }
}

/// A deterministic stream of ranges, block-aligned or not.
struct Rng(u64);

impl Rng {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }

    fn range(&mut self, max_len: u64, aligned: bool) -> (u64, u64) {
        let unit = if aligned { BLOCK } else { 1 };
        let len = (1 + self.next(max_len / unit)) * unit;
        let offset = self.next((SIZE - len) / unit) * unit;
        (offset, len)
    }
}

fn script(c: &mut Client) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    // Scattered writes of every size the loop treats differently: small ones it runs itself,
    // large and FUA ones its helpers run; a third are not block-aligned, so some share a block.
    // Writes in flight together never overlap: NBD lets a server run them in any order (and
    // the loop and its helpers do), so a client that cares about order waits for the reply.
    for round in 0..4u64 {
        let mut ops: Vec<Op> = Vec::new();
        for i in 0..48 {
            let (offset, len) = loop {
                let (offset, len) = rng.range(if i % 8 == 0 { 1 << 20 } else { 64 << 10 }, i % 3 != 0);
                let apart = |op: &Op| matches!(*op, Op::Write { offset: o, len: l, .. } if o + l <= offset || offset + len <= o);
                if ops.iter().all(apart) {
                    break (offset, len);
                }
            };
            ops.push(Op::Write { offset, len, seed: round * 100 + i, fua: i % 11 == 0 });
        }
        c.batch(&ops);
    }
    c.batch(&[Op::Flush]);
    // Reads of every size (one too large to share a batch), over written ranges and holes.
    let ops: Vec<Op> = (0..200)
        .map(|i| {
            let (offset, len) = rng.range(if i % 10 == 0 { 2 << 20 } else { 128 << 10 }, i % 2 == 0);
            Op::Read { offset, len }
        })
        .collect();
    c.batch(&ops);
    let mut ops: Vec<Op> = (0..16)
        .map(|i| {
            let (offset, len) = rng.range(256 << 10, true);
            if i % 2 == 0 { Op::Trim { offset, len } } else { Op::Zeroes { offset, len } }
        })
        .collect();
    ops.push(Op::Flush);
    c.batch(&ops);
    // The whole volume, back to back as a sequential reader does (readahead joins in).
    let ops: Vec<Op> = (0..SIZE / (256 << 10)).map(|i| Op::Read { offset: i * (256 << 10), len: 256 << 10 }).collect();
    c.batch(&ops);
}

fn run(pool: &Pool, ring: bool) {
    run_with(pool, ring, Arc::new(Limits::default()));
}

/// Limits that a single request of the script can fill alone.
fn tight() -> Arc<Limits> {
    Arc::new(Limits {
        connection_bytes: 512 << 10,
        connection_requests: 3,
        memory: Budget::new(1 << 20),
        ..Limits::default()
    })
}

fn run_with(pool: &Pool, ring: bool, limits: Arc<Limits>) {
    pool.create_volume("v", SIZE).unwrap();
    let export = Arc::new(Export::new("v", pool.open_volume("v").unwrap(), false, ""));
    let session =
        Session { export: Arc::clone(&export), structured: false, base_allocation: false, changed: None, depth: false };
    let (client, server) = UnixStream::pair().unwrap();
    let l = Arc::clone(&limits);
    let served = std::thread::spawn(move || serve(&server, &session, &l, ring));
    client.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
    let mut c = Client { sock: client, model: vec![0u8; span(0, SIZE).len()], cookie: 0 };
    script(&mut c);
    // A disconnect ends the loop cleanly.
    c.sock.write_all(&Request { flags: 0, kind: CMD_DISC, cookie: 0, offset: 0, length: 0 }.encode()).unwrap();
    served.join().unwrap().unwrap();
    let mut rest = Vec::new();
    assert_eq!(c.sock.read_to_end(&mut rest).unwrap(), 0, "nothing after the last reply");
    assert_eq!(export.metrics.errors.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(limits.memory.used(), 0, "every request released what it held");
    // The script's writes of 64-128 KiB grow the receive buffer; the connection gives it back.
    assert_eq!(limits.receive_buffers.peak(), 448 << 10);
    assert_eq!(limits.receive_buffers.used(), 0);
    assert!(limits.memory.peak() <= limits.memory.cap().max(2 * (2 << 20) + 256), "{}", limits.memory.peak());
}

fn file_pool(dir: &tempfile::TempDir) -> Pool {
    Pool::create(&dir.path().join("pool.img"), &dir.path().join("meta"), 512 << 20, PoolOptions::default()).unwrap()
}

#[test]
fn store_reads_on_the_loops_ring() {
    let dir = tempfile::tempdir().unwrap();
    let pool = file_pool(&dir);
    run(&pool, true);
}

#[test]
fn store_reads_through_the_engine_for_a_store_that_is_not_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let pool =
        Pool::create_on(Arc::new(MemoryBackend::new(512 << 20)), &dir.path().join("meta"), PoolOptions::default())
            .unwrap();
    run(&pool, true);
}

#[test]
fn blocking_calls_without_io_uring() {
    let dir = tempfile::tempdir().unwrap();
    run(&file_pool(&dir), false);
}

#[test]
fn tight_limits_on_the_ring() {
    let dir = tempfile::tempdir().unwrap();
    run_with(&file_pool(&dir), true, tight());
}

#[test]
fn tight_limits_with_blocking_calls() {
    let dir = tempfile::tempdir().unwrap();
    run_with(&file_pool(&dir), false, tight());
}

/// `n` read requests of `len` bytes each, back to back from offset 0; read `i` has cookie `i`.
fn pipelined_reads(n: u64, len: u64) -> Vec<u8> {
    let length = u32::try_from(len).unwrap();
    (0..n).flat_map(|i| Request { flags: 0, kind: CMD_READ, cookie: i, offset: i * len, length }.encode()).collect()
}

/// A client that sends many large reads before it reads a reply: the loop goes on finishing
/// reads while the first replies wait for room in the socket (a loop that waited in its write
/// would finish one or two and then stop until the client read).
#[test]
fn reads_go_on_while_replies_wait_for_the_client() {
    const READS: u64 = 16;
    const LEN: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let pool = file_pool(&dir);
    pool.create_volume("v", SIZE).unwrap();
    let volume = pool.open_volume("v").unwrap();
    let data: Vec<u8> = (0..READS * LEN).map(|i| byte(i, 3)).collect();
    volume.write(0, &data).unwrap();
    volume.flush().unwrap();
    let export = Arc::new(Export::new("v", volume, false, ""));
    let session =
        Session { export: Arc::clone(&export), structured: false, base_allocation: false, changed: None, depth: false };
    let limits = Arc::new(Limits::default());
    let (mut client, server) = UnixStream::pair().unwrap();
    let served = std::thread::spawn(move || serve(&server, &session, &limits, true));
    // A reply that fits the socket goes out on the spot: no sender thread yet.
    let small = Request { flags: 0, kind: CMD_READ, cookie: 99, offset: 0, length: 4096 };
    client.write_all(&small.encode()).unwrap();
    let mut reply = vec![0u8; 16 + 4096];
    client.read_exact(&mut reply).unwrap();
    assert!(reply[16..] == data[..4096]);
    let senders = || export.metrics.senders_started.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(senders(), 0);
    client.write_all(&pipelined_reads(READS, LEN)).unwrap();
    // No reply is read yet: every read is still served (its bytes counted once it is finished).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while export.metrics.read_bytes.load(std::sync::atomic::Ordering::Relaxed) < READS * LEN {
        assert!(std::time::Instant::now() < deadline, "reads stopped while the first replies waited for the client");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(senders(), 1);
    // The replies, in whatever order, each whole and right.
    for _ in 0..READS {
        let mut h = [0u8; 16];
        client.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[4..8].try_into().unwrap()), 0);
        let i = u64::from_be_bytes(h[8..].try_into().unwrap());
        let mut got = vec![0u8; span(0, LEN).len()];
        client.read_exact(&mut got).unwrap();
        assert!(got == data[span(i * LEN, LEN)], "read {i}");
    }
    client.write_all(&Request { flags: 0, kind: CMD_DISC, cookie: 0, offset: 0, length: 0 }.encode()).unwrap();
    served.join().unwrap().unwrap();
}

/// A client that never reads its replies is cut once a reply could not be written for the
/// socket's send timeout, and the connection's threads end.
#[test]
fn a_client_that_does_not_read_its_replies_is_cut_after_the_send_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let pool = file_pool(&dir);
    pool.create_volume("v", SIZE).unwrap();
    let export = Arc::new(Export::new("v", pool.open_volume("v").unwrap(), false, ""));
    let session = Session { export, structured: false, base_allocation: false, changed: None, depth: false };
    let (mut client, server) = UnixStream::pair().unwrap();
    server.set_write_timeout(Some(std::time::Duration::from_millis(500))).unwrap();
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(serve(&server, &session, &Limits::default(), true)));
    client.write_all(&pipelined_reads(16, 1 << 20)).unwrap();
    let ended = ended.recv_timeout(std::time::Duration::from_secs(20)).expect("the connection was cut");
    assert!(ended.is_ok(), "{ended:?}");
    // What the socket held before the cut can still be read; then the stream ends.
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    assert!(rest.len() < 16 * (1 << 20), "not every reply went out: {}", rest.len());
}
