//! The envelope every object but the marker travels in, and the chunk names.
//!
//! `FRBK`, format version, kind, flags (zstd, sealed), then the body; sealed bodies are
//! AES-256-GCM with a random nonce after the flags, and the header plus the object's name as
//! associated data, so a chunk, manifest or index moved to another name does not open. From
//! format 2 the name of every object but a chunk includes the target's prefix: a store cannot
//! serve one cluster's index or manifest as another's under a shared key. A chunk's name is
//! its contents' keyed hash, the same under any prefix, and its sealed bytes travel between
//! targets of one key as they are (`copy.rs`). Format 1 objects (unbound) are still read.

use ring::{aead, hkdf, hmac, rand::SecureRandom};

use crate::{Error, Result};

const MAGIC: &[u8; 4] = b"FRBK";
/// The newest envelope format this build writes and reads.
pub const FORMAT: u8 = 2;
const HEADER: usize = 7;
const ZSTD: u8 = 1;
const SEALED: u8 = 2;
/// zstd level 1: ~0.5-1 GB/s a core, and incompressible data passes through at memory speed.
const LEVEL: i32 = 1;
const SALT: &[u8] = b"ferrite backup v1";

/// What an object holds (part of the authenticated header: an index cannot pass for a chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Chunk = 1,
    Manifest = 2,
    Index = 3,
    Condemned = 4,
    Quarantined = 5,
}

/// Most bytes the envelope of `plain` bytes of plaintext may have (it is compressed only when
/// that makes it smaller).
pub fn max_envelope(plain: usize) -> u64 {
    (plain + HEADER + aead::NONCE_LEN + aead::MAX_TAG_LEN) as u64
}

/// Names chunks and seals objects with one target's keys.
pub struct Codec {
    target: String,
    /// The target's prefix, bound into the seal of every object but a chunk (format 2).
    prefix: String,
    id_key: hmac::Key,
    seal: Option<aead::LessSafeKey>,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec").field("target", &self.target).field("sealed", &self.seal.is_some()).finish()
    }
}

impl Codec {
    /// With a target key, both the chunk-naming key and the sealing key derive from it (HKDF);
    /// without, chunks are named under a fixed key (a plain content hash: the store holds the
    /// plaintext anyway) and nothing is sealed. Nothing random: two daemons that open a new
    /// target at once agree on every name. `prefix` is the target's in its store.
    pub fn new(target: &str, prefix: &str, key: Option<&[u8; 32]>) -> Codec {
        let salt = SALT;
        let derive = |key: &[u8; 32], info: &[u8]| {
            let mut out = [0u8; 32];
            hkdf::Salt::new(hkdf::HKDF_SHA256, salt)
                .extract(key)
                .expand(&[info], hkdf::HKDF_SHA256)
                .and_then(|okm| okm.fill(&mut out))
                .expect("32 bytes is a valid HKDF-SHA256 output length");
            out
        };
        let (id_key, seal) = match key {
            Some(key) => {
                let seal = aead::UnboundKey::new(&aead::AES_256_GCM, &derive(key, b"ferrite backup seal"))
                    .expect("32 bytes is an AES-256 key");
                (
                    hmac::Key::new(hmac::HMAC_SHA256, &derive(key, b"ferrite backup chunk id")),
                    Some(aead::LessSafeKey::new(seal)),
                )
            }
            None => (hmac::Key::new(hmac::HMAC_SHA256, salt), None),
        };
        Codec { target: target.to_owned(), prefix: prefix.to_owned(), id_key, seal }
    }

    /// The associated data of an object of `kind` at `name` whose header is `header`.
    fn aad(&self, header: &[u8], kind: Kind, name: &str) -> Vec<u8> {
        let bound = header[4] >= 2 && kind != Kind::Chunk;
        let prefix = if bound { self.prefix.as_bytes() } else { &[] };
        let cut: &[u8] = if bound { b"\0" } else { &[] };
        [header, prefix, cut, name.as_bytes()].concat()
    }

    pub fn is_sealed(&self) -> bool {
        self.seal.is_some()
    }

