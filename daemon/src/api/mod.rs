//! The daemon's services, each a gRPC face that translates calls and errors: admin, backups,
//! metrics, and the two daemons speak to one another (mirror, replica). None imports another:
//! what two share lives in a room below.

pub mod admin;
pub mod backups;
pub mod metrics;
pub mod mirror;
pub mod replica;
