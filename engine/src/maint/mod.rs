//! Background work: `checkpoint` (capture the dirty maps, sync the store, commit, release empty
//! segments) and its thread; `cleaner` (victims, moving their live blocks as log batches, the
//! background loop) and `pace`, which paces client writes by what the cleaner gives back. Uses
//! the write path to write moves and to hold the open batch while a checkpoint captures.

pub(crate) mod checkpoint;
pub(crate) mod cleaner;
pub(crate) mod pace;
