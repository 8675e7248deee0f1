//! `ferrite volume ...` and `ferrite clone`: thin volumes, their limits and keys.

use anyhow::{Context, Result};
use ferrite_proto::ferrite::v1 as pb;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, Progress, rpc_error, table};
use ferrite_daemon::base::size::{format_size, parse_size};

#[derive(clap::Subcommand)]
pub enum VolumeCmd {
    /// Create a thin volume, e.g. `ferrite volume create db 10G [--iops 5000 --bw 200M]`.
    Create {
        name: String,
        #[arg(value_parser = parse_size)]
        size: u64,
        #[command(flatten)]
        limits: LimitArgs,
        /// Copies of the volume, this daemon's included: with --peer for each other one, kept
        /// in sync on every write (`replica add --sync`).
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// A daemon holding a synchronous replica (tcp://host:port); repeatable.
        #[arg(long = "peer")]
        peers: Vec<String>,
        /// A daemon voting in the volume's membership without holding data (tcp://host:port):
        /// with two copies, one side keeps writing when the other is lost.
        #[arg(long)]
        witness: Option<String>,
        /// Encrypt the volume (AES-256-XTS) with a data key of its own, wrapped by a
        /// key-encryption key from the daemon's key directory (--key, made there if missing).
        #[arg(long)]
        encrypt: bool,
        /// The key-encryption key's id (<key-dir>/<id>.key).
        #[arg(long, requires = "encrypt", default_value = "default")]
        key: String,
    },
    /// Open an encrypted volume (or snapshot) with its key from the daemon's key directory:
    /// what the daemon does at start for every volume whose key is there.
    Unlock { name: String },
    /// Wrap an encrypted volume's data key with a new key-encryption key, online, without
    /// rewriting data (--key: its id, made in the key directory if missing; default: a new
    /// key named after the volume and the time). The old key file may then be removed.
    ///
    /// With --data-key: replace the data key itself (one that may have leaked): every block is
    /// re-encrypted in the background, online; shows progress until done (--detach: returns at
    /// once; `volume show` shows it). Snapshots keep the old data key until deleted.
    Rekey {
        name: String,
        #[arg(long, conflicts_with = "data_key")]
        key: Option<String>,
        #[arg(long)]
        data_key: bool,
        #[arg(long, requires = "data_key")]
        detach: bool,
    },
    /// Change a volume's limits online: `ferrite volume set db --iops 5000 --bw 200M` (limits
    /// not named keep their value; 0 removes one).
    Set {
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// List volumes.
    List,
    /// Show one volume.
    Show { name: String },
    /// Grow a volume to a new size.
    Resize {
        name: String,
        #[arg(value_parser = parse_size)]
        size: u64,
    },
    /// Delete a volume and its data.
    Delete { name: String },
    /// Rewrite a volume's scattered blocks in logical order, so sequential reads are large
    /// contiguous reads again (after random writes); blocks being written now stay where they are.
    Defrag { name: String },
}

pub async fn run(c: &mut Admin, out: Output, cmd: VolumeCmd) -> Result<()> {
    match cmd {
        VolumeCmd::Create { name, size, limits, replicas, peers, witness, encrypt, key } => {
            anyhow::ensure!(
                replicas == peers.len() + 1,
                "--replicas {replicas} needs {} --peer (this daemon holds one copy)",
                replicas.saturating_sub(1)
            );
            let limits = Some(limits.over(pb::VolumeLimits::default()));
            let encryption = encrypt.then(|| pb::KeyRef { key_id: key, key: Vec::new() });
            let req = pb::CreateVolumeRequest { name: name.clone(), size, limits, encryption };
            let v = c.create_volume(req).await.map_err(rpc_error)?;
            let members = peers.into_iter().map(|p| (p, false)).chain(witness.map(|w| (w, true)));
            let mut last = None;
            for (peer, witness) in members {
                let req = pb::AddSyncReplicaRequest { volume: name.clone(), peer: peer.clone(), witness };
                let r = c.add_sync_replica(req).await.map_err(rpc_error);
                last = Some(r.with_context(|| format!("volume {name} was created; adding {peer} failed"))?);
            }
            match last {
                Some(s) => crate::cli::replica::print_sync_volumes(out, &[s.into_inner()]),
                None => print_volume(out, v.get_ref()),
            }
        }
        VolumeCmd::Set { name, limits } => {
            anyhow::ensure!(!limits.is_empty(), "name at least one limit (--iops, --bw, ... ; 0 removes one)");
            let now = c.get_volume(pb::GetVolumeRequest { name: name.clone() }).await.map_err(rpc_error)?;
            let limits = Some(limits.over(now.into_inner().limits.unwrap_or_default()));
            let v = c.set_volume_limits(pb::SetVolumeLimitsRequest { name, limits }).await.map_err(rpc_error)?;
            print_volume(out, v.get_ref());
        }
        VolumeCmd::Unlock { name } => {
            let v = c.unlock_volume(pb::UnlockVolumeRequest { name, key: None }).await.map_err(rpc_error)?;
            print_volume(out, v.get_ref());
        }
        VolumeCmd::Rekey { name, key, data_key, detach } => {
            let new_key = key.map(|key_id| pb::KeyRef { key_id, key: Vec::new() });
            let req = pb::RekeyVolumeRequest { name: name.clone(), old_key: None, new_key, data_key };
            let mut v = c.rekey_volume(req).await.map_err(rpc_error)?.into_inner();
            if data_key && !detach {
                v = wait_for_rotation(c, &name).await?;
            }
            print_volume(out, &v);
        }
        VolumeCmd::List => {
            let r = c.list_volumes(pb::ListVolumesRequest {}).await.map_err(rpc_error)?;
            print_volumes(out, &r.get_ref().volumes);
        }
        VolumeCmd::Show { name } => {
            let v = c.get_volume(pb::GetVolumeRequest { name }).await.map_err(rpc_error)?;
            print_volume(out, v.get_ref());
        }
        VolumeCmd::Resize { name, size } => {
            let v = c.grow_volume(pb::GrowVolumeRequest { name, new_size: size }).await.map_err(rpc_error)?;
            print_volume(out, v.get_ref());
        }
        VolumeCmd::Delete { name } => {
            c.delete_volume(pb::DeleteVolumeRequest { name: name.clone() }).await.map_err(rpc_error)?;
            crate::out::print_done(out, "deleted volume", &name);
        }
        VolumeCmd::Defrag { name } => {
            let req = pb::DefragVolumeRequest { name: name.clone() };
            let stream = c.defrag_volume(req).await.map_err(rpc_error)?.into_inner();
            let r = crate::out::follow(stream, "defrag", out, |p| (p.done_bytes, p.total_bytes, p.done)).await?;
            print_defrag(out, &name, &r);
        }
    }
    Ok(())
}

/// `ferrite clone SOURCE NAME`: a volume from a snapshot or from a volume.
pub async fn clone(c: &mut Admin, out: Output, source: String, name: String) -> Result<()> {
    use pb::clone_volume_request::Source;
    let source = match source.split_once('@') {
        Some((_, snap)) => Source::Snapshot(snap.to_owned()),
        None => {
            // A bare name is a snapshot if one is called that, else a volume.
            let snap = c.get_snapshot(pb::GetSnapshotRequest { name: source.clone() }).await;
            if snap.is_ok() { Source::Snapshot(source) } else { Source::Volume(source) }
        }
    };
    let v = c.clone_volume(pb::CloneVolumeRequest { name, source: Some(source) }).await.map_err(rpc_error)?;
    print_volume(out, v.get_ref());
    Ok(())
}

fn volume_json(v: &pb::Volume) -> serde_json::Value {
    let l = v.limits.unwrap_or_default();
    json!({"name": v.name, "id": v.id, "size": v.size, "allocated": v.allocated, "exclusive": v.exclusive,
    "chain_depth": v.chain_depth, "created_unix": v.created_unix, "exports": v.exports,
    "read_only": v.read_only, "notes": v.notes,
    "limits": {"iops": l.iops, "read_iops": l.read_iops, "write_iops": l.write_iops, "bps": l.bps,
               "read_bps": l.read_bps, "write_bps": l.write_bps, "burst_ms": l.burst_ms},
    "ops_per_sec": v.ops_per_sec, "bytes_per_sec": v.bytes_per_sec,
    "throttled_requests": v.throttled_requests, "throttled_seconds": v.throttled_seconds,
    "encryption": v.encryption.as_ref().map(|e| {
        let mut j = json!({"key_id": e.key_id, "unlocked": e.unlocked, "provider": e.provider});
        if let Some(r) = &e.rotation {
            j["rotation"] = json!({"running": r.running, "done": r.done, "total": r.total,
                                   "copied": r.copied, "error": r.error});
        }
        j
    })})
}

/// How a volume is encrypted, in a word or three.
fn encryption_text(v: &pb::Volume) -> String {
    match &v.encryption {
        None => "-".into(),
        Some(e) if e.rotation.is_some() => {
            let r = e.rotation.clone().unwrap_or_default();
            let pct = (r.done * 100).checked_div(r.total).unwrap_or(0);
            let state = if r.running { "" } else { " (stopped)" };
            format!("aes-xts, key {} ({}), data key rotation at {pct}%{state}", e.key_id, e.provider)
        }
        Some(e) if e.unlocked => format!("aes-xts, key {} ({})", e.key_id, e.provider),
        Some(e) => format!("aes-xts, key {} ({}), LOCKED", e.key_id, e.provider),
    }
}

/// `--iops`, `--bw` and the rest, for `volume create` and `volume set`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LimitArgs {
    /// Operations per second, reads and writes together (0: no limit).
    #[arg(long)]
    pub iops: Option<u64>,
    #[arg(long)]
    pub read_iops: Option<u64>,
    #[arg(long)]
    pub write_iops: Option<u64>,
    /// Bytes per second, reads and writes together (200M, 1G; 0: no limit).
    #[arg(long, value_parser = ferrite_daemon::base::size::parse_size)]
    pub bw: Option<u64>,
    #[arg(long, value_parser = ferrite_daemon::base::size::parse_size)]
    pub read_bw: Option<u64>,
    #[arg(long, value_parser = ferrite_daemon::base::size::parse_size)]
    pub write_bw: Option<u64>,
    /// How much idle time is banked for a burst (500ms, 2s; default 1s).
    #[arg(long, value_parser = parse_burst)]
    pub burst: Option<u64>,
}

