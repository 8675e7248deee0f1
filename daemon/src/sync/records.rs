//! A synchronous volume's membership as every member keeps it (`sync-members.json`): the
//! generation, the primary, each member's state. A generation is the pair (number, primary):
//! only the primary proposes a membership naming it, and it takes each number once, so two
//! proposals never share a generation. A member stores a membership only with a higher
//! generation than the one it holds, so two proposals cannot both reach a majority.

use ferrite_proto::ferrite::v1 as pb;
use serde::{Deserialize, Serialize};

use crate::records::keys::MAX_WRAPPED_KEY;
use crate::replica::records::Keyed;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    /// Holds every acknowledged write; each write waits for it.
    InSync,
    /// Gets every new write while what changed since its mark is copied to it.
    Rebuilding,
    /// Left out of the writes (it failed or did not answer in time) until it is rebuilt.
    Ejected,
    /// Holds the membership only: a vote, no data.
    Witness,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::InSync => "in-sync",
            State::Rebuilding => "rebuilding",
            State::Ejected => "ejected",
            State::Witness => "witness",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [State::InSync, State::Rebuilding, State::Ejected, State::Witness].into_iter().find(|x| x.as_str() == s)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its admin endpoint, tcp://host:port (the primary is a member too).
    pub endpoint: String,
    pub state: State,
    #[serde(default)]
    pub reason: String,
    /// The newest mark it held alike with the primary when it was last in sync: where its
    /// rebuild starts.
    #[serde(default)]
    pub mark: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    pub volume: String,
    pub generation: u64,
    pub primary: String,
    pub members: Vec<Member>,
    pub size: u64,
    /// An encrypted volume's wrapped data key (empty: plaintext), as the primary holds it now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wrapped_key: Vec<u8>,
}

impl Keyed for Membership {
    fn key(&self) -> &str {
        &self.volume
    }
}

impl Membership {
    /// The generation as memberships are ordered: the number, then the proposer (the primary
    /// it names), so that two sides never hold different memberships under one generation.
    pub fn rank(&self) -> (u64, &str) {
        (self.generation, &self.primary)
    }

    /// Whether `self` is a later generation than `other`.
    pub fn outranks(&self, other: &Membership) -> bool {
        self.rank() > other.rank()
    }

    pub fn member(&self, endpoint: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.endpoint == endpoint)
    }

    pub fn member_mut(&mut self, endpoint: &str) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.endpoint == endpoint)
    }

    /// The state of `endpoint` here (None: not a member).
    pub fn state_of(&self, endpoint: &str) -> Option<State> {
        self.member(endpoint).map(|m| m.state)
    }

    /// How many stored copies make a majority of the members (every member votes, ejected ones
    /// and witnesses included).
    pub fn majority(&self) -> usize {
        self.members.len() / 2 + 1
    }

    /// The members other than the primary that get writes: in-sync and rebuilding ones.
    pub fn data_members(&self) -> impl Iterator<Item = &Member> {
        self.members
            .iter()
            .filter(|m| m.endpoint != self.primary && matches!(m.state, State::InSync | State::Rebuilding))
    }

    pub fn to_proto(&self) -> pb::Membership {
        pb::Membership {
            volume: self.volume.clone(),
            generation: self.generation,
            primary: self.primary.clone(),
            members: self
                .members
                .iter()
                .map(|m| pb::Member {
                    endpoint: m.endpoint.clone(),
                    state: m.state.as_str().into(),
                    reason: m.reason.clone(),
                    mark: m.mark.clone(),
                })
                .collect(),
            size: self.size,
            marks: Vec::new(),
            wrapped_key: self.wrapped_key.clone(),
        }
    }

    /// A membership a peer sent, checked field by field: bounded names, known states, each
    /// member once, the primary among them.
    pub fn from_proto(p: &pb::Membership) -> Result<Self, String> {
        if p.members.len() > MAX_MEMBERS {
            return Err(format!("{} members (at most {MAX_MEMBERS})", p.members.len()));
        }
        let mut members: Vec<Member> = Vec::with_capacity(p.members.len());
        for m in &p.members {
            check_endpoint(&m.endpoint)?;
            let state = State::parse(&m.state).ok_or_else(|| format!("unknown member state {:?}", m.state))?;
            if members.iter().any(|x| x.endpoint == m.endpoint) {
                return Err(format!("member {} is listed twice", m.endpoint));
            }
            if m.mark.len() > 255 {
                return Err(format!("mark {:?}... is too long", m.mark.chars().take(32).collect::<String>()));
            }
            let reason = m.reason.chars().take(200).collect();
            members.push(Member { endpoint: m.endpoint.clone(), state, reason, mark: m.mark.clone() });
        }
        if p.generation == 0 || p.generation > MAX_GENERATION {
            return Err(format!("generation {} is out of bounds (1 to {MAX_GENERATION})", p.generation));
        }
        if p.size > MAX_SIZE {
            return Err(format!("size {} is out of bounds (at most {MAX_SIZE})", p.size));
        }
        if p.wrapped_key.len() > MAX_WRAPPED_KEY {
            return Err(format!("a wrapped key of {} bytes (at most {MAX_WRAPPED_KEY})", p.wrapped_key.len()));
        }
        let rec = Self {
            volume: p.volume.clone(),
            generation: p.generation,
            primary: p.primary.clone(),
            members,
            size: p.size,
            wrapped_key: p.wrapped_key.clone(),
        };
        if rec.state_of(&rec.primary) != Some(State::InSync) {
            return Err(format!("the primary {:?} is not an in-sync member", rec.primary));
        }
        Ok(rec)
    }
}

