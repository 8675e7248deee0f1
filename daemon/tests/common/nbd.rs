//! A bare NBD client for tests that must do what no well-behaved client does: pipeline without
//! reading replies, stall mid-handshake, hold thousands of connections.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use ferrite_nbd::proto::*;

/// Connects and reads the greeting; None if the server closed the connection instead.
pub fn hello(sock: &Path) -> Option<UnixStream> {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).ok()?;
    assert_eq!(&g[..8], &NBD_MAGIC.to_be_bytes());
    Some(s)
}

/// A connection in transmission on `export` (simple replies).
pub fn connect(sock: &Path, export: &str) -> UnixStream {
    let mut s = hello(sock).expect("greeting");
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    let mut data = u32::try_from(export.len()).unwrap().to_be_bytes().to_vec();
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&OPT_GO.to_be_bytes());
    o.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    o.extend_from_slice(&data);
    s.write_all(&o).unwrap();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut p = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut p).unwrap();
        assert!(kind & (1 << 31) == 0, "NBD_OPT_GO refused: {}", String::from_utf8_lossy(&p));
        if kind == REP_ACK {
            return s;
        }
    }
}

/// A request's bytes (and a write's payload).
pub fn request(kind: u16, flags: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Request { flags, kind, cookie, offset, length }.encode().to_vec();
    b.extend_from_slice(payload);
    b
}

/// Reads one simple reply: (error, cookie), and `data_len` bytes of data after a successful one.
pub fn reply(s: &mut UnixStream, data_len: usize) -> (u32, u64) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), SIMPLE_REPLY_MAGIC);
    let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
    if error == 0 && data_len > 0 {
        std::io::copy(&mut (&*s).take(data_len as u64), &mut std::io::sink()).unwrap();
    }
    (error, u64::from_be_bytes(h[8..].try_into().unwrap()))
}

/// A process's peak and current resident set (KiB), from /proc.
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
    };
    (field("VmHWM:").unwrap(), field("VmRSS:").unwrap())
}

/// Sets a process's peak resident set to its present one (`clear_refs` 5).
pub fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// Writes `data` at `offset` on an open connection; the NBD error (0: done).
pub fn write_on(s: &mut UnixStream, offset: u64, data: &[u8]) -> u32 {
    s.write_all(&request(CMD_WRITE, 0, 7, offset, u32::try_from(data.len()).unwrap(), data)).unwrap();
    reply(s, 0).0
}

/// Exports `image` of `d` (a volume, or `volume@snapshot`) and connects to it.
pub fn open(d: &super::Daemon, image: &str) -> UnixStream {
    d.ok(&["export", "nbd", image]);
    connect(&d.nbd(), image)
}

/// `len` bytes of `image` from its start; the export stops after (so a snapshot read here is
/// not held by it).
pub fn read_image(d: &super::Daemon, image: &str, len: u64) -> Vec<u8> {
    try_read_image(d, image, len).unwrap_or_else(|| panic!("cannot export {image}"))
}

/// The same; None if `image` cannot be exported (a snapshot deleted meanwhile, say).
pub fn try_read_image(d: &super::Daemon, image: &str, len: u64) -> Option<Vec<u8>> {
    if !d.cli(&["export", "nbd", image]).status.success() {
        return None;
    }
    let buf = read_all(&mut connect(&d.nbd(), image), image, len);
    d.ok(&["export", "stop", image]);
    Some(buf)
}

/// `len` bytes from the start of the export `image` is connected to by `s`.
pub fn read_all(s: &mut UnixStream, image: &str, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; usize::try_from(len).unwrap()];
    for (i, chunk) in buf.chunks_mut(8 << 20).enumerate() {
        let at = i as u64 * (8 << 20);
        s.write_all(&request(CMD_READ, 0, 1, at, u32::try_from(chunk.len()).unwrap(), &[])).unwrap();
        let mut h = [0u8; 16];
        s.read_exact(&mut h).unwrap();
        assert_eq!(&h[4..8], &[0; 4], "read of {image} at {at} failed");
        s.read_exact(chunk).unwrap();
    }
    buf
}