/// A burst allowance in milliseconds: `500ms`, `2s`, or a bare number of seconds (the CSI
/// parameter's parser, which wants the unit).
pub fn parse_burst(s: &str) -> Result<u64, String> {
    let (n, unit) = s.split_at(s.find(char::is_alphabetic).unwrap_or(s.len()));
    let unit = if unit.is_empty() { "s" } else { unit };
    ferrite_csi::shared::qos::burst_ms(&format!("{}{unit}", n.trim()))
        .ok_or_else(|| format!("{s:?} is not a burst allowance like 500ms or 2s (at most an hour)"))
}

/// A measured rate as a whole number (rates are never negative; fractions do not matter here).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn whole(rate: f64) -> u64 {
    rate.max(0.0).round() as u64
}

/// One volume's limits, for people: "5000 IOPS, 200.0 MiB/s write" or "none".
fn limits_text(l: &pb::VolumeLimits) -> String {
    let mut parts = Vec::new();
    for (v, what) in [(l.iops, ""), (l.read_iops, " read"), (l.write_iops, " write")] {
        if v > 0 {
            parts.push(format!("{v} IOPS{what}"));
        }
    }
    for (v, what) in [(l.bps, ""), (l.read_bps, " read"), (l.write_bps, " write")] {
        if v > 0 {
            parts.push(format!("{}/s{what}", format_size(v)));
        }
    }
    if parts.is_empty() {
        return "none".into();
    }
    let burst = if l.burst_ms == 0 { 1000 } else { l.burst_ms };
    format!("{}, burst {burst} ms", parts.join(", "))
}

