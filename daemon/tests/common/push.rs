//! Hand-built pushes for the `Replica` service: what a peer (honest or not) sends.

use ferrite_proto::ferrite::v1::push_message::Msg;
use ferrite_proto::ferrite::v1::replica_client::ReplicaClient;
use ferrite_proto::ferrite::v1::{PushBegin, PushCommit, PushData, PushMessage};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// `len` bytes of a pattern made from `seed`.
pub fn bytes(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|i| u8::try_from(i % 256).unwrap().wrapping_mul(31).wrapping_add(seed)).collect()
}

/// A data piece of `bytes(seed, len)` at `offset`, with its crcs.
pub fn data(seed: u8, offset: u64, len: u64) -> PushMessage {
    let data = bytes(seed, len);
    let crcs = ferrite_replication::block_crcs(&data);
    PushMessage { msg: Some(Msg::Data(PushData { offset, data, crcs })) }
}

pub fn begin(b: PushBegin) -> PushMessage {
    PushMessage { msg: Some(Msg::Begin(b)) }
}

pub fn commit() -> PushMessage {
    PushMessage { msg: Some(Msg::Commit(PushCommit {})) }
}

/// Pushes `msgs` (the stream ends after them); the snapshot it brought, or the refusal.
pub async fn push(c: &Channel, msgs: Vec<PushMessage>) -> Result<String, tonic::Status> {
    let (tx, rx) = tokio::sync::mpsc::channel(msgs.len().max(1));
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    drop(tx);
    ReplicaClient::new(c.clone()).push(ReceiverStream::new(rx)).await.map(|r| r.into_inner().snapshot)
}
