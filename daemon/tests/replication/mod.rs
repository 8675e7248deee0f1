//! Replication between daemons: async relations and synchronous replicas, their roles, trust
//! and encryption.

mod replica;
mod replica_hosts;
mod replica_roles;
mod replica_trust;
mod sync_encryption;
mod sync_replicas;
mod sync_trust;
