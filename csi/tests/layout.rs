//! The CSI driver's layout stays true. Its rooms (`src/lib.rs`) are what they serve: `shared`
//! (what every service uses), `spec` (the CSI services), `addons` (the CSI-Addons services),
//! `kube` (the control loops over the Kubernetes API), and what starts them. A room uses only
//! rooms below it, and `kube` uses neither `spec` nor `addons`: a control loop and a CSI call
//! meet only in what they share. Inside a room its files keep an order too. A new room or file
//! must be placed in [`BANDS`] or [`ROOMS`].

use ferrite_testkit::bands;

use std::path::{Path, PathBuf};

/// Lowest first. Each may use those before it.
const BANDS: &[&str] = &["shared", "spec", "addons", "kube", "start", "lib"];

/// Each room's files, lowest first.
const ROOMS: &[(&str, &[&str])] = &[
    ("shared", &["qos", "class", "pvs", "host", "nodes", "ids", "args", "copies", "keys", "backups"]),
    ("spec", &["identity", "controller", "snapshots", "publish", "group", "metadata", "node"]),
    ("addons", &["identity", "fence", "volume_group", "replication", "reclaim", "key_rotation"]),
    ("kube", &["certs", "lease", "webhook", "heartbeat", "failover"]),
];

/// The rooms `kube` must not use, though they sit below it.
const NOT_FOR_KUBE: &[&str] = &["spec", "addons"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn rooms_only_use_lower_rooms() {
    let wrong = bands::wrong_uses(&src(), BANDS);
    assert!(wrong.is_empty(), "the CSI driver's rooms must only use lower ones:\n{}", wrong.join("\n"));
}

#[test]
fn files_of_a_room_only_use_lower_files() {
    let wrong = bands::wrong_uses_in_rooms(&src(), ROOMS);
    assert!(wrong.is_empty(), "a room's files must only use lower ones:\n{}", wrong.join("\n"));
}

#[test]
fn the_control_loops_use_no_csi_service() {
    let mut all = Vec::new();
    bands::files(&src().join("kube"), &mut all);
    let mut wrong = Vec::new();
    for f in all {
        for (line, used) in bands::references(&std::fs::read_to_string(&f).unwrap()) {
            if NOT_FOR_KUBE.contains(&used.as_str()) {
                wrong.push(format!("{}:{line}: kube uses {used}", f.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "kube must use neither spec nor addons:\n{}", wrong.join("\n"));
}

/// Every room orders its files (a file outside `BANDS` is [`rooms_only_use_lower_rooms`]'s).
#[test]
fn every_room_is_placed() {
    for entry in std::fs::read_dir(src()).unwrap().map(Result::unwrap).filter(|e| e.path().is_dir()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        assert!(ROOMS.iter().any(|(room, _)| *room == name), "room {name} has no order in ROOMS");
    }
}
