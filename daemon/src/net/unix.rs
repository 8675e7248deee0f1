//! The daemon's Unix sockets and the private directories that hold them.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};

use anyhow::{Context, Result};
use tokio::net::UnixListener;

/// Binds a Unix socket at `path` with `mode`, replacing a stale one a daemon left behind.
pub fn bind_unix(path: &std::path::Path, mode: u32) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        // A socket left by a daemon that did not shut down cleanly. Refuse if one still answers.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("{} is in use by a running process (another ferrite daemon?)", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(l)
}

/// Makes `dir` (and its parents) if missing; `dir` itself private (0700).
pub fn private_dir(dir: &std::path::Path) -> Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("restricting {}", dir.display()))
}
