//! Background work: `checkpoint` (capture the dirty maps, sync the store, commit, release empty
//! segments) and its thread; `cleaner` (moving victims' live blocks as log batches, the background
//! loop, and the room the write path asks for), `victims` (victim choice: a pure function of
//! the segment table) and `pace`, which paces client writes by what the cleaner gives back. Uses
//! the write path to write moves and to hold the open batch while a checkpoint captures.

pub(crate) mod checkpoint;
pub(crate) mod cleaner;
pub(crate) mod pace;
pub(crate) mod victims;
