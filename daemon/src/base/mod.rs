//! What every room shares, lowest first.

pub mod config;
pub mod error;
pub mod rpc;
pub mod size;
pub mod state;
