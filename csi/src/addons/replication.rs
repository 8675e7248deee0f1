//! CSI-Addons Replication (`replication.Controller`) over the daemons' replication: each call
//! goes to the daemon of the node the volume id names. The peer is another daemon (usually in
//! another cluster), reached by its admin endpoint over mutual TLS with the node's own identity.
//!
//! The peers are the operator's: only those the controller was started with
//! (`--replication-peer NAME=ENDPOINT`, [`parse_peers`]) are pushed to, so whoever reaches the
//! CSI-Addons endpoint cannot send a volume anywhere else.
//!
//! Parameters (of the VolumeReplicationClass): `peer` (a listed peer's name), or `peerEndpoint`
//! (a listed peer's admin endpoint, `tcp://host:port` or a socket path) or `peerNode` (a node of
//! this driver's directory listed as `node:NODE`); `schedulingInterval` (`30s`, `5m`, `1h`,
//! `1d`; default 1m), `remoteVolume` (the volume's name on the peer; default the same name),
//! `mirroringMode` (only `snapshot`). Keys the CSI-Addons
//! controller adds under its own prefixes are ignored; any other key is InvalidArgument.
//! GetReplicationDestinationInfo names the destination when the peer is a node of this
//! driver's directory (a volume id `<peer node>/<remote name>`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ferrite_proto::csi_addons::replication as rp;
use ferrite_proto::ferrite::v1 as pb;
use rp::replication_source::Type as Source;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::shared::nodes::NodeDirectory;
use ferrite_proto::busy::Busy;

/// `30s`, `5m`, `2h`, `1d` or plain seconds, as seconds.
pub fn parse_interval(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not an interval such as 30s, 5m, 1h or 0"))?;
    let scale = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{s:?}: the unit is s, m, h or d")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("{s:?} is too long"))
}

/// Prefixes of keys the CSI-Addons controller passes along for itself.
const FOREIGN: [&str; 2] = ["replication.storage.openshift.io/", "csi.storage.k8s.io/"];

/// The parameters that name the peer: one of them.
const PEER_KEYS: [&str; 3] = ["peer", "peerEndpoint", "peerNode"];

/// A listed peer that is a node of this driver's directory: `node:NODE`.
const NODE_PEER: &str = "node:";

/// The operator's peers from `NAME=ENDPOINT` entries: a `tcp://host:port` or socket-path admin
/// endpoint, or `node:NODE`.
pub fn parse_peers(list: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut peers = BTreeMap::new();
    for entry in list {
        let (name, at) =
            entry.split_once('=').filter(|(n, a)| crate::shared::ids::valid_name(n) && !a.is_empty()).ok_or_else(
                || format!("replication peer {entry:?}: expected NAME=tcp://host:port, NAME=/socket or NAME=node:NODE"),
            )?;
        if at.strip_prefix(NODE_PEER).is_some_and(|n| !crate::shared::nodes::valid_node(n)) {
            return Err(format!("replication peer {entry:?}: not a node name after {NODE_PEER}"));
        }
        if peers.insert(name.to_owned(), at.to_owned()).is_some() {
            return Err(format!("replication peer {name:?} is listed twice"));
        }
    }
    Ok(peers)
}

#[derive(Debug)]
pub struct Replication {
    pub nodes: Arc<dyn NodeDirectory>,
    pub busy: Busy,
    /// The operator's peers, by name ([`parse_peers`]).
    pub peers: BTreeMap<String, String>,
}

/// The node, a client of its daemon and the volume's (or group's) name there, for a
/// request's source.
struct Target {
    node: String,
    admin: pb::admin_client::AdminClient<Channel>,
    volume: String,
    group: bool,
}

impl Replication {
    /// Resolves the request's `replication_source` to an existing volume or volume group (a
    /// group replicates as one unit).
    async fn target(&self, source: Option<rp::ReplicationSource>) -> Result<Target, Status> {
        let id = match source.and_then(|s| s.r#type) {
            Some(Source::Volume(v)) if !v.volume_id.is_empty() => v.volume_id,
            Some(Source::Volumegroup(g)) if !g.volume_group_id.is_empty() => {
                return self.group(&g.volume_group_id).await;
            }
            Some(_) => return Err(Status::invalid_argument("replication_source needs a volume_id or volume_group_id")),
            None => return Err(Status::invalid_argument("replication_source is required")),
        };
        let (node, admin, v) = crate::shared::copies::volume(&*self.nodes, &id).await?;
        Ok(Target { node, admin, volume: v.name, group: false })
    }

