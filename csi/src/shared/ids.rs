//! CSI ids and names. A local volume's or a snapshot's id is `<node>/<engine name>`: it says
//! where the data lives, so the controller needs no state of its own. A replicated volume's id
//! is `_/<engine name>` ([`ANY`]): its copies move between nodes (failover, replacement) and it
//! outlives any one of them, so its id names none; the copies are asked where it is served
//! (`copies::locate`). Ids of replicated volumes made before (`<creation node>/<name>`) resolve
//! the same way once that node no longer holds the primary.

use sha2::{Digest, Sha256};

use crate::shared::nodes::valid_node;

/// The node part of a replicated volume's id: no node ([`valid_node`] refuses it), so the
/// directory knows none by that name and the copies are asked.
pub const ANY: &str = "_";

/// `(node, name)` of an id (the node may be [`ANY`]); None for an id this driver never made
/// (callers treat that as "does not exist", which the spec asks of Delete and answers NotFound
/// elsewhere).
pub fn parse(id: &str) -> Option<(&str, &str)> {
    let (node, name) = id.split_once('/')?;
    ((node == ANY || valid_node(node)) && valid_name(name)).then_some((node, name))
}

pub fn make(node: &str, name: &str) -> String {
    format!("{node}/{name}")
}

/// What a backup snapshot's id starts with (a VolumeSnapshotClass with `backup: <target>`):
/// `backup:<target>/<volume>/<backup id>`. No node name holds a ':'.
const BACKUP: &str = "backup:";

/// A backup of `volume` on `target`, as a snapshot id.
pub fn make_backup(target: &str, volume: &str, id: &str) -> String {
    format!("{BACKUP}{target}/{volume}/{id}")
}

/// `(target, volume, backup id)` of a backup snapshot's id; None for any other id.
pub fn parse_backup(id: &str) -> Option<(&str, &str, &str)> {
    let mut parts = id.strip_prefix(BACKUP)?.splitn(3, '/');
    let (t, v, b) = (parts.next()?, parts.next()?, parts.next()?);
    [t, v, b].iter().all(|p| valid_name(p)).then_some((t, v, b))
}

/// The id of the backup a CSI snapshot named `csi_name` makes: readable (`csi.<name>`) where
/// it can be, never a time (the daemons resume only those unasked).
pub fn backup_id(csi_name: &str) -> String {
    engine_name(&format!("csi.{csi_name}"))
}

/// What the engine accepts as a volume or snapshot name.
pub fn valid_name(n: &str) -> bool {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    !n.is_empty() && n.len() <= 128 && n.chars().all(ok) && !n.starts_with(['.', '-'])
}

/// The engine name for a CSI name: the name itself when the engine accepts it (Kubernetes'
/// `pvc-<uuid>` always is), else a digest of it (128 bits of SHA-256, so two names never meet on
/// one volume), stable across builds, so a retried CreateVolume finds the volume it made.
pub fn engine_name(csi_name: &str) -> String {
    engine_names(csi_name).swap_remove(0)
}

/// Every engine name a CSI name may have been given, newest first: the current one and, for a
/// digested name, the 64-bit FNV-1a digest earlier versions used (their volumes stay findable).
pub fn engine_names(csi_name: &str) -> Vec<String> {
    if valid_name(csi_name) {
        return vec![csi_name.to_owned()];
    }
    let digest = Sha256::digest(csi_name.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    let fnv = csi_name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    vec![format!("csi-{hex}"), format!("csi-{fnv:016x}")]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_strangers_are_refused() {
        assert_eq!(parse(&make("node-a", "pvc-1")), Some(("node-a", "pvc-1")));
        assert_eq!(parse(&make(ANY, "pvc-1")), Some((ANY, "pvc-1")));
        assert!(!valid_node(ANY), "no node can be named like the replicated volumes' ids");
        for bad in ["", "pvc-1", "/pvc", "node-a/", "Node/x", "node-a/x/y", "node-a/.x", "__/x", "_/"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn backup_ids_round_trip_and_are_no_volume_ids() {
        let id = make_backup("offsite", "pvc-1", &backup_id("snapshot-1"));
        assert_eq!(id, "backup:offsite/pvc-1/csi.snapshot-1");
        assert_eq!(parse_backup(&id), Some(("offsite", "pvc-1", "csi.snapshot-1")));
        assert_eq!(parse(&id), None, "not a node's snapshot");
        for bad in ["backup:", "backup:t/v", "backup:t//b", "backup:t/v/b/c", "node-a/x", "backup:t/.v/b"] {
            assert_eq!(parse_backup(bad), None, "{bad}");
        }
        let long = backup_id(&"x".repeat(200));
        assert!(valid_name(&long) && !long.starts_with(|c: char| c.is_ascii_digit()), "{long}");
    }

    #[test]
    fn engine_names_are_stable_and_valid() {
        assert_eq!(engine_name("pvc-0f1e2d3c-aaaa-bbbb-cccc-000011112222"), "pvc-0f1e2d3c-aaaa-bbbb-cccc-000011112222");
        let n = engine_name("my volume/with ünïcode");
        assert!(valid_name(&n) && n.starts_with("csi-"));
        assert_eq!(n, engine_name("my volume/with ünïcode"));
        assert_ne!(n, engine_name("my volume/with unicode"));
        assert_eq!(n.len(), 4 + 32, "128 bits of digest");
        // Names made by earlier versions (64-bit FNV-1a) are still looked up.
        assert_eq!(engine_names("my volume/with ünïcode")[1].len(), 4 + 16);
        assert_eq!(
            engine_names("a b"),
            ["csi-c8687a08aa5d6ed2044328fa6a697ab8".to_string(), "csi-e63f991904833892".into()]
        );
    }
}
