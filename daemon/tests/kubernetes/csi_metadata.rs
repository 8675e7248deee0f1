//! The CSI SnapshotMetadata service over the real gRPC socket of `ferrite csi --mode controller`:
//! allocated and changed ranges of snapshots streamed in pages, a listing restarted from
//! `starting_offset` continues it exactly, the answer is `ferrite snapshot diff`'s, every error
//! case of the spec, and an incremental copy driven by the delta turns the base into the target.

#![allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap, clippy::cast_sign_loss)] // small test sizes

use crate::common;

use common::csi::{channel, start_csi};
use std::io::Write;

use common::nbd::{connect, read_image, reply, request, write_on};
use common::{Daemon, pattern};
use ferrite_nbd::proto::CMD_TRIM;
use ferrite_proto::csi::v1 as csi;
use ferrite_proto::csi::v1::snapshot_metadata_client::SnapshotMetadataClient;
use tonic::Code;
use tonic::transport::Channel;

const SIZE: u64 = 64 << 20;

type Tuples = Vec<(i64, i64)>;

/// Every message of a GetMetadataAllocated stream: their tuples, and each message's size.
async fn allocated(
    c: &mut SnapshotMetadataClient<Channel>,
    snap: &str,
    start: i64,
    max: i32,
) -> Result<(Tuples, Vec<usize>), Code> {
    let req = csi::GetMetadataAllocatedRequest {
        snapshot_id: snap.into(),
        starting_offset: start,
        max_results: max,
        ..Default::default()
    };
    let mut s = c.get_metadata_allocated(req).await.map_err(|e| e.code())?.into_inner();
    let (mut all, mut sizes) = (Vec::new(), Vec::new());
    while let Some(m) = s.message().await.map_err(|e| e.code())? {
        assert_eq!(m.block_metadata_type, csi::BlockMetadataType::VariableLength as i32);
        assert_eq!(m.volume_capacity_bytes, SIZE as i64);
        sizes.push(m.block_metadata.len());
        all.extend(m.block_metadata.iter().map(|b| (b.byte_offset, b.size_bytes)));
    }
    Ok((all, sizes))
}