    async fn group(&self, id: &str) -> Result<Target, Status> {
        let (node, admin, g) = crate::addons::volume_group::locate(&*self.nodes, id).await?;
        Ok(Target { node, admin, volume: g.name, group: true })
    }

    /// The peer endpoint, interval and remote name from the class parameters.
    fn settings(&self, params: &HashMap<String, String>, volume: &str) -> Result<(String, u64, String), Status> {
        let bad = |key: &str, why: String| Status::invalid_argument(format!("parameter {key}: {why}"));
        let named: Vec<_> = params.iter().filter(|(k, _)| PEER_KEYS.contains(&k.as_str())).collect();
        let peer = match named[..] {
            [(k, v)] => self.listed(k, v)?,
            [] => return Err(Status::invalid_argument("parameters: peer, peerEndpoint or peerNode is required")),
            _ => return Err(Status::invalid_argument("parameters: name one peer (peer, peerEndpoint or peerNode)")),
        };
        let (mut interval, mut remote) = (60, volume.to_owned());
        for (k, v) in params {
            match k.as_str() {
                _ if PEER_KEYS.contains(&k.as_str()) => {}
                "schedulingInterval" => interval = parse_interval(v).map_err(|e| bad(k, e))?,
                "remoteVolume" if crate::shared::ids::valid_name(v) => remote.clone_from(v),
                "remoteVolume" => return Err(bad(k, format!("{v:?} is not a volume name"))),
                "mirroringMode" if v == "snapshot" => {}
                "mirroringMode" => return Err(bad(k, format!("{v:?}: only \"snapshot\" is supported"))),
                _ if FOREIGN.iter().any(|p| k.starts_with(p)) => {}
                _ => return Err(bad(k, "unknown parameter".into())),
            }
        }
        if interval == 0 {
            return Err(bad("schedulingInterval", "must be at least 1s".into()));
        }
        Ok((peer, interval, remote))
    }

    /// The admin endpoint of the listed peer a parameter names (`peer`: by name; `peerEndpoint`:
    /// by endpoint; `peerNode`: a node listed as `node:NODE`). PermissionDenied for one the
    /// operator did not list.
    fn listed(&self, key: &str, value: &str) -> Result<String, Status> {
        let found = self.peers.iter().find(|(name, at)| match key {
            "peer" => *name == value,
            "peerEndpoint" => *at == value && !at.starts_with(NODE_PEER),
            _ => at.strip_prefix(NODE_PEER) == Some(value),
        });
        let Some((name, at)) = found else {
            tracing::warn!(parameter = key, value, "replication to a peer the operator did not list refused");
            return Err(Status::permission_denied(format!(
                "parameter {key}: {value:?} is not a replication peer of this driver (the operator lists them: \
                 --replication-peer NAME=ENDPOINT{})",
                if self.peers.is_empty() { "; none is listed".to_owned() } else { String::new() }
            )));
        };
        match at.strip_prefix(NODE_PEER) {
            Some(node) => self.nodes.admin_endpoint(node).ok_or_else(|| {
                Status::failed_precondition(format!("replication peer {name:?}: node {node:?} runs no daemon now"))
            }),
            None => Ok(at.clone()),
        }
    }

    /// The volume's replication status; FailedPrecondition if it is not replicated.
    async fn status(t: &mut Target) -> Result<pb::Replication, Status> {
        let req = pb::ListReplicationsRequest { volume: t.volume.clone() };
        match t.admin.list_replications(req).await {
            Ok(r) => r.into_inner().replications.into_iter().next().ok_or_else(|| not_replicated(&t.volume)),
            Err(e) if e.code() == Code::NotFound => Err(not_replicated(&t.volume)),
            Err(e) => Err(e),
        }
    }
}

fn not_replicated(volume: &str) -> Status {
    Status::failed_precondition(format!("volume {volume:?} is not replicated"))
}

/// A daemon's answer, saying which node gave it.
fn on(node: &str) -> impl Fn(Status) -> Status + '_ {
    move |s| Status::new(s.code(), format!("node {node}: {}", s.message()))
}

fn source_key(s: &Option<rp::ReplicationSource>) -> String {
    match s.as_ref().and_then(|s| s.r#type.as_ref()) {
        Some(Source::Volume(v)) => v.volume_id.clone(),
        Some(Source::Volumegroup(g)) => format!("volume group {}", g.volume_group_id),
        None => String::new(),
    }
}

