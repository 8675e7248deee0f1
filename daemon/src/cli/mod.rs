//! The command-line client: one file per command group, each holding its arguments, its calls of
//! the admin API and its printing.

pub mod backup;
pub mod device;
pub mod export;
pub mod fence;
pub mod group;
pub mod pool;
pub mod replica;
pub mod snapshot;
pub mod version;
pub mod volume;

use std::sync::Arc;

use anyhow::{Context, Result};
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;
use tonic::transport::Channel;

use crate::out::Progress;

/// A client of a daemon's admin API.
pub type Admin = AdminClient<Channel>;

/// Connects to the daemon: a Unix socket path, or `tcp://host:port` (over TLS with `tls`).
pub async fn channel(endpoint: &str, tls: Option<Arc<ferrite_proto::ClientTls>>) -> Result<Channel> {
    ferrite_proto::connect(endpoint, tls)
        .await
        .with_context(|| format!("cannot reach the ferrite daemon at {endpoint} (is it running?)"))
}

/// Connects to the daemon's admin API.
pub async fn connect(endpoint: &str, tls: Option<Arc<ferrite_proto::ClientTls>>) -> Result<Admin> {
    Ok(AdminClient::new(channel(endpoint, tls).await?))
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
