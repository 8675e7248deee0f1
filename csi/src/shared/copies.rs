//! Replicated volumes (a StorageClass's `replicas: "2"` or `"3"`): copies of one volume on
//! distinct nodes, kept in step by the daemons' synchronous replicas. A replicated volume's id
//! names no node: which nodes hold its copies is the controller's record where the directory
//! keeps one (Kubernetes: `nodes::placements`), and which copy serves it now is asked of them
//! ([`locate`]: the copy that calls itself primary with a majority of the members behind it).

use std::collections::BTreeMap;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use futures_util::StreamExt;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::shared::class::Spread;
use crate::shared::ids;
use crate::shared::nodes::placements::{Placed, confirmed, recorded_on, share_cap};
use crate::shared::nodes::{NodeDirectory, SCAN, admin, scan};

/// The node serving the volume a CSI volume id names (for a replicated volume, the node of its
/// primary now), an admin client for it, and the volume; NotFound when it does not exist.
pub async fn volume(
    dir: &dyn NodeDirectory,
    volume_id: &str,
) -> Result<(String, AdminClient<Channel>, pb::Volume), Status> {
    let not_found = || Status::not_found(format!("volume {volume_id:?} does not exist"));
    let (node, name) = ids::parse(volume_id).ok_or_else(not_found)?;
    let (node, c, v, _) = primary(dir, node, name).await?;
    Ok((node, c, v))
}

/// The nodes that hold snapshot `id` with what each says of it (for an id naming a node, only
/// that one, if the directory knows it; of a recorded volume, only its recorded nodes), and the
/// nodes that did not answer; NotFound for an id we never made.
pub(crate) async fn holders(
    dir: &dyn NodeDirectory,
    id: &str,
) -> Result<(Vec<(String, pb::Snapshot)>, Vec<String>), Status> {
    let (node, name) = ids::parse(id).ok_or_else(|| Status::not_found(format!("snapshot {id:?} does not exist")))?;
    let nodes = match node {
        ids::ANY => dir.nodes(),
        n if dir.admin_endpoint(n).is_some() => vec![n.to_owned()],
        _ => Vec::new(),
    };
    let found = scan(dir, nodes, |_, mut c| async move {
        match c.get_snapshot(pb::GetSnapshotRequest { name: name.to_owned() }).await {
            Ok(s) => Ok(Some(s.into_inner())),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(s),
        }
    })
    .await?;
    let silent = found.silent.iter().map(|(n, _)| n.clone()).collect();
    // A node's snapshot of a volume counts only where the volume is recorded on it.
    let ours = |n: &str, s: &pb::Snapshot| recorded_on(dir.placements(), n, &s.volume);
    let mut at: Vec<(String, pb::Snapshot)> =
        found.answers.into_iter().filter_map(|(n, s)| Some((n, s?))).filter(|(n, s)| ours(n, s)).collect();
    at.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((at, silent))
}

/// The CSI VolumeCondition of a volume as its primary sees it: abnormal while it refuses writes
/// (no majority of its members in sync) or a copy is ejected (failed); a copy rebuilding is
/// said, not abnormal.
pub fn condition(sync: Option<&pb::SyncVolume>) -> csi::VolumeCondition {
    let Some(s) = sync else { return csi::VolumeCondition { abnormal: false, message: "ok".into() } };
    let mut problems = Vec::new();
    if !s.refused.is_empty() {
        problems.push(format!("refuses writes: {}", s.refused));
    }
    for m in s.members.iter().filter(|m| m.state == "ejected") {
        problems.push(format!("the copy at {} failed: {}", m.endpoint, m.reason));
    }
    let rebuilding: Vec<&str> =
        s.members.iter().filter(|m| m.state == "rebuilding").map(|m| m.endpoint.as_str()).collect();
    let abnormal = !problems.is_empty();
    if !rebuilding.is_empty() {
        problems.push(format!("rebuilding the copy at {}", rebuilding.join(", ")));
    }
    let message = if problems.is_empty() { "ok: every copy in sync".to_owned() } else { problems.join("; ") };
    csi::VolumeCondition { abnormal, message }
}

