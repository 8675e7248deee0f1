//! The CSI-Addons services, on their own endpoint: its [`identity`] (what the mode serves),
//! [`reclaim`] (ReclaimSpace on the controller and the node), [`fence`] (NetworkFence),
//! [`volume_group`] (VolumeGroup), [`replication`] (Replication) and [`key_rotation`]
//! (EncryptionKeyRotation).

pub mod fence;
pub mod identity;
pub mod key_rotation;
pub mod reclaim;
pub mod replication;
pub mod volume_group;
