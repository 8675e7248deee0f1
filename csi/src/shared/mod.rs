//! What every service and control loop of the driver shares: the node directory and the
//! daemons' clients ([`nodes`]), volume ids ([`ids`]), the checks of a call's arguments and of a
//! StorageClass's parameters ([`args`], [`class`], [`qos`]), the host's mount table and tools
//! ([`host`]), where a replicated volume's copies are ([`copies`]), the keys of encrypted
//! volumes ([`keys`]), snapshots that are backups ([`backups`]), and what a volume's PV says
//! ([`pvs`]).

pub(crate) mod args;
pub(crate) mod backups;
pub mod class;
pub mod copies;
pub(crate) mod host;
pub mod ids;
pub mod keys;
pub mod nodes;
pub(crate) mod pvs;
pub mod qos;
