//! Encrypted volumes: nothing of their plaintext reaches the pool file, the metadata holds
//! their data key only wrapped, a locked volume neither reads nor writes, a wrong key changes
//! nothing, snapshots and clones read with their parents' key, the cleaner and scrub work
//! without any key, and rekeying rewraps without rewriting.

#![allow(clippy::cast_possible_truncation)] // the shared test patterns

use crate::common;

use common::{Fixture, pattern, small_opts};
use ferrite_crypt::{Error as KeyError, Kek};
use ferrite_engine::{ErrorKind, Image, Pool};

const B: usize = 4096;

fn kek_a(id: &str) -> Result<Kek, KeyError> {
    Kek::new(id, [0xa1; 32])
}

fn kek_b(id: &str) -> Result<Kek, KeyError> {
    Kek::new(id, [0xb2; 32])
}

/// Recognisable plaintext: a marker repeated, different per block.
fn marked(blocks: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(blocks * B);
    for i in 0..blocks {
        let line = format!("FERRITE-PLAINTEXT-{i:06}-");
        v.extend(line.bytes().cycle().take(B));
    }
    v
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Every file under `dir`, concatenated (the metadata store).
fn all_bytes(dir: &std::path::Path) -> Vec<u8> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            out.extend(std::fs::read(&p).unwrap());
        }
    }
    out
}

#[test]
fn the_pool_file_and_the_metadata_hold_no_plaintext_and_no_key() {
    let dir = tempfile::tempdir().unwrap();
    let (file, meta) = (dir.path().join("pool"), dir.path().join("meta"));
    let data = marked(64);
    {
        let pool = Pool::create(&file, &meta, 16 << 20, small_opts()).unwrap();
        pool.create_encrypted_volume("secret", 1 << 20, &kek_a("k1").unwrap()).unwrap();
        pool.create_volume("plain", 1 << 20).unwrap();
        let v = pool.open_volume("secret").unwrap();
        v.write(0, &data).unwrap();
        v.write(100, b"FERRITE-PLAINTEXT-unaligned").unwrap();
        pool.open_volume("plain").unwrap().write(0, b"FERRITE-PLAINTEXT-in-the-clear").unwrap();
        let mut back = vec![0; data.len()];
        v.read(0, &mut back).unwrap();
        assert_eq!(&back[100..127], b"FERRITE-PLAINTEXT-unaligned");
        back[100..127].copy_from_slice(&data[100..127]);
        assert_eq!(back, data);
        pool.close().unwrap();
    }
    let raw = std::fs::read(&file).unwrap();
    // The control: the plaintext volume's bytes are there, so the scan would see them.
    assert!(contains(&raw, b"FERRITE-PLAINTEXT-in-the-clear"));
    assert!(!contains(&raw, b"FERRITE-PLAINTEXT-0"), "plaintext of the encrypted volume in the pool file");
    assert!(!contains(&raw, b"unaligned"), "an unaligned write's plaintext in the pool file");
    // The metadata directory's tail file holds batches as the store does: ciphertext here.
    let meta_bytes = all_bytes(&meta);
    assert!(contains(&meta_bytes, b"FERRITE-PLAINTEXT-in-the-clear"), "the control, in the tail file");
    assert!(!contains(&meta_bytes, b"FERRITE-PLAINTEXT-0"), "plaintext of the encrypted volume in the metadata");
    assert!(!contains(&meta_bytes, b"unaligned"), "an unaligned write's plaintext in the metadata");
    assert!(!contains(&meta_bytes, &[0xa1; 32]), "the key-encryption key in the metadata");
    assert!(contains(&meta_bytes, b"k1"), "the wrapped key names its key-encryption key");

    // Reopened, it is locked until unlocked with the right key.
    let pool = Pool::open(&file, &meta, small_opts()).unwrap();
    let info = pool.volume_info("secret").unwrap().encryption.unwrap();
    assert_eq!((info.key_id.as_str(), info.unlocked), ("k1", false));
    assert_eq!(pool.volume_info("plain").unwrap().encryption, None);
    let v = pool.open_volume("secret").unwrap();
    let mut buf = vec![0; B];
    let e = v.read(0, &mut buf).unwrap_err();
    assert_eq!((e.kind(), e.errno()), (ErrorKind::Locked, libc::ENOKEY), "{e}");
    assert!(e.to_string().contains("locked") && e.to_string().contains("k1"), "{e}");
    let before = pool.volume_info("secret").unwrap().allocated;
    assert_eq!(v.write(1 << 19, &[9; B]).unwrap_err().kind(), ErrorKind::Locked);
    assert_eq!(v.write(7, &[9; 10]).unwrap_err().kind(), ErrorKind::Locked);
    assert_eq!(pool.volume_info("secret").unwrap().allocated, before, "a locked volume's write wrote");
    // Other volumes are unaffected.
    pool.open_volume("plain").unwrap().read(0, &mut buf).unwrap();

    let e = pool.unlock(Image::Volume("secret"), kek_b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Locked);
    assert!(e.to_string().contains("does not open"), "{e}");
    assert!(!pool.volume_info("secret").unwrap().encryption.unwrap().unlocked);
    let e = pool
        .unlock(Image::Volume("secret"), |id| {
            Err(KeyError::Unavailable { key_id: id.into(), why: "no such file".into() })
        })
        .unwrap_err();
    assert!(e.to_string().contains("not available"), "{e}");

    pool.unlock(Image::Volume("secret"), kek_a).unwrap();
    assert!(pool.volume_info("secret").unwrap().encryption.unwrap().unlocked);
    let mut back = vec![0; data.len()];
    v.read(0, &mut back).unwrap();
    assert_eq!(&back[100..127], b"FERRITE-PLAINTEXT-unaligned");
    // Unlocking again with a wrong key still fails, and leaves it unlocked.
    assert!(pool.unlock(Image::Volume("secret"), kek_b).is_err());
    v.read(0, &mut buf).unwrap();
}

