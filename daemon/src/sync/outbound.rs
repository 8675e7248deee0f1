//! The sending side of a framed mirror connection: the primary's requests, a member's acks. A
//! frame is queued by the thread that sends it and written by that thread too, at once, while
//! the connection takes it without waiting: no task wakes up for a frame (here a wakeup costs
//! tens of µs of CPU, more than the write). Only what would wait (a full socket buffer) goes to
//! the connection's writer task, which also sends the primary's keepalives; frames queued
//! meanwhile go out after it. A thread may hold its writes for a batch
//! ([`ferrite_engine::Batch`]): what it queued goes out in one write at the batch's end.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use ferrite_proto::ferrite::v1::MirrorMessage;
use prost::Message;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::wire::{KEEPALIVE, put};

/// What a connection's frames are written to.
pub trait Writer: AsyncWrite + Unpin + Send + 'static {}
impl<W: AsyncWrite + Unpin + Send + 'static> Writer for W {}

/// Frames on their way out of one connection.
pub struct Outbound<W> {
    state: Mutex<State<W>>,
    handoff: Mutex<Option<mpsc::UnboundedSender<Handed<W>>>>,
}

/// For the writer task: a write to finish, from where the connection stopped taking it.
type Handed<W> = (W, Vec<u8>, usize);

struct State<W> {
    queued: Vec<u8>,
    /// A written buffer kept for the next frames (no allocation and growth per push).
    spare: Vec<u8>,
    /// None while a thread or the writer task writes: that one looks at `queued` again when done.
    writer: Option<W>,
    /// Why nothing goes out any more, once so.
    ended: Option<String>,
}

impl<W> State<W> {
    /// Keeps a written buffer for the next frames, unless it grew large (a burst of big writes).
    fn keep(&mut self, mut buf: Vec<u8>) {
        if buf.capacity() <= SPARE_MAX {
            buf.clear();
            self.spare = buf;
        }
    }
}

/// The largest written buffer kept for reuse.
const SPARE_MAX: usize = 4 << 20;

impl<W> std::fmt::Debug for Outbound<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock().expect("not poisoned");
        f.debug_struct("Outbound").field("queued", &s.queued.len()).field("ended", &s.ended).finish_non_exhaustive()
    }
}

impl<W: Writer> Outbound<W> {
    /// The outbound side of a connection, and its writer task (on the current runtime), which
    /// sends a keepalive every [`KEEPALIVE`] if `keepalive` (the primary's side); a failed write
    /// ends it, and `failed` hears why.
    pub fn start(w: W, keepalive: bool, failed: impl FnOnce(String) + Send + 'static) -> Arc<Self> {
        let (handoff, handed) = mpsc::unbounded_channel();
        let out = Arc::new(Self {
            state: Mutex::new(State { queued: Vec::new(), spare: Vec::new(), writer: Some(w), ended: None }),
            handoff: Mutex::new(Some(handoff)),
        });
        tokio::spawn(write_handed(Arc::clone(&out), handed, keepalive, failed));
        out
    }

    fn lock(&self) -> MutexGuard<'_, State<W>> {
        self.state.lock().expect("not poisoned")
    }

    /// Queues `m` for the next push.
    pub fn queue(&self, m: &impl Message) {
        put(&mut self.lock().queued, m);
    }

    /// Queues the frame `encode` appends.
    pub fn queue_with(&self, encode: impl FnOnce(&mut Vec<u8>)) {
        encode(&mut self.lock().queued);
    }

    /// Bytes queued behind a write that waits for the connection (none while it takes them).
    pub fn backlog(&self) -> usize {
        self.lock().queued.len()
    }

    /// Writes what is queued: here, while the connection takes it without waiting; the rest
    /// goes to the writer task. An error once nothing goes out any more, saying why.
    pub fn push(&self) -> Result<(), String> {
        loop {
            let (mut w, buf) = {
                let mut s = self.lock();
                if let Some(why) = &s.ended {
                    return Err(why.clone());
                }
                if s.queued.is_empty() {
                    return Ok(());
                }
                let Some(w) = s.writer.take() else { return Ok(()) };
                let spare = std::mem::take(&mut s.spare);
                (w, std::mem::replace(&mut s.queued, spare))
            };
            match write_now(&mut w, &buf) {
                Ok(None) => {
                    let mut s = self.lock();
                    s.writer = Some(w);
                    s.keep(buf);
                }
                Ok(Some(from)) => {
                    let handoff = self.handoff.lock().expect("not poisoned");
                    if handoff.as_ref().is_some_and(|h| h.send((w, buf, from)).is_ok()) {
                        return Ok(());
                    }
                    return Err(self.end("the connection is closed"));
                }
                Err(e) => return Err(self.end(&format!("writing to the member failed: {e}"))),
            }
        }
    }

    /// Nothing goes out from now on (what is being written still is); the writer task shuts the
    /// connection down. Returns why it ended (the first reason given).
    pub fn end(&self, why: &str) -> String {
        let why = self.lock().ended.get_or_insert_with(|| why.to_owned()).clone();
        self.handoff.lock().expect("not poisoned").take();
        why
    }
}

