//! The command-line client: each subcommand is one admin API call, printed as a table or JSON.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use serde_json::json;
use tonic::transport::Channel;

use ferrite_daemon::base::size::format_size;

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// Connects to the daemon's admin API: a Unix socket path, or `tcp://host:port` (over TLS with
/// `tls`).
/// A client of a daemon's admin API.
pub type Admin = AdminClient<Channel>;

pub async fn connect(endpoint: &str, tls: Option<Arc<ferrite_proto::ClientTls>>) -> Result<Admin> {
    let channel = ferrite_proto::connect(endpoint, tls)
        .await
        .with_context(|| format!("cannot reach the ferrite daemon at {endpoint} (is it running?)"))?;
    Ok(AdminClient::new(channel))
}

/// `ferrite certs`: the CA in `dir` (made if missing) and a certificate for `name`.
pub fn make_certs(dir: &Path, name: &str, sans: &[String], roles: &[String], days: u32) -> Result<()> {
    use ferrite_tls::certs;
    for r in roles {
        r.parse::<ferrite_daemon::authz::Role>().map_err(|e| anyhow::anyhow!("--role: {e}"))?;
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let write = |file: &str, text: &str, mode: u32| -> Result<PathBuf> {
        let p = dir.join(file);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&p)
            .with_context(|| format!("writing {} (it must not exist yet)", p.display()))?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        Ok(p)
    };
    let ca_key = dir.join("ca-key.pem");
    if !ca_key.exists() {
        let ca = certs::new_ca(days.saturating_mul(10)).context("making the CA")?;
        write("ca.pem", &ca.cert_pem, 0o644)?;
        write("ca-key.pem", &ca.key_pem, 0o600)?;
        println!("made CA {} (keep ca-key.pem secret)", dir.join("ca.pem").display());
    }
    let ca_key = std::fs::read_to_string(&ca_key).with_context(|| format!("reading {}", ca_key.display()))?;
    let mut all = vec![name.to_string()];
    all.extend(sans.iter().filter(|s| *s != name).cloned());
    let issued =
        certs::issue(&ca_key, name, &all, days).with_context(|| format!("issuing a certificate for {name}"))?;
    let cert = write(&format!("{name}.pem"), &issued.cert_pem, 0o644)?;
    let key = write(&format!("{name}-key.pem"), &issued.key_pem, 0o600)?;
    println!("made {} and {} for {}, valid {days} days", cert.display(), key.display(), all.join(", "));
    if !roles.is_empty() {
        let list: Vec<String> = roles.iter().map(|r| format!("{r:?}")).collect();
        println!("its roles, for the [roles] table of each daemon it calls:\n{name:?} = [{}]", list.join(", "));
    }
    Ok(())
}

/// Turns a gRPC status into a one-line error.
pub fn rpc_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}", s.message())
}

pub fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ").trim_end().to_string()
    };
    let mut out = vec![line(headers.iter().map(|h| (*h).to_string()).collect())];
    out.extend(rows.into_iter().map(line));
    out.join("\n")
}

/// Seconds since the epoch as `YYYY-MM-DD hh:mm:ss` (UTC).
pub fn format_time(unix: u64) -> String {
    let Ok(t) =
        i64::try_from(unix).map_err(drop).and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).map_err(drop))
    else {
        return unix.to_string();
    };
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
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

