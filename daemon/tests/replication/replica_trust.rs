//! Hostile replication peers. First, on one daemon over its admin socket (an operator, who may
//! call anything), the crafted group push that used to roll a live primary back. Then two hosts
//! on a network the test makes (one namespace holding both hosts' addresses, reachable from the
//! test), each daemon with its own certificate and `[roles]`, and pushes crafted over real
//! mutual TLS: from an identity that is not the relation's peer, from one with no role, fields
//! that lie, a silent stream, a commit that landed before a crash, a push the replica refuses a
//! hundred times, and a failed-over primary that keeps pushing (stale epoch). Every case ends
//! with the data checked byte for byte.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Daemon;
use common::csi::{certs, tls_channel};
use common::nbd::{open, read_image, write_on};
use common::netns::Lan;
use common::push::{begin, bytes, commit, data, push};
use ferrite_proto::ferrite::v1::replica_client::ReplicaClient;
use ferrite_proto::ferrite::v1::{GroupCommitRequest, PushBegin, ReplicaPositionRequest};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;

fn fill(d: &Daemon, volume: &str, byte: u8, offset: u64, len: u64) {
    assert_eq!(write_on(&mut open(d, volume), offset, &vec![byte; len as usize]), 0, "write to {volume}");
}

fn refused(r: Result<String, tonic::Status>, code: Code, says: &str) {
    let e = r.expect_err("the push must be refused");
    assert_eq!(e.code(), code, "{e}");
    assert!(e.message().contains(says), "{:?} should say {says:?}", e.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_push_cannot_touch_a_volume_outside_its_group() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["volume", "create", "prod", "8M"]);
    fill(&d, "prod", 0xAA, 0, 4096);
    d.ok(&["snapshot", "create", "prod", "s1"]);
    fill(&d, "prod", 0xBB, 0, 4096);
    d.ok(&["export", "nbd", "prod"]);
    let c = common::csi::channel(&d.admin()).await;
    let seed = PushBegin {
        group: "g".into(),
        replica: "seed".into(),
        snapshot: "p1".into(),
        prefix: "p".into(),
        size: 4096,
        ..Default::default()
    };
    assert_eq!(push(&c, vec![begin(seed), commit()]).await.unwrap(), "p1");
    let into_prod = PushBegin {
        group: "g".into(),
        replica: "prod".into(),
        base: "s1".into(),
        snapshot: "x".into(),
        size: 8 * MIB,
        ..Default::default()
    };
    refused(push(&c, vec![begin(into_prod.clone()), commit()]).await, Code::PermissionDenied, "not a member");
    // Nor as a new member, nor as a volume of its own, nor by a group commit naming it.
    let as_new = PushBegin { base: String::new(), ..into_prod.clone() };
    refused(push(&c, vec![begin(as_new), commit()]).await, Code::PermissionDenied, "not a member");
    let alone = PushBegin { group: String::new(), ..into_prod };
    refused(push(&c, vec![begin(alone), commit()]).await, Code::FailedPrecondition, "not a replica");
    let gc = GroupCommitRequest { group: "g".into(), point: "s1".into(), members: vec!["prod".into()], epoch: 0 };
    let e = ReplicaClient::new(c.clone()).group_commit(gc).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    // A first group push may not name a local group (its prune would delete the group's
    // snapshots that share the prefix), nor a local volume.
    d.ok(&["volume", "create", "lv", "8M"]);
    d.ok(&["group", "create", "lg", "lv"]);
    d.ok(&["group", "snapshot", "lg", "gsnap1"]);
    for group in ["lg", "lv"] {
        let take = PushBegin {
            group: group.into(),
            replica: "fresh".into(),
            snapshot: "gsnap2".into(),
            prefix: "gsnap".into(),
            size: 4096,
            ..Default::default()
        };
        refused(push(&c, vec![begin(take), commit()]).await, Code::AlreadyExists, "local group or volume");
    }
    let gc = GroupCommitRequest { group: "lg".into(), point: "gsnap2".into(), members: vec![], epoch: 0 };
    assert!(ReplicaClient::new(c.clone()).group_commit(gc).await.is_err());
    assert!(d.ok(&["group", "snapshots"]).contains("gsnap1"), "a local group snapshot was deleted");
    assert!(d.json(&["snapshot", "show", "gsnap1.lv"])["name"] == "gsnap1.lv");
    let now = read_image(&d, "prod", 4096);
    assert!(now.iter().all(|&b| b == 0xBB), "the acknowledged write is still there");
    assert_eq!(d.json(&["volume", "show", "prod"])["read_only"], false);
    assert!(d.log().contains("call refused"));
}

