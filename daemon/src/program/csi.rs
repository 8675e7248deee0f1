//! `ferrite csi`: the CSI driver (`ferrite_csi`, whose start, arguments and options are
//! `ferrite_csi::start`), and on a node without storage the attachment-only server beside it
//! (`ferrite_daemon::serve::attach_only`), which the driver's crate cannot hold.

use anyhow::{Context, Result};
use ferrite_csi::start::{self, TlsFiles};
use ferrite_daemon::base::config;
use ferrite_daemon::serve::attach_only;

use crate::args::Globals;

pub use ferrite_csi::start::Args;

pub fn run(a: &Args, g: &Globals) -> Result<()> {
    super::init_logging("info");
    let rt = super::runtime();
    let tls = TlsFiles { ca: g.tls_ca.as_deref(), cert: g.tls_cert.as_deref(), key: g.tls_key.as_deref() };
    let cluster = start::cluster_certs(a, tls)?;
    if let Some(o) = &cluster {
        rt.block_on(ferrite_csi::kube::certs::cluster::make(o)).context("the cluster's certificates")?;
    }
    let opts = start::options(a, g.tls_files()?, tls, g.admin_socket())?;
    let attach_only = matches!(a.mode, ferrite_csi::Mode::Node).then(|| attach_only::Options {
        socket: g.admin_socket(),
        state_dir: a.attach_state_dir.clone(),
        tls: config::TlsFiles {
            cert: a.node_tls_dir.join("tls.crt"),
            key: a.node_tls_dir.join("tls.key"),
            client_ca: Some(a.node_tls_dir.join("ca.crt")),
            peer_name: a.admin_server_name.clone(),
        },
        hold: config::DEFAULT_DEVICE_HOLD,
        request_timeout: config::DEFAULT_NBD_DEVICE_TIMEOUT,
    });
    rt.block_on(async move {
        if let Some(o) = cluster {
            ferrite_csi::kube::certs::cluster::keep(o);
        }
        let serving = match attach_only {
            Some(o) if !start::holds_storage(a, &opts.node_id).await? => Some(attach_only::start(o).await?),
            _ => None,
        };
        let served = ferrite_csi::serve(opts, super::shutdown_signal()).await;
        if let Some(s) = serving {
            s.stop().await;
        }
        served
    })
}