    /// A chunk's name: HMAC-SHA256 of its plaintext, in hex.
    pub fn chunk_id(&self, plain: &[u8]) -> String {
        hex(hmac::sign(&self.id_key, plain).as_ref())
    }

    /// What the marker stores to tell a right key from a wrong one.
    pub fn key_check(&self) -> String {
        self.chunk_id(b"ferrite backup key check")
    }

    /// The envelope of `plain`, stored under `name`.
    pub fn seal(&self, kind: Kind, name: &str, plain: &[u8]) -> Vec<u8> {
        self.seal_as(FORMAT, kind, name, plain)
    }

    /// The same in envelope format `format`.
    fn seal_as(&self, format: u8, kind: Kind, name: &str, plain: &[u8]) -> Vec<u8> {
        let packed = worth_packing(plain)
            .then(|| zstd::bulk::compress(plain, LEVEL).ok())
            .flatten()
            .filter(|c| c.len() < plain.len());
        let flags = if packed.is_some() { ZSTD } else { 0 } | if self.seal.is_some() { SEALED } else { 0 };
        let body = packed.as_deref().unwrap_or(plain);
        let mut out = Vec::with_capacity(HEADER + aead::NONCE_LEN + body.len() + aead::MAX_TAG_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[format, kind as u8, flags]);
        let Some(key) = &self.seal else {
            out.extend_from_slice(body);
            return out;
        };
        let mut nonce = [0u8; aead::NONCE_LEN];
        ring::rand::SystemRandom::new().fill(&mut nonce).expect("the system RNG works");
        let aad = self.aad(&out[..HEADER], kind, name);
        out.extend_from_slice(&nonce);
        let start = out.len();
        out.extend_from_slice(body);
        let tag = key
            .seal_in_place_separate_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(&aad),
                &mut out[start..],
            )
            .expect("AES-GCM seals any length we store");
        out.extend_from_slice(tag.as_ref());
        out
    }

    /// The plaintext of an envelope read from `name`: checks the header, opens the seal,
    /// decompresses (at most `max` bytes).
    pub fn open(&self, kind: Kind, name: &str, mut data: Vec<u8>, max: usize) -> Result<Vec<u8>> {
        let corrupt = |why: &str| Error::corrupt(&self.target, name, why);
        if data.len() < HEADER || &data[..4] != MAGIC {
            return Err(corrupt("not a Ferrite backup object"));
        }
        if data[4] > FORMAT {
            return Err(Error::Newer {
                target: self.target.clone(),
                what: name.to_owned(),
                found: data[4].into(),
                supported: FORMAT.into(),
            });
        }
        if data[5] != kind as u8 {
            return Err(corrupt("holds another kind of object"));
        }
        let flags = data[6];
        let body = match (&self.seal, flags & SEALED != 0) {
            (Some(key), true) => {
                if data.len() < HEADER + aead::NONCE_LEN + aead::MAX_TAG_LEN {
                    return Err(corrupt("truncated"));
                }
                let aad = self.aad(&data[..HEADER], kind, name);
                let nonce =
                    aead::Nonce::try_assume_unique_for_key(&data[HEADER..HEADER + aead::NONCE_LEN]).expect("12 bytes");
                let sealed = &mut data[HEADER + aead::NONCE_LEN..];
                let plain = key.open_in_place(nonce, aead::Aad::from(&aad), sealed).map_err(|_| {
                    corrupt("its seal does not open (damaged, or not written under this name with this key)")
                })?;
                plain.to_vec()
            }
            (None, true) => {
                return Err(Error::Key {
                    target: self.target.clone(),
                    msg: format!("{name} is encrypted: configure the target's key"),
                });
            }
            (Some(_), false) => return Err(corrupt("is not sealed, and this target's objects all are")),
            (None, false) => data.split_off(HEADER),
        };
        if flags & ZSTD == 0 {
            return Ok(body);
        }
        zstd::bulk::decompress(&body, max).map_err(|e| corrupt(&format!("does not decompress: {e}")))
    }
}

