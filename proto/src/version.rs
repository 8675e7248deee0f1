//! Which versions may run together. Every gRPC client of ours names its version in the
//! `user-agent` header (`ferrite/0.2.0 tonic/…`), and a daemon checks it on every call (the
//! authorization layer), so a connection that reconnects to an upgraded daemon is checked again.
//!
//! The skew rule, by `major.minor`:
//! - a **client of the admin API** (the CSI controller and node plugin, the CLI) runs the
//!   daemon's version or the next minor one: it is upgraded first, and a client older than its
//!   daemon, or two minors ahead, is refused;
//! - **daemons** (replication peers) may differ by one minor version either way, the state in
//!   the middle of a rolling upgrade;
//! - a different major version is never compatible; a caller that names no version (grpcurl, a
//!   script) is not checked.

/// This build's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// What our clients put first in their `user-agent` header.
pub fn user_agent() -> String {
    format!("ferrite/{VERSION}")
}

/// The version a `user-agent` header names, if it is one of ours.
pub fn from_user_agent(ua: &str) -> Option<&str> {
    ua.split_whitespace().find_map(|part| part.strip_prefix("ferrite/"))
}

fn major_minor(v: &str) -> Option<(u64, u64)> {
    let mut parts = v.split(['.', '-', '+']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Who is calling a daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// The admin API's clients.
    Client,
    /// Another daemon (the Replica and Mirror services).
    Peer,
}

/// Whether a caller of version `caller` may talk to a daemon of version `daemon`; the error
/// says which side to upgrade.
pub fn check(role: Caller, caller: &str, daemon: &str) -> Result<(), String> {
    let (Some((cmaj, cmin)), Some((dmaj, dmin))) = (major_minor(caller), major_minor(daemon)) else {
        return Err(format!("cannot compare versions {caller:?} and {daemon:?}"));
    };
    let who = match role {
        Caller::Client => "client",
        Caller::Peer => "peer daemon",
    };
    if cmaj != dmaj {
        return Err(format!(
            "{who} version {caller} and daemon version {daemon} are of different major versions, which never work \
             together"
        ));
    }
    match role {
        Caller::Client if cmin < dmin => Err(format!(
            "client version {caller} is older than daemon version {daemon}: upgrade the CSI driver and the CLI \
             before the daemons (clients may run the daemon's minor version or the next one)"
        )),
        Caller::Client if cmin > dmin + 1 => Err(format!(
            "client version {caller} is more than one minor version ahead of daemon version {daemon}: upgrade the \
             daemon first (clients may run the daemon's minor version or the next one)"
        )),
        Caller::Peer if cmin.abs_diff(dmin) > 1 => Err(format!(
            "peer daemon version {caller} and daemon version {daemon} are more than one minor version apart: \
             upgrade the older daemons one minor version at a time"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_skew_rule() {
        use Caller::{Client, Peer};
        // Clients: same or one minor ahead.
        assert!(check(Client, "0.2.0", "0.2.5").is_ok());
        assert!(check(Client, "0.3.1", "0.2.0").is_ok());
        let behind = check(Client, "0.1.9", "0.2.0").unwrap_err();
        assert!(behind.contains("older than daemon version 0.2.0") && behind.contains("0.1.9"), "{behind}");
        let ahead = check(Client, "0.4.0", "0.2.0").unwrap_err();
        assert!(ahead.contains("upgrade the daemon first"), "{ahead}");
        // Peers: one minor either way.
        assert!(check(Peer, "0.1.0", "0.2.0").is_ok() && check(Peer, "0.3.0", "0.2.0").is_ok());
        assert!(check(Peer, "0.4.0", "0.2.0").unwrap_err().contains("one minor version at a time"));
        // Majors never mix; garbage is refused with both strings named.
        assert!(check(Client, "1.2.0", "0.2.0").unwrap_err().contains("different major"));
        assert!(check(Peer, "x", "0.2.0").unwrap_err().contains("\"x\""));
        // Pre-releases compare by major.minor.
        assert!(check(Client, "0.3.0-rc.1", "0.2.0").is_ok());
    }

    #[test]
    fn the_user_agent_names_the_version() {
        let ua = format!("{} tonic/0.14.9", user_agent());
        assert_eq!(from_user_agent(&ua), Some(VERSION));
        assert_eq!(from_user_agent("grpc-go/1.70"), None);
    }
}
