//! Synchronous replicas (docs/design/replication.md): a volume's primary sends every
//! client request to each in-sync member over a persistent mutual-TLS stream and answers the client
//! when all of them hold it (`primary.rs`, `link.rs`, through the engine's `Mirror` hook), on
//! framed TLS connections (`wire.rs`); members apply what they receive (`serve.rs`). Every member
//! keeps the volume's membership with its generation (`records.rs`); a change is recorded on a
//! majority of the members before it counts, which is the rule that keeps a partition from having
//! two primaries. `control.rs` holds adding and removing members, promotion, status and the
//! start-up of primaries.

pub mod ack_sink;
mod applied;
mod catch_up;
pub mod control;
mod link;
mod outbound;
#[cfg(test)]
mod path_tests;
pub mod primary;
mod rebuild;
pub mod records;
pub mod serve;
pub mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrite_engine::Pool;
use ferrite_proto::ferrite::v1::mirror_client::MirrorClient;
use ferrite_proto::ferrite::v1::{self as pb, MembershipRequest, RecordReply};
use tonic::transport::Channel;

use crate::authz::Policy;
use crate::base::config::{Config, TlsFiles};
use crate::base::error::Error;
use crate::base::rpc::at_peer;
use crate::replica::records::Records;
use crate::replica::send::channel;
use crate::replica::{Limiter, PerKey};
pub use primary::Primary;
use records::{Membership, State};

/// Marks of `volume` (points its copies hold alike) are snapshots `<volume>.sync.<unix ms>`.
pub fn mark_prefix(volume: &str) -> String {
    format!("{volume}.sync.")
}

/// The largest mirrored request: an NBD request's payload (32 MiB) and framing.
pub const MAX_MESSAGE: usize = (32 << 20) + (64 << 10);

/// What synchronous replication shares, one per daemon.
#[derive(Debug)]
pub struct SyncHub {
    pub pool: Arc<Pool>,
    pub policy: Arc<Policy>,
    tls: Option<TlsFiles>,
    /// How members reach this daemon: its identity in memberships.
    pub me: String,
    pub records: Records<Membership>,
    primaries: Mutex<HashMap<String, Arc<Primary>>>,
    /// Volumes being rebuilt here (this daemon a member): what their streams wrote.
    catch_ups: Mutex<HashMap<String, Arc<catch_up::CatchUp>>>,
    /// Sends of rebuilds to each member, paced (`replication-bandwidth`).
    limiters: PerKey<Limiter>,
    bandwidth: u64,
    /// How often a primary that took writes takes a mark with its members.
    mark_interval: Duration,
    ops: PerKey<tokio::sync::Mutex<()>>,
    /// A member that does not answer a request within this is ejected.
    pub timeout: Duration,
    pub rt: tokio::runtime::Handle,
    overcommit: f64,
    /// Memberships one primary may make here (`peer-quota`), and the share of the pool their
    /// copies may add up to (`peer-space-percent`).
    quota: usize,
    space_percent: Option<u64>,
    /// Told the name of every volume this daemon stepped down as primary of (its
    /// publications end: see `daemon.rs`).
    stepped_down: Mutex<Option<tokio::sync::mpsc::UnboundedSender<String>>>,
}