/// Writes `buf` as far as `w` takes it without waiting: None once all of it is written and
/// flushed, else where it stopped (the length of `buf` when only the flush waits).
fn write_now<W: Writer>(w: &mut W, buf: &[u8]) -> std::io::Result<Option<usize>> {
    // Nothing waits on this context: a Pending hands the rest to the writer task, whose own
    // poll registers its waker.
    let mut cx = Context::from_waker(Waker::noop());
    let mut at = 0;
    while at < buf.len() {
        match Pin::new(&mut *w).poll_write(&mut cx, &buf[at..]) {
            Poll::Ready(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => at += n,
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => return Ok(Some(at)),
        }
    }
    match Pin::new(w).poll_flush(&mut cx) {
        Poll::Ready(Ok(())) => Ok(None),
        Poll::Ready(Err(e)) => Err(e),
        Poll::Pending => Ok(Some(buf.len())),
    }
}

/// The writer task: finishes the writes handed to it and sends a keepalive every
/// [`KEEPALIVE`] if `keepalive`; shuts the connection down once it ends.
async fn write_handed<W: Writer>(
    out: Arc<Outbound<W>>,
    mut handed: mpsc::UnboundedReceiver<Handed<W>>,
    keepalive: bool,
    failed: impl FnOnce(String),
) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    let why = loop {
        tokio::select! {
            h = handed.recv() => {
                let Some((mut w, buf, from)) = h else { break None };
                if let Err(e) = async { w.write_all(&buf[from..]).await?; w.flush().await }.await {
                    break Some(out.end(&format!("writing to the member failed: {e}")));
                }
                let mut s = out.lock();
                s.writer = Some(w);
                s.keep(buf);
            }
            _ = tick.tick(), if keepalive => out.queue(&MirrorMessage { seq: 0, op: None }),
        }
        if let Err(why) = out.push() {
            break Some(why);
        }
    };
    let w = out.lock().writer.take();
    if let Some(mut w) = w {
        let _ = w.shutdown().await;
    }
    if let Some(why) = why {
        failed(why);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn msg(seq: u64) -> MirrorMessage {
        MirrorMessage { seq, op: None }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_written_from_any_thread_arrive_in_order_and_a_full_pipe_goes_to_the_task() {
        // A pipe far smaller than what is sent: most pushes find it full.
        let (w, r) = tokio::io::duplex(64);
        let out = Outbound::start(w, true, |why| panic!("{why}"));
        let sender = {
            let out = Arc::clone(&out);
            std::thread::spawn(move || {
                for seq in 1..=500 {
                    out.queue(&msg(seq));
                    out.push().unwrap();
                }
            })
        };
        let mut frames = super::super::wire::Frames::<_, MirrorMessage>::new(r, None);
        for seq in 1..=500 {
            let m = tokio::time::timeout(Duration::from_secs(10), frames.next()).await.unwrap().unwrap().unwrap();
            assert_eq!(m.seq, seq);
        }
        sender.join().unwrap();
        assert_eq!(out.end("done"), "done");
        assert!(out.push().is_err(), "nothing goes out after the end");
        let last = tokio::time::timeout(Duration::from_secs(10), frames.next()).await.unwrap();
        assert_eq!(last, Ok(None), "the writer task shut the connection down");
    }
}