pub fn print_volumes(out: Output, vols: &[pb::Volume]) {
    match out {
        Output::Json => println!("{}", serde_json::Value::Array(vols.iter().map(volume_json).collect())),
        Output::Table => {
            let rows = vols
                .iter()
                .map(|v| {
                    let enc = encryption_text(v);
                    vec![v.name.clone(), format_size(v.size), format_size(v.allocated), enc, v.exports.join(",")]
                })
                .collect();
            println!("{}", table(&["NAME", "SIZE", "ALLOCATED", "ENCRYPTION", "EXPORTS"], rows));
        }
    }
}

pub fn print_volume(out: Output, v: &pb::Volume) {
    for n in &v.notes {
        eprintln!("note: {n}");
    }
    match out {
        Output::Json => println!("{}", volume_json(v)),
        Output::Table => {
            let rows = vec![
                vec!["name".into(), v.name.clone()],
                vec!["id".into(), v.id.to_string()],
                vec!["size".into(), format!("{} ({} bytes)", format_size(v.size), v.size)],
                vec!["allocated".into(), format!("{} ({} bytes)", format_size(v.allocated), v.allocated)],
                vec!["exclusive".into(), format_size(v.exclusive)],
                vec!["chain depth".into(), v.chain_depth.to_string()],
                vec!["exports".into(), if v.exports.is_empty() { "-".into() } else { v.exports.join(", ") }],
                vec!["encryption".into(), encryption_text(v)],
                vec!["limits".into(), limits_text(&v.limits.unwrap_or_default())],
                vec![
                    "rate".into(),
                    format!(
                        "{:.0} IOPS, {}/s ({} requests delayed, {:.1} s in all)",
                        v.ops_per_sec,
                        format_size(whole(v.bytes_per_sec)),
                        v.throttled_requests,
                        v.throttled_seconds
                    ),
                ],
            ];
            println!("{}", table(&["FIELD", "VALUE"], rows));
        }
    }
}

