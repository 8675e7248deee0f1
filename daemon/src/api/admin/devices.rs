//! Block devices on this node (ublk or kernel NBD: `records/attachments/`) and the
//! publications that say which node may write a volume.

use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::base::error::require;
use crate::records::attachments::{AttachRecord, calls, choose_transport};
use crate::records::exports::open_image;

use super::AdminService;

pub(super) async fn attach_volume(
    admin: &AdminService,
    req: Request<pb::AttachVolumeRequest>,
) -> Result<Response<pb::Attachment>, Status> {
    let r = req.into_inner();
    require("volume", &r.volume)?;
    if !r.remote.is_empty() {
        return Ok(Response::new(calls::attach_remote(&admin.attachments, r).await?));
    }
    crate::records::keys::refuse_if_locked(&admin.pool, &r.volume)?;
    let (transport, detail) = choose_transport(&r.transport)?;
    let mut opts = admin.cfg.ublk;
    if r.queues != 0 {
        opts.queues = u16::try_from(r.queues).unwrap_or(u16::MAX);
    }
    if r.depth != 0 {
        opts.depth = u16::try_from(r.depth).unwrap_or(u16::MAX);
    }
    opts.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
    let rec = admin.attachments.attach(&admin.pool, &admin.exports, &r.volume, transport, opts).await?;
    Ok(Response::new(admin.attachment_msg(&rec, detail)))
}

pub(super) async fn detach_volume(
    admin: &AdminService,
    req: Request<pb::DetachVolumeRequest>,
) -> Result<Response<pb::DetachVolumeResponse>, Status> {
    Ok(Response::new(calls::detach(&admin.attachments, Some(&admin.exports), req.into_inner()).await?))
}

pub(super) async fn resize_attachment(
    admin: &AdminService,
    req: Request<pb::ResizeAttachmentRequest>,
) -> Result<Response<pb::Attachment>, Status> {
    Ok(Response::new(calls::resize(&admin.attachments, req.into_inner()).await?))
}

pub(super) async fn list_attachments(
    admin: &AdminService,
    _: Request<pb::ListAttachmentsRequest>,
) -> Result<Response<pb::ListAttachmentsResponse>, Status> {
    let list = admin.attachments.list().await;
    let attachments = list.iter().map(|r| admin.attachment_msg(r, String::new())).collect();
    Ok(Response::new(pb::ListAttachmentsResponse { attachments }))
}

pub(super) async fn publish_volume(
    admin: &AdminService,
    req: Request<pb::PublishVolumeRequest>,
) -> Result<Response<pb::Publication>, Status> {
    let r = req.into_inner();
    let allow = crate::records::publications::allow_of(&r)?;
    // A volume that does not exist is NotFound, not an export that fails later.
    let name = r.volume.clone();
    admin.engine(move |p| p.volume_info(&name)).await?;
    let published = crate::records::publications::publish(&admin.exports, &r, allow, &admin.nbd_tcp()).await?;
    Ok(Response::new(published))
}

pub(super) async fn unpublish_volume(
    admin: &AdminService,
    req: Request<pb::UnpublishVolumeRequest>,
) -> Result<Response<pb::UnpublishVolumeResponse>, Status> {
    crate::records::publications::unpublish(&admin.exports, &req.into_inner().volume).await?;
    Ok(Response::new(pb::UnpublishVolumeResponse {}))
}

pub(super) async fn list_publications(
    admin: &AdminService,
    _: Request<pb::ListPublicationsRequest>,
) -> Result<Response<pb::ListPublicationsResponse>, Status> {
    let tcp = admin.nbd_tcp();
    let publications = crate::records::publications::list(&admin.exports, &tcp).await;
    Ok(Response::new(pb::ListPublicationsResponse { publications }))
}

impl AdminService {
    fn attachment_msg(&self, r: &AttachRecord, detail: String) -> pb::Attachment {
        if r.remote.is_some() {
            return calls::remote_message(r, detail);
        }
        r.message(detail, open_image(&self.pool, &r.volume).and_then(|v| v.size()).unwrap_or(0))
    }
}
