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
