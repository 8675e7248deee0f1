//! The CSI driver's modules use one another in one direction only, lowest first: no import
//! cycle. What every service shares (the node directory, ids, argument and class checks,
//! locating copies) sits below the CSI and CSI-Addons services, and the control loops (heartbeat,
//! failover) above them. A new module must be placed in [`MODULES`].

use ferrite_testkit::bands;

use std::path::Path;

/// Lowest first. Each may use those before it.
const MODULES: &[&str] = &[
    // What every service shares.
    "qos",
    "class",
    "host",
    "certs",
    "lease",
    "webhook",
    "nodes",
    "ids",
    "args",
    "copies",
    "encryption",
    "backups",
    // The CSI and CSI-Addons services.
    "identity",
    "addons",
    "controller",
    "snapshots",
    "publish",
    "group",
    "metadata",
    "fence",
    "volume_group",
    "replication",
    "node",
    "reclaim",
    // The control loops, and what starts everything.
    "heartbeat",
    "failover",
    "start",
    "lib",
];

#[test]
fn modules_only_use_lower_modules() {
    let wrong = bands::wrong_uses(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), MODULES);
    assert!(wrong.is_empty(), "the CSI driver's modules must only use lower ones:\n{}", wrong.join("\n"));
}
