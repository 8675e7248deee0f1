//! Publications (CSI ControllerPublish): a volume published to one node. Each is an export named
//! `csi-publish-<volume>` whose allow list is exactly that node's identity, or `local` (no TCP
//! client: the node is this daemon's own), so it persists with the exports and stopping it cuts
//! the node's connections. The controller role may make these and nothing wider: an export open
//! to any client, or to a network, stays an operator's decision. One node at a time: a second
//! node is refused here, whatever the caller checked before (and of two racing calls the
//! exports' own check lets one through). The node opens it only while its identity also holds
//! the `nbd-client` role: a controller cannot open a volume to a certificate without it.

use ferrite_proto::ferrite::v1 as pb;

use crate::base::error::Error;
use crate::records::exports::{ExportRecord, ExportTable, PUBLICATION_PREFIX as PREFIX};

fn export_name(volume: &str) -> String {
    format!("{PREFIX}{volume}")
}

/// The publication an export record is, if it is one.
pub fn of(r: &ExportRecord, tcp_address: &str) -> Option<pb::Publication> {
    let volume = r.name.strip_prefix(PREFIX)?;
    let local = r.allow.first().is_none_or(|a| a == "local");
    Some(pb::Publication {
        volume: volume.to_owned(),
        node: if local { String::new() } else { r.allow[0].clone() },
        local,
        read_only: r.read_only,
        export: r.name.clone(),
        tcp_address: tcp_address.to_owned(),
    })
}

/// What a publication request asks to allow: the node's identity, or `local`; refused when it
/// is anything wider (a network, no one named) or names a snapshot.
pub fn allow_of(r: &pb::PublishVolumeRequest) -> Result<String, Error> {
    crate::base::error::require("volume", &r.volume)?;
    if r.volume.contains('@') {
        return Err(Error::invalid("a publication is of a volume, not a snapshot"));
    }
    match (r.local, r.node.as_str()) {
        (true, "") => Ok("local".to_owned()),
        (true, _) => Err(Error::invalid("a local publication names no node")),
        (false, "") => Err(Error::invalid("node is required (or local)")),
        (false, node) => match node.parse::<ferrite_nbd::export::Allow>() {
            Ok(ferrite_nbd::export::Allow::Identity(_)) => Ok(node.to_owned()),
            _ => Err(Error::invalid(format!("node {node:?} is not an identity (a DNS name)"))),
        },
    }
}

/// Publishes `r.volume` to `allow` (see [`allow_of`]); the same publication again is no change.
pub async fn publish(
    exports: &ExportTable,
    r: &pb::PublishVolumeRequest,
    allow: String,
    tcp: &str,
) -> Result<pb::Publication, Error> {
    let rec = ExportRecord {
        name: export_name(&r.volume),
        volume: r.volume.clone(),
        read_only: r.read_only,
        allow: vec![allow],
    };
    let held = exports.lock().await.iter().find(|e| e.name == rec.name).cloned();
    if let Some(h) = held {
        let p = of(&h, tcp).expect("named as a publication");
        let to = if p.local { "this daemon's node".to_owned() } else { p.node.clone() };
        if h.allow != rec.allow {
            return Err(Error::refused(format!("volume {:?} is published to {to}; one node at a time", r.volume)));
        }
        if h.read_only != rec.read_only {
            return Err(Error::already_exists(format!(
                "volume {:?} is published to {to} with read_only {}",
                r.volume, h.read_only
            )));
        }
        return Ok(p);
    }
    exports.ensure(&rec).await?;
    tracing::info!(volume = %r.volume, to = %rec.allow[0], read_only = rec.read_only, "volume published");
    Ok(of(&rec, tcp).expect("named as a publication"))
}

/// Ends the publication of `volume`, if any (its node's connections with it).
pub async fn unpublish(exports: &ExportTable, volume: &str) -> Result<(), Error> {
    crate::base::error::require("volume", volume)?;
    match exports.stop(&export_name(volume)).await {
        Ok(cut) => {
            tracing::info!(volume, connections_cut = cut, "volume unpublished");
            Ok(())
        }
        Err(s) if s.kind() == crate::base::error::Kind::NotFound => Ok(()),
        Err(s) => Err(s),
    }
}

pub async fn list(exports: &ExportTable, tcp: &str) -> Vec<pb::Publication> {
    exports.list().await.iter().filter_map(|r| of(r, tcp)).collect()
}
