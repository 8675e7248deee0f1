//! Backups against a real S3 store, in one run (bench/backup.sh starts SeaweedFS and runs this):
//! a volume (default 10 GiB) filled with incompressible data;
//! - a full backup, and a raw parallel PUT loop of chunk-sized objects to the same store (the
//!   ceiling): throughput of each and their ratio;
//! - 1% of its 4 KiB blocks rewritten at random, then an incremental: bytes uploaded against
//!   the bytes of the chunks those writes touch;
//! - a clone backed up after its parent: what it uploads;
//! - an instant restore into a new volume: the first read served, reads during the copy, then
//!   the whole copy's time and throughput;
//!   and the PUT, GET, HEAD and LIST requests of each step.
//!
//!   backup-bench DIR ENDPOINT BUCKET [VOLUME_GIB] [CHUNK_MIB] [CONCURRENCY]

#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)] // sizes and rates

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use ferrite_backup::{CreateOptions, Manifest, Target, TargetConfig, TargetKind};
use ferrite_engine::{Image, Pool, PoolOptions};
use futures_util::StreamExt;
use object_store::ObjectStoreExt;

const MIB: u64 = 1 << 20;

fn noise(seed: u64, buf: &mut [u8]) {
    let mut x = seed * 2 + 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

fn mib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / MIB as f64 / secs
}

/// PUT, GET, HEAD, LIST requests since `before`.
fn requests(t: &Target, before: [u64; 7]) -> String {
    let now = t.counters.snapshot();
    format!(
        "PUT {} GET {} HEAD {} LIST {}",
        now[0] - before[0],
        now[2] - before[2],
        now[4] - before[4],
        now[5] - before[5]
    )
}

