//! Envelope keys: a volume's data key is stored only sealed (AES-256-GCM, a random nonce) by a
//! key-encryption key (KEK) that lives with a key provider. Rotating the KEK opens the data key
//! with the old one and seals it with the new one: O(1) per volume, no data rewritten.
//!
//! Encoding of a wrapped key: `2` (version), the KEK id's length (one byte) and the id, the
//! data key's 16-byte check value, then the 12-byte nonce, the 64 sealed key bytes and the
//! 16-byte tag. Version, id and check value are the additional data, so a wrapped key cannot be
//! passed off as sealed by another KEK or as another data key's. Version 1 (no check value) is
//! still read.
//!
//! The check value (a hash of the data key under a label of its own, which reveals nothing of
//! it) tells without any key whether two wrappings seal the same data key: a replica keeps a
//! rewrapped key's entry, and gives a new data key (after a rotation at its source) its own.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use zeroize::Zeroizing;

use crate::xts::DataKey;
use crate::{Error, Result};

const VERSION: u8 = 2;
const NONCE: usize = 12;
const CHECK: usize = 16;
const TAG: usize = 16;
const SEALED: usize = NONCE + 64 + TAG;

/// A key-encryption key and its id (what a volume records: which key opens it).
#[derive(Clone)]
pub struct Kek {
    id: String,
    key: Zeroizing<[u8; 32]>,
}

impl std::fmt::Debug for Kek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kek").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Kek {
    /// `id`: at most 255 bytes, as wrapped keys record it.
    pub fn new(id: &str, key: [u8; 32]) -> Result<Self> {
        if id.is_empty() || id.len() > 255 {
            return Err(Error::Malformed(format!("a key id is 1 to 255 bytes, not {}", id.len())));
        }
        Ok(Self { id: id.to_owned(), key: Zeroizing::new(key) })
    }

    pub fn generate(id: &str) -> Result<Self> {
        Self::new(id, crate::random::<32>()?)
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The same key under another id: a key a request carries opens whatever its volume
    /// records it as (the id only names the key).
    pub fn with_id(&self, id: &str) -> Result<Self> {
        Self::new(id, *self.key)
    }

    /// The key itself, for a provider that stores or copies it.
    pub(crate) fn key_bytes(&self) -> &[u8; 32] {
        &self.key
    }

    fn aead(&self) -> LessSafeKey {
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, self.key.as_ref()).expect("32-byte key"))
    }

    fn aad(id: &str, check: Option<&[u8; CHECK]>) -> Vec<u8> {
        let mut a = vec![if check.is_some() { VERSION } else { 1 }];
        a.extend_from_slice(id.as_bytes());
        a.extend_from_slice(check.map_or(&[][..], |c| &c[..]));
        a
    }

    /// Seals `key` under this KEK.
    pub fn wrap(&self, key: &DataKey) -> Result<WrappedKey> {
        let nonce = crate::random::<NONCE>()?;
        let check = check_value(key);
        let mut sealed = Zeroizing::new(key.bytes().to_vec());
        let tag = self
            .aead()
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(Self::aad(&self.id, Some(&check))),
                &mut sealed,
            )
            .map_err(|_| Error::Malformed("sealing failed".into()))?;
        let mut out = Vec::with_capacity(SEALED);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out.extend_from_slice(tag.as_ref());
        Ok(WrappedKey { key_id: self.id.clone(), check: Some(check), sealed: out })
    }

    /// Opens `w` with this KEK: [`Error::WrongKey`] if it was sealed by another key (or changed).
    pub fn unwrap(&self, w: &WrappedKey) -> Result<DataKey> {
        let wrong = || Error::WrongKey { key_id: self.id.clone() };
        if w.key_id != self.id {
            return Err(wrong());
        }
        let (nonce, body) = w.sealed.split_at(NONCE);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| wrong())?;
        let mut body = Zeroizing::new(body.to_vec());
        let aad = Aad::from(Self::aad(&self.id, w.check.as_ref()));
        let plain = self.aead().open_in_place(nonce, aad, &mut body).map_err(|_| wrong())?;
        let bytes: Zeroizing<[u8; 64]> = Zeroizing::new(plain.try_into().map_err(|_| wrong())?);
        let key = DataKey::from_bytes(&bytes);
        if w.check.is_some_and(|c| c != check_value(&key)) {
            return Err(wrong());
        }
        Ok(key)
    }
}

/// A data key as stored: sealed, with the id of the KEK that opens it.
#[derive(Clone, PartialEq, Eq)]
pub struct WrappedKey {
    pub key_id: String,
    /// The sealed data key's check value (None: a version 1 wrapping, which has none).
    check: Option<[u8; CHECK]>,
    sealed: Vec<u8>,
}

/// What identifies a data key without revealing it: SHA-256 of a label and the key, cut to 16
/// bytes.
fn check_value(key: &DataKey) -> [u8; CHECK] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"ferrite data key check value\0");
    ctx.update(key.bytes());
    ctx.finish().as_ref()[..CHECK].try_into().expect("a SHA-256 digest is 32 bytes")
}

