//! AES-256-XTS over 4 KiB blocks, tweaked by each block's logical address in its volume.

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::{Aes256, Block};
use zeroize::Zeroizing;

use crate::Result;

/// The unit of encryption: one volume block.
pub const BLOCK: usize = 4096;

/// A volume's data key (two AES-256 keys, as XTS takes them), ready to use. The key bytes are
/// zeroed when it is dropped; the expanded AES key schedules live inside the ciphers.
pub struct DataKey {
    bytes: Zeroizing<[u8; 64]>,
    /// Encrypts the data (the first half of the key).
    data: Aes256,
    /// Encrypts each block's address into its first tweak (the second half).
    tweak: Aes256,
}

/// AES blocks in one volume block.
const PER_BLOCK: usize = BLOCK / 16;

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(..)")
    }
}

impl DataKey {
    /// A new random key.
    pub fn generate() -> Result<Self> {
        Ok(Self::from_bytes(&crate::random::<64>()?))
    }

    pub fn from_bytes(bytes: &[u8; 64]) -> Self {
        Self {
            bytes: Zeroizing::new(*bytes),
            data: Aes256::new(GenericArray::from_slice(&bytes[..32])),
            tweak: Aes256::new(GenericArray::from_slice(&bytes[32..])),
        }
    }

    /// The raw key, for wrapping only.
    pub(crate) fn bytes(&self) -> &[u8; 64] {
        &self.bytes
    }

    /// Encrypts whole blocks in place; the first is block `first` of the volume.
    ///
    /// # Panics
    /// If `buf` is not a whole number of blocks.
    pub fn encrypt(&self, first: u64, buf: &mut [u8]) {
        self.xts(first, buf, true);
    }

    /// Decrypts whole blocks in place; the first is block `first` of the volume.
    ///
    /// # Panics
    /// If `buf` is not a whole number of blocks.
    pub fn decrypt(&self, first: u64, buf: &mut [u8]) {
        self.xts(first, buf, false);
    }

    /// XTS (IEEE 1619) a volume block at a time: the block's 256 tweaks first (its address
    /// encrypted, then multiplied by x in GF(2^128) per AES block), then all its AES blocks in
    /// one call, which AES-NI pipelines (one block at a time leaves it idle most cycles).
    fn xts(&self, first: u64, buf: &mut [u8], encrypt: bool) {
        assert!(buf.len().is_multiple_of(BLOCK), "XTS works on whole {BLOCK}-byte blocks");
        let mut tweaks = [0u128; PER_BLOCK];
        let mut blocks = [Block::default(); PER_BLOCK];
        for (n, sector) in (first..).zip(buf.chunks_exact_mut(BLOCK)) {
            let mut t = Block::from(u128::from(n).to_le_bytes());
            self.tweak.encrypt_block(&mut t);
            let mut t = u128::from_le_bytes(t.into());
            for tw in &mut tweaks {
                *tw = t;
                // Times x: a shift, and the carry folded back with x^7 + x^2 + x + 1.
                t = (t << 1) ^ if t >> 127 == 1 { 0x87 } else { 0 };
            }
            for ((b, chunk), tw) in blocks.iter_mut().zip(sector.chunks_exact(16)).zip(&tweaks) {
                let v = u128::from_le_bytes(chunk.try_into().expect("16 bytes")) ^ tw;
                *b = Block::from(v.to_le_bytes());
            }
            if encrypt {
                self.data.encrypt_blocks(&mut blocks);
            } else {
                self.data.decrypt_blocks(&mut blocks);
            }
            for ((b, chunk), tw) in blocks.iter().zip(sector.chunks_exact_mut(16)).zip(&tweaks) {
                let v = u128::from_le_bytes((*b).into()) ^ tw;
                chunk.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pattern() -> Vec<u8> {
        (0..BLOCK).map(|i| u8::try_from(i * 7 % 251).unwrap()).collect()
    }

    fn sha256(b: &[u8]) -> String {
        ring::digest::digest(&ring::digest::SHA256, b).as_ref().iter().map(|x| format!("{x:02x}")).collect()
    }

    /// Known answers from an independent implementation (OpenSSL's AES-XTS through Python's
    /// `cryptography`, tweak = the block number as 16 little-endian bytes): the format is
    /// dm-crypt's `aes-xts-plain64` with 4 KiB sectors.
    #[test]
    fn matches_an_independent_implementation() {
        let key: [u8; 64] = std::array::from_fn(|i| u8::try_from(i).unwrap());
        let k = DataKey::from_bytes(&key);
        for (block, head, digest) in [
            (
                0u64,
                "aa9fc37e8223b8caf71e4ac9f8d4916f",
                "85911657806c454a86851cde978725d863064906dfce35f73993ae610b9b429e",
            ),
            (5, "35af686901a5cb6df9c180d99226dfef", "4401ccc647b15b7e479010976610f55408d706b1df55a1d7b7f614f9b55f222c"),
            (
                0x1_0000_0001,
                "240bb932566a698dc12a1e53825a658c",
                "946c19ed9685b48021b1b26e1115ef3390e013d8f9ed5e4966bc254cd6d2f32a",
            ),
        ] {
            let mut b = pattern();
            k.encrypt(block, &mut b);
            let got: String = b[..16].iter().map(|x| format!("{x:02x}")).collect();
            assert_eq!((got.as_str(), sha256(&b).as_str()), (head, digest), "block {block}");
            k.decrypt(block, &mut b);
            assert!(b == pattern());
        }
    }

    #[test]
    fn the_same_data_at_another_address_or_key_differs() {
        let (k1, k2) = (DataKey::generate().unwrap(), DataKey::generate().unwrap());
        let mut a = pattern();
        let mut b = pattern();
        let mut c = pattern();
        k1.encrypt(1, &mut a);
        k1.encrypt(2, &mut b);
        k2.encrypt(1, &mut c);
        assert!(a != b && a != c && a != pattern());
        assert_eq!(format!("{k1:?}"), "DataKey(..)");
    }

    proptest! {
        /// Several blocks at once are the blocks one by one, and decrypt back.
        #[test]
        fn areas_are_blocks_and_round_trip(first in 0u64..1 << 40, blocks in 1usize..5, seed: u8) {
            let k = DataKey::from_bytes(&[seed; 64]);
            let plain: Vec<u8> = (0..blocks * BLOCK).map(|i| u8::try_from(i % 253).unwrap() ^ seed).collect();
            let mut all = plain.clone();
            k.encrypt(first, &mut all);
            for (i, chunk) in plain.chunks(BLOCK).enumerate() {
                let mut one = chunk.to_vec();
                k.encrypt(first + i as u64, &mut one);
                prop_assert!(one[..] == all[i * BLOCK..(i + 1) * BLOCK]);
            }
            k.decrypt(first, &mut all);
            prop_assert!(all == plain);
        }
    }
}