/// `node`'s view of `volume`'s synchronous membership (None: a local volume there).
pub(crate) async fn view(c: &mut AdminClient<Channel>, volume: &str) -> Result<Option<pb::SyncVolume>, Status> {
    let r = c.list_sync_replicas(pb::ListReplicationsRequest { volume: volume.to_owned() }).await?;
    Ok(r.into_inner().volumes.into_iter().find(|v| v.volume == volume))
}

/// The node whose admin endpoint is `endpoint`.
pub fn node_of(dir: &dyn NodeDirectory, endpoint: &str) -> Option<String> {
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

/// Where the copies of a volume were found (`locate`).
#[derive(Debug)]
pub struct Found {
    /// The copy that answers as primary (the newest generation's), or the local volume: its
    /// node, a client there, the volume, and its membership (None for a local volume).
    pub primary: Option<(String, AdminClient<Channel>, pb::Volume, Option<pb::SyncVolume>)>,
    /// Copies that are not the primary, by node, when no primary answered.
    pub copies: Vec<(String, pb::SyncVolume)>,
    /// Nodes that did not answer.
    pub silent: Vec<String>,
}

/// The node that last served each volume as primary (volume name → node): where a lookup asks
/// first, so that a volume whose id names no node (or a node that no longer holds it) costs
/// one call, not a scan. A wrong entry costs one call more.
static LAST_SEEN: std::sync::Mutex<BTreeMap<String, String>> = std::sync::Mutex::new(BTreeMap::new());
/// Entries kept before the map starts over.
const MOST_REMEMBERED: usize = 1 << 16;

fn remember(name: &str, node: &str) {
    let mut m = LAST_SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if m.len() >= MOST_REMEMBERED {
        m.clear();
    }
    m.insert(name.to_owned(), node.to_owned());
}

fn last_seen(name: &str) -> Option<String> {
    LAST_SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(name).cloned()
}

/// Finds volume `name`. Where the directory keeps the controller's record of where volumes
/// live, only the recorded nodes are asked, all at once, and a copy that calls itself primary
/// counts only with a majority of the recorded members behind it ([`confirmed`]); a volume made
/// before the record is found as below, then recorded once its primary is so confirmed by its
/// own members. Without a record (a directory the operator wrote), see [`ask_around`].
pub async fn locate(dir: &dyn NodeDirectory, hint: &str, name: &str) -> Result<Found, Status> {
    let Some(records) = dir.placements() else { return ask_around(dir, hint, name).await };
    if let Some(placed) = records.get(name) {
        return recorded(dir, &placed, name).await;
    }
    let found = ask_around(dir, hint, name).await?;
    let Some((node, _, _, view)) = &found.primary else { return Ok(found) };
    let placed = match view {
        None => Placed { copies: vec![node.clone()], witness: None },
        Some(v) => placed_of(dir, v),
    };
    let checked = recorded(dir, &placed, name).await?;
    if checked.primary.as_ref().is_some_and(|p| p.0 == *node) {
        // Recorded at the next lookup if this one fails: the volume is served meanwhile.
        match records.update(name, |p| p.clone_from(&placed)).await {
            Ok(_) => tracing::warn!(volume = name, copies = ?placed.copies, witness = ?placed.witness,
                "a volume made before placement records: recorded where its copies answered"),
            Err(e) => tracing::warn!(volume = name, "recording a volume made before placement records: {e}"),
        }
    }
    Ok(checked)
}

/// The nodes of `view`'s members as a record: its copies (the primary's first) and witness.
fn placed_of(dir: &dyn NodeDirectory, view: &pb::SyncVolume) -> Placed {
    let witness = view.members.iter().find(|m| m.state == "witness").and_then(|m| node_of(dir, &m.endpoint));
    Placed { copies: nodes_of(dir, view), witness }
}

/// Finds volume `name` on the nodes `placed` records (those the directory knows), each asked
/// within [`SCAN`], all at once: the primary is the newest generation's copy that calls itself
/// primary and is [`confirmed`]; a single recorded copy with no membership is a local volume.
async fn recorded(dir: &dyn NodeDirectory, placed: &Placed, name: &str) -> Result<Found, Status> {
    let known = dir.nodes();
    let nodes: Vec<String> = placed.members().filter(|n| known.iter().any(|k| k == n)).map(str::to_owned).collect();
    let found = scan(dir, nodes, |_, mut c| async move {
        let v = match c.get_volume(pb::GetVolumeRequest { name: name.to_owned() }).await {
            Ok(v) => Some(v.into_inner()),
            Err(s) if s.code() == Code::NotFound => None,
            Err(s) => return Err(s),
        };
        let s = view(&mut c, name).await?;
        Ok((c, v, s))
    })
    .await?;
    let views: Vec<(&str, &pb::SyncVolume)> =
        found.answers.iter().filter_map(|(n, (_, _, s))| Some((n.as_str(), s.as_ref()?))).collect();
    let backed: Vec<bool> = found
        .answers
        .iter()
        .map(|(n, (_, _, s))| s.as_ref().is_some_and(|s| confirmed(placed, n, s, views.iter().copied())))
        .collect();
    let local = placed.copies.len() == 1 && placed.witness.is_none();
    let silent = found.silent.into_iter().map(|(n, _)| n).collect();
    let mut out = Found { primary: None, copies: Vec::new(), silent };
    for ((node, (c, v, s)), backed) in found.answers.into_iter().zip(backed) {
        let Some(v) = v else { continue };
        match s {
            None if local => out.primary = Some((node, c, v, None)),
            None => {}
            Some(s) if s.role != "primary" => out.copies.push((node, s)),
            Some(s) if !backed => {
                tracing::warn!(
                    volume = name,
                    node,
                    generation = s.generation,
                    "a copy calls itself primary without a majority of the recorded members behind it"
                );
                out.copies.push((node, s));
            }
            Some(s) => {
                let newer =
                    out.primary.as_ref().is_none_or(|p| p.3.as_ref().is_none_or(|p| s.generation > p.generation));
                if newer {
                    out.primary = Some((node, c, v, Some(s)));
                }
            }
        }
    }
    Ok(out)
}

/// Changes the controller's record of where `volume` lives, where the directory keeps one.
pub async fn record(dir: &dyn NodeDirectory, volume: &str, change: impl Fn(&mut Placed)) -> Result<(), Status> {
    match dir.placements() {
        Some(records) => records.update(volume, change).await.map(drop),
        None => Ok(()),
    }
}

/// Finds volume `name` by asking the daemons: at `hint` (the node its id names, or
/// [`crate::shared::ids::ANY`]), else where it
/// was last served as a replicated volume's primary, following a copy that names another
/// primary; when none of those answers as its primary, every other node is asked at once, each
/// within [`SCAN`], and the copy of the newest generation that calls itself primary wins. A
/// node the directory no longer knows (its Node deleted) or that lost the volume is no answer:
/// the others are asked. Only the node an id names may answer with a local volume: elsewhere a
/// volume of that name (an asynchronous replica's secondary, say) is another volume.
async fn ask_around(dir: &dyn NodeDirectory, hint: &str, name: &str) -> Result<Found, Status> {
    let known = dir.nodes();
    let mut tried: Vec<String> = Vec::new();
    // (node, whether a local volume there is the one), asked last first.
    let mut queue: Vec<(String, bool)> = last_seen(name).into_iter().map(|n| (n, false)).collect();
    queue.push((hint.to_owned(), true));
    queue.retain(|(n, _)| known.contains(n));
    let mut silent = Vec::new();
    while let Some((node, local)) = queue.pop() {
        if tried.contains(&node) {
            continue;
        }
        tried.push(node.clone());
        match held(dir, &node, name).await {
            Ok((_, _, Some(s))) if s.role != "primary" => queue.extend(node_of(dir, &s.primary).map(|n| (n, false))),
            Ok((_, _, None)) if !local => {}
            Ok((c, v, s)) => {
                if s.is_some() {
                    remember(name, &node);
                }
                return Ok(Found { primary: Some((node, c, v, s)), copies: Vec::new(), silent });
            }
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) if matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded) => silent.push(node),
            Err(s) => return Err(s),
        }
    }
    let others: Vec<String> = known.into_iter().filter(|n| !tried.contains(n)).collect();
    let found = scan(dir, others, |_, mut c| async move {
        let v = match c.get_volume(pb::GetVolumeRequest { name: name.to_owned() }).await {
            Ok(v) => v.into_inner(),
            Err(s) if s.code() == Code::NotFound => return Ok(None),
            Err(s) => return Err(s),
        };
        Ok(view(&mut c, name).await?.map(|s| (c, v, s)))
    })
    .await?;
    silent.extend(found.silent.into_iter().map(|(n, _)| n));
    let mut out = Found { primary: None, copies: Vec::new(), silent };
    for (node, (c, v, s)) in found.answers.into_iter().filter_map(|(n, a)| Some((n, a?))) {
        if s.role != "primary" {
            out.copies.push((node, s));
        } else if out.primary.as_ref().is_none_or(|p| p.3.as_ref().is_none_or(|p| s.generation > p.generation)) {
            out.primary = Some((node, c, v, Some(s)));
        }
    }
    if let Some((node, ..)) = &out.primary {
        remember(name, node);
    }
    Ok(out)
}

