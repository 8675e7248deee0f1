//! NBD exports: start, stop, list, and the URIs a client connects with.

use ferrite_proto::ferrite::v1 as pb;
use tonic::{Request, Response, Status};

use crate::base::error::require;
use crate::records::exports::ExportRecord;

use super::AdminService;

pub(super) async fn start_export(
    admin: &AdminService,
    req: Request<pb::StartExportRequest>,
) -> Result<Response<pb::Export>, Status> {
    let r = req.into_inner();
    require("volume", &r.volume)?;
    let name = if r.name.is_empty() { r.volume.clone() } else { r.name.clone() };
    if name.len() > 4096 {
        return Err(Status::invalid_argument("export name longer than 4096 bytes"));
    }
    let read_only = r.read_only || r.volume.contains('@');
    let rec = ExportRecord { name, volume: r.volume, read_only, allow: r.allow };
    admin.exports.ensure(&rec).await?;
    Ok(Response::new(admin.export_msg(&rec)))
}

pub(super) async fn stop_export(
    admin: &AdminService,
    req: Request<pb::StopExportRequest>,
) -> Result<Response<pb::StopExportResponse>, Status> {
    let name = req.into_inner().name;
    require("name", &name)?;
    admin.exports.stop(&name).await?;
    Ok(Response::new(pb::StopExportResponse {}))
}

pub(super) async fn list_exports(
    admin: &AdminService,
    _: Request<pb::ListExportsRequest>,
) -> Result<Response<pb::ListExportsResponse>, Status> {
    let records = admin.exports.list().await;
    Ok(Response::new(pb::ListExportsResponse { exports: records.iter().map(|r| admin.export_msg(r)).collect() }))
}

impl AdminService {
    fn export_msg(&self, r: &ExportRecord) -> pb::Export {
        let sock = self.cfg.nbd_socket.display().to_string();
        let mut uris = vec![format!("nbd+unix:///{}?socket={sock}", r.name)];
        let tcp = self.nbd_tcp();
        if !tcp.is_empty() {
            let scheme = if self.cfg.nbd_tls == ferrite_nbd::tls::TlsMode::Require { "nbds" } else { "nbd" };
            uris.push(format!("{scheme}://{tcp}/{}", r.name));
        }
        pb::Export {
            name: r.name.clone(),
            volume: r.volume.clone(),
            read_only: r.read_only,
            unix_socket: sock,
            tcp_address: tcp,
            uris,
            allow: r.allow.clone(),
        }
    }
}
