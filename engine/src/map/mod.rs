//! The maps, in memory and pure: no I/O, no locks, no threads. `extent_map` maps a layer's
//! logical blocks to pool blocks (or zero markers) in 4 MiB chunks; `view` is a layer's
//! persistent map from blocks to the layer of its chain that answers them; `layers` chains layers
//! into volumes, snapshots and clones (resolve through the views, unmap with zero markers, merge,
//! free) and keeps every view exact;
//! `segments` is the segment table (state, live blocks, per-block crcs) and the read pins that
//! keep a segment from reuse while it is read. Uses `format` and `io::BLOCK` only.

pub(crate) mod extent_map;
pub(crate) mod layers;
pub(crate) mod segments;
pub(crate) mod view;
