//! `ferrite backup ...`: the CLI of the Backups service.

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::backups_client::BackupsClient;
use serde_json::json;
use tonic::transport::Channel;

use crate::out::{Output, follow, rpc_error};
use ferrite_daemon::base::size::format_size;

#[derive(clap::Subcommand)]
pub enum BackupCmd {
    /// Back up VOLUME (or VOLUME@SNAPSHOT) to a target: incremental to its last backup there.
    Create {
        /// VOLUME, or VOLUME@SNAPSHOT to back up that snapshot (else one is taken and kept as
        /// the next backup's base).
        source: String,
        #[arg(long, short)]
        target: String,
        /// Read every chunk, not only those changed since the last backup.
        #[arg(long)]
        full: bool,
    },
    /// A target's backups (of one volume, or of all).
    List {
        #[arg(long, short)]
        target: String,
        volume: Option<String>,
    },
    /// One backup: VOLUME/ID.
    Show {
        name: String,
        #[arg(long, short)]
        target: String,
    },
    /// Delete a backup; chunks only it listed go with a later prune.
    Delete {
        name: String,
        #[arg(long, short)]
        target: String,
    },
    /// Read back chunks and check each (exit code 1 if any is bad).
    Verify {
        /// Backups (VOLUME/ID); none: every backup of --volume, or of the target.
        names: Vec<String>,
        #[arg(long, short)]
        target: String,
        #[arg(long)]
        volume: Option<String>,
        /// Check a random share of the chunks (0-1), e.g. 0.05.
        #[arg(long)]
        sample: Option<f64>,
    },
    /// Write the raw image of VOLUME/ID to a file (sparse) or stdout, straight from the target
    /// as the config file names it: no daemon and no pool needed (qemu-img, dd or a VM read it).
    Export {
        name: String,
        #[arg(long, short)]
        target: String,
        /// The config naming the target (default: the daemon's, /etc/ferrite/ferrite.toml).
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        /// The file to write (made 0600), or - for stdout.
        #[arg(long, short = 'f')]
        file: std::path::PathBuf,
    },
    /// Copy VOLUME/ID from one target to another (only the chunks the other lacks travel; the
    /// same key: sealed chunks go as they are), with the targets the config file names: run
    /// here, no daemon needed.
    Copy {
        name: String,
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
        /// The config naming the targets (default: the daemon's, /etc/ferrite/ferrite.toml).
        #[arg(long)]
        config: Option<std::path::PathBuf>,
    },
    /// Apply retention, then delete chunks no backup lists (after the target's grace).
    Prune {
        #[arg(long, short)]
        target: String,
        #[arg(long, default_value_t = 0)]
        keep_last: u32,
        #[arg(long, default_value_t = 0)]
        keep_daily: u32,
        #[arg(long, default_value_t = 0)]
        keep_weekly: u32,
        #[arg(long, default_value_t = 0)]
        keep_monthly: u32,
        #[arg(long, default_value_t = 0)]
        keep_yearly: u32,
        /// Apply the retention to backups CSI snapshots own too (by default they are kept:
        /// deleting their VolumeSnapshot deletes them).
        #[arg(long)]
        include_csi: bool,
        /// A grace other than the target's (its marker's): longer, or shorter only with
        /// --no-writers (0 deletes unreferenced chunks at once).
        #[arg(long)]
        grace_s: Option<u64>,
        /// No backup or copy to the target runs anywhere (checked against the writers' leases on
        /// the target): allows a --grace-s shorter than the target's.
        #[arg(long)]
        no_writers: bool,
    },
    /// Restore VOLUME/ID into a new volume on this daemon. The volume serves at once (reads of
    /// what is not copied yet fetch it first); this follows the background copy to its end.
    Restore {
        name: String,
        volume: String,
        #[arg(long, short)]
        target: String,
        /// An encrypted volume's backup restores encrypted under this key (default "default").
        #[arg(long, default_value = "")]
        key: String,
        /// Return as soon as the volume serves; the copy goes on in the daemon (run the same
        /// command again to follow it).
        #[arg(long)]
        detach: bool,
    },
    /// The targets the daemon's config names.
    Targets,
    /// Change the S3 Object Lock the target's marker records (the one way it changes). Then set
    /// the same object-lock-mode and object-lock-days in every daemon's config for the target
    /// and restart them: each refuses the target until its config agrees. AWS never shortens a
    /// compliance retention already set.
    SetLock {
        #[arg(long, short)]
        target: String,
        /// governance or compliance.
        #[arg(long)]
        mode: String,
        #[arg(long)]
        days: u64,
    },
}

