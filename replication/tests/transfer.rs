//! Deltas between two pools in one process: a first sync ships only allocated blocks, an
//! incremental one only what changed, interrupted transfers resume or restart exactly, and a
//! bad piece or stream changes nothing on the replica. An encrypted source's data-key rotation
//! and rekeys reach its replica as ciphertext and wrappings.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use std::sync::Arc;
use std::time::Duration;

use ferrite_crypt::Kek;
use ferrite_engine::format::DATA_START;
use ferrite_engine::io::MemoryBackend;
use ferrite_engine::{ErrorKind, Image, Pool, PoolOptions};
use ferrite_replication::apply::Transfer;
use ferrite_replication::delta::Delta;
use ferrite_replication::{BLOCK, Piece};
use ferrite_testkit::pattern;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;
const PIECE: usize = 256 << 10;

fn pool() -> (tempfile::TempDir, Pool) {
    let opts = PoolOptions {
        segment_size: 1 << 20,
        reserve_segments: 2,
        checkpoint_interval: Duration::from_secs(3600),
        background_cleaner: false,
        ..PoolOptions::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(MemoryBackend::new(DATA_START + 128 * MIB));
    let pool = Pool::create_on(backend, &dir.path().join("meta"), opts).unwrap();
    (dir, pool)
}

fn content(pool: &Pool, snapshot: &str) -> Vec<u8> {
    let mut buf = vec![0u8; usize::try_from(SIZE).unwrap()];
    pool.open_snapshot(snapshot).unwrap().read(0, &mut buf).unwrap();
    buf
}

/// Ships `to` over `base` from `src` into `dst`'s volume "r", from byte `from`; returns the
/// data bytes sent.
fn ship(src: &Pool, dst: &Pool, to: &str, base: Option<&str>, resume: Option<u64>) -> u64 {
    ship_keyed(src, dst, to, base, resume, None)
}

/// [`ship`] with the wrapped keys a push of an encrypted volume carries.
fn ship_keyed(
    src: &Pool,
    dst: &Pool,
    to: &str,
    base: Option<&str>,
    resume: Option<u64>,
    keys: Option<&[Vec<u8>]>,
) -> u64 {
    let delta = Delta::plan(src, to, base).unwrap();
    let mut t = Transfer::begin(dst, "r", base, to, delta.size, delta.end(), resume, keys).unwrap();
    let mut sent = 0;
    for p in delta.pieces(src, t.next(), PIECE).unwrap() {
        let p = p.unwrap();
        if let Piece::Data { data, .. } = &p {
            sent += data.len() as u64;
        }
        t.apply(&p).unwrap();
    }
    t.commit(dst).unwrap();
    sent
}

/// A primary with a thin 64 MiB volume holding 3 MiB of data in three places and mirror
/// snapshot m1.
fn primary() -> (tempfile::TempDir, Pool) {
    let (d, p) = pool();
    p.create_volume("v", SIZE).unwrap();
    let v = p.open_volume("v").unwrap();
    for (i, at) in [0, 20 * MIB, 63 * MIB].into_iter().enumerate() {
        v.write(at, &pattern(i as u64 + 1, MIB as usize)).unwrap();
    }
    v.trim(20 * MIB, 64 << 10).unwrap();
    p.create_snapshot("v", "m1").unwrap();
    (d, p)
}

#[test]
fn first_sync_ships_allocated_blocks_and_increments_ship_changed_blocks() {
    let (_a, src) = primary();
    let (_b, dst) = pool();
    let sent = ship(&src, &dst, "m1", None, None);
    assert_eq!(sent, 3 * MIB - (64 << 10), "a first sync sends allocated blocks only");
    assert_eq!(content(&dst, "m1"), content(&src, "m1"));

    // 200 random 4 KiB writes (some landing twice) and a trim: only those blocks cross.
    let v = src.open_volume("v").unwrap();
    let mut changed = std::collections::BTreeSet::new();
    let mut x = 7u64;
    for i in 0..200 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let block = (x >> 33) % (SIZE / BLOCK as u64);
        v.write(block * BLOCK as u64, &pattern(1000 + i, BLOCK)).unwrap();
        changed.insert(block);
    }
    v.trim(0, 8 * BLOCK as u64).unwrap();
    for b in 0..8 {
        changed.remove(&b);
    }
    src.create_snapshot("v", "m2").unwrap();
    let delta = Delta::plan(&src, "m2", Some("m1")).unwrap();
    assert_eq!(delta.data_bytes(), changed.len() as u64 * BLOCK as u64, "exactly the changed blocks");
    ship(&src, &dst, "m2", Some("m1"), None);
    assert_eq!(content(&dst, "m2"), content(&src, "m2"));
    assert_eq!(content(&dst, "m1"), content(&src, "m1"), "the older mirror snapshot is untouched");
}

