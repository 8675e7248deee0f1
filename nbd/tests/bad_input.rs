//! Malformed and hostile requests: each gets the error the protocol specifies or a clean
//! disconnect; the server keeps serving every other connection and no export's data changes.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small values

use crate::common;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use std::sync::Arc;
use std::time::Duration;

use common::{Harness, MIB};
use ferrite_nbd::proto::*;
use ferrite_nbd::{Export, Exports};

fn harness() -> Harness {
    let h = Harness::new(256 * MIB);
    for name in ["a", "b"] {
        h.pool.create_volume(name, 4 * MIB).unwrap();
        let volume = h.pool.open_volume(name).unwrap();
        volume.write(0, &vec![name.as_bytes()[0]; 4 * MIB as usize]).unwrap();
        h.exports.add(Export::new(name, volume, false, ""));
    }
    h
}

/// Both exports still hold exactly what they were filled with.
fn assert_untouched(h: &Harness) {
    for name in ["a", "b"] {
        let mut buf = vec![0u8; 4 * MIB as usize];
        h.pool.open_volume(name).unwrap().read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == name.as_bytes()[0]), "export {name} changed");
    }
}

fn timeout(s: &UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
}

/// Opens a connection and reads the greeting; sends the client flags.
fn hello(h: &Harness) -> UnixStream {
    let mut s = UnixStream::connect(h.sock()).unwrap();
    timeout(&s);
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    assert_eq!(&g[..8], &NBD_MAGIC.to_be_bytes());
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    s
}

fn option(s: &mut UnixStream, opt: u32, data: &[u8]) {
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&opt.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(data);
    s.write_all(&o).unwrap();
}

/// Reads one option reply: (reply type, payload).
fn option_reply(s: &mut UnixStream) -> (u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(&h[..8], &REP_MAGIC.to_be_bytes());
    let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let mut p = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
    s.read_exact(&mut p).unwrap();
    (kind, p)
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

/// A connection in transmission on export `name` with simple replies.
fn transmission(h: &Harness, name: &str) -> UnixStream {
    let mut s = hello(h);
    option(&mut s, OPT_GO, &go_data(name));
    loop {
        let (kind, _) = option_reply(&mut s);
        if kind == REP_ACK {
            return s;
        }
        assert_eq!(kind, REP_INFO);
    }
}

fn request(s: &mut UnixStream, kind: u16, flags: u16, offset: u64, length: u32) -> u32 {
    s.write_all(&Request { flags, kind, cookie: 42, offset, length }.encode()).unwrap();
    reply(s)
}

fn reply(s: &mut UnixStream) -> u32 {
    let mut r = [0u8; 16];
    s.read_exact(&mut r).unwrap();
    assert_eq!(&r[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
    assert_eq!(&r[8..16], &42u64.to_be_bytes(), "reply carries the request's cookie");
    u32::from_be_bytes(r[4..8].try_into().unwrap())
}

fn closed(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn negotiation_errors() {
    let h = harness();
    // Unknown option: NBD_REP_ERR_UNSUP, and negotiation goes on.
    let mut s = hello(&h);
    option(&mut s, 999, b"junk");
    assert_eq!(option_reply(&mut s).0, REP_ERR_UNSUP);
    // Unknown export with GO: NBD_REP_ERR_UNKNOWN with a message.
    option(&mut s, OPT_GO, &go_data("nope"));
    let (kind, msg) = option_reply(&mut s);
    assert_eq!(kind, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&msg).contains("nope"));
    // Malformed GO (name length past the payload): NBD_REP_ERR_INVALID.
    option(&mut s, OPT_GO, &[0, 0, 1, 0, b'a']);
    assert_eq!(option_reply(&mut s).0, REP_ERR_INVALID);
    // SET_META_CONTEXT before structured replies: invalid.
    option(&mut s, OPT_SET_META_CONTEXT, &[0, 0, 0, 1, b'a', 0, 0, 0, 0]);
    assert_eq!(option_reply(&mut s).0, REP_ERR_INVALID);
    // TLS is refused by policy; LIST with data is invalid.
    option(&mut s, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut s).0, REP_ERR_POLICY);
    option(&mut s, OPT_LIST, b"x");
    assert_eq!(option_reply(&mut s).0, REP_ERR_INVALID);
    // ABORT: acknowledged, then closed.
    option(&mut s, OPT_ABORT, &[]);
    assert_eq!(option_reply(&mut s).0, REP_ACK);
    assert!(closed(&mut s));

    // EXPORT_NAME with an unknown name has no error reply: the server disconnects.
    let mut s = hello(&h);
    option(&mut s, OPT_EXPORT_NAME, b"nope");
    assert!(closed(&mut s));
    // Bad option magic: disconnect.
    let mut s = hello(&h);
    s.write_all(&[0u8; 16]).unwrap();
    assert!(closed(&mut s));
    // An absurd option length: disconnect without trying to read it.
    let mut s = hello(&h);
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&OPT_GO.to_be_bytes());
    o.extend_from_slice(&u32::MAX.to_be_bytes());
    s.write_all(&o).unwrap();
    assert!(closed(&mut s));
    // Unknown client flags: disconnect.
    let mut s = UnixStream::connect(h.sock()).unwrap();
    timeout(&s);
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&0x8000_0000u32.to_be_bytes()).unwrap();
    assert!(closed(&mut s));
    assert_untouched(&h);
}

