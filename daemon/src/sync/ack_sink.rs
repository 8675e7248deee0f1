//! Where a member's acks go: the gRPC stream's channel, or the framed connection's sending side
//! ([`Outbound`]) written by whichever thread finished the request. On a framed connection the
//! stream's task applies a batch of requests and writes one cumulative ack for it just before it
//! waits for more (the connection's buffer holds no whole request then): no task hop and one
//! write per batch, where an ack writer task took a wakeup per batch (a context switch in this
//! nested VM costs more than the ack). Requests finished on the blocking pool ack at once, from
//! their thread.
//!
//! Order is what keeps acks true: a failure is queued before its request leaves the running set
//! ([`super::applied`]), and a cumulative ack is computed after that, so none that covers a
//! failed request goes out ahead of its failure. Cumulative acks may pass each other (the primary
//! answers through the highest).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::outbound::Outbound;
use crate::base::error::Error;
use ferrite_proto::ferrite::v1::MirrorAck;
use tokio::io::AsyncWrite;
use tokio::sync::mpsc;

type Out = Outbound<Box<dyn AsyncWrite + Unpin + Send>>;

/// The most ack bytes a member queues behind a connection the primary does not read.
pub const MAX_BACKLOG: usize = 256 << 10;

#[derive(Clone, Debug)]
pub enum AckSink {
    /// The gRPC stream's body: every ack as it comes.
    Stream(mpsc::Sender<Result<MirrorAck, Error>>),
    /// A framed connection.
    Framed(Arc<Framed>),
}

#[derive(Debug)]
pub struct Framed {
    out: Arc<Out>,
    /// The highest cumulative ack held for the stream's next flush (0: none).
    through: AtomicU64,
}

impl AckSink {
    /// The sink of a framed connection's writing half.
    pub fn framed(w: impl AsyncWrite + Unpin + Send + 'static) -> Self {
        let out = Outbound::start(Box::new(w) as Box<dyn AsyncWrite + Unpin + Send>, false, |_| {});
        Self::Framed(Arc::new(Framed { out, through: AtomicU64::new(0) }))
    }

    /// An ack from the stream's own task: a cumulative one waits for [`AckSink::flush`], any
    /// other goes out now (after what is held). False once the connection is gone.
    pub async fn send(&self, a: MirrorAck) -> bool {
        match self {
            Self::Stream(tx) => tx.send(Ok(a)).await.is_ok(),
            Self::Framed(f) if a.through > 0 => {
                f.through.fetch_max(a.through, Ordering::SeqCst);
                true
            }
            Self::Framed(f) => f.write(Some(a)),
        }
    }

    /// An ack from a thread of the blocking pool: goes out now.
    pub fn send_blocking(&self, a: MirrorAck) -> bool {
        match self {
            Self::Stream(tx) => tx.blocking_send(Ok(a)).is_ok(),
            Self::Framed(f) if a.through > 0 => {
                f.through.fetch_max(a.through, Ordering::SeqCst);
                f.write(None)
            }
            Self::Framed(f) => f.write(Some(a)),
        }
    }

    /// The stream's task is about to wait for requests: the ack it holds goes out.
    pub fn flush(&self) -> bool {
        match self {
            Self::Stream(_) => true,
            Self::Framed(f) => f.through.load(Ordering::SeqCst) == 0 || f.write(None),
        }
    }

    /// Waits while the acks queued behind a write the primary does not read pass
    /// [`MAX_BACKLOG`]: the stream's task then reads no further requests, so a primary that
    /// sends without reading its acks is held back by its own socket (and a member's memory
    /// stays bounded) instead of growing the queue.
    pub async fn room(&self) {
        if let Self::Framed(f) = self {
            while f.out.backlog() > MAX_BACKLOG && f.out.push().is_ok() {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
    }

    /// The stream ends with `e`: its last ack says why.
    pub async fn fail(&self, e: Error) {
        match self {
            Self::Stream(tx) => drop(tx.send(Err(e)).await),
            Self::Framed(f) => {
                f.write(Some(MirrorAck { seq: 0, error: e.message().to_owned(), through: 0 }));
                f.out.end("the stream ended");
            }
        }
    }

    /// Nothing goes out any more: the connection is shut down once what was queued is written.
    pub fn close(&self) {
        if let Self::Framed(f) = self {
            f.out.end("the stream ended");
        }
    }
}

impl Framed {
    /// Writes the cumulative ack held, then `a`.
    fn write(&self, a: Option<MirrorAck>) -> bool {
        let through = self.through.swap(0, Ordering::SeqCst);
        if through > 0 {
            self.out.queue(&MirrorAck { seq: 0, error: String::new(), through });
        }
        if let Some(a) = a {
            self.out.queue(&a);
        }
        self.out.push().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::wire::Frames;
    use super::*;

    #[tokio::test]
    async fn cumulative_acks_wait_for_the_flush_and_others_go_out_behind_them() {
        let (w, r) = tokio::io::duplex(1 << 16);
        let sink = AckSink::framed(w);
        let mut frames = Frames::<_, MirrorAck>::new(r, None);
        let through = |n| MirrorAck { seq: 0, error: String::new(), through: n };
        assert!(sink.send(through(3)).await && sink.send(through(5)).await);
        let nothing = tokio::time::timeout(Duration::from_millis(50), frames.next()).await;
        assert!(nothing.is_err(), "a cumulative ack waits for the flush: {nothing:?}");
        // A failure goes out at once, behind the cumulative ack held before it.
        assert!(sink.send(MirrorAck { seq: 7, error: "disk full".into(), through: 0 }).await);
        assert_eq!(frames.next().await.unwrap().unwrap(), through(5));
        assert_eq!(frames.next().await.unwrap().unwrap().seq, 7);
        assert!(sink.send(through(9)).await && sink.flush());
        assert_eq!(frames.next().await.unwrap().unwrap(), through(9));
        let s = sink.clone();
        assert!(tokio::task::spawn_blocking(move || s.send_blocking(through(10))).await.unwrap());
        assert_eq!(frames.next().await.unwrap().unwrap(), through(10), "from the blocking pool: at once");
        // A primary that does not read its acks: the sink stops taking more at its backlog.
        let (w, _unread) = tokio::io::duplex(64);
        let stuck = AckSink::framed(w);
        let mut n = 0;
        while tokio::time::timeout(Duration::from_millis(20), stuck.room()).await.is_ok() {
            n += 1;
            assert!(stuck.send(through(n)).await && stuck.flush());
            assert!(n < 1_000_000, "the backlog never filled");
        }
        let AckSink::Framed(f) = &stuck else { unreachable!() };
        assert!(f.out.backlog() > MAX_BACKLOG && f.out.backlog() < MAX_BACKLOG + 64, "{}", f.out.backlog());
        sink.fail(Error::internal("a damaged frame")).await;
        assert_eq!(frames.next().await.unwrap().unwrap().error, "a damaged frame");
        assert_eq!(frames.next().await, Ok(None), "then the connection is shut down");
        assert!(!sink.send_blocking(through(11)), "nothing goes out after the end");
    }
}