#[test]
fn an_interrupted_transfer_resumes_from_its_durable_point_or_restarts_exactly() {
    let (_a, src) = primary();
    let (_b, dst) = pool();
    let delta = Delta::plan(&src, "m1", None).unwrap();
    let mut t = Transfer::begin(&dst, "r", None, "m1", delta.size, delta.end(), None, None).unwrap();
    let (mut first, mut last_end) = (0, 0);
    for p in delta.pieces(&src, 0, PIECE).unwrap().take(5) {
        let p = p.unwrap();
        first += p.range().1;
        last_end = p.range().0 + p.range().1;
        t.apply(&p).unwrap();
    }
    let kept = t.durable().unwrap();
    assert_eq!(kept, last_end, "the resume point is the end of the last piece applied");
    drop(t); // the link went down
    assert!(dst.snapshot_info("m1").is_err(), "no snapshot from a partial delta");

    // Resumed: only what is left crosses.
    let mut t = Transfer::begin(&dst, "r", None, "m1", delta.size, delta.end(), Some(kept), None).unwrap();
    let mut sent = 0;
    for p in delta.pieces(&src, t.next(), PIECE).unwrap() {
        let p = p.unwrap();
        if let Piece::Data { data, .. } = &p {
            sent += data.len() as u64;
        }
        t.apply(&p).unwrap();
    }
    assert_eq!(first + sent, delta.data_bytes(), "nothing sent twice");
    t.commit(&dst).unwrap();
    assert_eq!(content(&dst, "m1"), content(&src, "m1"));

    // An increment abandoned halfway and started over (no resume point): the replica's head is
    // returned to the base first, so the result is exact.
    src.open_volume("v").unwrap().write(5 * MIB, &pattern(9, 2 * MIB as usize)).unwrap();
    src.create_snapshot("v", "m2").unwrap();
    let delta = Delta::plan(&src, "m2", Some("m1")).unwrap();
    // (A sender that lied about the delta's end: the stray piece lands outside the real delta.)
    let mut t = Transfer::begin(&dst, "r", Some("m1"), "m2", delta.size, SIZE, None, None).unwrap();
    let stray = pattern(77, PIECE);
    let crcs = ferrite_replication::block_crcs(&stray);
    t.apply(&Piece::Data { offset: 40 * MIB, data: stray, crcs }).unwrap();
    t.durable().unwrap();
    drop(t);
    ship(&src, &dst, "m2", Some("m1"), None);
    assert_eq!(content(&dst, "m2"), content(&src, "m2"));
}

#[test]
fn bad_pieces_and_streams_are_refused_and_change_nothing() {
    let (_a, src) = primary();
    let (_b, dst) = pool();
    ship(&src, &dst, "m1", None, None);
    src.open_volume("v").unwrap().write(MIB, &pattern(5, MIB as usize)).unwrap();
    src.create_snapshot("v", "m2").unwrap();
    let delta = Delta::plan(&src, "m2", Some("m1")).unwrap();
    let begin = || Transfer::begin(&dst, "r", Some("m1"), "m2", delta.size, delta.end(), None, None).unwrap();

    // A corrupt block: refused by its crc, nothing written.
    let mut t = begin();
    let Some(Ok(Piece::Data { offset, mut data, crcs })) = delta.pieces(&src, 0, PIECE).unwrap().next() else {
        panic!("the delta starts with data")
    };
    data[BLOCK + 7] ^= 1;
    let err = t.apply(&Piece::Data { offset, data, crcs }).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains(&format!("byte {}", offset + BLOCK as u64)), "{err}");
    assert_eq!(t.next(), 0);

    // Out of order, off block boundaries, past the end.
    let good: Vec<Piece> = delta.pieces(&src, 0, PIECE).unwrap().map(Result::unwrap).collect();
    t.apply(&good[1]).unwrap();
    for bad in [
        good[0].clone(),
        Piece::Zero { offset: MIB * 3 + 512, len: 4096 },
        Piece::Zero { offset: delta.end(), len: 4096 },
    ] {
        assert_eq!(t.apply(&bad).unwrap_err().kind(), ErrorKind::InvalidArgument, "{bad:?}");
    }

    // A truncated stream: no commit, and the replica still reads as m1.
    let err = t.commit(&dst).unwrap_err();
    assert!(err.to_string().contains("incomplete"), "{err}");
    assert!(dst.snapshot_info("m2").is_err());
    assert_eq!(content(&dst, "m1"), content(&src, "m1"));

    // A delta against a base the replica does not hold; a snapshot it already holds; a first
    // sync into a replica with history.
    let err = Transfer::begin(&dst, "r", Some("m0"), "m2", delta.size, delta.end(), None, None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(err.to_string().contains("resync"), "{err}");
    assert_eq!(
        Transfer::begin(&dst, "r", None, "m1", SIZE, 0, None, None).unwrap_err().kind(),
        ErrorKind::AlreadyExists
    );
    assert_eq!(
        Transfer::begin(&dst, "r", None, "m9", SIZE, 0, None, None).unwrap_err().kind(),
        ErrorKind::AlreadyExists
    );
    assert_eq!(
        Transfer::begin(&dst, "r", Some("m1"), "m2", SIZE, SIZE + 4096, None, None).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );

    // After all that, the real delta still applies exactly.
    ship(&src, &dst, "m2", Some("m1"), None);
    assert_eq!(content(&dst, "m2"), content(&src, "m2"));
}

