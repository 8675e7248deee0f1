//! Attaching an export as a kernel NBD device (`/dev/nbdN`), through the kernel's
//! generic-netlink NBD interface: the caller connects and negotiates (fixed newstyle, `OPT_GO`,
//! no structured replies: the kernel client speaks simple replies only), then hands the
//! connected socket to the kernel with `NBD_CMD_CONNECT`. The kernel keeps the socket; no
//! process has to stay behind (unlike the old ioctl interface). `detach` sends
//! `NBD_CMD_DISCONNECT`.
//!
//! A device outlives its server: it is attached with a dead-connection timeout, so when its
//! socket closes (the serving daemon restarts) the kernel holds new requests for that long, and
//! requests already sent are re-queued after the request timeout; a new socket handed over with
//! `NBD_CMD_RECONFIGURE` ([`reconnect`]) serves them all. The device carries a backend identifier
//! (`/sys/block/nbdN/backend`) that the kernel checks on reconfigure, so a socket for another
//! volume is never handed to it.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use rustix::net;

use crate::proto::*;

// include/uapi/linux/nbd-netlink.h and genetlink.h
const NBD_CMD_CONNECT: u8 = 1;
const NBD_CMD_DISCONNECT: u8 = 2;
const NBD_CMD_RECONFIGURE: u8 = 3;
const NBD_ATTR_INDEX: u16 = 1;
const NBD_ATTR_SIZE_BYTES: u16 = 2;
const NBD_ATTR_BLOCK_SIZE_BYTES: u16 = 3;
const NBD_ATTR_TIMEOUT: u16 = 4;
const NBD_ATTR_SERVER_FLAGS: u16 = 5;
const NBD_ATTR_SOCKETS: u16 = 7;
const NBD_ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
const NBD_ATTR_BACKEND_IDENTIFIER: u16 = 10;
const NBD_SOCK_ITEM: u16 = 1;
const NBD_SOCK_FD: u16 = 1;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NLA_F_NESTED: u16 = 1 << 15;
// include/uapi/linux/netlink.h (libc has them as i32)
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;

/// How a device waits for its server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// A request without a reply for this long marks the connection dead and is re-queued for
    /// the next one (so a daemon that died with requests in flight costs at most this).
    pub request_timeout: Duration,
    /// How long requests wait for a new connection before they fail with EIO.
    pub dead_connection: Duration,
    /// Names what the device serves (a volume): checked by the kernel on every reconnect.
    pub backend: String,
}

/// A kernel NBD device attached to an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub index: u32,
    pub device: PathBuf,
    pub size: u64,
    pub read_only: bool,
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn read_u16(s: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Client side of the greeting: checks the server's, answers with our flags.
pub fn greet<S: Read + Write>(s: &mut S) -> io::Result<()> {
    if read_u64(s)? != NBD_MAGIC || read_u64(s)? != IHAVEOPT {
        return Err(invalid("not an NBD server (bad greeting)"));
    }
    let server = read_u16(s)?;
    if server & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(invalid("NBD server does not speak fixed newstyle"));
    }
    let mut client = FLAG_C_FIXED_NEWSTYLE;
    if server & FLAG_NO_ZEROES != 0 {
        client |= FLAG_C_NO_ZEROES;
    }
    s.write_all(&client.to_be_bytes())
}

/// One option reply: (kind, data).
fn option_reply<S: Read>(s: &mut S) -> io::Result<(u32, Vec<u8>)> {
    if read_u64(s)? != REP_MAGIC {
        return Err(invalid("bad option reply magic"));
    }
    let (_opt, kind, len) = (read_u32(s)?, read_u32(s)?, read_u32(s)?);
    if len > 1 << 20 {
        return Err(invalid("option reply too long"));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((kind, data))
}

/// `NBD_OPT_STARTTLS` after the greeting: once it returns, the caller runs the TLS handshake on
/// the same connection and negotiates the export inside it.
pub fn start_tls<S: Read + Write>(s: &mut S) -> io::Result<()> {
    let mut opt = Vec::with_capacity(16);
    opt.extend_from_slice(&IHAVEOPT.to_be_bytes());
    opt.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&opt)?;
    match option_reply(s)? {
        (REP_ACK, _) => Ok(()),
        (_, data) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the NBD server refused TLS: {}", String::from_utf8_lossy(&data)),
        )),
    }
}

