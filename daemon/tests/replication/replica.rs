//! The `Replica` service on a real daemon, driven by a hand-built delta over the admin socket:
//! a first sync and an increment land as whole mirror snapshots; a corrupt block, a truncated
//! stream, a daemon restart mid-transfer, an unknown base, a resume with nothing to resume and a
//! second push at once are refused or resumed, and the replica never shows a partial delta.

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use crate::common;

use common::Daemon;
use common::csi::channel;
use common::nbd::{open, read_image, write_on};
use common::push::{bytes, commit, data, push};
use ferrite_proto::ferrite::v1::push_message::Msg;
use ferrite_proto::ferrite::v1::replica_client::ReplicaClient;
use ferrite_proto::ferrite::v1::{PushBegin, PushMessage, PushZero, ReplicaPositionRequest};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 8 * MIB;

fn zero(offset: u64, length: u64) -> PushMessage {
    PushMessage { msg: Some(Msg::Zero(PushZero { offset, length })) }
}

fn begin(base: &str, snapshot: &str, end: u64, resume: bool) -> PushMessage {
    let b = PushBegin {
        replica: "r".into(),
        base: base.into(),
        snapshot: snapshot.into(),
        size: SIZE,
        end,
        resume,
        prefix: "m".into(),
        ..Default::default()
    };
    PushMessage { msg: Some(Msg::Begin(b)) }
}

async fn position(c: &Channel) -> (String, String, u64) {
    let p = ReplicaClient::new(c.clone())
        .position(ReplicaPositionRequest { replica: "r".into() })
        .await
        .unwrap()
        .into_inner();
    (p.snapshots.last().cloned().unwrap_or_default(), p.pending_snapshot, p.resume_offset)
}

/// The whole content of `image` (a volume or `volume@snapshot`), over NBD.
fn read(d: &Daemon, image: &str) -> Vec<u8> {
    read_image(d, image, SIZE)
}

