//! What the daemon keeps beside the pool: each record kind owns its state file (or background
//! job) and its rules, and none imports a service.

pub mod attachments;
pub mod backup_outcomes;
pub mod exports;
pub mod fence;
pub mod keys;
pub mod publications;
pub mod restores;
pub mod rotations;