#[test]
fn a_writable_volume_takes_no_delta() {
    let (_a, src) = primary();
    let (_b, dst) = pool();
    ship(&src, &dst, "m1", None, None);
    src.open_volume("v").unwrap().write(0, &pattern(8, MIB as usize)).unwrap();
    src.create_snapshot("v", "m2").unwrap();
    let delta = Delta::plan(&src, "m2", Some("m1")).unwrap();
    // The replica made writable (promoted, or disabled), then written: no delta may roll it
    // back, grow it or write into it, whatever the caller's records say.
    dst.set_read_only("r", false).unwrap();
    dst.open_volume("r").unwrap().write(MIB, &pattern(9, MIB as usize)).unwrap();
    let head = |p: &Pool| {
        let mut buf = vec![0u8; usize::try_from(SIZE).unwrap()];
        p.open_volume("r").unwrap().read(0, &mut buf).unwrap();
        buf
    };
    let now = head(&dst);
    for resume in [None, Some(0)] {
        let err = Transfer::begin(&dst, "r", Some("m1"), "m2", delta.size, delta.end(), resume, None).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ReadOnly, "{err}");
        assert!(err.to_string().contains("writable"), "{err}");
    }
    let err = Transfer::begin(&dst, "r", None, "m2", SIZE * 2, 0, None, None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly, "{err}");
    assert!(head(&dst) == now, "the writable volume changed");
    assert_eq!(dst.volume_info("r").unwrap().size, SIZE);
}

/// The wrapped keys a push of snapshot `to` carries: its own first, then the older ones.
fn keys_of(src: &Pool, to: &str) -> Vec<Vec<u8>> {
    let image = Image::Snapshot(to);
    std::iter::once(src.wrapped_key(image).unwrap().unwrap()).chain(src.older_wrapped_keys(image).unwrap()).collect()
}

#[test]
fn an_encrypted_source_s_rotation_and_rekey_reach_its_replica_as_ciphertext() {
    let (_a, src) = pool();
    let (_b, dst) = pool();
    let k1 = Kek::new("k1", [1; 32]).unwrap();
    let k2 = Kek::new("k2", [2; 32]).unwrap();
    src.create_encrypted_volume("v", SIZE, &k1).unwrap();
    let v = src.open_volume("v").unwrap();
    v.write(0, &pattern(1, 4 * MIB as usize)).unwrap();
    src.create_snapshot("v", "m1").unwrap();
    ship_keyed(&src, &dst, "m1", None, None, Some(&keys_of(&src, "m1")));

    // A rotation under way when m2 is taken: the delta holds blocks under the old key (written
    // before it) and the new; the replica gets one key's ciphertext, and its head that key.
    v.write(8 * MIB, &pattern(2, MIB as usize)).unwrap();
    src.start_data_key_rotation("v", |id| k1.with_id(id)).unwrap();
    v.write(MIB, &pattern(3, 64 << 10)).unwrap();
    src.create_snapshot("v", "m2").unwrap();
    let keys = keys_of(&src, "m2");
    assert_eq!(keys.len(), 2, "m2 reads with the new key and the old one");
    ship_keyed(&src, &dst, "m2", Some("m1"), None, Some(&keys));
    dst.unlock(Image::Volume("r"), |id| k1.with_id(id)).unwrap();
    assert_eq!(dst.volume_info("r").unwrap().encryption.unwrap().data_keys, 2);
    for s in ["m1", "m2"] {
        assert!(content(&dst, s) == content(&src, s), "the replica's {s} differs");
    }

    // Finished, then the KEK replaced at the source: the next push rewraps both keys there,
    // and the replica then opens with the new KEK alone (its older snapshot included).
    src.run_data_key_rotation("v", |_| {}).unwrap();
    src.rewrap_volume("v", |id| k1.with_id(id), &k2).unwrap();
    v.write(20 * MIB, &pattern(4, MIB as usize)).unwrap();
    src.create_snapshot("v", "m3").unwrap();
    ship_keyed(&src, &dst, "m3", Some("m2"), None, Some(&keys_of(&src, "m3")));
    assert!(content(&dst, "m3") == content(&src, "m3"));
    // Every key is checked, open or not: k2 opens the whole chain, k1 nothing of it.
    assert_eq!(dst.unlock(Image::Volume("r"), |id| k1.with_id(id)).unwrap_err().kind(), ErrorKind::Locked);
    dst.unlock(Image::Volume("r"), |id| k2.with_id(id)).unwrap();

    // A new data key never relabels blocks already written under another one.
    dst.open_volume("r").unwrap().past_read_only().ciphertext().write(0, &[9; BLOCK]).unwrap();
    let other = k2.wrap(&ferrite_crypt::DataKey::generate().unwrap()).unwrap().encode();
    let err = dst.follow_wrapped_keys("r", &other, &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
}
