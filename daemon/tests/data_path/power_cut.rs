//! A power cut on a real device, replayed at every flush point: the pool and its catalog sit on
//! the kernel's dm-log-writes target (`common::log_writes`), which records every write the
//! daemon's I/O really sends the block layer (io_uring, O_DIRECT, fdatasync, FUA; RocksDB on
//! ext4 through its journal) in the order a device with a write cache must be assumed to keep
//! them. A workload goes through the daemon over NBD — mixed sizes, overwrites, trims, FUA
//! writes, flushes, a snapshot and a clone, a cleaner pass, a clean restart (a checkpoint), an
//! encrypted volume and a data-key rotation — and records what was acknowledged and which
//! flushes completed, each completion a mark in the log. Then, for flush points of the log (a
//! sample; every one with FERRITE_LONG=1), the device is rebuilt up to that point, and again
//! with a random subset of the writes since the previous flush point (a device may keep any of
//! them), and opened by a fresh daemon: the pool must open, scrub clean, and every block of
//! every volume read back a value that was written there, never older than the last one a
//! completed flush or FUA covered; a snapshot or clone whose command returned must exist with
//! its content.
//!
//! Two layouts: the pool on the raw device and the catalog on ext4 beside it (one dm-log-writes
//! device split by dm-linear, so one log orders both), and the pool as a file on that ext4.
//! FERRITE_POWER_CUT_LAYOUTS=raw or =file runs one of them (the VM tier gives each kernel one).
//!
//! Needs root, dm-log-writes and dmsetup: the VM tier runs it in the QEMU guest
//! (tests/vm/power_cut.sh); on hosts without them it is `#[ignore]`d.

use crate::common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::Daemon;
use common::log_writes::{self, Log};
use ferrite_nbd::proto::*;
use ferrite_proto::ferrite::v1::{self as pb, admin_client::AdminClient};

const BLOCK: usize = 4096;
const MIB: u64 = 1 << 20;
const POOL: u64 = 160 * MIB;
const META: u64 = 96 * MIB;
const ROOT: &str = "/tmp/power-cut";

