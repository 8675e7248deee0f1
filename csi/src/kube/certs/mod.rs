//! Node certificates issued by the cluster, through the Kubernetes CertificateSigningRequest
//! API: no certificate is copied onto a node by hand.
//!
//! ```text
//!  daemon pod (ServiceAccount ferrite-daemon, token bound to the pod)
//!    init container `ferrite node-cert`: key (kept on the node) ─► CSR: CN = node,
//!        SANs = node name, the Node's addresses, the node Service (on a node without storage
//!        `client.<Service>`) ─► CertificateSigningRequest
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

pub mod addresses;
pub mod cluster;
pub mod request;
pub mod signer;

use k8s_openapi::api::core::v1::Node;

use crate::shared::nodes::kubernetes::RESTRICTED_STORAGE;

/// The signer name of the certificates the controller issues to the nodes' daemons.
pub const SIGNER: &str = "ferrite.dev/node";

/// The key usages a node's request asks for (a certificate is a server's and a client's).
pub const USAGES: [&str; 4] = ["digital signature", "key encipherment", "server auth", "client auth"];

/// The names a node's certificate carries: the node's name (who it is to the NBD exports
/// published to it), its addresses that are IP addresses (who it is to its replication peers),
/// and on a `storage` node the node Service (what the controller checks, and what binds the
/// replication-peer role in `[roles]`), elsewhere [`client_name`] (which binds only the NBD
/// client's role: a node without storage is no replication peer).
/// A kubelet writes its Node's addresses as it likes: one that is no IP address is left out,
/// so that no string there becomes a DNS name of the certificate.
pub fn node_names(node: &Node, service: &str, storage: bool) -> Vec<String> {
    let mut names = vec![node.metadata.name.clone().unwrap_or_default()];
    for ip in ip_addresses(node) {
        if !names.contains(&ip) {
            names.push(ip);
        }
    }
    names.push(if storage { service.to_owned() } else { client_name(service) });
    names
}

/// The name a node without storage carries instead of the node Service's: a subdomain of it, so
/// no Node can be named so ([`refused_node_name`] refuses a `svc` label).
pub fn client_name(service: &str) -> String {
    format!("client.{service}")
}

/// Whether `node`'s certificate names the node Service, which binds the replication-peer role:
/// once any Node is labelled [`RESTRICTED_STORAGE`] (`restricted`; a kubelet cannot write it),
/// only a Node labelled so `"true"`; until then every node (one without storage keeps the
/// Service's name until the cluster opts in, so that daemons configured before
/// [`client_name`] existed still let it open the exports published to it).
pub fn names_service(node: &Node, restricted: bool) -> bool {
    let label = node.metadata.labels.as_ref().and_then(|l| l.get(RESTRICTED_STORAGE));
    !restricted || label.is_some_and(|v| v == "true")
}

/// A Node's InternalIP and ExternalIP addresses that parse as IP addresses, written the one way.
pub fn ip_addresses(node: &Node) -> impl Iterator<Item = String> + '_ {
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    addresses
        .into_iter()
        .flatten()
        .filter(|a| matches!(a.type_.as_str(), "InternalIP" | "ExternalIP"))
        .filter_map(|a| a.address.parse::<std::net::IpAddr>().ok())
        .map(|ip| ip.to_string())
}

/// Why `name` may not be the node name a certificate carries: it is, or could be read as, an
/// identity a role is bound to (the controller's, any URI, an address: a replication peer's
/// identity) or the name of a Service (`*.svc`, `*.svc.<cluster domain>`), as a Node registered
/// by a compromised node could be named. None: a node's name.
pub fn refused_node_name(name: &str, service: &str) -> Option<String> {
    let why = if name.is_empty() {
        "is empty"
    } else if name.parse::<std::net::IpAddr>().is_ok() {
        "is an IP address (a replication peer's identity)"
    } else if name.contains([':', '/']) {
        "could be read as a URI identity"
    } else if ferrite_tls::same_name(name, cluster::LEGACY_IDENTITY) || ferrite_tls::same_name(name, service) {
        "is a role's identity"
    } else if name.split('.').any(|l| l.eq_ignore_ascii_case("svc")) {
        "could be read as a Service's name"
    } else {
        return None;
    };
    Some(format!("the node name {name:?} {why}: no certificate names it"))
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
    fn names_a_node_may_not_carry() {
        let svc = "ferrite-node.ferrite.svc";
        for ok in ["node-a", "ip-10-0-0-5.ec2.internal", "worker-7.lab", "svc-node", "node.svcs"] {
            assert_eq!(refused_node_name(ok, svc), None, "{ok}");
        }
        for bad in [
            "",
            "10.0.0.6",
            "fd00::6",
            "ferrite-controller",
            "FERRITE-CONTROLLER",
            "ferrite-node.ferrite.svc",
            "ferrite-controller.ferrite.svc",
            "kubernetes.default.svc.cluster.local",
            "spiffe://ferrite.dev/controller",
        ] {
            assert!(refused_node_name(bad, svc).is_some(), "{bad:?}");
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
                // What a kubelet may write there: never a name of the certificate.
                ("InternalIP", "ferrite-controller"),
                ("ExternalIP", "spiffe://ferrite.dev/controller"),
                ("InternalIP", "FD00:0::5"),
            ],
        );
        assert_eq!(
            node_names(&n, "ferrite-node.ferrite.svc", true),
            ["node-a", "10.0.0.5", "fd00::5", "ferrite-node.ferrite.svc"]
        );
        assert_eq!(
            node_names(&n, "ferrite-node.ferrite.svc", false),
            ["node-a", "10.0.0.5", "fd00::5", "client.ferrite-node.ferrite.svc"]
        );
    }

    #[test]
    fn a_node_names_the_service_where_it_holds_storage() {
        let mut n = node("node-a", &[]);
        assert!(names_service(&n, false), "every node, until the cluster labels its storage nodes");
        assert!(!names_service(&n, true), "then only those");
        n.metadata.labels = Some([(RESTRICTED_STORAGE.to_owned(), "true".to_owned())].into());
        assert!(names_service(&n, true));
        // No Node may be named as a node without storage is known.
        assert!(refused_node_name(&client_name("ferrite-node.ferrite.svc"), "ferrite-node.ferrite.svc").is_some());
    }
}
