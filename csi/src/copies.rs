//! Replicated volumes (a StorageClass's `replicas: "2"` or `"3"`): copies of one volume on
//! distinct nodes, kept in step by the daemons' synchronous replicas. The controller still keeps
//! no state: a volume id names the node the volume was made on, and which node holds the primary
//! now is asked of the daemons (the copy that calls itself primary, newest generation first).

use std::collections::HashMap;

use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::nodes::{NodeDirectory, SCAN, admin, scan};

/// The StorageClass parameter: how many copies (1, the default, is a local volume).
pub const REPLICAS: &str = "replicas";
/// Most copies a class may ask for.
const MOST: usize = 3;

/// The copies `params` ask for.
pub fn replicas(params: &HashMap<String, String>) -> Result<usize, Status> {
    match params.get(REPLICAS).map(String::as_str) {
        None => Ok(1),
        Some(v) => match v.parse::<usize>() {
            Ok(n @ 1..=MOST) => Ok(n),
            _ => Err(Status::invalid_argument(format!("parameter {REPLICAS} must be 1 to {MOST}, not {v:?}"))),
        },
    }
}

/// `node`'s view of `volume`'s synchronous membership (None: a local volume there).
async fn view(c: &mut AdminClient<Channel>, volume: &str) -> Result<Option<pb::SyncVolume>, Status> {
    let r = c.list_sync_replicas(pb::ListReplicationsRequest { volume: volume.to_owned() }).await?;
    Ok(r.into_inner().volumes.into_iter().find(|v| v.volume == volume))
}

/// The node whose admin endpoint is `endpoint`.
fn node_of(dir: &dyn NodeDirectory, endpoint: &str) -> Option<String> {
    dir.nodes().into_iter().find(|n| dir.admin_endpoint(n).as_deref() == Some(endpoint))
}

/// What a node holds of volume `name`: a client there, the volume, and its membership; within
/// [`SCAN`] (a node that does not answer in time is Unavailable, as one that refuses).
async fn held(
    dir: &dyn NodeDirectory,
    node: &str,
    name: &str,
) -> Result<(AdminClient<Channel>, pb::Volume, Option<pb::SyncVolume>), Status> {
    let ask = async {
        let mut c = admin(dir, node).await?;
        let v = c.get_volume(pb::GetVolumeRequest { name: name.to_owned() }).await?.into_inner();
        let s = view(&mut c, name).await?;
        Ok((c, v, s))
    };
    tokio::time::timeout(SCAN, ask)
        .await
        .unwrap_or_else(|_| Err(Status::unavailable(format!("node {node}: no answer within {SCAN:?}"))))
}

/// Where volume `name` is served now: its node, a client there, the volume, and its membership
/// (None for a local volume). `hint` is where to ask first (the node its id names); a copy that
/// is not the primary says which is, and when neither answers every other node is asked at
/// once, each within [`SCAN`]. NotFound when no node holds it.
pub async fn primary(
    dir: &dyn NodeDirectory,
    hint: &str,
    name: &str,
) -> Result<(String, AdminClient<Channel>, pb::Volume, Option<pb::SyncVolume>), Status> {
    let not_found = || Status::not_found(format!("volume {name:?} does not exist"));
    let mut tried = Vec::new();
    let mut next = Some(hint.to_owned());
    let mut unreachable = None;
    while let Some(node) = next.take() {
        tried.push(node.clone());
        match held(dir, &node, name).await {
            Ok((c, v, None)) => return Ok((node, c, v, None)),
            Ok((c, v, Some(s))) if s.role == "primary" => return Ok((node, c, v, Some(s))),
            Ok((_, _, Some(s))) => next = node_of(dir, &s.primary).filter(|n| !tried.contains(n)),
            Err(s) if s.code() == Code::NotFound => return Err(not_found()),
            Err(s) if matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded) => unreachable = Some(s),
            Err(s) => return Err(s),
        }
    }
    // The named copies do not answer as primary: the newest generation that does, anywhere.
    let others: Vec<String> = dir.nodes().into_iter().filter(|n| !tried.contains(n)).collect();
    let found = scan(dir, others, |_, mut c| async move {
        let v = match c.get_volume(pb::GetVolumeRequest { name: name.to_owned() }).await {
            Ok(v) => v.into_inner(),
            // Silent nodes are logged as such; any other answer means it holds no primary.
            Err(s) if s.code() == Code::Unavailable => return Err(s),
            Err(_) => return Ok(None),
        };
        Ok(view(&mut c, name).await.ok().flatten().filter(|s| s.role == "primary").map(|s| (c, v, s)))
    })
    .await?;
    let best = found.answers.into_iter().filter_map(|(n, a)| Some((n, a?))).max_by_key(|(_, (_, _, s))| s.generation);
    match (best, unreachable) {
        (Some((n, (c, v, s))), _) => Ok((n, c, v, Some(s))),
        (None, Some(s)) => Err(s),
        (None, None) => Err(Status::unavailable(format!(
            "volume {name:?}: no copy answers as its primary (asked {})",
            tried.join(", ")
        ))),
    }
}

