//! A manifest's chunk list, in segments that backups share (as Proxmox Backup Server's fixed
//! index, or kopia's indirect objects).
//!
//! A segment lists the non-zero chunks of [`SPAN`] consecutive chunk positions (64 GiB of
//! volume at 4 MiB chunks), in a compact binary form, and is stored as a chunk: named by the
//! keyed hash of its bytes under `chunks/`. So a segment no chunk of which changed has the same
//! name in the next backup and is stored once; the condemned list, the object lock and verify
//! treat segments as the chunks they are; a backup holds one segment at a time, whatever the
//! volume's size; and a prune reads each distinct segment once, so its reads grow with what
//! changed, not with the number of backups.
//!
//! Layout: `FRSG`, version (1), first position (u64 LE), count (u32 LE), then per chunk its
//! position past the first (u32 LE), its plaintext length (u32 LE) and its name (32 bytes).

use serde::{Deserialize, Serialize};

use crate::manifest::{ChunkRef, chunk_path};
use crate::prune::Swept;
use crate::{Error, Pace, Result, Target};

/// Chunk positions a segment covers.
pub const SPAN: u64 = 16_384;
const MAGIC: &[u8; 4] = b"FRSG";
const VERSION: u8 = 1;
const HEAD: usize = 4 + 1 + 8 + 4;
const ENTRY: usize = 4 + 4 + 32;

/// A segment as its manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    /// Its first chunk position (a multiple of [`SPAN`]).
    pub first: u64,
    /// Its name: it is stored as a chunk.
    pub id: String,
    /// The non-zero chunks it lists, and their plaintext bytes.
    pub chunks: u32,
    pub bytes: u64,
}

impl SegmentRef {
    /// The segment as the chunk it is stored as (its `len` is its plaintext's).
    pub(crate) fn as_chunk(&self) -> ChunkRef {
        let len = HEAD + ENTRY * self.chunks as usize;
        ChunkRef { i: self.first, id: self.id.clone(), len: u32::try_from(len).expect("a segment is under 1 MiB") }
    }
}

/// The bytes of the segment starting at `first` that lists `refs` (in order, all inside it).
pub(crate) fn encode(first: u64, refs: &[ChunkRef]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + ENTRY * refs.len());
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&first.to_le_bytes());
    out.extend_from_slice(&u32::try_from(refs.len()).expect("at most SPAN").to_le_bytes());
    for c in refs {
        let at = u32::try_from(c.i - first).expect("inside the segment");
        out.extend_from_slice(&at.to_le_bytes());
        out.extend_from_slice(&c.len.to_le_bytes());
        out.extend_from_slice(&crate::codec::unhex(&c.id).expect("chunk names are hex"));
    }
    out
}

