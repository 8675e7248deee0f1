//! What a peer may push, checked before a push touches anything: every field it sends, that it
//! is the configured peer of the relation the push is for, the relation's role and epoch, and
//! for a group push that the volume is one of the group's. A volume not replicated here takes
//! only a first sync from an endpoint the caller's certificate names, which creates it.

use ferrite_proto::ferrite::v1::PushBegin;

use super::Replication;
use super::records::{Relation, Role};
use crate::authz::Caller;
use crate::base::error::Error;

/// The call every check here answers for.
const PUSH: &str = "/ferrite.v1.Replica/Push";

/// Whether a name is fit to be a volume or snapshot name a peer gives (the engine checks its
/// own rules too; this keeps control characters and oversized names out of logs and records).
pub(crate) fn check_name(what: &str, name: &str) -> Result<(), Error> {
    if name.is_empty() || name.len() > 255 || name.chars().any(char::is_control) {
        return Err(Error::invalid(format!("{what} {name:?}: 1 to 255 printable characters")));
    }
    Ok(())
}

/// An epoch a peer sent, bounded: epochs count promotions, and one far past any real count is a
/// peer pinning the relation.
pub(super) fn check_epoch_bound(epoch: u64) -> Result<(), Error> {
    if epoch > super::MAX_EPOCH {
        return Err(Error::invalid(format!("epoch {epoch} is past {}", super::MAX_EPOCH)));
    }
    Ok(())
}

/// Refuses a `what` made under epoch `sent` of relation `key`, which is at `here` on this side:
/// a promotion happened since, and the sender must be demoted and resynced.
pub(super) fn check_not_stale(what: &str, key: &str, sent: u64, here: u64) -> Result<(), Error> {
    if sent < here {
        return Err(Error::refused(format!(
            "stale {what}: made under epoch {sent} of {key:?}, which is at epoch {here} here (a promotion \
             happened since); the sender must be demoted and resynced"
        )));
    }
    Ok(())
}

/// Checks every field of a begin message that does not depend on this daemon's records.
pub(super) fn check_begin(rep: &Replication, b: &PushBegin) -> Result<(), Error> {
    check_name("replica", &b.replica)?;
    check_name("snapshot", &b.snapshot)?;
    if !b.base.is_empty() {
        check_name("base", &b.base)?;
    }
    if !b.group.is_empty() {
        check_name("group", &b.group)?;
    }
    if b.prefix.len() > 255 || b.prefix.chars().any(char::is_control) {
        return Err(Error::invalid("the mirror-snapshot prefix is not a name"));
    }
    if b.interval_secs > super::MAX_INTERVAL_SECS {
        return Err(Error::invalid(format!(
            "interval {} s: at most a week ({} s), or 0 for on request only",
            b.interval_secs,
            super::MAX_INTERVAL_SECS
        )));
    }
    let most = super::largest_replica(&rep.pool, rep.overcommit);
    if b.size == 0 || b.size > most {
        return Err(Error::invalid(format!(
            "replica {:?} of {} bytes: a replica must be larger than 0 and at most {most} bytes here (the \
             pool's size times its overcommit cap)",
            b.replica, b.size
        )));
    }
    check_epoch_bound(b.epoch)?;
    if b.end > b.size {
        return Err(Error::invalid(format!("the delta ends at {} past the size {}", b.end, b.size)));
    }
    Ok(())
}

/// The relation `name` belongs to here: its own, or that of the replicated group it is a
/// member of.
pub(super) fn relation_of(rep: &Replication, name: &str) -> Option<Relation> {
    rep.relations
        .get(name)
        .or_else(|| rep.relations.all().into_iter().find(|r| r.group && r.members.iter().any(|m| m == name)))
}

/// Refuses `caller` unless it is the configured peer of `rel`.
pub(super) fn check_peer(rep: &Replication, caller: &Caller, call: &str, rel: &Relation) -> Result<(), Error> {
    let identity = rep.peer_identity(&rel.peer);
    if identity.as_deref().is_some_and(|i| caller.is_peer(i)) || caller.is_operator() {
        return Ok(());
    }
    let what = if rel.group { "replicated group" } else { "replicated volume" };
    Err(rep
        .policy
        .refuse(
            caller,
            call,
            &format!(
                "{what} {:?} here has peer {} (identity {:?})",
                rel.volume,
                rel.peer,
                identity.unwrap_or_default()
            ),
        )
        .into())
}

