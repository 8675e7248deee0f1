//! Snapshot-based async replication, the part that needs no network: what a mirror snapshot
//! ships ([`delta`]) and applying it on the replica ([`apply`]).
//!
//! The primary takes a mirror snapshot every interval; the layers between the peer's last
//! mirror snapshot and the new one are exactly the changed blocks (`Pool::changed_ranges`, no
//! media I/O), and a first sync ships only allocated blocks. A delta is a sequence of
//! [`Piece`]s in offset order, each data block with its crc32c computed where it was read, so
//! the replica checks every block end to end. The replica writes pieces into its volume's
//! head, which no client reads (clients read the last mirror snapshot), and takes the same
//! mirror snapshot only when the whole delta has arrived: a replica is always exactly one of the
//! primary's mirror snapshots. An interrupted delta resumes at the first offset not yet applied.

pub mod apply;
pub mod delta;

/// Bytes per block: what a crc covers.
pub const BLOCK: usize = 4096;

/// One piece of a delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Whole blocks of data at `offset`, with each block's crc32c.
    Data { offset: u64, data: Vec<u8>, crcs: Vec<u32> },
    /// `len` bytes at `offset` that read as zeros (trimmed or never written since the base).
    Zero { offset: u64, len: u64 },
}

impl Piece {
    /// Where the piece starts and how many bytes it covers.
    pub fn range(&self) -> (u64, u64) {
        match self {
            Piece::Data { offset, data, .. } => (*offset, data.len() as u64),
            Piece::Zero { offset, len } => (*offset, *len),
        }
    }
}

/// The crc32c of every block of `data` (whole blocks).
pub fn block_crcs(data: &[u8]) -> Vec<u32> {
    data.chunks(BLOCK).map(crc32c::crc32c).collect()
}