#[test]
fn transmission_errors_keep_the_connection_and_the_data() {
    let h = harness();
    let mut s = transmission(&h, "a");
    let size = 4 * MIB;
    // Out of range: EINVAL for reads, ENOSPC for writes (payload consumed, framing kept).
    assert_eq!(request(&mut s, CMD_READ, 0, size - 10, 4096), EINVAL);
    assert_eq!(request(&mut s, CMD_READ, 0, u64::MAX - 100, 4096), EINVAL);
    s.write_all(&Request { flags: 0, kind: CMD_WRITE, cookie: 42, offset: size, length: 512 }.encode()).unwrap();
    s.write_all(&[9u8; 512]).unwrap();
    assert_eq!(reply(&mut s), ENOSPC);
    assert_eq!(request(&mut s, CMD_TRIM, 0, size, 4096), EINVAL);
    assert_eq!(request(&mut s, CMD_WRITE_ZEROES, 0, size - 1, 2), ENOSPC);
    // Oversized read: refused.
    assert_eq!(request(&mut s, CMD_READ, 0, 0, 64 << 20), EINVAL);
    // Oversized write: its payload is skipped and the write refused.
    s.write_all(&Request { flags: 0, kind: CMD_WRITE, cookie: 42, offset: 0, length: 33 << 20 }.encode()).unwrap();
    s.write_all(&vec![7u8; 33 << 20]).unwrap();
    assert_eq!(reply(&mut s), EOVERFLOW);
    // Flags a command does not take (unknown bits, DF without structured replies, NO_HOLE on a
    // plain write): EINVAL, and a write so refused writes nothing. FUA goes with any command.
    s.write_all(&Request { flags: 1 << 9, kind: CMD_WRITE, cookie: 42, offset: 0, length: 512 }.encode()).unwrap();
    s.write_all(&[9u8; 512]).unwrap();
    assert_eq!(reply(&mut s), EINVAL);
    s.write_all(&Request { flags: CMD_FLAG_NO_HOLE, kind: CMD_WRITE, cookie: 42, offset: 0, length: 512 }.encode())
        .unwrap();
    s.write_all(&[9u8; 512]).unwrap();
    assert_eq!(reply(&mut s), EINVAL);
    assert_eq!(request(&mut s, CMD_READ, CMD_FLAG_DF, 0, 4096), EINVAL);
    assert_eq!(request(&mut s, CMD_FLUSH, 0x8000, 0, 0), EINVAL);
    assert_eq!(request(&mut s, CMD_TRIM, CMD_FLAG_REQ_ONE, 0, 4096), EINVAL);
    assert_eq!(request(&mut s, CMD_FLUSH, CMD_FLAG_FUA, 0, 0), 0);
    // Unknown command: EINVAL. Block status without a negotiated context: EINVAL.
    assert_eq!(request(&mut s, 77, 0, 0, 0), EINVAL);
    assert_eq!(request(&mut s, CMD_BLOCK_STATUS, 0, 0, 4096), EINVAL);
    // The connection still works.
    assert_eq!(request(&mut s, CMD_FLUSH, 0, 0, 0), 0);
    s.write_all(&Request { flags: 0, kind: CMD_READ, cookie: 42, offset: 100, length: 10 }.encode()).unwrap();
    assert_eq!(reply(&mut s), 0);
    let mut data = [0u8; 10];
    s.read_exact(&mut data).unwrap();
    assert_eq!(data, [b'a'; 10]);
    // Bad request magic: the server disconnects.
    s.write_all(&[0xFFu8; REQUEST_LEN]).unwrap();
    assert!(closed(&mut s));
    assert_untouched(&h);
}

