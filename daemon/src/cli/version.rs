//! `ferrite version`: this CLI's version and the daemon's.

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, rpc_error};

pub async fn run(c: &mut Admin, out: Output) -> Result<()> {
    let r = c.version(pb::VersionRequest {}).await.map_err(rpc_error)?;
    print_version(out, r.get_ref());
    Ok(())
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
