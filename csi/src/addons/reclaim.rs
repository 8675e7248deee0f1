//! CSI-Addons ReclaimSpace.
//!
//! - Node: a filesystem volume is trimmed (`fstrim` on its mount), which unmaps the blocks the
//!   filesystem no longer uses. A raw block volume has no filesystem to say what is unused, so we
//!   discard its allocated blocks that read back as zeros, and only while it is not published:
//!   with a writer present, a block read as zeros could be written between our read and our
//!   discard. Usage is the volume's allocated bytes before and after.
//! - Controller: runs the daemon's cleaner, which turns what trims and overwrites left dead into
//!   free segments. The cleaner works pool-wide, so usage is the node pool's physical use.

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use ferrite_proto::csi_addons::reclaimspace as rs;
use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::shared::args::{no_parameters, require};
use crate::shared::host;
use crate::shared::nodes::NodeDirectory;
use crate::spec::node::{Node, mounted_at, other_users, shows};

const BLOCK: usize = 4096;
/// How much of a raw block volume is read at a time while looking for zeroed blocks.
const SCAN_CHUNK: u64 = 1 << 20;

fn usage(bytes: u64) -> Option<rs::StorageConsumption> {
    Some(rs::StorageConsumption { usage_bytes: i64::try_from(bytes).unwrap_or(i64::MAX) })
}

#[derive(Debug)]
pub struct ReclaimController {
    pub nodes: Arc<dyn NodeDirectory>,
}

#[tonic::async_trait]
impl rs::reclaim_space_controller_server::ReclaimSpaceController for ReclaimController {
    async fn controller_reclaim_space(
        &self,
        req: Request<rs::ControllerReclaimSpaceRequest>,
    ) -> Result<Response<rs::ControllerReclaimSpaceResponse>, Status> {
        let r = req.into_inner();
        require("volume_id", &r.volume_id)?;
        no_parameters(&r.parameters)?;
        let (node, mut c, _) = crate::shared::copies::volume(&*self.nodes, &r.volume_id).await?;
        let done = c.reclaim_pool(pb::ReclaimPoolRequest {}).await?.into_inner();
        tracing::info!(volume_id = %r.volume_id, node, used_before = done.used_before, used_after = done.used_after,
            segments_freed = done.segments_freed, "cleaner ran");
        Ok(Response::new(rs::ControllerReclaimSpaceResponse {
            pre_usage: usage(done.used_before),
            post_usage: usage(done.used_after),
        }))
    }
}

/// Discards the all-zero blocks of `ranges` on `device`; returns the bytes discarded.
fn discard_zeroes(device: &Path, ranges: &[pb::Range]) -> std::io::Result<u64> {
    const BLKDISCARD: libc::c_ulong = 0x1277; // _IO(0x12, 119), linux/fs.h
    let f = std::fs::OpenOptions::new().read(true).write(true).open(device)?;
    let discard = |start: u64, len: u64| -> std::io::Result<()> {
        let range = [start, len];
        // SAFETY: BLKDISCARD reads two u64 (start, length) from the pointer, which points to
        // `range`, alive for the call; the descriptor is open for writing.
        if unsafe { libc::ioctl(f.as_raw_fd(), BLKDISCARD, range.as_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    let mut buf = vec![0u8; usize::try_from(SCAN_CHUNK).expect("1 MiB")];
    let mut discarded = 0;
    for r in ranges {
        let mut at = r.offset;
        let end = r.offset + r.length;
        let mut run: Option<(u64, u64)> = None; // (start, len) of zero blocks not yet discarded
        while at < end {
            let n = usize::try_from((end - at).min(SCAN_CHUNK)).expect("bounded");
            f.read_exact_at(&mut buf[..n], at)?;
            for (i, block) in buf[..n].chunks(BLOCK).enumerate() {
                let off = at + (i * BLOCK) as u64;
                if block.iter().all(|b| *b == 0) {
                    run = Some(run.map_or((off, block.len() as u64), |(s, l)| (s, l + block.len() as u64)));
                } else if let Some((s, l)) = run.take() {
                    discard(s, l)?;
                    discarded += l;
                }
            }
            at += n as u64;
        }
        if let Some((s, l)) = run {
            discard(s, l)?;
            discarded += l;
        }
    }
    Ok(discarded)
}

#[tonic::async_trait]
impl rs::reclaim_space_node_server::ReclaimSpaceNode for Node {
    async fn node_reclaim_space(
        &self,
        req: Request<rs::NodeReclaimSpaceRequest>,
    ) -> Result<Response<rs::NodeReclaimSpaceResponse>, Status> {
        let r = req.into_inner();
        require("volume_id", &r.volume_id)?;
        if r.volume_path.is_empty() && r.staging_target_path.is_empty() {
            return Err(Status::invalid_argument("volume_path or staging_target_path is required"));
        }
        let name = self.local(&r.volume_id, None).await?;
        let _busy = self.busy.begin(&r.volume_id)?;
        let mut c = self.admin().await?;
        let get = pb::GetVolumeRequest { name: name.into() };
        let pre = c.get_volume(get.clone()).await?.into_inner().allocated;
        let device = Node::staged_device(&mut c, name).await?;
        // A filesystem volume: trim through whichever of its mounts we were given.
        let mut fs_mount = None;
        for p in [&r.staging_target_path, &r.volume_path].into_iter().filter(|p| !p.is_empty()) {
            if let Some(m) = mounted_at(Path::new(p))?
                && m.fs_type != "devtmpfs"
                && shows(&m, &device)?
            {
                fs_mount = Some(p.clone());
                break;
            }
        }
        if let Some(p) = fs_mount {
            let out = host::run("fstrim", &["-v", &p]).await?;
            tracing::info!(volume_id = %r.volume_id, mount = p, "{}", out.trim());
        } else {
            let users: Vec<String> =
                other_users(&device, None)?.into_iter().map(|m| m.target.display().to_string()).collect();
            if !users.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "raw block volume {} is published at {users:?}: unused blocks can only be told from data \
                     while nothing writes to it; unpublish it first (or discard from inside the workload)",
                    r.volume_id
                )));
            }
            let ranges = c
                .changed_ranges(pb::ChangedRangesRequest {
                    image: Some(pb::changed_ranges_request::Image::Volume(name.into())),
                    since: String::new(),
                })
                .await?
                .into_inner()
                .ranges;
            let dev = device.clone();
            let discarded = tokio::task::spawn_blocking(move || discard_zeroes(&dev, &ranges))
                .await
                .map_err(|e| Status::internal(format!("reclaim task failed: {e}")))?
                .map_err(|e| Status::internal(format!("reclaiming {}: {e}", device.display())))?;
            tracing::info!(volume_id = %r.volume_id, discarded, "zeroed blocks of a raw block volume discarded");
        }
        let post = c.get_volume(get).await?.into_inner().allocated;
        Ok(Response::new(rs::NodeReclaimSpaceResponse { pre_usage: usage(pre), post_usage: usage(post) }))
    }
}
