//! The CSI SnapshotMetadata service (alpha since CSI 1.10): the allocated ranges of a snapshot,
//! and the ranges changed between two snapshots of one volume, streamed in pages, for backup
//! tools that copy only those (through the external-snapshot-metadata sidecar). Both come from
//! the daemon's ChangedRanges, the answer `ferrite snapshot diff` and NBD's `ferrite:changed:`
//! context give too.
//!
//! Ranges are VARIABLE_LENGTH: the engine knows changes as runs of blocks, and a run of a
//! thousand blocks is one tuple instead of a thousand. A range may be reported changed although
//! its bytes are equal (rewritten with the same data, or trimmed where it read as zeros), never
//! the other way round; and a range reported unallocated reads as zeros.

use std::sync::Arc;

use ferrite_proto::csi::v1 as csi;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Code, Request, Response, Status};

use crate::shared::args::require;
use crate::shared::ids;
use crate::shared::nodes::{NodeDirectory, admin};

/// Tuples per message when the caller leaves it to us, and at most whatever it asks.
const PAGE: usize = 1024;

/// The largest ChangedRanges answer taken from a daemon: some 25 million ranges.
const MAX_LISTING: usize = 256 << 20;

#[derive(Debug)]
pub struct SnapshotMetadata {
    pub nodes: Arc<dyn NodeDirectory>,
}

/// A snapshot a request names: a node holding it (`on` when given and it does: a replicated
/// volume's snapshots are on each copy), and what the daemon says of it.
async fn snapshot(
    dir: &dyn NodeDirectory,
    field: &str,
    id: &str,
    on: Option<&str>,
) -> Result<(String, pb::Snapshot), Status> {
    require(field, id)?;
    if let Some(node) = on
        && let Some((at, name)) = ids::parse(id).filter(|(at, _)| *at == ids::ANY || at == &node)
    {
        let name = name.to_owned();
        match admin(dir, node).await?.get_snapshot(pb::GetSnapshotRequest { name }).await {
            Ok(s) => return Ok((node.to_owned(), s.into_inner())),
            Err(s) if s.code() == Code::NotFound && at == ids::ANY => {}
            Err(s) => return Err(s),
        }
    }
    crate::spec::snapshots::holder(dir, id).await
}

/// `ranges` from byte `start` on (a range across it cut there), as pages of at most `max`
/// tuples (0: [`PAGE`]); at least one page, which tells the capacity.
fn pages(ranges: &[pb::Range], start: u64, max: i32, capacity: u64) -> Result<Vec<Vec<csi::BlockMetadata>>, Status> {
    let max = match usize::try_from(max) {
        Err(_) => return Err(Status::invalid_argument(format!("max_results {max} is negative"))),
        Ok(0) => PAGE,
        Ok(n) => n.min(PAGE),
    };
    // The daemon's answer is checked like any input: a range past the capacity (or a capacity
    // past i64) is an error, never a panic or a wrapped offset.
    capacity_i64(capacity)?;
    let mut tuples: Vec<csi::BlockMetadata> = Vec::new();
    for r in ranges {
        let end = r.offset.checked_add(r.length).filter(|&e| e <= capacity).ok_or_else(|| {
            Status::internal(format!(
                "the daemon answered a range at {} of {} bytes, past the volume's {capacity} bytes",
                r.offset, r.length
            ))
        })?;
        if end > start {
            let from = r.offset.max(start);
            let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX); // within the capacity, checked above
            tuples.push(csi::BlockMetadata { byte_offset: to_i64(from), size_bytes: to_i64(end - from) });
        }
    }
    let mut out: Vec<Vec<_>> = tuples.chunks(max).map(<[_]>::to_vec).collect();
    if out.is_empty() {
        out.push(Vec::new());
    }
    Ok(out)
}

/// The start of a listing: OutOfRange if negative or past the end.
fn starting(offset: i64, capacity: u64) -> Result<u64, Status> {
    u64::try_from(offset).ok().filter(|&o| o <= capacity).ok_or_else(|| {
        Status::out_of_range(format!("starting_offset {offset} is outside the snapshot (0 to {capacity})"))
    })
}

type Stream<M> = tonic::codegen::BoxStream<M>;

