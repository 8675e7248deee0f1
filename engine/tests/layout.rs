//! The engine's layout stays true: its bands (the folders and top-level files of `src/`) use
//! one another in one direction only, lowest first, so there is no import cycle and no import
//! that runs back up. Every `crate::<band>` path in a file of one band must name the same band
//! or one listed before it in [`BANDS`]. A new module must be placed in the list.

use ferrite_testkit::bands;

use std::path::Path;

/// Lowest first. Each may use those before it (see `src/lib.rs` for what each owns).
const BANDS: &[&str] = &[
    "batch", "error", "rng", "io", "format", "map", "qos", "meta", "keys", "mirror", "fill", "gate", "state", "ctx",
    "write", "read", "maint", "recovery", "pool", "volume", "ops", "lib",
];

#[test]
fn bands_only_use_lower_bands() {
    let wrong = bands::wrong_uses(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), BANDS);
    assert!(wrong.is_empty(), "the engine's bands must only use lower bands:\n{}", wrong.join("\n"));
}
