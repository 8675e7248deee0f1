//! The `ferrite` package's integration tests, one scenario per module (the files beside this
//! one), built as one test binary (`daemon_tests`): one compile of the shared helpers and one
//! link instead of one per file. A test is named `<module>::<test>`, e.g.
//! `cargo nextest run --workspace -E 'test(/^qos::/)'`.

mod common;
#[path = "../../backup/tests/common/mod.rs"]
mod weed;

mod attach;
mod backup;
mod backup_scale;
mod backup_targets;
mod changed_blocks;
mod cli;
mod crash;
mod csi;
mod csi_addons;
mod csi_backups;
mod csi_copies;
mod csi_encryption;
mod csi_metadata;
mod csi_node;
mod csi_replication;
mod deploy_render;
mod encryption;
mod failover_sim;
mod file_modes;
mod hostile;
mod hostile_store;
mod images;
mod interop;
mod kubernetes;
mod kubernetes_upgrade;
mod layout;
mod monitoring;
mod pool_format;
mod power_cut;
mod qos;
mod replica;
mod replica_hosts;
mod replica_roles;
mod replica_trust;
mod roles;
mod sync_encryption;
mod sync_replicas;
mod sync_trust;
mod tls;
mod versions;
