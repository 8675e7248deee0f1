//! CSI snapshots: the engine's O(1) snapshots, ids `<node>/<snapshot>` like volumes (or
//! backups off the cluster, with a class's `backup` parameter: `backups.rs`). A
//! replicated volume's snapshot is taken on every copy at one point of its writes (the
//! daemons do it), so its id names no node either (`_/<snapshot>`): it is found on any node that
//! holds it, and outlives the node it was taken on.

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::shared::args::{no_parameters, paginate, require};
use crate::shared::ids;
use crate::shared::nodes::{NodeDirectory, admin};
use crate::spec::controller::Controller;

/// The node the ids of `volume`'s snapshots name: none (`_`) for a replicated volume, whose
/// snapshots are on every copy; else `node`, where it is.
async fn id_node<'a>(c: &mut AdminClient<Channel>, volume: &str, node: &'a str) -> Result<&'a str, Status> {
    let req = pb::ListReplicationsRequest { volume: volume.to_owned() };
    let held = c.list_sync_replicas(req).await?.into_inner().volumes;
    Ok(if held.is_empty() { node } else { ids::ANY })
}

pub(crate) fn snapshot_msg(node: &str, s: &pb::Snapshot) -> csi::Snapshot {
    csi::Snapshot {
        size_bytes: i64::try_from(s.size).unwrap_or(i64::MAX),
        snapshot_id: ids::make(node, &s.name),
        // Empty once the source volume is deleted (the snapshot lives on).
        source_volume_id: if s.volume.is_empty() { String::new() } else { ids::make(node, &s.volume) },
        creation_time: Some(prost_types::Timestamp {
            seconds: i64::try_from(s.created_unix).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        ready_to_use: true,
        group_snapshot_id: String::new(),
    }
}

/// A point the copies of a replicated volume hold alike (`<volume>.sync.<unix ms>`, the
/// daemons' own): not a CSI snapshot.
fn is_mark(s: &pb::Snapshot) -> bool {
    s.name
        .strip_prefix(&s.volume)
        .and_then(|r| r.strip_prefix(".sync."))
        .is_some_and(|ms| !ms.is_empty() && ms.bytes().all(|b| b.is_ascii_digit()))
}

/// A node that holds snapshot `id`, and the snapshot.
pub(crate) async fn holder(dir: &dyn NodeDirectory, id: &str) -> Result<(String, pb::Snapshot), Status> {
    let (at, silent) = crate::shared::copies::holders(dir, id).await?;
    match (at.into_iter().next(), silent.is_empty()) {
        (Some(held), _) => Ok(held),
        (None, true) => Err(Status::not_found(format!("snapshot {id:?} does not exist"))),
        (None, false) => Err(Status::unavailable(format!(
            "snapshot {id:?} was found on no node that answers; silent: {}",
            silent.join(", ")
        ))),
    }
}

impl Controller {
    pub(crate) async fn create_snapshot_impl(&self, r: csi::CreateSnapshotRequest) -> Result<csi::Snapshot, Status> {
        require("name", &r.name)?;
        require("source_volume_id", &r.source_volume_id)?;
        let mut rest = r.parameters.clone();
        rest.remove(crate::shared::backups::BACKUP);
        no_parameters(&rest)?;
        let backup = crate::shared::backups::target(&r.parameters)?;
        let name = ids::engine_name(&r.name);
        let _busy = self.busy.begin(&format!("snapshot name {}", r.name))?;
        // A replicated volume's snapshot is taken where its primary is now (its backup too).
        let (node, mut c, v) = crate::shared::copies::volume(&*self.nodes, &r.source_volume_id).await?;
        if let Some(target) = backup {
            return crate::shared::backups::create(&*self.nodes, &node, &v, target, &r.name, r.source_volume_id).await;
        }
        let (node, volume) = (node.as_str(), v.name.as_str());
        for known in ids::engine_names(&r.name) {
            match c.get_snapshot(pb::GetSnapshotRequest { name: known }).await {
                Ok(s) if s.get_ref().volume == volume => {
                    let at = id_node(&mut c, volume, node).await?;
                    return Ok(csi::Snapshot { source_volume_id: r.source_volume_id, ..snapshot_msg(at, s.get_ref()) });
                }
                Ok(_) => {
                    return Err(Status::already_exists(format!("snapshot {:?} exists for another volume", r.name)));
                }
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => return Err(s),
            }
        }
        let s = c.create_snapshot(pb::CreateSnapshotRequest { volume: volume.to_owned(), name }).await?.into_inner();
        let at = id_node(&mut c, volume, node).await?;
        tracing::info!(name = %r.name, snapshot_id = %ids::make(at, &s.name), "CSI snapshot created");
        Ok(csi::Snapshot { source_volume_id: r.source_volume_id, ..snapshot_msg(at, &s) })
    }

    pub(crate) async fn delete_snapshot_impl(&self, id: &str) -> Result<(), Status> {
        require("snapshot_id", id)?;
        let _busy = self.busy.begin(id)?;
        if ids::parse_backup(id).is_some() {
            return crate::shared::backups::delete(&*self.nodes, id).await;
        }
        let (at, silent) = match crate::shared::copies::holders(&*self.nodes, id).await {
            Err(s) if s.code() == Code::NotFound => return Ok(()),
            other => other?,
        };
        // Every copy goes, or none: a silent node may hold one (retried, as for volumes).
        if !silent.is_empty() {
            return Err(Status::unavailable(format!(
                "snapshot {id:?}: {} did not answer; nothing was deleted, deletion is retried",
                silent.join(", ")
            )));
        }
        for (node, snap) in at {
            let mut c = admin(&*self.nodes, &node).await?;
            match c.delete_snapshot(pb::DeleteSnapshotRequest { name: snap.name }).await {
                Ok(_) => {}
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => {
                    return Err(Status::new(s.code(), format!("deleting snapshot {id:?} on {node}: {}", s.message())));
                }
            }
        }
        Ok(())
    }

    pub(crate) async fn list_snapshots_impl(
        &self,
        r: csi::ListSnapshotsRequest,
    ) -> Result<csi::ListSnapshotsResponse, Status> {
        // A backup is listed when asked for by id (backups are the target's, not a node's).
        if ids::parse_backup(&r.snapshot_id).is_some() {
            let entries = match crate::shared::backups::snapshot(&*self.nodes, &r.snapshot_id).await {
                Ok(s) => vec![csi::list_snapshots_response::Entry { snapshot: Some(s) }],
                Err(s) if s.code() == Code::NotFound => Vec::new(),
                Err(s) => return Err(s),
            };
            return Ok(csi::ListSnapshotsResponse { entries, next_token: String::new() });
        }
        // Filters name one node (or nothing at all: an id we never made matches no snapshot).
        let wanted = |id: &str| ids::parse(id).map(|(n, x)| (n.to_owned(), x.to_owned()));
        let (snap, source) = (wanted(&r.snapshot_id), wanted(&r.source_volume_id));
        let mut nodes = self.nodes.nodes();
        if (!r.snapshot_id.is_empty() && snap.is_none()) || (!r.source_volume_id.is_empty() && source.is_none()) {
            nodes.clear();
        }
        // A replicated volume's id names no node: its snapshots are looked for everywhere.
        if let Some((n, _)) = snap.as_ref().or(source.as_ref()).filter(|(n, _)| n != ids::ANY) {
            nodes.retain(|x| x == n);
        }
        // Nodes that do not answer are skipped (and logged), as for ListVolumes.
        let (source, snap) = (&source, &snap);
        let listed = crate::shared::nodes::scan(&*self.nodes, nodes, |node, mut c| async move {
            let volume = source.as_ref().map(|(_, v)| v.clone()).unwrap_or_default();
            let mut list = match c.list_snapshots(pb::ListSnapshotsRequest { volume }).await {
                Ok(l) => l.into_inner().snapshots,
                Err(s) if s.code() == Code::NotFound => Vec::new(),
                Err(s) => return Err(s),
            };
            list.retain(|s| snap.as_ref().is_none_or(|(_, name)| &s.name == name) && !is_mark(s));
            list.sort_by(|a, b| a.name.cmp(&b.name));
            let sync = c.list_sync_replicas(pb::ListReplicationsRequest::default()).await?.into_inner().volumes;
            let msg = |s: &pb::Snapshot| match sync.iter().any(|v| v.volume == s.volume) {
                true => snapshot_msg(ids::ANY, s),
                false => snapshot_msg(&node, s),
            };
            Ok(list.iter().map(msg).collect::<Vec<_>>())
        })
        .await?;
        // A replicated volume's snapshot is on each of its copies: listed once.
        let mut all: Vec<csi::Snapshot> = listed.answers.into_iter().flat_map(|(_, s)| s).collect();
        let mut seen = std::collections::BTreeSet::new();
        all.retain(|s| seen.insert(s.snapshot_id.clone()));
        let (page, next_token) = paginate(all, r.max_entries, &r.starting_token)?;
        let entries = page.into_iter().map(|s| csi::list_snapshots_response::Entry { snapshot: Some(s) }).collect();
        Ok(csi::ListSnapshotsResponse { entries, next_token })
    }

    pub(crate) async fn get_snapshot_impl(&self, id: &str) -> Result<csi::Snapshot, Status> {
        require("snapshot_id", id)?;
        if ids::parse_backup(id).is_some() {
            return crate::shared::backups::snapshot(&*self.nodes, id).await;
        }
        let (node, s) = holder(&*self.nodes, id).await?;
        let at = if id.starts_with(&ids::make(ids::ANY, "")) { ids::ANY } else { node.as_str() };
        Ok(snapshot_msg(at, &s))
    }
}
