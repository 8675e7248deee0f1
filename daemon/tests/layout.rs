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

/// Every source file ARCHITECTURE.md names (`x.rs`, `dir/x.rs`) exists, and every item it points
/// at (`x.rs::name`) is declared in a file of that name: the map stays true as code moves.
#[test]
fn every_pointer_of_the_architecture_is_true() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let out = std::process::Command::new("git").arg("-C").arg(&root).args(["ls-files", "*.rs"]).output().unwrap();
    let files: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(|l| format!("/{l}")).collect();
    assert!(files.len() > 100, "git ls-files lists the tree");
    let mut wrong = Vec::new();
    for quoted in text.split('`').skip(1).step_by(2) {
        let (file, item) = quoted.split_once("::").map_or((quoted, None), |(f, i)| (f, Some(i)));
        if !file.ends_with(".rs") || file.contains(char::is_whitespace) {
            continue;
        }
        let found: Vec<&String> = files.iter().filter(|f| f.ends_with(&format!("/{file}"))).collect();
        if found.is_empty() {
            wrong.push(format!("{quoted}: no file {file}"));
            continue;
        }
        let Some(item) = item.map(|i| i.split(['(', ':']).next().unwrap()) else { continue };
        let declared = found.iter().any(|f| {
            let src = std::fs::read_to_string(root.join(&f[1..])).unwrap_or_default();
            ["fn", "struct", "enum", "trait", "type", "const", "static", "mod"].iter().any(|k| {
                src.contains(&format!("{k} {item}("))
                    || src.contains(&format!("{k} {item} "))
                    || src.contains(&format!("{k} {item}<"))
                    || src.contains(&format!("{k} {item}:"))
                    || src.contains(&format!("{k} {item};"))
            })
        });
        if !declared {
            wrong.push(format!(
                "{quoted}: {item} is not declared in {}",
                found.iter().map(|f| &f[1..]).collect::<Vec<_>>().join(", ")
            ));
        }
    }
    assert!(wrong.is_empty(), "ARCHITECTURE.md points at what is not there:\n{}", wrong.join("\n"));
}
