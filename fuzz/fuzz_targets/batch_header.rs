#![no_main]
use ferrite_engine::format::{BatchHeader, Superblock};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = Superblock::decode(data);
    if let Some(h) = BatchHeader::decode(data) {
        // Whatever decodes must re-encode to the same bytes.
        let mut out = vec![0u8; h.header_blocks() * 4096];
        h.encode_into(&mut out);
        assert_eq!(BatchHeader::decode(&out), Some(h));
    }
});
