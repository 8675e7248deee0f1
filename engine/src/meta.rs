//! The metadata store: RocksDB holding the catalog, checkpoints and the log's segment chain.
//!
//! Keys (all integers big-endian so iteration is ordered):
//! ```text
//! p/uuid               pool uuid (must match the superblock)
//! p/next_id            next volume/layer id (ids are never reused: the log may name old ones)
//! v/<id>               volume record (its head layer, size, name)
//! y/<layer>            layer record: its parent layer (0 for a root), then the data key its
//!                      blocks are encrypted with (absent: plaintext)
//! d/<key>              a data key, wrapped by its key-encryption key (see ferrite-crypt)
//! n/<id>               snapshot record (volume, frozen layer, size, name)
//! g/<id>               volume group (member volume ids, name)
//! h/<id>               group snapshot (group, member snapshot ids, name)
//! c/ckpt               checkpoint record: replay position, sequence and generation
//! m/<layer><chunk>     extent-map chunk as of the last checkpoint
//! s/<segment>          per-block crc32c table of a segment as of the last checkpoint
//! l/<seq>              segment the log head moved to at batch <seq> (only after the checkpoint)
//! ```
//! Every write is synchronous: a catalog change is durable when its call returns.

use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

use parking_lot::Mutex;
use rocksdb::{DB, Direction, IteratorMode, Options, WriteBatch, WriteOptions};

use crate::error::{Error, ErrorKind, Result, corrupt};
use crate::format::le64;
use crate::map::extent_map::Chunk;
use crate::qos::QosLimits;

/// A volume as stored in the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VolumeRecord {
    pub id: u64,
    pub layer: u64,
    pub size: u64,
    pub created_unix: u64,
    /// Clients may not write (a demoted replication primary, a replica).
    pub read_only: bool,
    /// IOPS and bandwidth limits (all 0: none).
    pub qos: QosLimits,
    pub name: String,
}

/// A layer as stored in the catalog: its parent (None: a root) and its data key (None: plaintext).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerRecord {
    pub id: u64,
    pub parent: Option<u64>,
    pub key: Option<u64>,
}

/// A snapshot as stored in the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SnapshotRecord {
    pub id: u64,
    /// The volume it was taken of (which may since have been deleted).
    pub volume: u64,
    pub layer: u64,
    /// The volume's size when the snapshot was taken.
    pub size: u64,
    pub created_unix: u64,
    /// Random, drawn when the snapshot is taken: with the pool's uuid and the id it tells this
    /// snapshot apart from one of a pool copied from the same image (0: taken by an earlier
    /// build, unknown).
    pub nonce: u64,
    pub name: String,
}

/// A volume group (also used, with `members` = snapshot ids, for a group snapshot, whose
/// `group` is then the group it was taken of).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GroupRecord {
    pub id: u64,
    pub group: u64,
    pub created_unix: u64,
    pub members: Vec<u64>,
    pub name: String,
}

impl GroupRecord {
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![1u8];
        for x in [self.id, self.group, self.created_unix, self.members.len() as u64] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for m in &self.members {
            v.extend_from_slice(&m.to_le_bytes());
        }
        v.extend_from_slice(self.name.as_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 33 || b[0] != 1 {
            return None;
        }
        let n = usize::try_from(le64(b, 25)).ok()?;
        let names_at = 33usize.checked_add(n.checked_mul(8)?)?;
        if b.len() < names_at {
            return None;
        }
        Some(Self {
            id: le64(b, 1),
            group: le64(b, 9),
            created_unix: le64(b, 17),
            members: (0..n).map(|i| le64(b, 33 + i * 8)).collect(),
            name: String::from_utf8(b[names_at..].to_vec()).ok()?,
        })
    }
}

/// One change to the catalog, applied with others in one atomic write.
#[derive(Debug, Clone)]
pub(crate) enum CatalogOp {
    PutVolume(VolumeRecord),
    DeleteVolume(u64),
    /// A layer, its parent (None: a root layer) and its data key (None: plaintext).
    PutLayer(u64, Option<u64>, Option<u64>),
    /// Removes a layer's record and every checkpointed chunk of its map.
    DeleteLayer(u64),
    PutSnapshot(SnapshotRecord),
    DeleteSnapshot(u64),
    PutGroup(GroupRecord),
    DeleteGroup(u64),
    PutGroupSnapshot(GroupRecord),
    DeleteGroupSnapshot(u64),
    /// A data key, wrapped (`ferrite_crypt::WrappedKey::encode`).
    PutDataKey(u64, Vec<u8>),
    DeleteDataKey(u64),
}

