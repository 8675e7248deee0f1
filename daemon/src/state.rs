//! The daemon's JSON state files in the data directory (exports, attachments, fences): read
//! whole, and replaced atomically and durably (write a private temporary file, fsync it, rename it
//! over the old one, fsync the directory), so a crash leaves either the old list or the new one.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Reads a list kept as JSON; a missing file is an empty list.
pub fn load_list<T: DeserializeOwned>(p: &Path) -> anyhow::Result<Vec<T>> {
    match std::fs::read(p) {
        Ok(b) => Ok(serde_json::from_slice(&b).map_err(|e| anyhow::anyhow!("parsing {}: {e}", p.display()))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(anyhow::anyhow!("reading {}: {e}", p.display())),
    }
}

/// Replaces such a list durably.
pub fn save_list<T: Serialize>(p: &Path, items: &[T]) -> std::io::Result<()> {
    let tmp = p.with_extension("json.tmp");
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(items).expect("serialisable"))?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, p)?;
    // The rename is durable only once the directory entry is.
    File::open(p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")))?.sync_all()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn lists_round_trip_privately_and_leave_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("things.json");
        assert!(load_list::<String>(&p).unwrap().is_empty(), "a missing file is an empty list");
        save_list(&p, &["a".to_string(), "b".to_string()]).unwrap();
        save_list(&p, &["c".to_string()]).unwrap();
        assert_eq!(load_list::<String>(&p).unwrap(), ["c"]);
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!p.with_extension("json.tmp").exists());
        std::fs::write(&p, b"{not json").unwrap();
        assert!(load_list::<String>(&p).unwrap_err().to_string().contains("things.json"));
    }
}
