//! The daemon's layout stays true. The library's rooms (`src/lib.rs`) use one another in one
//! direction only, lowest first, and the binary's modules sit above them all: no import cycle,
//! no import that runs back up. Inside a room its files keep their order too, the services
//! (`api/`) never import one another, and the library names neither clap nor the CSI driver.
//! A new room or file must be placed in [`BANDS`] or [`ROOMS`].

use ferrite_testkit::bands;

use std::path::{Path, PathBuf};

/// Lowest first: the library's rooms, then the binary's modules. Each may use those before it.
const BANDS: &[&str] = &[
    "authz", "base", "records", "net", "replica", "sync", "api", "serve", "lib",
    // The `ferrite` binary, the front door over the library: printing, the global arguments,
    // the programs it runs, the client's command groups, and the dispatch.
    "out", "args", "program", "cli", "main",
];

/// The library's rooms whose files are ordered among themselves, lowest first. `api` is not
/// ordered: no service may use another ([`services_do_not_use_one_another`]).
const ROOMS: &[(&str, &[&str])] = &[
    ("base", &["size", "state", "error", "rpc", "config"]),
    (
        "records",
        &["rotations", "restores", "keys", "fence", "exports", "publications", "attachments", "backup_outcomes"],
    ),
    ("net", &["listen", "unix", "grpc"]),
];

