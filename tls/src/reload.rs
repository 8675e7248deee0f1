//! TLS configs that follow their files: a certificate rotated on disk (a Kubernetes Secret
//! updated, cert-manager renewing, `ferrite certs` run again) is used by the next handshake,
//! without a restart. Each `current()` call looks at the files' metadata at most once a second
//! and rebuilds the config when one changed (Kubernetes swaps a Secret's files through a
//! symlink, so the inode changes even where the time would not). A change that does not load (a
//! rotation caught half written, a key that does not match its certificate) keeps the config in
//! use and logs why; the next change is tried again.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::{ClientConfig, ServerConfig};

/// How often the files are looked at.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What identifies a file's content without reading it.
type Stamp = Option<(u64, u64, i64, i64, u64)>;

fn stamp(path: &Path) -> Stamp {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.len()))
}

type Build<T> = Box<dyn Fn() -> io::Result<Arc<T>> + Send + Sync>;

struct State<T> {
    checked: Instant,
    stamps: Vec<Stamp>,
    config: Arc<T>,
}

/// A config built from files, rebuilt when they change.
pub struct Reloading<T> {
    files: Vec<PathBuf>,
    build: Build<T>,
    state: Mutex<State<T>>,
}

impl<T> std::fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading").field("files", &self.files).finish_non_exhaustive()
    }
}

impl<T> Reloading<T> {
    /// Builds the config once (an error here is the caller's to report) and keeps the files'
    /// stamps.
    pub fn new(files: Vec<PathBuf>, build: Build<T>) -> io::Result<Self> {
        let stamps = files.iter().map(|f| stamp(f)).collect();
        let config = build()?;
        Ok(Self { files, build, state: Mutex::new(State { checked: Instant::now(), stamps, config }) })
    }

    /// The config for the next connection.
    pub fn current(&self) -> Arc<T> {
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if st.checked.elapsed() >= CHECK_EVERY {
            st.checked = Instant::now();
            let stamps: Vec<Stamp> = self.files.iter().map(|f| stamp(f)).collect();
            if stamps != st.stamps {
                match (self.build)() {
                    Ok(c) => {
                        st.config = c;
                        st.stamps = stamps;
                        tracing::info!(files = ?self.files, "TLS files changed: reloaded");
                    }
                    // Stamps are kept as they were, so the next look tries again.
                    Err(e) => {
                        tracing::warn!(files = ?self.files, "TLS files changed but do not load; keeping the previous ones: {e}")
                    }
                }
            }
        }
        Arc::clone(&st.config)
    }
}

/// [`crate::server_config`], following its files.
pub fn server(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> io::Result<Reloading<ServerConfig>> {
    let (c, k, ca) = (cert.to_path_buf(), key.to_path_buf(), client_ca.map(Path::to_path_buf));
    let alpn: Vec<Vec<u8>> = alpn.iter().map(|p| p.to_vec()).collect();
    let files = [Some(c.clone()), Some(k.clone()), ca.clone()].into_iter().flatten().collect();
    Reloading::new(
        files,
        Box::new(move || {
            let alpn: Vec<&[u8]> = alpn.iter().map(Vec::as_slice).collect();
            crate::server_config(&c, &k, ca.as_deref(), &alpn)
        }),
    )
}

/// [`crate::client_config`], following its files.
pub fn client(ca: &Path, identity: Option<(&Path, &Path)>, alpn: &[&[u8]]) -> io::Result<Reloading<ClientConfig>> {
    let ca = ca.to_path_buf();
    let id = identity.map(|(c, k)| (c.to_path_buf(), k.to_path_buf()));
    let alpn: Vec<Vec<u8>> = alpn.iter().map(|p| p.to_vec()).collect();
    let files = std::iter::once(ca.clone()).chain(id.iter().flat_map(|(c, k)| [c.clone(), k.clone()])).collect();
    Reloading::new(
        files,
        Box::new(move || {
            let alpn: Vec<&[u8]> = alpn.iter().map(Vec::as_slice).collect();
            crate::client_config(&ca, id.as_ref().map(|(c, k)| (c.as_path(), k.as_path())), &alpn)
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs;

    #[test]
    fn follows_a_rotation_and_keeps_the_old_config_over_a_broken_one() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ca = certs::new_ca(2).unwrap();
        std::fs::write(d.join("ca.pem"), &ca.cert_pem).unwrap();
        let issue = |name: &str| {
            let s = certs::issue(&ca.key_pem, name, &[name.to_owned()], 2).unwrap();
            std::fs::write(d.join("s.pem"), s.cert_pem).unwrap();
            std::fs::write(d.join("s-key.pem"), s.key_pem).unwrap();
        };
        issue("first.example");
        let r = server(&d.join("s.pem"), &d.join("s-key.pem"), Some(&d.join("ca.pem")), &[]).unwrap();
        let first = r.current();
        assert!(Arc::ptr_eq(&first, &r.current()), "nothing changed: the same config");

        std::thread::sleep(CHECK_EVERY);
        issue("second.example");
        let second = r.current();
        assert!(!Arc::ptr_eq(&first, &second), "a rotated certificate is picked up");

        std::thread::sleep(CHECK_EVERY);
        std::fs::write(d.join("s-key.pem"), "not a key").unwrap();
        assert!(Arc::ptr_eq(&second, &r.current()), "a broken rotation keeps the config in use");
        std::thread::sleep(CHECK_EVERY);
        issue("third.example");
        assert!(!Arc::ptr_eq(&second, &r.current()), "and the next good one is taken");
    }
}
