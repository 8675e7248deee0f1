//! Envelope keys: a volume's data key is stored only sealed (AES-256-GCM, a random nonce) by a
//! key-encryption key (KEK) that lives with a key provider. Rotating the KEK opens the data key
//! with the old one and seals it with the new one: O(1) per volume, no data rewritten.
//!
//! Encoding of a wrapped key: `1` (version), the KEK id's length (one byte) and the id, then the
//! 12-byte nonce, the 64 sealed key bytes and the 16-byte tag. The id and the version are the
//! additional data, so a wrapped key cannot be passed off as sealed by another KEK.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use zeroize::Zeroizing;

use crate::xts::DataKey;
use crate::{Error, Result};

const VERSION: u8 = 1;
const NONCE: usize = 12;
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

    fn aad(id: &str) -> Vec<u8> {
        let mut a = vec![VERSION];
        a.extend_from_slice(id.as_bytes());
        a
    }

    /// Seals `key` under this KEK.
    pub fn wrap(&self, key: &DataKey) -> Result<WrappedKey> {
        let nonce = crate::random::<NONCE>()?;
        let mut sealed = Zeroizing::new(key.bytes().to_vec());
        let tag = self
            .aead()
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(Self::aad(&self.id)),
                &mut sealed,
            )
            .map_err(|_| Error::Malformed("sealing failed".into()))?;
        let mut out = Vec::with_capacity(SEALED);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out.extend_from_slice(tag.as_ref());
        Ok(WrappedKey { key_id: self.id.clone(), sealed: out })
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
        let plain = self.aead().open_in_place(nonce, Aad::from(Self::aad(&self.id)), &mut body).map_err(|_| wrong())?;
        let bytes: Zeroizing<[u8; 64]> = Zeroizing::new(plain.try_into().map_err(|_| wrong())?);
        Ok(DataKey::from_bytes(&bytes))
    }
}

/// A data key as stored: sealed, with the id of the KEK that opens it.
#[derive(Clone, PartialEq, Eq)]
pub struct WrappedKey {
    pub key_id: String,
    sealed: Vec<u8>,
}

impl std::fmt::Debug for WrappedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WrappedKey").field("key_id", &self.key_id).finish_non_exhaustive()
    }
}

impl WrappedKey {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + self.key_id.len() + SEALED);
        out.push(VERSION);
        out.push(u8::try_from(self.key_id.len()).expect("ids are at most 255 bytes"));
        out.extend_from_slice(self.key_id.as_bytes());
        out.extend_from_slice(&self.sealed);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let bad = |why: &str| Error::Malformed(why.to_owned());
        let (&version, rest) = b.split_first().ok_or_else(|| bad("empty"))?;
        if version != VERSION {
            return Err(bad(&format!("version {version}, this build reads {VERSION}")));
        }
        let (&len, rest) = rest.split_first().ok_or_else(|| bad("no key id"))?;
        let len = usize::from(len);
        if len == 0 || rest.len() != len + SEALED {
            return Err(bad(&format!("{} bytes where a key id of {len} needs {}", b.len(), 2 + len + SEALED)));
        }
        let key_id = std::str::from_utf8(&rest[..len]).map_err(|_| bad("the key id is not UTF-8"))?.to_owned();
        Ok(Self { key_id, sealed: rest[len..].to_vec() })
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
}