/// Whether zstd is worth running on `plain`: a 64 KiB sample of a large chunk must shrink by 3%
/// (incompressible data, already compressed or encrypted, then costs no CPU: the bench's full
/// backup shares two cores with the store).
fn worth_packing(plain: &[u8]) -> bool {
    const SAMPLE: usize = 64 << 10;
    if plain.len() <= 4 * SAMPLE {
        return true;
    }
    let at = plain.len() / 2;
    let sample = &plain[at..at + SAMPLE];
    zstd::bulk::compress(sample, LEVEL).is_ok_and(|c| c.len() < SAMPLE - SAMPLE / 32)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// Random bytes from the system RNG.
pub fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    ring::rand::SystemRandom::new().fill(&mut out).expect("the system RNG works");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_plain_and_sealed() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        for key in [None, Some([7u8; 32])] {
            let c = Codec::new("t", "p", key.as_ref());
            let env = c.seal(Kind::Chunk, "chunks/ab/x", &data);
            assert!(env.len() < data.len(), "compressible data is compressed");
            assert_eq!(c.open(Kind::Chunk, "chunks/ab/x", env, data.len()).unwrap(), data);
        }
    }

    #[test]
    fn refuses_what_it_must() {
        let sealed = Codec::new("t", "p", Some(&[1; 32]));
        let env = sealed.seal(Kind::Manifest, "m", b"hello");
        // Another name, another kind, another key, a flipped bit, no key, a newer format.
        assert!(matches!(sealed.open(Kind::Manifest, "n", env.clone(), 99), Err(Error::Corrupt { .. })));
        assert!(matches!(sealed.open(Kind::Index, "m", env.clone(), 99), Err(Error::Corrupt { .. })));
        let other = Codec::new("t", "p", Some(&[2; 32]));
        assert!(matches!(other.open(Kind::Manifest, "m", env.clone(), 99), Err(Error::Corrupt { .. })));
        let mut flipped = env.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(sealed.open(Kind::Manifest, "m", flipped, 99), Err(Error::Corrupt { .. })));
        let plain = Codec::new("t", "p", None);
        assert!(matches!(plain.open(Kind::Manifest, "m", env.clone(), 99), Err(Error::Key { .. })));
        let mut newer = env;
        newer[4] = FORMAT + 1;
        let e = sealed.open(Kind::Manifest, "m", newer, 99).unwrap_err();
        assert!(e.to_string().contains("upgrade"), "{e}");
    }

    /// A manifest, index or list sealed under one prefix does not open under another; a chunk
    /// does (its name is its contents'); an object of format 1 opens unbound.
    #[test]
    fn the_prefix_is_sealed_but_for_chunks() {
        let (a, b) = (Codec::new("t", "cluster-a", Some(&[1; 32])), Codec::new("t", "cluster-b", Some(&[1; 32])));
        let index = a.seal(Kind::Index, "volumes/db/index", b"{}");
        assert!(matches!(b.open(Kind::Index, "volumes/db/index", index.clone(), 99), Err(Error::Corrupt { .. })));
        assert_eq!(a.open(Kind::Index, "volumes/db/index", index, 99).unwrap(), b"{}");
        let chunk = a.seal(Kind::Chunk, "chunks/ab/x", b"data");
        assert_eq!(b.open(Kind::Chunk, "chunks/ab/x", chunk, 99).unwrap(), b"data");
        // Format 1, as an earlier build sealed it: the name alone.
        let old = b.seal_as(1, Kind::Index, "volumes/db/index", b"{}");
        assert_eq!(a.open(Kind::Index, "volumes/db/index", old, 99).unwrap(), b"{}");
    }

    #[test]
    fn names_depend_on_the_key() {
        let a = Codec::new("t", "p", Some(&[1; 32]));
        let b = Codec::new("t", "p", Some(&[2; 32]));
        assert_eq!(a.chunk_id(b"x"), a.chunk_id(b"x"));
        assert_ne!(a.chunk_id(b"x"), b.chunk_id(b"x"));
        assert_eq!(a.chunk_id(b"x").len(), 64);
        assert_eq!(unhex(&hex(&[0, 255, 16])).unwrap(), vec![0, 255, 16]);
    }
}