/// Where volume `name` is served now ([`locate`]): its node, a client there, the volume, and its
/// membership (None for a local volume). NotFound only when every node answered and none
/// holds it; Unavailable when copies answer but none as primary (not failed over yet), or when
/// nothing was found and some node is silent.
pub async fn primary(
    dir: &dyn NodeDirectory,
    hint: &str,
    name: &str,
) -> Result<(String, AdminClient<Channel>, pb::Volume, Option<pb::SyncVolume>), Status> {
    let found = locate(dir, hint, name).await?;
    if let Some(p) = found.primary {
        return Ok(p);
    }
    let nodes = |v: &[String]| v.join(", ");
    if !found.copies.is_empty() {
        let at: Vec<String> = found.copies.into_iter().map(|(n, _)| n).collect();
        return Err(Status::unavailable(format!(
            "volume {name:?}: no copy answers as its primary (copies on {}{})",
            nodes(&at),
            if found.silent.is_empty() { String::new() } else { format!("; silent: {}", nodes(&found.silent)) }
        )));
    }
    if !found.silent.is_empty() {
        return Err(Status::unavailable(format!(
            "volume {name:?} was found on no node that answers; silent: {}",
            nodes(&found.silent)
        )));
    }
    Err(Status::not_found(format!("volume {name:?} does not exist")))
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
/// nodes with the most free space that hold no copy yet, in zones no copy uses as `spread`
/// asks. Two copies get a witness on a third node too (a member that votes and holds no data;
/// in a zone of its own where there is one): the majority of two is both, so without it either
/// copy's node being away (a reboot, a daemon upgrade) would stop the writes.
/// ResourceExhausted when too few nodes (or zones) answer.
pub async fn ensure(
    dir: &dyn NodeDirectory,
    node: &str,
    volume: &str,
    n: usize,
    spread: Spread,
) -> Result<Vec<String>, Status> {
    let mut c = admin(dir, node).await?;
    let current = view(&mut c, volume).await?;
    let mut have = current.as_ref().map_or_else(|| vec![node.to_owned()], |v| nodes_of(dir, v));
    let witnesses: Vec<String> = current
        .iter()
        .flat_map(|v| v.members.iter().filter(|m| m.state == "witness"))
        .filter_map(|m| node_of(dir, &m.endpoint))
        .collect();
    let witness = n == 2 && witnesses.is_empty();
    if have.len() >= n && !witness {
        return Ok(have);
    }
    let exclude: Vec<String> = have.iter().chain(&witnesses).cloned().collect();
    let mut candidates = candidates(dir, &exclude, volume).await;
    let wanted = n.saturating_sub(have.len());
    if candidates.len() < wanted + usize::from(witness) {
        let why = if witness {
            "; two copies need a witness on a third node, so that writes go on while either copy's node is away"
        } else {
            ""
        };
        return Err(Status::resource_exhausted(format!(
            "{n} copies of {volume:?} need {} more nodes with a daemon that answers; {} found{why}",
            wanted + usize::from(witness),
            candidates.len()
        )));
    }
    let mut zones = zones_of(dir, &have).await;
    let mut picked = Vec::new();
    for _ in 0..wanted {
        picked.push(pick(&mut candidates, &mut zones, spread, false).map_err(|why| {
            Status::resource_exhausted(format!("{n} copies of {volume:?} with zoneSpread required: {why}"))
        })?);
    }
    for other in picked {
        have.push(add_member(dir, &mut c, volume, &other, false).await?);
    }
    if witness && let Ok(other) = pick(&mut candidates, &mut zones, Spread::Preferred, true) {
        add_member(dir, &mut c, volume, &other, true).await?;
    }
    Ok(have)
}

/// A node that could take a copy, and its zone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub node: String,
    pub zone: String,
}

