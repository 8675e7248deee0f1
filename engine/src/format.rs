//! The on-media format: the superblock and the log batch header.
//!
//! Fixed-layout little-endian records, each with a magic, a version and a crc32c, encoded and
//! decoded by pure functions (bytes in, structs out) so they can be fuzzed.
//!
//! ```text
//! pool:   | superblock (4 KiB) | its copy (4 KiB, v2+) | pad to DATA_START | segment 0 | ... |
//! batch:  | header: fixed 48 B, entries 24 B each, one crc32c per data block | data blocks |
//!           (header padded to whole 4 KiB blocks; a batch never crosses a segment end)
//! ```

use crate::error::{Error, ErrorKind};
use crate::error::{Result, corrupt};
use crate::io::BLOCK;

/// Magic at offset 0 of every Ferrite pool.
pub const SUPER_MAGIC: [u8; 8] = *b"FERRPOOL";
/// Current pool format version. Version 2 keeps a copy of the superblock in the second block,
/// so that rewriting it (an upgrade) can never leave a pool without a valid one; version 1 pools
/// are upgraded in place when a daemon of version 2 opens them (one way: see CHANGELOG.md).
pub const FORMAT_VERSION: u32 = 2;
/// The oldest pool format this build opens (and upgrades).
pub const OLDEST_FORMAT: u32 = 1;
/// Byte offset of the superblock's copy (format 2+).
pub const SUPER_COPY_AT: u64 = BLOCK as u64;
/// Byte offset of segment 0 (the superblock lives in the first block; 1 MiB keeps segments
/// aligned for any device).
pub const DATA_START: u64 = 1 << 20;
/// Smallest and largest segment a pool may have.
pub const MIN_SEGMENT: u64 = 64 << 10;
pub const MAX_SEGMENT: u64 = 1 << 30;
/// Largest data area a superblock may describe (1 EiB): every offset computed from the geometry
/// then fits in a u64 with room to spare.
pub const MAX_POOL_BYTES: u64 = 1 << 60;
const SUPER_CRC_AT: usize = BLOCK - 4;
#[allow(clippy::cast_possible_truncation)] // 4096 fits
const BLOCK_U32: u32 = BLOCK as u32;

/// Magic of a log batch header ("FLOG").
pub const BATCH_MAGIC: u32 = 0x464C_4F47;
/// Current batch format version.
pub const BATCH_VERSION: u16 = 1;
const BATCH_FIXED: usize = 48;
const ENTRY_LEN: usize = 24;
const BATCH_CRC_AT: usize = 8;

/// Checks a segment size and count against the bounds every pool keeps; says what is wrong.
pub fn check_geometry(segment_size: u64, segment_count: u64) -> std::result::Result<(), String> {
    if !(MIN_SEGMENT..=MAX_SEGMENT).contains(&segment_size) || !segment_size.is_multiple_of(BLOCK as u64) {
        return Err(format!("segment size {segment_size} must be a multiple of 4 KiB between 64 KiB and 1 GiB"));
    }
    match segment_size.checked_mul(segment_count) {
        _ if segment_count == 0 => Err("a pool needs at least one segment".into()),
        Some(n) if n <= MAX_POOL_BYTES => Ok(()),
        _ => Err(format!("{segment_count} segments of {segment_size} bytes are more than 1 EiB")),
    }
}

/// The pool's identity and geometry, stored in its first block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub uuid: [u8; 16],
    pub segment_size: u64,
    pub segment_count: u64,
    pub created_unix: u64,
}

const _: () = assert!(BATCH_FIXED + ENTRY_LEN < BLOCK && SUPER_CRC_AT > 64);