/// The binary's files: everything under `src/` that the library does not declare.
const BINARY: &[&str] = &["out", "args", "program", "cli", "main"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn files_of(dir: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    bands::files(dir, &mut all);
    all
}

/// The file or folder name of `file` just under `room` (`records/attachments/mod.rs`: `attachments`).
fn name_in(room: &Path, file: &Path) -> String {
    bands::band_of(room, file)
}

#[test]
fn rooms_only_use_lower_rooms() {
    let wrong = bands::wrong_uses(&src(), BANDS);
    assert!(wrong.is_empty(), "the daemon's rooms must only use lower ones:\n{}", wrong.join("\n"));
}

#[test]
fn files_of_a_room_only_use_lower_files() {
    let wrong = bands::wrong_uses_in_rooms(&src(), ROOMS);
    assert!(wrong.is_empty(), "a room's files must only use lower ones:\n{}", wrong.join("\n"));
}

#[test]
fn services_do_not_use_one_another() {
    let dir = src().join("api");
    let mut wrong = Vec::new();
    for f in files_of(&dir) {
        let mine = name_in(&dir, &f);
        let text = std::fs::read_to_string(&f).unwrap();
        for (line, used) in bands::paths_into(&text, "api") {
            if used != mine {
                wrong.push(format!("{}:{line}: api/{mine} uses api::{used}", f.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "a service must not use another:\n{}", wrong.join("\n"));
}

/// Whether `code` holds `word` as a whole word (not `PoolStatus` for `Status`).
fn names(code: &str, word: &str) -> bool {
    let part = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(word).any(|(at, _)| !code[..at].ends_with(part) && !code[at + word.len()..].starts_with(part))
}

/// The lines of `files` whose code (not a comment) names one of `words`.
fn lines_naming(files: impl IntoIterator<Item = PathBuf>, words: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if words.iter().any(|w| names(code, w)) {
                found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    found
}

#[test]
fn the_library_names_neither_clap_nor_the_csi_driver() {
    let library = files_of(&src()).into_iter().filter(|f| !BINARY.contains(&bands::band_of(&src(), f).as_str()));
    let wrong = lines_naming(library, &["clap", "ferrite_csi", "#[arg"]);
    assert!(wrong.is_empty(), "the library must not use clap or ferrite-csi:\n{}", wrong.join("\n"));
}

/// The rooms below the services return the library's own error (`base/error.rs`), never a
/// gRPC status: only `base/rpc.rs` turns one into the other, and the services (`api/`) answer.
#[test]
fn the_rooms_below_the_services_return_their_own_error() {
    let below = ["base", "records", "replica", "sync"].iter().flat_map(|room| files_of(&src().join(room)));
    let wrong = lines_naming(below.filter(|f| !f.ends_with("base/rpc.rs")), &["Status", "Streaming", "tonic::Request"]);
    assert!(wrong.is_empty(), "a room below the services speaks gRPC:\n{}", wrong.join("\n"));
}

/// The design's pages: the map (ARCHITECTURE.md) and the topic pages under docs/design/.
fn design_pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![root.join("ARCHITECTURE.md")];
    let mut topics: Vec<PathBuf> =
        std::fs::read_dir(root.join("docs/design")).unwrap().map(|e| e.unwrap().path()).collect();
    topics.sort();
    pages.extend(topics);
    pages
}

/// Every source file the design names (`x.rs`, `dir/x.rs`) exists, every item it points at
/// (`x.rs::name`) is declared in a file of that name, and every page it links exists: the map
/// and its pages stay true as code moves. The map stays a map (at most 300 lines).
#[test]
fn every_pointer_of_the_architecture_is_true() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("git").arg("-C").arg(&root).args(["ls-files", "*.rs"]).output().unwrap();
    let files: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(|l| format!("/{l}")).collect();
    assert!(files.len() > 100, "git ls-files lists the tree");
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    assert!(map.lines().count() <= 300, "ARCHITECTURE.md is a map: topics go to docs/design/");
    let mut wrong = Vec::new();
    for page in design_pages(&root) {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(&root).unwrap().display().to_string();
        for (at, _) in text.match_indices("](") {
            let link = &text[at + 2..];
            let link = link[..link.find(')').unwrap_or(0)].split('#').next().unwrap();
            if !link.is_empty() && !link.contains("://") && !page.parent().unwrap().join(link).exists() {
                wrong.push(format!("{name}: the link {link} goes nowhere"));
            }
        }
        wrong.extend(pointers_of(&root, &files, &text).into_iter().map(|w| format!("{name}: {w}")));
    }
    assert!(wrong.is_empty(), "the design points at what is not there:\n{}", wrong.join("\n"));
}

/// What `text`'s quoted pointers (`x.rs`, `x.rs::item`) name that is not there.
fn pointers_of(root: &Path, files: &[String], text: &str) -> Vec<String> {
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
    wrong
}

/// Every log filter the tests, docs and manifests give (`ferrite_daemon::records::attachments=info`)
/// names a module that exists: a target is a module path, so a move would silently mute it.
#[test]
fn every_log_filter_names_a_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("git").arg("-C").arg(&root).args(["ls-files"]).output().unwrap();
    let mut wrong = Vec::new();
    for file in String::from_utf8(out.stdout).unwrap().lines() {
        if !file.ends_with(".sh") && !file.ends_with(".md") && !file.ends_with(".yaml") && !file.ends_with(".toml") {
            continue;
        }
        let text = std::fs::read_to_string(root.join(file)).unwrap_or_default();
        for (at, _) in text.match_indices("ferrite") {
            let target: String =
                text[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
            let level = text[at + target.len()..].strip_prefix('=').unwrap_or("");
            if !["off", "error", "warn", "info", "debug", "trace"].iter().any(|l| level.starts_with(l)) {
                continue;
            }
            let mut parts = target.split("::");
            // The crate (the binary `ferrite`, or `ferrite_<dir>`), then its modules.
            let dir = match parts.next().unwrap() {
                "ferrite" | "ferrite_daemon" => "daemon",
                krate => krate.trim_start_matches("ferrite_"),
            };
            let mut path = root.join(dir).join("src");
            for m in parts {
                path.push(m);
            }
            let exists = path.with_extension("rs").is_file() || path.join("mod.rs").is_file() || path.ends_with("src");
            if !exists {
                wrong.push(format!("{file}: {target}"));
            }
        }
    }
    assert!(wrong.is_empty(), "log filters naming no module:\n{}", wrong.join("\n"));
}