impl std::fmt::Debug for WrappedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WrappedKey").field("key_id", &self.key_id).finish_non_exhaustive()
    }
}

impl WrappedKey {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + self.key_id.len() + CHECK + SEALED);
        out.push(if self.check.is_some() { VERSION } else { 1 });
        out.push(u8::try_from(self.key_id.len()).expect("ids are at most 255 bytes"));
        out.extend_from_slice(self.key_id.as_bytes());
        out.extend_from_slice(self.check.as_ref().map_or(&[][..], |c| &c[..]));
        out.extend_from_slice(&self.sealed);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let bad = |why: &str| Error::Malformed(why.to_owned());
        let (&version, rest) = b.split_first().ok_or_else(|| bad("empty"))?;
        let check_len = match version {
            1 => 0,
            VERSION => CHECK,
            v => return Err(bad(&format!("version {v}, this build reads 1 and {VERSION}"))),
        };
        let (&len, rest) = rest.split_first().ok_or_else(|| bad("no key id"))?;
        let len = usize::from(len);
        let want = len + check_len + SEALED;
        if len == 0 || rest.len() != want {
            return Err(bad(&format!("{} bytes where a key id of {len} needs {}", b.len(), 2 + want)));
        }
        let key_id = std::str::from_utf8(&rest[..len]).map_err(|_| bad("the key id is not UTF-8"))?.to_owned();
        let (check, sealed) = rest[len..].split_at(check_len);
        Ok(Self { key_id, check: check.try_into().ok(), sealed: sealed.to_vec() })
    }

    /// Whether `self` and `other` seal the same data key (rewrappings of it), as far as their
    /// check values tell; None if either is a version 1 wrapping, which has none.
    pub fn same_key(&self, other: &WrappedKey) -> Option<bool> {
        Some(self.check? == other.check?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BLOCK;

    #[test]
    fn wraps_rewraps_and_refuses_the_wrong_key() {
        let (old, new) = (Kek::generate("k1").unwrap(), Kek::generate("k2").unwrap());
        let data = DataKey::generate().unwrap();
        let mut block = vec![7u8; BLOCK];
        data.encrypt(9, &mut block);
        let w = WrappedKey::decode(&old.wrap(&data).unwrap().encode()).unwrap();
        assert_eq!(w.key_id, "k1");
        // Rotation: open with the old KEK, seal with the new; the data key is the same.
        let rotated = new.wrap(&old.unwrap(&w).unwrap()).unwrap();
        let opened = new.unwrap(&rotated).unwrap();
        opened.decrypt(9, &mut block);
        assert!(block.iter().all(|&b| b == 7));
        // Another KEK, even under the right id, does not open it.
        assert!(matches!(new.unwrap(&w), Err(Error::WrongKey { .. })));
        let impostor = Kek::generate("k1").unwrap();
        assert!(matches!(impostor.unwrap(&w), Err(Error::WrongKey { .. })));
        // Rewrappings are of the same data key, another key's wrapping is not.
        assert_eq!(rotated.same_key(&w), Some(true));
        assert_eq!(old.wrap(&DataKey::generate().unwrap()).unwrap().same_key(&w), Some(false));
        // Key material never shows.
        assert_eq!(format!("{old:?} {w:?}"), r#"Kek { id: "k1", .. } WrappedKey { key_id: "k1", .. }"#);
    }

    #[test]
    fn every_corruption_is_refused() {
        let kek = Kek::generate("vault:data").unwrap();
        let enc = kek.wrap(&DataKey::generate().unwrap()).unwrap().encode();
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 0x40;
            match WrappedKey::decode(&bad) {
                Ok(w) => assert!(kek.unwrap(&w).is_err(), "a flip at byte {i} still opened"),
                Err(Error::Malformed(_)) => {}
                Err(e) => panic!("byte {i}: {e}"),
            }
        }
        assert!(matches!(WrappedKey::decode(&enc[..enc.len() - 1]), Err(Error::Malformed(_))));
        assert!(matches!(WrappedKey::decode(&[]), Err(Error::Malformed(_))));
        assert!(Kek::new("", [0; 32]).is_err() && Kek::new(&"x".repeat(256), [0; 32]).is_err());
    }

    #[test]
    fn a_version_1_wrapping_still_opens_and_has_no_check_value() {
        let kek = Kek::generate("k").unwrap();
        let data = DataKey::generate().unwrap();
        // Sealed as version 1 did: no check value, version 1 in the additional data.
        let nonce = [3u8; NONCE];
        let mut sealed = data.bytes().to_vec();
        let tag = kek
            .aead()
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(Kek::aad("k", None)),
                &mut sealed,
            )
            .unwrap();
        let mut enc = vec![1, 1, b'k'];
        enc.extend_from_slice(&nonce);
        enc.extend_from_slice(&sealed);
        enc.extend_from_slice(tag.as_ref());
        let w = WrappedKey::decode(&enc).unwrap();
        assert_eq!(w.encode(), enc);
        assert_eq!(kek.unwrap(&w).unwrap().bytes(), data.bytes());
        assert_eq!(w.same_key(&kek.wrap(&data).unwrap()), None);
    }
}
