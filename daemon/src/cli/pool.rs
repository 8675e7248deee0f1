//! `ferrite pool ...`: the pool's figures, the cleaner, scrub; formatting a pool and choosing a
//! Kubernetes node's pool are programs (`program/`).

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, rpc_error, table};
use ferrite_daemon::base::size::format_size;

#[derive(clap::Subcommand)]
pub enum PoolCmd {
    /// Make a new pool on a block device or a file (offline: the daemon must not be running),
    /// with its catalog in the configuration's meta-dir. Refuses a store holding a filesystem,
    /// a partition table, a volume manager or another pool unless --force, and one in use always.
    Format(crate::program::pool_format::Args),
    /// For the data-path DaemonSet's init container: the pool this Kubernetes node's
    /// annotations name (pool.ferrite.dev/device; formatted only if blank and
    /// pool.ferrite.dev/format is "true"), written into the daemon's configuration.
    Node(crate::program::node_pool::Args),
    /// Space, log, traffic and cleaner figures.
    Status,
    /// Run the cleaner now: move live data out of segments with dead space and free them.
    Reclaim,
    /// Read every live block and verify its checksum; lists damaged blocks with the volumes and
    /// snapshots that read them (exit code 1 if any).
    Scrub,
}

pub async fn run(c: &mut Admin, out: Output, cmd: PoolCmd) -> Result<()> {
    match cmd {
        PoolCmd::Format(_) | PoolCmd::Node(_) => unreachable!("programs, run by main"),
        PoolCmd::Status => {
            let s = c.pool_status(pb::PoolStatusRequest {}).await.map_err(rpc_error)?;
            print_pool(out, s.get_ref());
            // The daemon's readiness probe runs this: a failed pool takes the node out of service.
            anyhow::ensure!(!s.get_ref().failed, "the pool stopped after a media failure; restart the daemon");
        }
        PoolCmd::Scrub => {
            let stream = c.scrub_pool(pb::ScrubPoolRequest {}).await.map_err(rpc_error)?.into_inner();
            let r = crate::out::follow(stream, "scrub", out, |p| (p.checked_bytes, p.total_bytes, p.done)).await?;
            print_scrub(out, &r);
            if r.damaged_blocks > 0 {
                anyhow::bail!("scrub found {} damaged blocks", r.damaged_blocks);
            }
        }
        PoolCmd::Reclaim => {
            if out == Output::Table {
                eprintln!("reclaiming: cleaning segments with dead space...");
            }
            let r = c.reclaim_pool(pb::ReclaimPoolRequest {}).await.map_err(rpc_error)?;
            print_reclaim(out, r.get_ref());
        }
    }
    Ok(())
}

pub fn print_pool(out: Output, s: &pb::PoolStatusResponse) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"uuid": s.uuid, "path": s.path, "size": s.size, "used": s.used, "free": s.free,
                   "live": s.live, "reclaimable": s.reclaimable, "segment_size": s.segment_size,
                   "segments": s.segments, "segments_free": s.segments_free, "volumes": s.volumes,
                   "log_seq": s.log_seq, "generation": s.generation,
                   "client_bytes_written": s.client_bytes_written, "media_bytes_written": s.media_bytes_written,
                   "nbd_connections": s.nbd_connections, "cleaner_active": s.cleaner_active,
                   "cleaner_runs": s.cleaner_runs, "cleaner_segments_cleaned": s.cleaner_segments_cleaned,
                   "cleaner_bytes_moved": s.cleaner_bytes_moved, "failed": s.failed,
                   "backing_free": s.backing_free, "provisionable": s.provisionable,
                   "zone": s.zone, "region": s.region})
        ),
        Output::Table => {
            let wa = if s.client_bytes_written > 0 {
                format!("{:.2}", s.media_bytes_written as f64 / s.client_bytes_written as f64)
            } else {
                "-".into()
            };
            let mut rows = vec![
                vec!["uuid".into(), s.uuid.clone()],
                vec!["state".into(), if s.failed { "FAILED (media failure: restart the daemon)" } else { "ok" }.into()],
                vec!["path".into(), s.path.clone()],
                vec!["size".into(), format_size(s.size)],
                vec!["used".into(), format_size(s.used)],
                vec!["free".into(), format_size(s.free)],
                vec!["live".into(), format_size(s.live)],
                vec!["reclaimable".into(), format_size(s.reclaimable)],
                vec![
                    "segments".into(),
                    format!("{} of {} free ({} each)", s.segments_free, s.segments, format_size(s.segment_size)),
                ],
                vec!["volumes".into(), s.volumes.to_string()],
                vec!["write amplification".into(), wa],
                vec![
                    "cleaner".into(),
                    format!(
                        "{}; {} runs, {} segments cleaned, {} moved",
                        if s.cleaner_active { "running" } else { "idle" },
                        s.cleaner_runs,
                        s.cleaner_segments_cleaned,
                        format_size(s.cleaner_bytes_moved)
                    ),
                ],
                vec!["nbd connections".into(), s.nbd_connections.to_string()],
            ];
            if !s.zone.is_empty() || !s.region.is_empty() {
                rows.push(vec!["zone / region".into(), format!("{} / {}", s.zone, s.region)]);
            }
            println!("{}", table(&["POOL", ""], rows));
        }
    }
}

pub fn print_reclaim(out: Output, r: &pb::ReclaimPoolResponse) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"segments_cleaned": r.segments_cleaned, "bytes_moved": r.bytes_moved,
                   "segments_freed": r.segments_freed, "used_before": r.used_before, "used_after": r.used_after,
                   "live": r.live})
        ),
        Output::Table => println!(
            "reclaimed: used {} -> {} (live {}); {} segments cleaned, {} moved, {} segments freed",
            format_size(r.used_before),
            format_size(r.used_after),
            format_size(r.live),
            r.segments_cleaned,
            format_size(r.bytes_moved),
            r.segments_freed
        ),
    }
}

pub fn print_scrub(out: Output, r: &pb::ScrubPoolProgress) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"checked_bytes": r.checked_bytes, "damaged_blocks": r.damaged_blocks,
                   "damaged": r.damaged.iter().map(|d| json!({"offset": d.offset, "pool_block": d.pool_block,
                                                               "images": d.images})).collect::<Vec<_>>()})
        ),
        Output::Table => {
            for d in &r.damaged {
                println!("damaged: offset {} (pool block {}) in {}", d.offset, d.pool_block, d.images.join(", "));
            }
            println!("scrub: {} checked, {} damaged blocks", format_size(r.checked_bytes), r.damaged_blocks);
        }
    }
}
