//! Data-key rotation: every block re-encrypted under a new key, online (client writes during it
//! are kept), crash-safe at any point (every block still reads, under the old key or the new),
//! resumable, and the old key gone once nothing uses it.

#![allow(clippy::cast_possible_truncation)] // the shared test patterns

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::{Fixture, pattern};
use ferrite_crypt::{Error as KeyError, Kek};
use ferrite_engine::io::CrashMode;
use ferrite_engine::{ErrorKind, Image, Pool};

const B: usize = 4096;
const SIZE: usize = 2 << 20;

fn kek(id: &str) -> Result<Kek, KeyError> {
    Kek::new(id, [0x42; 32])
}

fn content(pool: &Pool, name: &str) -> Vec<u8> {
    let mut buf = vec![0; SIZE];
    pool.open_volume(name).unwrap().read(0, &mut buf).unwrap();
    buf
}

/// A volume of `SIZE` bytes under key "k": two patterns, a hole, a snapshot in between.
fn setup(pool: &Pool) -> Vec<u8> {
    pool.create_encrypted_volume("v", SIZE as u64, &kek("k").unwrap()).unwrap();
    let v = pool.open_volume("v").unwrap();
    let mut want = pattern(1, SIZE);
    v.write(0, &want).unwrap();
    pool.create_snapshot("v", "s").unwrap();
    let second = pattern(2, SIZE / 2);
    v.write(B as u64 * 3, &second).unwrap();
    want[B * 3..B * 3 + SIZE / 2].copy_from_slice(&second);
    v.trim(SIZE as u64 - 8 * B as u64, 4 * B as u64).unwrap();
    want[SIZE - 8 * B..SIZE - 4 * B].fill(0);
    v.flush().unwrap();
    want
}

#[test]
fn a_rotation_reencrypts_every_block_while_clients_write() {
    let (f, pool) = Fixture::new(64);
    let mut want = setup(&pool);
    let e =
        pool.start_data_key_rotation("v", |id| Err(KeyError::Unavailable { key_id: id.into(), why: "none".into() }));
    assert_eq!(e.unwrap_err().kind(), ErrorKind::Locked, "started without the key");
    pool.start_data_key_rotation("v", kek).unwrap();
    assert_eq!(pool.volume_info("v").unwrap().encryption.unwrap().data_keys, 2);
    // A client writes while the blocks are copied: its writes win, whatever the order.
    let stop = AtomicBool::new(false);
    let writes: Vec<(usize, Vec<u8>)> = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let v = pool.open_volume("v").unwrap();
            let mut done = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) || i < 20 {
                let at = usize::try_from(i * 37 % (SIZE / B) as u64).unwrap() * B;
                let data = pattern(100 + i, B);
                v.write(at as u64, &data).unwrap();
                done.push((at, data));
                i += 1;
            }
            done
        });
        let mut last = None;
        pool.run_data_key_rotation("v", |p| last = Some(p)).unwrap();
        stop.store(true, Ordering::SeqCst);
        let last = last.unwrap();
        assert_eq!((last.done, last.total), (SIZE as u64, SIZE as u64));
        assert!(last.copied > 0 && last.copied <= SIZE as u64, "{last:?}");
        writer.join().unwrap()
    });
    for (at, data) in writes {
        want[at..at + B].copy_from_slice(&data);
    }
    assert_eq!(content(&pool, "v"), want);
    // The snapshot keeps its layer and the old key; the volume's old head is gone.
    let info = pool.volume_info("v").unwrap();
    assert_eq!((info.encryption.unwrap().data_keys, info.chain_depth), (2, 2));
    let mut snap = vec![0; SIZE];
    pool.open_snapshot("s").unwrap().read(0, &mut snap).unwrap();
    assert_eq!(snap, pattern(1, SIZE));
    // A second run finds nothing to copy.
    let mut again = None;
    pool.run_data_key_rotation("v", |p| again = Some(p)).unwrap();
    assert_eq!(again.unwrap().copied, 0);
    pool.delete_snapshot("s").unwrap();
    assert_eq!(pool.volume_info("v").unwrap().encryption.unwrap().data_keys, 1);
    pool.close().unwrap();
    let pool = f.reopen();
    pool.unlock(Image::Volume("v"), kek).unwrap();
    assert_eq!(content(&pool, "v"), want);
}

#[test]
fn a_crash_at_any_point_of_a_rotation_loses_nothing_and_it_resumes() {
    for crash_after in [0, 1, 2, 4, 8, 16, 40] {
        let (f, pool) = Fixture::new(64);
        let want = setup(&pool);
        f.backend.crash_after_writes(crash_after);
        let started = pool.start_data_key_rotation("v", kek);
        let ran = started.and_then(|()| pool.run_data_key_rotation("v", |_| {}));
        f.backend.crash();
        drop(pool);
        f.backend.restart(CrashMode::Random(crash_after));
        let pool = f.reopen();
        pool.unlock(Image::Volume("v"), kek).unwrap();
        assert_eq!(content(&pool, "v"), want, "after a crash {crash_after} writes in ({ran:?})");
        // Resume (or start again if the start itself was lost), then all is under one key.
        if pool.volume_info("v").unwrap().encryption.unwrap().data_keys == 1 {
            pool.start_data_key_rotation("v", kek).unwrap();
        }
        pool.run_data_key_rotation("v", |_| {}).unwrap();
        pool.delete_snapshot("s").unwrap();
        assert_eq!(pool.volume_info("v").unwrap().encryption.unwrap().data_keys, 1);
        assert_eq!(content(&pool, "v"), want);
        pool.close().unwrap();
        let pool = f.reopen();
        pool.unlock(Image::Volume("v"), kek).unwrap();
        assert_eq!(content(&pool, "v"), want, "after resuming from a crash {crash_after} writes in");
    }
}