/// Client side of the handshake: the greeting, then `OPT_GO` for `export`; returns (size,
/// transmission flags).
pub fn negotiate_client<S: Read + Write>(s: &mut S, export: &str) -> io::Result<(u64, u16)> {
    greet(s)?;
    go(s, export)
}

/// `OPT_GO` for `export` after the greeting (and TLS, if any); returns (size, transmission flags).
pub fn go<S: Read + Write>(s: &mut S, export: &str) -> io::Result<(u64, u16)> {
    let name = export.as_bytes();
    let len = u32::try_from(name.len() + 6).map_err(|_| invalid("export name too long"))?;
    let mut opt = Vec::with_capacity(16 + name.len() + 6);
    opt.extend_from_slice(&IHAVEOPT.to_be_bytes());
    opt.extend_from_slice(&OPT_GO.to_be_bytes());
    opt.extend_from_slice(&len.to_be_bytes());
    opt.extend_from_slice(&u32::try_from(name.len()).expect("checked above").to_be_bytes());
    opt.extend_from_slice(name);
    opt.extend_from_slice(&0u16.to_be_bytes()); // no extra info requests: INFO_EXPORT always comes
    s.write_all(&opt)?;
    let mut export_info = None;
    loop {
        let (kind, data) = option_reply(s)?;
        match kind {
            REP_ACK => break,
            REP_INFO if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT => {
                let size = u64::from_be_bytes(data[2..10].try_into().expect("8 bytes"));
                let flags = u16::from_be_bytes([data[10], data[11]]);
                export_info = Some((size, flags));
            }
            REP_INFO => {}
            k if k & (1 << 31) != 0 => {
                let msg = String::from_utf8_lossy(&data);
                return Err(io::Error::new(io::ErrorKind::NotFound, format!("export {export:?} refused: {msg}")));
            }
            k => return Err(invalid(format!("unexpected option reply {k}"))),
        }
    }
    export_info.ok_or_else(|| invalid("server acknowledged OPT_GO without the export's size"))
}

/// A generic netlink socket.
struct Genl(OwnedFd);

fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).expect("small attribute");
    buf.extend_from_slice(&len.to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// Attributes of a netlink message payload as (type without flags, payload).
fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        let kind = u16::from_ne_bytes([b[2], b[3]]) & !NLA_F_NESTED;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((kind, &b[4..len]));
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    out
}

impl Genl {
    fn open() -> io::Result<Self> {
        let fd = net::socket_with(
            net::AddressFamily::NETLINK,
            net::SocketType::RAW,
            net::SocketFlags::CLOEXEC,
            Some(net::netlink::GENERIC),
        )?;
        Ok(Self(fd))
    }

