//! What every CSI service checks of its arguments first (required fields, parameters,
//! capabilities, pagination tokens), and the volume shape they answer with.

use std::collections::HashMap;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use tonic::Status;

use crate::shared::class::Class;
use crate::shared::ids;

/// Topology key naming the node a volume lives on.
pub const TOPOLOGY_KEY: &str = "topology.ferrite.dev/node";
pub use crate::shared::nodes::{REGION_KEY, ZONE_KEY};

pub(crate) fn require(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(())
}

/// For calls that take no parameters of ours: the class's own ones, which Kubernetes and
/// CSI-Addons pass on from a PV, are checked ([`Class::parse`]), any other is refused.
pub(crate) fn no_parameters(params: &HashMap<String, String>) -> Result<(), Status> {
    Class::parse(params).map(drop)
}

/// One page of `all` (in a stable order): the token is the index to start at; a token we did not
/// hand out is Aborted, as the spec asks.
/// Names the nodes a listing could not read (comma-separated) in the response's
/// `ferrite-unread-nodes` header: CSI's listings have no field for it.
pub(crate) fn unread_header<T>(mut r: tonic::Response<T>, unread: &str) -> tonic::Response<T> {
    if let Ok(v) = unread.parse()
        && !unread.is_empty()
    {
        r.metadata_mut().insert("ferrite-unread-nodes", v);
    }
    r
}

pub(crate) fn paginate<T>(mut all: Vec<T>, max_entries: i32, token: &str) -> Result<(Vec<T>, String), Status> {
    if max_entries < 0 {
        return Err(Status::invalid_argument("max_entries must not be negative"));
    }
    let start: usize = if token.is_empty() {
        0
    } else {
        token.parse().map_err(|_| Status::aborted(format!("bad starting_token {token:?}")))?
    };
    if start > all.len() {
        return Err(Status::aborted(format!("starting_token {start} is past the end ({} entries)", all.len())));
    }
    let n = if max_entries == 0 { all.len() } else { usize::try_from(max_entries).unwrap_or(usize::MAX) };
    let end = start.saturating_add(n).min(all.len());
    let next = if end < all.len() { end.to_string() } else { String::new() };
    Ok((all.drain(start..end).collect(), next))
}

pub(crate) fn topology(node: &str) -> csi::Topology {
    csi::Topology { segments: HashMap::from([(TOPOLOGY_KEY.to_owned(), node.to_owned())]) }
}

pub(crate) fn volume_msg(node: &str, v: &pb::Volume, source: Option<csi::VolumeContentSource>) -> csi::Volume {
    csi::Volume {
        capacity_bytes: i64::try_from(v.size).unwrap_or(i64::MAX),
        volume_id: ids::make(node, &v.name),
        volume_context: HashMap::new(),
        content_source: source,
        accessible_topology: vec![topology(node)],
    }
}

/// Checks the capabilities we can serve: single-node access, raw block or ext4/xfs mounts.
pub fn check_capabilities(caps: &[csi::VolumeCapability]) -> Result<(), String> {
    use csi::volume_capability::access_mode::Mode;
    if caps.is_empty() {
        return Err("volume_capabilities is required".into());
    }
    for c in caps {
        let mode = c.access_mode.as_ref().map(|m| m.mode).ok_or("access_mode is required")?;
        match Mode::try_from(mode) {
            Ok(Mode::SingleNodeWriter | Mode::SingleNodeReaderOnly | Mode::SingleNodeSingleWriter) => {}
            Ok(Mode::SingleNodeMultiWriter) => {}
            _ => return Err(format!("access mode {mode} is not supported (volumes are local to one node)")),
        }
        match &c.access_type {
            Some(csi::volume_capability::AccessType::Block(_)) => {}
            Some(csi::volume_capability::AccessType::Mount(m)) => {
                if !matches!(m.fs_type.as_str(), "" | "ext4" | "xfs") {
                    return Err(format!("fs_type {:?} is not supported (ext4 or xfs)", m.fs_type));
                }
            }
            None => return Err("access_type (block or mount) is required".into()),
        }
    }
    Ok(())
}
