//! `ferrite attach`, `detach`, `refresh`, `attachments`: volumes as block devices on this machine.

use anyhow::Result;
use ferrite_proto::ferrite::v1 as pb;

use crate::cli::Admin;
use crate::out::{Output, rpc_error, table};
use ferrite_daemon::base::size::format_size;

#[derive(clap::Args)]
pub struct AttachArgs {
    pub volume: String,
    /// auto, ublk or nbd.
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// ublk queues (default: the daemon's ublk-queues).
    #[arg(long, default_value_t = 0)]
    pub queues: u32,
    /// ublk queue depth (default: the daemon's ublk-depth).
    #[arg(long, default_value_t = 0)]
    pub depth: u32,
    /// Another daemon's NBD listener (host:port) serving the volume: attached with the kernel
    /// NBD client, relayed over TLS with this daemon's certificate. Needs --export.
    #[arg(long, requires = "export")]
    pub remote: Option<String>,
    /// The export the remote daemon granted to this node.
    #[arg(long, requires = "remote")]
    pub export: Option<String>,
    /// The NBD listener of another copy of the volume (host:port), where its primary may move
    /// in a failover: the device follows it there. Repeatable.
    #[arg(long = "copy", requires = "remote")]
    pub copies: Vec<String>,
}

pub async fn attach(c: &mut Admin, out: Output, a: AttachArgs) -> Result<()> {
    let AttachArgs { volume, transport, queues, depth, remote, export, copies } = a;
    let (remote, export) = (remote.unwrap_or_default(), export.unwrap_or_default());
    let req = pb::AttachVolumeRequest { volume, transport, queues, depth, remote, export, copies };
    let a = c.attach_volume(req).await.map_err(rpc_error)?;
    print_attachment(out, a.get_ref());
    Ok(())
}

pub async fn detach(c: &mut Admin, out: Output, device: String) -> Result<()> {
    c.detach_volume(pb::DetachVolumeRequest { device: device.clone() }).await.map_err(rpc_error)?;
    crate::out::print_done(out, "detached", &device);
    Ok(())
}

pub async fn refresh(c: &mut Admin, out: Output, device: String) -> Result<()> {
    let a = c.resize_attachment(pb::ResizeAttachmentRequest { device }).await.map_err(rpc_error)?;
    print_attachment(out, a.get_ref());
    Ok(())
}

pub async fn list(c: &mut Admin, out: Output) -> Result<()> {
    let r = c.list_attachments(pb::ListAttachmentsRequest {}).await.map_err(rpc_error)?;
    print_attachments(out, &r.get_ref().attachments);
    Ok(())
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