fn expect(pieces: &[(u8, u64, u64)]) -> Vec<u8> {
    let mut want = vec![0u8; SIZE as usize];
    for &(seed, offset, len) in pieces {
        want[offset as usize..(offset + len) as usize].copy_from_slice(&bytes(seed, len));
    }
    want
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_land_whole_and_bad_or_cut_pushes_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let c = channel(&d.admin()).await;

    // A first sync cut short, then started over (not resumed): what it left goes with it.
    let err = push(&c, vec![begin("", "m1", 4 * MIB, false), data(7, 2 * MIB, MIB)]).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err}");
    assert_eq!(position(&c).await, (String::new(), "m1".into(), 3 * MIB));
    // A first sync: data, a zero run, data.
    let m1 = vec![begin("", "m1", 4 * MIB, false), data(1, 0, MIB), zero(MIB, MIB), data(2, 3 * MIB, MIB), commit()];
    assert_eq!(push(&c, m1).await.unwrap(), "m1");
    assert_eq!(position(&c).await, ("m1".into(), String::new(), 0));
    let m1_content = expect(&[(1, 0, MIB), (2, 3 * MIB, MIB)]);
    assert_eq!(read(&d, "r@m1"), m1_content);

    // A corrupt block: DataLoss naming the byte, no snapshot.
    let mut bad = data(3, 2 * MIB, MIB);
    if let Some(Msg::Data(p)) = &mut bad.msg {
        p.data[5000] ^= 1;
    }
    let err = push(&c, vec![begin("m1", "m2", 6 * MIB, false), data(3, 0, 64 << 10), bad, commit()]).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err}");
    assert!(err.message().contains(&format!("byte {}", 2 * MIB + 4096)), "{err}");
    assert_eq!(position(&c).await, ("m1".into(), "m2".into(), 64 << 10));

    // A truncated stream (no commit): Aborted, what arrived is kept and its resume point recorded.
    let err = push(&c, vec![begin("m1", "m2", 6 * MIB, false), data(3, 0, 64 << 10), data(4, 2 * MIB, MIB)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err}");
    assert_eq!(position(&c).await, ("m1".into(), "m2".into(), 3 * MIB));
    assert_eq!(read(&d, "r@m1"), m1_content, "the replica still reads as its mirror snapshot");

    // The receiving daemon restarts; the resume point survives and the rest completes the delta.
    d.stop();
    let d = Daemon::start(dir.path());
    let c = channel(&d.admin()).await;
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(dir.path().join("replication.json")).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(position(&c).await, ("m1".into(), "m2".into(), 3 * MIB));
    assert_eq!(push(&c, vec![begin("m1", "m2", 6 * MIB, true), data(5, 5 * MIB, MIB), commit()]).await.unwrap(), "m2");
    assert_eq!(position(&c).await, ("m2".into(), String::new(), 0));
    assert_eq!(
        read(&d, "r@m2"),
        expect(&[
            (3, 0, 64 << 10),
            (1, 64 << 10, MIB - (64 << 10)),
            (4, 2 * MIB, MIB),
            (2, 3 * MIB, MIB),
            (5, 5 * MIB, MIB)
        ])
    );
    let snaps = d.ok(&["-o", "json", "snapshot", "list", "r"]);
    assert!(!snaps.contains("\"m1\""), "the older mirror snapshot goes: m2 is the common point now: {snaps}");
    let vol: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "volume", "show", "r"])).unwrap();
    assert_eq!(vol["read_only"], true, "a replica is read-only for clients: {vol}");

    // Refusals: a base the replica lacks, a resume with nothing to resume, a snapshot it has, a
    // push that does not start with its begin, a second push while one is in flight.
    d.ok(&["volume", "create", "mine", "1M"]);
    let mut first = begin("", "x1", 0, false);
    if let Some(Msg::Begin(b)) = &mut first.msg {
        b.replica = "mine".into();
    }
    let err = push(&c, vec![first, commit()]).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "a first sync never takes over a volume: {err}");
    let err = push(&c, vec![begin("m1", "m3", MIB, false), commit()]).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert!(err.message().contains("resync"), "{err}");
    assert_eq!(push(&c, vec![begin("m2", "m3", MIB, true)]).await.unwrap_err().code(), Code::FailedPrecondition);
    let mut ghost = begin("m2", "g1", MIB, false);
    if let Some(Msg::Begin(b)) = &mut ghost.msg {
        b.replica = "ghost".into();
    }
    let err = push(&c, vec![ghost, commit()]).await.unwrap_err();
    assert!(err.code() == Code::FailedPrecondition && err.message().contains("not a replica"), "{err}");
    assert_eq!(push(&c, vec![begin("m2", "m2", MIB, false)]).await.unwrap_err().code(), Code::AlreadyExists);
    assert_eq!(push(&c, vec![commit()]).await.unwrap_err().code(), Code::InvalidArgument);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(begin("m2", "m3", 0, false)).await.unwrap();
    let held = tokio::spawn({
        let c = c.clone();
        async move { ReplicaClient::new(c).push(ReceiverStream::new(rx)).await }
    });
    // Once the held push has begun (its transfer is recorded), a second one is refused.
    let start = std::time::Instant::now();
    while position(&c).await.1 != "m3" {
        assert!(start.elapsed().as_secs() < 30, "the held push did not begin");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let err = push(&c, vec![begin("m2", "m3", 0, false), commit()]).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err}");
    assert!(err.message().contains("\"r\""), "{err}");
    tx.send(commit()).await.unwrap();
    drop(tx);
    held.await.unwrap().unwrap();
    assert_eq!(position(&c).await.0, "m3");
}

/// Writes `len` bytes of a `seed` pattern at `offset` of `volume`, over NBD.
fn write(d: &Daemon, volume: &str, seed: u8, offset: u64, len: u64) {
    let Some(Msg::Data(p)) = data(seed, offset, len).msg else { unreachable!() };
    assert_eq!(write_on(&mut open(d, volume), offset, &p.data), 0, "write to {volume} failed");
}

/// Replicates `v` to `r` at `peer`, on request only.
fn enable(primary: &Daemon, peer: &str) {
    primary.ok(&["replica", "enable", "v", peer, "--as", "r", "--interval", "0"]);
}

fn sync(primary: &Daemon) -> serde_json::Value {
    serde_json::from_str(&primary.ok(&["-o", "json", "replica", "sync", "v"])).unwrap()
}