#[test]
fn snapshots_and_clones_read_with_their_parents_key() {
    let (f, pool) = Fixture::new(32);
    pool.create_encrypted_volume("v", 256 << 10, &kek_a("k").unwrap()).unwrap();
    let v = pool.open_volume("v").unwrap();
    let first = pattern(1, 256 << 10);
    v.write(0, &first).unwrap();
    pool.create_snapshot("v", "s").unwrap();
    v.write(B as u64, &pattern(2, B)).unwrap();
    pool.clone_volume(Image::Snapshot("s"), "c").unwrap();
    pool.clone_volume(Image::Volume("v"), "c2").unwrap();
    let c = pool.open_volume("c").unwrap();
    c.write(2 * B as u64, &pattern(3, B)).unwrap();
    for name in ["c", "c2"] {
        assert_eq!(pool.volume_info(name).unwrap().encryption.unwrap().key_id, "k", "{name}");
    }
    pool.close().unwrap();

    let pool = f.reopen();
    // A snapshot is unlocked on its own; a clone on its own (its chain shares the key).
    pool.unlock(Image::Snapshot("s"), kek_a).unwrap();
    let mut got = vec![0; 256 << 10];
    pool.open_snapshot("s").unwrap().read(0, &mut got).unwrap();
    assert_eq!(got, first);
    pool.unlock(Image::Volume("c"), kek_a).unwrap();
    pool.open_volume("c").unwrap().read(0, &mut got).unwrap();
    let mut want = first.clone();
    want[2 * B..3 * B].copy_from_slice(&pattern(3, B));
    assert_eq!(got, want);
    pool.unlock(Image::Volume("c2"), kek_a).unwrap();
    pool.open_volume("c2").unwrap().read(0, &mut got).unwrap();
    let mut want = first.clone();
    want[B..2 * B].copy_from_slice(&pattern(2, B));
    assert_eq!(got, want);
    // Deleting everything but the clone keeps it readable (a merge keeps its key), and the
    // data key goes with the last layer that used it.
    pool.delete_volume("v").unwrap();
    pool.delete_volume("c2").unwrap();
    pool.delete_snapshot("s").unwrap();
    pool.open_volume("c").unwrap().read(0, &mut got).unwrap();
    assert_eq!(&got[2 * B..3 * B], &pattern(3, B)[..]);
    pool.delete_volume("c").unwrap();
    pool.close().unwrap();
    let pool = f.reopen();
    assert!(pool.volumes().is_empty());
}