/// A burst allowance in milliseconds: `500ms`, `2s`, or a bare number of seconds (the CSI
/// parameter's parser, which wants the unit).
pub fn parse_burst(s: &str) -> Result<u64, String> {
    let (n, unit) = s.split_at(s.find(char::is_alphabetic).unwrap_or(s.len()));
    let unit = if unit.is_empty() { "s" } else { unit };
    ferrite_csi::qos::burst_ms(&format!("{}{unit}", n.trim()))
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

fn snapshot_json(s: &pb::Snapshot) -> serde_json::Value {
    json!({"name": s.name, "id": s.id, "volume": s.volume, "volume_id": s.volume_id, "size": s.size,
           "created_unix": s.created_unix, "layer_bytes": s.layer_bytes,
           "reclaimable_on_delete": s.reclaimable_on_delete})
}

/// One line (or a JSON object) saying what was done to what.
pub fn print_done(out: Output, what: &str, name: &str) {
    match out {
        Output::Json => println!("{}", json!({ what.split(' ').next().unwrap_or(what): name })),
        Output::Table => println!("{what} {name}"),
    }
}

pub fn print_sync(out: Output, r: &pb::SyncReplicationResponse) {
    match out {
        Output::Json => println!(
            "{}",
            json!({ "snapshot": r.snapshot, "base": r.base, "data_bytes": r.data_bytes, "resumed": r.resumed })
        ),
        Output::Table => {
            let over = if r.base.is_empty() { "a first sync".to_owned() } else { format!("over {}", r.base) };
            let how = if r.resumed { ", finishing an interrupted transfer" } else { "" };
            println!("replica at {} ({over}{how}): {} of data sent", r.snapshot, format_size(r.data_bytes));
        }
    }
}

/// Runs `call` while showing the progress of `volume`'s running transfer.
pub async fn with_progress<T>(c: &Admin, volume: &str, what: &'static str, call: impl Future<Output = T>) -> T {
    let mut progress = Progress::new(what);
    let mut poll = c.clone();
    let watch = async {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let req = pb::ListReplicationsRequest { volume: volume.to_owned() };
            if let Ok(r) = poll.list_replications(req).await
                && let Some(x) = r.get_ref().replications.first().filter(|x| x.state == "syncing")
            {
                progress.update(x.bytes_done, x.bytes_done + x.bytes_left);
            }
        }
    };
    let out = tokio::select! {
        out = call => out,
        () = watch => unreachable!("the watch never ends"),
    };
    progress.finish();
    out
}

fn replication_json(r: &pb::Replication) -> serde_json::Value {
    json!({"volume": r.volume, "role": r.role, "peer": r.peer, "remote": r.remote,
           "interval_secs": r.interval_secs, "state": r.state, "error": r.error,
           "last_snapshot": r.last_snapshot, "last_snapshot_unix_ms": r.last_snapshot_unix_ms,
           "last_sync_seconds": r.last_sync_seconds, "last_sync_bytes": r.last_sync_bytes,
           "lag_seconds": r.lag_seconds, "bytes_done": r.bytes_done, "bytes_left": r.bytes_left,
           "bytes_per_second": r.bytes_per_second, "handover": r.handover, "resynced": r.resynced,
           "group": r.group, "members": r.members, "snapshots": r.snapshots})
}

pub fn print_replications(out: Output, list: &[pb::Replication]) {
    match out {
        Output::Json if list.len() == 1 => println!("{}", replication_json(&list[0])),
        Output::Json => println!("{}", serde_json::Value::Array(list.iter().map(replication_json).collect())),
        Output::Table => {
            let rows = list
                .iter()
                .map(|r| {
                    let state = match (r.state.as_str(), r.handover) {
                        ("syncing", _) => format!("syncing {} left", format_size(r.bytes_left)),
                        (s, true) => format!("{s}, final delta pending"),
                        (s, false) => s.to_owned(),
                    };
                    let every =
                        if r.interval_secs == 0 { "on request".into() } else { format!("{}s", r.interval_secs) };
                    let lag = if r.last_snapshot.is_empty() { "-".into() } else { format!("{:.1}s", r.lag_seconds) };
                    let name = if r.group {
                        format!("{} (group: {})", r.volume, r.members.join(", "))
                    } else {
                        r.volume.clone()
                    };
                    vec![name, r.role.clone(), format!("{}:{}", r.peer, r.remote), state, lag, every]
                })
                .collect();
            println!("{}", table(&["VOLUME", "ROLE", "PEER:VOLUME", "STATE", "LAG", "INTERVAL"], rows));
            for r in list.iter().filter(|r| !r.error.is_empty()) {
                println!("{}: {}", r.volume, r.error);
            }
        }
    }
}

fn sync_json(v: &pb::SyncVolume) -> serde_json::Value {
    let members: Vec<_> = v
        .members
        .iter()
        .map(|m| json!({"endpoint": m.endpoint, "state": m.state, "reason": m.reason, "mark": m.mark}))
        .collect();
    json!({"volume": v.volume, "kind": "sync", "role": v.role, "generation": v.generation, "primary": v.primary,
           "members": members, "refused": v.refused, "requests": v.requests,
           "added_latency_us": v.added_latency_us})
}

