//! The daemon's modules use one another in one direction only, lowest first: no import cycle.
//! What every service shares (`rpc`, `authz`) sits below the services; the services below what
//! wires them together. A new module must be placed in [`MODULES`].

#[path = "../../engine/tests/support/bands.rs"]
mod bands;

use std::path::Path;

/// Lowest first. Each may use those before it.
const MODULES: &[&str] = &[
    "size",
    "state",
    "authz",
    "rpc",
    "config",
    "rotations",
    "restores",
    "encryption",
    "fence",
    "listen",
    "exports",
    "publications",
    "attachments",
    "replica",
    "sync",
    "metrics",
    "admin",
    "backups",
    "cli",
    "hand_over",
    "backup_cli",
    "daemon",
    "attach_only",
    "pool_format",
    "node_pool",
    "main",
];

#[test]
fn modules_only_use_lower_modules() {
    let wrong = bands::wrong_uses(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), MODULES);
    assert!(wrong.is_empty(), "the daemon's modules must only use lower ones:\n{}", wrong.join("\n"));
}