#[test]
fn the_cleaner_and_scrub_need_no_key() {
    let (f, pool) = Fixture::new(24);
    pool.create_encrypted_volume("v", 512 << 10, &kek_a("k").unwrap()).unwrap();
    let v = pool.open_volume("v").unwrap();
    for round in 0..6u64 {
        v.write(0, &pattern(round, 512 << 10)).unwrap();
    }
    pool.close().unwrap();
    // Locked: the cleaner moves its blocks and scrub checks them, without the key.
    let pool = f.reopen();
    assert!(pool.reclaim().unwrap().segments_cleaned > 0);
    let report = pool.scrub(&mut |_| {}).unwrap();
    assert!(report.damaged.is_empty() && report.checked_bytes > 0, "{report:?}");
    pool.close().unwrap();
    let pool = f.reopen();
    pool.unlock(Image::Volume("v"), kek_a).unwrap();
    let mut got = vec![0; 512 << 10];
    pool.open_volume("v").unwrap().read(0, &mut got).unwrap();
    assert_eq!(got, pattern(5, 512 << 10));
}

#[test]
fn rekeying_rewraps_online_and_the_old_key_stops_opening_it() {
    let (f, pool) = Fixture::new(16);
    pool.create_encrypted_volume("v", 64 << 10, &kek_a("old").unwrap()).unwrap();
    pool.create_volume("plain", 64 << 10).unwrap();
    let v = pool.open_volume("v").unwrap();
    v.write(0, &pattern(9, 64 << 10)).unwrap();
    // The wrong old key is refused and changes nothing.
    let e = pool.rewrap_volume("v", kek_b, &kek_b("new").unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Locked, "{e}");
    assert_eq!(pool.volume_info("v").unwrap().encryption.unwrap().key_id, "old");
    let e = pool.rewrap_volume("plain", kek_a, &kek_b("new").unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let info = pool.rewrap_volume("v", kek_a, &kek_b("new").unwrap()).unwrap();
    assert_eq!((info.key_id.as_str(), info.unlocked), ("new", true));
    // Online: the open handle goes on reading and writing.
    v.write(0, &pattern(10, B)).unwrap();
    let mut got = vec![0; 64 << 10];
    v.read(0, &mut got).unwrap();
    assert_eq!(&got[..B], &pattern(10, B)[..]);
    pool.close().unwrap();
    let pool = f.reopen();
    assert!(pool.unlock(Image::Volume("v"), kek_a).is_err(), "the old key still opens it");
    pool.unlock(Image::Volume("v"), kek_b).unwrap();
    pool.open_volume("v").unwrap().read(0, &mut got).unwrap();
    assert_eq!(&got[B..], &pattern(9, 64 << 10)[B..]);
}

#[test]
fn a_replica_made_from_ciphertext_opens_with_the_source_key() {
    let (_f, pool) = Fixture::new(32);
    pool.create_encrypted_volume("src", 256 << 10, &kek_a("k").unwrap()).unwrap();
    let data = pattern(4, 256 << 10);
    pool.open_volume("src").unwrap().write(0, &data).unwrap();
    pool.create_snapshot("src", "m1").unwrap();
    // What replication does, no key in hand: ciphertext out of a snapshot, into a replica
    // made with the same wrapped key.
    let wrapped = pool.wrapped_key(Image::Snapshot("m1")).unwrap().unwrap();
    assert_eq!(pool.wrapped_key(Image::Volume("src")).unwrap().as_ref(), Some(&wrapped));
    let mut raw = vec![0; 256 << 10];
    pool.open_snapshot("m1").unwrap().ciphertext().read(0, &mut raw).unwrap();
    assert_ne!(raw, data);
    pool.create_volume_wrapped("replica", 256 << 10, &wrapped).unwrap();
    let replica = pool.open_volume("replica").unwrap();
    assert_eq!(replica.read(0, &mut vec![0; B]).unwrap_err().kind(), ErrorKind::Locked);
    let c = replica.clone().ciphertext();
    c.write(0, &raw).unwrap();
    assert_eq!(c.write(10, &raw[..100]).unwrap_err().kind(), ErrorKind::InvalidArgument, "a partial ciphertext write");
    assert!(pool.create_volume_wrapped("bad", B as u64, &wrapped[..10]).is_err());
    // Promoted: the source's key opens it, and it reads the plaintext.
    pool.unlock(Image::Volume("replica"), kek_a).unwrap();
    let mut got = vec![0; 256 << 10];
    replica.read(0, &mut got).unwrap();
    assert_eq!(got, data);
}
