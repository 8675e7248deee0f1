//! CSI snapshots: the engine's O(1) snapshots, ids `<node>/<snapshot>` like volumes.

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Code, Status};

use crate::args::{no_parameters, paginate, require};
use crate::controller::Controller;
use crate::ids;
use crate::nodes::admin;

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

impl Controller {
    pub(crate) async fn create_snapshot_impl(&self, r: csi::CreateSnapshotRequest) -> Result<csi::Snapshot, Status> {
        require("name", &r.name)?;
        require("source_volume_id", &r.source_volume_id)?;
        no_parameters(&r.parameters)?;
        let name = ids::engine_name(&r.name);
        let _busy = self.busy.begin(&format!("snapshot name {}", r.name))?;
        // A replicated volume's snapshot is taken where its primary is now.
        let (node, mut c, v) = crate::nodes::volume(&*self.nodes, &r.source_volume_id).await?;
        let (node, volume) = (node.as_str(), v.name.as_str());
        for known in ids::engine_names(&r.name) {
            match c.get_snapshot(pb::GetSnapshotRequest { name: known }).await {
                Ok(s) if s.get_ref().volume == volume => {
                    return Ok(csi::Snapshot {
                        source_volume_id: r.source_volume_id,
                        ..snapshot_msg(node, s.get_ref())
                    });
                }
                Ok(_) => {
                    return Err(Status::already_exists(format!("snapshot {:?} exists for another volume", r.name)));
                }
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => return Err(s),
            }
        }
        let s = c.create_snapshot(pb::CreateSnapshotRequest { volume: volume.to_owned(), name }).await?.into_inner();
        tracing::info!(name = %r.name, snapshot_id = %ids::make(node, &s.name), "CSI snapshot created");
        Ok(csi::Snapshot { source_volume_id: r.source_volume_id, ..snapshot_msg(node, &s) })
    }

    pub(crate) async fn delete_snapshot_impl(&self, id: &str) -> Result<(), Status> {
        require("snapshot_id", id)?;
        let _busy = self.busy.begin(id)?;
        let Some((node, name)) = ids::parse(id) else { return Ok(()) };
        if self.nodes.admin_endpoint(node).is_none() {
            return Ok(());
        }
        let mut c = admin(&*self.nodes, node).await?;
        match c.delete_snapshot(pb::DeleteSnapshotRequest { name: name.to_owned() }).await {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::NotFound => Ok(()),
            Err(s) => Err(s),
        }
    }

    pub(crate) async fn list_snapshots_impl(
        &self,
        r: csi::ListSnapshotsRequest,
    ) -> Result<csi::ListSnapshotsResponse, Status> {
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
        let listed = crate::nodes::scan(&*self.nodes, nodes, |node, mut c| async move {
            let volume = source.as_ref().map(|(_, v)| v.clone()).unwrap_or_default();
            let mut list = match c.list_snapshots(pb::ListSnapshotsRequest { volume }).await {
                Ok(l) => l.into_inner().snapshots,
                Err(s) if s.code() == Code::NotFound => Vec::new(),
                Err(s) => return Err(s),
            };
            list.retain(|s| snap.as_ref().is_none_or(|(_, name)| &s.name == name) && !is_mark(s));
            list.sort_by(|a, b| a.name.cmp(&b.name));
            let sync = c.list_sync_replicas(pb::ListReplicationsRequest::default()).await?.into_inner().volumes;
            let msg = |s: &pb::Snapshot| {
                let mut m = snapshot_msg(&node, s);
                if sync.iter().any(|v| v.volume == s.volume) {
                    m.source_volume_id = ids::make(ids::ANY, &s.volume);
                }
                m
            };
            Ok(list.iter().map(msg).collect::<Vec<_>>())
        })
        .await?;
        let all: Vec<_> = listed.answers.into_iter().flat_map(|(_, s)| s).collect();
        let (page, next_token) = paginate(all, r.max_entries, &r.starting_token)?;
        let entries = page.into_iter().map(|s| csi::list_snapshots_response::Entry { snapshot: Some(s) }).collect();
        Ok(csi::ListSnapshotsResponse { entries, next_token })
    }

    pub(crate) async fn get_snapshot_impl(&self, id: &str) -> Result<csi::Snapshot, Status> {
        require("snapshot_id", id)?;
        let not_found = || Status::not_found(format!("snapshot {id:?} does not exist"));
        let (node, name) = ids::parse(id).ok_or_else(not_found)?;
        if self.nodes.admin_endpoint(node).is_none() {
            return Err(not_found());
        }
        let mut c = admin(&*self.nodes, node).await?;
        let s = c.get_snapshot(pb::GetSnapshotRequest { name: name.to_owned() }).await?.into_inner();
        Ok(snapshot_msg(node, &s))
    }
}
