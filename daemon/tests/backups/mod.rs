//! Backups: to S3 (SeaweedFS on loopback) and directories, at scale, against hostile stores, and
//! through the CSI driver.

mod backup;
mod backup_scale;
mod backup_targets;
mod csi_backups;
mod hostile_store;
