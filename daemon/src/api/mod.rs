//! The daemon's services. None imports another: what two share lives in a room below.

pub mod admin;
pub mod backups;
pub mod metrics;
