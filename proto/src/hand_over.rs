//! Which primaries a daemon hands over before a planned restart, as its own answers show them:
//! the rule the failover loop acts on and the daemon's preStop hook waits for, kept in one place
//! so that the two cannot disagree about when a hand-over is done.

use std::collections::BTreeSet;

use crate::ferrite::v1::{Publication, SyncMember, SyncVolume};

/// The synchronous volumes in `held` this daemon is the primary of and does not serve a
/// publication of (a published volume stays: the kernel holds its I/O through the restart), each
/// with the in-sync copies on other members it may go to (never empty).
pub fn movable<'a>(held: &'a [SyncVolume], published: &[Publication]) -> Vec<(&'a SyncVolume, Vec<&'a SyncMember>)> {
    let published: BTreeSet<&str> = published.iter().map(|p| p.volume.as_str()).collect();
    held.iter()
        .filter(|v| v.role == "primary" && !published.contains(v.volume.as_str()))
        .map(|v| (v, v.members.iter().filter(|m| m.state == "in-sync" && m.endpoint != v.primary).collect::<Vec<_>>()))
        .filter(|(_, copies)| !copies.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(endpoint: &str, state: &str) -> SyncMember {
        SyncMember { endpoint: endpoint.into(), state: state.into(), ..Default::default() }
    }

    fn volume(name: &str, role: &str, members: Vec<SyncMember>) -> SyncVolume {
        SyncVolume { volume: name.into(), role: role.into(), primary: "a:1".into(), members, ..Default::default() }
    }

    #[test]
    fn only_unpublished_primaries_with_an_in_sync_copy_elsewhere_move() {
        let held = vec![
            volume(
                "moves",
                "primary",
                vec![member("a:1", "in-sync"), member("b:1", "in-sync"), member("c:1", "rebuilding")],
            ),
            volume("published", "primary", vec![member("a:1", "in-sync"), member("b:1", "in-sync")]),
            volume("no-copy", "primary", vec![member("a:1", "in-sync"), member("b:1", "rebuilding")]),
            volume("a-replica", "replica", vec![member("a:1", "in-sync"), member("b:1", "in-sync")]),
        ];
        let published = vec![Publication { volume: "published".into(), ..Default::default() }];
        let moves = movable(&held, &published);
        assert_eq!(moves.len(), 1);
        assert_eq!(moves[0].0.volume, "moves");
        let to: Vec<&str> = moves[0].1.iter().map(|m| m.endpoint.as_str()).collect();
        assert_eq!(to, ["b:1"]);
    }
}
