//! The role table: which roles may make each call. It is the spec: `tests` checks that every
//! RPC of `admin.proto`, `replica.proto` and `mirror.proto` has a row, so a new RPC without one fails the build's
//! tests, and a call without a row is refused to everyone but an operator.

use super::Role::{self, Controller, ReplicationPeer};

/// gRPC method paths and the roles besides `operator` (who may make every call) that may make
/// them. `controller` holds what `ferrite csi` calls (controller and node modes, CSI-Addons);
/// `replication-peer` the Replica and Mirror services, whose handlers also check that the caller
/// is the configured peer of the relation (or the primary of the membership) a call touches; `nbd-client` no call at all.
pub const RULES: &[(&str, &[Role])] = &[
    ("/ferrite.v1.Admin/CreateVolume", &[Controller]),
    ("/ferrite.v1.Admin/ListVolumes", &[Controller]),
    ("/ferrite.v1.Admin/GetVolume", &[Controller]),
    ("/ferrite.v1.Admin/GrowVolume", &[Controller]),
    ("/ferrite.v1.Admin/SetVolumeLimits", &[Controller]),
    ("/ferrite.v1.Admin/DeleteVolume", &[Controller]),
    ("/ferrite.v1.Admin/CloneVolume", &[Controller]),
    // With the key a CSI request's secret carries (NodeStage, ControllerPublish, key rotation).
    ("/ferrite.v1.Admin/UnlockVolume", &[Controller]),
    ("/ferrite.v1.Admin/RekeyVolume", &[Controller]),
    ("/ferrite.v1.Admin/CreateSnapshot", &[Controller]),
    ("/ferrite.v1.Admin/ListSnapshots", &[Controller]),
    ("/ferrite.v1.Admin/GetSnapshot", &[Controller]),
    ("/ferrite.v1.Admin/DeleteSnapshot", &[Controller]),
    ("/ferrite.v1.Admin/ChangedRanges", &[Controller]),
    ("/ferrite.v1.Admin/EnableReplication", &[Controller]),
    ("/ferrite.v1.Admin/DisableReplication", &[Controller]),
    // A push on demand is an operator's tool; the scheduler and Replica/Sync cover the rest.
    ("/ferrite.v1.Admin/SyncReplication", &[]),
    ("/ferrite.v1.Admin/DemoteReplication", &[Controller]),
    ("/ferrite.v1.Admin/PromoteReplication", &[Controller]),
    ("/ferrite.v1.Admin/ResyncReplication", &[Controller]),
    ("/ferrite.v1.Admin/ListReplications", &[Controller]),
    ("/ferrite.v1.Admin/AddSyncReplica", &[Controller]),
    ("/ferrite.v1.Admin/RemoveSyncReplica", &[Controller]),
    ("/ferrite.v1.Admin/PromoteSyncReplica", &[Controller]),
    ("/ferrite.v1.Admin/ListSyncReplicas", &[Controller]),
    ("/ferrite.v1.Admin/CreateGroup", &[Controller]),
    ("/ferrite.v1.Admin/UpdateGroup", &[Controller]),
    ("/ferrite.v1.Admin/DeleteGroup", &[Controller]),
    ("/ferrite.v1.Admin/ListGroups", &[Controller]),
    ("/ferrite.v1.Admin/CreateGroupSnapshot", &[Controller]),
    ("/ferrite.v1.Admin/ListGroupSnapshots", &[Controller]),
    ("/ferrite.v1.Admin/DeleteGroupSnapshot", &[Controller]),
    ("/ferrite.v1.Admin/CloneGroupSnapshot", &[]),
    // Exports serve volumes over NBD to anyone their allow list admits: an operator's decision.
    ("/ferrite.v1.Admin/StartExport", &[]),
    ("/ferrite.v1.Admin/StopExport", &[]),
    ("/ferrite.v1.Admin/ListExports", &[]),
    // A publication is an export to exactly one node (or none over TCP): the controller's.
    ("/ferrite.v1.Admin/PublishVolume", &[Controller]),
    ("/ferrite.v1.Admin/UnpublishVolume", &[Controller]),
    ("/ferrite.v1.Admin/ListPublications", &[Controller]),
    // Block devices on this host: the node plugin's, over the admin socket (an operator).
    ("/ferrite.v1.Admin/AttachVolume", &[]),
    ("/ferrite.v1.Admin/DetachVolume", &[]),
    ("/ferrite.v1.Admin/ResizeAttachment", &[]),
    ("/ferrite.v1.Admin/ListAttachments", &[]),
    ("/ferrite.v1.Admin/PoolStatus", &[Controller]),
    ("/ferrite.v1.Admin/Version", &[Controller]),
    ("/ferrite.v1.Admin/ReclaimPool", &[Controller]),
    ("/ferrite.v1.Admin/ScrubPool", &[]),
    ("/ferrite.v1.Admin/DefragVolume", &[]),
    ("/ferrite.v1.Admin/FenceNetworks", &[Controller]),
    ("/ferrite.v1.Admin/UnfenceNetworks", &[Controller]),
    ("/ferrite.v1.Admin/ListFences", &[Controller]),
    ("/ferrite.v1.Admin/ListClients", &[Controller]),
    // Backups leave the cluster with a target's credentials. The controller makes, finds,
    // deletes and restores one backup at a time (a VolumeSnapshot of a `backup` class); listing
    // a target, verifying and pruning it are an operator's.
    ("/ferrite.v1.Backups/CreateBackup", &[Controller]),
    ("/ferrite.v1.Backups/ListBackups", &[]),
    ("/ferrite.v1.Backups/GetBackup", &[Controller]),
    ("/ferrite.v1.Backups/DeleteBackup", &[Controller]),
    ("/ferrite.v1.Backups/VerifyBackups", &[]),
    ("/ferrite.v1.Backups/PruneBackups", &[]),
    ("/ferrite.v1.Backups/RestoreBackup", &[Controller]),
    ("/ferrite.v1.Backups/ListBackupTargets", &[]),
    ("/ferrite.v1.Backups/SetBackupLock", &[]),
    ("/ferrite.v1.Replica/Position", &[ReplicationPeer]),
    ("/ferrite.v1.Replica/Push", &[ReplicationPeer]),
    ("/ferrite.v1.Replica/Sync", &[ReplicationPeer]),
    ("/ferrite.v1.Replica/GroupCommit", &[ReplicationPeer]),
    ("/ferrite.v1.Mirror/Stream", &[ReplicationPeer]),
    ("/ferrite.v1.Mirror/Record", &[ReplicationPeer]),
    ("/ferrite.v1.Mirror/Get", &[ReplicationPeer]),
    ("/ferrite.v1.Mirror/Rebuild", &[ReplicationPeer]),
];