#[test]
fn disconnect_mid_write_changes_nothing_and_others_keep_working() {
    let h = harness();
    let mut other = transmission(&h, "b");
    for _ in 0..5 {
        let mut s = transmission(&h, "a");
        s.write_all(&Request { flags: 0, kind: CMD_WRITE, cookie: 42, offset: 0, length: 1 << 20 }.encode()).unwrap();
        s.write_all(&vec![0xEEu8; 300 << 10]).unwrap(); // payload shorter than announced
        drop(s);
    }
    // A connection on the other export is unaffected, and so is a new one on the first.
    assert_eq!(request(&mut other, CMD_FLUSH, 0, 0, 0), 0);
    let mut s = transmission(&h, "a");
    assert_eq!(request(&mut s, CMD_FLUSH, 0, 0, 0), 0);
    std::thread::sleep(Duration::from_millis(100));
    assert_untouched(&h);
}

#[test]
fn read_only_export_refuses_every_write_kind() {
    let h = harness();
    let exports = Arc::new(Exports::default());
    let volume = h.pool.open_volume("a").unwrap();
    exports.add(Export::new("ro", volume, true, ""));
    let sock = h.dir.path().join("ro.sock");
    h.serve(exports, &sock);
    let mut s = UnixStream::connect(&sock).unwrap();
    timeout(&s);
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    option(&mut s, OPT_GO, &go_data("ro"));
    while option_reply(&mut s).0 != REP_ACK {}
    s.write_all(&Request { flags: 0, kind: CMD_WRITE, cookie: 42, offset: 0, length: 4 }.encode()).unwrap();
    s.write_all(&[1, 2, 3, 4]).unwrap();
    assert_eq!(reply(&mut s), EPERM);
    assert_eq!(request(&mut s, CMD_TRIM, 0, 0, 4096), EPERM);
    assert_eq!(request(&mut s, CMD_WRITE_ZEROES, 0, 0, 4096), EPERM);
    assert_untouched(&h);
}

#[test]
fn kernel_attach_handshake_gets_size_and_flags_or_a_clear_refusal() {
    let h = harness();
    let mut s = UnixStream::connect(h.sock()).unwrap();
    timeout(&s);
    let (size, flags) = ferrite_nbd::kernel::negotiate_client(&mut s, "a").unwrap();
    assert_eq!(size, h.pool.volume_info("a").unwrap().size);
    assert!(flags & TF_SEND_FLUSH != 0 && flags & TF_READ_ONLY == 0);
    // The connection is in transmission now: a flush gets a simple reply.
    assert_eq!(request(&mut s, CMD_FLUSH, 0, 0, 0), 0);
    let mut s = UnixStream::connect(h.sock()).unwrap();
    timeout(&s);
    let err = ferrite_nbd::kernel::negotiate_client(&mut s, "nope").unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
}

