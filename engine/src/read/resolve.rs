//! Block resolution for reads: a range of a volume or snapshot becomes, block by block, either
//! a hole (reads as zeros) or a pool block with its checksum, resolved through the layer chain
//! under the state lock, with the segments it will be read from pinned. And the other end: a
//! resolved range filled from the media read for it, every block's checksum checked.

use std::sync::Arc;

use ferrite_crypt::DataKey;

use crate::error::{Error, ErrorKind, Result};
use crate::format::block_crc;
use crate::io::BLOCK;
use crate::map::segments::Pinned;
use crate::read::reads::Media;
use crate::state::{State, Target};

const B: u64 = BLOCK as u64;

/// One block of a read, resolved: unmapped (reads as zeros), or where it is.
pub(crate) type Resolved = Option<Mapped>;

/// A mapped block of a read: its pool block, its checksum (of what the pool holds), the data
/// key its layer is encrypted with (to decrypt it), and the key to encrypt it with afterwards
/// (a ciphertext read of a block under another key than the image's own).
#[derive(Clone)]
pub(crate) struct Mapped {
    pub pba: u64,
    pub crc: u32,
    pub key: Option<Arc<DataKey>>,
    pub reseal: Option<Arc<DataKey>>,
}

/// What a resolved read does with encrypted blocks.
#[derive(Clone, Copy)]
enum Keys {
    /// Reads them as the pool holds them (readahead: decrypted when served).
    Stored,
    /// Decrypts them.
    Open,
    /// Reads them as ciphertext under this key, the image's own: a block of a layer under
    /// another key (a data-key rotation under way when a snapshot was taken) is re-encrypted,
    /// so a ciphertext reader gets one key's blocks.
    Under(Option<u64>),
}

/// The pool blocks of resolved reads as runs of consecutive blocks, one request each, in order.
pub(crate) fn media_runs<'a>(blocks: impl IntoIterator<Item = &'a Resolved>) -> Vec<(u64, u64)> {
    pba_runs(blocks.into_iter().flatten().map(|m| m.pba))
}

/// Pool blocks as runs of consecutive blocks, in order.
pub(crate) fn pba_runs(pbas: impl IntoIterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for pba in pbas {
        match runs.last_mut() {
            Some((p, k)) if *p + *k == pba => *k += 1,
            _ => runs.push((pba, 1)),
        }
    }
    runs
}

/// The error for a handle whose volume or snapshot is gone.
pub(crate) fn gone(name: &str) -> Error {
    Error::new(ErrorKind::NotFound, format!("{name:?} was deleted"))
}

/// Fails unless `[offset, offset + len)` lies within `size` bytes.
pub(crate) fn check_within(name: &str, size: u64, offset: u64, len: u64) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(Error::new(
            ErrorKind::OutOfRange,
            format!("volume {name:?}: range {offset}+{len} is past its end ({size} bytes)"),
        ));
    }
    Ok(())
}

/// Resolves every block of `[offset, offset + len)` of `target` (checking the range), pinning
/// the segments it will be read from. `raw`: blocks are read as ciphertext under the image's
/// own key (see [`crate::Volume::ciphertext`]).
pub(crate) fn resolve(
    st: &State,
    target: Target,
    name: &str,
    pins: &mut Pinned<'_>,
    (offset, len): (u64, u64),
    raw: bool,
) -> Result<Vec<Resolved>> {
    let (head, size) = st.head_of(target).ok_or_else(|| gone(name))?;
    check_within(name, size, offset, len)?;
    if raw {
        return resolve_from(st, head, name, pins, offset, len, Keys::Under(st.layers.key_of(head)));
    }
    // A locked image reads nothing, not even its holes.
    crate::keys::open(&st.keys, st.layers.key_of(head), name)?;
    resolve_from(st, head, name, pins, offset, len, Keys::Open)
}

/// As [`resolve`] for a readahead window: clipped to the end of `target`.
pub(crate) fn resolve_ahead(
    st: &State,
    target: Target,
    name: &str,
    pins: &mut Pinned<'_>,
    offset: u64,
    len: u64,
) -> Result<Vec<Resolved>> {
    let (head, size) = st.head_of(target).ok_or_else(|| gone(name))?;
    resolve_from(st, head, name, pins, offset.min(size), len.min(size.saturating_sub(offset)), Keys::Stored)
}