impl Superblock {
    /// Encodes into one block.
    pub fn encode(&self) -> [u8; BLOCK] {
        let mut b = [0u8; BLOCK];
        b[0..8].copy_from_slice(&SUPER_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid);
        b[32..36].copy_from_slice(&BLOCK_U32.to_le_bytes());
        b[40..48].copy_from_slice(&self.segment_size.to_le_bytes());
        b[48..56].copy_from_slice(&self.segment_count.to_le_bytes());
        b[56..64].copy_from_slice(&DATA_START.to_le_bytes());
        b[64..72].copy_from_slice(&self.created_unix.to_le_bytes());
        let crc = crc32c::crc32c(&b[..SUPER_CRC_AT]);
        b[SUPER_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and verifies; every failure says what is wrong.
    pub fn decode(b: &[u8]) -> Result<Self> {
        if b.len() < BLOCK {
            return Err(corrupt("superblock is truncated"));
        }
        if b[0..8] != SUPER_MAGIC {
            return Err(corrupt("not a Ferrite pool (bad superblock magic)"));
        }
        let version = le32(b, 8);
        if version > FORMAT_VERSION {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "pool format version {version} is newer than this ferrite {} understands (it reads format \
                     versions {OLDEST_FORMAT} to {FORMAT_VERSION}): run the ferrite that wrote the pool, or a newer one",
                    env!("CARGO_PKG_VERSION")
                ),
            ));
        }
        if version < OLDEST_FORMAT {
            return Err(corrupt(format!("superblock names format version {version}, which never existed")));
        }
        if crc32c::crc32c(&b[..SUPER_CRC_AT]) != le32(b, SUPER_CRC_AT) {
            return Err(corrupt("superblock checksum mismatch"));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        let sb =
            Self { version, uuid, segment_size: le64(b, 40), segment_count: le64(b, 48), created_unix: le64(b, 64) };
        if le32(b, 32) != BLOCK_U32 || le64(b, 56) != DATA_START {
            return Err(corrupt("superblock geometry is not one this build writes"));
        }
        check_geometry(sb.segment_size, sb.segment_count).map_err(|m| corrupt(format!("superblock: {m}")))?;
        Ok(sb)
    }

    /// Bytes the pool needs on its backing store (the geometry was checked, so no overflow).
    pub fn required_len(&self) -> u64 {
        DATA_START + self.segment_size * self.segment_count
    }

    /// Byte offset on the store of position `off` within segment `seg`.
    pub fn segment_offset(&self, seg: usize, off: u64) -> u64 {
        DATA_START + seg as u64 * self.segment_size + off
    }

    /// The first 8 bytes of the uuid, stamped into every batch header.
    pub fn uuid_tag(&self) -> u64 {
        le64(&self.uuid, 0)
    }
}

/// What a log entry does to its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EntryKind {
    /// The range gets the next `blocks` data blocks of the batch.
    Data = 1,
    /// The range is unmapped (trim, or write-zeroes over a layer with no parent).
    Unmap = 2,
}

/// One entry of a batch: a range of a layer and what happens to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub layer: u64,
    pub lba: u64,
    pub blocks: u32,
    pub kind: EntryKind,
}

/// A decoded batch header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    pub seq: u64,
    pub generation: u64,
    pub uuid_tag: u64,
    pub entries: Vec<Entry>,
    /// crc32c of each data block, in order.
    pub crcs: Vec<u32>,
}

impl BatchHeader {
    /// Header size in whole blocks for `entries` entries and `data_blocks` data blocks.
    pub fn blocks_for(entries: usize, data_blocks: usize) -> usize {
        (BATCH_FIXED + entries * ENTRY_LEN + data_blocks * 4).div_ceil(BLOCK)
    }

    /// Number of header blocks this header occupies.
    pub fn header_blocks(&self) -> usize {
        Self::blocks_for(self.entries.len(), self.crcs.len())
    }

    /// Whole batch length in bytes (header plus data).
    pub fn batch_len(&self) -> u64 {
        ((self.header_blocks() + self.crcs.len()) * BLOCK) as u64
    }

