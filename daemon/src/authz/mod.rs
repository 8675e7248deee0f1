//! Who may do what. Every gRPC call the daemon serves passes [`layer::Authorize`], a tower layer
//! on each listener's server (so no handler can forget it): it finds the caller's roles and
//! refuses a call the role table (`rules.rs`) does not give one of them, with PermissionDenied
//! naming the identity and the call, counted in `ferrite_authz_denied_total`.
//!
//! - The admin socket (root-only, 0600) and a TCP listener the operator chose to serve without
//!   TLS (`insecure-admin-listen`) mean `operator`.
//! - Over mutual TLS, the caller is what its verified certificate names (DNS and IP
//!   subjectAltNames, its CN): the `[roles]` of the configuration bind roles to those names by
//!   exact match. A certificate that names no configured identity has no role, so it may call
//!   nothing: holding a certificate of the cluster CA is not enough.
//! - `replication-peer` reaches the Replica service only, and its handlers let it touch only
//!   relations whose configured peer it is ([`Caller::is_peer`]).

pub mod layer;
pub mod rules;

use ferrite_tls::same_name;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;

use anyhow::{Result, bail};
use serde::Deserialize;
use tonic::Status;

/// What an identity may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Everything.
    Operator,
    /// What the CSI driver calls.
    Controller,
    /// The Replica service, for relations whose peer the caller is.
    ReplicationPeer,
    /// No admin access at all (NBD exports' allow lists decide what it may read or write).
    NbdClient,
    /// The metrics endpoint only.
    Metrics,
}

impl Role {
    pub const ALL: [Role; 5] =
        [Role::Operator, Role::Controller, Role::ReplicationPeer, Role::NbdClient, Role::Metrics];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Operator => "operator",
            Role::Controller => "controller",
            Role::ReplicationPeer => "replication-peer",
            Role::NbdClient => "nbd-client",
            Role::Metrics => "metrics",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| {
            format!("unknown role {s:?} (roles: operator, controller, replication-peer, nbd-client, metrics)")
        })
    }
}

/// One role or several, as `[roles]` writes them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RoleList {
    One(String),
    Many(Vec<String>),
}

/// Identities and their roles, from the configuration's `[roles]` table.
pub fn parse_roles(table: BTreeMap<String, RoleList>) -> Result<Vec<(String, Vec<Role>)>> {
    let mut out = Vec::new();
    for (identity, list) in table {
        if identity.trim().is_empty() || identity.contains('*') {
            bail!(
                "[roles]: {identity:?} is not an identity (a certificate's DNS name, IP address or CN; no wildcards)"
            );
        }
        let names = match list {
            RoleList::One(r) => vec![r],
            RoleList::Many(v) => v,
        };
        if names.is_empty() {
            bail!("[roles]: {identity:?} has no role (to give it none, leave it out)");
        }
        let roles = names
            .iter()
            .map(|r| r.parse())
            .collect::<Result<Vec<Role>, _>>()
            .map_err(|e| anyhow::anyhow!("[roles]: {identity:?}: {e}"))?;
        out.push((identity, roles));
    }
    Ok(out)
}

/// Who is at the other end of a TCP connection: what tonic hands each request of it (in the
/// request's extensions), read once at the TLS handshake (`listen.rs`).
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: std::net::SocketAddr,
    /// The names its verified client certificate carries (empty without TLS).
    pub names: Vec<String>,
}

/// Who is calling: its name (for messages and the metric), its roles and, over TLS, the names
/// its certificate carries.
#[derive(Debug, Clone)]
pub struct Caller {
    /// "local" (the admin socket, or a TCP listener without TLS), a configured identity, or
    /// "unconfigured".
    pub label: String,
    /// What messages call it: the identity, or the certificate's names.
    pub name: String,
    pub roles: Vec<Role>,
    /// The names of its certificate; None for a local caller.
    pub names: Option<Vec<String>>,
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl Caller {
    /// A local caller: the admin socket.
    pub fn local() -> Self {
        Self { label: "local".into(), name: "the local admin socket".into(), roles: vec![Role::Operator], names: None }
    }

    pub fn is_operator(&self) -> bool {
        self.roles.contains(&Role::Operator)
    }

    /// Whether this caller holds `role`, or is an operator (who holds every role).
    pub fn acts_as(&self, role: Role) -> bool {
        self.is_operator() || self.roles.contains(&role)
    }

    /// Whether this caller's certificate names `identity`.
    pub fn is(&self, identity: &str) -> bool {
        self.names.as_ref().is_some_and(|n| n.iter().any(|x| same_name(x, identity)))
    }

    /// Whether this caller may act as the peer named `identity` of a relation: an operator, or
    /// a `replication-peer` whose certificate names it.
    pub fn is_peer(&self, identity: &str) -> bool {
        self.is_operator() || (self.roles.contains(&Role::ReplicationPeer) && self.is(identity))
    }
}

/// The configured identities, and the refusals counted since the daemon started.
#[derive(Debug, Default)]
pub struct Policy {
    identities: Vec<(String, Vec<Role>)>,
    /// (identity label, call) -> refusals.
    denied: Mutex<BTreeMap<(String, String), u64>>,
}

impl Policy {
    pub fn new(identities: Vec<(String, Vec<Role>)>) -> Self {
        Self { identities, denied: Mutex::default() }
    }

