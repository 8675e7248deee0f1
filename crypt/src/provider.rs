//! Where key-encryption keys come from. A provider hands out the KEK a volume's wrapped key
//! names; a volume whose KEK is not available stays closed, and nothing else is affected.
//!
//! - [`KeyFiles`]: a directory of key files for the standalone daemon (`<id>.key`, 32 random
//!   bytes or 64 hex digits), refused unless private to their owner (mode 0600 or 0400).
//!
//! The key a CSI request carries in its secrets (a Kubernetes Secret, 64 hex digits: `openssl
//! rand -hex 32`, read with [`parse_hex`]) reaches the daemon in the request itself, which opens
//! the volume with it without storing it (the "request" provider in status).

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

use crate::envelope::Kek;
use crate::{Error, Result};

/// A source of key-encryption keys, by id.
pub trait KeyProvider: Send + Sync + std::fmt::Debug {
    /// What status shows as the provider ("file").
    fn kind(&self) -> &'static str;
    /// The KEK called `id`.
    fn kek(&self, id: &str) -> Result<Kek>;
}

/// Key ids as file names: letters, digits, `.`, `_`, `-`, at most 128, not starting with `.`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// 32 key bytes from `text`: exactly 64 hex digits (surrounding whitespace ignored).
pub fn parse_hex(text: &str) -> Option<Zeroizing<[u8; 32]>> {
    let t = text.trim().as_bytes();
    if t.len() != 64 {
        return None;
    }
    let mut out = Zeroizing::new([0u8; 32]);
    for (i, pair) in t.chunks(2).enumerate() {
        let hi = char::from(pair[0]).to_digit(16)?;
        let lo = char::from(pair[1]).to_digit(16)?;
        out[i] = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(out)
}

/// Key files in one directory, private to the daemon.
#[derive(Debug, Clone)]
pub struct KeyFiles {
    dir: PathBuf,
}

impl KeyFiles {
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_owned() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> Result<PathBuf> {
        if !valid_id(id) {
            return Err(Error::Unavailable {
                key_id: id.to_owned(),
                why: "a key file id is letters, digits, '.', '_' and '-' (at most 128)".into(),
            });
        }
        Ok(self.dir.join(format!("{id}.key")))
    }

    /// Makes a new random key `id` (mode 0600, in a 0700 directory); refuses to replace one.
    pub fn create(&self, id: &str) -> Result<Kek> {
        let path = self.path(id)?;
        std::fs::create_dir_all(&self.dir)?;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))?;
        let kek = Kek::generate(id)?;
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(|e| {
            Error::Unavailable { key_id: id.to_owned(), why: format!("creating {}: {e}", path.display()) }
        })?;
        let hex: Zeroizing<String> = Zeroizing::new(kek_hex(&kek));
        f.write_all(hex.as_bytes())?;
        f.sync_all()?;
        Ok(kek)
    }
}

/// The KEK's 64 hex digits and a newline, for its file.
fn kek_hex(kek: &Kek) -> String {
    let mut s: String = kek.key_bytes().iter().map(|b| format!("{b:02x}")).collect();
    s.push('\n');
    s
}

impl KeyProvider for KeyFiles {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn kek(&self, id: &str) -> Result<Kek> {
        let path = self.path(id)?;
        let unavailable = |why: String| Error::Unavailable { key_id: id.to_owned(), why };
        let meta = std::fs::metadata(&path).map_err(|e| unavailable(format!("{}: {e}", path.display())))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(unavailable(format!(
                "{} has mode {mode:o}: a key file must be private to the daemon (chmod 600)",
                path.display()
            )));
        }
        let raw = Zeroizing::new(std::fs::read(&path).map_err(|e| unavailable(format!("{}: {e}", path.display())))?);
        let key = match raw.len() {
            32 => Zeroizing::new(<[u8; 32]>::try_from(&raw[..]).expect("32 bytes")),
            _ => std::str::from_utf8(&raw).ok().and_then(parse_hex).ok_or_else(|| {
                unavailable(format!("{} holds neither 32 key bytes nor 64 hex digits", path.display()))
            })?,
        };
        Kek::new(id, *key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DataKey;

    #[test]
    fn key_files_are_private_and_well_formed() {
        let dir = tempfile::tempdir().unwrap();
        let files = KeyFiles::new(&dir.path().join("keys"));
        let made = files.create("pool-1").unwrap();
        let mode = std::fs::metadata(dir.path().join("keys/pool-1.key")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let dmode = std::fs::metadata(dir.path().join("keys")).unwrap().permissions().mode();
        assert_eq!(dmode & 0o777, 0o700);
        assert!(files.create("pool-1").is_err(), "an existing key is never replaced");
        // The file's key is the one made: what one wraps, the other opens.
        let w = made.wrap(&DataKey::generate().unwrap()).unwrap();
        files.kek("pool-1").unwrap().unwrap(&w).unwrap();

        let p = dir.path().join("keys/pool-1.key");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = files.kek("pool-1").unwrap_err().to_string();
        assert!(e.contains("mode 644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
        files.kek("pool-1").unwrap();

        let raw = dir.path().join("keys/raw.key");
        std::fs::write(&raw, [9u8; 32]).unwrap();
        std::fs::set_permissions(&raw, std::fs::Permissions::from_mode(0o600)).unwrap();
        files.kek("raw").unwrap();
        std::fs::write(&raw, "not a key\n").unwrap();
        let e = files.kek("raw").unwrap_err().to_string();
        assert!(e.contains("neither 32 key bytes nor 64 hex digits"), "{e}");
        for bad in ["", "../etc/passwd", ".hidden", "a/b", "missing"] {
            assert!(files.kek(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hex_keys_are_64_digits_of_either_case() {
        let hex = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF\n";
        let k = parse_hex(hex).unwrap();
        assert_eq!((k[0], k[15], k[31]), (0x00, 0xff, 0xff));
        for bad in ["", "00", &"zz".repeat(32), &"7".repeat(63), &"7".repeat(65)] {
            assert!(parse_hex(bad).is_none(), "{bad:?}");
        }
    }
}
