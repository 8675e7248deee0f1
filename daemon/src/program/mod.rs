//! The programs `ferrite` runs (the daemon, the CSI driver, the pool's preparation, certificates,
//! the heartbeat, the device watchdog), one file each, and what they share.

pub mod certs;
pub mod csi;
pub mod daemon;
pub mod heartbeat;
pub mod node_cert;
pub mod node_pool;
pub mod pool_format;
pub mod watchdog;

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// A multi-threaded tokio runtime.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime")
}

/// Logs to stderr, with colour only when it is a terminal (never escape codes in a log file).
pub fn init_logging(default: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERRITE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}
