//! Snapshots, clones and deletion: content, isolation, space and persistence.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use common::{Fixture, pattern};
use ferrite_engine::{ErrorKind, Image, Pool};

const B: u64 = 4096;
const MIB: u64 = 1 << 20;

fn read(pool: &Pool, name: &str, snapshot: bool, len: usize) -> Vec<u8> {
    let v = if snapshot { pool.open_snapshot(name) } else { pool.open_volume(name) }.unwrap();
    let mut buf = vec![0u8; len];
    v.read(0, &mut buf).unwrap();
    buf
}

#[test]
fn snapshot_freezes_content_and_clones_diverge() {
    let (_f, pool) = Fixture::new(64);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let a = pattern(1, MIB as usize);
    v.write(0, &a).unwrap();
    let info = pool.create_snapshot("v", "s1").unwrap();
    assert_eq!((info.size, info.layer_bytes, info.volume.as_deref()), (MIB, MIB, Some("v")));
    assert_eq!(pool.volume_info("v").unwrap().chain_depth, 2);
    assert_eq!(pool.volume_info("v").unwrap().exclusive, 0);
    // Writes, trims and zeroes after the snapshot do not reach it.
    v.write(4096, &pattern(2, 8192)).unwrap();
    v.trim(64 << 10, 64 << 10).unwrap();
    v.write_zeroes(200 << 10, 5000, false).unwrap();
    assert_eq!(read(&pool, "s1", true, MIB as usize), a);
    let now = read(&pool, "v", false, MIB as usize);
    assert_eq!(&now[4096..12288], &pattern(2, 8192)[..]);
    assert!(now[64 << 10..128 << 10].iter().all(|&b| b == 0), "a trim hides the snapshot's data");
    assert_eq!(&now[..4096], &a[..4096]);
    let alloc = pool.open_volume("v").unwrap().allocation(0, MIB).unwrap();
    assert!(alloc.contains(&(64 << 10, false)), "trimmed range reports as a hole: {alloc:?}");
    // A snapshot handle is read-only.
    let s = pool.open_snapshot("s1").unwrap();
    assert!(s.is_read_only());
    assert_eq!(s.write(0, &[1; 4096]).unwrap_err().kind(), ErrorKind::ReadOnly);
    assert_eq!(s.trim(0, 4096).unwrap_err().kind(), ErrorKind::ReadOnly);
    // Clones of the snapshot and of the live volume start from their source and diverge.
    pool.clone_volume(Image::Snapshot("s1"), "c1").unwrap();
    pool.clone_volume(Image::Volume("v"), "c2").unwrap();
    assert_eq!(read(&pool, "c1", false, MIB as usize), a);
    assert_eq!(read(&pool, "c2", false, MIB as usize), now);
    pool.open_volume("c1").unwrap().write(0, &[7; 4096]).unwrap();
    pool.open_volume("c2").unwrap().write(0, &[8; 4096]).unwrap();
    v.write(0, &[9; 4096]).unwrap();
    assert_eq!(read(&pool, "c1", false, 4096), vec![7; 4096]);
    assert_eq!(read(&pool, "c2", false, 4096), vec![8; 4096]);
    assert_eq!(read(&pool, "v", false, 4096), vec![9; 4096]);
    assert_eq!(read(&pool, "s1", true, 4096), a[..4096]);
    // Clone of a clone.
    pool.create_snapshot("c1", "c1s").unwrap();
    pool.clone_volume(Image::Snapshot("c1s"), "c3").unwrap();
    assert_eq!(read(&pool, "c3", false, 4096), vec![7; 4096]);
    assert_eq!(pool.volume_info("c3").unwrap().chain_depth, 3);
    // Names: unique, validated.
    assert_eq!(pool.create_snapshot("v", "s1").unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(pool.create_snapshot("v", "a b").unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(pool.create_snapshot("nope", "s9").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(pool.clone_volume(Image::Snapshot("s1"), "v").unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(pool.snapshots(Some("v")).unwrap().len(), 1);
    assert_eq!(pool.snapshots(None).unwrap().len(), 2);
}

#[test]
fn deletion_is_always_allowed_and_frees_exactly_what_nothing_needs() {
    let (f, pool) = Fixture::new(64);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    let a = pattern(1, MIB as usize);
    v.write(0, &a).unwrap();
    pool.create_snapshot("v", "s1").unwrap();
    pool.clone_volume(Image::Snapshot("s1"), "c").unwrap();
    // Overwrite a quarter and trim a quarter of the volume after the snapshot.
    v.write(0, &pattern(2, (MIB / 4) as usize)).unwrap();
    v.trim(MIB / 2, MIB / 4).unwrap();
    let live = |p: &Pool| p.stats().live / B;
    assert_eq!(live(&pool), 256 + 64, "snapshot data plus the overwrite");
    let s = pool.snapshot_info("s1").unwrap();
    assert_eq!(s.reclaimable_on_delete, 0, "a clone still needs all of it");
    // Deleting the snapshot hides its layer: the clone and the volume still read right.
    pool.delete_snapshot("s1").unwrap();
    assert_eq!(pool.delete_snapshot("s1").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(live(&pool), 256 + 64);
    assert_eq!(read(&pool, "c", false, MIB as usize), a);
    // Deleting the volume leaves one dependent: the hidden layer merges into the clone, and
    // the volume's own writes are freed.
    pool.delete_volume("v").unwrap();
    assert_eq!(live(&pool), 256);
    assert_eq!(read(&pool, "c", false, MIB as usize), a);
    assert_eq!(pool.volume_info("c").unwrap().chain_depth, 1);
    assert_eq!(pool.volume_info("c").unwrap().exclusive, MIB);
    // Persisted: a clean reopen and a crash both see the same.
    pool.close().unwrap();
    let pool = f.reopen();
    assert_eq!(read(&pool, "c", false, MIB as usize), a);
    assert_eq!(live(&pool), 256);
    assert!(pool.open_volume("v").is_err() && pool.snapshots(None).unwrap().is_empty());
    f.backend.crash();
    drop(pool);
    f.backend.restart(ferrite_engine::io::CrashMode::DropAll);
    let pool = f.reopen();
    assert_eq!(read(&pool, "c", false, MIB as usize), a);
    pool.delete_volume("c").unwrap();
    assert_eq!(live(&pool), 0);
}

#[test]
fn snapshot_outlives_its_volume_and_a_chain_collapses_when_deleted() {
    let (f, pool) = Fixture::new(64);
    pool.create_volume("v", 256 << 10).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut expect = Vec::new();
    for i in 0..5u64 {
        v.write(i * B, &pattern(i, 4096)).unwrap();
        pool.create_snapshot("v", &format!("s{i}")).unwrap();
        expect.push(read(&pool, "v", false, 256 << 10));
    }
    assert_eq!(pool.volume_info("v").unwrap().chain_depth, 6);
    // Delete the middle ones: the rest still read as taken.
    pool.delete_snapshot("s1").unwrap();
    pool.delete_snapshot("s3").unwrap();
    for i in [0usize, 2, 4] {
        assert_eq!(read(&pool, &format!("s{i}"), true, 256 << 10), expect[i], "s{i}");
    }
    assert_eq!(pool.volume_info("v").unwrap().chain_depth, 4);
    pool.delete_volume("v").unwrap();
    let s4 = pool.snapshot_info("s4").unwrap();
    assert_eq!((s4.volume, s4.volume_id > 0), (None, true));
    assert_eq!(read(&pool, "s4", true, 256 << 10), expect[4]);
    pool.close().unwrap();
    let pool = f.reopen();
    assert_eq!(read(&pool, "s2", true, 256 << 10), expect[2]);
    for s in ["s0", "s2", "s4"] {
        pool.delete_snapshot(s).unwrap();
    }
    assert_eq!(pool.stats().live, 0, "nothing left once every reference is gone");
}

#[test]
fn a_thousand_snapshots_of_one_volume() {
    let (_f, pool) = Fixture::new(64);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    for i in 0..1000u64 {
        if i % 100 == 0 {
            v.write((i / 100) * B, &pattern(i, 4096)).unwrap();
        }
        pool.create_snapshot("v", &format!("s{i:04}")).unwrap();
    }
    assert_eq!(pool.snapshots(Some("v")).unwrap().len(), 1000);
    assert_eq!(pool.volume_info("v").unwrap().chain_depth, 1001);
    let s = read(&pool, "s0500", true, 16 * 4096);
    for k in 0..16u64 {
        let want = if k <= 5 { pattern(k * 100, 4096) } else { vec![0; 4096] };
        assert_eq!(&s[(k * B) as usize..((k + 1) * B) as usize], &want[..], "block {k}");
    }
}

#[test]
fn changed_ranges_between_snapshots_and_the_live_volume() {
    let (_f, pool) = Fixture::new(64);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(1, 64 << 10)).unwrap();
    v.write(512 << 10, &pattern(2, 8192)).unwrap();
    let vol = Image::Volume("v");
    assert_eq!(pool.changed_ranges(vol, None).unwrap(), vec![(0, 64 << 10), (512 << 10, 8192)]);
    pool.create_snapshot("v", "a").unwrap();
    v.write(4096, &[1; 4096]).unwrap();
    v.write(100 << 10, &[2; 5000]).unwrap(); // touches two blocks
    pool.create_snapshot("v", "b").unwrap();
    v.trim(512 << 10, 8192).unwrap();
    let ab = pool.changed_ranges(Image::Snapshot("b"), Some("a")).unwrap();
    assert_eq!(ab, vec![(4096, 4096), (100 << 10, 8192)]);
    let a_live = pool.changed_ranges(vol, Some("a")).unwrap();
    assert_eq!(a_live, vec![(4096, 4096), (100 << 10, 8192), (512 << 10, 8192)], "a trim is a change");
    assert_eq!(pool.changed_ranges(vol, Some("b")).unwrap(), vec![(512 << 10, 8192)]);
    // Allocated ranges of a snapshot; a later snapshot is not beneath an earlier one.
    assert_eq!(pool.changed_ranges(Image::Snapshot("a"), None).unwrap(), vec![(0, 64 << 10), (512 << 10, 8192)]);
    let err = pool.changed_ranges(Image::Snapshot("a"), Some("b")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    // Deleting the snapshot in between keeps the diff from the older one exact.
    pool.delete_snapshot("b").unwrap();
    assert_eq!(pool.changed_ranges(vol, Some("a")).unwrap(), a_live);
}

#[test]
fn scrub_finds_a_damaged_block_and_names_every_image_that_reads_it() {
    let (f, pool) = Fixture::new(64);
    pool.create_volume("v", MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(3, 8192)).unwrap();
    pool.create_snapshot("v", "s").unwrap();
    pool.clone_volume(Image::Snapshot("s"), "c").unwrap();
    v.write(64 << 10, &pattern(4, 4096)).unwrap();
    let mut seen = Vec::new();
    let clean = pool.scrub(&mut |p| seen.push(p)).unwrap();
    assert_eq!((clean.checked_bytes, clean.damaged.len()), (3 * 4096, 0));
    assert_eq!(seen.last().unwrap().checked_bytes, seen.last().unwrap().total_bytes);
    // Damage the second data block of the first batch (after its 1-block header).
    f.backend.corrupt(ferrite_engine::format::DATA_START + 2 * 4096 + 9, &[0x5A]);
    let r = pool.scrub(&mut |_| {}).unwrap();
    assert_eq!(r.damaged.len(), 1, "{r:?}");
    let d = &r.damaged[0];
    assert_eq!(d.offset, 4096);
    assert_eq!(d.images, vec!["c".to_string(), "v".to_string(), "v@s".to_string()]);
}

#[test]
fn thin_overcommit_cap_refuses_create_grow_and_clone_past_it() {
    let opts = ferrite_engine::PoolOptions { overcommit_ratio: Some(2.0), ..common::small_opts() };
    let (_f, pool) = Fixture::with_opts(16, opts); // 4 MiB of segments: cap 8 MiB
    pool.create_volume("a", 6 * MIB).unwrap();
    assert_eq!(pool.create_volume("b", 3 * MIB).unwrap_err().kind(), ErrorKind::NoSpace);
    pool.create_volume("b", 2 * MIB).unwrap();
    assert_eq!(pool.grow_volume("b", 3 * MIB).unwrap_err().kind(), ErrorKind::NoSpace);
    pool.create_snapshot("b", "s").unwrap();
    let err = pool.clone_volume(Image::Snapshot("s"), "c").unwrap_err();
    assert!(err.kind() == ErrorKind::NoSpace && err.to_string().contains("overcommit"), "{err}");
    pool.delete_volume("a").unwrap();
    pool.clone_volume(Image::Snapshot("s"), "c").unwrap();
}

#[test]
fn snapshots_are_listed_in_creation_order() {
    let (_f, pool) = Fixture::new(16);
    pool.create_volume("v", 1 << 20).unwrap();
    pool.create_volume("w", 1 << 20).unwrap();
    for (vol, name) in [("v", "s10"), ("w", "b"), ("v", "s2"), ("v", "a")] {
        pool.create_snapshot(vol, name).unwrap();
    }
    let names = |v| pool.snapshots(v).unwrap().into_iter().map(|s| s.name).collect::<Vec<_>>();
    assert_eq!(names(Some("v")), ["s10", "s2", "a"]);
    assert_eq!(names(None), ["s10", "b", "s2", "a"]);
}

#[test]
fn rollback_returns_a_volume_to_its_own_snapshot_and_frees_what_was_written_since() {
    let (f, mut pool) = Fixture::new(32);
    pool.create_volume("v", MIB).unwrap();
    let (a, b, c) = (pattern(1, MIB as usize), pattern(2, 64 << 10), pattern(3, 256 << 10));
    pool.open_volume("v").unwrap().write(0, &a).unwrap();
    pool.create_snapshot("v", "s1").unwrap();
    pool.open_volume("v").unwrap().write(0, &b).unwrap();
    pool.create_snapshot("v", "s2").unwrap();
    pool.grow_volume("v", 2 * MIB).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(MIB, &c).unwrap();
    let live = pool.stats().live;

    let info = pool.rollback_volume("v", "s1").unwrap();
    assert_eq!(info.size, MIB, "the volume takes the snapshot's size");
    assert_eq!(read(&pool, "v", false, MIB as usize), a);
    assert_eq!(&read(&pool, "s2", true, MIB as usize)[..b.len()], &b[..], "later snapshots stay");
    assert_eq!(pool.stats().live, live - c.len() as u64, "what was written since s2 is freed");
    let mut buf = vec![0u8; 4096];
    v.read(0, &mut buf).unwrap();
    assert_eq!(buf, a[..4096], "open handles read the rolled-back content");

    pool.create_volume("w", MIB).unwrap();
    pool.create_snapshot("w", "w1").unwrap();
    let err = pool.rollback_volume("v", "w1").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert_eq!(pool.rollback_volume("nope", "s1").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(pool.rollback_volume("v", "nope").unwrap_err().kind(), ErrorKind::NotFound);

    // Forward again to the later snapshot, then a crash: the catalog and maps agree.
    pool.open_volume("v").unwrap().write(4096, &c[..8192]).unwrap();
    pool.rollback_volume("v", "s2").unwrap();
    pool.flush().unwrap();
    f.backend.crash();
    drop(pool);
    f.backend.restart(ferrite_engine::io::CrashMode::Random(3));
    pool = f.reopen();
    let mut want = a.clone();
    want[..b.len()].copy_from_slice(&b);
    assert_eq!(read(&pool, "v", false, MIB as usize), want);
    assert_eq!(read(&pool, "s1", true, MIB as usize), a);
}
