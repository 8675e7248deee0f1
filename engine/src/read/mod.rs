//! The read path: `resolve` turns a range into pool blocks through the layer chain and checks
//! what was read against their checksums; `reads` resolves ranges under the state lock, pins the segments they read,
//! gathers what memory holds and leaves the store reads to the caller (or does them), then
//! checks every block's crc; `readahead` detects sequential streams per volume handle and
//! reads windows ahead of them on two threads into a cache keyed by pool block. Uses the write
//! path's tail only to find blocks still in an unwritten batch.

pub(crate) mod readahead;
pub(crate) mod reads;
pub(crate) mod resolve;
