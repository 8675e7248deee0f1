//! Fixtures shared by the engine's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferrite_engine::TAIL_FILE;
use ferrite_engine::format::DATA_START;
use ferrite_engine::io::CrashBackend;
use ferrite_engine::{Pool, PoolOptions};

pub use ferrite_testkit::pattern;

/// Small geometry so tests cross segment boundaries and fill pools quickly.
pub const SEG: u64 = 256 << 10;

pub fn small_opts() -> PoolOptions {
    PoolOptions {
        segment_size: SEG,
        reserve_segments: 1,
        max_batch_bytes: 64 << 10,
        // Checkpoints only when a test asks (or on open/close), so tests control them.
        checkpoint_interval: Duration::from_secs(3600),
        checkpoint_bytes: u64::MAX,
        // Cleaning only when a test asks, too.
        background_cleaner: false,
        ..PoolOptions::default()
    }
}

/// A pool on the crash-simulating backend, with its metadata in a temporary directory.
pub struct Fixture {
    pub backend: Arc<CrashBackend>,
    pub dir: tempfile::TempDir,
    pub opts: PoolOptions,
}

impl Fixture {
    pub fn new(segments: u64) -> (Self, Pool) {
        Self::with_opts(segments, small_opts())
    }

    pub fn with_opts(segments: u64, opts: PoolOptions) -> (Self, Pool) {
        let backend = Arc::new(CrashBackend::new(DATA_START + segments * opts.segment_size));
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool::create_on(backend.clone(), &dir.path().join("meta"), opts.clone()).unwrap();
        (Self { backend, dir, opts }, pool)
    }

    pub fn meta(&self) -> PathBuf {
        self.dir.path().join("meta")
    }

    /// A power cut takes the page cache, and with it the tail file's pages (it is left empty).
    pub fn lose_tail_file(&self) {
        let f = std::fs::OpenOptions::new().write(true).open(self.meta().join(TAIL_FILE)).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(0).unwrap();
        f.set_len(len).unwrap();
    }

    pub fn reopen(&self) -> Pool {
        Pool::open_on(self.backend.clone(), &self.meta(), self.opts.clone()).unwrap()
    }
}