    /// Encodes into `out`, which must be exactly `header_blocks() * BLOCK` bytes.
    pub fn encode_into(&self, out: &mut [u8]) {
        let hb = self.header_blocks();
        assert_eq!(out.len(), hb * BLOCK, "header buffer size");
        out.fill(0);
        out[0..4].copy_from_slice(&BATCH_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&BATCH_VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&u16::try_from(hb).expect("header below 256 MiB").to_le_bytes());
        out[12..16].copy_from_slice(&u32::try_from(self.entries.len()).expect("entry count").to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.generation.to_le_bytes());
        out[32..36].copy_from_slice(&u32::try_from(self.crcs.len()).expect("block count").to_le_bytes());
        out[40..48].copy_from_slice(&self.uuid_tag.to_le_bytes());
        let mut at = BATCH_FIXED;
        for e in &self.entries {
            out[at..at + 8].copy_from_slice(&e.layer.to_le_bytes());
            out[at + 8..at + 16].copy_from_slice(&e.lba.to_le_bytes());
            out[at + 16..at + 20].copy_from_slice(&e.blocks.to_le_bytes());
            out[at + 20] = e.kind as u8;
            at += ENTRY_LEN;
        }
        for c in &self.crcs {
            out[at..at + 4].copy_from_slice(&c.to_le_bytes());
            at += 4;
        }
        let crc = crc32c::crc32c(out);
        out[BATCH_CRC_AT..BATCH_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// From the first block of a would-be header: how many header blocks to read, or None if
    /// this is not a batch header at all.
    pub fn peek_header_blocks(first: &[u8]) -> Option<usize> {
        if first.len() < BATCH_FIXED || le32(first, 0) != BATCH_MAGIC || le16(first, 4) != BATCH_VERSION {
            return None;
        }
        let hb = usize::from(le16(first, 6));
        (hb >= 1).then_some(hb)
    }

    /// Decodes and verifies a whole header (all of its blocks). `None` means "not a valid header":
    /// garbage, a torn header, or a stale one; recovery treats all alike as the end of the log.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let hb = Self::peek_header_blocks(b)?;
        if b.len() != hb * BLOCK {
            return None;
        }
        let mut copy = b.to_vec();
        copy[BATCH_CRC_AT..BATCH_CRC_AT + 4].fill(0);
        if crc32c::crc32c(&copy) != le32(b, BATCH_CRC_AT) {
            return None;
        }
        let n_entries = le32(b, 12) as usize;
        let n_blocks = le32(b, 32) as usize;
        if Self::blocks_for(n_entries, n_blocks) != hb {
            return None;
        }
        let mut entries = Vec::with_capacity(n_entries);
        let mut at = BATCH_FIXED;
        let mut data_blocks = 0u64;
        for _ in 0..n_entries {
            let kind = match b[at + 20] {
                1 => EntryKind::Data,
                2 => EntryKind::Unmap,
                _ => return None,
            };
            let e = Entry { layer: le64(b, at), lba: le64(b, at + 8), blocks: le32(b, at + 16), kind };
            if e.blocks == 0 || e.lba.checked_add(u64::from(e.blocks)).is_none() {
                return None;
            }
            if kind == EntryKind::Data {
                data_blocks += u64::from(e.blocks);
            }
            entries.push(e);
            at += ENTRY_LEN;
        }
        if data_blocks != n_blocks as u64 {
            return None;
        }
        let crcs = (0..n_blocks).map(|i| le32(b, at + i * 4)).collect();
        Some(Self { seq: le64(b, 16), generation: le64(b, 24), uuid_tag: le64(b, 40), entries, crcs })
    }
}

/// crc32c of one data block.
pub fn block_crc(block: &[u8]) -> u32 {
    crc32c::crc32c(block)
}

pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    #[test]
    fn probe_knows_the_superblock_magic() {
        assert_eq!(crate::io::probe::POOL_MAGIC, SUPER_MAGIC);
    }

    fn sb() -> Superblock {
        Superblock { version: FORMAT_VERSION, uuid: [7; 16], segment_size: 1 << 20, segment_count: 9, created_unix: 5 }
    }