pub async fn run(mut c: BackupsClient<Channel>, cmd: BackupCmd, out: Output) -> Result<()> {
    let bytes = |p: &pb::BackupProgress| (p.bytes_done, p.bytes_total, p.done);
    match cmd {
        BackupCmd::Create { source, target, full } => {
            let (volume, snapshot) = source.split_once('@').unwrap_or((&source, ""));
            let req = pb::CreateBackupRequest {
                target,
                volume: volume.into(),
                snapshot: snapshot.into(),
                full,
                id: String::new(),
            };
            let stream = c.create_backup(req).await.map_err(rpc_error)?.into_inner();
            let r = follow(stream, "backup", out, bytes).await?;
            print_made(out, &r);
        }
        BackupCmd::List { target, volume } => {
            let req = pb::ListBackupsRequest { target, volume: volume.unwrap_or_default() };
            let r = c.list_backups(req).await.map_err(rpc_error)?.into_inner();
            print_list(out, &r);
        }
        BackupCmd::Show { name, target } => {
            let b = c.get_backup(pb::GetBackupRequest { target, name }).await.map_err(rpc_error)?.into_inner();
            print_backup(out, &b);
        }
        BackupCmd::Delete { name, target } => {
            c.delete_backup(pb::DeleteBackupRequest { target, name: name.clone() }).await.map_err(rpc_error)?;
            crate::out::print_done(out, "deleted backup", &name);
        }
        BackupCmd::Verify { names, target, volume, sample } => {
            let req = pb::VerifyBackupsRequest {
                target,
                names,
                volume: volume.unwrap_or_default(),
                sample: sample.unwrap_or(0.0),
            };
            let stream = c.verify_backups(req).await.map_err(rpc_error)?.into_inner();
            let r = follow(stream, "verify", out, bytes).await?;
            print_verified(out, &r);
            anyhow::ensure!(r.bad.is_empty(), "{} chunks failed their check", r.bad.len());
        }
        BackupCmd::Prune {
            target,
            keep_last,
            keep_daily,
            keep_weekly,
            keep_monthly,
            keep_yearly,
            include_csi,
            grace_s,
            no_writers,
        } => {
            let req = pb::PruneBackupsRequest {
                target,
                keep_last,
                keep_daily,
                keep_weekly,
                keep_monthly,
                keep_yearly,
                grace_s,
                include_csi,
                no_writers,
            };
            let r = c.prune_backups(req).await.map_err(rpc_error)?.into_inner();
            print_pruned(out, &r);
        }
        BackupCmd::Restore { name, volume, target, key, detach } => {
            let encryption = Some(pb::KeyRef { key_id: key, key: Vec::new() });
            let req =
                pb::RestoreBackupRequest { target, name: name.clone(), volume: volume.clone(), encryption, detach };
            let stream = c.restore_backup(req).await.map_err(rpc_error)?.into_inner();
            let r = follow(stream, "restore", out, |m: &pb::BackupProgress| {
                (m.bytes_done, m.bytes_total, m.done || detach)
            })
            .await?;
            print_restored(out, &r, &name, &volume);
        }
        BackupCmd::Export { .. } | BackupCmd::Copy { .. } => anyhow::bail!("this runs here, not in the daemon"),
        BackupCmd::Targets => {
            let r = c.list_backup_targets(pb::ListBackupTargetsRequest {}).await.map_err(rpc_error)?.into_inner();
            print_targets(out, &r);
        }
        BackupCmd::SetLock { target, mode, days } => {
            let req = pb::SetBackupLockRequest { target: target.clone(), mode: mode.clone(), days };
            let r = c.set_backup_lock(req).await.map_err(rpc_error)?.into_inner();
            match out {
                Output::Json => println!(
                    "{}",
                    json!({"target": target, "mode": mode, "days": days,
                        "previous_mode": r.previous_mode, "previous_days": r.previous_days})
                ),
                Output::Table => println!(
                    "target {target}'s object lock is now {mode} for {days} days (was {}); set object-lock-mode and \
                     object-lock-days so in every daemon's config for it",
                    if r.previous_mode.is_empty() {
                        "none".to_owned()
                    } else {
                        format!("{} for {} days", r.previous_mode, r.previous_days)
                    }
                ),
            }
        }
    }
    Ok(())
}

/// A made backup.
fn print_made(out: Output, r: &pb::BackupProgress) {
    let b = r.backup.clone().unwrap_or_default();
    match out {
        Output::Json => println!("{}", backup_json(&b)),
        Output::Table => {
            println!(
                "backup {} made on {}: {} {} read, {} uploaded",
                b.name,
                b.target,
                if b.full { "full," } else { "incremental," },
                format_size(r.bytes_done),
                format_size(b.uploaded_bytes)
            );
            if !b.full_reason.is_empty() {
                println!("  read the whole volume: {}", b.full_reason);
            }
        }
    }
}

