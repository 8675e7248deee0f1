//! In-suite fuzzing of negotiation and the request decoder (the cargo-fuzz targets in fuzz/
//! run the same entry points for longer): random bytes, and valid openings with random tails.

use ferrite_nbd::fuzzing;
use ferrite_nbd::proto::*;
use proptest::prelude::*;

fn opening() -> Vec<u8> {
    (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec()
}

fn option_bytes(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&opt.to_be_bytes());
    o.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    o.extend_from_slice(data);
    o
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        prop_assert!(!fuzzing::handshake(&bytes));
        fuzzing::requests(&bytes);
    }

    #[test]
    fn well_framed_options_with_random_payloads(
        opts in prop::collection::vec((0u32..14, prop::collection::vec(any::<u8>(), 0..300)), 1..8),
    ) {
        let mut input = opening();
        for (opt, data) in &opts {
            input.extend(option_bytes(*opt, data));
        }
        // No export exists, so no sequence can reach transmission.
        prop_assert!(!fuzzing::handshake(&input));
    }
}

/// Requests with valid magic and random fields, payloads and tails, thrown at a connection in
/// transmission on a real export: nothing panics or hangs, and every request gets a reply (or the
/// connection ends on a bad header).
mod transmission {
    use std::sync::{Arc, OnceLock};

    use ferrite_engine::io::MemoryBackend;
    use ferrite_engine::{Pool, PoolOptions};
    use ferrite_nbd::{Export, fuzzing};
    use proptest::prelude::*;

    use super::*;

    fn export() -> &'static Arc<Export> {
        static EXPORT: OnceLock<(tempfile::TempDir, Pool, Arc<Export>)> = OnceLock::new();
        &EXPORT
            .get_or_init(|| {
                let dir = tempfile::tempdir().unwrap();
                let opts = PoolOptions { segment_size: 1 << 20, ..PoolOptions::default() };
                let pool =
                    Pool::create_on(Arc::new(MemoryBackend::new(64 << 20)), &dir.path().join("meta"), opts).unwrap();
                pool.create_volume("fuzz", 8 << 20).unwrap();
                let export = Arc::new(Export::new("fuzz", pool.open_volume("fuzz").unwrap(), false, ""));
                (dir, pool, export)
            })
            .2
    }

    fn request() -> impl Strategy<Value = Vec<u8>> {
        (
            0u16..10,
            any::<u16>(),
            0u64..(10 << 20),
            prop_oneof![0u32..70_000, any::<u32>()],
            prop::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(kind, flags, offset, length, tail)| {
                let mut b = Request { flags, kind, cookie: u64::from(length), offset, length }.encode().to_vec();
                if kind == CMD_WRITE && length < 70_000 {
                    b.resize(b.len() + length as usize, 0xA5);
                }
                b.extend_from_slice(&tail[..tail.len() % 3]); // now and then, a byte out of frame
                b
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn hostile_request_streams_never_panic_or_hang(mode in any::<u8>(), reqs in prop::collection::vec(request(), 0..24)) {
            let mut input = vec![mode];
            input.extend(reqs.concat());
            fuzzing::transmission(export(), &input);
        }

        #[test]
        fn random_bytes_in_transmission(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
            fuzzing::transmission(export(), &bytes);
        }
    }
}
