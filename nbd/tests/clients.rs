//! The NBD server against real, independent clients from Debian's packages: nbdinfo, qemu-img,
//! qemu-io, nbdcopy and nbdsh. Each test skips (with a message) if its client is missing.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small values

use crate::common;

use std::path::Path;
use std::process::Command;

use common::{Harness, MIB, have};

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed: {text}");
    text
}

fn write_file(path: &Path, len: usize, seed: u8) -> Vec<u8> {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    std::fs::write(path, &data).unwrap();
    data
}

#[test]
fn nbdinfo_lists_exports_and_maps_allocation() {
    if !have("nbdinfo") || !have("qemu-io") {
        return;
    }
    let h = Harness::new(512 * MIB);
    h.export("alpha", 64 * MIB, false);
    h.export("beta", 8 * MIB, true);
    let list = run(Command::new("nbdinfo").arg("--list").arg(format!("nbd+unix://?socket={}", h.sock().display())));
    assert!(list.contains("alpha") && list.contains("beta"), "{list}");
    let info = run(Command::new("nbdinfo").arg("--json").arg(h.uri("alpha")));
    assert!(info.contains("\"export-size\": 67108864"), "{info}");
    assert!(info.contains("\"can_multi_conn\": true"), "{info}");
    assert!(info.contains("\"is_read_only\": false"), "{info}");
    assert!(run(Command::new("nbdinfo").arg("--json").arg(h.uri("beta"))).contains("\"is_read_only\": true"));
    // Write 1 MiB at 4 MiB, then the map shows exactly that as data.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x5a 4M 1M"]).arg(h.qemu("alpha")));
    let map = run(Command::new("nbdinfo").arg("--map").arg(h.uri("alpha")));
    let lines: Vec<&str> = map.lines().collect();
    assert_eq!(lines.len(), 3, "{map}");
    assert!(lines[0].split_whitespace().take(3).eq(["0", "4194304", "3"]), "{map}");
    assert!(lines[1].split_whitespace().take(3).eq(["4194304", "1048576", "0"]), "{map}");
    assert!(lines[2].split_whitespace().take(2).eq(["5242880", "61865984"]), "{map}");
    // An unknown export is refused with a clear error, and the server keeps serving.
    let out = Command::new("nbdinfo").arg(h.uri("nope")).output().unwrap();
    assert!(!out.status.success());
    run(Command::new("nbdinfo").arg(h.uri("alpha")));
}

#[test]
fn qemu_img_convert_in_and_out_and_compare() {
    if !have("qemu-img") {
        return;
    }
    let h = Harness::new(512 * MIB);
    h.export("disk", 32 * MIB, false);
    let src = h.dir.path().join("src.raw");
    let mut data = write_file(&src, 32 * MIB as usize, 7);
    // Leave a hole so sparse handling is exercised on the way back.
    data[8 * MIB as usize..12 * MIB as usize].fill(0);
    std::fs::write(&src, &data).unwrap();
    run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&src).arg(h.qemu("disk")));
    run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&src).arg(h.qemu("disk")));
    let back = h.dir.path().join("back.raw");
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw"]).arg(h.qemu("disk")).arg(&back));
    assert!(std::fs::read(&back).unwrap() == data);
    let info = run(Command::new("qemu-img").args(["info", "-f", "raw"]).arg(h.qemu("disk")));
    assert!(info.contains("32 MiB"), "{info}");
}

#[test]
fn qemu_io_patterns_discard_and_write_zeroes() {
    if !have("qemu-io") {
        return;
    }
    let h = Harness::new(512 * MIB);
    h.export("v", 16 * MIB, false);
    let t = h.qemu("v");
    let io = |cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        run(c.arg(&t))
    };
    io(&["write -P 0xab 0 1M", "write -P 0xcd 1M 64k", "write -P 0x11 3000 1234", "write -f -P 0x22 2M 4k"]);
    let out = io(&[
        "read -P 0xab 0 2048",
        "read -P 0x11 3000 1234",
        "read -P 0xab 4234 1044298",
        "read -P 0xcd 1M 64k",
        "read -P 0x22 2M 4k",
    ]);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    io(&["discard 1M 64k", "write -z 0 512k", "flush"]);
    let out = io(&["read -P 0 1M 64k", "read -P 0 0 512k", "read -P 0xab 512k 512k"]);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // Unaligned write-zeroes and reads spanning data and holes.
    io(&["write -P 0x44 0 8k", "write -z 100 200", "write -P 0x33 8M 4k"]);
    let out = io(&[
        "read -P 0 100 200",
        "read -P 0x44 0 100",
        "read -P 0x44 300 1000",
        "read -P 0 7M 1M",
        "read -P 0x33 8M 4k",
    ]);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // Writes past the end fail cleanly.
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", "write 16M 4k"]).arg(&t).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("error") || text.contains("Input/output") || text.contains("No space") || !out.status.success(),
        "{text}"
    );
}

#[test]
fn nbdcopy_roundtrip_with_multiple_connections() {
    if !have("nbdcopy") {
        return;
    }
    let h = Harness::new(512 * MIB);
    h.export("c", 24 * MIB, false);
    let src = h.dir.path().join("in.raw");
    let mut data = write_file(&src, 24 * MIB as usize, 3);
    run(Command::new("nbdcopy").args(["--connections=4", "--requests=16"]).arg(&src).arg(h.uri("c")));
    // Scatter a quarter of the blocks over the log, so the copy out reads through readahead
    // windows of scattered blocks, four connections reading out of order.
    let v = h.pool.open_volume("c").unwrap();
    let blocks = 24 * MIB / 4096;
    for i in 0..blocks / 4 {
        let at = ((i * 7919) % blocks * 4096) as usize;
        let block = [(i % 251) as u8; 4096];
        v.write(at as u64, &block).unwrap();
        data[at..at + 4096].copy_from_slice(&block);
    }
    let out = h.dir.path().join("out.raw");
    run(Command::new("nbdcopy").args(["--connections=4"]).arg(h.uri("c")).arg(&out));
    assert!(std::fs::read(&out).unwrap() == data);
    let s = h.pool.stats();
    eprintln!("readahead {} KiB, hits {} KiB", s.readahead_bytes >> 10, s.readahead_hit_bytes >> 10);
    assert!(s.readahead_hit_bytes > 0, "the copy out was served by readahead: {s:?}");
}

#[test]
fn read_only_export_refuses_writes() {
    if !have("qemu-io") {
        return;
    }
    let h = Harness::new(512 * MIB);
    h.export("ro", 4 * MIB, true);
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k"]).arg(h.qemu("ro")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!text.contains("wrote 4096"), "{text}");
    run(Command::new("qemu-io").args(["-r", "-f", "raw", "-c", "read -P 0 0 4k"]).arg(h.qemu("ro")));
}
