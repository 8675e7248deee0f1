//! A pool and an NBD server on a Unix socket in a temporary directory, shared by the tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_engine::{Pool, PoolOptions};
use ferrite_nbd::{Export, Exports, Server};

pub use ferrite_testkit::have;

pub const MIB: u64 = 1 << 20;

/// Fields drop in order: the server's runtime first, the directory last.
pub struct Harness {
    pub rt: tokio::runtime::Runtime,
    pub exports: Arc<Exports>,
    pub pool: Pool,
    pub dir: tempfile::TempDir,
}

impl Harness {
    /// A pool of `pool_size` bytes (4 MiB segments) and a server on `<dir>/nbd.sock`.
    pub fn new(pool_size: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let opts = PoolOptions { segment_size: 4 * MIB, ..PoolOptions::default() };
        let pool = Pool::create(&dir.path().join("pool.img"), &dir.path().join("meta"), pool_size, opts).unwrap();
        let exports = Arc::new(Exports::default());
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let h = Self { rt, exports: Arc::clone(&exports), pool, dir };
        h.serve(exports, &h.sock());
        h
    }

    /// Serves `exports` on another socket of the same runtime. The socket is bound and listening on return (the
    /// socket file appears at bind, before listen, so waiting for the file alone races with the first connect).
    pub fn serve(&self, exports: Arc<Exports>, sock: &Path) {
        let server = Arc::new(Server::new(exports));
        let listener = {
            let _guard = self.rt.enter();
            tokio::net::UnixListener::bind(sock).unwrap()
        };
        self.rt.spawn(async move { server.serve_unix_listener(listener).await });
    }

    pub fn sock(&self) -> PathBuf {
        self.dir.path().join("nbd.sock")
    }

    /// Creates a volume and exports it under the same name.
    pub fn export(&self, name: &str, size: u64, read_only: bool) {
        self.pool.create_volume(name, size).unwrap();
        let volume = self.pool.open_volume(name).unwrap();
        self.exports.add(Export::new(name, volume, read_only, format!("volume {name}")));
    }

    /// libnbd's URI of an export.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.sock().display())
    }

    /// qemu's spelling of the same export.
    pub fn qemu(&self, name: &str) -> String {
        format!("nbd:unix:{}:exportname={name}", self.sock().display())
    }
}
