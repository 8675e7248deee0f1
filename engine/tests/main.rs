//! The engine's integration tests, one scenario per module (the files beside this one), built as
//! one test binary (`engine_tests`): one compile of the shared helpers and one link instead of one
//! per file. A test is named `<module>::<test>`: `-E 'test(/^changed_blocks::/)'` picks a file's.

mod common;

mod backend_conformance;
mod changed_blocks;
mod cleaner;
mod crash_model;
mod deep_chains;
mod defrag;
mod encryption;
mod format_upgrade;
mod groups;
mod layout;
mod mirror;
mod mirror_completion;
mod readahead;
mod recovery;
mod rotation;
mod snapshots;
mod volumes;
mod write_back;