/// Generations end here (refused above): a number no volume reaches at a change per
/// millisecond for thirty years, and far from wrapping.
pub const MAX_GENERATION: u64 = 1 << 40;

/// The largest volume size a membership may carry (1 PiB): bounded like every other size.
pub const MAX_SIZE: u64 = 1 << 50;

/// The generation number after `g`, refused past [`MAX_GENERATION`].
pub fn next_number(g: u64) -> Result<u64, String> {
    g.checked_add(1)
        .filter(|&n| n <= MAX_GENERATION)
        .ok_or_else(|| format!("generation {g} is the last one (at most {MAX_GENERATION})"))
}

/// At most this many members per volume (the primary, replicas and witnesses).
pub const MAX_MEMBERS: usize = 7;

/// A member's endpoint: tcp://host:port, bounded.
pub fn check_endpoint(e: &str) -> Result<(), String> {
    let ok = e.len() <= 255
        && e.strip_prefix("tcp://").is_some_and(|a| !a.is_empty() && a.chars().all(|c| c.is_ascii_graphic()));
    if ok { Ok(()) } else { Err(format!("member endpoint {e:?} is not tcp://host:port")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(states: &[(&str, State)]) -> Membership {
        Membership {
            volume: "v".into(),
            generation: 3,
            primary: states[0].0.into(),
            members: states
                .iter()
                .map(|(e, s)| Member { endpoint: (*e).into(), state: *s, reason: String::new(), mark: String::new() })
                .collect(),
            size: 1 << 20,
            wrapped_key: Vec::new(),
        }
    }

    #[test]
    fn majorities_count_every_member_and_peers_are_checked() {
        let three = rec(&[("tcp://a:1", State::InSync), ("tcp://b:1", State::Ejected), ("tcp://c:1", State::InSync)]);
        assert_eq!(three.majority(), 2);
        let two = rec(&[("tcp://a:1", State::InSync), ("tcp://b:1", State::InSync)]);
        assert_eq!(two.majority(), 2, "two copies alone have no majority once one is gone");
        let with_witness =
            rec(&[("tcp://a:1", State::InSync), ("tcp://b:1", State::InSync), ("tcp://w:1", State::Witness)]);
        assert_eq!(with_witness.majority(), 2);
        assert_eq!(with_witness.data_members().map(|m| m.endpoint.as_str()).collect::<Vec<_>>(), ["tcp://b:1"]);
        assert_eq!(Membership::from_proto(&three.to_proto()).unwrap(), three);
        let mut p = three.to_proto();
        p.members[1].state = "boss".into();
        assert!(Membership::from_proto(&p).unwrap_err().contains("unknown member state"));
        let mut p = three.to_proto();
        p.members[2].endpoint = "/run/x.sock".into();
        assert!(Membership::from_proto(&p).is_err(), "a socket path is no member");
        let mut p = three.to_proto();
        p.primary = "tcp://b:1".into();
        assert!(Membership::from_proto(&p).unwrap_err().contains("not an in-sync member"));
        let mut p = three.to_proto();
        p.members.push(p.members[0].clone());
        assert!(Membership::from_proto(&p).unwrap_err().contains("twice"));
        let mut p = three.to_proto();
        p.wrapped_key = vec![1; 513];
        assert!(Membership::from_proto(&p).unwrap_err().contains("wrapped key"));
        for g in [0, MAX_GENERATION + 1, u64::MAX] {
            let mut p = three.to_proto();
            p.generation = g;
            assert!(Membership::from_proto(&p).unwrap_err().contains("generation"), "{g}");
        }
        let mut p = three.to_proto();
        p.size = u64::MAX;
        assert!(Membership::from_proto(&p).unwrap_err().contains("size"));
        assert_eq!(next_number(MAX_GENERATION - 1), Ok(MAX_GENERATION));
        assert!(next_number(MAX_GENERATION).is_err() && next_number(u64::MAX).is_err());
    }

    #[test]
    fn generations_are_ordered_by_number_then_proposer() {
        let a = rec(&[("tcp://a:1", State::InSync), ("tcp://b:1", State::InSync)]);
        let b = Membership { primary: "tcp://b:1".into(), ..a.clone() };
        assert!(b.outranks(&a) && !a.outranks(&b), "one number, two proposers: never equal");
        let later = Membership { generation: 4, ..a.clone() };
        assert!(later.outranks(&b) && !a.outranks(&a));
    }
}