/// Takes the node for the next copy (or, `witness`, the witness: the least free space) out of
/// `candidates` (the most free space first): the first in a zone not in `zones` where `spread`
/// asks for one, and records its zone. Required with no such zone: why not.
pub fn pick(
    candidates: &mut Vec<Candidate>,
    zones: &mut Vec<String>,
    spread: Spread,
    witness: bool,
) -> Result<String, String> {
    let order: Vec<usize> =
        if witness { (0..candidates.len()).rev().collect() } else { (0..candidates.len()).collect() };
    let fresh = order.iter().copied().find(|&i| !zones.contains(&candidates[i].zone));
    let at = match (spread, fresh) {
        (Spread::Any, _) => order.first().copied(),
        (_, Some(i)) => Some(i),
        (Spread::Preferred, None) => order.first().copied(),
        (Spread::Required, None) => {
            return Err(format!(
                "no node that answers is in a zone other than {}",
                zones.iter().map(|z| if z.is_empty() { "(none)" } else { z.as_str() }).collect::<Vec<_>>().join(", ")
            ));
        }
    };
    let c = candidates.remove(at.ok_or("no node left")?);
    zones.push(c.zone);
    Ok(c.node)
}

/// How many daemons a placement asks at once: a directory of silent nodes costs one [`SCAN`] per
/// this many, not one per node (past the provisioner's timeout with a handful of them).
const ASK_AT_ONCE: usize = 32;

