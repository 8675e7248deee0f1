//! Reading a crate's source for its layout tests (the engine's, the daemon's and the CSI
//! driver's `layout.rs`): the source files, the band each belongs to, and the `crate::` paths
//! each names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The band a source file belongs to: its folder under `src/`, or its own name.
pub fn band_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_owned()
}

/// Every band named by a `crate::<band>` path in `text`, with its line number. Each name at the
/// top level of a `use crate::{a, b::{c, d}}` group counts; comments do not.
pub fn references(text: &str) -> Vec<(usize, String)> {
    let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    let line_at = |at: usize| code[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("crate::") {
        let at = from + found + "crate::".len();
        from = at;
        let rest = &code[at..];
        let Some(group) = rest.strip_prefix('{') else {
            out.push((line_at(at), ident(rest)));
            continue;
        };
        // Top-level items of the group: the text after `{` and after each depth-0 comma.
        let mut starts = vec![0];
        let mut depth = 0usize;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => starts.push(i + 1),
                _ => {}
            }
        }
        for s in starts {
            let item = &group[s..];
            let skipped = item.len() - item.trim_start().len();
            let name = ident(item.trim_start());
            if !name.is_empty() {
                out.push((line_at(at + 1 + s + skipped), name));
            }
        }
    }
    out
}

/// Every `crate::` path under `src` that names a band above its own file's in `bands` (lowest
/// first), or a band not in the list: what a layout test reports.
pub fn wrong_uses(src: &Path, bands: &[&str]) -> Vec<String> {
    let mut all = Vec::new();
    files(src, &mut all);
    let rank: BTreeMap<&str, usize> = bands.iter().enumerate().map(|(i, b)| (*b, i)).collect();
    let mut wrong = Vec::new();
    for f in &all {
        let band = band_of(src, f);
        let Some(&mine) = rank.get(band.as_str()) else {
            wrong.push(format!("{}: band {band:?} is not in the list", f.display()));
            continue;
        };
        for (line, used) in references(&std::fs::read_to_string(f).unwrap()) {
            match rank.get(used.as_str()) {
                // Items re-exported at the crate root (`crate::Error`) are not bands.
                None if used.starts_with(char::is_uppercase) => {}
                None => wrong.push(format!("{}:{line}: crate::{used} is not a band", f.display())),
                Some(&theirs) if theirs > mine => {
                    wrong.push(format!("{}:{line}: {band} uses {used}, which is above it", f.display()));
                }
                Some(_) => {}
            }
        }
    }
    wrong
}

/// [`wrong_uses_in_room`] for each room and its order.
pub fn wrong_uses_in_rooms(src: &Path, rooms: &[(&str, &[&str])]) -> Vec<String> {
    rooms.iter().flat_map(|(room, order)| wrong_uses_in_room(src, room, order)).collect()
}

/// Every `crate::<room>::<name>` path in the files under `src/<room>` that names a file of the
/// room ranked above its own in `order` (lowest first), or a file not in it: the room's own
/// order, as [`wrong_uses`] keeps the crate's. A room's `mod.rs` is not ranked.
pub fn wrong_uses_in_room(src: &Path, room: &str, order: &[&str]) -> Vec<String> {
    let dir = src.join(room);
    let rank = |name: &str| order.iter().position(|n| *n == name);
    let mut all = Vec::new();
    files(&dir, &mut all);
    let mut wrong = Vec::new();
    for f in all {
        let mine = band_of(&dir, &f);
        if mine == "mod" {
            continue;
        }
        let Some(me) = rank(&mine) else {
            wrong.push(format!("{}: {room}/{mine} is not in the room's order", f.display()));
            continue;
        };
        for (line, used) in paths_into(&std::fs::read_to_string(&f).unwrap(), room) {
            match rank(&used) {
                Some(theirs) if theirs <= me => {}
                _ => wrong.push(format!("{}:{line}: {room}/{mine} uses {room}::{used}", f.display())),
            }
        }
    }
    wrong
}

/// The names `crate::<room>::<name>` paths in `text` reach (each top-level name of a
/// `crate::<room>::{a, b::c}` group too), with their line numbers.
pub fn paths_into(text: &str, room: &str) -> Vec<(usize, String)> {
    let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let prefix = format!("crate::{room}::");
    let mut out = Vec::new();
    for (at, _) in code.match_indices(&prefix) {
        let line = code[..at].matches('\n').count() + 1;
        let rest = &code[at + prefix.len()..];
        if rest.starts_with('{') {
            // The group up to its closing brace, read as a `crate::{...}` group.
            let mut depth = 0;
            let end = rest.char_indices().find(|&(_, c)| {
                depth += i32::from(c == '{') - i32::from(c == '}');
                depth == 0
            });
            let group = &rest[..end.map_or(rest.len(), |(i, _)| i + 1)];
            out.extend(references(&format!("crate::{group}")).into_iter().map(|(l, n)| (line + l - 1, n)));
        } else {
            out.push((line, rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::references;

    #[test]
    fn the_reference_finder_sees_groups_paths_and_skips_comments() {
        let text = "use crate::{map::{layers, segments::Pinned}, state::State};\n\
                    let x = crate::write::submit(); // crate::pool\n\
                    use crate::{\n    io::BLOCK,\n    read::{self, Reads},\n};\n";
        let got: Vec<(usize, String)> = references(text);
        let names: Vec<&str> = got.iter().map(|(_, b)| b.as_str()).collect();
        assert_eq!(names, ["map", "state", "write", "io", "read"]);
        assert_eq!(got[2].0, 2);
        assert_eq!(got[4].0, 5);
    }
}
