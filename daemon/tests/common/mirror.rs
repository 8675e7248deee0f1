//! What the synchronous-replica tests send a member as a peer would: memberships and a mirror
//! stream's first write.

use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::mirror_client::MirrorClient;
use ferrite_proto::ferrite::v1::mirror_message::Op;

/// A membership of `volume` (16 MiB) at `generation`, `members` as (endpoint, state).
pub fn membership(volume: &str, generation: u64, primary: &str, members: &[(&str, &str)]) -> pb::Membership {
    pb::Membership {
        volume: volume.into(),
        generation,
        primary: primary.into(),
        members: members
            .iter()
            .map(|(e, s)| pb::Member { endpoint: (*e).into(), state: (*s).into(), ..Default::default() })
            .collect(),
        size: 16 << 20,
        ..Default::default()
    }
}

/// Opens a mirror stream of `volume` at `generation` and sends one write: the first answer.
pub async fn stream_write(
    c: &mut MirrorClient<tonic::transport::Channel>,
    volume: &str,
    generation: u64,
) -> tonic::Status {
    let open = pb::MirrorMessage {
        seq: 0,
        op: Some(Op::Open(pb::MirrorOpen { volume: volume.into(), generation, ..Default::default() })),
    };
    let data = prost::bytes::Bytes::from(vec![7u8; 4096]);
    let write = pb::MirrorMessage {
        seq: 1,
        op: Some(Op::Write(pb::MirrorWrite { offset: 0, crc: crc32c::crc32c(&data), data, fua: false })),
    };
    match c.stream(tokio_stream::iter(vec![open, write])).await {
        Err(e) => e,
        Ok(r) => match r.into_inner().message().await {
            Ok(m) => tonic::Status::ok(format!("{m:?}")),
            Err(e) => e,
        },
    }
}

/// The state of `member` in `d`'s view of synchronous volume `volume` ("none": not a member).
pub fn state_of(d: &super::Daemon, volume: &str, member: &str) -> String {
    let s = d.json(&["replica", "status", volume]);
    let m = s["members"].as_array().unwrap().iter().find(|m| m["endpoint"] == member).cloned();
    m.map_or("none".into(), |m| m["state"].as_str().unwrap().to_owned())
}
