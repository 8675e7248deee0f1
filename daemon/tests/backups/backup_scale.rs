//! A target at scale: a million chunks, 100 volumes of 30 backups each (3000 manifests of 10 000
//! chunks), made on a directory target as a daemon would have written it. Listing it, a sampled
//! verify and a prune run through the daemon, and its peak resident memory during each stays
//! within a figure that does not grow with the target's size, or, for a prune, grows by ~20-30
//! bytes per chunk its backups reference (docs/operations.md, "Memory").

use crate::common;

use std::io::Write;
use std::time::Instant;

use common::Daemon;
use common::nbd::{reset_peak, rss_kib};

const VOLUMES: usize = 100;
const BACKUPS: usize = 30;
const CHUNKS: usize = 10_000;
const MIB: u64 = 1 << 20;

/// An object as an unsealed target stores it: the envelope's header, then the plaintext.
fn envelope(kind: u8, body: &[u8]) -> Vec<u8> {
    [&b"FRBK\x01"[..], &[kind, 0], body].concat()
}

/// Writes volume `v`: its chunks (8 bytes each: their number), 30 manifests listing all of them,
/// and its index.
fn write_volume(root: &std::path::Path, target: &ferrite_backup::Target, v: usize) {
    let mut list = String::with_capacity(CHUNKS * 90);
    for i in 0..CHUNKS {
        let plain = ((v * CHUNKS + i) as u64).to_le_bytes();
        let id = target.chunk_name(&plain);
        let dir = root.join("chunks").join(&id[..2]);
        std::fs::write(dir.join(&id), envelope(1, &plain)).unwrap();
        let sep = if i == 0 { "" } else { "," };
        list += &format!(r#"{sep}{{"i":{i},"id":"{id}","len":8}}"#);
    }
    let volume = format!("v{v:03}");
    let backups = root.join("volumes").join(&volume).join("backups");
    std::fs::create_dir_all(&backups).unwrap();
    let size = CHUNKS as u64 * MIB;
    let mut entries = Vec::new();
    for b in 0..BACKUPS {
        let id = format!("b{b:02}");
        let head = format!(
            r#"{{"format":1,"volume":"{volume}","id":"{id}","snapshot":"s{b}","source":null,"created":{},"size":{size},"chunk_size":{MIB},"previous":null,"full":true,"encrypted_volume":false,"read_bytes":0,"uploaded_bytes":0,"new_chunks":0,"chunks":["#,
            1_790_000_000 + b * 86_400
        );
        let mut f = std::fs::File::create(backups.join(&id)).unwrap();
        f.write_all(&envelope(2, head.as_bytes())).unwrap();
        f.write_all(list.as_bytes()).unwrap();
        f.write_all(b"]}").unwrap();
        entries.push(serde_json::json!({"id": id, "snapshot": format!("s{b}"), "created": 1_790_000_000 + b * 86_400,
            "size": size, "full": true, "previous": null, "chunks": CHUNKS, "bytes": CHUNKS * 8, "uploaded_bytes": 0}));
    }
    let index = serde_json::json!({"format": 1, "volume": volume, "backups": entries}).to_string();
    std::fs::write(root.join("volumes").join(&volume).join("index"), envelope(3, index.as_bytes())).unwrap();
}

#[test]
fn a_million_chunks_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("big");
    let config = ferrite_backup::TargetConfig {
        kind: Some(ferrite_backup::TargetKind::Dir),
        path: Some(root.clone()),
        chunk_size: Some(MIB),
        ..ferrite_backup::TargetConfig::default()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let target = rt.block_on(ferrite_backup::Target::open("big", config)).unwrap();
    let start = Instant::now();
    for b in 0..=255u8 {
        std::fs::create_dir_all(root.join("chunks").join(format!("{b:02x}"))).unwrap();
    }
    std::thread::scope(|s| {
        for half in 0..2 {
            let (root, target) = (&root, &target);
            s.spawn(move || (half..VOLUMES).step_by(2).for_each(|v| write_volume(root, target, v)));
        }
    });
    println!("made {} chunks and {} manifests in {:?}", VOLUMES * CHUNKS, VOLUMES * BACKUPS, start.elapsed());

    let toml = format!(
        "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\n\
         [backup-targets.big]\nkind = \"dir\"\npath = {:?}\nchunk-size = \"1M\"\n",
        root.display().to_string()
    );
    std::fs::write(dir.path().join("ferrite.toml"), toml).unwrap();
    let d = Daemon::start(dir.path());
    let pid = d.child.as_ref().unwrap().id();
    // The target opened, one index read: the baseline.
    assert_eq!(d.json(&["backup", "list", "v000", "--target", "big"]).as_array().unwrap().len(), BACKUPS);
    let baseline = rss_kib(pid).1;

    let peak = |what: &str, args: &[&str]| {
        reset_peak(pid);
        let start = Instant::now();
        let out = d.json(args);
        let grown = rss_kib(pid).0.saturating_sub(baseline) >> 10;
        println!("{what}: {:?}, the daemon's peak +{grown} MiB over its baseline", start.elapsed());
        (out, grown)
    };
    let (listed, list_peak) = peak("list", &["backup", "list", "--target", "big"]);
    assert_eq!(listed.as_array().unwrap().len(), VOLUMES * BACKUPS);
    let (verified, verify_peak) = peak("verify 1%", &["backup", "verify", "--target", "big", "--sample", "0.01"]);
    let checked = verified["chunks_checked"].as_u64().unwrap();
    assert!((7_000..=16_000).contains(&checked), "a 1% sample of a million chunks: {verified}");
    assert_eq!(verified["bad"], serde_json::json!([]));
    let (pruned, prune_peak) = peak("prune", &["backup", "prune", "--target", "big"]);
    assert_eq!(pruned["manifests"], VOLUMES * BACKUPS);
    assert_eq!(pruned["chunks_referenced"], VOLUMES * CHUNKS);
    assert_eq!((pruned["chunks_deleted"].as_u64(), pruned["chunks_condemned"].as_u64()), (Some(0), Some(0)));
    // The figures docs/operations.md gives ("Memory"): listing and verifying hold one manifest
    // and the sample; a prune ~20-30 bytes per referenced chunk besides (a million: 28 MiB at
    // most), and glibc's per-thread arenas keep what the manifests' readers freed (measured
    // +77 MiB in all, +41 MiB with MALLOC_ARENA_MAX=2).
    assert!(list_peak < 32 && verify_peak < 32, "list +{list_peak} MiB, verify +{verify_peak} MiB");
    assert!(prune_peak < 128, "prune +{prune_peak} MiB");
}
