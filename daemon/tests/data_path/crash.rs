//! kill -9 the daemon while a client writes; restart. With periodic flushes: everything
//! acknowledged before the last completed flush reads back, and every other block holds one of
//! the contents written to it (never garbage). Without any flush: every acknowledged write reads
//! back exactly, since a process crash is not a power cut (the kernel kept what the daemon had
//! handed it), on plain and encrypted volumes and during a data-key rotation.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small values

use crate::common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Daemon;
use ferrite_nbd::proto::*;

const BLOCKS: u64 = 2048;

/// A minimal blocking NBD client: fixed newstyle, NBD_OPT_GO, simple replies.
struct Client(UnixStream);

impl Client {
    fn connect(sock: &std::path::Path, export: &str) -> std::io::Result<Self> {
        let mut s = UnixStream::connect(sock)?;
        let mut greet = [0u8; 18];
        s.read_exact(&mut greet)?;
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
        let mut data = (export.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut opt = IHAVEOPT.to_be_bytes().to_vec();
        opt.extend_from_slice(&OPT_GO.to_be_bytes());
        opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
        opt.extend_from_slice(&data);
        s.write_all(&opt)?;
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h)?;
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let mut skip = vec![0u8; len];
            s.read_exact(&mut skip)?;
            if kind == REP_ACK {
                return Ok(Self(s));
            }
            assert!(kind < (1 << 31), "NBD_OPT_GO refused: {kind:#x}");
        }
    }

    fn request(&mut self, kind: u16, offset: u64, length: u32, payload: &[u8]) -> std::io::Result<u32> {
        let r = Request { flags: 0, kind, cookie: 1, offset, length };
        self.0.write_all(&r.encode())?;
        self.0.write_all(payload)?;
        let mut h = [0u8; 16];
        self.0.read_exact(&mut h)?;
        Ok(u32::from_be_bytes(h[4..8].try_into().unwrap()))
    }

    fn read(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let err = self.request(CMD_READ, offset, buf.len() as u32, &[])?;
        assert_eq!(err, 0);
        self.0.read_exact(buf)
    }
}

fn block(seed: u64) -> Vec<u8> {
    common::pattern(seed, 4096)
}

#[derive(Default)]
struct History {
    /// (write index, block, seed) of every write sent (the last may be unacknowledged), in order.
    writes: Vec<(u64, u64, u64)>,
    /// Every write with an index below this was acknowledged before a completed flush.
    flushed_before: u64,
}

#[test]
fn kill_9_keeps_everything_flushed() {
    for round in 0..2u64 {
        let dir = tempfile::tempdir().unwrap();
        let mut d = Daemon::start(dir.path());
        d.ok(&["volume", "create", "v", "8M"]);
        d.ok(&["export", "nbd", "v"]);
        let history = Arc::new(Mutex::new(History::default()));
        let writer = {
            let (history, sock) = (Arc::clone(&history), d.nbd());
            std::thread::spawn(move || {
                let mut c = Client::connect(&sock, "v").unwrap();
                let mut x = 0x1234_5678u64 + round;
                for i in 0u64.. {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let (blk, seed) = (x % BLOCKS, x);
                    history.lock().unwrap().writes.push((i, blk, seed));
                    if c.request(CMD_WRITE, blk * 4096, 4096, &block(seed)).is_err() {
                        return;
                    }
                    if i % 16 == 15 {
                        match c.request(CMD_FLUSH, 0, 0, &[]) {
                            Ok(0) => history.lock().unwrap().flushed_before = i + 1,
                            _ => return,
                        }
                    }
                }
            })
        };
        std::thread::sleep(Duration::from_millis(1500 + round * 700));
        d.crash();
        writer.join().unwrap();
        let h = history.lock().unwrap();
        assert!(h.flushed_before > 64, "the client made progress before the crash ({})", h.flushed_before);

        let d = Daemon::start(dir.path());
        let mut c = Client::connect(&d.nbd(), "v").unwrap();
        let mut checked = 0;
        for blk in 0..BLOCKS {
            let mine: Vec<&(u64, u64, u64)> = h.writes.iter().filter(|w| w.1 == blk).collect();
            let covered = mine.iter().rev().find(|w| w.0 < h.flushed_before).map(|w| block(w.2));
            let mut allowed: Vec<Vec<u8>> = vec![covered.unwrap_or_else(|| vec![0; 4096])];
            allowed.extend(mine.iter().filter(|w| w.0 >= h.flushed_before).map(|w| block(w.2)));
            let mut got = vec![0u8; 4096];
            c.read(blk * 4096, &mut got).unwrap();
            assert!(
                allowed.contains(&got),
                "round {round} block {blk}: content after kill -9 is neither the flushed one nor a later write"
            );
            checked += 1;
        }
        assert_eq!(checked, BLOCKS);
        let log = d.log();
        assert!(log.contains("pool opened"), "{log}");
    }
}

/// The next value of a xorshift generator.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

const VOLUME: u64 = 48 << 20;