pub fn print_defrag(out: Output, name: &str, r: &pb::DefragVolumeProgress) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"volume": name, "moved_bytes": r.moved_bytes, "mapped_bytes": r.mapped_bytes,
                   "runs_before": r.runs_before, "runs_after": r.runs_after})
        ),
        Output::Table => println!(
            "defrag {name}: {} rewritten; a sequential read of its {} takes {} contiguous runs (was {})",
            format_size(r.moved_bytes),
            format_size(r.mapped_bytes),
            r.runs_after,
            r.runs_before
        ),
    }
}

/// Follows volume `name`'s data-key rotation until it is done, with progress; fails with the
/// reason it stopped.
pub async fn wait_for_rotation(c: &mut Admin, name: &str) -> anyhow::Result<pb::Volume> {
    let mut progress = Progress::new("re-encrypting");
    let mut total = 0;
    loop {
        let v = c.get_volume(pb::GetVolumeRequest { name: name.into() }).await.map_err(rpc_error)?.into_inner();
        match v.encryption.as_ref().and_then(|e| e.rotation.as_ref()) {
            None => {
                let total = if total == 0 { v.size } else { total };
                progress.update(total, total);
                progress.finish();
                return Ok(v);
            }
            Some(r) if !r.running && !r.error.is_empty() => {
                progress.finish();
                anyhow::bail!("the data key rotation of {name} stopped: {} (run the command again to resume)", r.error);
            }
            Some(r) => {
                total = r.total;
                progress.update(r.done, r.total);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

impl LimitArgs {
    pub fn is_empty(&self) -> bool {
        [self.iops, self.read_iops, self.write_iops, self.bw, self.read_bw, self.write_bw, self.burst]
            .iter()
            .all(Option::is_none)
    }

    /// `base` with the limits given here in place of its own.
    pub fn over(&self, base: pb::VolumeLimits) -> pb::VolumeLimits {
        pb::VolumeLimits {
            iops: self.iops.unwrap_or(base.iops),
            read_iops: self.read_iops.unwrap_or(base.read_iops),
            write_iops: self.write_iops.unwrap_or(base.write_iops),
            bps: self.bw.unwrap_or(base.bps),
            read_bps: self.read_bw.unwrap_or(base.read_bps),
            write_bps: self.write_bw.unwrap_or(base.write_bps),
            burst_ms: self.burst.unwrap_or(base.burst_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_allowances_parse() {
        for (s, ms) in [("500ms", 500), ("2s", 2000), ("2", 2000), ("2 s", 2000), ("3600s", 3_600_000)] {
            assert_eq!(parse_burst(s), Ok(ms), "{s}");
        }
        for s in ["forever", "0s", "0", "3601s", "", "2h"] {
            assert!(parse_burst(s).unwrap_err().contains("burst allowance"), "{s}");
        }
    }
}
