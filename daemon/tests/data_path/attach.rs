//! `ferrite attach` on a machine without the kernel drivers (this one: no ublk, no NBD module):
//! every failure is one clear error, nothing is left behind, and a daemon restart drops records of
//! devices that are gone. The real devices are tested in the QEMU guest (tests/vm/).

use crate::common;

use common::Daemon;

fn err(d: &Daemon, args: &[&str]) -> String {
    let o = d.cli(args);
    assert!(!o.status.success(), "ferrite {args:?} should fail");
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(e.trim().lines().count(), 1, "one line: {e}");
    e
}

#[test]
fn attach_errors_are_clear_and_leave_nothing_behind() {
    if ferrite_ublk::available() || std::path::Path::new("/sys/module/nbd").exists() {
        return common::skip("attach errors: this kernel has ublk or nbd; the guest tests cover real devices", false);
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "v", "64M"]);
    assert!(err(&d, &["attach", "v", "--transport", "ublk"]).contains("ublk-control"));
    assert!(err(&d, &["attach", "v", "--transport", "floppy"]).contains("transport must be auto, ublk or nbd"));
    assert!(err(&d, &["attach", "v", "--depth", "5000"]).contains("depth"));
    assert!(err(&d, &["attach", "nope"]).contains("not found"));
    // auto falls back to the kernel NBD client, which is missing here too; the export that the
    // attach made for it is taken back.
    let e = err(&d, &["attach", "v"]);
    assert!(e.contains("kernel NBD attach"), "{e}");
    assert_eq!(d.ok(&["-o", "json", "export", "list"]).trim(), "[]");
    assert_eq!(d.ok(&["-o", "json", "attachments"]).trim(), "[]");
    assert!(err(&d, &["detach", "/dev/ublkb7"]).contains("not attached"));
    // The volume is free to go.
    d.ok(&["volume", "delete", "v"]);
}

#[test]
fn restart_drops_records_of_devices_that_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    // As a daemon killed while /dev/ublkb9 and /dev/nbd3 were attached would leave it.
    std::fs::write(
        dir.path().join("attachments.json"),
        r#"[{"volume":"v","transport":"ublk","device":"/dev/ublkb9","index":9,"read_only":false},
            {"volume":"w","transport":"nbd","device":"/dev/nbd3","index":3,"read_only":false,"export":"w"}]"#,
    )
    .unwrap();
    let d = Daemon::start(dir.path());
    assert_eq!(d.ok(&["-o", "json", "attachments"]).trim(), "[]");
    let log = d.log();
    assert!(log.contains("ublk device is gone") || log.contains("cannot recover"), "{log}");
    assert!(log.contains("the kernel NBD device is gone"), "{log}");
    let saved = std::fs::read_to_string(dir.path().join("attachments.json")).unwrap();
    assert_eq!(saved.trim(), "[]");
}
