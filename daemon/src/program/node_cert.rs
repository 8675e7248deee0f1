//! `ferrite node-cert`: this node's certificate, issued by the cluster (and kept renewed).

use std::path::PathBuf;

use anyhow::Result;

use crate::out::format_time;

#[derive(clap::Args)]
pub struct Args {
    /// This node's name.
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    /// Where tls.key (made here once, 0600), tls.crt and ca.crt are.
    #[arg(long, default_value = "/etc/ferrite/tls")]
    pub dir: PathBuf,
    /// The node Service's DNS name, which every node's certificate carries.
    #[arg(long, default_value = "ferrite-node.ferrite.svc")]
    pub service: String,
    /// The lifetime to ask for, in days (renewed two thirds into it).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=365))]
    pub days: u64,
    /// Seconds to wait for the signer's answer.
    #[arg(long, default_value_t = 300)]
    pub wait: u64,
    /// Keep running: renew whenever due.
    #[arg(long)]
    pub renew: bool,
    /// With --renew: seconds between looks at the files (a missing or outdated certificate
    /// is replaced at the next look).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub check_every: u64,
}

pub fn run(a: &Args) -> Result<()> {
    super::init_logging("info");
    let Args { node, dir, service, days, wait, renew, check_every } = a;
    let secs = std::time::Duration::from_secs;
    let o = ferrite_csi::kube::certs::request::Options {
        node: node.clone(),
        dir: dir.clone(),
        service: service.clone(),
        lifetime: secs(days * 86_400),
        wait: secs(*wait),
        check_every: secs(*check_every),
    };
    super::runtime().block_on(async {
        if *renew {
            ferrite_csi::kube::certs::request::renew(&o, super::shutdown_signal()).await;
            return Ok(());
        }
        let h = ferrite_csi::kube::certs::request::ensure(&o).await?;
        let what = if h.issued { "issued" } else { "already held" };
        println!(
            "node {node}: certificate {what}, valid until {} (renewed from {})",
            format_time(h.not_after.unsigned_abs()),
            format_time(h.renew_at.unsigned_abs())
        );
        Ok(())
    })
}
