#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferrite_nbd::fuzzing::handshake(data);
});