async fn backup(t: &Target, pool: &Pool, volume: &str, snapshot: &str, id: &str) -> (Manifest, f64) {
    let opts = CreateOptions { volume: volume.into(), snapshot: snapshot.into(), id: id.into(), full: false };
    let start = Instant::now();
    let m = ferrite_backup::create(t, pool, &opts, &|_| {}).await.expect("backup");
    (m, start.elapsed().as_secs_f64())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: backup-bench DIR ENDPOINT BUCKET [VOLUME_GIB] [CHUNK_MIB] [CONCURRENCY]";
    let dir = std::path::PathBuf::from(args.get(1).expect(usage));
    let endpoint = args.get(2).expect(usage).clone();
    let bucket = args.get(3).expect(usage).clone();
    let gib: u64 = args.get(4).map_or(10, |a| a.parse().expect("VOLUME_GIB"));
    let chunk = args.get(5).map_or(4, |a| a.parse::<u64>().expect("CHUNK_MIB")) * MIB;
    let concurrency: usize = args.get(6).map_or(8, |a| a.parse().expect("CONCURRENCY"));
    let size = gib << 30;

    // A sparse pool file big enough for the volume, its rewrites and a restored copy.
    let path = dir.join("pool.img");
    std::fs::File::create(&path).and_then(|f| f.set_len(2 * size + size / 4 + (1 << 30))).expect("pool file");
    let backend = Arc::new(ferrite_engine::io::UringBackend::open(&path).expect("open pool file"));
    let pool = Pool::create_on(backend, &dir.join("meta"), PoolOptions::default()).expect("create pool");
    pool.create_volume("vol", size).expect("volume");
    let vol = pool.open_volume("vol").expect("open");
    eprintln!("filling a {gib} GiB volume with incompressible data...");
    let mut buf = vec![0u8; (16 * MIB) as usize];
    for (n, off) in (0..size).step_by(buf.len()).enumerate() {
        noise(n as u64 + 1, &mut buf);
        vol.write(off, &buf).expect("fill");
    }
    vol.flush().expect("flush");
    pool.create_snapshot("vol", "s1").expect("snapshot");

    let config = TargetConfig {
        kind: Some(TargetKind::S3),
        endpoint: Some(endpoint.clone()),
        bucket: Some(bucket.clone()),
        prefix: Some("bench".into()),
        chunk_size: Some(chunk),
        concurrency: Some(concurrency),
        ..TargetConfig::default()
    };
    let t = Target::open("bench", config).await.expect("target");

    let before = t.counters.snapshot();
    let (full, secs) = backup(&t, &pool, "vol", "s1", "full").await;
    let full_rate = mib_s(full.read_bytes, secs);
    println!(
        "full backup:      {:.1} GiB in {secs:.1} s = {full_rate:.0} MiB/s, uploaded {:.2} GiB; {}",
        full.read_bytes as f64 / (1u64 << 30) as f64,
        full.uploaded_bytes as f64 / (1u64 << 30) as f64,
        requests(&t, before)
    );

    // The ceiling: the same store, chunk-sized incompressible objects, the same concurrency
    // (at most 2 GiB of them: the disk under the store holds the rest of the run).
    let raw = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&endpoint)
        .with_bucket_name(&bucket)
        .with_region("us-east-1")
        .with_allow_http(true)
        .with_skip_signature(true)
        .build()
        .expect("raw client");
    let objects = (size.min(2 << 30) / chunk) as usize;
    let mut payload = vec![0u8; chunk as usize];
    noise(7, &mut payload);
    let payload = bytes::Bytes::from(payload);
    let start = Instant::now();
    let mut puts = futures_util::stream::iter(0..objects)
        .map(|n| {
            let (raw, data) = (&raw, payload.clone());
            async move { raw.put(&object_store::path::Path::from(format!("raw/{n}")), data.into()).await }
        })
        .buffer_unordered(concurrency);
    while let Some(r) = puts.next().await {
        r.expect("raw PUT");
    }
    drop(puts);
    let raw_rate = mib_s(objects as u64 * chunk, start.elapsed().as_secs_f64());
    println!(
        "raw PUT loop:     {raw_rate:.0} MiB/s ({objects} objects of {} MiB, {concurrency} at a time)",
        chunk / MIB
    );
    println!("full / raw:       {:.2}", full_rate / raw_rate);
    for n in 0..objects {
        let _ = raw.delete(&object_store::path::Path::from(format!("raw/{n}"))).await;
    }

    // 1% of the blocks rewritten at random.
    let writes = size / 4096 / 100;
    let mut touched = BTreeSet::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut block = vec![0u8; 4096];
    for n in 0..writes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let off = (x % (size / 4096)) * 4096;
        noise(1_000_000 + n, &mut block);
        vol.write(off, &block).expect("rewrite");
        touched.insert(off / chunk);
    }
    pool.create_snapshot("vol", "s2").expect("snapshot");
    let before = t.counters.snapshot();
    let (inc, secs) = backup(&t, &pool, "vol", "s2", "incremental").await;
    let touched_bytes = touched.len() as u64 * chunk;
    println!(
        "incremental:      {writes} random 4 KiB writes touch {} of {} chunks; uploaded {:.2} GiB = {:.3} x the touched chunks, in {secs:.1} s; {}",
        touched.len(),
        size / chunk,
        inc.uploaded_bytes as f64 / (1u64 << 30) as f64,
        inc.uploaded_bytes as f64 / touched_bytes as f64,
        requests(&t, before)
    );

    pool.clone_volume(Image::Snapshot("s2"), "clone").expect("clone");
    pool.create_snapshot("clone", "c1").expect("snapshot");
    let before = t.counters.snapshot();
    let (clone, secs) = backup(&t, &pool, "clone", "c1", "first").await;
    println!(
        "clone's backup:   uploaded {} bytes = {:.4}% of its size, in {secs:.1} s; {}",
        clone.uploaded_bytes,
        100.0 * clone.uploaded_bytes as f64 / size as f64,
        requests(&t, before)
    );

    // An instant restore into a new volume on the same pool: the first read served (its chunk
    // fetched on demand), reads while the copy runs, then the whole copy.
    pool.delete_snapshot("s1").expect("drop s1");
    let before = t.counters.snapshot();
    let start = Instant::now();
    let m = Manifest::load(&t, &inc.backup_ref()).await.expect("manifest");
    pool.create_volume("restored", size).expect("volume");
    let writer = pool.open_volume("restored").expect("open").past_read_only();
    let record = dir.join("restore-record");
    // As the daemon keeps it: the whole bitmap now and then, a journal of positions between.
    let save: ferrite_backup::Save = Box::new(move |saved| {
        let (mut f, bytes) = match saved {
            ferrite_backup::Saved::All(done) => (std::fs::File::create(&record)?, done.as_bytes().to_vec()),
            ferrite_backup::Saved::Done(positions) => (
                std::fs::OpenOptions::new().create(true).append(true).open(record.with_extension("done"))?,
                positions.iter().flat_map(|&p| (p as u32).to_le_bytes()).collect(),
            ),
        };
        std::io::Write::write_all(&mut f, &bytes)?;
        f.sync_data()
    });
    let rt = tokio::runtime::Handle::current();
    let chunks = m.chunk_list(&t).await.expect("its segments");
    let f = ferrite_backup::Filling::new(t.clone(), m, chunks, writer, None, save, rt).expect("restore");
    pool.set_fill("restored", Some(f.clone())).expect("fill");
    let target_vol = pool.open_volume("restored").expect("open");
    let read_at = |off: u64| {
        let v = target_vol.clone();
        async move {
            let at = Instant::now();
            tokio::task::spawn_blocking(move || v.read(off, &mut [0u8; 4096]).expect("read")).await.expect("read");
            at.elapsed().as_secs_f64()
        }
    };
    read_at(size / 2 / 4096 * 4096).await;
    let first = start.elapsed().as_secs_f64();
    let copy = {
        let f = Arc::clone(&f);
        tokio::spawn(async move { f.run(&|_| {}).await })
    };
    let mut during = Vec::new();
    for n in 1..=8u64 {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        during.push(read_at((size / 9 * n) / 4096 * 4096).await);
    }
    copy.await.expect("copy").expect("restore");
    pool.set_fill("restored", None).expect("fill");
    let secs = start.elapsed().as_secs_f64();
    during.sort_by(f64::total_cmp);
    println!(
        "instant restore:  first 4 KiB read served {first:.2} s after the restore began; reads during the copy: median {:.0} ms, max {:.0} ms; {} of {} chunks fetched on demand",
        during[during.len() / 2] * 1000.0,
        during[during.len() - 1] * 1000.0,
        f.counts().2,
        f.counts().1,
    );
    println!(
        "full restore:     {:.1} GiB in {secs:.1} s = {:.0} MiB/s; {}",
        inc.chunk_count() as f64 * chunk as f64 / (1u64 << 30) as f64,
        mib_s(inc.chunk_count() * chunk, secs),
        requests(&t, before)
    );
    // Spot-check the restore against the snapshot, 64 places.
    let snap = pool.open_snapshot("s2").expect("s2");
    let (mut a, mut b) = (vec![0u8; 65536], vec![0u8; 65536]);
    for n in 0..64 {
        let off = (size / 64) * n;
        snap.read(off, &mut a).expect("read");
        target_vol.read(off, &mut b).expect("read");
        assert!(a == b, "the restore differs at {off}");
    }
    println!("restore matches the snapshot (64 samples)");
}
