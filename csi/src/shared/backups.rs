//! Snapshots that are backups: a VolumeSnapshotClass with `backup: <target>` (a target every
//! daemon's config names) makes CreateSnapshot back the volume up off the cluster, DeleteSnapshot
//! delete the backup, and CreateVolume from such a snapshot restore it (instantly: the volume
//! serves while its chunks are copied). The id says where it is, as for volumes:
//! `backup:<target>/<volume>/<backup id>` ([`ids::make_backup`]), so the controller keeps no
//! state. The backup's id is named after the CSI snapshot, so a retry finds what the call before
//! made or resumes what it began.

use std::collections::HashMap;
use std::time::Duration;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::kind::Kind;
use tokio_stream::StreamExt;
use tonic::{Code, Status};

use crate::shared::ids;
use crate::shared::nodes::{NodeDirectory, admin, backups};

/// The VolumeSnapshotClass parameter: its snapshots are backups to this target.
pub const BACKUP: &str = "backup";

/// How long CreateSnapshot waits for a backup before answering "not ready yet" (the
/// snapshotter asks again until it is).
const WAIT: Duration = Duration::from_secs(5);

/// The target a snapshot class's parameters name, if it is a backup class.
pub fn target(params: &HashMap<String, String>) -> Result<Option<&str>, Status> {
    match params.get(BACKUP) {
        Some(t) if !ids::valid_name(t) => Err(Status::invalid_argument(format!("invalid backup target {t:?}"))),
        t => Ok(t.map(String::as_str)),
    }
}

