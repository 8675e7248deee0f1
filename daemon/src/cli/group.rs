//! `ferrite group ...`: volume groups and their crash-consistent group snapshots.

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, rpc_error, table};

#[derive(clap::Subcommand)]
pub enum GroupCmd {
    /// Create a group: `ferrite group create app db log`.
    Create { name: String, volumes: Vec<String> },
    /// Add volumes to a group.
    Add {
        name: String,
        #[arg(required = true)]
        volumes: Vec<String>,
    },
    /// Remove volumes from a group.
    Remove {
        name: String,
        #[arg(required = true)]
        volumes: Vec<String>,
    },
    /// Delete a group (its volumes and group snapshots stay).
    Delete { name: String },
    /// List groups.
    List,
    /// Snapshot every member at one point in time: `ferrite group snapshot app nightly`
    /// (member snapshots are named nightly.<volume>).
    Snapshot { group: String, name: String },
    /// List group snapshots (of one group if given).
    Snapshots { group: Option<String> },
    /// Delete a group snapshot and its member snapshots.
    DeleteSnapshot { name: String },
    /// Clone every member of a group snapshot into a new group (volumes <new-group>.<volume>).
    Clone { snapshot: String, new_group: String },
}

pub async fn run(c: &mut Admin, out: Output, cmd: GroupCmd) -> Result<()> {
    match cmd {
        GroupCmd::Create { name, volumes } => {
            let r = c.create_group(pb::CreateGroupRequest { name, volumes }).await.map_err(rpc_error)?;
            print_groups(out, std::slice::from_ref(r.get_ref()));
        }
        GroupCmd::Add { name, volumes } => {
            let req = pb::UpdateGroupRequest { name, add: volumes, remove: Vec::new() };
            let r = c.update_group(req).await.map_err(rpc_error)?;
            print_groups(out, std::slice::from_ref(r.get_ref()));
        }
        GroupCmd::Remove { name, volumes } => {
            let req = pb::UpdateGroupRequest { name, add: Vec::new(), remove: volumes };
            let r = c.update_group(req).await.map_err(rpc_error)?;
            print_groups(out, std::slice::from_ref(r.get_ref()));
        }
        GroupCmd::Delete { name } => {
            c.delete_group(pb::DeleteGroupRequest { name: name.clone() }).await.map_err(rpc_error)?;
            crate::out::print_done(out, "deleted group", &name);
        }
        GroupCmd::List => {
            let r = c.list_groups(pb::ListGroupsRequest {}).await.map_err(rpc_error)?;
            print_groups(out, &r.get_ref().groups);
        }
        GroupCmd::Snapshot { group, name } => {
            let req = pb::CreateGroupSnapshotRequest { group, name };
            let r = c.create_group_snapshot(req).await.map_err(rpc_error)?;
            print_group_snapshots(out, std::slice::from_ref(r.get_ref()));
        }
        GroupCmd::Snapshots { group } => {
            let req = pb::ListGroupSnapshotsRequest { group: group.unwrap_or_default() };
            let r = c.list_group_snapshots(req).await.map_err(rpc_error)?;
            print_group_snapshots(out, &r.get_ref().snapshots);
        }
        GroupCmd::DeleteSnapshot { name } => {
            let req = pb::DeleteGroupSnapshotRequest { name: name.clone() };
            c.delete_group_snapshot(req).await.map_err(rpc_error)?;
            crate::out::print_done(out, "deleted group snapshot", &name);
        }
        GroupCmd::Clone { snapshot, new_group } => {
            let req = pb::CloneGroupSnapshotRequest { name: snapshot, new_group };
            let r = c.clone_group_snapshot(req).await.map_err(rpc_error)?;
            print_groups(out, std::slice::from_ref(r.get_ref()));
        }
    }
    Ok(())
}

pub fn print_groups(out: Output, groups: &[pb::Group]) {
    match out {
        Output::Json => println!(
            "{}",
            serde_json::Value::Array(
                groups
                    .iter()
                    .map(|g| json!({"name": g.name, "id": g.id, "volumes": g.volumes, "created_unix": g.created_unix}))
                    .collect()
            )
        ),
        Output::Table => {
            let rows = groups.iter().map(|g| vec![g.name.clone(), g.volumes.join(",")]).collect();
            println!("{}", table(&["GROUP", "VOLUMES"], rows));
        }
    }
}

pub fn print_group_snapshots(out: Output, snaps: &[pb::GroupSnapshot]) {
    match out {
        Output::Json => println!(
            "{}",
            serde_json::Value::Array(
                snaps
                    .iter()
                    .map(|g| json!({"name": g.name, "id": g.id, "group": g.group, "created_unix": g.created_unix,
                                    "members": g.members.iter().map(|m| json!({"snapshot": m.snapshot, "volume": m.volume}))
                                        .collect::<Vec<_>>()}))
                    .collect()
            )
        ),
        Output::Table => {
            let rows = snaps
                .iter()
                .map(|g| {
                    let members: Vec<String> = g.members.iter().map(|m| m.snapshot.clone()).collect();
                    vec![g.name.clone(), if g.group.is_empty() { "(deleted)".into() } else { g.group.clone() }, members.join(",")]
                })
                .collect();
            println!("{}", table(&["GROUP SNAPSHOT", "GROUP", "MEMBER SNAPSHOTS"], rows));
        }
    }
}
