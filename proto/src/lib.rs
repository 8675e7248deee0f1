//! Generated gRPC code for Ferrite's own protocols.

/// `ferrite.v1`: the daemon's admin API.
pub mod ferrite {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic, missing_debug_implementations)]
        tonic::include_proto!("ferrite.v1");
    }
}