    /// Sends one request and returns the payload (after the genl header) of its reply, if any.
    fn request(&self, family: u16, cmd: u8, body: &[u8]) -> io::Result<Option<Vec<u8>>> {
        let len = u32::try_from(16 + 4 + body.len()).expect("small message");
        let mut m = Vec::with_capacity(len as usize);
        m.extend_from_slice(&len.to_ne_bytes());
        m.extend_from_slice(&family.to_ne_bytes());
        m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes()); // seq
        m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
        m.extend_from_slice(&[cmd, 1, 0, 0]); // genl header: cmd, version
        m.extend_from_slice(body);
        net::send(&self.0, &m, net::SendFlags::empty())?;
        let mut payload = None;
        let mut buf = vec![0u8; 16 << 10];
        loop {
            let (n, _) = net::recv(&self.0, &mut buf[..], net::RecvFlags::empty())?;
            let mut b = &buf[..n];
            while b.len() >= 16 {
                let len = u32::from_ne_bytes(b[0..4].try_into().expect("4")) as usize;
                let kind = u16::from_ne_bytes([b[4], b[5]]);
                if len < 16 || len > b.len() {
                    return Err(invalid("malformed netlink reply"));
                }
                if kind == NLMSG_ERROR {
                    let err = i32::from_ne_bytes(b[16..20].try_into().expect("4"));
                    if err != 0 {
                        return Err(io::Error::from_raw_os_error(-err));
                    }
                    return Ok(payload);
                }
                if len > 20 {
                    payload = Some(b[20..len].to_vec());
                }
                b = &b[len.next_multiple_of(4).min(b.len())..];
            }
        }
    }

    fn nbd_family(&self) -> io::Result<u16> {
        let mut body = Vec::new();
        attr(&mut body, CTRL_ATTR_FAMILY_NAME, b"nbd\0");
        let reply = self.request(GENL_ID_CTRL, CTRL_CMD_GETFAMILY, &body).map_err(|e| {
            io::Error::new(e.kind(), format!("the kernel has no NBD netlink family (is the nbd module loaded?): {e}"))
        })?;
        reply
            .as_deref()
            .and_then(|r| attrs(r).into_iter().find(|a| a.0 == CTRL_ATTR_FAMILY_ID))
            .and_then(|a| a.1.get(..2).map(|x| u16::from_ne_bytes([x[0], x[1]])))
            .ok_or_else(|| invalid("no family id in the netlink reply"))
    }
}

/// Negotiates `export` on `s` (a new connection to its server) up to the transmission phase;
/// returns its size and transmission flags.
pub fn negotiate_blocking(s: &mut UnixStream, export: &str) -> io::Result<(u64, u16)> {
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let negotiated = negotiate_client(s, export)?;
    s.set_read_timeout(None)?;
    Ok(negotiated)
}

fn sockets_attr(body: &mut Vec<u8>, sock: &impl AsRawFd) {
    let fd = u32::try_from(sock.as_raw_fd()).expect("descriptors are non-negative");
    let mut item = Vec::new();
    attr(&mut item, NBD_SOCK_FD, &fd.to_ne_bytes());
    let mut socks = Vec::new();
    attr(&mut socks, NBD_SOCK_ITEM | NLA_F_NESTED, &item);
    attr(body, NBD_ATTR_SOCKETS | NLA_F_NESTED, &socks);
}

fn backend_attr(body: &mut Vec<u8>, backend: &str) {
    let mut name = backend.as_bytes().to_vec();
    name.push(0);
    attr(body, NBD_ATTR_BACKEND_IDENTIFIER, &name);
}

/// Hands `sock`, negotiated to the transmission phase (size and flags from `OPT_GO`), to the
/// kernel as the next free `/dev/nbdN`, waiting for its server as `hold` says. The kernel takes
/// its own reference: the caller may drop its end.
pub fn connect(sock: &impl AsRawFd, size: u64, flags: u16, hold: &Hold) -> io::Result<Attached> {
    let nl = Genl::open()?;
    let family = nl.nbd_family()?;
    let mut body = Vec::new();
    attr(&mut body, NBD_ATTR_SIZE_BYTES, &size.to_ne_bytes());
    attr(&mut body, NBD_ATTR_BLOCK_SIZE_BYTES, &4096u64.to_ne_bytes());
    attr(&mut body, NBD_ATTR_TIMEOUT, &hold.request_timeout.as_secs().max(1).to_ne_bytes());
    attr(&mut body, NBD_ATTR_DEAD_CONN_TIMEOUT, &hold.dead_connection.as_secs().max(1).to_ne_bytes());
    attr(&mut body, NBD_ATTR_SERVER_FLAGS, &u64::from(flags).to_ne_bytes());
    backend_attr(&mut body, &hold.backend);
    sockets_attr(&mut body, sock);
    let reply = nl.request(family, NBD_CMD_CONNECT, &body)?;
    let index = reply
        .as_deref()
        .and_then(|r| attrs(r).into_iter().find(|a| a.0 == NBD_ATTR_INDEX))
        .and_then(|a| a.1.get(..4).map(|x| u32::from_ne_bytes(x.try_into().expect("4"))))
        .ok_or_else(|| invalid("the kernel did not say which device it attached"))?;
    Ok(Attached {
        index,
        device: PathBuf::from(format!("/dev/nbd{index}")),
        size,
        read_only: flags & TF_READ_ONLY != 0,
    })
}