#[tonic::async_trait]
impl rp::controller_server::Controller for Replication {
    async fn enable_volume_replication(
        &self,
        req: Request<rp::EnableVolumeReplicationRequest>,
    ) -> Result<Response<rp::EnableVolumeReplicationResponse>, Status> {
        let r = req.into_inner();
        let _busy = self.busy.begin(&source_key(&r.replication_source))?;
        let mut t = self.target(r.replication_source).await?;
        let (peer, interval_secs, remote) = self.settings(&r.parameters, &t.volume)?;
        // Enabled already as a secondary (the other cluster's primary pushes here): nothing to do.
        if Self::status(&mut t).await.is_ok_and(|s| s.role == "secondary") {
            return Ok(Response::new(rp::EnableVolumeReplicationResponse {}));
        }
        let req = pb::EnableReplicationRequest {
            volume: t.volume.clone(),
            peer,
            replica: remote,
            interval_secs,
            group: t.group,
            snapshots: Vec::new(),
        };
        t.admin.enable_replication(req).await.map_err(on(&t.node))?;
        tracing::info!(volume = %t.volume, node = %t.node, interval_secs, "replication enabled");
        Ok(Response::new(rp::EnableVolumeReplicationResponse {}))
    }

    async fn disable_volume_replication(
        &self,
        req: Request<rp::DisableVolumeReplicationRequest>,
    ) -> Result<Response<rp::DisableVolumeReplicationResponse>, Status> {
        let r = req.into_inner();
        let _busy = self.busy.begin(&source_key(&r.replication_source))?;
        let mut t = self.target(r.replication_source).await?;
        match t.admin.disable_replication(pb::ReplicationRequest { volume: t.volume.clone() }).await {
            Err(e) if e.code() != Code::NotFound => return Err(on(&t.node)(e)),
            _ => {}
        }
        Ok(Response::new(rp::DisableVolumeReplicationResponse {}))
    }

    async fn promote_volume(
        &self,
        req: Request<rp::PromoteVolumeRequest>,
    ) -> Result<Response<rp::PromoteVolumeResponse>, Status> {
        let r = req.into_inner();
        let _busy = self.busy.begin(&source_key(&r.replication_source))?;
        let mut t = self.target(r.replication_source).await?;
        Self::status(&mut t).await?;
        let req = pb::PromoteReplicationRequest { volume: t.volume.clone(), force: r.force };
        t.admin.promote_replication(req).await.map_err(on(&t.node))?;
        Ok(Response::new(rp::PromoteVolumeResponse {}))
    }

    async fn demote_volume(
        &self,
        req: Request<rp::DemoteVolumeRequest>,
    ) -> Result<Response<rp::DemoteVolumeResponse>, Status> {
        let r = req.into_inner();
        let _busy = self.busy.begin(&source_key(&r.replication_source))?;
        let mut t = self.target(r.replication_source).await?;
        Self::status(&mut t).await?;
        // The final delta is retried by the daemon until it arrives; its status tells.
        t.admin.demote_replication(pb::ReplicationRequest { volume: t.volume.clone() }).await.map_err(on(&t.node))?;
        Ok(Response::new(rp::DemoteVolumeResponse {}))
    }

    async fn resync_volume(
        &self,
        req: Request<rp::ResyncVolumeRequest>,
    ) -> Result<Response<rp::ResyncVolumeResponse>, Status> {
        let r = req.into_inner();
        let _busy = self.busy.begin(&source_key(&r.replication_source))?;
        let mut t = self.target(r.replication_source).await?;
        let s = Self::status(&mut t).await?;
        if s.role != "secondary" {
            return Err(Status::failed_precondition(format!(
                "volume {:?} is primary: demote it before a resync",
                t.volume
            )));
        }
        // Ready once a delta from the primary has landed since it became a secondary; until
        // then every call asks the primary again (it pushes at once, or is already pushing).
        if s.resynced && !s.handover {
            return Ok(Response::new(rp::ResyncVolumeResponse { ready: true }));
        }
        let req = pb::ReplicationRequest { volume: t.volume.clone() };
        let s = t.admin.resync_replication(req).await.map_err(on(&t.node))?.into_inner();
        Ok(Response::new(rp::ResyncVolumeResponse { ready: s.resynced }))
    }

