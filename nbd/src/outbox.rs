//! A connection's outgoing replies: written at once as far as the socket takes them without
//! waiting, the rest by the connection's sender thread, in order.
//!
//! The event loop is the only thread that receives requests and starts store reads; a blocking
//! write of a large reply into a full socket would stop both until the client read it (a 1 MiB
//! reply is several socket buffers). With a sender, the loop's write never waits: what the socket
//! has no room for is queued, and the loop goes on receiving and reading while the sender drains
//! it. A reply that fits goes out on the spot, with no hand-off (a queue-depth-1 client pays
//! nothing), and the sender is started the first time one does not (an idle connection has
//! none). Queued replies still hold what their requests were charged (`limits.rs`) until they
//! are written, so a client that does not read its replies stops the loop taking requests, and
//! a write that cannot go on for the socket's send timeout ends the connection.
//!
//! Only a socket whose bytes are the protocol's own gets a sender (a TLS session's records are
//! written by blocking writes, under the same lock, in order).

use std::collections::VecDeque;
use std::io::IoSlice;

use parking_lot::{Condvar, Mutex};
use rustix::io::Errno;
use rustix::net;

use crate::transmission::{Reply, Socket};

/// What a batch of replies cost their requests: (bytes, requests), given back once written.
pub(crate) type Cost = (u64, usize);

/// Most buffers one `sendmsg` takes (`IOV_MAX`).
const MAX_IOV: usize = 1024;

#[derive(Default)]
pub(crate) struct Outbox {
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    /// Replies waiting for the sender, each batch with how many of its bytes went out already.
    queue: VecDeque<(Vec<Reply>, usize, Cost)>,
    /// The sender is writing batches it took from `queue`: nobody else writes meanwhile.
    writing: bool,
    /// A sender runs, or is being started (until `stop`, and the queue is empty).
    sender: bool,
    stop: bool,
}

/// How [`Outbox::send`] went.
#[must_use]
pub(crate) enum Sent {
    /// Written: what the replies cost can be given back.
    Written(Cost),
    /// Queued for the running sender, which gives their cost back.
    Queued,
    /// Queued, and the caller must start the sender ([`Outbox::run_sender`]).
    StartSender,
}

impl Outbox {
    /// Writes `replies` in order after those before. Once a sender runs, never waits: what the
    /// socket has no room for is queued for it. Before, waits for the socket, unless
    /// `may_start` (the loop, which can start the sender): then the rest is queued for a sender
    /// to start (a connection whose replies always fit never has one). Both write to the
    /// descriptor itself: only for a socket whose bytes are the protocol's own.
    pub fn send<S: Socket>(&self, sock: &S, replies: Vec<Reply>, cost: Cost, may_start: bool) -> Sent {
        if replies.is_empty() {
            return Sent::Written(cost);
        }
        let mut st = self.state.lock();
        if !st.sender && !may_start {
            write_blocking(sock, &replies, 0);
            return Sent::Written(cost);
        }
        let sent = if st.writing || !st.queue.is_empty() { 0 } else { write_nowait(sock, &replies) };
        if sent == replies.iter().map(|r| r.bytes.len()).sum() {
            return Sent::Written(cost);
        }
        st.queue.push_back((replies, sent, cost));
        if st.sender {
            self.ready.notify_one();
            return Sent::Queued;
        }
        st.sender = true;
        Sent::StartSender
    }

    /// The sender: writes what was queued, in order, and gives back its cost with `release`;
    /// returns once stopped (see [`Outbox::stop`]) with nothing left to write. Also what the
    /// loop runs when no sender thread can be started: `stop` set, it writes the queue and ends.
    pub fn run_sender<S: Socket>(&self, sock: &S, stop: bool, release: impl Fn(Cost)) {
        let mut st = self.state.lock();
        loop {
            while st.queue.is_empty() && !st.stop && !stop {
                self.ready.wait(&mut st);
            }
            if st.queue.is_empty() {
                // Replies sent from now on (helpers still running) wait for the socket.
                st.sender = false;
                return;
            }
            let batches: Vec<_> = st.queue.drain(..).collect();
            st.writing = true;
            drop(st);
            write_blocking(sock, batches.iter().flat_map(|(r, _, _)| r), batches[0].1);
            for &(_, _, cost) in &batches {
                release(cost);
            }
            st = self.state.lock();
            st.writing = false;
        }
    }

    /// Lets the sender end once the queue is empty.
    pub fn stop(&self) {
        self.state.lock().stop = true;
        self.ready.notify_all();
    }
}

/// The buffers of `replies` from byte `skip` on.
fn slices<'r>(replies: impl IntoIterator<Item = &'r Reply>, skip: usize) -> Vec<IoSlice<'r>> {
    let mut bufs: Vec<IoSlice<'r>> = replies.into_iter().map(|r| IoSlice::new(&r.bytes)).collect();
    let total = bufs.len();
    let mut view = &mut bufs[..];
    // Shortens the first buffer left in place, and says how many are left.
    IoSlice::advance_slices(&mut view, skip);
    let done = total - view.len();
    bufs.drain(..done);
    bufs
}

/// Writes the replies (from byte `skip` on), waiting for the socket as long as its send timeout
/// allows; a failure ends the connection (the loop's receive sees it).
fn write_blocking<'r, S: Socket>(sock: &S, replies: impl IntoIterator<Item = &'r Reply>, skip: usize) {
    if let Err(e) = sock.write_all_vectored(&mut slices(replies, skip)) {
        tracing::debug!(error = %e, "writing an NBD reply failed; ending the connection");
        let _ = net::shutdown(sock.as_fd(), net::Shutdown::Both);
    }
}

/// Writes as much of `replies` as the socket takes without waiting; returns how many bytes. A
/// failure stops it early: the sender's write of the rest meets it again and handles it.
fn write_nowait<S: Socket>(sock: &S, replies: &[Reply]) -> usize {
    let mut bufs = slices(replies, 0);
    let mut view = &mut bufs[..];
    let mut sent = 0;
    while !view.is_empty() {
        let n = view.len().min(MAX_IOV);
        let flags = net::SendFlags::DONTWAIT | net::SendFlags::NOSIGNAL;
        match net::sendmsg(sock.as_fd(), &view[..n], &mut net::SendAncillaryBuffer::default(), flags) {
            Ok(0) => break,
            Ok(k) => {
                sent += k;
                IoSlice::advance_slices(&mut view, k);
            }
            Err(Errno::INTR) => {}
            Err(_) => break,
        }
    }
    sent
}
