//! The assembly: what opens the pool and serves every service.

pub mod attach_only;
pub mod daemon;
