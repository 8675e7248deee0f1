//! `ferrite pool format`: what it refuses (a filesystem, a partition table, another pool, a
//! catalog in place, a device in use), a preallocated file pool that keeps its blocks, and a pool
//! on a block device (a loop device) that the daemon serves, keeps across a restart, and
//! discards freed segments of.

#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::nbd::{open, read_image, write_on};
use common::{BIN, Daemon, have, skip};

const MIB: u64 = 1 << 20;

/// `ferrite pool format ARGS` with the daemon configuration of `dir` (written if missing).
fn format(dir: &Path, args: &[&str]) -> Output {
    let cfg = config(dir, None);
    Command::new(BIN)
        .args(["pool", "format", "--config"])
        .arg(cfg)
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

/// Writes `dir`/ferrite.toml (pool-path `pool` if given) unless it exists; returns its path.
fn config(dir: &Path, pool: Option<(&Path, &str)>) -> PathBuf {
    let cfg = dir.join("ferrite.toml");
    std::fs::create_dir_all(dir).unwrap();
    if !cfg.exists() {
        let mut text = "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\n".to_string();
        if let Some((p, discard)) = pool {
            text += &format!("pool-path = {:?}\npool-discard = {discard:?}\n", p.display().to_string());
        }
        std::fs::write(&cfg, text).unwrap();
    }
    cfg
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn refused(o: &Output, says: &str) {
    assert!(!o.status.success(), "format should have been refused: {}", String::from_utf8_lossy(&o.stdout));
    assert!(stderr(o).contains(says), "expected {says:?} in: {}", stderr(o));
}

fn image(path: &Path, bytes: &[(usize, &[u8])]) {
    let mut img = vec![0u8; 64 << 20];
    for &(at, b) in bytes {
        img[at..at + b.len()].copy_from_slice(b);
    }
    std::fs::write(path, img).unwrap();
}

/// Bytes the filesystem has allocated to `path`.
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Writes 16 MiB, overwrites it (the first copy's segments die), reclaims; returns what reads back.
fn churn(d: &Daemon) -> Vec<u8> {
    d.ok(&["volume", "create", "v", "64M"]);
    let mut s = open(d, "v");
    for round in 0..3u8 {
        let data = vec![round + 1; 16 * MIB as usize];
        for (i, chunk) in data.chunks(MIB as usize).enumerate() {
            assert_eq!(write_on(&mut s, i as u64 * MIB, chunk), 0);
        }
    }
    drop(s);
    d.ok(&["export", "stop", "v"]);
    let r = d.json(&["pool", "reclaim"]);
    assert!(r["segments_freed"].as_u64().unwrap() >= 4, "{r}");
    read_image(d, "v", 16 * MIB)
}

#[test]
fn refuses_filesystems_partition_tables_and_pools_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let dir = |name: &str| {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    };

    println!("== partition tables (DOS, GPT): refused, the file untouched");
    let mbr = root.join("mbr.img");
    // One partition entry (type 0x83 from sector 2048) and the boot signature.
    image(&mbr, &[(446, &[0, 0, 0, 0, 0x83, 0, 0, 0, 0, 8, 0, 0, 0, 0, 1, 0]), (510, &[0x55, 0xAA])]);
    let before = std::fs::read(&mbr).unwrap();
    refused(&format(&dir("a"), &[mbr.to_str().unwrap()]), "DOS (MBR) partition table");
    assert!(std::fs::read(&mbr).unwrap() == before, "a refused format wrote to the file");
    let gpt = root.join("gpt.img");
    image(&gpt, &[(510, &[0x55, 0xAA]), (446, &[0, 0, 2, 0, 0xEE]), (512, b"EFI PART")]);
    refused(&format(&dir("a"), &[gpt.to_str().unwrap()]), "GPT partition table");
    assert!(!root.join("a/meta").exists(), "a refused format left a catalog behind");

    if have("mkfs.ext4") {
        println!("== an ext4 filesystem: refused, then formatted with --force, and served");
        let fs = root.join("fs.img");
        image(&fs, &[]);
        let mk = Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&fs).output().unwrap();
        assert!(mk.status.success(), "{}", stderr(&mk));
        let o = format(&dir("b"), &[fs.to_str().unwrap()]);
        refused(&o, "ext2/3/4 filesystem");
        assert!(stderr(&o).contains("--force"), "the message says how to go on: {}", stderr(&o));
        let o = format(&dir("b"), &[fs.to_str().unwrap(), "--force"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains("set pool-path"), "{}", String::from_utf8_lossy(&o.stdout));
        std::fs::remove_file(root.join("b/ferrite.toml")).unwrap();
        config(&root.join("b"), Some((&fs, "auto")));
        let d = Daemon::start(&root.join("b"));
        d.ok(&["volume", "create", "x", "16M"]);
        assert_eq!(d.json(&["pool", "status"])["path"], fs.display().to_string());
    }

    println!("== another pool: refused; a catalog in place: refused");
    let c = dir("c");
    let o = format(&c, &["--size", "256M"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let pool = c.join("pool.img");
    assert_eq!(std::fs::metadata(&pool).unwrap().len(), 256 * MIB);
    assert_eq!(std::fs::metadata(&pool).unwrap().permissions().mode() & 0o777, 0o600);
    refused(&format(&dir("d"), &[pool.to_str().unwrap()]), "a Ferrite pool");
    refused(&format(&c, &["--force"]), "already holds a pool's catalog");
    // The first pool is intact and served.
    let d = Daemon::start(&c);
    d.ok(&["volume", "create", "y", "16M"]);
}

#[test]
fn a_preallocated_pool_file_keeps_its_blocks_and_a_sparse_one_gives_them_back() {
    let tmp = tempfile::tempdir().unwrap();
    let (pre, sparse) = (tmp.path().join("pre"), tmp.path().join("sparse"));
    std::fs::create_dir_all(&pre).unwrap();
    std::fs::create_dir_all(&sparse).unwrap();
    let o = format(&pre, &["--size", "256M", "--preallocate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("preallocating: 100%"), "progress is shown: {}", stderr(&o));
    let file = pre.join("pool.img");
    assert!(allocated(&file) >= 256 * MIB, "preallocated: {} bytes allocated", allocated(&file));
    let d = Daemon::start(&pre);
    let data = churn(&d);
    assert!(data.iter().all(|&b| b == 3));
    assert!(allocated(&file) >= 256 * MIB, "freed segments keep their blocks: {} allocated", allocated(&file));

    // The default pool file is sparse: freed segments go back to the filesystem.
    let d = Daemon::start(&sparse);
    let file = sparse.join("pool.img");
    d.ok(&["volume", "create", "w", "64M"]);
    let mut s = open(&d, "w");
    for (i, chunk) in vec![9u8; 48 * MIB as usize].chunks(MIB as usize).enumerate() {
        assert_eq!(write_on(&mut s, i as u64 * MIB, chunk), 0);
    }
    drop(s);
    d.ok(&["export", "stop", "w"]);
    let high = allocated(&file);
    let data = churn(&d);
    assert!(data.iter().all(|&b| b == 3));
    d.ok(&["volume", "delete", "w"]);
    d.json(&["pool", "reclaim"]);
    let low = allocated(&file);
    println!("sparse pool file: {} MiB allocated at most, {} MiB after reclaim", high / MIB, low / MIB);
    assert!(low + 32 * MIB < high, "freed segments were not given back: {high} -> {low}");
}

/// A loop device, detached on drop.
struct Loop {
    dev: String,
}

impl Loop {
    fn new(file: &Path) -> Option<Self> {
        let o = Command::new("losetup").args(["--find", "--show"]).arg(file).output().ok()?;
        o.status.success().then(|| Self { dev: String::from_utf8_lossy(&o.stdout).trim().to_string() })
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

#[test]
fn a_pool_on_a_block_device_is_served_kept_and_discarded() {
    let tmp = tempfile::tempdir().unwrap();
    let backing = tmp.path().join("disk.img");
    std::fs::File::create(&backing).unwrap().set_len(512 * MIB).unwrap();
    let Some(lo) = Loop::new(&backing) else {
        skip("pool_format: no loop device (needs root and the loop module)", false);
        return;
    };
    let dev = PathBuf::from(&lo.dev);
    let dir = tmp.path().join("d");
    std::fs::create_dir_all(&dir).unwrap();
    config(&dir, Some((&dev, "on")));

    if have("mkfs.ext4") {
        println!("== a mounted filesystem on the device: refused even with --force");
        assert!(Command::new("mkfs.ext4").args(["-q", "-F", &lo.dev]).status().unwrap().success());
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        // Mounted in a mount namespace of its own that ends with the format: a namespace another
        // test creates meanwhile (`ip netns exec`, `unshare`) would copy a mount made here and keep
        // the device busy after our umount, for as long as that namespace lives.
        let cfg = config(&dir, None);
        let o = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                r#"mount "$1" "$2" && exec "$3" pool format --config "$4" --data-dir "$5" --force"#,
                "sh",
            ])
            .arg(&lo.dev)
            .arg(&mnt)
            .arg(BIN)
            .arg(&cfg)
            .arg(&dir)
            .output()
            .unwrap();
        refused(&o, "is in use");
        refused(&format(&dir, &[]), "ext2/3/4 filesystem");
        refused(&format(&dir, &["--size", "1G", "--force"]), "a device pool takes the whole device");
    }

    println!("== formatted, served, kept across a restart");
    let o = format(&dir, &["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("formatted") && out.contains("segments of 4.0 MiB"), "{out}");
    let mut d = Daemon::start(&dir);
    let status = d.json(&["pool", "status"]);
    assert_eq!(status["path"], lo.dev.as_str());
    assert!(status["size"].as_u64().unwrap() > 500 * MIB, "{status}");
    // The daemon holds the device: another format (or a second daemon) is refused.
    refused(&format(&tmp.path().join("other"), &[&lo.dev, "--force"]), "is in use");
    // Fill the backing file (the loop device passes discards on as holes).
    let mut s = open(&d, {
        d.ok(&["volume", "create", "big", "400M"]);
        "big"
    });
    for (i, chunk) in vec![7u8; 256 * MIB as usize].chunks(4 * MIB as usize).enumerate() {
        assert_eq!(write_on(&mut s, i as u64 * 4 * MIB, chunk), 0);
    }
    drop(s);
    d.ok(&["export", "stop", "big"]);
    let data = churn(&d);
    d.stop();
    let d = Daemon::start(&dir);
    assert!(read_image(&d, "v", 16 * MIB) == data, "the device pool kept its data across a restart");
    assert!(read_image(&d, "big", 4 * MIB).iter().all(|&b| b == 7));

    println!("== pool-discard = on: freed segments reach the device (BLKDISCARD)");
    let high = allocated(&backing);
    d.ok(&["volume", "delete", "big"]);
    d.json(&["pool", "reclaim"]);
    let low = allocated(&backing);
    println!(
        "backing file of the loop device: {} MiB allocated, {} MiB after the delete and reclaim",
        high / MIB,
        low / MIB
    );
    assert!(low + 128 * MIB < high, "discards did not reach the device: {high} -> {low}");
}