fn sh(cmd: &str) -> String {
    let o = Command::new("bash").args(["-c", cmd]).output().unwrap();
    assert!(o.status.success(), "{cmd}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

/// A device-mapper device `name` with `table`, its node made by hand (no udev in the guest).
fn dm_create(name: &str, table: &str) {
    sh(&format!("dmsetup create {name} --table '{table}' && dmsetup mknodes {name}"));
}

/// A written block's bytes: a stamp (magic, image, block, the write's sequence number) and a
/// fill derived from it, so a torn or misplaced block shows.
fn block_bytes(image: u32, block: u64, seq: u64) -> Vec<u8> {
    let mut b = common::pattern(seq << 20 | block, BLOCK);
    b[..8].copy_from_slice(b"FERRPCUT");
    b[8..12].copy_from_slice(&image.to_le_bytes());
    b[12..20].copy_from_slice(&block.to_le_bytes());
    b[20..28].copy_from_slice(&seq.to_le_bytes());
    b
}

/// What a read block holds: Ok(0) zeros, Ok(seq) a whole write of `block`, Err(why) anything else.
fn read_value(b: &[u8], block: u64) -> Result<u64, String> {
    if b.iter().all(|x| *x == 0) {
        return Ok(0);
    }
    if &b[..8] != b"FERRPCUT" {
        return Err("neither zeros nor a block the workload wrote".into());
    }
    let image = u32::from_le_bytes(b[8..12].try_into().unwrap());
    let at = u64::from_le_bytes(b[12..20].try_into().unwrap());
    let seq = u64::from_le_bytes(b[20..28].try_into().unwrap());
    if at != block {
        return Err(format!("the block written at {at}"));
    }
    if b != block_bytes(image, block, seq) {
        return Err(format!("write {seq}'s stamp with other bytes (torn or damaged)"));
    }
    Ok(seq)
}

/// A volume, snapshot or clone of the workload and every change to each of its blocks:
/// (sequence number, value: the write's sequence number, 0 for zeros).
struct Image {
    name: String,
    id: u32,
    blocks: Vec<Vec<(u64, u64)>>,
    /// The mark after the command that made it returned (None: made before the log's checks).
    made: Option<String>,
}

/// What a mark in the log says had completed when it was logged.
#[derive(Clone)]
enum Covers {
    /// A flush of image `.0` acknowledged: every change with a sequence number up to `.1`.
    Flush(usize, u64),
    /// One change (a FUA write, a clone's or snapshot's content) of image `.0`: sequence `.1`.
    One(usize, u64),
    /// A step of the workload (a reclaim, a restart, a rotation), for the report.
    Step,
}

struct Workload {
    images: Vec<Image>,
    marks: BTreeMap<String, Covers>,
    seq: u64,
    device: String,
    rng: u64,
    writes: u64,
}

impl Workload {
    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn mark(&mut self, covers: Covers) -> String {
        let name = format!("m{}", self.marks.len());
        sh(&format!("dmsetup message {} 0 mark {name}", self.device));
        self.marks.insert(name.clone(), covers);
        name
    }

    fn image(&mut self, name: &str, blocks: usize, made: Option<String>) -> usize {
        let id = u32::try_from(self.images.len()).unwrap() + 1;
        self.images.push(Image { name: name.into(), id, blocks: vec![Vec::new(); blocks], made });
        self.images.len() - 1
    }

    fn request(&mut self, s: &mut UnixStream, kind: u16, flags: u16, at: u64, len: u64, payload: &[u8]) {
        let len32 = u32::try_from(len).unwrap();
        s.write_all(&common::nbd::request(kind, flags, 9, at, len32, payload)).unwrap();
        let (error, _) = common::nbd::reply(s, 0);
        assert_eq!(error, 0, "NBD command {kind} at {at}+{len} failed");
    }

    /// Writes `n` blocks of image `i` from `block` (FUA if asked); returns the sequence number.
    fn write(&mut self, s: &mut UnixStream, i: usize, block: u64, n: u64, fua: bool) -> u64 {
        self.seq += 1;
        let seq = self.seq;
        let id = self.images[i].id;
        let data: Vec<u8> = (block..block + n).flat_map(|b| block_bytes(id, b, seq)).collect();
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        self.request(s, CMD_WRITE, flags, block * BLOCK as u64, n * BLOCK as u64, &data);
        for b in block..block + n {
            self.images[i].blocks[usize::try_from(b).unwrap()].push((seq, seq));
        }
        self.writes += 1;
        seq
    }

    fn trim(&mut self, s: &mut UnixStream, i: usize, block: u64, n: u64) {
        self.seq += 1;
        self.request(s, CMD_TRIM, 0, block * BLOCK as u64, n * BLOCK as u64, &[]);
        for b in block..block + n {
            self.images[i].blocks[usize::try_from(b).unwrap()].push((self.seq, 0));
        }
    }

    fn flush(&mut self, s: &mut UnixStream, i: usize) {
        self.request(s, CMD_FLUSH, 0, 0, 0, &[]);
        let upto = self.seq;
        self.mark(Covers::Flush(i, upto));
    }

    /// A round of random I/O on image `i`: writes of 1–64 blocks (some FUA), overwrites, trims,
    /// a flush every few.
    fn round(&mut self, s: &mut UnixStream, i: usize, ops: usize) {
        let blocks = self.images[i].blocks.len() as u64;
        for k in 0..ops {
            let r = self.next();
            let n = [1, 1, 2, 4, 8, 16, 64][usize::try_from(r % 7).unwrap()];
            let at = (r >> 8) % (blocks - n);
            match (r >> 40) % 16 {
                0 => self.trim(s, i, at, n),
                1 => {
                    let seq = self.write(s, i, at, n, true);
                    self.mark(Covers::One(i, seq));
                }
                _ => drop(self.write(s, i, at, n, false)),
            }
            if k % 6 == 5 {
                self.flush(s, i);
            }
        }
        self.flush(s, i);
    }

    /// Image `from`'s content now (every acknowledged change), as image `to`'s first content,
    /// covered by mark `made`.
    fn copy_content(&mut self, from: usize, to: usize) {
        self.seq += 1;
        let seq = self.seq;
        for b in 0..self.images[from].blocks.len() {
            let v = self.images[from].blocks[b].last().map_or(0, |e| e.1);
            self.images[to].blocks[b].push((seq, v));
        }
        let made = self.mark(Covers::One(to, seq));
        self.images[to].made = Some(made);
    }
}

/// Where the pool is: on the raw device beside the catalog's ext4, or a file on that ext4.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    RawPool,
    FileOnExt4,
}

/// The devices under test: data and log files on loop devices, dm-log-writes over them, and
/// (raw layout) dm-linear splitting it into the pool and the ext4 holding the catalog.
struct Rig {
    layout: Layout,
    dir: PathBuf,
    loops: Vec<String>,
}

impl Rig {
    fn new(layout: Layout) -> Self {
        let dir = PathBuf::from(format!("{ROOT}/{layout:?}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("meta")).unwrap();
        let d = dir.display();
        sh(&format!("truncate -s {} {d}/data.img && truncate -s 4G {d}/log.img", POOL + META));
        let data = sh(&format!("losetup -f --show {d}/data.img"));
        let log = sh(&format!("losetup -f --show {d}/log.img"));
        let sectors = (POOL + META) / 512;
        dm_create("pcut-lw", &format!("0 {sectors} log-writes {data} {log}"));
        let fs = match layout {
            Layout::RawPool => {
                let (p, m) = (POOL / 512, META / 512);
                dm_create("pcut-pool", &format!("0 {p} linear /dev/mapper/pcut-lw 0"));
                dm_create("pcut-meta", &format!("0 {m} linear /dev/mapper/pcut-lw {p}"));
                "/dev/mapper/pcut-meta"
            }
            Layout::FileOnExt4 => "/dev/mapper/pcut-lw",
        };
        sh(&format!("mkfs.ext4 -q -F {fs} && mount {fs} {d}/meta"));
        Self { layout, dir, loops: vec![data, log] }
    }

    /// The daemon's data directory (on the ext4) and its configuration, naming `pool`.
    fn configure(data_dir: &Path, pool: Option<&str>) {
        std::fs::create_dir_all(data_dir).unwrap();
        let pool = match pool {
            Some(p) => format!("pool-path = \"{p}\"\n"),
            None => format!("pool-size = \"{}M\"\n", POOL / MIB),
        };
        let cfg = format!("{pool}segment-size = \"4M\"\nlog-level = \"info\"\nidle-cleaning-s = 0\n");
        std::fs::write(data_dir.join("ferrite.toml"), cfg).unwrap();
    }

    fn pool_device(&self) -> Option<&'static str> {
        (self.layout == Layout::RawPool).then_some("/dev/mapper/pcut-pool")
    }

    /// Ends logging: the ext4 unmounted, the dm devices removed (the target writes its last
    /// entries and super block), the loop devices detached. Returns the log's path.
    fn finish(&mut self) -> PathBuf {
        let d = self.dir.display();
        sh(&format!("umount {d}/meta"));
        for dev in ["pcut-pool", "pcut-meta", "pcut-lw"] {
            if Path::new(&format!("/dev/mapper/{dev}")).exists() {
                sh(&format!("dmsetup remove {dev}"));
            }
        }
        for l in self.loops.drain(..) {
            sh(&format!("losetup -d {l}"));
        }
        self.dir.join("log.img")
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let d = self.dir.display();
        let _ = Command::new("bash")
            .args(["-c", &format!("umount -l {d}/meta {d}/check 2>/dev/null; dmsetup remove_all; losetup -D")])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The workload through a daemon on the rig's devices; the journal of what it did.
fn run_workload(rig: &Rig) -> Workload {
    let dir = rig.dir.join("meta/d");
    Rig::configure(&dir, rig.pool_device());
    let fmt = Command::new(common::BIN)
        .args(["pool", "format", "--config"])
        .arg(dir.join("ferrite.toml"))
        .arg("--data-dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(fmt.status.success(), "pool format: {}", String::from_utf8_lossy(&fmt.stderr));
    let mut d = Daemon::start(&dir);
    let mut w = Workload {
        images: Vec::new(),
        marks: BTreeMap::new(),
        seq: 0,
        device: "pcut-lw".into(),
        rng: 0x5eed_f00d ^ u64::from(rig.layout == Layout::RawPool),
        writes: 0,
    };
    d.ok(&["volume", "create", "plain", "24M"]);
    d.ok(&["volume", "create", "sealed", "16M", "--encrypt"]);
    let made = w.mark(Covers::Step);
    let plain = w.image("plain", 24 * 256, Some(made.clone()));
    let sealed = w.image("sealed", 16 * 256, Some(made));
    let mut p = common::nbd::open(&d, "plain");
    let mut s = common::nbd::open(&d, "sealed");
    w.round(&mut p, plain, 60);
    w.round(&mut s, sealed, 30);

    // A snapshot (durable on return) and a clone of it, written to.
    d.ok(&["snapshot", "create", "plain", "s1"]);
    let snap = w.image("plain@s1", 24 * 256, None);
    w.copy_content(plain, snap);
    d.ok(&["clone", "plain@s1", "copy"]);
    let copy = w.image("copy", 24 * 256, None);
    w.copy_content(snap, copy);
    let mut c = common::nbd::open(&d, "copy");
    w.round(&mut c, copy, 30);
    w.round(&mut p, plain, 60);

    // The cleaner moves what the overwrites left live.
    d.ok(&["pool", "reclaim"]);
    w.mark(Covers::Step);
    w.round(&mut p, plain, 30);

    // A clean restart: the daemon drains, flushes and checkpoints.
    drop((p, s, c));
    for v in ["plain", "sealed", "copy"] {
        d.ok(&["export", "stop", v]);
    }
    d.stop();
    w.mark(Covers::Step);
    let d2 = Daemon::start(&dir);
    let mut s = common::nbd::open(&d2, "sealed");
    w.round(&mut s, sealed, 20);
    // A new data key: every block of the encrypted volume re-encrypted, online.
    d2.ok(&["volume", "rekey", "sealed", "--data-key"]);
    w.mark(Covers::Step);
    w.round(&mut s, sealed, 20);
    let mut p = common::nbd::open(&d2, "plain");
    w.round(&mut p, plain, 40);
    // The power goes: nothing after the last acknowledged request is owed.
    let mut d2 = d2;
    d2.crash();
    drop((p, s));
    w
}

/// Which changes of each image the marks logged before entry `end` cover: the flush's bound and
/// the single changes.
fn coverage(w: &Workload, log: &Log, end: usize) -> (Vec<u64>, Vec<Vec<u64>>, Vec<bool>) {
    let mut upto = vec![0; w.images.len()];
    let mut ones = vec![Vec::new(); w.images.len()];
    for e in &log.entries[..end] {
        match e.mark.as_deref().and_then(|m| w.marks.get(m)) {
            Some(Covers::Flush(i, s)) => upto[*i] = upto[*i].max(*s),
            Some(Covers::One(i, s)) => ones[*i].push(*s),
            _ => {}
        }
    }
    let made = w
        .images
        .iter()
        .map(|im| im.made.as_deref().is_some_and(|m| log.entries[..end].iter().any(|e| e.mark.as_deref() == Some(m))))
        .collect();
    (upto, ones, made)
}

/// What `check` saw at one point: blocks compared, and where its time went (mounting the
/// catalog's ext4, starting the daemon, scrubbing, reading the images back).
struct Checked {
    blocks: u64,
    phases: [Duration; 4],
}

/// Opens `image` (the data device as it was at entry `end`, modified) with a fresh daemon and
/// checks it against the workload.
fn check(rig: &Rig, w: &Workload, log: &Log, end: usize, what: &str) -> Checked {
    let image = View::DEVICE;
    let (upto, ones, made) = coverage(w, log, end);
    let d = rig.dir.join("check");
    std::fs::create_dir_all(&d).unwrap();
    let (pool_loop, fs_loop) = match rig.layout {
        Layout::RawPool => {
            let p = sh(&format!("losetup -f --show --sizelimit {POOL} {image}"));
            (Some(p), sh(&format!("losetup -f --show --offset {POOL} {image}")))
        }
        Layout::FileOnExt4 => (None, sh(&format!("losetup -f --show {image}"))),
    };
    let mut clock = Instant::now();
    let mut lap = || std::mem::replace(&mut clock, Instant::now()).elapsed();
    // Mounting replays the ext4 journal, as a boot after the power cut would.
    let mount = Command::new("mount").arg(&fs_loop).arg(&d).output().unwrap();
    if !mount.status.success() {
        let fsck = Command::new("e2fsck").args(["-fn", &fs_loop]).output().unwrap();
        panic!(
            "{what}: the catalog's ext4 does not mount: {}\n{}\n{}",
            String::from_utf8_lossy(&mount.stderr),
            sh("dmesg | tail -5"),
            String::from_utf8_lossy(&fsck.stdout)
        );
    }
    let data_dir = d.join("d");
    if !data_dir.join("meta").exists() {
        println!("{what}: no catalog; the file system holds:\n{}", sh(&format!("find {} | head -40", d.display())));
    }
    Rig::configure(&data_dir, pool_loop.as_deref());
    let mounted = lap();
    let mut daemon = Daemon::start(&data_dir);
    let started = lap();
    let mut admin = Admin::new(&daemon);
    let scrub = admin.scrub();
    assert!(scrub.done && scrub.damaged_blocks == 0, "{what}: scrub after recovery: {scrub:?}");
    let scrubbed = lap();
    let mut blocks = 0;
    let listed = admin.images();
    for (i, im) in w.images.iter().enumerate() {
        let exists = listed.contains(&im.name);
        assert!(exists || !made[i], "{what}: {} is gone although the command that made it returned", im.name);
        if !exists {
            continue;
        }
        // Left exported: the daemon is killed after.
        admin.export(&im.name);
        let len = (im.blocks.len() * BLOCK) as u64;
        let bytes = common::nbd::read_all(&mut common::nbd::connect(&daemon.nbd(), &im.name), &im.name, len);
        for (b, events) in im.blocks.iter().enumerate() {
            let at = b as u64;
            let got = read_value(&bytes[b * BLOCK..(b + 1) * BLOCK], at)
                .unwrap_or_else(|e| panic!("{what}: {} block {b}: {e}", im.name));
            // The newest change a completed flush or FUA covered, and what came after it.
            let covered = events.iter().rposition(|(s, _)| *s <= upto[i] || ones[i].contains(s));
            let oldest_allowed = covered.unwrap_or(0);
            let mut allowed = events[oldest_allowed..].iter().map(|e| e.1);
            let ok = allowed.any(|v| v == got) || (covered.is_none() && got == 0);
            assert!(
                ok,
                "{what}: {} block {b} reads write {got}, but its changes are {events:?} and the log covers up to {}",
                im.name, upto[i]
            );
            blocks += 1;
        }
    }
    let read = lap();
    daemon.crash();
    sh(&format!("umount {}", d.display()));
    for l in pool_loop.iter().chain([&fs_loop]) {
        sh(&format!("losetup -d {l}"));
    }
    Checked { blocks, phases: [mounted, started, scrubbed, read] }
}

/// A fresh daemon's admin service called from here: under TCG each `ferrite` command costs
/// ~0.4 s, which was most of a replay's check.
struct Admin {
    rt: tokio::runtime::Runtime,
    client: AdminClient<tonic::transport::Channel>,
}

impl Admin {
    fn new(d: &Daemon) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let client = AdminClient::new(rt.block_on(ferrite_proto::connect_unix(&d.admin())).unwrap());
        Self { rt, client }
    }

    /// The scrub's last report.
    fn scrub(&mut self) -> pb::ScrubPoolProgress {
        self.rt.block_on(async {
            let mut stream = self.client.scrub_pool(pb::ScrubPoolRequest {}).await.unwrap().into_inner();
            let mut last = pb::ScrubPoolProgress::default();
            while let Some(p) = stream.message().await.unwrap() {
                last = p;
            }
            last
        })
    }

    /// Every volume and snapshot (`volume@snapshot`).
    fn images(&mut self) -> Vec<String> {
        self.rt.block_on(async {
            let volumes = self.client.list_volumes(pb::ListVolumesRequest {}).await.unwrap().into_inner().volumes;
            let snaps = self.client.list_snapshots(pb::ListSnapshotsRequest::default()).await.unwrap().into_inner();
            let snaps = snaps.snapshots.into_iter().map(|s| format!("{}@{}", s.volume, s.name));
            volumes.into_iter().map(|v| v.name).chain(snaps).collect()
        })
    }

    fn export(&mut self, image: &str) {
        let req = pb::StartExportRequest { volume: image.into(), ..Default::default() };
        self.rt.block_on(self.client.start_export(req)).unwrap_or_else(|e| panic!("exporting {image}: {e}"));
    }
}

/// The replays checked so far, and where their time went: rebuilding the device, then `check`'s phases.
#[derive(Default)]
struct Totals {
    replays: u32,
    blocks: u64,
    imaging: Duration,
    phases: [Duration; 4],
}

impl Totals {
    fn add(&mut self, c: Checked) {
        self.replays += 1;
        self.blocks += c.blocks;
        self.phases.iter_mut().zip(c.phases).for_each(|(t, p)| *t += p);
    }
}

/// The device at one point, writable for the daemon that recovers it, its changes kept apart
/// (dm-snapshot, the exception store a sparse file in memory): the image the log rebuilds is
/// never changed by a check, and never copied.
struct View {
    loops: [String; 2],
    cow: PathBuf,
}

impl View {
    const DEVICE: &str = "/dev/mapper/pcut-view";

    fn new(dir: &Path, image: &Path) -> Self {
        let cow = dir.join("cow.img");
        // As large as the device: the store cannot fill up, whatever recovery writes.
        File::create(&cow).unwrap().set_len(POOL + META).unwrap();
        let origin = sh(&format!("losetup -f --show {}", image.display()));
        let store = sh(&format!("losetup -f --show {}", cow.display()));
        dm_create("pcut-view", &format!("0 {} snapshot {origin} {store} N 8", (POOL + META) / 512));
        Self { loops: [origin, store], cow }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // After a failed check the rig's own drop takes everything down (lazily, as it may be busy).
        if std::thread::panicking() {
            return;
        }
        sh("dmsetup remove pcut-view");
        for l in &self.loops {
            sh(&format!("losetup -d {l}"));
        }
        std::fs::remove_file(&self.cow).unwrap();
    }
}

fn replay_layout(layout: Layout, long: bool) {
    let started = Instant::now();
    let mut rig = Rig::new(layout);
    let w = run_workload(&rig);
    let log_path = rig.finish();
    let log = Log::open(&log_path).unwrap();
    let first = log.mark("m0").expect("the first mark is in the log");
    let points: Vec<usize> =
        (first..log.entries.len()).filter(|i| log.entries[*i].is_flush_point()).map(|i| i + 1).collect();
    // A new seed each run (printed; FERRITE_POWER_CUT_SEED repeats one): where the short sample
    // starts and which unflushed writes are kept, so runs cover different points over time.
    let seed: u64 = std::env::var("FERRITE_POWER_CUT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos().into()
    });
    let sample: Vec<usize> = if long {
        points.clone()
    } else {
        let step = (points.len() / 8).max(1);
        let from = usize::try_from(seed).unwrap() % step;
        points.iter().copied().skip(from).step_by(step).chain([log.entries.len()]).collect()
    };
    println!(
        "{layout:?}: workload {:.1?}: {} writes, {} marks; the log holds {} entries, {} flush points; replaying {} (seed {seed})",
        started.elapsed(),
        w.writes,
        w.marks.len(),
        log.entries.len(),
        points.len(),
        sample.len()
    );
    let replay = rig.dir.join("replay.img");
    // The whole log replayed is the device as the workload left it, byte for byte.
    File::create(&replay).unwrap().set_len(POOL + META).unwrap();
    let whole = std::fs::OpenOptions::new().write(true).open(&replay).unwrap();
    log.replay(0, log.entries.len(), &whole).unwrap();
    drop(whole);
    sh(&format!("cmp {} {}", replay.display(), rig.dir.join("data.img").display()));
    // The guest's files live in its memory: only the log, the image and a view's changes stay.
    std::fs::remove_file(rig.dir.join("data.img")).unwrap();
    // Rebuilt again from nothing (File::create empties it), point by point.
    File::create(&replay).unwrap().set_len(POOL + META).unwrap();
    let target = std::fs::OpenOptions::new().write(true).open(&replay).unwrap();
    // xorshift needs a state other than 0.
    let (mut applied, mut rng) = (0, seed | 1);
    let mut t = Totals::default();
    let timer = Instant::now();
    let mut lap = Instant::now();
    let mut shown = 0;
    for end in sample {
        // What the device holds for sure: every entry up to the last flush point before this
        // one; the writes logged after it, a random subset of them kept (a device may keep any).
        let since = (applied..end - 1).rev().find(|i| log.entries[*i].is_flush_point()).map_or(applied, |i| i + 1);
        log.replay(applied, since, &target).unwrap();
        applied = since;
        target.sync_all().unwrap();
        if end - 1 > since {
            let view = View::new(&rig.dir, &replay);
            let torn = std::fs::OpenOptions::new().write(true).open(View::DEVICE).unwrap();
            let mut kept = 0;
            for i in since..end - 1 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                if rng & 1 == 1 {
                    log.apply(i, &torn).unwrap();
                    kept += 1;
                }
            }
            torn.sync_all().unwrap();
            drop(torn);
            let what = format!("{layout:?} entries {since}..{} with {kept} of {} kept", end - 1, end - 1 - since);
            t.imaging += lap.elapsed();
            t.add(check(&rig, &w, &log, end - 1, &what));
            drop(view);
            lap = Instant::now();
        }
        log.replay(applied, end, &target).unwrap();
        applied = end;
        target.sync_all().unwrap();
        let view = View::new(&rig.dir, &replay);
        t.imaging += lap.elapsed();
        t.add(check(&rig, &w, &log, end, &format!("{layout:?} up to entry {end}")));
        drop(view);
        lap = Instant::now();
        // Progress every 20 replays (a point may add two: a torn one and its own).
        if t.replays / 20 > shown {
            shown = t.replays / 20;
            println!("{layout:?}: {} replays checked, up to entry {end} of {}", t.replays, log.entries.len());
        }
    }
    let each = |d: Duration| d / t.replays;
    println!(
        "{layout:?}: {} replays checked ({} blocks), {:.1?} per replay: image {:.1?}, mount {:.1?}, \
         daemon start {:.1?}, scrub {:.1?}, reads {:.1?}",
        t.replays,
        t.blocks,
        each(timer.elapsed()),
        each(t.imaging),
        each(t.phases[0]),
        each(t.phases[1]),
        each(t.phases[2]),
        each(t.phases[3])
    );
}

#[test]
#[ignore = "needs root, dm-log-writes and dmsetup: the VM tier runs it in the guest"]
fn power_cut_replayed_at_flush_points() {
    let long = std::env::var("FERRITE_LONG").is_ok_and(|v| v == "1");
    sh("modprobe loop && modprobe dm-log-writes");
    // Its own room in the guest's memory (the log, an image of the device, a view's changes), apart
    // from what the guest's other tests left in /tmp.
    sh(&format!("mkdir -p {ROOT} && mount -t tmpfs -o size=1400M,mode=0700 power-cut {ROOT}"));
    let only = std::env::var("FERRITE_POWER_CUT_LAYOUTS").unwrap_or_default();
    let wanted = |name: &str| only.is_empty() || only.split(',').any(|l| l == name);
    for (name, layout) in [("raw", Layout::RawPool), ("file", Layout::FileOnExt4)] {
        if wanted(name) {
            replay_layout(layout, long);
        }
    }
    sh(&format!("umount {ROOT}"));
    println!("POWER_CUT_OK");
}

/// A log as the target writes it, from (sector, flags, data or a mark's text).
fn write_log(path: &Path, sectorsize: usize, entries: &[(u64, u64, Vec<u8>)]) {
    let mut out = vec![0u8; sectorsize];
    out[..8].copy_from_slice(&log_writes::MAGIC.to_le_bytes());
    out[8..16].copy_from_slice(&1u64.to_le_bytes());
    out[16..24].copy_from_slice(&(entries.len() as u64).to_le_bytes());
    out[24..28].copy_from_slice(&u32::try_from(sectorsize).unwrap().to_le_bytes());
    for (sector, flags, data) in entries {
        let mut h = vec![0u8; sectorsize];
        let mark = flags & log_writes::MARK != 0;
        let sectors = if mark { 0 } else { data.len().div_ceil(sectorsize) as u64 };
        h[..8].copy_from_slice(&sector.to_le_bytes());
        h[8..16].copy_from_slice(&sectors.to_le_bytes());
        h[16..24].copy_from_slice(&flags.to_le_bytes());
        if mark {
            h[24..32].copy_from_slice(&(data.len() as u64).to_le_bytes());
            h[32..32 + data.len()].copy_from_slice(data);
        }
        out.extend_from_slice(&h);
        if flags & (log_writes::MARK | log_writes::DISCARD) == 0 {
            out.extend_from_slice(data);
        }
    }
    std::fs::write(path, out).unwrap();
}

#[test]
fn a_log_replays_to_each_point() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let (a, b) = (vec![0xaa; 8192], vec![0xbb; 4096]);
    let entries = [
        (2, 0, a.clone()),
        (0, log_writes::FLUSH, Vec::new()),
        (0, log_writes::MARK, b"start".to_vec()),
        (3, log_writes::FUA, b.clone()),
        (2, log_writes::DISCARD, vec![0; 4096]),
    ];
    write_log(&path, 4096, &entries);
    let log = Log::open(&path).unwrap();
    assert_eq!(log.sectorsize, 4096);
    assert_eq!(log.entries.len(), 5);
    assert_eq!(log.mark("start"), Some(2));
    let points: Vec<usize> = (0..5).filter(|i| log.entries[*i].is_flush_point()).collect();
    assert_eq!(points, [1, 3]);
    let out = dir.path().join("dev");
    File::create(&out).unwrap().set_len(6 * 4096).unwrap();
    let dev = std::fs::OpenOptions::new().read(true).write(true).open(&out).unwrap();
    let read = |dev: &File| {
        let mut v = vec![0u8; 6 * 4096];
        dev.read_exact_at(&mut v, 0).unwrap();
        v
    };
    log.replay(0, 2, &dev).unwrap();
    let v = read(&dev);
    assert!(v[2 * 4096..4 * 4096].iter().all(|x| *x == 0xaa) && v[..2 * 4096].iter().all(|x| *x == 0));
    log.replay(2, 5, &dev).unwrap();
    let v = read(&dev);
    assert!(v[2 * 4096..3 * 4096].iter().all(|x| *x == 0), "the discard reads zeros");
    assert!(v[3 * 4096..4 * 4096].iter().all(|x| *x == 0xbb), "the FUA write overwrote the first");
    // A log cut short (a super block counting more entries than it holds) is refused.
    let mut bytes = Vec::new();
    File::open(&path).unwrap().read_to_end(&mut bytes).unwrap();
    bytes.truncate(bytes.len() - 4096 * 2);
    std::fs::write(&path, &bytes).unwrap();
    assert!(Log::open(&path).unwrap_err().to_string().contains("past the log's end"));
    std::fs::write(&path, vec![0u8; 4096]).unwrap();
    assert!(Log::open(&path).unwrap_err().to_string().contains("not a dm-log-writes log"));
}

#[test]
fn a_block_value_shows_tears_and_strays() {
    let b = block_bytes(3, 17, 42);
    assert_eq!(read_value(&b, 17), Ok(42));
    assert_eq!(read_value(&[0u8; BLOCK], 17), Ok(0));
    assert!(read_value(&b, 18).unwrap_err().contains("written at 17"));
    let mut torn = b.clone();
    torn[BLOCK - 1] ^= 1;
    assert!(read_value(&torn, 17).unwrap_err().contains("torn"));
    assert!(read_value(&[7u8; BLOCK], 17).is_err());
}
