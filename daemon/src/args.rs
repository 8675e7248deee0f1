//! What every command takes: how to reach the daemon (its admin socket, or TCP with mutual TLS)
//! and how to print.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use ferrite_daemon::base::config;

use crate::out::Output;

/// A client certificate and its key.
pub type Identity<'a> = (&'a Path, &'a Path);

#[derive(clap::Args)]
pub struct Globals {
    /// The daemon's admin socket (default: <data dir>/admin.sock).
    #[arg(long, global = true, env = "FERRITE_ADMIN_SOCKET")]
    pub admin_socket: Option<PathBuf>,
    /// Reach the daemon's admin API over TCP instead (its `admin-listen`, HOST:PORT), with mutual
    /// TLS (--tls-ca, --tls-cert, --tls-key).
    #[arg(long, global = true, env = "FERRITE_ADMIN_TCP")]
    pub admin_tcp: Option<String>,
    /// CA certificate (PEM) the daemons' certificates are checked against (admin over TCP, and
    /// `ferrite csi` to tcp:// nodes).
    #[arg(long, global = true, env = "FERRITE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM) for mutual TLS.
    #[arg(long, global = true, env = "FERRITE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, global = true, env = "FERRITE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Output format of client commands.
    #[arg(long, short, global = true, value_enum, default_value = "table")]
    pub output: Output,
}

impl Globals {
    /// The daemon's admin socket: --admin-socket, else `<default data dir>/admin.sock`.
    pub fn admin_socket(&self) -> PathBuf {
        self.admin_socket.clone().unwrap_or_else(|| config::default_data_dir().join("admin.sock"))
    }

    /// The daemon's admin endpoint: `tcp://HOST:PORT` with --admin-tcp, else its socket.
    pub fn endpoint(&self) -> String {
        match &self.admin_tcp {
            Some(addr) => format!("tcp://{addr}"),
            None => self.admin_socket().display().to_string(),
        }
    }

    /// This client's certificate and key (--tls-cert, --tls-key), if given.
    pub fn identity(&self) -> Option<Identity<'_>> {
        self.tls_cert.as_deref().zip(self.tls_key.as_deref())
    }

    /// The CA and the identity the --tls-* options name: none without --tls-ca, and an error for
    /// a certificate without a CA to check the daemon's against.
    pub fn tls_files(&self) -> Result<Option<(&Path, Option<Identity<'_>>)>> {
        anyhow::ensure!(
            self.tls_ca.is_some() || self.tls_cert.is_none(),
            "--tls-cert needs --tls-ca (the CA the daemon's certificate is checked against)"
        );
        Ok(self.tls_ca.as_deref().map(|ca| (ca, self.identity())))
    }

    /// The TLS client config the --tls-* options describe.
    pub fn client_tls(&self) -> Result<Option<Arc<ferrite_proto::ClientTls>>> {
        let Some((ca, identity)) = self.tls_files()? else { return Ok(None) };
        Ok(Some(ferrite_proto::admin_tls(ca, identity)?))
    }
}
