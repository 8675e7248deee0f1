/// `len` bytes of a xorshift sequence seeded by `seed`: the same bytes for the same seed, and
/// different seeds that read back apart (a misplaced block shows).
#[must_use]
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::pattern;

    #[test]
    fn a_seed_gives_the_same_bytes_and_seeds_differ() {
        assert_eq!(pattern(7, 4096), pattern(7, 4096));
        assert_ne!(pattern(7, 4096), pattern(8, 4096));
        assert_eq!(pattern(7, 100), pattern(7, 4096)[..100]);
    }
}
