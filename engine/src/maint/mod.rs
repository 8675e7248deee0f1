//! Background work: `checkpoint` (capture the dirty maps, sync the store, commit, release empty
//! segments) and its thread; `cleaner` (moving victims' live blocks as log batches, the background
//! loop, and the room the write path asks for), `victims` (victim choice: a pure function of
//! the segment table), `pace`, which paces client writes by what the cleaner gives back, and
//! `defrag` (a volume's scattered blocks rewritten in logical order, with the cleaner's moves).
//! Uses the write path to write moves and to hold the open batch while a checkpoint captures.

pub(crate) mod checkpoint;
pub(crate) mod cleaner;
pub(crate) mod defrag;
pub(crate) mod pace;
pub(crate) mod victims;
