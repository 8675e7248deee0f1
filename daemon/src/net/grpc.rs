//! The admin API's gRPC server settings, one for every listener it serves on.

/// The admin API's gRPC server, with per-connection limits: streams in flight, and keepalive
/// pings that drop a peer that stopped answering.
pub fn admin_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(64))
        .concurrency_limit_per_connection(64)
        // A peer whose link died is noticed within 15 s: an incoming replication stream then
        // records its resume point and lets the next push in.
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(5)))
}