/// Whether this daemon takes the push `b` from `caller` (the caller holds the relation's op
/// lock): the caller is the relation's peer, the relation is a secondary at an epoch no
/// higher than the push's, and a group push names a member of the group (or creates one).
/// A volume that is not replicated here takes only a first sync, which creates it: then the
/// relation it gets.
pub(super) fn admit(rep: &Replication, caller: &Caller, b: &PushBegin) -> Result<Option<Relation>, Error> {
    let grouped = !b.group.is_empty();
    let key = if grouped { &b.group } else { &b.replica };
    let Some(mut r) = rep.relations.get(key) else {
        return new_relation(rep, caller, b).map(Some);
    };
    check_peer(rep, caller, PUSH, &r)?;
    if r.group != grouped {
        let (is, not) = if r.group { ("a group", "a volume") } else { ("a volume", "a group") };
        return Err(Error::refused(format!("{key:?} replicates as {is} here, and the push is for {not}")));
    }
    if r.role == Role::Primary {
        return Err(Error::refused(format!(
            "{key:?} is a primary on this daemon: both sides are primary (split-brain); demote one and resync it"
        )));
    }
    check_not_stale("push", key, b.epoch, r.epoch)?;
    if grouped && !r.members.contains(&b.replica) {
        let new_member = b.base.is_empty() && !b.resume && rep.pool.volume_info(&b.replica).is_err();
        if !new_member {
            return Err(rep
                .policy
                .refuse(
                    caller,
                    PUSH,
                    &format!("volume {:?} is not a member of replicated group {key:?} here", b.replica),
                )
                .into());
        }
    }
    // A promoted replica schedules as its primary did, and carries its epoch on.
    if r.interval_secs != b.interval_secs || r.epoch != b.epoch {
        (r.interval_secs, r.epoch) = (b.interval_secs, b.epoch);
        rep.relations.put(r)?;
    }
    Ok(None)
}

/// The relation a first push makes: from an endpoint of the caller's own.
pub(super) fn new_relation(rep: &Replication, caller: &Caller, b: &PushBegin) -> Result<Relation, Error> {
    if !b.base.is_empty() {
        return Err(Error::refused(format!(
            "volume {:?} is not a replica on this daemon: a push over a base needs one",
            b.replica
        )));
    }
    if b.prefix.is_empty() {
        return Err(Error::invalid("a first push names the prefix of its relation's mirror snapshots"));
    }
    // Whoever pushes first becomes the relation's peer: the endpoint this daemon will call
    // back (resync, promote) must be one the caller's certificate proves it is.
    if !caller.is_operator() {
        let Some(identity) = rep.peer_identity(&b.origin) else {
            return Err(rep
                .policy
                .refuse(caller, PUSH, &format!("origin {:?} is not a tcp:// endpoint", b.origin))
                .into());
        };
        if !caller.is_peer(&identity) {
            return Err(rep
                .policy
                .refuse(
                    caller,
                    PUSH,
                    &format!(
                        "origin {} is identity {identity:?}, which the caller's certificate does not name",
                        b.origin
                    ),
                )
                .into());
        }
    }
    let made: Vec<Relation> = rep.relations.all().into_iter().filter(|r| r.peer == b.origin).collect();
    if made.len() >= rep.quota && !caller.is_operator() {
        let why = format!("{} is the peer of {} relations here (peer-quota {})", b.origin, made.len(), rep.quota);
        return Err(rep.policy.exhausted(caller, PUSH, &why).into());
    }
    // Nor more than its share of the pool.
    let size = |v: &String| rep.pool.volume_info(v).map_or(0, |i| i.size);
    let held: u64 = made
        .iter()
        .flat_map(|r| if r.group { r.members.iter() } else { std::slice::from_ref(&r.volume).iter() })
        .map(size)
        .sum();
    if !caller.is_operator()
        && let Err(why) = super::check_peer_space(&rep.pool, rep.overcommit, rep.space_percent, held, b.size)
    {
        return Err(rep.policy.exhausted(caller, PUSH, &format!("{}: {why}", b.origin)).into());
    }
    // A first sync creates its volume; it never takes over one that exists.
    if rep.pool.volume_info(&b.replica).is_ok() || rep.pending.get(&b.replica).is_some() {
        return Err(Error::already_exists(format!(
            "volume {:?} already exists here and is no replica of yours: a first sync creates its replica volume",
            b.replica
        )));
    }
    // Nor, for a group, a local group or volume of the group's name.
    let group = &b.group;
    if !group.is_empty() && (rep.pool.groups().iter().any(|g| g.name == *group) || rep.pool.volume_info(group).is_ok())
    {
        return Err(Error::already_exists(format!(
            "{group:?} already exists here as a local group or volume and is no replica of yours: a first group sync creates its replica group"
        )));
    }
    let key = if b.group.is_empty() { &b.replica } else { &b.group };
    Ok(Relation {
        volume: key.clone(),
        role: Role::Secondary,
        peer: b.origin.clone(),
        remote: b.origin_volume.clone(),
        prefix: b.prefix.clone(),
        interval_secs: b.interval_secs,
        handover: false,
        synced: String::new(),
        group: !b.group.is_empty(),
        members: Vec::new(),
        snapshots: Vec::new(),
        epoch: b.epoch,
    })
}
