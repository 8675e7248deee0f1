//! `ferrite fence ...` and `ferrite clients`: who is refused on the TCP listeners, and who is
//! connected.

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;
use serde_json::json;

use crate::cli::Admin;
use crate::out::{Output, rpc_error, table};

#[derive(clap::Subcommand)]
pub enum FenceCmd {
    /// Fence CIDR blocks (`10.0.0.0/8`, `192.0.2.7`): their clients are refused and cut off.
    Add { cidrs: Vec<String> },
    /// Lift fences.
    Remove { cidrs: Vec<String> },
    /// List fenced blocks.
    List,
}

pub async fn run(c: &mut Admin, out: Output, cmd: FenceCmd) -> Result<()> {
    let r = match cmd {
        FenceCmd::Add { cidrs } => c.fence_networks(pb::FenceRequest { cidrs, owner: String::new() }).await,
        FenceCmd::Remove { cidrs } => c.unfence_networks(pb::FenceRequest { cidrs, owner: String::new() }).await,
        FenceCmd::List => c.list_fences(pb::ListFencesRequest {}).await,
    };
    print_fences(out, r.map_err(rpc_error)?.get_ref());
    Ok(())
}

/// `ferrite clients`.
pub async fn clients(c: &mut Admin, out: Output) -> Result<()> {
    let r = c.list_clients(pb::ListClientsRequest {}).await.map_err(rpc_error)?;
    print_clients(out, &r.get_ref().clients);
    Ok(())
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