/// Resolves `[offset, offset + len)` (within bounds) through the chain from layer `head`.
fn resolve_from(
    st: &State,
    head: u64,
    name: &str,
    pins: &mut Pinned<'_>,
    offset: u64,
    len: u64,
    keys: Keys,
) -> Result<Vec<Resolved>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let first = offset / B;
    let last = (offset + len - 1) / B;
    let mut resolved = Vec::with_capacity(usize::try_from(last - first + 1).expect("read fits memory"));
    for run in st.layers.resolve(head, first, last - first + 1) {
        let Some(start) = run.pba else {
            resolved.extend(std::iter::repeat_n(None, usize::try_from(run.blocks).expect("fits")));
            continue;
        };
        let open = |key| crate::keys::open(&st.keys, key, name);
        let layer_key = st.layers.key_of(run.layer);
        let (key, reseal) = match keys {
            Keys::Stored => (None, None),
            Keys::Open => (open(layer_key)?, None),
            Keys::Under(own) if own == layer_key => (None, None),
            Keys::Under(own) => (open(layer_key)?, open(own)?),
        };
        for pba in start..start + run.blocks {
            let crc = st.segs.crc(pba).ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!("{name:?}: no checksum for pool block {pba} (offset {})", (run.lba + pba - start) * B),
                )
            })?;
            pins.pin(st.segs.locate(pba).0);
            resolved.push(Some(Mapped { pba, crc, key: key.clone(), reseal: reseal.clone() }));
        }
    }
    Ok(resolved)
}

/// The error for a store read of `len` bytes at `offset` of `name` that failed with `e`.
pub(crate) fn media_error(name: &str, offset: u64, len: usize, e: &std::io::Error) -> Error {
    let e = e
        .raw_os_error()
        .map_or_else(|| std::io::Error::new(e.kind(), e.to_string()), std::io::Error::from_raw_os_error);
    Error::io(format!("volume {name:?}: reading {len} bytes at offset {offset}"), e)
}

/// Copies the resolved blocks of a read into `buf` (zeros for holes) from `media`, whose blocks
/// from the given slot on are the mapped ones in order, verifying each checksum and decrypting
/// the blocks of encrypted layers; appends the range's allocation to `alloc` as runs of
/// (bytes, mapped).
pub(crate) fn fill(
    name: &str,
    offset: u64,
    buf: &mut [u8],
    resolved: &[Resolved],
    media: Option<(&Media, usize)>,
    alloc: &mut Vec<(u64, bool)>,
) -> Result<()> {
    let first = offset / B;
    let mut slot = 0;
    for (i, r) in resolved.iter().enumerate() {
        let block_start = (first + i as u64) * B;
        let lo = offset.max(block_start);
        let hi = (offset + buf.len() as u64).min(block_start + B);
        let dst = &mut buf[usize::try_from(lo - offset).expect("fits")..usize::try_from(hi - offset).expect("fits")];
        match alloc.last_mut() {
            Some((n, mapped)) if *mapped == r.is_some() => *n += hi - lo,
            _ => alloc.push((hi - lo, r.is_some())),
        }
        match r {
            None => dst.fill(0),
            Some(Mapped { pba, crc, key, reseal }) => {
                let (media, first) = media.expect("a read with mapped blocks has their media");
                let src = media.block(first + slot);
                if block_crc(src) != *crc {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!("volume {name:?}: checksum mismatch at offset {block_start} (pool block {pba})"),
                    ));
                }
                let from = usize::try_from(lo - block_start).expect("fits");
                let crypt = |b: &mut [u8]| {
                    if let Some(k) = key {
                        k.decrypt(block_start / B, b);
                    }
                    if let Some(k) = reseal {
                        k.encrypt(block_start / B, b);
                    }
                };
                if key.is_none() && reseal.is_none() {
                    dst.copy_from_slice(&src[from..from + dst.len()]);
                } else if dst.len() == BLOCK {
                    dst.copy_from_slice(src);
                    crypt(dst);
                } else {
                    let mut whole = [0u8; BLOCK];
                    whole.copy_from_slice(src);
                    crypt(&mut whole);
                    dst.copy_from_slice(&whole[from..from + dst.len()]);
                }
                slot += 1;
            }
        }
    }
    Ok(())
}
