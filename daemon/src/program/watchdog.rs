//! `ferrite watchdog`: fails the ublk devices no daemon served within their hold.

use std::path::Path;

/// Runs until killed.
pub fn run(socket: &Path) -> ! {
    super::init_logging("info");
    ferrite_ublk::hold::run(&ferrite_ublk::hold::path(socket));
}