    #[test]
    fn superblock_roundtrip_and_rejections() {
        let enc = sb().encode();
        assert_eq!(Superblock::decode(&enc).unwrap(), sb());
        let mut bad = enc;
        bad[0] ^= 1;
        assert!(Superblock::decode(&bad).unwrap_err().to_string().contains("magic"));
        // A newer format is refused naming both versions; an older one is read (and upgraded by
        // the pool); version 0 never existed.
        let newer = Superblock { version: FORMAT_VERSION + 1, ..sb() }.encode();
        let e = Superblock::decode(&newer).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let msg = e.to_string();
        assert!(msg.contains(&format!("version {}", FORMAT_VERSION + 1)), "{msg}");
        assert!(msg.contains(&format!("{OLDEST_FORMAT} to {FORMAT_VERSION}")), "{msg}");
        assert!(msg.contains(env!("CARGO_PKG_VERSION")), "{msg}");
        let older = Superblock { version: OLDEST_FORMAT, ..sb() };
        assert_eq!(Superblock::decode(&older.encode()).unwrap(), older);
        let never = Superblock { version: 0, ..sb() }.encode();
        assert_eq!(Superblock::decode(&never).unwrap_err().kind(), ErrorKind::Corrupt);
        let mut bad = enc;
        bad[100] ^= 1;
        assert!(Superblock::decode(&bad).unwrap_err().to_string().contains("checksum"));
        assert!(Superblock::decode(&enc[..100]).is_err());
        // A valid crc over absurd geometry is refused with a message, never a panic or overflow.
        for (size, count) in [(0, 9), (1 << 20, 0), (4097, 9), (2 << 30, 1), (1 << 30, u64::MAX), (1 << 20, 1 << 41)] {
            let bad = Superblock { segment_size: size, segment_count: count, ..sb() }.encode();
            let e = Superblock::decode(&bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{size} x {count}");
            assert!(e.to_string().contains("superblock"), "{e}");
        }
    }

    fn header() -> BatchHeader {
        BatchHeader {
            seq: 42,
            generation: 3,
            uuid_tag: 99,
            entries: vec![
                Entry { layer: 1, lba: 10, blocks: 2, kind: EntryKind::Data },
                Entry { layer: 2, lba: 0, blocks: 100, kind: EntryKind::Unmap },
            ],
            crcs: vec![1, 2],
        }
    }

    #[test]
    fn batch_header_roundtrip() {
        let h = header();
        let mut buf = vec![0u8; h.header_blocks() * BLOCK];
        h.encode_into(&mut buf);
        assert_eq!(BatchHeader::decode(&buf), Some(h.clone()));
        assert_eq!(h.batch_len(), 3 * BLOCK as u64);
        for i in [0usize, 9, 20, 60, 4000] {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert_eq!(BatchHeader::decode(&bad), None, "flip at {i}");
        }
    }

    proptest::proptest! {
        /// Decoders take arbitrary bytes without panicking.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..9000)) {
            let _ = Superblock::decode(&bytes);
            let _ = BatchHeader::peek_header_blocks(&bytes);
            let _ = BatchHeader::decode(&bytes);
        }

        /// A valid header with one byte changed never decodes to something else.
        #[test]
        fn any_single_flip_is_caught(at in 0usize..BLOCK, bit in 0u8..8) {
            let h = header();
            let mut buf = vec![0u8; BLOCK];
            h.encode_into(&mut buf);
            buf[at] ^= 1 << bit;
            proptest::prop_assert_eq!(BatchHeader::decode(&buf), None);
        }
    }

    #[test]
    fn large_header_spans_blocks() {
        let mut h = header();
        h.entries = (0..300).map(|i| Entry { layer: 1, lba: i * 2, blocks: 1, kind: EntryKind::Data }).collect();
        h.crcs = (0..300).collect();
        assert_eq!(h.header_blocks(), 3);
        let mut buf = vec![0u8; 3 * BLOCK];
        h.encode_into(&mut buf);
        assert_eq!(BatchHeader::decode(&buf), Some(h));
        assert_eq!(BatchHeader::decode(&buf[..BLOCK]), None);
    }
}