/// The zones of `nodes` (in their order), as the directory records them or else as their
/// daemons report them (a silent one: none);
/// [`ASK_AT_ONCE`] asked at a time, each within [`SCAN`].
pub async fn zones_of(dir: &dyn NodeDirectory, nodes: &[String]) -> Vec<String> {
    let zone = |n: String| async move {
        if let Some(z) = dir.zone(&n) {
            return z;
        }
        let ask = async { admin(dir, &n).await.ok()?.pool_status(pb::PoolStatusRequest {}).await.ok() };
        tokio::time::timeout(SCAN, ask).await.ok().flatten().map(|s| s.into_inner().zone).unwrap_or_default()
    };
    futures_util::stream::iter(nodes.iter().cloned()).map(zone).buffered(ASK_AT_ONCE).collect().await
}

/// The nodes that could take a copy of `volume`: their daemon answers within [`SCAN`], they are
/// not in `exclude` and hold no volume of that name; the most free space first. [`ASK_AT_ONCE`]
/// are asked at a time.
pub async fn candidates(dir: &dyn NodeDirectory, exclude: &[String], volume: &str) -> Vec<Candidate> {
    let full = over_share(dir);
    let others = dir.nodes().into_iter().filter(|o| !exclude.contains(o) && !full.contains(o));
    let ask = |other: String| async move {
        let ask = async {
            let mut oc = admin(dir, &other).await.ok()?;
            let s = oc.pool_status(pb::PoolStatusRequest {}).await.ok()?.into_inner();
            // A node that has a volume of this name already cannot take a copy.
            match oc.get_volume(pb::GetVolumeRequest { name: volume.to_owned() }).await {
                Err(e) if e.code() == Code::NotFound => Some((s.free, s.zone)),
                _ => None,
            }
        };
        let (free, zone) = tokio::time::timeout(SCAN, ask).await.ok().flatten()?;
        let zone = dir.zone(&other).unwrap_or(zone);
        Some((free, Candidate { node: other, zone }))
    };
    let mut found: Vec<(u64, Candidate)> = futures_util::stream::iter(others)
        .map(ask)
        .buffer_unordered(ASK_AT_ONCE)
        .filter_map(|c| async { c })
        .collect()
        .await;
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.node.cmp(&b.1.node)));
    found.into_iter().map(|(_, c)| c).collect()
}