#[test]
fn pipelined_requests_each_get_their_own_reply() {
    let h = harness();
    let vol = h.pool.open_volume("a").unwrap();
    for i in 0..64u64 {
        vol.write(i * 4096, &[i as u8; 4096]).unwrap();
    }
    let mut s = transmission(&h, "a");
    // Everything goes out in one write, so the server finds many requests in one socket read:
    // reads of different blocks and lengths, one past the end, one oversized, writes among
    // them, and a bad magic at the end.
    let mut bytes = Vec::new();
    let mut reads = std::collections::HashMap::new();
    for c in 0..48u64 {
        let (block, len) = (c % 40, 512 * (1 + c as u32 % 8));
        bytes.extend_from_slice(
            &Request { flags: 0, kind: CMD_READ, cookie: c, offset: block * 4096, length: len }.encode(),
        );
        reads.insert(c, (block as u8, len as usize));
        if c % 10 == 5 {
            // Writes among the reads (one with FUA, which runs on its own), to blocks no read reads.
            let flags = if c == 35 { CMD_FLAG_FUA } else { 0 };
            let w = Request { flags, kind: CMD_WRITE, cookie: 1000 + c, offset: (45 + c) * 4096, length: 4096 };
            bytes.extend_from_slice(&w.encode());
            bytes.extend_from_slice(&[c as u8 + 100; 4096]);
        }
        if c == 20 {
            bytes.extend_from_slice(
                &Request { flags: 0, kind: CMD_READ, cookie: 1001, offset: 4 * MIB - 10, length: 4096 }.encode(),
            );
            bytes.extend_from_slice(
                &Request { flags: 0, kind: CMD_READ, cookie: 1002, offset: 0, length: 64 << 20 }.encode(),
            );
        }
    }
    bytes.extend_from_slice(&[0xFF; REQUEST_LEN]);
    s.write_all(&bytes).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..reads.len() + 7 {
        let mut r = [0u8; 16];
        s.read_exact(&mut r).unwrap();
        assert_eq!(&r[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        let error = u32::from_be_bytes(r[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(r[8..16].try_into().unwrap());
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
        match cookie {
            1005 | 1015 | 1025 | 1035 | 1045 => assert_eq!(error, 0, "cookie {cookie}"),
            1001 | 1002 => assert_eq!(error, EINVAL, "cookie {cookie}"),
            c => {
                assert_eq!(error, 0, "cookie {c}");
                let (fill, len) = reads[&c];
                let mut data = vec![0u8; len];
                s.read_exact(&mut data).unwrap();
                assert!(data.iter().all(|&b| b == fill), "cookie {c}: wrong data");
            }
        }
    }
    assert!(closed(&mut s), "bad magic ends the connection once the others replied");
    for c in [5u64, 15, 25, 35, 45] {
        let mut block = vec![0u8; 4096];
        vol.read((45 + c) * 4096, &mut block).unwrap();
        assert!(block.iter().all(|&b| b == c as u8 + 100), "write {c} landed");
    }
}

#[test]
fn a_queue_depth_one_client_is_served_by_one_thread_and_a_burst_by_more() {
    use std::sync::atomic::Ordering;
    let h = harness();
    let started = || h.exports.get("a").unwrap().metrics.helpers_started.load(Ordering::Relaxed);
    let mut s = transmission(&h, "a");
    // One request at a time: the worker that reads each one runs it and reads the next.
    for i in 0..50u64 {
        s.write_all(&Request { flags: 0, kind: CMD_WRITE, cookie: 42, offset: i * 4096, length: 4096 }.encode())
            .unwrap();
        s.write_all(&[i as u8; 4096]).unwrap();
        assert_eq!(reply(&mut s), 0);
        assert_eq!(request(&mut s, CMD_READ, 0, i * 4096, 0), 0);
    }
    assert_eq!(started(), 0, "no worker thread started for a client at queue depth 1");
    // A flush runs on its own worker thread while the next requests are read.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&Request { flags: 0, kind: CMD_FLUSH, cookie: 42, offset: 0, length: 0 }.encode());
    for _ in 0..8 {
        bytes.extend_from_slice(&Request { flags: 0, kind: CMD_READ, cookie: 42, offset: 0, length: 0 }.encode());
    }
    s.write_all(&bytes).unwrap();
    for _ in 0..9 {
        assert_eq!(reply(&mut s), 0);
    }
    assert!(started() >= 1, "requests behind a flush were not read while it ran");
    let mut block = vec![0u8; 4096];
    h.pool.open_volume("a").unwrap().read(49 * 4096, &mut block).unwrap();
    assert_eq!(block, [49u8; 4096]);
}