    async fn get_volume_replication_info(
        &self,
        req: Request<rp::GetVolumeReplicationInfoRequest>,
    ) -> Result<Response<rp::GetVolumeReplicationInfoResponse>, Status> {
        let r = req.into_inner();
        let mut t = self.target(r.replication_source).await?;
        let s = Self::status(&mut t).await?;
        if s.role != "primary" {
            return Err(Status::failed_precondition(format!("volume {:?} is not the primary", t.volume)));
        }
        if s.last_snapshot_unix_ms == 0 {
            return Err(Status::not_found(format!("volume {:?} has not completed a sync yet", t.volume)));
        }
        let ms = i64::try_from(s.last_snapshot_unix_ms).unwrap_or(i64::MAX);
        let status = match s.state.as_str() {
            "error" if s.error.contains("split-brain") => rp::get_volume_replication_info_response::Status::Error,
            "error" => rp::get_volume_replication_info_response::Status::Degraded,
            _ => rp::get_volume_replication_info_response::Status::Healthy,
        };
        Ok(Response::new(rp::GetVolumeReplicationInfoResponse {
            last_sync_time: Some(prost_types::Timestamp {
                seconds: ms / 1000,
                nanos: i32::try_from(ms % 1000).unwrap_or(0) * 1_000_000,
            }),
            last_sync_duration: prost_types::Duration::try_from(std::time::Duration::from_secs_f64(
                s.last_sync_seconds.max(0.0),
            ))
            .ok(),
            last_sync_bytes: i64::try_from(s.last_sync_bytes).unwrap_or(i64::MAX),
            status: status as i32,
            status_message: if s.error.is_empty() {
                format!("{}, lag {:.0}s", s.state, s.lag_seconds)
            } else {
                s.error
            },
        }))
    }

    async fn get_replication_destination_info(
        &self,
        req: Request<rp::GetReplicationDestinationInfoRequest>,
    ) -> Result<Response<rp::GetReplicationDestinationInfoResponse>, Status> {
        use rp::replication_destination::{Type as Dest, VolumeDestination, VolumeGroupDestination};
        let mut t = self.target(req.into_inner().replication_source).await?;
        let s = Self::status(&mut t).await?;
        // Destination ids name the peer's node: known only if the peer is in this directory.
        let node = self
            .nodes
            .nodes()
            .into_iter()
            .find(|n| self.nodes.admin_endpoint(n).as_deref() == Some(s.peer.as_str()))
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "the peer {} is not a node of this driver's directory: its volume ids are not known here",
                    s.peer
                ))
            })?;
        let dest = if t.group {
            let groups = t.admin.list_groups(pb::ListGroupsRequest {}).await?.into_inner().groups;
            let now = groups.into_iter().find(|g| g.name == t.volume).map(|g| g.volumes).unwrap_or_default();
            let mut synced = s.members.clone();
            synced.sort();
            let mut current = now.clone();
            current.sort();
            if s.last_snapshot.is_empty() || synced != current {
                return Err(Status::unavailable(format!(
                    "not every member of group {:?} has completed a sync yet",
                    t.volume
                )));
            }
            let volume_ids = now
                .iter()
                .map(|m| (crate::shared::ids::make(&t.node, m), crate::shared::ids::make(&node, m)))
                .collect();
            Dest::Volumegroup(VolumeGroupDestination {
                volume_group_id: crate::shared::ids::make(&node, &s.remote),
                volume_ids,
            })
        } else {
            Dest::Volume(VolumeDestination { volume_id: crate::shared::ids::make(&node, &s.remote) })
        };
        Ok(Response::new(rp::GetReplicationDestinationInfoResponse {
            replication_destination: Some(rp::ReplicationDestination { r#type: Some(dest) }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_parse_with_units() {
        assert_eq!(parse_interval("90"), Ok(90));
        assert_eq!(parse_interval("30s"), Ok(30));
        assert_eq!(parse_interval("5m"), Ok(300));
        assert_eq!(parse_interval("1h"), Ok(3600));
        assert_eq!(parse_interval("2d"), Ok(172_800));
        assert!(parse_interval("3x").unwrap_err().contains("unit"));
        assert!(parse_interval("m").is_err());
        assert!(parse_interval("99999999999999999999d").is_err());
    }

    #[test]
    fn peers_are_names_with_an_endpoint_or_a_node() {
        let list = |l: &[&str]| parse_peers(&l.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        let p = list(&["dr=tcp://192.0.2.7:7070", "b=node:node-b", "local=/run/ferrite/admin.sock"]).unwrap();
        assert_eq!(p["dr"], "tcp://192.0.2.7:7070");
        assert_eq!(p["b"], "node:node-b");
        for bad in ["dr", "=tcp://x:1", "dr=", "b=node:Node_B", "a b=tcp://x:1"] {
            assert!(list(&[bad]).is_err(), "{bad}");
        }
        assert!(list(&["a=node:x", "a=node:y"]).unwrap_err().contains("twice"));
    }
}
