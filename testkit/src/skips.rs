use std::process::Command;

/// Records a skipped test: says why, and lists it in `$FERRITE_SKIPS` (the suite prints them in
/// one line). Under CI a skip for want of something the suite installs itself (`installable`)
/// fails instead: only what cannot exist on the machine (a kernel feature) may be skipped there.
///
/// # Panics
/// Under CI (`CI=true`) when `installable`.
pub fn skip(why: &str, installable: bool) {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    assert!(!(installable && ci), "{why}: scripts/setup.sh installs it, so under CI it must be there");
    eprintln!("SKIPPED: {why}");
    if let Some(f) = std::env::var_os("FERRITE_SKIPS") {
        use std::io::Write as _;
        let file = std::fs::OpenOptions::new().create(true).append(true).open(f);
        let _ = file.and_then(|mut f| writeln!(f, "{why}"));
    }
}

/// Whether `tool` is on PATH (every tool the tests use is one setup.sh installs); a skip if not.
#[must_use]
pub fn have(tool: &str) -> bool {
    let found =
        Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().is_ok_and(|o| o.status.success());
    if !found {
        skip(&format!("{tool} is not installed (scripts/setup.sh installs it)"), true);
    }
    found
}