/// One write a client sent: where, how long, its bytes' seed.
#[derive(Clone, Copy)]
struct Sent {
    offset: u64,
    len: usize,
    seed: u64,
}

/// A write of mixed size and alignment: mostly single blocks, some partial blocks (read-modify-
/// write), some through the open batch's largest (128 KiB), some batches of their own (1 MiB).
fn mixed(x: &mut u64) -> Sent {
    let r = next(x);
    let len = match r % 16 {
        0..=8 => 4096,
        9 | 10 => 512 * (1 + (r >> 8) % 7) as usize,
        11 | 12 => 64 << 10,
        13 => 128 << 10,
        14 => 256 << 10,
        _ => 1 << 20,
    };
    let align = if len % 4096 == 0 { 4096 } else { 512 };
    let offset = (next(x) % (VOLUME - len as u64)) / align * align;
    Sent { offset, len, seed: next(x) }
}

#[test]
fn kill_9_loses_no_acknowledged_write() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let size = format!("{}MiB", VOLUME >> 20);
    d.ok(&["volume", "create", "plain", &size]);
    d.ok(&["volume", "create", "enc", &size, "--encrypt"]);
    d.ok(&["export", "nbd", "plain"]);
    d.ok(&["export", "nbd", "enc"]);
    let mut images = [vec![0u8; VOLUME as usize], vec![0u8; VOLUME as usize]];
    let mut x = 0x5eed_u64;
    let (mut from_tail, mut rotating_rounds) = (0u64, 0);
    for round in 0..24u64 {
        let (name, which) = if round % 2 == 0 { ("plain", 0) } else { ("enc", 1) };
        // Every fourth round starts a data-key rotation of the encrypted volume, which then runs
        // (and resumes after each restart) under the writes and kills of the rounds that follow.
        if round % 4 == 1 {
            let rotating = d.json(&["volume", "show", "enc"])["encryption"].get("rotation").is_some();
            if !rotating {
                d.ok(&["volume", "rekey", "enc", "--data-key", "--detach"]);
            }
        }
        if which == 1 && d.json(&["volume", "show", "enc"])["encryption"].get("rotation").is_some() {
            rotating_rounds += 1;
        }
        let acked = Arc::new(Mutex::new((Vec::<Sent>::new(), None::<Sent>)));
        let writer = {
            let (acked, sock, mut x) = (Arc::clone(&acked), d.nbd(), next(&mut x));
            std::thread::spawn(move || {
                let mut c = Client::connect(&sock, name).unwrap();
                loop {
                    let w = mixed(&mut x);
                    acked.lock().unwrap().1 = Some(w);
                    match c.request(CMD_WRITE, w.offset, w.len as u32, &common::pattern(w.seed, w.len)) {
                        Ok(0) => {
                            let mut a = acked.lock().unwrap();
                            a.0.push(w);
                            a.1 = None;
                        }
                        _ => return,
                    }
                }
            })
        };
        std::thread::sleep(Duration::from_millis(50 + next(&mut x) % 650));
        d.crash();
        writer.join().unwrap();
        let (sent, unacked) = std::mem::take(&mut *acked.lock().unwrap());
        assert!(!sent.is_empty(), "round {round}: the client wrote before the kill");
        let image = &mut images[which];
        for w in &sent {
            image[w.offset as usize..w.offset as usize + w.len].copy_from_slice(&common::pattern(w.seed, w.len));
        }

        d = Daemon::start(dir.path());
        let mut c = Client::connect(&d.nbd(), name).unwrap();
        let mut got = vec![0u8; VOLUME as usize];
        for (i, chunk) in got.chunks_mut(4 << 20).enumerate() {
            c.read(i as u64 * (4 << 20), chunk).unwrap();
        }
        // The write in flight at the kill may have landed or not, block by block.
        let mut with_unacked = image.clone();
        if let Some(w) = unacked {
            with_unacked[w.offset as usize..w.offset as usize + w.len].copy_from_slice(&common::pattern(w.seed, w.len));
        }
        for (blk, ((g, old), new)) in
            got.chunks(4096).zip(image.chunks(4096)).zip(with_unacked.chunks(4096)).enumerate()
        {
            assert!(
                g == old || g == new,
                "round {round} ({name}): block {blk} lost an acknowledged write after kill -9 ({} writes acknowledged)",
                sent.len()
            );
        }
        // What the unacknowledged write left is the volume's content from now on.
        image.copy_from_slice(&got);
        let log = d.log();
        let opened = log.lines().rev().find(|l| l.contains("pool opened")).unwrap().to_owned();
        assert!(opened.contains("truncated=\"no\""), "round {round}: recovery dropped a batch: {opened}");
        from_tail += opened
            .split("from_tail=")
            .nth(1)
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .expect("the pool opened line names the batches taken from the tail file");
    }
    // The kills fell where acknowledged writes were still only in the tail file, and rotations ran.
    assert!(from_tail > 0, "no round recovered a batch from the tail file");
    assert!(rotating_rounds > 0, "no round ran during a data-key rotation");
}
