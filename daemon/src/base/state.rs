//! The daemon's JSON state files in the data directory (exports, attachments, fences): read
//! whole, and replaced atomically and durably (write a private temporary file, fsync it, rename it
//! over the old one, fsync the directory), so a crash leaves either the old list or the new one.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// One list of records kept as a JSON file in the data directory.
#[derive(Debug, Clone)]
pub struct RecordFile {
    path: PathBuf,
}

impl RecordFile {
    /// `<data_dir>/<name>.json`.
    pub fn new(data_dir: &Path, name: &str) -> Self {
        Self { path: data_dir.join(format!("{name}.json")) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The list; a missing file is an empty list.
    pub fn load<T: DeserializeOwned>(&self) -> anyhow::Result<Vec<T>> {
        load_list(&self.path)
    }

    /// Replaces the list durably.
    pub fn save<T: Serialize>(&self, items: &[T]) -> std::io::Result<()> {
        save_json(&self.path, items)
    }
}

/// Reads a list kept as JSON; a missing file is an empty list.
fn load_list<T: DeserializeOwned>(p: &Path) -> anyhow::Result<Vec<T>> {
    match std::fs::read(p) {
        Ok(b) => Ok(serde_json::from_slice(&b).map_err(|e| anyhow::anyhow!("parsing {}: {e}", p.display()))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(anyhow::anyhow!("reading {}: {e}", p.display())),
    }
}

/// Replaces a JSON state file (such a list, or any other) durably.
pub fn save_json<T: Serialize + ?Sized>(p: &Path, value: &T) -> std::io::Result<()> {
    let tmp = p.with_extension("json.tmp");
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(value).expect("serialisable"))?;
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
        let f = RecordFile::new(dir.path(), "things");
        let p = dir.path().join("things.json");
        assert_eq!(f.path(), p);
        assert!(f.load::<String>().unwrap().is_empty(), "a missing file is an empty list");
        f.save(&["a".to_string(), "b".to_string()]).unwrap();
        f.save(&["c".to_string()]).unwrap();
        assert_eq!(f.load::<String>().unwrap(), ["c"]);
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!p.with_extension("json.tmp").exists());
        std::fs::write(&p, b"{not json").unwrap();
        assert!(f.load::<String>().unwrap_err().to_string().contains("things.json"));
    }

    #[test]
    fn any_state_file_is_private() {
        // The ublk hold list (`ferrite_ublk::hold::List`) is written this way too.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ublk-hold.json");
        save_json(&p, &serde_json::json!({"boot_id": "b", "devices": []})).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!p.with_extension("json.tmp").exists());
    }
}
