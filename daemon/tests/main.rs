//! The `ferrite` package's integration tests, one scenario per file, in folders by subject
//! (`data_path/`, `replication/`, `kubernetes/`, `backups/`, `daemon/`), built as one test
//! binary (`daemon_tests`): one compile of the shared helpers and one link instead of one per
//! file. A test is named `<subject>::<scenario>::<test>`, e.g.
//! `cargo nextest run --workspace -E 'test(/^data_path::qos::/)'`.

mod common;
#[path = "../../backup/tests/common/mod.rs"]
mod weed;

mod backups;
mod daemon;
mod data_path;
mod kubernetes;
mod replication;