/// The backups of a target.
fn print_list(out: Output, r: &pb::ListBackupsResponse) {
    match out {
        Output::Json => println!("{}", serde_json::Value::Array(r.backups.iter().map(backup_json).collect())),
        Output::Table => {
            let rows = r
                .backups
                .iter()
                .map(|b| {
                    vec![
                        b.name.clone(),
                        if b.full { "full" } else { "incremental" }.into(),
                        format_size(b.size),
                        format_size(b.bytes),
                        format_size(b.uploaded_bytes),
                    ]
                })
                .collect();
            print!("{}", crate::out::table(&["BACKUP", "KIND", "SIZE", "DATA", "UPLOADED"], rows));
        }
    }
}

/// One backup.
fn print_backup(out: Output, b: &pb::Backup) {
    match out {
        Output::Json => println!("{}", backup_json(b)),
        Output::Table => {
            println!("backup {} on {}", b.name, b.target);
            println!(
                "  snapshot {} ({}), size {}",
                b.snapshot,
                if b.full { "full" } else { "incremental" },
                format_size(b.size)
            );
            if !b.previous.is_empty() {
                println!("  incremental to {}/{}", b.volume, b.previous);
            }
            if !b.full_reason.is_empty() {
                println!("  read the whole volume: {}", b.full_reason);
            }
            if !b.copied_from.is_empty() {
                println!("  copied from target {} (an operator's copy)", b.copied_from);
            }
            println!(
                "  {} chunks of {}: {} of data, {} uploaded by this backup{}",
                b.chunks,
                format_size(b.chunk_size),
                format_size(b.bytes),
                format_size(b.uploaded_bytes),
                if b.encrypted_volume { "; the volume is encrypted" } else { "" }
            );
        }
    }
}

/// What a verify found.
fn print_verified(out: Output, r: &pb::BackupProgress) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"chunks_checked": r.chunks_done, "bytes_checked": r.bytes_done,
                "bad": r.bad.iter().map(|b| json!({"chunk": b.chunk, "why": b.why, "backups": b.backups})).collect::<Vec<_>>()})
        ),
        Output::Table => {
            println!("verified {} chunks ({}): {} bad", r.chunks_done, format_size(r.bytes_done), r.bad.len());
            for b in &r.bad {
                println!("  chunk {}: {} (in {})", b.chunk, b.why, b.backups.join(", "));
            }
        }
    }
}

/// What a prune deleted.
fn print_pruned(out: Output, r: &pb::PruneBackupsResponse) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"backups_deleted": r.backups_deleted, "manifests": r.manifests,
                "chunks_referenced": r.chunks_referenced, "chunks_deleted": r.chunks_deleted,
                "bytes_deleted": r.bytes_deleted, "chunks_condemned": r.chunks_condemned,
                "locks_extended": r.locks_extended, "manifests_deleted": r.manifests_deleted,
                "backups_recovered": r.backups_recovered, "indexes_rebuilt": r.indexes_rebuilt})
        ),
        Output::Table => {
            for b in &r.backups_deleted {
                println!("deleted backup {b}");
            }
            println!(
                "{} backups list {} chunks; deleted {} chunks ({}); {} unreferenced chunks wait for the grace",
                r.manifests,
                r.chunks_referenced,
                r.chunks_deleted,
                format_size(r.bytes_deleted),
                r.chunks_condemned
            );
            if r.locks_extended > 0 {
                println!("extended the object lock of {} objects", r.locks_extended);
            }
            for v in &r.indexes_rebuilt {
                println!("warning: the index of volume {v} was missing: rebuilt from its manifests");
            }
            for b in &r.backups_recovered {
                println!("warning: backup {b} was missing from its index: listed again");
            }
        }
    }
}

/// The daemon's backup targets.
fn print_targets(out: Output, r: &pb::ListBackupTargetsResponse) {
    match out {
        Output::Json => println!(
            "{}",
            serde_json::Value::Array(
                r.targets
                    .iter()
                    .map(|t| json!({"name": t.name, "kind": t.kind, "location": t.location,
                        "encrypted": t.encrypted, "key_fingerprint": t.key_fingerprint}))
                    .collect()
            )
        ),
        Output::Table => {
            let rows = r
                .targets
                .iter()
                .map(|t| vec![t.name.clone(), t.kind.clone(), t.location.clone(), t.key_fingerprint.clone()])
                .collect();
            print!("{}", crate::out::table(&["TARGET", "KIND", "LOCATION", "KEY"], rows));
        }
    }
}

/// A restore: done, or going on in the daemon.
fn print_restored(out: Output, r: &pb::BackupProgress, name: &str, volume: &str) {
    let (copied, total, on_demand) = (r.chunks_done, r.chunks_total, r.chunks_on_demand);
    match out {
        Output::Json => println!(
            "{}",
            json!({"volume": volume, "backup": name, "done": r.done, "bytes": r.bytes_done,
                "chunks-done": copied, "chunks": total, "chunks-on-demand": on_demand})
        ),
        Output::Table if r.done => println!(
            "restored backup {name} into volume {volume} ({on_demand} of its {total} chunks fetched on demand)"
        ),
        Output::Table => println!(
            "volume {volume} serves; restoring backup {name} goes on in the daemon ({copied} of {total} chunks copied)"
        ),
    }
}