impl SyncHub {
    pub fn new(pool: Arc<Pool>, policy: Arc<Policy>, cfg: &Config) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            pool,
            policy,
            tls: cfg.tls.clone(),
            me: cfg.replication_endpoint.clone(),
            records: Records::load(&cfg.data_dir, "sync-members")?,
            primaries: Mutex::default(),
            catch_ups: Mutex::default(),
            limiters: PerKey::default(),
            bandwidth: cfg.replication_bandwidth,
            mark_interval: cfg.sync_mark_interval,
            ops: PerKey::default(),
            timeout: cfg.sync_timeout,
            rt: tokio::runtime::Handle::current(),
            overcommit: cfg.overcommit_ratio.unwrap_or(1.0).max(1.0),
            quota: cfg.peer_quota,
            space_percent: cfg.peer_space_percent,
            stepped_down: Mutex::default(),
        }))
    }

    /// The volumes this daemon steps down as primary of, from now on.
    pub fn steps_down(&self) -> tokio::sync::mpsc::UnboundedReceiver<String> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        *self.stepped_down.lock().expect("not poisoned") = Some(tx);
        rx
    }

    /// The lock that orders membership operations on `volume` here.
    fn op_lock(&self, volume: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.ops.get(volume, Default::default)
    }

    /// The primaries here that refuse writes now (`refused`), or that take them.
    fn primaries_refusing(&self, refused: bool) -> Vec<Arc<Primary>> {
        let all = self.primaries.lock().expect("not poisoned");
        all.values().filter(|p| p.refused().is_some() == refused).cloned().collect()
    }

    pub fn primary(&self, volume: &str) -> Option<Arc<Primary>> {
        self.primaries.lock().expect("not poisoned").get(volume).cloned()
    }

    /// The identity a member at `endpoint` proves with its certificate (as for async peers:
    /// `peer-server-name` where set, else the endpoint's host).
    pub fn identity(&self, endpoint: &str) -> Option<String> {
        crate::replica::identity_of(self.tls.as_ref(), endpoint)
    }

    async fn client(&self, endpoint: &str) -> Result<MirrorClient<Channel>, Error> {
        Ok(MirrorClient::new(channel(self.tls.as_ref(), endpoint).await?))
    }

    /// The generation number after `rec`'s, and after any this daemon holds (a proposal of its
    /// own that did not win stays recorded here, and each number is taken once).
    pub fn next_generation(&self, rec: &Membership) -> Result<u64, String> {
        records::next_number(rec.generation.max(self.records.get(&rec.volume).map_or(0, |h| h.generation)))
    }

    /// The member at `endpoint`'s answer to Get for `volume` (its membership and marks), within
    /// the timeout.
    pub async fn get_at(&self, endpoint: &str, volume: &str) -> Result<pb::Membership, String> {
        let call = async {
            let mut c = self.client(endpoint).await?;
            let r = c.get(MembershipRequest { volume: volume.to_owned() }).await.map_err(at_peer(endpoint))?;
            Ok::<_, Error>(r.into_inner())
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r.map_err(|e| e.message().to_owned()),
            Err(_) => Err(format!("{endpoint} did not answer within {:?}", self.timeout)),
        }
    }

    /// What the member at `endpoint` holds for `volume`, within the timeout: evidence only (it
    /// is checked to be of `volume`, and never stored here).
    pub async fn held_at(&self, endpoint: &str, volume: &str) -> Result<Membership, String> {
        let p = self.get_at(endpoint, volume).await?;
        if p.generation == 0 {
            return Err(format!("{endpoint} holds no membership of {volume}"));
        }
        evidence(endpoint, volume, &p)
    }

    /// Records `next` on the members of `old` and `next` (here first): Ok once a majority of
    /// each stored it, which makes it the volume's membership. A member holding a newer
    /// generation under another primary means this daemon was failed over: the error says so,
    /// and nothing a member answers is stored here.
    pub async fn propose(self: &Arc<Self>, old: &Membership, next: &Membership) -> Result<(), String> {
        let mut stored: Vec<String> = Vec::new();
        let mut failures: Vec<String> = Vec::new();
        let here = self.records.get(&next.volume);
        if here.as_ref().is_some_and(|h| !next.outranks(h) && h != next) {
            failures.push(format!("this daemon already holds generation {}", here.map_or(0, |h| h.generation)));
        } else if let Err(e) = self.records.put(next.clone()) {
            failures.push(format!("storing it here: {}", e.message()));
        } else {
            stored.push(self.me.clone());
        }
        let mut others: Vec<&str> =
            old.members.iter().chain(&next.members).map(|m| m.endpoint.as_str()).filter(|e| *e != self.me).collect();
        others.sort_unstable();
        others.dedup();
        let mut calls = tokio::task::JoinSet::new();
        for e in others {
            let (hub, e, rec) = (Arc::clone(self), e.to_owned(), next.to_proto());
            calls.spawn(async move {
                let call = async {
                    let mut c = hub.client(&e).await?;
                    Ok::<RecordReply, Error>(c.record(rec).await.map_err(at_peer(&e))?.into_inner())
                };
                let r = tokio::time::timeout(hub.timeout, call).await;
                (e, r)
            });
        }
        let mut newer: Vec<(String, Membership)> = Vec::new();
        while let Some(Ok((e, r))) = calls.join_next().await {
            match r {
                Ok(Ok(RecordReply { stored: true, .. })) => stored.push(e),
                Ok(Ok(RecordReply { held, .. })) => {
                    let held = held.and_then(|h| evidence(&e, &next.volume, &h).ok());
                    let g = held.as_ref().map_or(0, |h| h.generation);
                    failures.push(format!("{e} holds generation {g}"));
                    // Another primary there, with a generation this one does not outrank or
                    // one that ejected this daemon: it was failed over.
                    let over = |h: &Membership| {
                        h.primary != self.me
                            && h.outranks(old)
                            && (h.outranks(next) || h.state_of(&self.me) != Some(State::InSync))
                    };
                    newer.extend(held.filter(over).map(|h| (e.clone(), h)));
                }
                Ok(Err(s)) => failures.push(s.message().to_owned()),
                Err(_) => failures.push(format!("{e} did not answer within {:?}", self.timeout)),
            }
        }
        let count = |m: &Membership| m.members.iter().filter(|x| stored.contains(&x.endpoint)).count();
        let (in_old, in_next) = (count(old), count(next));
        if in_old >= old.majority() && in_next >= next.majority() {
            return Ok(());
        }
        if let Some(why) = failed_over(old, &newer) {
            // Evidence, not a record: the new primary's own Record (when it rebuilds this
            // daemon) is what changes the membership here.
            return Err(why);
        }
        Err(format!(
            "generation {} was recorded on {in_next} of {} members (a majority is {}): {}",
            next.generation,
            next.members.len(),
            next.majority(),
            failures.join("; ")
        ))
    }
}