/// Synchronous volumes: one row per member.
pub fn print_sync_volumes(out: Output, list: &[pb::SyncVolume]) {
    match out {
        Output::Json if list.len() == 1 => println!("{}", sync_json(&list[0])),
        Output::Json => println!("{}", serde_json::Value::Array(list.iter().map(sync_json).collect())),
        Output::Table => {
            let mut rows = Vec::new();
            for v in list {
                for m in &v.members {
                    let state =
                        if m.reason.is_empty() { m.state.clone() } else { format!("{} ({})", m.state, m.reason) };
                    rows.push(vec![v.volume.clone(), v.generation.to_string(), m.endpoint.clone(), state]);
                }
            }
            println!("{}", table(&["VOLUME", "GENERATION", "MEMBER", "STATE"], rows));
            for v in list {
                let added =
                    if v.requests == 0 { String::new() } else { format!(", +{:.0} µs per write", v.added_latency_us) };
                println!("{}: {} here{added}", v.volume, v.role);
                if !v.refused.is_empty() {
                    println!("{}: {}", v.volume, v.refused);
                }
            }
        }
    }
}

pub fn print_snapshots(out: Output, snaps: &[pb::Snapshot]) {
    match out {
        Output::Json => println!("{}", serde_json::Value::Array(snaps.iter().map(snapshot_json).collect())),
        Output::Table => {
            let rows = snaps
                .iter()
                .map(|s| {
                    vec![
                        s.name.clone(),
                        if s.volume.is_empty() { "(deleted)".into() } else { s.volume.clone() },
                        format_size(s.size),
                        format_size(s.layer_bytes),
                        format_size(s.reclaimable_on_delete),
                        format_time(s.created_unix),
                    ]
                })
                .collect();
            println!("{}", table(&["SNAPSHOT", "VOLUME", "SIZE", "CHANGED", "FREED ON DELETE", "CREATED (UTC)"], rows));
        }
    }
}

pub fn print_snapshot(out: Output, s: &pb::Snapshot) {
    match out {
        Output::Json => println!("{}", snapshot_json(s)),
        Output::Table => {
            let rows = vec![
                vec!["name".into(), s.name.clone()],
                vec!["id".into(), s.id.to_string()],
                vec!["volume".into(), if s.volume.is_empty() { "(deleted)".into() } else { s.volume.clone() }],
                vec!["size".into(), format!("{} ({} bytes)", format_size(s.size), s.size)],
                vec!["changed since previous".into(), format_size(s.layer_bytes)],
                vec!["freed on delete".into(), format_size(s.reclaimable_on_delete)],
            ];
            println!("{}", table(&["FIELD", "VALUE"], rows));
        }
    }
}

