//! The NBD wire format (fixed newstyle handshake, simple and structured replies), as pure
//! encode/decode functions over byte slices: no I/O, so every decoder can be fuzzed.
//!
//! Numbers and layouts follow the protocol document of the NBD project (doc/proto.md).

/// "NBDMAGIC", the first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle negotiation, and the prefix of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply.
pub const REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// Info types (NBD_OPT_INFO / NBD_OPT_GO).
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TF_SEND_CACHE: u16 = 1 << 10;
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Whether `flags` are ones command `kind` may carry, as qemu-nbd and nbdkit check them: FUA on
/// any command, DF on a read (with structured replies), NO_HOLE and FAST_ZERO on a write-zeroes,
/// REQ_ONE on a block status. A request with any other bit set is answered EINVAL, not run with
/// the bit ignored (a flag we do not know may change what the client expects done).
pub fn flags_valid(kind: u16, flags: u16, structured: bool) -> bool {
    let allowed = CMD_FLAG_FUA
        | match kind {
            CMD_READ if structured => CMD_FLAG_DF,
            CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            _ => 0,
        };
    flags & !allowed == 0
}

// Structured reply chunk types and flags.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// base:allocation status flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;
// ferrite:changed: status flag (as qemu:dirty-bitmap's dirty bit): changed since the snapshot.
pub const STATE_CHANGED: u32 = 1 << 0;

// Error values on the wire.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Length of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Length of a transmission request header.
pub const REQUEST_LEN: usize = 28;
/// Length of an option request header (magic, option, length).
pub const OPTION_HEADER_LEN: usize = 16;

/// A transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// Why a request header could not be decoded; the connection must be closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    BadMagic(u32),
}

impl Request {
    /// Decodes a request header.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, DecodeError> {
        let magic = be32(b, 0);
        if magic != REQUEST_MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        Ok(Self { flags: be16(b, 4), kind: be16(b, 6), cookie: be64(b, 8), offset: be64(b, 16), length: be32(b, 24) })
    }

    /// Encodes a request header (used by tests acting as a client).
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// An option request header: (option, payload length), after checking the magic.
pub fn decode_option_header(b: &[u8; OPTION_HEADER_LEN]) -> Result<(u32, u32), u64> {
    let magic = be64(b, 0);
    if magic != IHAVEOPT {
        return Err(magic);
    }
    Ok((be32(b, 8), be32(b, 12)))
}

/// Encodes an option reply header followed by its payload.
pub fn option_reply(option: u32, kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + payload.len());
    v.extend_from_slice(&REP_MAGIC.to_be_bytes());
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(&u32::try_from(payload.len()).expect("option replies are small").to_be_bytes());
    v.extend_from_slice(payload);
    v
}

/// A simple reply header.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Bytes of a structured reply chunk's header.
pub const STRUCTURED_HEADER_LEN: usize = 20;

/// A structured reply chunk header for a payload of `len` bytes.
pub fn structured_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; STRUCTURED_HEADER_LEN] {
    let mut b = [0u8; STRUCTURED_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// A structured error chunk (always the final one): error, message length, message.
pub fn structured_error(cookie: u64, error: u32, msg: &str) -> Vec<u8> {
    let msg = &msg.as_bytes()[..msg.len().min(4096)];
    let mut v = Vec::with_capacity(26 + msg.len());
    let len = u32::try_from(6 + msg.len()).expect("bounded");
    v.extend_from_slice(&structured_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, len));
    v.extend_from_slice(&error.to_be_bytes());
    v.extend_from_slice(&u16::try_from(msg.len()).expect("bounded").to_be_bytes());
    v.extend_from_slice(msg);
    v
}

/// A cursor over an option payload that never reads past its end.
#[derive(Debug)]
pub struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Self { b }
    }

    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Some(head)
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| be16(b, 0))
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| be32(b, 0))
    }

    /// A u32-length-prefixed string of at most `max` bytes.
    pub fn string(&mut self, max: usize) -> Option<&'a str> {
        let n = usize::try_from(self.u32()?).ok()?;
        if n > max {
            return None;
        }
        std::str::from_utf8(self.take(n)?).ok()
    }

    pub fn is_empty(&self) -> bool {
        self.b.is_empty()
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_roundtrip_and_bad_magic() {
        assert!(flags_valid(CMD_WRITE, CMD_FLAG_FUA, false));
        assert!(flags_valid(CMD_READ, CMD_FLAG_FUA | CMD_FLAG_DF, true));
        assert!(!flags_valid(CMD_READ, CMD_FLAG_DF, false));
        assert!(!flags_valid(CMD_WRITE, CMD_FLAG_NO_HOLE, true));
        assert!(flags_valid(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO, true));
        assert!(!flags_valid(CMD_FLUSH, 1 << 5, true));
        assert!(!flags_valid(CMD_TRIM, 0x8000, true));
        let r = Request { flags: CMD_FLAG_FUA, kind: CMD_WRITE, cookie: 7, offset: 4096, length: 512 };
        assert_eq!(Request::decode(&r.encode()), Ok(r));
        let mut b = r.encode();
        b[0] = 0;
        assert!(matches!(Request::decode(&b), Err(DecodeError::BadMagic(_))));
    }

    #[test]
    fn cursor_never_overruns() {
        let mut c = Cursor::new(&[0, 0, 0, 5, b'a', b'b']);
        assert_eq!(c.string(100), None);
        let mut c = Cursor::new(&[0, 0, 0, 2, b'a', b'b', 0, 1]);
        assert_eq!(c.string(100), Some("ab"));
        assert_eq!(c.u16(), Some(1));
        assert!(c.is_empty());
        assert_eq!(c.u32(), None);
        let mut c = Cursor::new(&[0, 0, 0, 3, b'a', b'b', b'c']);
        assert_eq!(c.string(2), None, "over the limit");
    }

    #[test]
    fn replies_have_their_magic() {
        assert_eq!(&option_reply(OPT_GO, REP_ACK, &[])[..8], &REP_MAGIC.to_be_bytes());
        assert_eq!(simple_reply(EIO, 9)[4..8], EIO.to_be_bytes());
        let e = structured_error(3, EINVAL, "bad");
        assert_eq!(e.len(), 20 + 6 + 3);
        assert_eq!(&e[16..20], &9u32.to_be_bytes());
    }
}
