//! Human sizes: `10G`, `512MiB`, `4096`, `1.5T`. K/M/G/T/P with or without `i`/`iB`/`B` are
//! all powers of 1024, as block-storage users expect.

/// Parses a size; the error says what was wrong.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "ki" | "kib" => 10,
        "m" | "mb" | "mi" | "mib" => 20,
        "g" | "gb" | "gi" | "gib" => 30,
        "t" | "tb" | "ti" | "tib" => 40,
        "p" | "pb" | "pi" | "pib" => 50,
        u => return Err(format!("unknown size unit {u:?} in {s:?} (use K, M, G, T or P)")),
    };
    // Exact integer arithmetic (an f64 rounds above 2^53): whole part, then the fraction, which
    // must come to whole bytes.
    let bad = || format!("invalid size {s:?}: expected a number with an optional unit");
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if (whole.is_empty() && frac.is_empty()) || frac.contains('.') || frac.len() > 18 {
        return Err(bad());
    }
    let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| bad())? };
    let scale = 10u128.pow(u32::try_from(frac.len()).expect("at most 18 digits"));
    let frac: u128 = if frac.is_empty() { 0 } else { frac.parse().map_err(|_| bad())? };
    let frac_bytes = frac << shift;
    if !frac_bytes.is_multiple_of(scale) {
        return Err(format!("invalid size {s:?}: not a whole number of bytes"));
    }
    whole
        .checked_shl(shift)
        .filter(|w| w >> shift == whole)
        .and_then(|w| w.checked_add(frac_bytes / scale))
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(|| format!("invalid size {s:?}: larger than 16 EiB"))
}

/// Formats bytes with a binary unit, e.g. `1.5 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", UNITS[i]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert_eq!(parse_size(" 2 TB ").unwrap(), 2 << 40);
        // Exact above 2^53, where an f64 would round.
        assert_eq!(parse_size("9007199254740993").unwrap(), 9_007_199_254_740_993);
        assert_eq!(parse_size("16777215.75T").unwrap(), (16_777_215 << 40) + (3 << 38));
        assert_eq!(parse_size(".5K").unwrap(), 512);
        for bad in ["", "G", "10X", "1.3", "-5", "1e3", ".", "1.2.3", "16384P", "18446744073709551616"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
    }
}
