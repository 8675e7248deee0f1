//! Per-volume QoS as CSI mutable parameters (CreateVolume's `mutable_parameters`,
//! ControllerModifyVolume; a Kubernetes VolumeAttributesClass). The keys name the daemon's
//! limits; a set of parameters replaces the volume's limits as a whole (a key left out is no
//! limit), so modifying to the same class twice changes nothing.
//!
//! | key | value |
//! |---|---|
//! | `iops`, `readIops`, `writeIops` | operations per second |
//! | `bandwidth`, `readBandwidth`, `writeBandwidth` | bytes per second: `200M`, `1Gi`, `500000` |
//! | `burst` | idle time banked for a burst: `500ms`, `2s` (default 1s) |

use std::collections::HashMap;

use ferrite_proto::ferrite::v1 as pb;
use tonic::Status;

/// The limits `params` ask for; InvalidArgument naming the key for anything else.
pub fn limits(params: &HashMap<String, String>) -> Result<pb::VolumeLimits, Status> {
    let mut l = pb::VolumeLimits::default();
    for (k, v) in params {
        let bad = |what: &str| Status::invalid_argument(format!("mutable parameter {k}: {v:?} is not {what}"));
        let count = || v.trim().parse::<u64>().map_err(|_| bad("a whole number of operations per second"));
        let bytes = || bytes(v).ok_or_else(|| bad("a rate in bytes per second like 200M or 1Gi"));
        match k.as_str() {
            "iops" => l.iops = count()?,
            "readIops" => l.read_iops = count()?,
            "writeIops" => l.write_iops = count()?,
            "bandwidth" => l.bps = bytes()?,
            "readBandwidth" => l.read_bps = bytes()?,
            "writeBandwidth" => l.write_bps = bytes()?,
            "burst" => l.burst_ms = burst_ms(v).ok_or_else(|| bad("a duration like 500ms or 2s"))?,
            _ => {
                return Err(Status::invalid_argument(format!(
                    "unknown mutable parameter {k:?} (known: iops, readIops, writeIops, bandwidth, readBandwidth, \
                     writeBandwidth, burst)"
                )));
            }
        }
    }
    Ok(l)
}

/// `200M`, `1Gi`, `64KiB`, `500000`: binary multiples (a storage rate, as sizes are).
fn bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: u64 = s[..digits].parse().ok()?;
    let shift = match s[digits..].trim_end_matches('B').trim_end_matches('i') {
        "" => 0,
        "K" | "k" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// A burst allowance in milliseconds: `500ms` or `2s`, more than 0 and at most an hour.
pub fn burst_ms(s: &str) -> Option<u64> {
    let s = s.trim();
    let (n, scale) = match s.strip_suffix("ms") {
        Some(n) => (n, 1),
        None => (s.strip_suffix('s')?, 1000),
    };
    let v: u64 = n.parse().ok()?;
    (v > 0 && v <= 3_600_000 / scale).then_some(v * scale)
}

/// The limits as the same parameters (only those set), for ControllerGetVolume.
pub fn parameters(l: &pb::VolumeLimits) -> HashMap<String, String> {
    let mut m = HashMap::new();
    for (k, v) in [
        ("iops", l.iops),
        ("readIops", l.read_iops),
        ("writeIops", l.write_iops),
        ("bandwidth", l.bps),
        ("readBandwidth", l.read_bps),
        ("writeBandwidth", l.write_bps),
    ] {
        if v > 0 {
            m.insert(k.to_owned(), v.to_string());
        }
    }
    if l.burst_ms > 0 {
        m.insert("burst".into(), format!("{}ms", l.burst_ms));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn parameters_parse_and_round_trip() {
        let l = limits(&p(&[("iops", "5000"), ("writeBandwidth", "200M"), ("readBandwidth", "1Gi"), ("burst", "2s")]))
            .unwrap();
        assert_eq!((l.iops, l.write_bps, l.read_bps, l.burst_ms), (5000, 200 << 20, 1 << 30, 2000));
        assert_eq!(limits(&parameters(&l)).unwrap(), l);
        assert_eq!(limits(&p(&[])).unwrap(), pb::VolumeLimits::default());
        assert_eq!(limits(&p(&[("bandwidth", "64KiB"), ("burst", "500ms")])).unwrap().bps, 64 << 10);
    }

    #[test]
    fn bad_keys_and_values_name_the_key() {
        for (k, v) in [("iops", "lots"), ("iops", "-1"), ("bandwidth", "2X"), ("burst", "2"), ("burst", "0s")] {
            let e = limits(&p(&[(k, v)])).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(k), "{}", e.message());
        }
        let e = limits(&p(&[("maxIops", "1")])).unwrap_err();
        assert!(e.message().contains("maxIops"), "{}", e.message());
    }
}
