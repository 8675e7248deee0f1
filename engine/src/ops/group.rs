//! Volume groups and crash-consistent group snapshots.
//!
//! A group names a set of volumes (a volume is in at most one group). A group snapshot is one
//! log barrier that freezes every member's head at the same point of the log, with one store
//! sync and one catalog write, so the member snapshots (named `<group snapshot>.<volume>`)
//! together are what a crash at that instant would have left. Deleting a group snapshot deletes
//! its member snapshots; cloning one creates a new group of clones in one catalog write.

use crate::error::{Error, ErrorKind, Result};
use crate::meta::{CatalogOp, GroupRecord};
use crate::ops::snapshot::{apply_snapshots, plan_snapshots, remove_snapshot};
use crate::ops::volumes::{check_overcommit, lookup, new_record, validate_name};
use crate::pool::{Pool, now_unix};
use crate::state::{State, VolumeEntry};

/// A volume group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    pub id: u64,
    pub name: String,
    pub volumes: Vec<String>,
    pub created_unix: u64,
}

/// A group snapshot: one snapshot per member, all at one point of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSnapshotInfo {
    pub id: u64,
    pub name: String,
    /// The group it was taken of, if it still exists.
    pub group: Option<String>,
    /// Member snapshots, as `(snapshot name, volume name at the time)`.
    pub snapshots: Vec<(String, String)>,
    pub created_unix: u64,
}

fn group_by_name(st: &State, name: &str) -> Result<u64> {
    st.groups
        .values()
        .find(|g| g.name == name)
        .map(|g| g.id)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("group {name:?} not found")))
}

fn group_snapshot_by_name(st: &State, name: &str) -> Result<u64> {
    st.group_snapshots
        .values()
        .find(|g| g.name == name)
        .map(|g| g.id)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("group snapshot {name:?} not found")))
}

fn group_info(st: &State, g: &GroupRecord) -> GroupInfo {
    let mut volumes: Vec<String> =
        g.members.iter().filter_map(|m| st.volumes.get(m)).map(|v| v.rec.name.clone()).collect();
    volumes.sort();
    GroupInfo { id: g.id, name: g.name.clone(), volumes, created_unix: g.created_unix }
}

fn group_snapshot_info(st: &State, g: &GroupRecord) -> GroupSnapshotInfo {
    let prefix = format!("{}.", g.name);
    let snapshots = g
        .members
        .iter()
        .filter_map(|s| st.snapshots.get(s))
        .map(|s| (s.name.clone(), s.name.strip_prefix(&prefix).unwrap_or(&s.name).to_owned()))
        .collect();
    GroupSnapshotInfo {
        id: g.id,
        name: g.name.clone(),
        group: st.groups.get(&g.group).map(|x| x.name.clone()),
        snapshots,
        created_unix: g.created_unix,
    }
}