#[test]
fn a_daemon_pushes_a_volume_to_a_peer_first_in_full_then_only_what_changed() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (primary, peer) = (Daemon::start(a.path()), Daemon::start(b.path()));
    primary.ok(&["volume", "create", "v", "8M"]);
    write(&primary, "v", 1, 0, 2 * MIB);
    write(&primary, "v", 2, 6 * MIB, MIB);

    // First sync: the allocated 3 MiB, as mirror snapshot v.mirror.<ms> on both sides.
    enable(&primary, peer.admin().to_str().unwrap());
    let r = sync(&primary);
    let m1 = r["snapshot"].as_str().unwrap().to_owned();
    assert!(m1.starts_with("v.mirror."), "{r}");
    assert_eq!(
        (r["base"].as_str(), r["data_bytes"].as_u64(), r["resumed"].as_bool()),
        (Some(""), Some(3 * MIB), Some(false))
    );
    assert_eq!(read(&peer, &format!("r@{m1}")), read(&primary, &format!("v@{m1}")));

    // An increment: 64 KiB rewritten, 1 MiB new; only those cross, and the primary keeps only
    // the newest mirror snapshot.
    write(&primary, "v", 3, 64 << 10, 64 << 10);
    write(&primary, "v", 4, 4 * MIB, MIB);
    let r = sync(&primary);
    let m2 = r["snapshot"].as_str().unwrap().to_owned();
    assert_eq!((r["base"].as_str(), r["data_bytes"].as_u64()), (Some(m1.as_str()), Some(MIB + (64 << 10))), "{r}");
    let want = read(&primary, &format!("v@{m2}"));
    assert_eq!(read(&peer, &format!("r@{m2}")), want);
    assert_eq!(read(&primary, "v"), want);
    let snaps = primary.ok(&["-o", "json", "snapshot", "list", "v"]);
    assert!(!snaps.contains(&m1) && snaps.contains(&m2), "{snaps}");

    // The table output says what happened; a peer that is not there is a clear error.
    let out = primary.ok(&["replica", "sync", "v"]);
    assert!(out.contains(&format!("over {m2}")) && out.contains("of data sent"), "{out}");
    primary.ok(&["volume", "create", "w", "1M"]);
    primary.ok(&["replica", "enable", "w", "/nonexistent.sock", "--interval", "0"]);
    let err = primary.cli(&["replica", "sync", "w"]);
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("/nonexistent.sock"), "{err:?}");
}

#[test]
fn a_push_to_a_tcp_peer_uses_mutual_tls_and_the_peer_fence_list() {
    let root = tempfile::tempdir().unwrap();
    let (primary, _, _) = common::csi::tcp_node(&root.path().join("a"), "127.0.0.2");
    let (peer, peer_admin, _) = common::csi::tcp_node(&root.path().join("b"), "127.0.0.3");
    primary.ok(&["volume", "create", "v", "8M"]);
    write(&primary, "v", 9, MIB, MIB);
    let to = format!("tcp://{peer_admin}");
    enable(&primary, &to);
    let r = sync(&primary);
    let m1 = r["snapshot"].as_str().unwrap().to_owned();
    assert_eq!(r["data_bytes"].as_u64(), Some(MIB), "{r}");
    assert_eq!(read(&peer, &format!("r@{m1}")), read(&primary, &format!("v@{m1}")));

    // Fenced on the peer (the primary's connections come from a loopback address the kernel
    // picks): they are refused, and the replica stays.
    peer.ok(&["fence", "add", "127.0.0.0/8"]);
    write(&primary, "v", 10, 0, MIB);
    let err = primary.cli(&["replica", "sync", "v"]);
    assert!(!err.status.success(), "a fenced primary must not reach the replica");
    assert!(String::from_utf8_lossy(&err.stderr).contains(&peer_admin.to_string()), "{err:?}");
    assert_eq!(peer.ok(&["-o", "json", "snapshot", "list", "r"]).matches("v.mirror.").count(), 1);
    peer.ok(&["fence", "remove", "127.0.0.0/8"]);
    let r = sync(&primary);
    assert_eq!(r["base"].as_str(), Some(m1.as_str()), "{r}");
}

