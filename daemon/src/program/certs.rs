//! `ferrite certs`: a CA and certificates for a test or a small cluster.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

#[derive(clap::Args)]
pub struct Args {
    pub dir: PathBuf,
    pub name: String,
    pub sans: Vec<String>,
    /// A role for NAME (operator, controller, replication-peer, nbd-client, metrics); repeatable.
    #[arg(long = "role")]
    pub roles: Vec<String>,
    /// Validity in days (the CA, when made now: ten times as long).
    #[arg(long, default_value_t = 825, value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub days: u32,
}

pub fn run(a: &Args) -> Result<()> {
    make_certs(&a.dir, &a.name, &a.sans, &a.roles, a.days)
}

/// `ferrite certs`: the CA in `dir` (made if missing) and a certificate for `name`.
fn make_certs(dir: &Path, name: &str, sans: &[String], roles: &[String], days: u32) -> Result<()> {
    use ferrite_tls::certs;
    for r in roles {
        r.parse::<ferrite_daemon::authz::Role>().map_err(|e| anyhow::anyhow!("--role: {e}"))?;
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let write = |file: &str, text: &str, mode: u32| -> Result<PathBuf> {
        let p = dir.join(file);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&p)
            .with_context(|| format!("writing {} (it must not exist yet)", p.display()))?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        Ok(p)
    };
    let ca_key = dir.join("ca-key.pem");
    if !ca_key.exists() {
        let ca = certs::new_ca(days.saturating_mul(10)).context("making the CA")?;
        write("ca.pem", &ca.cert_pem, 0o644)?;
        write("ca-key.pem", &ca.key_pem, 0o600)?;
        println!("made CA {} (keep ca-key.pem secret)", dir.join("ca.pem").display());
    }
    let ca_key = std::fs::read_to_string(&ca_key).with_context(|| format!("reading {}", ca_key.display()))?;
    let mut all = vec![name.to_string()];
    all.extend(sans.iter().filter(|s| *s != name).cloned());
    let issued =
        certs::issue(&ca_key, name, &all, days).with_context(|| format!("issuing a certificate for {name}"))?;
    let cert = write(&format!("{name}.pem"), &issued.cert_pem, 0o644)?;
    let key = write(&format!("{name}-key.pem"), &issued.key_pem, 0o600)?;
    println!("made {} and {} for {}, valid {days} days", cert.display(), key.display(), all.join(", "));
    if !roles.is_empty() {
        let list: Vec<String> = roles.iter().map(|r| format!("{r:?}")).collect();
        println!("its roles, for the [roles] table of each daemon it calls:\n{name:?} = [{}]", list.join(", "));
    }
    Ok(())
}