/// The nodes that take no new copy: those holding their share of the recorded ones already
/// ([`share_cap`]), so that a daemon that claims more free space than it has does not take
/// every new volume. Empty without a record.
pub fn over_share(dir: &dyn NodeDirectory) -> Vec<String> {
    let Some(records) = dir.placements() else { return Vec::new() };
    let counts = records.counts();
    let cap = share_cap(&counts, dir.nodes().len());
    let full: Vec<String> = counts.into_iter().filter(|(_, n)| *n >= cap).map(|(node, _)| node).collect();
    if !full.is_empty() {
        tracing::info!(nodes = ?full, cap, "nodes at their share of the copies take no new one");
    }
    full
}

/// Adds a copy (or a `witness`) of `volume` on node `other` through its primary's client `c`,
/// recording it first (and forgetting it again if the primary refuses).
pub async fn add_member(
    dir: &dyn NodeDirectory,
    c: &mut AdminClient<Channel>,
    volume: &str,
    other: &str,
    witness: bool,
) -> Result<String, Status> {
    let peer = dir.admin_endpoint(other).ok_or_else(|| Status::not_found(format!("unknown node {other:?}")))?;
    let r = pb::AddSyncReplicaRequest { volume: volume.to_owned(), peer, witness };
    let what = if witness { "a witness" } else { "a copy" };
    // Recorded first: the record names every node that may hold a member.
    record(dir, volume, |p| p.add(other, witness)).await?;
    if let Err(s) = c.add_sync_replica(r).await {
        if let Err(e) = record(dir, volume, |p| p.remove(other)).await {
            tracing::warn!(volume, node = %other, "a member not added stays recorded: {e}");
        }
        return Err(Status::new(s.code(), format!("adding {what} of {volume:?} on {other}: {}", s.message())));
    }
    tracing::info!(volume, node = %other, witness, "member added");
    Ok(other.to_owned())
}

/// Deletes volume `name` (its id names `hint`) and every copy of it. Nothing is changed
/// unless every copy can go: a copy whose node the directory knows but that does not answer
/// makes it Unavailable (the caller retries: Kubernetes keeps the PV until a retry succeeds), so
/// no copy is left behind to come back later. A copy whose node the directory no longer knows
/// (its Node deleted) went with its node: it leaves the membership without being asked. When
/// no copy answers as primary (its node gone, not failed over yet), the newest in-sync copy is
/// promoted first, which takes a majority as any promotion does.
pub async fn delete(dir: &dyn NodeDirectory, hint: &str, name: &str) -> Result<(), Status> {
    let mut found = locate(dir, hint, name).await?;
    if found.primary.is_none() && !found.copies.is_empty() {
        promote_newest(dir, name, &mut found.copies).await?;
        found = locate(dir, hint, name).await?;
    }
    let Some((node, mut c, _, view)) = found.primary else {
        return match found.silent.is_empty() {
            true => record(dir, name, |p| *p = Placed::default()).await,
            false => Err(Status::unavailable(format!(
                "volume {name:?}: no copy found, and {} did not answer; deletion is retried",
                found.silent.join(", ")
            ))),
        };
    };
    if let Some(view) = view {
        remove_copies(dir, &node, &view).await?;
    }
    match c.delete_volume(pb::DeleteVolumeRequest { name: name.to_owned() }).await {
        Ok(_) => {}
        Err(s) if s.code() == Code::NotFound => {}
        Err(s) => return Err(s),
    }
    record(dir, name, |p| *p = Placed::default()).await
}

