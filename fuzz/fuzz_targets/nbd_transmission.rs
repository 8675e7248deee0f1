#![no_main]
use std::sync::{Arc, OnceLock};

use ferrite_engine::io::MemoryBackend;
use ferrite_engine::{Pool, PoolOptions};
use ferrite_nbd::Export;

/// One pool and export for the whole run (a pool per input would dominate the time).
fn export() -> &'static Arc<Export> {
    static EXPORT: OnceLock<(Pool, Arc<Export>)> = OnceLock::new();
    &EXPORT
        .get_or_init(|| {
            let meta = std::env::temp_dir().join(format!("ferrite-fuzz-{}", std::process::id()));
            let opts = PoolOptions { segment_size: 1 << 20, ..PoolOptions::default() };
            let pool = Pool::create_on(Arc::new(MemoryBackend::new(64 << 20)), &meta, opts).unwrap();
            pool.create_volume("fuzz", 8 << 20).unwrap();
            let export = Arc::new(Export::new("fuzz", pool.open_volume("fuzz").unwrap(), false, ""));
            (pool, export)
        })
        .1
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferrite_nbd::fuzzing::transmission(export(), data);
});