/// The chunks segment `seg` of a manifest of `chunk` byte chunks and `size` bytes lists, from
/// its bytes `data`; why not, when they are not what its reference says or break what the
/// readers rely on ([`crate::manifest::check_place`]).
pub(crate) fn decode(
    seg: &SegmentRef,
    data: &[u8],
    chunk: u64,
    size: u64,
) -> std::result::Result<Vec<ChunkRef>, String> {
    let Some((head, body)) = data.split_at_checked(HEAD) else { return Err("it is cut short".into()) };
    if &head[..4] != MAGIC || head[4] != VERSION {
        return Err("it is no segment (or one of a newer build)".into());
    }
    let first = u64::from_le_bytes(head[5..13].try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(head[13..17].try_into().expect("4 bytes"));
    if first != seg.first || count != seg.chunks || body.len() != ENTRY * count as usize {
        return Err(format!("it is not the segment its manifest lists at chunk {}", seg.first));
    }
    let mut refs = Vec::with_capacity(count as usize);
    let mut bytes = 0u64;
    for entry in body.chunks_exact(ENTRY) {
        let at = u32::from_le_bytes(entry[..4].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(entry[4..8].try_into().expect("4 bytes"));
        if u64::from(at) >= SPAN || refs.last().is_some_and(|p: &ChunkRef| p.i >= first + u64::from(at)) {
            return Err(format!("chunk {at} of the segment at {first} is out of order or past its span"));
        }
        let c = ChunkRef { i: first + u64::from(at), id: crate::codec::hex(&entry[8..]), len };
        crate::manifest::check_place(&c, chunk, size)?;
        bytes += u64::from(len);
        refs.push(c);
    }
    if bytes != seg.bytes {
        return Err(format!(
            "the segment at chunk {first} holds {bytes} bytes, not the {} its manifest says",
            seg.bytes
        ));
    }
    Ok(refs)
}

/// Fetches segment `seg` of a manifest of `chunk` byte chunks and `size` bytes, checked as a
/// chunk (its name) and as a segment.
pub(crate) async fn load(target: &Target, seg: &SegmentRef, chunk: u64, size: u64) -> Result<Vec<ChunkRef>> {
    let data = crate::restore::fetch_chunk(target, &seg.as_chunk(), &Pace::new(None)).await?;
    decode(seg, &data, chunk, size).map_err(|why| Error::corrupt(&target.name, format!("segment {}", seg.id), why))
}

/// A segment stored by [`store`].
pub(crate) struct Stored {
    pub seg: SegmentRef,
    /// Bytes uploaded (0 when the target had it).
    pub uploaded: u64,
    /// Its bytes, when it was condemned and uploaded again (to check after the commit).
    pub again: Option<Vec<u8>>,
}

/// Stores the segment starting at `first` that lists `refs` unless the target holds it: the
/// previous backup's segment there (`previous`) or a HEAD says so, and it is not condemned
/// (`swept`).
pub(crate) async fn store(
    target: &Target,
    first: u64,
    refs: &[ChunkRef],
    previous: Option<&SegmentRef>,
    swept: &Swept,
    pace: &Pace,
) -> Result<Stored> {
    let data = encode(first, refs);
    let seg = SegmentRef {
        first,
        id: target.codec.chunk_id(&data),
        chunks: u32::try_from(refs.len()).expect("at most SPAN"),
        bytes: refs.iter().map(|c| u64::from(c.len)).sum(),
    };
    let path = chunk_path(&seg.id);
    let fresh = !swept.condemned.contains(&seg.id);
    if fresh && (previous.is_some_and(|p| p.id == seg.id) || target.holds_fresh(&path, swept.locked_at).await?) {
        return Ok(Stored { seg, uploaded: 0, again: None });
    }
    let uploaded = crate::create::upload(target, &path, data.clone(), pace).await?;
    Ok(Stored { seg, uploaded, again: (!fresh).then_some(data) })
}

/// After a commit: each segment that [`store`] uploaded again because it was condemned
/// (`again`: its name and bytes), once more if a prune's DELETE took it meanwhile (a prune's
/// HEAD and DELETE are two requests; the manifest listing it is there now, so no later prune
/// takes it).
pub(crate) async fn store_again(target: &Target, again: Vec<(String, Vec<u8>)>, pace: &Pace) -> Result<()> {
    for (id, data) in again {
        let path = chunk_path(&id);
        if target.head(&path).await?.is_none() {
            tracing::warn!(target = %target.name, segment = %id,
                "a segment uploaded again was swept by a prune meanwhile: uploading it once more");
            crate::create::upload(target, &path, data, pace).await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(i: u64, len: u32) -> ChunkRef {
        ChunkRef { i, id: format!("{:02x}", i % 256).repeat(32), len }
    }

    #[test]
    fn a_segment_round_trips_and_is_checked() {
        const MIB: u64 = 1 << 20;
        let (first, size) = (SPAN, 3 * SPAN * MIB);
        let refs = vec![chunk(first, 1 << 20), chunk(first + 7, 4096), chunk(2 * SPAN - 1, 1 << 20)];
        let data = encode(first, &refs);
        let seg = SegmentRef { first, id: String::new(), chunks: 3, bytes: (2 << 20) + 4096 };
        assert_eq!(data.len(), seg.as_chunk().len as usize);
        assert_eq!(decode(&seg, &data, MIB, size), Ok(refs.clone()));
        // What its manifest says must be what it is.
        for other in [
            SegmentRef { first: 0, ..seg.clone() },
            SegmentRef { chunks: 2, ..seg.clone() },
            SegmentRef { bytes: 1, ..seg.clone() },
        ] {
            assert!(decode(&other, &data, MIB, size).is_err(), "{other:?}");
        }
        // What readers rely on: order, places, lengths.
        for bad in [
            vec![refs[1].clone(), refs[0].clone()],
            vec![refs[0].clone(), refs[0].clone()],
            vec![chunk(first, (1 << 20) + 1)],
        ] {
            let seg = SegmentRef {
                chunks: u32::try_from(bad.len()).unwrap(),
                bytes: bad.iter().map(|c| u64::from(c.len)).sum(),
                ..seg.clone()
            };
            assert!(decode(&seg, &encode(first, &bad), MIB, size).is_err(), "{bad:?}");
        }
        assert!(decode(&seg, &data[..data.len() - 1], MIB, size).is_err(), "cut short");
        assert!(decode(&seg, &[b"FRSG\x02", &data[5..]].concat(), MIB, size).is_err(), "a newer version");
        // Past the volume's end.
        assert!(decode(&seg, &data, MIB, (SPAN + 8) * MIB).is_err());
    }
}