/// Where replay starts, and the generation new batches carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CheckpointRecord {
    pub seq: u64,
    pub seg: u64,
    pub off: u64,
    pub generation: u64,
    /// The cold head (segment, offset), if one is open (see `write/cold.rs`).
    pub cold: Option<(u64, u64)>,
}

const KEY_UUID: &[u8] = b"p/uuid";
const KEY_NEXT_ID: &[u8] = b"p/next_id";
const KEY_CKPT: &[u8] = b"c/ckpt";

fn key(prefix: &[u8], parts: &[u64]) -> Vec<u8> {
    let mut k = prefix.to_vec();
    for p in parts {
        k.extend_from_slice(&p.to_be_bytes());
    }
    k
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl VolumeRecord {
    /// Version 2 adds a flags byte before the name (bit 0: read-only; bit 1: QoS limits follow,
    /// seven u64s); version 1 has none. A record without limits is written as version 2, so a
    /// catalog only gains version 3 records once limits are set.
    fn encode(&self) -> Vec<u8> {
        let limited = !self.qos.is_unlimited();
        let mut v = vec![if limited { 3u8 } else { 2 }];
        for x in [self.id, self.layer, self.size, self.created_unix] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.push(u8::from(self.read_only) | if limited { 2 } else { 0 });
        if limited {
            for x in self.qos.to_array() {
                v.extend_from_slice(&x.to_le_bytes());
            }
        }
        v.extend_from_slice(self.name.as_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let (flags, mut rest) = match b.first()? {
            1 if b.len() >= 33 => (0, &b[33..]),
            2 | 3 if b.len() >= 34 => (b[33], &b[34..]),
            _ => return None,
        };
        if flags > 3 || (flags & 2 != 0) != (b[0] == 3) {
            return None;
        }
        let mut qos = QosLimits::default();
        if flags & 2 != 0 {
            let mut a = [0u64; 7];
            for (i, x) in a.iter_mut().enumerate() {
                *x = u64::from_le_bytes(rest.get(i * 8..i * 8 + 8)?.try_into().ok()?);
            }
            qos = QosLimits::from_array(a);
            rest = &rest[56..];
        }
        Some(Self {
            id: le64(b, 1),
            layer: le64(b, 9),
            size: le64(b, 17),
            created_unix: le64(b, 25),
            read_only: flags & 1 == 1,
            qos,
            name: String::from_utf8(rest.to_vec()).ok()?,
        })
    }
}

impl SnapshotRecord {
    /// Version 2 adds the nonce after the time; version 1 has none.
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![2u8];
        for x in [self.id, self.volume, self.layer, self.size, self.created_unix, self.nonce] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.extend_from_slice(self.name.as_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let (nonce, name_at) = match b.first()? {
            1 if b.len() >= 41 => (0, 41),
            2 if b.len() >= 49 => (le64(b, 41), 49),
            _ => return None,
        };
        Some(Self {
            id: le64(b, 1),
            volume: le64(b, 9),
            layer: le64(b, 17),
            size: le64(b, 25),
            created_unix: le64(b, 33),
            nonce,
            name: String::from_utf8(b[name_at..].to_vec()).ok()?,
        })
    }
}

impl CheckpointRecord {
    /// Version 2 adds the cold head (two u64s); version 1 has none.
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![if self.cold.is_some() { 2u8 } else { 1 }];
        for x in [self.seq, self.seg, self.off, self.generation] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        if let Some((seg, off)) = self.cold {
            v.extend_from_slice(&seg.to_le_bytes());
            v.extend_from_slice(&off.to_le_bytes());
        }
        v
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let cold = match (b.len(), b.first()) {
            (33, Some(1)) => None,
            (49, Some(2)) => Some((le64(b, 33), le64(b, 41))),
            _ => return None,
        };
        Some(Self { seq: le64(b, 1), seg: le64(b, 9), off: le64(b, 17), generation: le64(b, 25), cold })
    }
}

/// A map chunk's key (layer, chunk index) and its new encoding, or None to delete it.
pub(crate) type ChunkUpdate = ((u64, u64), Option<Vec<u8>>);

/// What one checkpoint writes, applied atomically.
#[derive(Debug, Default)]
pub(crate) struct CheckpointWrite {
    pub chunks: Vec<ChunkUpdate>,
    pub crcs: Vec<(u64, Option<Vec<u8>>)>,
    pub record: Option<CheckpointRecord>,
    /// Catalog changes that must become durable together with this checkpoint.
    pub catalog: Vec<CatalogOp>,
}

/// The RocksDB-backed metadata store.
#[derive(Debug)]
pub(crate) struct Meta {
    db: DB,
    /// Chain records written but not yet synced. A segment move is written to RocksDB at once
    /// without a sync (its WAL write reaches the kernel, so a process crash keeps it, as it keeps
    /// the batches after it) and becomes durable against a power cut with the next store sync
    /// (`Ctx::sync_store`) or checkpoint, not with a sync of its own on the write path: batches
    /// in the new segment need it durable only once something promised them durable, and every
    /// such promise goes through one of those two.
    pending_chain: Mutex<BTreeMap<u64, u64>>,
}

fn sync_opts() -> WriteOptions {
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    wo
}

fn db_options(create: bool) -> Options {
    let mut o = Options::default();
    o.create_if_missing(create);
    o.set_error_if_exists(create);
    o.set_compression_type(rocksdb::DBCompressionType::None);
    o.set_keep_log_file_num(4);
    o.set_max_log_file_size(4 << 20);
    o.set_write_buffer_size(16 << 20);
    o
}

impl Meta {
    /// Creates a new store for a new pool; fails if one exists in `dir`.
    pub fn create(dir: &Path, uuid: &[u8; 16], first: CheckpointRecord) -> Result<Self> {
        // The catalog names every volume and maps every block: private to the daemon (0700).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| Error::io(format!("creating metadata directory {}", dir.display()), e))?;
        let db = DB::open(&db_options(true), dir).map_err(|e| {
            Error::new(ErrorKind::AlreadyExists, format!("cannot create metadata store at {}", dir.display()))
                .with_source(e)
        })?;
        let mut b = WriteBatch::default();
        b.put(KEY_UUID, uuid);
        b.put(KEY_NEXT_ID, 1u64.to_le_bytes());
        b.put(KEY_CKPT, first.encode());
        db.write_opt(b, &sync_opts())?;
        Ok(Self { db, pending_chain: Mutex::default() })
    }

    /// Opens an existing store.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.join("CURRENT").exists() {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("metadata store {} does not exist (was the pool created?)", dir.display()),
            ));
        }
        let db = DB::open(&db_options(false), dir).map_err(|e| {
            Error::new(ErrorKind::Io, format!("cannot open metadata store at {}", dir.display())).with_source(e)
        })?;
        Ok(Self { db, pending_chain: Mutex::default() })
    }

    pub fn uuid(&self) -> Result<Option<Vec<u8>>> {
        Ok(self.db.get(KEY_UUID)?)
    }

    /// Allocates a fresh id (durable before it is handed out).
    pub fn next_id(&self) -> Result<u64> {
        let cur = self.db.get(KEY_NEXT_ID)?.filter(|v| v.len() == 8).ok_or_else(|| corrupt("next id missing"))?;
        let id = le64(&cur, 0);
        self.db.put_opt(KEY_NEXT_ID, (id + 1).to_le_bytes(), &sync_opts())?;
        Ok(id)
    }

    pub fn put_volume(&self, v: &VolumeRecord) -> Result<()> {
        self.apply(&[CatalogOp::PutVolume(v.clone())])
    }

    /// Applies catalog changes in one synchronous, atomic write.
    pub fn apply(&self, ops: &[CatalogOp]) -> Result<()> {
        let mut b = WriteBatch::default();
        add_ops(&mut b, ops);
        Ok(self.db.write_opt(b, &sync_opts())?)
    }

    fn scan(&self, prefix: &[u8], mut f: impl FnMut(&[u8], &[u8]) -> Result<()>) -> Result<()> {
        for item in self.db.iterator(IteratorMode::From(prefix, Direction::Forward)) {
            let (k, v) = item?;
            if !k.starts_with(prefix) {
                break;
            }
            f(&k[prefix.len()..], &v)?;
        }
        Ok(())
    }

    pub fn volumes(&self) -> Result<Vec<VolumeRecord>> {
        let mut out = Vec::new();
        self.scan(b"v/", |_, v| {
            out.push(VolumeRecord::decode(v).ok_or_else(|| corrupt("malformed volume record"))?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Every layer record. A build without encryption refuses the 16-byte records of encrypted
    /// layers instead of reading their blocks as plaintext.
    pub fn layers(&self) -> Result<Vec<LayerRecord>> {
        let mut out = Vec::new();
        self.scan(b"y/", |k, v| {
            if k.len() != 8 || !matches!(v.len(), 8 | 16) {
                return Err(corrupt("malformed layer record"));
            }
            let key = (v.len() == 16).then(|| le64(v, 8)).filter(|&k| k != 0);
            out.push(LayerRecord { id: be64(k, 0), parent: Some(le64(v, 0)).filter(|&p| p != 0), key });
            Ok(())
        })?;
        Ok(out)
    }

    /// Every data key, wrapped: (key id, `WrappedKey` encoding).
    pub fn data_keys(&self) -> Result<Vec<(u64, Vec<u8>)>> {
        let mut out = Vec::new();
        self.scan(b"d/", |k, v| {
            if k.len() != 8 {
                return Err(corrupt("malformed data key record"));
            }
            out.push((be64(k, 0), v.to_vec()));
            Ok(())
        })?;
        Ok(out)
    }

    pub fn snapshots(&self) -> Result<Vec<SnapshotRecord>> {
        let mut out = Vec::new();
        self.scan(b"n/", |_, v| {
            out.push(SnapshotRecord::decode(v).ok_or_else(|| corrupt("malformed snapshot record"))?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Groups (`g/`) or group snapshots (`h/`).
    pub fn groups(&self, snapshots: bool) -> Result<Vec<GroupRecord>> {
        let mut out = Vec::new();
        self.scan(if snapshots { b"h/" } else { b"g/" }, |_, v| {
            out.push(GroupRecord::decode(v).ok_or_else(|| corrupt("malformed group record"))?);
            Ok(())
        })?;
        Ok(out)
    }

    pub fn chunks(&self, mut f: impl FnMut(u64, u64, Chunk)) -> Result<()> {
        self.scan(b"m/", |k, v| {
            let chunk = Chunk::decode(v).filter(|_| k.len() == 16).ok_or_else(|| corrupt("malformed map chunk"))?;
            f(be64(k, 0), be64(k, 8), chunk);
            Ok(())
        })
    }

    pub fn crc_tables(&self, mut f: impl FnMut(u64, &[u8])) -> Result<()> {
        self.scan(b"s/", |k, v| {
            if k.len() != 8 {
                return Err(corrupt("malformed crc table key"));
            }
            f(be64(k, 0), v);
            Ok(())
        })
    }

    pub fn checkpoint(&self) -> Result<CheckpointRecord> {
        let v = self.db.get(KEY_CKPT)?.ok_or_else(|| corrupt("checkpoint record missing"))?;
        CheckpointRecord::decode(&v).ok_or_else(|| corrupt("malformed checkpoint record"))
    }

    /// The segment chain: batch sequence at which the head moved -> segment.
    pub fn chain(&self) -> Result<BTreeMap<u64, u64>> {
        let mut out = BTreeMap::new();
        self.scan(b"l/", |k, v| {
            if k.len() != 8 || v.len() != 8 {
                return Err(corrupt("malformed log chain record"));
            }
            out.insert(be64(k, 0), le64(v, 0));
            Ok(())
        })?;
        Ok(out)
    }

    /// Records that batch `seq` and its successors go to segment `seg`: written now (kept by a
    /// process crash), durable with the next [`Meta::sync_chain`] or checkpoint.
    pub fn note_chain(&self, seq: u64, seg: u64) -> Result<()> {
        self.db.put(key(b"l/", &[seq]), seg.to_le_bytes())?;
        self.pending_chain.lock().insert(seq, seg);
        Ok(())
    }

    /// Makes every chain record noted so far durable (one synchronous write, none if nothing
    /// is pending).
    pub fn sync_chain(&self) -> Result<()> {
        let mut b = WriteBatch::default();
        let pending = self.put_pending_chain(&mut b);
        if pending.is_empty() {
            return Ok(());
        }
        self.db.write_opt(b, &sync_opts())?;
        self.forget_chain(&pending);
        Ok(())
    }

    /// Adds the pending chain records to `b`; returns them, for [`Meta::forget_chain`] once
    /// `b` is written.
    fn put_pending_chain(&self, b: &mut WriteBatch) -> Vec<(u64, u64)> {
        let pending: Vec<(u64, u64)> = self.pending_chain.lock().iter().map(|(&k, &v)| (k, v)).collect();
        for &(seq, seg) in &pending {
            b.put(key(b"l/", &[seq]), seg.to_le_bytes());
        }
        pending
    }

    fn forget_chain(&self, written: &[(u64, u64)]) {
        let mut p = self.pending_chain.lock();
        for (seq, seg) in written {
            if p.get(seq) == Some(seg) {
                p.remove(seq);
            }
        }
    }

    /// Applies a checkpoint atomically; chain records before its sequence are dropped.
    pub fn write_checkpoint(&self, w: CheckpointWrite) -> Result<()> {
        let mut b = WriteBatch::default();
        for ((layer, chunk), v) in w.chunks {
            match v {
                Some(v) => b.put(key(b"m/", &[layer, chunk]), v),
                None => b.delete(key(b"m/", &[layer, chunk])),
            }
        }
        for (seg, v) in w.crcs {
            match v {
                Some(v) => b.put(key(b"s/", &[seg]), v),
                None => b.delete(key(b"s/", &[seg])),
            }
        }
        add_ops(&mut b, &w.catalog);
        // Segment moves since the last sync go with it (before the range delete, which drops
        // those the checkpoint makes unneeded).
        let chain = self.put_pending_chain(&mut b);
        if let Some(r) = w.record {
            b.put(KEY_CKPT, r.encode());
            b.delete_range(key(b"l/", &[0]), key(b"l/", &[r.seq]));
        }
        self.db.write_opt(b, &sync_opts())?;
        self.forget_chain(&chain);
        Ok(())
    }

    /// Drops every chain record (after recovery has written a fresh checkpoint).
    pub fn clear_chain(&self) -> Result<()> {
        let mut b = WriteBatch::default();
        b.delete_range(key(b"l/", &[0]), key(b"l/", &[u64::MAX]));
        self.pending_chain.lock().clear();
        Ok(self.db.write_opt(b, &sync_opts())?)
    }
}

fn add_ops(b: &mut WriteBatch, ops: &[CatalogOp]) {
    for op in ops {
        match op {
            CatalogOp::PutVolume(v) => b.put(key(b"v/", &[v.id]), v.encode()),
            CatalogOp::DeleteVolume(id) => b.delete(key(b"v/", &[*id])),
            CatalogOp::PutLayer(id, parent, data_key) => {
                let mut v = parent.unwrap_or(0).to_le_bytes().to_vec();
                if let Some(k) = data_key {
                    v.extend_from_slice(&k.to_le_bytes());
                }
                b.put(key(b"y/", &[*id]), v);
            }
            CatalogOp::DeleteLayer(id) => {
                b.delete(key(b"y/", &[*id]));
                b.delete_range(key(b"m/", &[*id]), key(b"m/", &[*id + 1]));
            }
            CatalogOp::PutSnapshot(s) => b.put(key(b"n/", &[s.id]), s.encode()),
            CatalogOp::DeleteSnapshot(id) => b.delete(key(b"n/", &[*id])),
            CatalogOp::PutGroup(g) => b.put(key(b"g/", &[g.id]), g.encode()),
            CatalogOp::DeleteGroup(id) => b.delete(key(b"g/", &[*id])),
            CatalogOp::PutGroupSnapshot(g) => b.put(key(b"h/", &[g.id]), g.encode()),
            CatalogOp::DeleteGroupSnapshot(id) => b.delete(key(b"h/", &[*id])),
            CatalogOp::PutDataKey(id, wrapped) => b.put(key(b"d/", &[*id]), wrapped),
            CatalogOp::DeleteDataKey(id) => b.delete(key(b"d/", &[*id])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_roundtrip() {
        let mut v = VolumeRecord {
            id: 3,
            layer: 4,
            size: 1 << 30,
            created_unix: 9,
            read_only: false,
            qos: QosLimits::default(),
            name: "vol-a".into(),
        };
        assert_eq!(VolumeRecord::decode(&v.encode()), Some(v.clone()));
        // Version 1 (no flags byte) still reads.
        let mut v1 = v.encode();
        v1[0] = 1;
        v1.remove(33);
        assert_eq!(VolumeRecord::decode(&v1), Some(v.clone()));
        v.read_only = true;
        assert_eq!(VolumeRecord::decode(&v.encode()), Some(v.clone()));
        // Limits: version 3, and every field read back; a truncated one is refused.
        v.qos = QosLimits { iops: 5000, write_bps: 200 << 20, burst_ms: 2000, ..Default::default() };
        let e = v.encode();
        assert_eq!(e[0], 3);
        assert_eq!(VolumeRecord::decode(&e), Some(v.clone()));
        assert_eq!(VolumeRecord::decode(&e[..60]), None);
        let mut lying = e.clone();
        lying[0] = 2;
        assert_eq!(VolumeRecord::decode(&lying), None, "flags and version disagree");
        let n = SnapshotRecord { id: 5, volume: 3, layer: 4, size: 8192, created_unix: 1, nonce: 9, name: "s1".into() };
        assert_eq!(SnapshotRecord::decode(&n.encode()), Some(n.clone()));
        // A record of an earlier build (version 1, no nonce) reads with nonce 0.
        let mut v1 = vec![1u8];
        for x in [5u64, 3, 4, 8192, 1] {
            v1.extend_from_slice(&x.to_le_bytes());
        }
        v1.extend_from_slice(b"s1");
        assert_eq!(SnapshotRecord::decode(&v1), Some(SnapshotRecord { nonce: 0, ..n }));
        let g = GroupRecord { id: 7, group: 0, created_unix: 2, members: vec![3, 9], name: "g1".into() };
        assert_eq!(GroupRecord::decode(&g.encode()), Some(g.clone()));
        assert_eq!(GroupRecord::decode(&g.encode()[..40]), None);
        let c = CheckpointRecord { seq: 5, seg: 6, off: 7, generation: 8, cold: None };
        assert_eq!(CheckpointRecord::decode(&c.encode()), Some(c));
        assert_eq!(CheckpointRecord::decode(&[1, 2]), None);
    }

    #[test]
    fn create_open_and_chain() {
        let dir = tempfile::tempdir().unwrap();
        let first = CheckpointRecord { seq: 1, seg: 0, off: 0, generation: 1, cold: None };
        {
            let m = Meta::create(dir.path(), &[1; 16], first).unwrap();
            assert_eq!(m.next_id().unwrap(), 1);
            assert_eq!(m.next_id().unwrap(), 2);
            m.note_chain(10, 3).unwrap();
            m.sync_chain().unwrap();
            // Not synced, but written: a process crash (this drop) keeps it.
            m.note_chain(20, 4).unwrap();
        }
        assert_eq!(Meta::create(dir.path(), &[1; 16], first).unwrap_err().kind(), ErrorKind::AlreadyExists);
        let m = Meta::open(dir.path()).unwrap();
        assert_eq!(m.next_id().unwrap(), 3);
        assert_eq!(m.chain().unwrap().into_iter().collect::<Vec<_>>(), vec![(10, 3), (20, 4)]);
        // A checkpoint carries what is pending and drops what it makes unneeded.
        m.note_chain(25, 6).unwrap();
        let rec = CheckpointRecord { seq: 15, ..first };
        m.write_checkpoint(CheckpointWrite { record: Some(rec), ..Default::default() }).unwrap();
        assert_eq!(m.chain().unwrap().into_iter().collect::<Vec<_>>(), vec![(20, 4), (25, 6)]);
        m.note_chain(30, 5).unwrap();
        m.sync_chain().unwrap();
        m.sync_chain().unwrap();
        assert_eq!(m.chain().unwrap().len(), 3);
        assert_eq!(m.checkpoint().unwrap(), rec);
        let missing = dir.path().join("nope");
        assert_eq!(Meta::open(&missing).unwrap_err().kind(), ErrorKind::NotFound);
    }
}
