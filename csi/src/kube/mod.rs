//! What runs against the Kubernetes API rather than for a CSI call: the cluster's
//! certificates ([`certs`]), the Lease a pass holds ([`lease`]), the drain guard's admission
//! [`webhook`], the nodes' storage [`heartbeat`], and [`failover`] of replicated volumes off a
//! lost node.

pub mod certs;
pub mod failover;
pub mod heartbeat;
pub(crate) mod lease;
pub(crate) mod webhook;
