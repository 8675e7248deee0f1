//! `ferrite snapshot ...`: snapshots and the ranges that changed between them.

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, format_time, rpc_error, table};
use ferrite_daemon::base::size::format_size;

#[derive(clap::Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a volume: `ferrite snapshot create db nightly` (O(1), durable on return).
    Create { volume: String, name: String },
    /// List snapshots (of one volume if given).
    List { volume: Option<String> },
    /// Show one snapshot.
    Show { name: String },
    /// Delete a snapshot; clones and later snapshots keep what they need.
    Delete { name: String },
    /// Ranges of a volume (`db`) or snapshot (`db@nightly`) changed since an earlier snapshot
    /// (`--since`), or its allocated ranges without one.
    Diff {
        image: String,
        #[arg(long)]
        since: Option<String>,
    },
}

pub async fn run(c: &mut Admin, out: Output, cmd: SnapshotCmd) -> Result<()> {
    match cmd {
        SnapshotCmd::Create { volume, name } => {
            let s = c.create_snapshot(pb::CreateSnapshotRequest { volume, name }).await.map_err(rpc_error)?;
            print_snapshot(out, s.get_ref());
        }
        SnapshotCmd::List { volume } => {
            let req = pb::ListSnapshotsRequest { volume: volume.unwrap_or_default() };
            let r = c.list_snapshots(req).await.map_err(rpc_error)?;
            print_snapshots(out, &r.get_ref().snapshots);
        }
        SnapshotCmd::Show { name } => {
            let s = c.get_snapshot(pb::GetSnapshotRequest { name }).await.map_err(rpc_error)?;
            print_snapshot(out, s.get_ref());
        }
        SnapshotCmd::Delete { name } => {
            c.delete_snapshot(pb::DeleteSnapshotRequest { name: name.clone() }).await.map_err(rpc_error)?;
            crate::out::print_done(out, "deleted snapshot", &name);
        }
        SnapshotCmd::Diff { image, since } => {
            use pb::changed_ranges_request::Image;
            let image = match image.split_once('@') {
                Some((_, snap)) => Image::Snapshot(snap.to_owned()),
                None => Image::Volume(image),
            };
            let req = pb::ChangedRangesRequest { image: Some(image), since: since.unwrap_or_default() };
            let r = c.changed_ranges(req).await.map_err(rpc_error)?;
            print_ranges(out, r.get_ref());
        }
    }
    Ok(())
}

fn snapshot_json(s: &pb::Snapshot) -> serde_json::Value {
    json!({"name": s.name, "id": s.id, "volume": s.volume, "volume_id": s.volume_id, "size": s.size,
           "created_unix": s.created_unix, "layer_bytes": s.layer_bytes,
           "reclaimable_on_delete": s.reclaimable_on_delete})
}

pub fn print_snapshots(out: Output, snaps: &[pb::Snapshot]) {
    match out {
        Output::Json => println!("{}", serde_json::Value::Array(snaps.iter().map(snapshot_json).collect())),
        Output::Table => {
            let rows = snaps
                .iter()
                .map(|s| {
                    vec![
                        s.name.clone(),
                        if s.volume.is_empty() { "(deleted)".into() } else { s.volume.clone() },
                        format_size(s.size),
                        format_size(s.layer_bytes),
                        format_size(s.reclaimable_on_delete),
                        format_time(s.created_unix),
                    ]
                })
                .collect();
            println!("{}", table(&["SNAPSHOT", "VOLUME", "SIZE", "CHANGED", "FREED ON DELETE", "CREATED (UTC)"], rows));
        }
    }
}

pub fn print_snapshot(out: Output, s: &pb::Snapshot) {
    match out {
        Output::Json => println!("{}", snapshot_json(s)),
        Output::Table => {
            let rows = vec![
                vec!["name".into(), s.name.clone()],
                vec!["id".into(), s.id.to_string()],
                vec!["volume".into(), if s.volume.is_empty() { "(deleted)".into() } else { s.volume.clone() }],
                vec!["size".into(), format!("{} ({} bytes)", format_size(s.size), s.size)],
                vec!["changed since previous".into(), format_size(s.layer_bytes)],
                vec!["freed on delete".into(), format_size(s.reclaimable_on_delete)],
            ];
            println!("{}", table(&["FIELD", "VALUE"], rows));
        }
    }
}

pub fn print_ranges(out: Output, r: &pb::ChangedRangesResponse) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"bytes": r.bytes,
                   "ranges": r.ranges.iter().map(|x| json!({"offset": x.offset, "length": x.length})).collect::<Vec<_>>()})
        ),
        Output::Table => {
            let rows = r.ranges.iter().map(|x| vec![x.offset.to_string(), x.length.to_string()]).collect();
            println!("{}", table(&["OFFSET", "LENGTH"], rows));
            println!("{} in {} ranges", format_size(r.bytes), r.ranges.len());
        }
    }
}
