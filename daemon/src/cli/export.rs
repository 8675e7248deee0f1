//! `ferrite export ...`: NBD exports.

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, rpc_error, table};

#[derive(clap::Subcommand)]
pub enum ExportCmd {
    /// Export a volume (or `volume@snapshot`, read-only) over NBD.
    Nbd {
        volume: String,
        /// Export name (default: the volume name).
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        read_only: bool,
        /// Who may open it over TCP: a CIDR block (10.0.0.0/8), an address, or a client
        /// certificate identity (a DNS name in its subjectAltName). Repeatable; none: anyone
        /// the listener admits.
        #[arg(long)]
        allow: Vec<String>,
    },
    /// List exports.
    List,
    /// Stop an export.
    Stop { name: String },
}

pub async fn run(c: &mut Admin, out: Output, cmd: ExportCmd) -> Result<()> {
    match cmd {
        ExportCmd::Nbd { volume, name, read_only, allow } => {
            let req = pb::StartExportRequest { volume, name: name.unwrap_or_default(), read_only, allow };
            let e = c.start_export(req).await.map_err(rpc_error)?;
            print_export(out, e.get_ref());
        }
        ExportCmd::List => {
            let r = c.list_exports(pb::ListExportsRequest {}).await.map_err(rpc_error)?;
            print_exports(out, &r.get_ref().exports);
        }
        ExportCmd::Stop { name } => {
            c.stop_export(pb::StopExportRequest { name: name.clone() }).await.map_err(rpc_error)?;
            crate::out::print_done(out, "stopped export", &name);
        }
    }
    Ok(())
}

fn export_json(e: &pb::Export) -> serde_json::Value {
    json!({"name": e.name, "volume": e.volume, "read_only": e.read_only,
           "unix_socket": e.unix_socket, "tcp_address": e.tcp_address, "uris": e.uris, "allow": e.allow})
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