/// The roles besides `operator` that may call `path`; None for a path without a row.
pub fn allowed(path: &str) -> Option<&'static [Role]> {
    RULES.iter().find(|(p, _)| *p == path).map(|(_, r)| *r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `rpc` of a proto file, as gRPC method paths.
    fn rpcs(service: &str, proto: &str) -> Vec<String> {
        proto
            .lines()
            .filter_map(|l| l.trim().strip_prefix("rpc "))
            .map(|l| format!("/ferrite.v1.{service}/{}", l.split('(').next().unwrap().trim()))
            .collect()
    }

    #[test]
    fn every_rpc_has_a_row_and_every_row_an_rpc() {
        let mut all = rpcs("Admin", include_str!("../../../proto/ferrite/v1/admin.proto"));
        all.extend(rpcs("Replica", include_str!("../../../proto/ferrite/v1/replica.proto")));
        all.extend(rpcs("Mirror", include_str!("../../../proto/ferrite/v1/mirror.proto")));
        all.extend(rpcs("Backups", include_str!("../../../proto/ferrite/v1/backup.proto")));
        assert!(all.len() > 40, "the proto files were not read: {all:?}");
        for rpc in &all {
            assert!(allowed(rpc).is_some(), "{rpc} has no row in the role table");
        }
        for (path, _) in RULES {
            assert!(all.iter().any(|r| r == path), "{path} is in the role table but not in the protos");
        }
    }

    /// The README's table of what each role may call, as the role table says.
    fn readme_table() -> String {
        let mut out = String::from("| role | calls |\n|---|---|\n| `operator` | every call |\n");
        for role in [Controller, ReplicationPeer] {
            let calls: Vec<&str> = RULES
                .iter()
                .filter(|(_, r)| r.contains(&role))
                .map(|(p, _)| p.rsplit('/').next().unwrap_or(p))
                .collect();
            out += &format!("| `{}` | {} |\n", role.as_str(), calls.join(", "));
        }
        out + "| `nbd-client` | none: it opens NBD exports that admit it |\n| `metrics` | none: it reads `/metrics` |\n"
    }

    #[test]
    fn the_readme_lists_what_each_role_may_do() {
        let readme = include_str!("../../../README.md");
        let table = readme_table();
        let shown = readme.split("<!-- roles:begin -->\n").nth(1).and_then(|r| r.split("<!-- roles:end -->").next());
        assert_eq!(shown, Some(table.as_str()), "README.md's role table is not the code's; it should read:\n{table}");
    }

    #[test]
    fn roles_are_disjoint_in_what_they_reach() {
        for (path, roles) in RULES {
            let replica = path.starts_with("/ferrite.v1.Replica/") || path.starts_with("/ferrite.v1.Mirror/");
            assert_eq!(roles.contains(&ReplicationPeer), replica, "{path}");
            assert!(!roles.contains(&Role::NbdClient), "{path}: nbd-client has no admin access");
            assert!(!roles.contains(&Role::Metrics), "{path}: metrics has no admin access");
            assert!(!(replica && roles.contains(&Controller)), "{path}");
        }
    }
}