impl SnapshotMetadata {
    /// The ranges of `target` changed since `base` (None: its allocated ranges), the target's
    /// capacity, and where the listing starts.
    async fn listing(
        &self,
        target: &str,
        base: Option<&str>,
        starting_offset: i64,
    ) -> Result<(u64, u64, Vec<pb::Range>), Status> {
        let dir = &*self.nodes;
        let field = if base.is_some() { "target_snapshot_id" } else { "snapshot_id" };
        let (node, t) = snapshot(dir, field, target, None).await?;
        let since = match base {
            None => String::new(),
            Some(b) => {
                let (base_node, b) = snapshot(dir, "base_snapshot_id", b, Some(&node)).await?;
                if base_node != node || b.volume_id != t.volume_id {
                    return Err(Status::invalid_argument(format!(
                        "snapshots {:?} and {target:?} are not of one volume",
                        base.unwrap_or_default()
                    )));
                }
                if b.id > t.id {
                    return Err(Status::invalid_argument(format!(
                        "base snapshot {:?} was taken after {target:?}",
                        base.unwrap_or_default()
                    )));
                }
                b.name
            }
        };
        let start = starting(starting_offset, t.size)?;
        // A scattered delta is many ranges (about 10 bytes each on the wire): more than gRPC's
        // 4 MiB default for a volume with a few hundred thousand of them.
        let mut c = admin(dir, &node).await?.max_decoding_message_size(MAX_LISTING);
        let req = pb::ChangedRangesRequest { image: Some(pb::changed_ranges_request::Image::Snapshot(t.name)), since };
        let ranges = c.changed_ranges(req).await?.into_inner().ranges;
        Ok((t.size, start, ranges))
    }
}

fn capacity_i64(capacity: u64) -> Result<i64, Status> {
    i64::try_from(capacity).map_err(|_| Status::internal(format!("the daemon answered a size of {capacity} bytes")))
}

#[tonic::async_trait]
impl csi::snapshot_metadata_server::SnapshotMetadata for SnapshotMetadata {
    async fn get_metadata_allocated(
        &self,
        req: Request<csi::GetMetadataAllocatedRequest>,
    ) -> Result<Response<Stream<csi::GetMetadataAllocatedResponse>>, Status> {
        let r = req.into_inner();
        let (capacity, start, ranges) = self.listing(&r.snapshot_id, None, r.starting_offset).await?;
        let pages = pages(&ranges, start, r.max_results, capacity)?;
        let msgs = pages.into_iter().map(|block_metadata| {
            Ok(csi::GetMetadataAllocatedResponse {
                block_metadata_type: csi::BlockMetadataType::VariableLength as i32,
                volume_capacity_bytes: capacity_i64(capacity)?,
                block_metadata,
            })
        });
        Ok(Response::new(Box::pin(tokio_stream::iter(msgs.collect::<Vec<_>>()))))
    }

    async fn get_metadata_delta(
        &self,
        req: Request<csi::GetMetadataDeltaRequest>,
    ) -> Result<Response<Stream<csi::GetMetadataDeltaResponse>>, Status> {
        let r = req.into_inner();
        require("base_snapshot_id", &r.base_snapshot_id)?;
        let (capacity, start, ranges) =
            self.listing(&r.target_snapshot_id, Some(&r.base_snapshot_id), r.starting_offset).await?;
        let pages = pages(&ranges, start, r.max_results, capacity)?;
        let msgs = pages.into_iter().map(|block_metadata| {
            Ok(csi::GetMetadataDeltaResponse {
                block_metadata_type: csi::BlockMetadataType::VariableLength as i32,
                volume_capacity_bytes: capacity_i64(capacity)?,
                block_metadata,
            })
        });
        Ok(Response::new(Box::pin(tokio_stream::iter(msgs.collect::<Vec<_>>()))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(offset: u64, length: u64) -> pb::Range {
        pb::Range { offset, length }
    }

    #[test]
    fn pages_start_where_asked_and_hold_at_most_max_results() {
        let ranges = [r(0, 8192), r(16384, 4096), r(65536, 1 << 20)];
        let all = pages(&ranges, 0, 0, 4 << 20).unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].len(), 3);
        // Cut at the start: a range across it begins there, those before it are left out.
        let from = pages(&ranges, 4096, 2, 4 << 20).unwrap();
        assert_eq!(from.len(), 2);
        assert_eq!((from[0][0].byte_offset, from[0][0].size_bytes), (4096, 4096));
        assert_eq!(from[1].len(), 1);
        let past = pages(&ranges, 2 << 20, 5, 4 << 20).unwrap();
        assert_eq!(past, vec![Vec::new()], "one empty page tells the capacity");
        assert!(pages(&ranges, 0, -1, 4 << 20).is_err());
        // A daemon's answer past the capacity, or wrapping, is an error, not a panic.
        for bad in [pb::Range { offset: 4 << 20, length: 4096 }, pb::Range { offset: u64::MAX, length: 2 }] {
            assert_eq!(pages(&[bad], 0, 0, 4 << 20).unwrap_err().code(), tonic::Code::Internal);
        }
        assert!(pages(&ranges, 0, 0, u64::MAX).is_err());
        assert_eq!(starting(-1, 10).unwrap_err().code(), tonic::Code::OutOfRange);
        assert_eq!(starting(11, 10).unwrap_err().code(), tonic::Code::OutOfRange);
        assert_eq!(starting(10, 10).unwrap(), 10);
    }
}
