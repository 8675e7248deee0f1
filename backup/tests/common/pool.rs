//! A pool in memory for the backup tests, and backing up and restoring as the daemon does.
#![allow(dead_code, clippy::cast_possible_truncation)]

use std::sync::Arc;

use ferrite_backup::{BackupRef, CreateOptions, Error, Manifest, Target};
use ferrite_engine::io::MemoryBackend;
use ferrite_engine::{Pool, PoolOptions};

pub const MIB: u64 = 1 << 20;
pub const SIZE: u64 = 48 * MIB;

pub fn new_pool() -> (tempfile::TempDir, Pool) {
    let opts =
        PoolOptions { segment_size: MIB, reserve_segments: 2, background_cleaner: false, ..PoolOptions::default() };
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(MemoryBackend::new(ferrite_engine::format::DATA_START + 256 * MIB));
    let pool = Pool::create_on(backend, &dir.path().join("meta"), opts).unwrap();
    (dir, pool)
}

/// Incompressible bytes; a different odd seed gives different bytes.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed * 2 + 1;
    (0..len / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

pub fn image(pool: &Pool, snapshot: &str) -> Vec<u8> {
    let v = pool.open_snapshot(snapshot).unwrap();
    let mut buf = vec![0u8; v.size().unwrap() as usize];
    v.read(0, &mut buf).unwrap();
    buf
}

pub fn volume_image(pool: &Pool, volume: &str) -> Vec<u8> {
    let v = pool.open_volume(volume).unwrap();
    let mut buf = vec![0u8; v.size().unwrap() as usize];
    v.read(0, &mut buf).unwrap();
    buf
}

pub async fn backup(target: &Target, pool: &Pool, volume: &str, snapshot: &str, id: &str) -> Result<Manifest, Error> {
    let opts = CreateOptions { volume: volume.into(), snapshot: snapshot.into(), id: id.into(), full: false };
    let last = std::sync::Mutex::new(None);
    let m = ferrite_backup::create(target, pool, &opts, &|p| *last.lock().unwrap() = Some(*p)).await?;
    let p = last.lock().unwrap().unwrap();
    assert_eq!((p.chunks_done, p.bytes_done), (p.chunks_total, p.bytes_total), "progress reaches its total");
    Ok(m)
}

/// Restores backup `b` into a new volume `name` as the daemon does (an instant restore, its
/// record kept nowhere), to the end of its copy.
pub async fn restore(target: &Target, pool: &Pool, b: &BackupRef, name: &str) -> Result<(), Error> {
    let m = Manifest::load(target, b).await?;
    let chunks = m.chunk_list(target).await?;
    pool.create_volume(name, m.size).unwrap();
    let writer = pool.open_volume(name).unwrap().past_read_only();
    let rt = tokio::runtime::Handle::current();
    let f = ferrite_backup::Filling::new(target.clone(), m, chunks, writer, None, Box::new(|_| Ok(())), rt)?;
    pool.set_fill(name, Some(f.clone())).unwrap();
    let copied = f.run(&|_| {}).await;
    pool.set_fill(name, None).unwrap();
    copied
}

/// A prune's sweep when nothing else writes to the target: unreferenced chunks go at once.
pub fn no_writers() -> ferrite_backup::Sweep {
    ferrite_backup::Sweep { grace: Some(std::time::Duration::ZERO), no_writers: true }
}