async fn delta(
    c: &mut SnapshotMetadataClient<Channel>,
    base: &str,
    target: &str,
    start: i64,
    max: i32,
) -> Result<Tuples, Code> {
    let req = csi::GetMetadataDeltaRequest {
        base_snapshot_id: base.into(),
        target_snapshot_id: target.into(),
        starting_offset: start,
        max_results: max,
        ..Default::default()
    };
    let mut s = c.get_metadata_delta(req).await.map_err(|e| e.code())?.into_inner();
    let mut all = Vec::new();
    while let Some(m) = s.message().await.map_err(|e| e.code())? {
        assert!(max <= 0 || m.block_metadata.len() <= max as usize);
        all.extend(m.block_metadata.iter().map(|b| (b.byte_offset, b.size_bytes)));
    }
    Ok(all)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_metadata_through_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("a")).unwrap();
    let a = Daemon::start(&dir.path().join("a"));
    let _csi = start_csi(dir.path(), &[("node-a", &a)], &["--mode", "controller"]);
    let ch = channel(&dir.path().join("csi.sock")).await;
    let mut ident = csi::identity_client::IdentityClient::new(ch.clone());
    let caps = ident.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}).await.unwrap().into_inner();
    let service = csi::plugin_capability::Service {
        r#type: csi::plugin_capability::service::Type::SnapshotMetadataService as i32,
    };
    assert!(
        caps.capabilities.iter().any(|c| c.r#type == Some(csi::plugin_capability::Type::Service(service))),
        "not advertised"
    );
    let mut c = SnapshotMetadataClient::new(ch);

    // Data in 40 places, a snapshot; then rewrites, a trim and new data, a second snapshot.
    a.ok(&["volume", "create", "v", "64M"]);
    a.ok(&["volume", "create", "other", "64M"]);
    a.ok(&["export", "nbd", "v"]);
    let mut s = connect(&a.nbd(), "v");
    for i in 0..40u64 {
        assert_eq!(write_on(&mut s, i * (1 << 20) + 8192, &pattern(i, 12288)), 0);
    }
    a.ok(&["snapshot", "create", "v", "s1"]);
    for i in (0..40u64).step_by(3) {
        assert_eq!(write_on(&mut s, i * (1 << 20) + 4096, &pattern(100 + i, 8192)), 0);
    }
    assert_eq!(write_on(&mut s, 50 << 20, &pattern(7, 1 << 20)), 0);
    s.write_all(&request(CMD_TRIM, 0, 9, 20 << 20, 1 << 20, &[])).unwrap();
    assert_eq!(reply(&mut s, 0).0, 0);
    drop(s);
    a.ok(&["export", "stop", "v"]);
    a.ok(&["snapshot", "create", "v", "s2"]);
    a.ok(&["snapshot", "create", "other", "o1"]);

    // The same answer as the admin API's, streamed in pages of at most max_results.
    let (all, sizes) = allocated(&mut c, "node-a/s2", 0, 0).await.unwrap();
    assert_eq!(all, a.diff("v@s2", None));
    assert_eq!(sizes.len(), 1);
    let (paged, sizes) = allocated(&mut c, "node-a/s2", 0, 7).await.unwrap();
    assert_eq!(paged, all);
    assert!(sizes.iter().all(|&n| n <= 7) && sizes.len() >= all.len() / 7, "{sizes:?}");
    let changed = delta(&mut c, "node-a/s1", "node-a/s2", 0, 5).await.unwrap();
    assert_eq!(changed, a.diff("v@s2", Some("s1")));
    assert!(!changed.is_empty());

    // Restarted after the 4th tuple (cut inside the 5th): the rest, exactly, the first tuple
    // ending past the start.
    let cut = changed[4].0 + 512;
    let rest = delta(&mut c, "node-a/s1", "node-a/s2", cut, 0).await.unwrap();
    assert_eq!(rest[0], (cut, changed[4].0 + changed[4].1 - cut));
    assert_eq!(rest[1..], changed[5..]);
    let (tail, _) = allocated(&mut c, "node-a/s2", SIZE as i64, 0).await.unwrap();
    assert!(tail.is_empty(), "nothing at the end");

    // Every byte outside the delta is the same in both snapshots: an incremental copy of the
    // base turns into the target.
    let (base, target) = (read_image(&a, "v@s1", SIZE), read_image(&a, "v@s2", SIZE));
    let mut copy = base.clone();
    for (o, n) in &changed {
        let r = *o as usize..(*o + *n) as usize;
        copy[r.clone()].copy_from_slice(&target[r]);
    }
    assert!(copy == target, "an incremental copy driven by the delta differs from the target");

    // Errors, as the spec names them.
    assert_eq!(allocated(&mut c, "", 0, 0).await.unwrap_err(), Code::InvalidArgument);
    assert_eq!(allocated(&mut c, "node-a/nope", 0, 0).await.unwrap_err(), Code::NotFound);
    assert_eq!(allocated(&mut c, "node-z/s1", 0, 0).await.unwrap_err(), Code::NotFound);
    assert_eq!(allocated(&mut c, "garbage", 0, 0).await.unwrap_err(), Code::NotFound);
    assert_eq!(allocated(&mut c, "node-a/s1", -1, 0).await.unwrap_err(), Code::OutOfRange);
    assert_eq!(allocated(&mut c, "node-a/s1", SIZE as i64 + 1, 0).await.unwrap_err(), Code::OutOfRange);
    assert_eq!(allocated(&mut c, "node-a/s1", 0, -5).await.unwrap_err(), Code::InvalidArgument);
    assert_eq!(delta(&mut c, "", "node-a/s2", 0, 0).await.unwrap_err(), Code::InvalidArgument);
    assert_eq!(delta(&mut c, "node-a/s1", "", 0, 0).await.unwrap_err(), Code::InvalidArgument);
    assert_eq!(delta(&mut c, "node-a/nope", "node-a/s2", 0, 0).await.unwrap_err(), Code::NotFound);
    assert_eq!(
        delta(&mut c, "node-a/o1", "node-a/s2", 0, 0).await.unwrap_err(),
        Code::InvalidArgument,
        "another volume's"
    );
    assert_eq!(
        delta(&mut c, "node-a/s2", "node-a/s1", 0, 0).await.unwrap_err(),
        Code::InvalidArgument,
        "base after target"
    );
    assert_eq!(delta(&mut c, "node-a/s1", "node-a/s2", SIZE as i64 + 4096, 0).await.unwrap_err(), Code::OutOfRange);
}