/// Whether this daemon was failed over as primary of `old`, from the newer memberships naming
/// another primary that members answered (endpoint, membership): only when a majority of
/// `old`'s members says so. One member's word (a lie, a joining peer's, or a stale promotion
/// that never won) never makes a primary step down for good; with fewer such answers it cannot
/// record anything anyway, and it refuses writes until it can.
fn failed_over(old: &Membership, newer: &[(String, Membership)]) -> Option<String> {
    let mut said: Vec<&str> = newer.iter().map(|(e, _)| e.as_str()).filter(|e| old.member(e).is_some()).collect();
    said.sort_unstable();
    said.dedup();
    let newest = newer.iter().map(|(_, h)| h).max_by(|a, b| a.rank().cmp(&b.rank()))?;
    (said.len() >= old.majority()).then(|| {
        format!("this daemon was failed over: generation {} names {} the primary", newest.generation, newest.primary)
    })
}

/// A membership a member at `endpoint` answered about `volume`, checked as evidence: well
/// formed and of the volume asked about.
fn evidence(endpoint: &str, volume: &str, p: &pb::Membership) -> Result<Membership, String> {
    let h = Membership::from_proto(p).map_err(|e| format!("{endpoint} answered a bad membership: {e}"))?;
    if h.volume != volume {
        return Err(format!("{endpoint} answered with a membership of {:?}, not of {volume:?}", h.volume));
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_members_answer_is_evidence_about_the_volume_asked_only() {
        let m = |volume: &str| pb::Membership {
            volume: volume.into(),
            generation: 100,
            primary: "tcp://m:1".into(),
            members: vec![pb::Member { endpoint: "tcp://m:1".into(), state: "in-sync".into(), ..Default::default() }],
            size: 1 << 20,
            ..Default::default()
        };
        assert_eq!(evidence("tcp://m:1", "v", &m("v")).unwrap().generation, 100);
        let e = evidence("tcp://m:1", "v", &m("plain3")).unwrap_err();
        assert!(e.contains("\"plain3\", not of \"v\""), "{e}");
        let mut bad = m("v");
        bad.generation = u64::MAX;
        assert!(evidence("tcp://m:1", "v", &bad).is_err());
    }

    #[test]
    fn only_a_majority_of_members_says_a_primary_was_failed_over() {
        let member =
            |e: &str, state: &str| pb::Member { endpoint: e.into(), state: state.into(), ..Default::default() };
        let old = Membership::from_proto(&pb::Membership {
            volume: "v".into(),
            generation: 3,
            primary: "tcp://p:1".into(),
            members: vec![
                member("tcp://p:1", "in-sync"),
                member("tcp://a:1", "in-sync"),
                member("tcp://b:1", "in-sync"),
            ],
            size: 1 << 20,
            ..Default::default()
        })
        .unwrap();
        let mut claim = old.clone();
        claim.generation = 100;
        claim.primary = "tcp://a:1".into();
        let said = |e: &str| (e.to_owned(), claim.clone());
        assert_eq!(failed_over(&old, &[]), None);
        assert_eq!(failed_over(&old, &[said("tcp://a:1")]), None, "one member's word");
        assert_eq!(failed_over(&old, &[said("tcp://a:1"), said("tcp://a:1")]), None, "twice");
        assert_eq!(failed_over(&old, &[said("tcp://a:1"), said("tcp://x:1")]), None, "a stranger");
        let why = failed_over(&old, &[said("tcp://a:1"), said("tcp://b:1")]).unwrap();
        assert!(why.contains("generation 100 names tcp://a:1"), "{why}");
    }
}