/// Promotes the first of `copies` (newest generation first, in-sync ones first) the daemons
/// accept.
async fn promote_newest(
    dir: &dyn NodeDirectory,
    name: &str,
    copies: &mut [(String, pb::SyncVolume)],
) -> Result<(), Status> {
    let in_sync = |node: &str, v: &pb::SyncVolume| {
        let me = dir.admin_endpoint(node);
        v.members.iter().any(|m| Some(&m.endpoint) == me.as_ref() && m.state == "in-sync")
    };
    copies.sort_by_key(|(n, v)| std::cmp::Reverse((v.generation, in_sync(n, v))));
    let mut refused = Vec::new();
    for (node, _) in copies.iter() {
        let req = pb::PromoteReplicationRequest { volume: name.to_owned(), force: false };
        match admin(dir, node).await?.promote_sync_replica(req).await {
            Ok(_) => {
                tracing::warn!(
                    volume = name,
                    node,
                    "no copy answered as primary: promoted this one to delete the volume"
                );
                return Ok(());
            }
            Err(s) => refused.push(format!("{node}: {}", s.message())),
        }
    }
    Err(Status::unavailable(format!(
        "volume {name:?}: no copy answers as its primary and none could be promoted ({})",
        refused.join("; ")
    )))
}

/// Removes every copy of `view`'s volume but the primary's (on `node`) and deletes them on
/// their nodes; Unavailable before any change when a copy's node is known but does not answer.
async fn remove_copies(dir: &dyn NodeDirectory, node: &str, view: &pb::SyncVolume) -> Result<(), Status> {
    let volume = &view.volume;
    let others: Vec<&pb::SyncMember> = view.members.iter().filter(|m| m.endpoint != view.primary).collect();
    let at: Vec<(&pb::SyncMember, Option<String>)> = others.iter().map(|m| (*m, node_of(dir, &m.endpoint))).collect();
    let known: Vec<String> = at.iter().filter_map(|(_, n)| n.clone()).collect();
    let asked = scan(dir, known, |_, mut c| async move { c.pool_status(pb::PoolStatusRequest {}).await }).await?;
    if !asked.silent.is_empty() {
        return Err(Status::unavailable(format!(
            "volume {volume:?} has copies on {}, which did not answer: nothing was deleted; deletion is retried",
            asked.silent_names()
        )));
    }
    let mut c = admin(dir, node).await?;
    // The copies of nodes that are gone first: the majority that records each removal is then
    // made of members that answer.
    let (gone, here): (Vec<_>, Vec<_>) = at.into_iter().partition(|(_, n)| n.is_none());
    for (m, other) in gone.into_iter().chain(here) {
        let r = pb::RemoveSyncReplicaRequest { volume: volume.clone(), peer: m.endpoint.clone() };
        match c.remove_sync_replica(r).await {
            Ok(_) => {}
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(s),
        }
        let Some(other) = other else {
            tracing::warn!(volume, member = %m.endpoint, "a copy whose node is gone left the membership with it");
            continue;
        };
        delete_copy(&mut admin(dir, &other).await?, volume)
            .await
            .map_err(|s| Status::new(s.code(), format!("deleting the copy on {other}: {}", s.message())))?;
        record(dir, volume, |p| p.remove(&other)).await?;
    }
    Ok(())
}

