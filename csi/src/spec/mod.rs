//! The CSI 1.12 services, as the specification names them: [`identity`], the [`controller`]'s
//! volumes with its [`snapshots`] and [`publish`] calls, the [`group`] controller's group
//! snapshots, the SnapshotMetadata service ([`metadata`]), and the [`node`] service.

pub mod controller;
pub mod group;
pub mod identity;
pub mod metadata;
pub mod node;
pub(crate) mod publish;
pub(crate) mod snapshots;
