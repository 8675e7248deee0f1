//! Node certificates issued by the cluster, through the Kubernetes CertificateSigningRequest
//! API: no certificate is copied onto a node by hand.
//!
//! ```text
//!  daemon pod (ServiceAccount ferrite-daemon, token bound to the pod)
//!    init container `ferrite node-cert`: key (kept on the node) ─► CSR: CN = node,
//!        SANs = node name, the Node's addresses, the node Service ─► CertificateSigningRequest
//!        signerName ferrite.dev/node ─► waits ─► tls.crt, ca.crt beside tls.key
//!    container `node-cert --renew`: the same once two thirds of the lifetime have passed
//!  controller (the CA key from the Secret ferrite-ca, read by nobody else)
//!    watches CSRs of ferrite.dev/node ─► approves only one whose requester is a daemon pod's
//!        token, whose pod runs on the node the CSR names, and whose names are that Node's
//!        own ─► signs (status.certificate: the leaf, then the CA); denies any other, saying why
//! ```
//!
//! The API server records who asked (`spec.username`, and a pod-bound token's pod and node in
//! `spec.extra`); a daemon can therefore get a certificate for its own node's names and no other
//! node's, whatever it writes in its request. The CA travels with the certificate: only a holder
//! of the `sign` right on the signer name may write `status.certificate` (the API server checks
//! it), so the chain is as trustworthy as the signer.

pub mod cluster;
pub mod request;
pub mod signer;

use k8s_openapi::api::core::v1::Node;

/// The signer name of the certificates the controller issues to the nodes' daemons.
pub const SIGNER: &str = "ferrite.dev/node";

/// The key usages a node's request asks for (a certificate is a server's and a client's).
pub const USAGES: [&str; 4] = ["digital signature", "key encipherment", "server auth", "client auth"];

/// The names a node's certificate carries: the node's name (who it is to the NBD exports
/// published to it), its addresses (who it is to its replication peers), the node Service (what
/// the controller checks, and what binds the node's role in `[roles]`).
pub fn node_names(node: &Node, service: &str) -> Vec<String> {
    let mut names = vec![node.metadata.name.clone().unwrap_or_default()];
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for a in addresses.into_iter().flatten() {
        if matches!(a.type_.as_str(), "InternalIP" | "ExternalIP") && !names.contains(&a.address) {
            names.push(a.address.clone());
        }
    }
    names.push(service.to_owned());
    names
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};

    use super::*;

    pub(super) fn node(name: &str, addresses: &[(&str, &str)]) -> Node {
        let addresses = addresses.iter().map(|(t, a)| NodeAddress { type_: (*t).into(), address: (*a).into() });
        Node {
            metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
            status: Some(NodeStatus { addresses: Some(addresses.collect()), ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn a_node_is_named_by_its_name_its_ip_addresses_and_the_service() {
        let n = node(
            "node-a",
            &[
                ("Hostname", "node-a.lab"),
                ("InternalIP", "10.0.0.5"),
                ("InternalIP", "fd00::5"),
                ("ExternalIP", "10.0.0.5"),
            ],
        );
        assert_eq!(
            node_names(&n, "ferrite-node.ferrite.svc"),
            ["node-a", "10.0.0.5", "fd00::5", "ferrite-node.ferrite.svc"]
        );
    }
}
