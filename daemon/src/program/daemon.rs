//! `ferrite daemon`: the block storage daemon in the foreground ([`ferrite_daemon::serve::daemon`]).

use std::path::PathBuf;

use anyhow::Result;
use ferrite_daemon::base::config::Config;
use ferrite_daemon::serve::daemon;

#[derive(clap::Args)]
pub struct Args {
    /// TOML configuration file (every key optional; see the config docs).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Data directory (overrides the config file).
    #[arg(long, env = "FERRITE_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
}

pub fn run(a: &Args) -> Result<()> {
    let cfg = Config::load(a.config.as_deref(), a.data_dir.clone())?;
    super::init_logging(&cfg.log_level);
    super::runtime().block_on(daemon::run(cfg))
}