fn export_json(e: &pb::Export) -> serde_json::Value {
    json!({"name": e.name, "volume": e.volume, "read_only": e.read_only,
           "unix_socket": e.unix_socket, "tcp_address": e.tcp_address, "uris": e.uris, "allow": e.allow})
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

fn attachment_json(a: &pb::Attachment) -> serde_json::Value {
    serde_json::json!({"volume": a.volume, "device": a.device, "transport": a.transport,
                       "read_only": a.read_only, "size": a.size, "detail": a.detail, "remote": a.remote})
}

/// `ferrite attach` prints the device alone (for `DEV=$(ferrite attach vol)`) and says on stderr
/// how it was made.
pub fn print_attachment(out: Output, a: &pb::Attachment) {
    match out {
        Output::Json => println!("{}", attachment_json(a)),
        Output::Table => {
            eprintln!("attached {} via {}: {}", a.volume, a.transport, a.detail);
            println!("{}", a.device);
        }
    }
}

pub fn print_attachments(out: Output, list: &[pb::Attachment]) {
    match out {
        Output::Json => println!("{}", serde_json::Value::Array(list.iter().map(attachment_json).collect())),
        Output::Table => {
            let rows = list
                .iter()
                .map(|a| {
                    vec![
                        a.device.clone(),
                        a.volume.clone(),
                        if a.remote.is_empty() {
                            a.transport.clone()
                        } else {
                            format!("{} via {}", a.transport, a.remote)
                        },
                        if a.read_only { "ro" } else { "rw" }.into(),
                        format_size(a.size),
                    ]
                })
                .collect();
            println!("{}", table(&["DEVICE", "VOLUME", "TRANSPORT", "MODE", "SIZE"], rows));
        }
    }
}

pub fn print_fences(out: Output, r: &pb::FenceResponse) {
    match out {
        Output::Json => {
            let by: serde_json::Map<_, _> = r.fences.iter().map(|f| (f.cidr.clone(), json!(f.by))).collect();
            println!("{}", json!({ "fenced": r.cidrs, "by": by, "connections_cut": r.connections_cut }));
        }
        Output::Table => {
            if r.connections_cut > 0 {
                println!("cut {} open connection(s)", r.connections_cut);
            }
            let rows = r.fences.iter().map(|f| vec![f.cidr.clone(), f.by.join(", ")]).collect();
            println!("{}", table(&["FENCED", "BY"], rows));
        }
    }
}

pub fn print_clients(out: Output, clients: &[pb::Client]) {
    match out {
        Output::Json => {
            let v: Vec<_> = clients
                .iter()
                .map(|c| json!({ "id": c.id, "address": c.address, "listener": c.listener, "connected_unix": c.connected_unix }))
                .collect();
            println!("{}", serde_json::Value::Array(v));
        }
        Output::Table => {
            let rows = clients
                .iter()
                .map(|c| vec![c.id.to_string(), c.address.clone(), c.listener.clone(), c.connected_unix.to_string()])
                .collect();
            println!("{}", table(&["ID", "ADDRESS", "LISTENER", "SINCE (UNIX)"], rows));
        }
    }
}

pub fn print_exports(out: Output, exports: &[pb::Export]) {
    match out {
        Output::Json => println!("{}", serde_json::Value::Array(exports.iter().map(export_json).collect())),
        Output::Table => {
            let rows = exports
                .iter()
                .map(|e| {
                    vec![
                        e.name.clone(),
                        e.volume.clone(),
                        if e.read_only { "ro" } else { "rw" }.into(),
                        e.uris.join(" "),
                    ]
                })
                .collect();
            println!("{}", table(&["EXPORT", "VOLUME", "MODE", "URI"], rows));
        }
    }
}

pub fn print_export(out: Output, e: &pb::Export) {
    match out {
        Output::Json => println!("{}", export_json(e)),
        Output::Table => {
            println!(
                "exported volume {} as {:?} ({})",
                e.volume,
                e.name,
                if e.read_only { "read-only" } else { "read-write" }
            );
            for u in &e.uris {
                println!("  {u}");
            }
            if !e.allow.is_empty() {
                println!("  TCP clients allowed: {}", e.allow.join(", "));
            }
            if let Some(u) = e.uris.first() {
                println!("try:  nbdinfo '{u}'");
                println!("      qemu-img info 'nbd:unix:{}:exportname={}'", e.unix_socket, e.name);
            }
        }
    }
}

pub fn print_version(out: Output, v: &pb::VersionResponse) {
    let cli = ferrite_proto::version::VERSION;
    match out {
        Output::Json => println!(
            "{}",
            json!({"cli": cli, "daemon": v.version, "format_version": v.format_version,
                   "oldest_format": v.oldest_format, "upgraded_from": v.upgraded_from})
        ),
        Output::Table => {
            println!("cli      {cli}");
            println!(
                "daemon   {} (pool format {}, opens {} to {})",
                v.version, v.format_version, v.oldest_format, v.format_version
            );
            if v.upgraded_from != 0 {
                println!("         upgraded the pool from format {} when it started", v.upgraded_from);
            }
        }
    }
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

pub fn print_ranges(out: Output, r: &pb::ChangedRangesResponse) {
    match out {
        Output::Json => println!(
            "{}",
            json!({"bytes": r.bytes,
                   "ranges": r.ranges.iter().map(|x| json!({"offset": x.offset, "length": x.length})).collect::<Vec<_>>()})
        ),
        Output::Table => {
            let rows = r.ranges.iter().map(|x| vec![x.offset.to_string(), x.length.to_string()]).collect();
            println!("{}", table(&["OFFSET", "LENGTH"], rows));
            println!("{} in {} ranges", format_size(r.bytes), r.ranges.len());
        }
    }
}

/// Follows a streamed job to its end: a progress line (table output) fed by `progress` of each
/// message, which also says whether the message is the final one; returns that final message.
pub async fn follow<T>(
    mut stream: tonic::Streaming<T>,
    what: &'static str,
    out: Output,
    progress: impl Fn(&T) -> (u64, u64, bool),
) -> Result<T> {
    let mut last = None;
    let mut bar = (out == Output::Table).then(|| Progress::new(what));
    while let Some(m) = stream.message().await.map_err(rpc_error)? {
        let (done, total, finished) = progress(&m);
        if let Some(bar) = &mut bar {
            bar.update(done, total);
        }
        if finished {
            last = Some(m);
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    last.ok_or_else(|| anyhow::anyhow!("the daemon ended the {what} without a result"))
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

/// Progress of a long operation on stderr: an indicatif bar on a terminal, left at its final
/// state when done; elsewhere (logs, CI), where indicatif draws nothing, a line at every 25%.
#[derive(Debug)]
pub struct Progress {
    what: &'static str,
    bar: Option<indicatif::ProgressBar>,
    quarter: Option<u64>,
}

impl Progress {
    pub fn new(what: &'static str) -> Self {
        let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
            let style = indicatif::ProgressStyle::with_template(
                "{prefix}: [{bar:25}] {percent:>3}% {binary_bytes} of {binary_total_bytes} ({binary_bytes_per_sec}, {eta} left)",
            )
            .expect("a valid template")
            .progress_chars("#>-");
            indicatif::ProgressBar::new(0).with_style(style).with_prefix(what)
        });
        Self { what, bar, quarter: None }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(total);
                bar.set_position(done);
            }
            None => {
                let pct = (done * 100).checked_div(total).unwrap_or(100);
                if self.quarter.replace(pct / 25) != Some(pct / 25) {
                    eprintln!("{}: {pct}% ({} of {})", self.what, format_size(done), format_size(total));
                }
            }
        }
    }

    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish();
            eprintln!(); // indicatif leaves the cursor on the bar's line
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

pub fn print_groups(out: Output, groups: &[pb::Group]) {
    match out {
        Output::Json => println!(
            "{}",
            serde_json::Value::Array(
                groups
                    .iter()
                    .map(|g| json!({"name": g.name, "id": g.id, "volumes": g.volumes, "created_unix": g.created_unix}))
                    .collect()
            )
        ),
        Output::Table => {
            let rows = groups.iter().map(|g| vec![g.name.clone(), g.volumes.join(",")]).collect();
            println!("{}", table(&["GROUP", "VOLUMES"], rows));
        }
    }
}

pub fn print_group_snapshots(out: Output, snaps: &[pb::GroupSnapshot]) {
    match out {
        Output::Json => println!(
            "{}",
            serde_json::Value::Array(
                snaps
                    .iter()
                    .map(|g| json!({"name": g.name, "id": g.id, "group": g.group, "created_unix": g.created_unix,
                                    "members": g.members.iter().map(|m| json!({"snapshot": m.snapshot, "volume": m.volume}))
                                        .collect::<Vec<_>>()}))
                    .collect()
            )
        ),
        Output::Table => {
            let rows = snaps
                .iter()
                .map(|g| {
                    let members: Vec<String> = g.members.iter().map(|m| m.snapshot.clone()).collect();
                    vec![g.name.clone(), if g.group.is_empty() { "(deleted)".into() } else { g.group.clone() }, members.join(",")]
                })
                .collect();
            println!("{}", table(&["GROUP SNAPSHOT", "GROUP", "MEMBER SNAPSHOTS"], rows));
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

    #[test]
    fn times_are_utc_and_zero_padded() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00");
        assert_eq!(format_time(1_795_000_000), "2026-11-18 11:06:40");
        assert_eq!(format_time(u64::MAX), u64::MAX.to_string(), "out of range: the raw number");
    }
}
