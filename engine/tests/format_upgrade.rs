//! A pool made by the previous format version (a fixture kept in the tree, made by ferrite 0.1.0
//! with format 1) opens, keeps every byte, and is upgraded in place; a damaged superblock is
//! read from its copy; a pool of a newer format is refused with both versions named.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ferrite_engine::format::{FORMAT_VERSION, OLDEST_FORMAT, SUPER_COPY_AT, Superblock};
use ferrite_engine::{ErrorKind, Pool, PoolOptions};

const PATTERN_AT: u64 = 4096;

fn pattern() -> Vec<u8> {
    (0..65536u32).map(|i| (i * 7 % 251) as u8).collect()
}

/// Unpacks the format-1 fixture into `dir`; returns (pool file, metadata directory).
fn unpack(dir: &Path) -> (PathBuf, PathBuf) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pool-format-1.tar.gz");
    let ok = std::process::Command::new("tar").arg("xzf").arg(&fixture).arg("-C").arg(dir).status().unwrap();
    assert!(ok.success(), "unpacking {}", fixture.display());
    (dir.join("format-1/pool.img"), dir.join("format-1/meta"))
}

fn opts() -> PoolOptions {
    PoolOptions { segment_size: 256 << 10, reserve_segments: 1, ..PoolOptions::default() }
}

fn superblock_at(file: &Path, off: u64) -> ferrite_engine::Result<Superblock> {
    let mut b = vec![0u8; 4096];
    std::fs::File::open(file).unwrap().read_exact_at(&mut b, off).unwrap();
    Superblock::decode(&b)
}

fn check_contents(pool: &Pool) {
    let mut got = vec![0u8; 65536];
    pool.open_snapshot("s").unwrap().read(PATTERN_AT, &mut got).unwrap();
    assert!(got == pattern(), "the snapshot's bytes changed");
    pool.open_volume("v").unwrap().read(PATTERN_AT, &mut got).unwrap();
    assert!(got[..4096].iter().all(|&b| b == 0xAB), "the volume's last write is missing");
    assert!(got[4096..] == pattern()[4096..], "the volume's bytes changed");
}

#[test]
fn a_format_1_pool_is_upgraded_in_place_and_keeps_its_data() {
    assert_eq!(OLDEST_FORMAT, 1);
    let dir = tempfile::tempdir().unwrap();
    let (file, meta) = unpack(dir.path());
    assert_eq!(superblock_at(&file, 0).unwrap().version, 1);
    assert!(superblock_at(&file, SUPER_COPY_AT).is_err(), "format 1 has no copy");

    let pool = Pool::open(&file, &meta, opts()).unwrap();
    assert_eq!(pool.recovery_report().upgraded_from, Some(1));
    check_contents(&pool);
    pool.close().unwrap();
    let (sb, copy) = (superblock_at(&file, 0).unwrap(), superblock_at(&file, SUPER_COPY_AT).unwrap());
    assert_eq!(sb.version, FORMAT_VERSION);
    assert_eq!(sb, copy);

    // Opened again: nothing more to upgrade.
    let pool = Pool::open(&file, &meta, opts()).unwrap();
    assert_eq!(pool.recovery_report().upgraded_from, None);
    check_contents(&pool);
    pool.close().unwrap();
}

#[test]
fn a_damaged_superblock_is_read_from_its_copy_and_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let (file, meta) = unpack(dir.path());
    Pool::open(&file, &meta, opts()).unwrap().close().unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(&[0xFF; 64], 100).unwrap(); // a torn write in the first block
    assert!(superblock_at(&file, 0).is_err());
    let pool = Pool::open(&file, &meta, opts()).unwrap();
    check_contents(&pool);
    pool.close().unwrap();
    assert_eq!(superblock_at(&file, 0).unwrap(), superblock_at(&file, SUPER_COPY_AT).unwrap());
}

#[test]
fn a_newer_format_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let (file, meta) = unpack(dir.path());
    Pool::open(&file, &meta, opts()).unwrap().close().unwrap();
    let newer = Superblock { version: FORMAT_VERSION + 1, ..superblock_at(&file, 0).unwrap() };
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(&newer.encode(), 0).unwrap();
    let e = Pool::open(&file, &meta, opts()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(msg.contains(&format!("format version {}", FORMAT_VERSION + 1)), "{msg}");
    assert!(msg.contains(&format!("{OLDEST_FORMAT} to {FORMAT_VERSION}")), "{msg}");
    // Nothing was written: the newer superblock is still there, its copy untouched.
    assert_eq!(superblock_at(&file, 0).unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(superblock_at(&file, SUPER_COPY_AT).unwrap().version, FORMAT_VERSION);
}