fn backup_json(b: &pb::Backup) -> serde_json::Value {
    json!({"target": b.target, "name": b.name, "volume": b.volume, "id": b.id, "snapshot": b.snapshot,
        "created_unix": b.created_unix, "size": b.size, "full": b.full, "previous": b.previous,
        "chunks": b.chunks, "bytes": b.bytes, "uploaded_bytes": b.uploaded_bytes,
        "chunk_size": b.chunk_size, "encrypted_volume": b.encrypted_volume, "full_reason": b.full_reason,
        "pool": b.pool, "snapshot_id": b.snapshot_id, "copied_from": b.copied_from})
}

/// The commands that run here, with the targets a config file names: `export` and `copy`.
pub async fn local(cmd: &BackupCmd, out: Output) -> Option<Result<()>> {
    Some(match cmd {
        BackupCmd::Export { name, target, config, file } => export(name, target, config.as_deref(), file).await,
        BackupCmd::Copy { name, from, to, config } => copy(name, from, to, config.as_deref(), out).await,
        _ => return None,
    })
}

/// Opens the targets `names` of the config file `config` (the daemon's by default).
async fn open_targets<const N: usize>(
    config: Option<&std::path::Path>,
    names: [&str; N],
) -> Result<[ferrite_backup::Target; N]> {
    let cfg = ferrite_daemon::base::config::Config::load(config, None)?;
    let mut out = Vec::with_capacity(N);
    for name in names {
        let t = cfg.backup_targets.get(name).ok_or_else(|| {
            let known: Vec<&str> = cfg.backup_targets.keys().map(String::as_str).collect();
            anyhow::anyhow!("no backup target {name:?} in the config (it has: {})", known.join(", "))
        })?;
        out.push(ferrite_backup::Target::open(name, t.clone()).await?);
    }
    Ok(out.try_into().expect("N targets"))
}

async fn copy(name: &str, from: &str, to: &str, config: Option<&std::path::Path>, out: Output) -> Result<()> {
    let [from, to] = open_targets(config, [from, to]).await?;
    let b: ferrite_backup::BackupRef = name.parse()?;
    let bar = std::sync::Mutex::new(crate::out::Progress::new("copy"));
    let progress = |p: &ferrite_backup::Progress| bar.lock().expect("not poisoned").update(p.bytes_done, p.bytes_total);
    let m = ferrite_backup::copy(&from, &to, &b, &progress).await?;
    bar.into_inner().expect("not poisoned").finish();
    match out {
        Output::Json => println!(
            "{}",
            json!({"name": name, "from": from.name, "to": to.name, "chunks": m.chunk_count(),
                "new_chunks": m.new_chunks, "uploaded_bytes": m.uploaded_bytes})
        ),
        Output::Table => {
            println!(
                "backup {name} copied from {} to {}: {} uploaded",
                from.name,
                to.name,
                format_size(m.uploaded_bytes)
            )
        }
    }
    Ok(())
}

/// `backup export`: the raw image of a backup, to a sparse file or stdout.
async fn export(name: &str, target: &str, config: Option<&std::path::Path>, file: &std::path::Path) -> Result<()> {
    let [t] = open_targets(config, [target]).await?;
    let b: ferrite_backup::BackupRef = name.parse()?;
    let bar = std::sync::Mutex::new(crate::out::Progress::new("export"));
    let progress = |p: &ferrite_backup::Progress| bar.lock().expect("not poisoned").update(p.bytes_done, p.bytes_total);
    if file.as_os_str() == "-" {
        let mut out = std::io::BufWriter::with_capacity(4 << 20, std::io::stdout());
        ferrite_backup::export(&t, &b, &mut out, &progress).await?;
    } else {
        use std::os::unix::fs::OpenOptionsExt as _;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(file)
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        let mut out = Sparse { file: f };
        let m = ferrite_backup::export(&t, &b, &mut out, &progress).await?;
        out.file.set_len(m.size)?;
        out.file.sync_all()?;
    }
    bar.into_inner().expect("not poisoned").finish();
    Ok(())
}

/// A file written in order whose runs of zeros are skipped (holes).
struct Sparse {
    file: std::fs::File,
}

impl std::io::Write for Sparse {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::io::Seek as _;
        if buf.iter().all(|&b| b == 0) {
            self.file.seek(std::io::SeekFrom::Current(i64::try_from(buf.len()).expect("a buffer's length")))?;
        } else {
            self.file.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}
