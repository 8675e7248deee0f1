//! The attachment calls as both of their servers answer them: the daemon's admin service
//! (`api/admin/devices.rs`) and, on a node without storage, the node plugin's attachment-only service
//! (`serve/attach_only.rs`). What another node's volume needs is checked and answered here once.

use ferrite_proto::ferrite::v1 as pb;

use super::{AttachRecord, Attachments};
use crate::base::error::{Error, require};
use crate::records::exports::ExportTable;

/// Attaches another node's volume (`remote`, `export`): the kernel NBD client, relayed over TLS.
pub async fn attach_remote(a: &Attachments, r: pb::AttachVolumeRequest) -> Result<pb::Attachment, Error> {
    require("export", &r.export)?;
    if !matches!(r.transport.as_str(), "" | "auto" | "nbd") {
        return Err(Error::invalid("another node's volume is attached with the kernel NBD client"));
    }
    let rec = a.attach_remote(&r.volume, &r.remote, &r.export, r.copies).await?;
    Ok(remote_message(&rec, format!("kernel NBD client, relayed over TLS to {}", r.remote)))
}

/// Detaches a device (by path or volume name); `exports` where this node serves volumes.
pub async fn detach(
    a: &Attachments,
    exports: Option<&ExportTable>,
    r: pb::DetachVolumeRequest,
) -> Result<pb::DetachVolumeResponse, Error> {
    require("device", &r.device)?;
    a.detach(exports, &r.device).await?;
    Ok(pb::DetachVolumeResponse {})
}

/// Gives another node's volume's device that volume's current size.
pub async fn resize(a: &Attachments, r: pb::ResizeAttachmentRequest) -> Result<pb::Attachment, Error> {
    require("device", &r.device)?;
    let rec = a.resize_remote(&r.device).await?;
    let detail = format!("the device has the size of {} on {}", rec.volume, rec.remote.as_deref().unwrap_or(""));
    Ok(remote_message(&rec, detail))
}

/// The message of an attachment of another node's volume: its size is its device's.
pub fn remote_message(r: &AttachRecord, detail: String) -> pb::Attachment {
    r.message(detail, ferrite_nbd::kernel::size(r.index).unwrap_or(0))
}