/// Two hosts on one network, each a daemon with its own certificate (`host-0`, `host-1`, naming
/// its address) that knows the other as a replication peer; `host-2` is a third daemon's
/// identity, a replication peer of host 1 too, and `stray` a certificate of the same CA with no
/// role.
struct Pair {
    lan: Lan,
    root: tempfile::TempDir,
    a: Daemon,
    b: Daemon,
}

impl Pair {
    fn pki(&self) -> PathBuf {
        self.root.path().join("pki")
    }

    fn endpoint(&self, i: usize) -> String {
        format!("tcp://{}:7070", self.lan.hosts[i])
    }

    fn daemon(lan: &Lan, root: &Path, i: usize, extra: &str) -> Daemon {
        let pki = root.join("pki");
        let dir = root.join(format!("host-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let p = |f: &str| pki.join(f).display().to_string();
        let roles = match i {
            0 => "\"host-1\" = \"replication-peer\"\n",
            _ => "\"host-0\" = \"replication-peer\"\n\"host-2\" = \"replication-peer\"\n",
        };
        let cfg = format!(
            "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\nadmin-listen = \"{}:7070\"\n\
             tls-cert = {:?}\ntls-key = {:?}\ntls-client-ca = {:?}\nreplication-idle-timeout-s = 2\n{extra}\n[roles]\n{roles}",
            lan.hosts[i],
            p(&format!("host-{i}.pem")),
            p(&format!("host-{i}-key.pem")),
            p("ca.pem")
        );
        std::fs::write(dir.join("ferrite.toml"), cfg).unwrap();
        Daemon::start_in(&dir, Some(&lan.ns))
    }

    fn new() -> Option<Self> {
        Self::with("")
    }

    /// The pair, host 1's daemon configured with `extra_b` too.
    fn with(extra_b: &str) -> Option<Self> {
        let lan = Lan::new(3)?;
        let root = tempfile::tempdir().unwrap();
        let pki = root.path().join("pki");
        for i in 0..3 {
            certs(&pki, &format!("host-{i}"), &[&lan.hosts[i]]);
        }
        certs(&pki, "stray", &[]);
        let a = Self::daemon(&lan, root.path(), 0, "");
        let b = Self::daemon(&lan, root.path(), 1, extra_b);
        Some(Self { lan, root, a, b })
    }

    /// Volume `v` (8 MiB, 2 MiB written) on host 0, replicated once to host 1; its mirror snapshot.
    fn replicated_v(&self) -> String {
        self.a.ok(&["volume", "create", "v", "8M"]);
        fill(&self.a, "v", 1, 0, 2 * MIB);
        self.a.ok(&["replica", "enable", "v", &self.endpoint(1), "--interval", "0"]);
        self.a.ok(&["replica", "sync", "v"]);
        mirror(&self.a, "v")
    }

    /// A client of host `i`'s admin listener with `who`'s certificate.
    async fn to(&self, i: usize, who: &str) -> Channel {
        tls_channel(&format!("{}:7070", self.lan.hosts[i]), &self.pki(), who).await
    }

    async fn to_b(&self, who: &str) -> Channel {
        self.to(1, who).await
    }
}

/// A push into `v` on host 1 over mirror snapshot `base`, as host 0 (its origin) sends one.
fn into_v(pair: &Pair, base: &str, snapshot: &str) -> PushBegin {
    PushBegin {
        replica: "v".into(),
        base: base.into(),
        snapshot: snapshot.into(),
        size: 8 * MIB,
        end: 8 * MIB,
        origin: pair.endpoint(0),
        prefix: "v.mirror.".into(),
        ..Default::default()
    }
}

fn mirror(d: &Daemon, v: &str) -> String {
    d.replica(v)["last_snapshot"].as_str().unwrap().to_owned()
}

fn mirrors(d: &Daemon, v: &str, prefix: &str) -> usize {
    let list = d.json(&["snapshot", "list", v]);
    list.as_array().unwrap().iter().filter(|s| s["name"].as_str().unwrap().starts_with(prefix)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peers_over_mutual_tls_change_nothing() {
    let Some(mut pair) = Pair::new() else { return };
    let size = 8 * MIB;
    let m1 = pair.replicated_v();
    let image = format!("v@{m1}");
    let want = read_image(&pair.a, &image, size);
    assert_eq!(read_image(&pair.b, &image, size), want);
    let same = |pair: &Pair| assert_eq!(read_image(&pair.b, &image, size), want, "the replica changed");

    // Another daemon's identity, a replication peer here but not v's: refused for v, whatever it
    // claims to be.
    let intruder = pair.to_b("host-2").await;
    let lie = into_v(&pair, &m1, "evil");
    refused(push(&intruder, vec![begin(lie.clone()), commit()]).await, Code::PermissionDenied, "host-2");
    let pos = ReplicaClient::new(intruder.clone()).position(ReplicaPositionRequest { replica: "v".into() }).await;
    assert_eq!(pos.unwrap_err().code(), Code::PermissionDenied);
    // A first sync from it under the other host's endpoint: its certificate does not name that.
    let impostor = PushBegin { replica: "w".into(), base: String::new(), ..lie.clone() };
    refused(push(&intruder, vec![begin(impostor), commit()]).await, Code::PermissionDenied, "does not name");
    // Nor may it ask the primary to push: it has no role there, so its connection is closed.
    let a = format!("{}:7070", pair.lan.hosts[0]);
    assert!(common::csi::closed_for(&a, &pair.pki(), "host-2").await, "host-2 got in where it has no role");
    // A certificate of the CA with no role: nothing at all.
    let b = format!("{}:7070", pair.lan.hosts[1]);
    assert!(common::csi::closed_for(&b, &pair.pki(), "stray").await, "a stray certificate got in");
    same(&pair);

    // The real peer, lying: an interval past a week, an epoch no promotions reach, a volume
    // larger than the pool.
    let real = pair.to_b("host-0").await;
    let long = PushBegin { interval_secs: u64::MAX, snapshot: "m-long".into(), ..lie.clone() };
    refused(push(&real, vec![begin(long), commit()]).await, Code::InvalidArgument, "interval");
    let pinned = PushBegin { epoch: u64::MAX, snapshot: "m-pin".into(), ..lie.clone() };
    refused(push(&real, vec![begin(pinned), commit()]).await, Code::InvalidArgument, "epoch");
    let huge = PushBegin { replica: "huge".into(), base: String::new(), size: 1 << 50, end: 0, ..lie.clone() };
    refused(push(&real, vec![begin(huge), commit()]).await, Code::InvalidArgument, "at most");
    same(&pair);

    // A silent stream is ended after the idle timeout (2 s), its place kept for a resume.
    let t = Instant::now();
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(begin(PushBegin { snapshot: "v.mirror.1".into(), ..lie.clone() })).await.unwrap();
    let silent = ReplicaClient::new(real.clone()).push(ReceiverStream::new(rx)).await;
    assert_eq!(silent.unwrap_err().code(), Code::DeadlineExceeded);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    drop(tx);
    let pos = ReplicaClient::new(real.clone()).position(ReplicaPositionRequest { replica: "v".into() }).await.unwrap();
    assert!(!pos.into_inner().busy);
    same(&pair);
    // The real primary carries on: its next delta lands whole.
    fill(&pair.a, "v", 2, 3 * MIB, MIB);
    pair.a.ok(&["replica", "sync", "v"]);
    let m2 = mirror(&pair.a, "v");
    assert_eq!(read_image(&pair.b, &format!("v@{m2}"), size), read_image(&pair.a, &format!("v@{m2}"), size));

    // A commit that landed just before a crash, unrecorded: the replica's records still show the
    // transfer pending, and its sender (which never heard back) holds both its base and it. It
    // is recognised as done, not resumed for ever (a resume of a snapshot held is refused).
    let origin = pair.endpoint(0);
    let r = |snapshot: &str, base: &str, end: u64| PushBegin {
        replica: "r".into(),
        snapshot: snapshot.into(),
        base: base.into(),
        size,
        end,
        origin: origin.clone(),
        prefix: "m".into(),
        ..Default::default()
    };
    assert_eq!(push(&real, vec![begin(r("m1", "", MIB)), data(1, 0, MIB), commit()]).await.unwrap(), "m1");
    assert_eq!(push(&real, vec![begin(r("m2", "m1", 3 * MIB)), data(2, 2 * MIB, MIB), commit()]).await.unwrap(), "m2");
    assert_eq!(pair.b.stop().code(), Some(0));
    let pending = serde_json::json!([{"replica": "r", "snapshot": "m2", "base": "m1", "resume": 2 * MIB}]);
    std::fs::write(pair.b.dir.join("replica-transfers.json"), pending.to_string()).unwrap();
    pair.b = Pair::daemon(&pair.lan, pair.root.path(), 1, "");
    let real = pair.to_b("host-0").await;
    let pos = ReplicaClient::new(real.clone()).position(ReplicaPositionRequest { replica: "r".into() }).await;
    let pos = pos.unwrap().into_inner();
    assert_eq!((pos.pending_snapshot.as_str(), pos.snapshots.last().map(String::as_str)), ("", Some("m2")), "{pos:?}");
    assert_eq!(pair.b.replica("r")["last_snapshot"], "m2");
    assert_eq!(push(&real, vec![begin(r("m3", "m2", 5 * MIB)), data(3, 4 * MIB, MIB), commit()]).await.unwrap(), "m3");
    let mut want = vec![0u8; size as usize];
    for (seed, at) in [(1u8, 0), (2, 2 * MIB), (3, 4 * MIB)] {
        want[at as usize..(at + MIB) as usize].copy_from_slice(&bytes(seed, MIB));
    }
    assert_eq!(read_image(&pair.b, "r@m3", size), want);

    // A volume larger than the peer's pool: refused a hundred times, and the sender keeps no
    // more than the common point and its newest attempt.
    pair.a.ok(&["volume", "create", "big", "3G"]);
    fill(&pair.a, "big", 5, 0, MIB);
    pair.a.ok(&["replica", "enable", "big", &pair.endpoint(1), "--interval", "0"]);
    for _ in 0..100 {
        let o = pair.a.cli(&["replica", "sync", "big"]);
        assert!(!o.status.success());
        assert!(String::from_utf8_lossy(&o.stderr).contains("at most"), "{o:?}");
    }
    let kept = mirrors(&pair.a, "big", "big.mirror.");
    assert!(kept <= 2, "{kept} mirror snapshots of a relation whose pushes are all refused");
    assert!(pair.b.cli(&["volume", "show", "big"]).status.code() != Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_over_primary_can_never_overwrite_its_successor() {
    let Some(mut pair) = Pair::new() else { return };
    let size = 8 * MIB;
    let m1 = pair.replicated_v();
    // Host 1 takes over (host 0 is thought dead), takes writes of its own, then hands the
    // volume back (demote: read-only, waiting for host 0 to take its final delta).
    let promoted = pair.b.json(&["replica", "promote", "v", "--force"]);
    assert_eq!((promoted["role"].as_str(), promoted["last_snapshot"].as_str()), (Some("primary"), Some(m1.as_str())));
    fill(&pair.b, "v", 9, MIB, MIB);
    pair.b.ok(&["replica", "demote", "v"]);
    let b_now = read_image(&pair.b, "v", size);
    // The old primary comes back, restarted and still primary, with writes the cluster never
    // acknowledged past its failover: its pushes are refused, naming both epochs.
    fill(&pair.a, "v", 2, 4 * MIB, MIB);
    pair.a.stop();
    pair.a = Pair::daemon(&pair.lan, pair.root.path(), 0, "");
    for _ in 0..3 {
        let o = pair.a.cli(&["replica", "sync", "v"]);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("epoch 1, this side at 0"), "{err}");
    }
    // Even a push crafted past the sender's own checks, as host 0, under its old epoch.
    let real = pair.to_b("host-0").await;
    let stale = PushBegin { epoch: 0, ..into_v(&pair, &m1, "v.mirror.999") };
    refused(push(&real, vec![begin(stale), data(6, 0, MIB), commit()]).await, Code::FailedPrecondition, "epoch 0");
    assert_eq!(read_image(&pair.b, "v", size), b_now, "the successor's writes are all there");
    assert_eq!(pair.b.replica("v")["role"], "secondary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_and_forced_promotions_race_without_a_partial_replica() {
    let Some(pair) = Pair::new() else { return };
    for i in 0..4 {
        let v = format!("c{i}");
        pair.a.ok(&["volume", "create", &v, "32M"]);
        fill(&pair.a, &v, 1 + i as u8, 0, 4 * MIB);
        pair.a.ok(&["replica", "enable", &v, &pair.endpoint(1), "--interval", "0"]);
        pair.a.ok(&["replica", "sync", &v]);
        fill(&pair.a, &v, 20 + i as u8, 8 * MIB, 16 * MIB);
        let mut sync = std::process::Command::new(common::BIN)
            .arg("--admin-socket")
            .arg(pair.a.admin())
            .args(["replica", "sync", &v])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(50 + 120 * i));
        pair.b.ok(&["replica", "promote", &v, "--force"]);
        let _ = sync.wait();
        // The successor is exactly one of the primary's complete mirror snapshots.
        let at = pair.b.replica(&v)["last_snapshot"].as_str().unwrap().to_owned();
        let here = read_image(&pair.b, &v, 32 * MIB);
        assert_eq!(here, read_image(&pair.a, &format!("{v}@{at}"), 32 * MIB), "round {i}: a partial replica");
        // And the old primary cannot push into it any more.
        assert!(!pair.a.cli(&["replica", "sync", &v]).status.success());
        assert_eq!(read_image(&pair.b, &v, 32 * MIB), here);
    }
}

#[test]
fn a_peer_fills_at_most_its_share_of_the_pool() {
    let Some(pair) = Pair::with("peer-space-percent = 10") else { return };
    let pool = pair.b.json(&["pool", "status"])["size"].as_u64().unwrap();
    // Each 6% of b's pool (whole MiB): the second would take the peer past its 10%.
    let size = format!("{}M", (pool * 6 / 100) >> 20);
    for i in 0..2 {
        let v = format!("s{i}");
        pair.a.ok(&["volume", "create", &v, &size]);
        pair.a.ok(&["replica", "enable", &v, &pair.endpoint(1), "--interval", "0"]);
        let o = pair.a.cli(&["replica", "sync", &v]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.success(), i == 0, "{v}: {err}");
        if i == 1 {
            assert!(err.contains("peer-space-percent"), "{err}");
            assert!(pair.b.cli(&["volume", "show", &v]).status.code() != Some(0), "the refused replica exists");
        }
    }
}

#[test]
fn a_peer_makes_at_most_its_quota_of_relations() {
    let Some(pair) = Pair::with("peer-quota = 2") else { return };
    for i in 0..3 {
        let v = format!("q{i}");
        pair.a.ok(&["volume", "create", &v, "8M"]);
        pair.a.ok(&["replica", "enable", &v, &pair.endpoint(1), "--interval", "0"]);
        let o = pair.a.cli(&["replica", "sync", &v]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.success(), i < 2, "{v}: {err}");
        if i == 2 {
            assert!(err.contains("peer-quota 2"), "{err}");
            assert!(pair.b.cli(&["volume", "show", &v]).status.code() != Some(0), "the refused replica exists");
        }
    }
}