/// Gives the live `/dev/nbd<index>`, whose connection died, the new connection `sock` (negotiated
/// to the transmission phase): the requests it holds go there. The kernel refuses it (EINVAL)
/// if the device serves another backend than `backend`. Until the kernel has noticed the old
/// connection's end there is no dead socket to replace (ENOSPC): that is retried for a while.
pub fn reconnect(index: u32, sock: &impl AsRawFd, backend: &str) -> io::Result<()> {
    let nl = Genl::open()?;
    let family = nl.nbd_family()?;
    let mut body = Vec::new();
    attr(&mut body, NBD_ATTR_INDEX, &index.to_ne_bytes());
    backend_attr(&mut body, backend);
    sockets_attr(&mut body, sock);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match nl.request(family, NBD_CMD_RECONFIGURE, &body) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(io::Error::new(e.kind(), format!("reconnecting /dev/nbd{index}: {e}"))),
            Ok(_) => return Ok(()),
        }
    }
}

/// What `/dev/nbd<index>` serves, as its backend identifier says (None: not connected, or
/// attached without one).
pub fn backend(index: u32) -> Option<String> {
    let b = std::fs::read_to_string(format!("/sys/block/nbd{index}/backend")).ok()?;
    let b = b.trim_end_matches(['\n', '\0']);
    (!b.is_empty()).then(|| b.to_owned())
}

/// Detaches `/dev/nbd<index>` (in-flight requests finish first).
pub fn detach(index: u32) -> io::Result<()> {
    let nl = Genl::open()?;
    let family = nl.nbd_family()?;
    let mut body = Vec::new();
    attr(&mut body, NBD_ATTR_INDEX, &index.to_ne_bytes());
    nl.request(family, NBD_CMD_DISCONNECT, &body).map(|_| ())
}

/// Sets the size of the live `/dev/nbd<index>` (after its export grew): `NBD_CMD_RECONFIGURE`
/// with a new size, which the kernel applies online (Linux 5.3+) and announces to the disk.
/// A device attached with a backend identifier takes a reconfigure only with the same one.
pub fn resize(index: u32, size: u64, backend: &str) -> io::Result<()> {
    let nl = Genl::open()?;
    let family = nl.nbd_family()?;
    let mut body = Vec::new();
    attr(&mut body, NBD_ATTR_INDEX, &index.to_ne_bytes());
    backend_attr(&mut body, backend);
    attr(&mut body, NBD_ATTR_SIZE_BYTES, &size.to_ne_bytes());
    nl.request(family, NBD_CMD_RECONFIGURE, &body).map(|_| ())
}

/// The size of `/dev/nbd<index>` as the kernel has it.
pub fn size(index: u32) -> io::Result<u64> {
    let sectors = std::fs::read_to_string(format!("/sys/block/nbd{index}/size"))?;
    sectors.trim().parse::<u64>().map(|s| s * 512).map_err(|e| invalid(format!("/sys/block/nbd{index}/size: {e}")))
}

/// The device index of a `/dev/nbdN` path (or a bare `N`).
pub fn parse_device(dev: &str) -> Option<u32> {
    dev.strip_prefix("/dev/nbd").unwrap_or(dev).parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_roundtrip_and_device_names() {
        let mut b = Vec::new();
        attr(&mut b, 2, &7u64.to_ne_bytes());
        attr(&mut b, 7 | NLA_F_NESTED, b"abc");
        let a = attrs(&b);
        assert_eq!(a.len(), 2);
        assert_eq!((a[0].0, a[0].1), (2, &7u64.to_ne_bytes()[..]));
        assert_eq!((a[1].0, a[1].1), (7, &b"abc"[..]));
        assert_eq!(parse_device("/dev/nbd3"), Some(3));
        assert_eq!(parse_device("12"), Some(12));
        assert_eq!(parse_device("/dev/sda"), None);
    }
}