/// The nodes of every copy of `view` (the primary's first), as the directory names them.
pub fn nodes_of(dir: &dyn NodeDirectory, view: &pb::SyncVolume) -> Vec<String> {
    let mut eps: Vec<&str> = vec![view.primary.as_str()];
    eps.extend(
        view.members.iter().filter(|m| m.state != "witness" && m.endpoint != view.primary).map(|m| m.endpoint.as_str()),
    );
    eps.into_iter().filter_map(|e| node_of(dir, e)).collect()
}

/// Makes `volume` (on `node`, its primary) have `n` copies: keeps the members it has and adds
/// nodes with the most free space that hold no copy yet. ResourceExhausted when too few nodes
/// answer.
pub async fn ensure(dir: &dyn NodeDirectory, node: &str, volume: &str, n: usize) -> Result<Vec<String>, Status> {
    let mut c = admin(dir, node).await?;
    let mut have = match view(&mut c, volume).await? {
        Some(v) => nodes_of(dir, &v),
        None => vec![node.to_owned()],
    };
    if have.len() >= n {
        return Ok(have);
    }
    let mut candidates = Vec::new();
    for other in dir.nodes().into_iter().filter(|o| !have.contains(o)) {
        let Ok(mut oc) = admin(dir, &other).await else { continue };
        let Ok(s) = oc.pool_status(pb::PoolStatusRequest {}).await else { continue };
        // A node that has a volume of this name already cannot take a copy.
        if oc.get_volume(pb::GetVolumeRequest { name: volume.to_owned() }).await.is_ok() {
            continue;
        }
        candidates.push((s.into_inner().free, other));
    }
    candidates.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let wanted = n - have.len();
    if candidates.len() < wanted {
        return Err(Status::resource_exhausted(format!(
            "{n} copies of {volume:?} need {wanted} more nodes with a daemon that answers; {} found",
            candidates.len()
        )));
    }
    for (_, other) in candidates.into_iter().take(wanted) {
        let peer = dir.admin_endpoint(&other).ok_or_else(|| Status::not_found(format!("unknown node {other:?}")))?;
        let r = pb::AddSyncReplicaRequest { volume: volume.to_owned(), peer, witness: false };
        c.add_sync_replica(r)
            .await
            .map_err(|s| Status::new(s.code(), format!("adding a copy of {volume:?} on {other}: {}", s.message())))?;
        tracing::info!(volume, node = %other, "copy added");
        have.push(other);
    }
    Ok(have)
}

/// Removes every copy of `volume` but the primary's (on `node`), and deletes them where their
/// node answers; a node that does not keeps a read-only copy, which its daemon lists.
pub async fn remove_all(dir: &dyn NodeDirectory, node: &str, view: &pb::SyncVolume) -> Result<(), Status> {
    let mut c = admin(dir, node).await?;
    for m in view.members.iter().filter(|m| m.endpoint != view.primary) {
        let r = pb::RemoveSyncReplicaRequest { volume: view.volume.clone(), peer: m.endpoint.clone() };
        match c.remove_sync_replica(r).await {
            Ok(_) => {}
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(s),
        }
        let Some(other) = node_of(dir, &m.endpoint) else { continue };
        let deleted = match admin(dir, &other).await {
            Ok(mut oc) => match oc.delete_volume(pb::DeleteVolumeRequest { name: view.volume.clone() }).await {
                Ok(_) => Ok(()),
                Err(s) if s.code() == Code::NotFound => Ok(()),
                Err(s) => Err(s),
            },
            Err(s) => Err(s),
        };
        if let Err(s) = deleted {
            tracing::warn!(volume = %view.volume, node = %other, error = %s.message(),
                "a removed copy could not be deleted; it stays read-only there");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_parameter() {
        let p = |v: &str| HashMap::from([(REPLICAS.to_owned(), v.to_owned())]);
        assert_eq!(replicas(&HashMap::new()).unwrap(), 1);
        assert_eq!(replicas(&p("3")).unwrap(), 3);
        for bad in ["0", "4", "two", "-1", ""] {
            assert_eq!(replicas(&p(bad)).unwrap_err().code(), Code::InvalidArgument, "{bad}");
        }
    }
}