/// A backup as a CSI snapshot.
fn snapshot_msg(target: &str, b: &pb::Backup, source_volume_id: String) -> csi::Snapshot {
    csi::Snapshot {
        size_bytes: i64::try_from(b.size).unwrap_or(i64::MAX),
        snapshot_id: ids::make_backup(target, &b.volume, &b.id),
        source_volume_id,
        creation_time: Some(prost_types::Timestamp {
            seconds: i64::try_from(b.created_unix).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        ready_to_use: true,
        group_snapshot_id: String::new(),
    }
}

/// The snapshot a backup to `target` takes first (the daemons' `VOLUME.backup.TARGET.ID`,
/// `ferrite_backup::auto_snapshot`); before Ferrite 0.3 it was `VOLUME.backup.ID`.
fn base_snapshots(volume: &str, target: &str, id: &str) -> [String; 2] {
    [format!("{volume}.backup.{target}.{id}"), format!("{volume}.backup.{id}")]
}

/// Backs up volume `volume` (served on `node`, its id `source_volume_id`) to `target` as the
/// backup CSI snapshot `csi_name` names: done (ready) if it was made before or ends within
/// [`WAIT`], else begun (or resumed) and not ready; what it failed with if it failed.
pub(crate) async fn create(
    dir: &dyn NodeDirectory,
    node: &str,
    volume: &pb::Volume,
    target: &str,
    csi_name: &str,
    source_volume_id: String,
) -> Result<csi::Snapshot, Status> {
    let id = ids::backup_id(csi_name);
    let mut c = backups(dir, node).await?;
    let req = pb::CreateBackupRequest {
        target: target.to_owned(),
        volume: volume.name.clone(),
        id: id.clone(),
        ..Default::default()
    };
    let mut progress = match c.create_backup(req).await {
        Ok(s) => s.into_inner(),
        // Running already (this snapshot's backup, begun by the call before, or another).
        Err(s) if s.code() == Code::Aborted => return pending(dir, node, volume, target, &id, source_volume_id).await,
        // The class names a target this daemon's config does not: the class is wrong.
        Err(s) if Kind::UnknownTarget.is(&s) => {
            return Err(Status::invalid_argument(format!("the snapshot class's backup target: {}", s.message())));
        }
        Err(s) => {
            return Err(Status::new(s.code(), format!("backing up {} to {target}: {}", volume.name, s.message())));
        }
    };
    let waited = tokio::time::timeout(WAIT, async {
        while let Some(p) = progress.next().await {
            if let Some(b) = p?.backup {
                return Ok(Some(b));
            }
        }
        Ok::<_, Status>(None)
    })
    .await;
    match waited {
        Ok(Ok(Some(b))) => {
            tracing::info!(name = %csi_name, backup = %b.name, target, "CSI snapshot backed up");
            Ok(snapshot_msg(target, &b, source_volume_id))
        }
        Ok(Err(s)) => Err(Status::new(s.code(), format!("backing up {} to {target}: {}", volume.name, s.message()))),
        // Still running (on the daemon, which goes on without us), or its stream ended early.
        Ok(Ok(None)) | Err(_) => pending(dir, node, volume, target, &id, source_volume_id).await,
    }
}

/// A backup begun and not done: not ready, its time the moment its snapshot was taken.
async fn pending(
    dir: &dyn NodeDirectory,
    node: &str,
    volume: &pb::Volume,
    target: &str,
    id: &str,
    source_volume_id: String,
) -> Result<csi::Snapshot, Status> {
    let [name, _] = base_snapshots(&volume.name, target, id);
    let s = match admin(dir, node).await?.get_snapshot(pb::GetSnapshotRequest { name }).await {
        Ok(s) => s.into_inner(),
        // Another backup of the volume runs and this one has not begun: asked again later.
        Err(s) if s.code() == Code::NotFound => {
            return Err(Status::unavailable(format!(
                "a backup of {} is running; this one begins after it",
                volume.name
            )));
        }
        Err(s) => return Err(s),
    };
    let b = pb::Backup {
        volume: volume.name.clone(),
        id: id.to_owned(),
        created_unix: s.created_unix,
        size: s.size,
        ..Default::default()
    };
    Ok(csi::Snapshot { ready_to_use: false, ..snapshot_msg(target, &b, source_volume_id) })
}

/// The backup snapshot `id` names, asked of the first node that answers; NotFound if no backup
/// has that id.
pub(crate) async fn get(dir: &dyn NodeDirectory, id: &str) -> Result<(String, pb::Backup), Status> {
    let (target, volume, backup) =
        ids::parse_backup(id).ok_or_else(|| Status::not_found(format!("snapshot {id:?} does not exist")))?;
    let mut last = Status::unavailable("the directory knows no node");
    for node in dir.nodes() {
        let req = pb::GetBackupRequest { target: target.to_owned(), name: format!("{volume}/{backup}") };
        let mut c = match backups(dir, &node).await {
            Ok(c) => c,
            Err(s) => {
                last = s;
                continue;
            }
        };
        match c.get_backup(req).await {
            Ok(b) => return Ok((node, b.into_inner())),
            Err(s) if Kind::UnknownTarget.is(&s) => last = s,
            Err(s) if s.code() == Code::NotFound => {
                return Err(Status::not_found(format!("snapshot {id:?} does not exist")));
            }
            Err(s) => last = s,
        }
    }
    Err(Status::new(last.code(), format!("snapshot {id:?}: {}", last.message())))
}

/// The backup snapshot `id` as CSI says it.
pub(crate) async fn snapshot(dir: &dyn NodeDirectory, id: &str) -> Result<csi::Snapshot, Status> {
    let (target, _, _) = ids::parse_backup(id).expect("a backup id");
    let (_, b) = get(dir, id).await?;
    Ok(snapshot_msg(target, &b, String::new()))
}

/// Deletes the backup snapshot `id` names and the snapshot it was taken from, wherever it is
/// (the base of the volume's next incremental: without it, that one reads the whole volume).
pub(crate) async fn delete(dir: &dyn NodeDirectory, id: &str) -> Result<(), Status> {
    let Some((target, volume, backup)) = ids::parse_backup(id) else { return Ok(()) };
    let (node, _) = match get(dir, id).await {
        Err(s) if s.code() == Code::NotFound => return Ok(()),
        other => other?,
    };
    let req = pb::DeleteBackupRequest { target: target.to_owned(), name: format!("{volume}/{backup}") };
    match backups(dir, &node).await?.delete_backup(req).await {
        Ok(_) => {}
        Err(s) if s.code() == Code::NotFound => {}
        Err(s) => return Err(s),
    }
    for base in base_snapshots(volume, target, backup) {
        let (at, _) = crate::shared::copies::holders(dir, &ids::make(ids::ANY, &base)).await?;
        for (node, s) in at {
            match admin(dir, &node).await?.delete_snapshot(pb::DeleteSnapshotRequest { name: s.name }).await {
                Ok(_) => {}
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => return Err(s),
            }
        }
    }
    tracing::info!(snapshot_id = %id, "CSI backup snapshot deleted");
    Ok(())
}

/// Restores the backup snapshot `id` names as volume `name` on `node` (it serves at once; its
/// chunks are copied in the background), encrypted with `encryption` when the backup's volume
/// was; the volume restored.
pub(crate) async fn restore(
    dir: &dyn NodeDirectory,
    id: &str,
    node: &str,
    name: &str,
    encryption: Option<pb::KeyRef>,
) -> Result<pb::Volume, Status> {
    let (target, volume, backup) = ids::parse_backup(id).expect("a backup id");
    let (_, b) = get(dir, id).await?;
    if b.encrypted_volume != encryption.is_some() {
        return Err(Status::invalid_argument(match b.encrypted_volume {
            true => format!("snapshot {id:?} is a backup of an encrypted volume: restore it with an encrypted class"),
            false => format!("snapshot {id:?} is a backup of a plain volume: an encrypted class cannot restore it"),
        }));
    }
    let req = pb::RestoreBackupRequest {
        target: target.to_owned(),
        name: format!("{volume}/{backup}"),
        volume: name.to_owned(),
        encryption,
        detach: true,
    };
    let mut progress = backups(dir, node).await?.restore_backup(req).await?.into_inner();
    // The first message: the volume exists and serves.
    if let Some(p) = progress.next().await {
        p?;
    }
    let v = admin(dir, node).await?.get_volume(pb::GetVolumeRequest { name: name.to_owned() }).await?.into_inner();
    tracing::info!(snapshot_id = %id, volume = %name, node, "CSI volume restored from a backup (its copy goes on)");
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backup_class_names_a_valid_target() {
        let p = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(target(&p(&[])).unwrap(), None);
        assert_eq!(target(&p(&[("backup", "offsite")])).unwrap(), Some("offsite"));
        assert!(target(&p(&[("backup", "a/b")])).is_err());
    }
}
