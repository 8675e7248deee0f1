//! Encryption at rest for Ferrite volumes.
//!
//! - [`xts`]: a volume's blocks under AES-256-XTS (IEEE 1619, over the `aes` crate's batched calls), each 4 KiB block's tweak its logical block
//!   address in the volume (dm-crypt's `aes-xts-plain64` with 4 KiB sectors), so a block moved in
//!   the log is never re-encrypted and a clone reads its parent's blocks at the same addresses.
//! - [`envelope`]: each volume's random data key is stored only wrapped (AES-256-GCM) by a
//!   key-encryption key; rotating that key rewraps the data key and rewrites nothing else.
//! - [`provider`]: where key-encryption keys come from: key files private to the daemon, or the
//!   secrets of a CSI request; one trait, so a KMS can follow.
//!
//! Nothing here logs or formats key material: keys are zeroed on drop and their `Debug` shows
//! only their id.

pub mod envelope;
pub mod provider;
pub mod xts;

pub use envelope::{Kek, WrappedKey};
pub use provider::{KeyFiles, KeyProvider};
pub use xts::{BLOCK, DataKey};

/// What can go wrong with keys. Messages name keys by id, never by content.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The key-encryption key does not open the wrapped key: a wrong key, or a wrapped key that
    /// was changed.
    #[error("key {key_id:?} does not open this volume's data key (a wrong key, or a corrupted wrapped key)")]
    WrongKey { key_id: String },
    #[error("wrapped data key is malformed: {0}")]
    Malformed(String),
    #[error("key {key_id:?} is not available: {why}")]
    Unavailable { key_id: String, why: String },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the system random number generator failed")]
    Random,
}

pub type Result<T> = std::result::Result<T, Error>;

/// `n` random bytes from the operating system.
fn random<const N: usize>() -> Result<[u8; N]> {
    use ring::rand::SecureRandom;
    let mut b = [0u8; N];
    ring::rand::SystemRandom::new().fill(&mut b).map_err(|_| Error::Random)?;
    Ok(b)
}
