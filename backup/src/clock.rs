//! Dates without a date crate: backup ids from the time, the civil date of a day (what retention
//! by month and year counts), and the time now.

/// A backup id from the time: `20261128T101500Z`.
pub fn new_id(unix: u64) -> String {
    let (days, secs) = (unix / 86_400, unix % 86_400);
    let (year, month, day) = civil(days);
    format!("{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The civil date (year, month 1-12, day 1-31) of `days` since 1970-01-01 (H. Hinnant's
/// algorithm).
pub(crate) fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

pub fn now_unix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_utc_times() {
        assert_eq!(super::new_id(0), "19700101T000000Z");
        assert_eq!(super::new_id(1_795_861_815), "20261128T103015Z");
        assert_eq!(super::new_id(951_782_400), "20000229T000000Z");
    }
}
