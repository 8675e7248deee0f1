//! Network fences: blocks of addresses whose NBD and replication clients are cut and refused.

use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::authz::{Caller, caller_of};
use crate::records::fence::{Change, Cidr, FenceError};

use super::AdminService;

pub(super) async fn fence_networks(
    admin: &AdminService,
    req: Request<pb::FenceRequest>,
) -> Result<Response<pb::FenceResponse>, Status> {
    admin.change_fences(&caller_of(&req)?, req.get_ref(), true).map(Response::new)
}

pub(super) async fn unfence_networks(
    admin: &AdminService,
    req: Request<pb::FenceRequest>,
) -> Result<Response<pb::FenceResponse>, Status> {
    admin.change_fences(&caller_of(&req)?, req.get_ref(), false).map(Response::new)
}

pub(super) async fn list_fences(
    admin: &AdminService,
    _: Request<pb::ListFencesRequest>,
) -> Result<Response<pb::FenceResponse>, Status> {
    Ok(Response::new(fence_response(&admin.fences.list(), 0)))
}

impl AdminService {
    /// Fences (`fence`) or lifts the blocks of `req` as `caller` (and the request's owner).
    fn change_fences(&self, caller: &Caller, req: &pb::FenceRequest, fence: bool) -> Result<pb::FenceResponse, Status> {
        let parsed =
            req.cidrs.iter().map(|c| c.parse()).collect::<Result<Vec<Cidr>, _>>().map_err(Status::invalid_argument)?;
        let maker = crate::records::fence::maker(caller.is_operator(), &req.owner).map_err(Status::invalid_argument)?;
        let change =
            if fence { Change::Fence(&parsed) } else { Change::Lift { cidrs: &parsed, all: caller.is_operator() } };
        let (list, cut) = self.fences.update(change, &maker).map_err(|e| match e {
            FenceError::NotYours { .. } => Status::permission_denied(e.to_string()),
            FenceError::Save(_) => Status::internal(e.to_string()),
        })?;
        tracing::info!(fenced = fence, cidrs = ?req.cidrs, maker, connections_cut = cut, "fence list changed");
        Ok(fence_response(&list, cut))
    }
}

/// The fence list as the API answers it.
fn fence_response(list: &crate::records::fence::FenceList, connections_cut: u64) -> pb::FenceResponse {
    pb::FenceResponse {
        cidrs: list.keys().map(ToString::to_string).collect(),
        connections_cut,
        fences: list
            .iter()
            .map(|(c, by)| pb::FencedBlock { cidr: c.to_string(), by: by.iter().cloned().collect() })
            .collect(),
    }
}
