//! The data path: attaching volumes as block devices, NBD clients and hostile ones, the pool on
//! disk, crashes and power cuts, encryption at rest, QoS.

mod attach;
mod changed_blocks;
mod crash;
mod encryption;
mod file_modes;
mod hostile;
mod interop;
mod pool_format;
mod power_cut;
mod qos;