    /// The caller a verified certificate carrying `names` is.
    pub fn caller(&self, names: &[String]) -> Caller {
        let mut roles = Vec::new();
        let mut matched = Vec::new();
        for (identity, r) in &self.identities {
            if names.iter().any(|n| same_name(n, identity)) {
                matched.push(identity.as_str());
                roles.extend_from_slice(r);
            }
        }
        roles.sort();
        roles.dedup();
        let (label, name) = if matched.is_empty() {
            let shown = if names.is_empty() { "no name".to_owned() } else { names.join(", ") };
            ("unconfigured".to_owned(), format!("certificate [{shown}] (no role configured for it)"))
        } else {
            (matched.join(","), format!("identity {:?}", matched.join(", ")))
        };
        Caller { label, name, roles, names: Some(names.to_vec()) }
    }

    /// Whether `caller` may call `path` at all; a refusal is counted.
    pub fn check(&self, caller: &Caller, path: &str) -> Result<(), Status> {
        let ok =
            caller.is_operator() || rules::allowed(path).is_some_and(|r| r.iter().any(|x| caller.roles.contains(x)));
        if ok {
            return Ok(());
        }
        let roles: Vec<_> = caller.roles.iter().map(|r| r.as_str()).collect();
        let has = if roles.is_empty() { "no role".to_owned() } else { format!("role {}", roles.join(", ")) };
        Err(self.refuse(caller, path, &format!("{has} does not allow it")))
    }

    /// A refusal of `call` to `caller`, counted, saying why.
    pub fn refuse(&self, caller: &Caller, call: &str, why: &str) -> Status {
        let known = if rules::allowed(call).is_some() { call } else { "unknown" };
        *self.denied.lock().expect("not poisoned").entry((caller.label.clone(), known.to_owned())).or_default() += 1;
        let short = call.rsplit('/').next().unwrap_or(call);
        tracing::warn!(caller = %caller, call = %call, why, "call refused");
        Status::permission_denied(format!("{caller} may not call {short}: {why}"))
    }

    /// A refusal of `call` to `caller` for a quota, counted with the other refusals.
    pub fn exhausted(&self, caller: &Caller, call: &str, why: &str) -> Status {
        let short = call.rsplit('/').next().unwrap_or(call);
        let _ = self.refuse(caller, call, why);
        Status::resource_exhausted(format!("{caller} may not call {short}: {why}"))
    }

    /// Refusals so far, by identity label and call.
    pub fn denials(&self) -> Vec<((String, String), u64)> {
        self.denied.lock().expect("not poisoned").iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// The caller of a request the layer passed (an internal error if it is missing, which would
/// mean a server without the layer: refused rather than trusted).
pub fn caller_of<T>(req: &tonic::Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::internal("no caller identity on this call (a server without authorization)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        let t: BTreeMap<String, RoleList> = toml::from_str(
            "\"csi\" = \"controller\"\n\"node-b\" = [\"replication-peer\", \"nbd-client\"]\n\"10.0.0.2\" = \"replication-peer\"\n\"root\" = \"operator\"",
        )
        .unwrap();
        Policy::new(parse_roles(t).unwrap())
    }

    #[test]
    fn roles_come_from_the_names_a_certificate_carries() {
        let p = policy();
        let csi = p.caller(&["csi".into()]);
        assert_eq!(csi.roles, vec![Role::Controller]);
        assert!(p.check(&csi, "/ferrite.v1.Admin/CreateVolume").is_ok());
        let e = p.check(&csi, "/ferrite.v1.Admin/ScrubPool").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("\"csi\"") && e.message().contains("ScrubPool"), "{}", e.message());
        assert!(p.check(&csi, "/ferrite.v1.Replica/Push").is_err());
        // An IP SAN matches the configured address however it is written.
        let peer = p.caller(&["host-1".into(), "10.0.0.2".into()]);
        assert_eq!(peer.roles, vec![Role::ReplicationPeer]);
        assert!(peer.is_peer("10.0.0.2") && !peer.is_peer("10.0.0.3") && !peer.is_peer("node-b"));
        assert!(p.check(&peer, "/ferrite.v1.Replica/Push").is_ok());
        assert!(p.check(&peer, "/ferrite.v1.Admin/DeleteVolume").is_err());
        // Names are matched exactly: no prefix, no wildcard.
        let other = p.caller(&["csi.example".into(), "*.example".into()]);
        assert!(other.roles.is_empty());
        assert!(p.check(&other, "/ferrite.v1.Admin/ListVolumes").unwrap_err().message().contains("no role"));
        assert!(p.check(&p.caller(&["root".into()]), "/ferrite.v1.Admin/NoSuchCall").is_ok());
        assert!(p.check(&csi, "/ferrite.v1.Admin/NoSuchCall").is_err());
        assert!(Caller::local().is_peer("anything"));
        let d = p.denials();
        assert!(d.iter().any(|((who, call), n)| who == "csi" && call == "/ferrite.v1.Admin/ScrubPool" && *n == 1));
        assert!(d.iter().any(|((who, call), _)| who == "csi" && call == "unknown"));
        assert!(d.iter().any(|((who, _), _)| who == "unconfigured"));
    }

    #[test]
    fn bad_role_tables_are_refused() {
        for bad in ["\"x\" = \"admin\"", "\"x\" = []", "\"*.svc\" = \"controller\"", "\"\" = \"operator\""] {
            let t: BTreeMap<String, RoleList> = toml::from_str(bad).unwrap();
            assert!(parse_roles(t).is_err(), "{bad}");
        }
    }
}
