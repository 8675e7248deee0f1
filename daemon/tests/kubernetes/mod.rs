//! Kubernetes: the CSI driver and CSI-Addons through their sockets, the manifests and images,
//! failover decisions, and the tier (`tier.rs`: a real control plane, kubelets and the sidecars).

mod cluster_certs;
mod csi;
mod csi_addons;
mod csi_copies;
mod csi_encryption;
mod csi_metadata;
mod csi_node;
mod csi_replication;
mod deploy_render;
mod failover_sim;
mod images;
mod kubernetes_upgrade;
mod tier;