/// Member volume ids for `names`, each existing and in no group other than `except`.
fn members(st: &State, names: &[String], except: Option<u64>) -> Result<Vec<u64>> {
    let mut ids = Vec::with_capacity(names.len());
    for n in names {
        let id = lookup(st, n)?;
        if let Some(g) = st.groups.values().find(|g| Some(g.id) != except && g.members.contains(&id)) {
            return Err(Error::new(ErrorKind::AlreadyExists, format!("volume {n:?} is already in group {:?}", g.name)));
        }
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

impl Pool {
    /// Creates a group of existing volumes (none may be in another group). Durable on return.
    pub fn create_group(&self, name: &str, volumes: &[&str]) -> Result<GroupInfo> {
        validate_name(name)?;
        let inner = &self.inner;
        inner.check_open()?;
        let _m = inner.meta_lock.lock();
        let names: Vec<String> = volumes.iter().map(|v| (*v).to_owned()).collect();
        let ids = {
            let st = inner.state.read();
            if group_by_name(&st, name).is_ok() {
                return Err(Error::new(ErrorKind::AlreadyExists, format!("group {name:?} already exists")));
            }
            members(&st, &names, None)?
        };
        let rec = GroupRecord {
            id: inner.meta.next_id()?,
            group: 0,
            created_unix: now_unix(),
            members: ids,
            name: name.to_owned(),
        };
        inner.meta.apply(&[CatalogOp::PutGroup(rec.clone())])?;
        let mut st = inner.state.write();
        st.groups.insert(rec.id, rec.clone());
        Ok(group_info(&st, &rec))
    }

    /// Adds volumes to, or removes them from, a group. Durable on return.
    pub fn update_group(&self, name: &str, add: &[&str], remove: &[&str]) -> Result<GroupInfo> {
        let inner = &self.inner;
        inner.check_open()?;
        let _m = inner.meta_lock.lock();
        let rec = {
            let st = inner.state.read();
            let mut rec = st.groups[&group_by_name(&st, name)?].clone();
            let add: Vec<String> = add.iter().map(|v| (*v).to_owned()).collect();
            for id in members(&st, &add, Some(rec.id))? {
                if !rec.members.contains(&id) {
                    rec.members.push(id);
                }
            }
            for v in remove {
                let id = lookup(&st, v)?;
                if !rec.members.contains(&id) {
                    return Err(Error::new(ErrorKind::NotFound, format!("volume {v:?} is not in group {name:?}")));
                }
                rec.members.retain(|&m| m != id);
            }
            rec
        };
        inner.meta.apply(&[CatalogOp::PutGroup(rec.clone())])?;
        let mut st = inner.state.write();
        st.groups.insert(rec.id, rec.clone());
        Ok(group_info(&st, &rec))
    }

    /// Deletes a group; its volumes and group snapshots stay. Durable on return.
    pub fn delete_group(&self, name: &str) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let _m = inner.meta_lock.lock();
        let id = group_by_name(&inner.state.read(), name)?;
        inner.meta.apply(&[CatalogOp::DeleteGroup(id)])?;
        inner.state.write().groups.remove(&id);
        Ok(())
    }

    /// Every group, by name.
    pub fn groups(&self) -> Vec<GroupInfo> {
        let st = self.inner.state.read();
        let mut v: Vec<_> = st.groups.values().map(|g| group_info(&st, g)).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Snapshots every member of `group` at one point of the log (crash-consistent across
    /// members); the member snapshots are named `<name>.<volume>`. Durable on return.
    pub fn create_group_snapshot(&self, group: &str, name: &str) -> Result<GroupSnapshotInfo> {
        validate_name(name)?;
        let (group, name) = (group.to_owned(), name.to_owned());
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let (gid, items) = {
                let st = inner.state.read();
                if group_snapshot_by_name(&st, &name).is_ok() {
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!("group snapshot {name:?} already exists"),
                    ));
                }
                let g = &st.groups[&group_by_name(&st, &group)?];
                if g.members.is_empty() {
                    return Err(Error::new(ErrorKind::InvalidArgument, format!("group {group:?} has no volumes")));
                }
                let items: Vec<(u64, String)> =
                    g.members.iter().map(|m| (*m, format!("{name}.{}", st.volumes[m].rec.name))).collect();
                (g.id, items)
            };
            for (_, n) in &items {
                validate_name(n)?;
            }
            let (planned, mut ops) = plan_snapshots(inner, &items)?;
            let rec = GroupRecord {
                id: inner.meta.next_id()?,
                group: gid,
                created_unix: now_unix(),
                members: planned.iter().map(|(_, s)| s.id).collect(),
                name,
            };
            ops.push(CatalogOp::PutGroupSnapshot(rec.clone()));
            inner.sync_store()?;
            inner.meta.apply(&ops)?;
            let mut st = inner.state.write();
            apply_snapshots(&mut st, planned);
            st.group_snapshots.insert(rec.id, rec.clone());
            tracing::info!(group = %group, snapshot = %rec.name, members = rec.members.len(), "group snapshot created");
            Ok(group_snapshot_info(&st, &rec))
        })
    }

    /// Group snapshots, by name; only those of `group` if given.
    pub fn group_snapshots(&self, group: Option<&str>) -> Result<Vec<GroupSnapshotInfo>> {
        let st = self.inner.state.read();
        let of = group.map(|g| group_by_name(&st, g)).transpose()?;
        let mut v: Vec<_> = st
            .group_snapshots
            .values()
            .filter(|g| of.is_none_or(|id| g.group == id))
            .map(|g| group_snapshot_info(&st, g))
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }

    /// Deletes a group snapshot and its member snapshots (always allowed; clones keep what
    /// they need). Durable on return.
    pub fn delete_group_snapshot(&self, name: &str) -> Result<()> {
        let name = name.to_owned();
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let ops = {
                let mut st = inner.state.write();
                let id = group_snapshot_by_name(&st, &name)?;
                let rec = st.group_snapshots.remove(&id).expect("looked up above");
                let mut ops = vec![CatalogOp::DeleteGroupSnapshot(id)];
                for s in rec.members {
                    ops.extend(remove_snapshot(&mut st, s));
                }
                ops
            };
            inner.commit_restructure(ops)?;
            tracing::info!(snapshot = %name, "group snapshot deleted");
            Ok(())
        })
    }

    /// Clones every member of a group snapshot into a new group `new_group`, the clones named
    /// `<new_group>.<volume>`; one catalog write. Durable on return.
    pub fn clone_group_snapshot(&self, name: &str, new_group: &str) -> Result<GroupInfo> {
        validate_name(new_group)?;
        let (name, new_group) = (name.to_owned(), new_group.to_owned());
        self.inner.barrier(move |inner| {
            let _m = inner.meta_lock.lock();
            let sources: Vec<(String, u64, u64, Option<u64>)> = {
                let st = inner.state.read();
                if group_by_name(&st, &new_group).is_ok() {
                    return Err(Error::new(ErrorKind::AlreadyExists, format!("group {new_group:?} already exists")));
                }
                let g = &st.group_snapshots[&group_snapshot_by_name(&st, &name)?];
                let info = group_snapshot_info(&st, g);
                let mut out = Vec::new();
                for ((snap, vol), id) in info.snapshots.into_iter().zip(&g.members) {
                    let clone = format!("{new_group}.{vol}");
                    validate_name(&clone)?;
                    if st.names.contains_key(&clone) {
                        return Err(Error::new(ErrorKind::AlreadyExists, format!("volume {clone:?} already exists")));
                    }
                    let s = &st.snapshots[id];
                    debug_assert_eq!(s.name, snap);
                    out.push((clone, s.layer, s.size, st.layers.key_of(s.layer)));
                }
                check_overcommit(inner, &st, out.iter().map(|o| o.2).sum())?;
                out
            };
            let mut ops = Vec::new();
            let mut recs = Vec::new();
            for (clone, parent, size, key) in sources {
                let id = inner.meta.next_id()?;
                let rec = new_record(id, size, clone);
                ops.push(CatalogOp::PutLayer(id, Some(parent), key));
                ops.push(CatalogOp::PutVolume(rec.clone()));
                recs.push((rec, parent));
            }
            let group = GroupRecord {
                id: inner.meta.next_id()?,
                group: 0,
                created_unix: now_unix(),
                members: recs.iter().map(|(r, _)| r.id).collect(),
                name: new_group,
            };
            ops.push(CatalogOp::PutGroup(group.clone()));
            inner.meta.apply(&ops)?;
            let mut st = inner.state.write();
            for (rec, parent) in recs {
                st.layers.add(rec.id, parent);
                st.names.insert(rec.name.clone(), rec.id);
                st.volumes.insert(rec.id, VolumeEntry::new(rec));
            }
            st.groups.insert(group.id, group.clone());
            Ok(group_info(&st, &group))
        })
    }
}