#[test]
fn user_snapshots_named_in_the_settings_replicate_in_order_and_stay() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (primary, peer) = (Daemon::start(a.path()), Daemon::start(b.path()));
    primary.ok(&["volume", "create", "v", "8M"]);
    write(&primary, "v", 1, 0, MIB);
    primary.ok(&["snapshot", "create", "v", "nightly-1"]);
    write(&primary, "v", 2, 2 * MIB, MIB);
    primary.ok(&["snapshot", "create", "v", "scratch"]);
    write(&primary, "v", 3, 4 * MIB, MIB);
    let to = peer.admin().display().to_string();
    primary.ok(&["replica", "enable", "v", &to, "--as", "r", "--interval", "0", "--snapshot", "nightly-*"]);
    // nightly-1 first (1 MiB), then the mirror snapshot over it (2 MiB): nothing crosses twice.
    assert_eq!(sync(&primary)["data_bytes"], 3 * MIB);
    let names = |d: &Daemon, v: &str| -> Vec<String> {
        let list: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "snapshot", "list", v])).unwrap();
        list.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap().to_owned()).collect()
    };
    let on_peer = names(&peer, "r");
    assert!(on_peer[0] == "nightly-1" && on_peer.len() == 2 && on_peer[1].starts_with("v.mirror."), "{on_peer:?}");
    assert_eq!(read(&peer, "r@nightly-1"), read(&primary, "v@nightly-1"));

    write(&primary, "v", 4, 6 * MIB, MIB);
    primary.ok(&["snapshot", "create", "v", "nightly-2"]);
    assert_eq!(sync(&primary)["data_bytes"], MIB);
    let on_peer = names(&peer, "r");
    assert_eq!(&on_peer[..2], ["nightly-1", "nightly-2"], "user snapshots stay through mirror pruning");
    assert_eq!(on_peer.len(), 3, "{on_peer:?}");
    assert_eq!(read(&peer, "r@nightly-2"), read(&primary, "v@nightly-2"));
    let m = on_peer[2].as_str();
    assert_eq!(read(&peer, &format!("r@{m}")), read(&primary, "v"));

    // A clone replicates as it is: its first sync reads through its origin, and the clone on
    // the primary stays a clone (nothing flattened).
    primary.ok(&["clone", "v@nightly-1", "c"]);
    write(&primary, "c", 5, 3 * MIB, MIB);
    let depth = |d: &Daemon| -> u64 {
        let v: serde_json::Value = serde_json::from_str(&d.ok(&["-o", "json", "volume", "show", "c"])).unwrap();
        v["chain_depth"].as_u64().unwrap()
    };
    let before = depth(&primary);
    assert!(before >= 2, "a clone sits on its origin");
    primary.ok(&["replica", "enable", "c", &to, "--interval", "0"]);
    let r: serde_json::Value = serde_json::from_str(&primary.ok(&["-o", "json", "replica", "sync", "c"])).unwrap();
    assert_eq!(r["data_bytes"], 2 * MIB, "the origin's 1 MiB and the clone's own: {r}");
    assert_eq!(read(&peer, "c"), read(&primary, "c"));
    assert_eq!(depth(&primary), before + 1, "only the mirror snapshot was added");
}

/// An encrypted volume replicates as ciphertext: the peer holds it without the key (locked, no
/// plaintext in its pool file), follows a rekey of the primary, and opens with the primary's key.
#[test]
fn an_encrypted_volume_replicates_as_ciphertext() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (primary, mut peer) = (Daemon::start(a.path()), Daemon::start(b.path()));
    primary.ok(&["volume", "create", "v", "8M", "--encrypt"]);
    write(&primary, "v", 1, 0, 2 * MIB);
    enable(&primary, peer.admin().to_str().unwrap());
    let m1 = sync(&primary)["snapshot"].as_str().unwrap().to_owned();
    let r = peer.json(&["volume", "show", "r"]);
    assert_eq!(
        r["encryption"],
        serde_json::json!({"key_id": "default", "unlocked": false, "provider": "request"}),
        "{r}"
    );
    let o = peer.cli(&["export", "nbd", &format!("r@{m1}")]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("locked"));

    // The primary's new key-encryption key travels with the next delta (wrapped data key only).
    primary.ok(&["volume", "rekey", "v", "--key", "k2"]);
    write(&primary, "v", 2, 4 * MIB, MIB);
    let m2 = sync(&primary)["snapshot"].as_str().unwrap().to_owned();
    assert_eq!(peer.json(&["volume", "show", "r"])["encryption"]["key_id"], "k2");
    assert!(peer.stop().success());
    let raw = std::fs::read(b.path().join("pool.img")).unwrap();
    let plain = bytes(1, 4096);
    assert!(!raw.windows(4096).step_by(4096).any(|w| w == &plain[..]), "plaintext in the replica's pool");

    // Given the key, the replica opens and reads what the primary holds.
    let keys = b.path().join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    std::fs::copy(a.path().join("keys/k2.key"), keys.join("k2.key")).unwrap();
    let peer = Daemon::start(b.path());
    assert_eq!(peer.json(&["volume", "show", "r"])["encryption"]["unlocked"], true);
    assert_eq!(read(&peer, &format!("r@{m2}")), read(&primary, &format!("v@{m2}")));
}
