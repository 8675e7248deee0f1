//! CSI ids and names. A volume or snapshot id is `<node>/<engine name>`: it says where the data
//! lives, so the controller needs no state of its own.

use crate::nodes::valid_node;

/// `(node, name)` of an id; None for an id this driver never made (callers treat that as "does
/// not exist", which the spec asks of Delete and answers NotFound elsewhere).
pub fn parse(id: &str) -> Option<(&str, &str)> {
    let (node, name) = id.split_once('/')?;
    (valid_node(node) && valid_name(name)).then_some((node, name))
}

pub fn make(node: &str, name: &str) -> String {
    format!("{node}/{name}")
}

/// What the engine accepts as a volume or snapshot name.
pub fn valid_name(n: &str) -> bool {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    !n.is_empty() && n.len() <= 128 && n.chars().all(ok) && !n.starts_with(['.', '-'])
}

/// The engine name for a CSI name: the name itself when the engine accepts it (Kubernetes'
/// `pvc-<uuid>` always is), else a stable digest of it, so a retried CreateVolume finds the
/// volume it made.
pub fn engine_name(csi_name: &str) -> String {
    if valid_name(csi_name) {
        return csi_name.to_owned();
    }
    // FNV-1a, 64 bit: stable across builds and platforms.
    let h = csi_name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("csi-{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_strangers_are_refused() {
        assert_eq!(parse(&make("node-a", "pvc-1")), Some(("node-a", "pvc-1")));
        for bad in ["", "pvc-1", "/pvc", "node-a/", "Node/x", "node-a/x/y", "node-a/.x"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn engine_names_are_stable_and_valid() {
        assert_eq!(engine_name("pvc-0f1e2d3c-aaaa-bbbb-cccc-000011112222"), "pvc-0f1e2d3c-aaaa-bbbb-cccc-000011112222");
        let n = engine_name("my volume/with ünïcode");
        assert!(valid_name(&n) && n.starts_with("csi-"));
        assert_eq!(n, engine_name("my volume/with ünïcode"));
        assert_ne!(n, engine_name("my volume/with unicode"));
    }
}