/// Deletes a copy that is no member any more, ending the standby publication it may hold first
/// (`publish.rs`: a node that relays is published on every copy); a copy already gone is fine.
pub async fn delete_copy(c: &mut AdminClient<Channel>, volume: &str) -> Result<(), Status> {
    c.unpublish_volume(pb::UnpublishVolumeRequest { volume: volume.to_owned() }).await?;
    match c.delete_volume(pb::DeleteVolumeRequest { name: volume.to_owned() }).await {
        Ok(_) => Ok(()),
        Err(s) if s.code() == Code::NotFound => Ok(()),
        Err(s) => Err(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of daemons that accept connections and never answer (powered off behind a
    /// live switch, stopped, or stuck): a placement asks them at once, so it costs one [`SCAN`],
    /// not one per node.
    #[test]
    fn silent_nodes_are_asked_together() {
        let silent: Vec<std::net::TcpListener> =
            (0..6).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let dir = std::env::temp_dir().join(format!("ferrite-csi-silent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("nodes.toml");
        let mut text = String::from("[nodes]\n");
        for (i, l) in silent.iter().enumerate() {
            text.push_str(&format!("node-{i} = \"tcp://{}\"\n", l.local_addr().unwrap()));
        }
        std::fs::write(&file, text).unwrap();
        let nodes = crate::shared::nodes::StaticNodes::load(&file).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let start = std::time::Instant::now();
        let found = rt.block_on(candidates(&nodes, &[], "v"));
        assert!(found.is_empty());
        let names = nodes.nodes();
        let zones = rt.block_on(zones_of(&nodes, &names));
        assert_eq!(zones, vec![String::new(); 6], "one (empty) zone per node, in their order");
        // Serially this would be 2 × 6 × SCAN (36 s).
        assert!(start.elapsed() < 3 * SCAN, "{:?} for 6 silent nodes, twice", start.elapsed());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_volume_is_abnormal_without_a_majority_or_with_a_failed_copy() {
        let member = |endpoint: &str, state: &str, reason: &str| pb::SyncMember {
            endpoint: endpoint.into(),
            state: state.into(),
            reason: reason.into(),
            ..Default::default()
        };
        assert!(!condition(None).abnormal, "a local volume");
        let mut s = pb::SyncVolume {
            members: vec![member("tcp://a:7070", "primary", ""), member("tcp://b:7070", "in-sync", "")],
            ..Default::default()
        };
        assert_eq!(
            condition(Some(&s)),
            csi::VolumeCondition { abnormal: false, message: "ok: every copy in sync".into() }
        );
        s.members.push(member("tcp://c:7070", "rebuilding", "40%"));
        let c = condition(Some(&s));
        assert!(!c.abnormal && c.message.contains("rebuilding the copy at tcp://c:7070"), "{c:?}");
        s.members[1].state = "ejected".into();
        s.members[1].reason = "no answer for 10 s".into();
        let c = condition(Some(&s));
        assert!(c.abnormal && c.message.contains("the copy at tcp://b:7070 failed: no answer for 10 s"), "{c:?}");
        s.refused = "1 of 3 members in sync".into();
        let c = condition(Some(&s));
        assert!(c.abnormal && c.message.starts_with("refuses writes: 1 of 3 members in sync"), "{c:?}");
    }

    fn cands(list: &[(&str, &str)]) -> Vec<Candidate> {
        list.iter().map(|(n, z)| Candidate { node: (*n).into(), zone: (*z).into() }).collect()
    }

    #[test]
    fn copies_spread_across_zones() {
        let all = cands(&[("n1", "z1"), ("n2", "z1"), ("n3", "z2"), ("n4", "z3")]);
        // By free space alone: n1 and n2, though one zone.
        let (mut c, mut z) = (all.clone(), vec!["z1".to_owned()]);
        assert_eq!(pick(&mut c, &mut z, Spread::Any, false).unwrap(), "n1");
        // Spread: the roomiest node of an unused zone, then the next zone.
        let (mut c, mut z) = (all.clone(), vec!["z1".to_owned()]);
        assert_eq!(pick(&mut c, &mut z, Spread::Required, false).unwrap(), "n3");
        assert_eq!(pick(&mut c, &mut z, Spread::Required, false).unwrap(), "n4");
        let e = pick(&mut c, &mut z, Spread::Required, false).unwrap_err();
        assert!(e.contains("z1, z2, z3"), "{e}");
        assert_eq!(pick(&mut c, &mut z, Spread::Preferred, false).unwrap(), "n1", "preferred falls back");
        // A witness: the least free space of an unused zone.
        let (mut c, mut z) = (all, vec!["z1".to_owned(), "z2".to_owned()]);
        assert_eq!(pick(&mut c, &mut z, Spread::Preferred, true).unwrap(), "n4");
    }
}
