//! How clients reach the daemon: its TCP listeners, Unix sockets and gRPC server settings.

pub mod grpc;
pub mod listen;
pub mod unix;
