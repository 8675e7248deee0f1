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
use std::os::fd::{AsFd, BorrowedFd};

use parking_lot::{Condvar, Mutex};
use rustix::io::Errno;
use rustix::net;

use crate::socket::Socket;
use crate::transmission::Reply;

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
        let mut st = self.state.lock();
        if replies.is_empty() {
            // The rest of a reply written by [`Outbox::try_send`] may wait for a sender.
            if st.queue.is_empty() || st.sender || !may_start {
                return Sent::Written(cost);
            }
            st.sender = true;
            return Sent::StartSender;
        }
        if !st.sender && !may_start && st.queue.is_empty() {
            write_blocking(sock, &replies, 0);
            return Sent::Written(cost);
        }
        let sent = if st.writing || !st.queue.is_empty() { 0 } else { write_nowait(sock, &replies) };
        if sent == replies.iter().map(|r| r.bytes.len()).sum() {
            return Sent::Written(cost);
        }
        st.queue.push_back((replies, sent, cost));
        if st.sender || !may_start {
            // Without a sender, the rest of a reply [`Outbox::try_send`] wrote is ahead: the
            // loop starts one (told so by the writer of that reply).
            self.ready.notify_one();
            return Sent::Queued;
        }
        st.sender = true;
        Sent::StartSender
    }

    /// Writes `replies` now, from any thread, if no reply is ahead of them and the socket takes
    /// some without waiting; gives them back, with nothing written, if not. `Ok(true)` when only
    /// part went out: the rest is queued, and the loop must start a sender for it unless one
    /// runs (the loop's next [`Outbox::send`] does).
    pub fn try_send(&self, fd: BorrowedFd<'_>, mut replies: Vec<Reply>) -> Result<bool, Vec<Reply>> {
        let mut st = self.state.lock();
        if st.writing || st.stop || !st.queue.is_empty() {
            return Err(replies);
        }
        let total: usize = replies.iter().map(|r| r.bytes.len()).sum();
        match write_nowait(fd, &replies) {
            n if n == total => Ok(false),
            0 => Err(replies),
            mut n => {
                // The replies written whole are done; the rest waits from where the socket stopped.
                let whole = replies.iter().take_while(|r| n >= r.bytes.len() && (n -= r.bytes.len(), true).1).count();
                replies.drain(..whole);
                st.queue.push_back((replies, n, (0, 0)));
                self.ready.notify_one();
                Ok(!st.sender)
            }
        }
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
fn write_nowait(fd: impl AsFd, replies: &[Reply]) -> usize {
    let mut bufs = slices(replies, 0);
    let mut view = &mut bufs[..];
    let mut sent = 0;
    while !view.is_empty() {
        let n = view.len().min(MAX_IOV);
        let flags = net::SendFlags::DONTWAIT | net::SendFlags::NOSIGNAL;
        match net::sendmsg(fd.as_fd(), &view[..n], &mut net::SendAncillaryBuffer::default(), flags) {
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

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    use super::*;

    fn reply(byte: u8, len: usize) -> Reply {
        Reply { bytes: vec![byte; len], failed: false }
    }

    #[test]
    fn a_reply_written_in_part_by_another_thread_stays_ahead_of_later_ones() {
        let (sock, mut peer) = UnixStream::pair().unwrap();
        let out = Outbox::default();
        // Far more than the socket buffer: only part of it goes out.
        let big = 4 << 20;
        let first = vec![reply(4, 10), reply(1, big)];
        assert!(matches!(out.try_send(sock.as_fd(), first), Ok(true)), "the loop must start a sender");
        assert!(out.try_send(sock.as_fd(), vec![reply(9, 10)]).is_err(), "nothing overtakes the rest");
        // A helper's reply queues behind it instead of writing.
        assert!(matches!(out.send(&sock, vec![reply(2, 10)], (10, 1), false), Sent::Queued));
        // The loop's next send, with nothing new, starts the sender.
        assert!(matches!(out.send(&sock, Vec::new(), (0, 0), true), Sent::StartSender));
        std::thread::scope(|s| {
            s.spawn(|| out.run_sender(&sock, true, |_| {}));
            let mut got = vec![0u8; 10 + big + 10];
            peer.read_exact(&mut got).unwrap();
            let (first, rest) = got.split_at(10);
            assert!(first.iter().all(|&b| b == 4), "the first reply, whole");
            assert!(rest[..big].iter().all(|&b| b == 1) && rest[big..].iter().all(|&b| b == 2), "out of order");
        });
        let two = vec![reply(3, 10), reply(5, 10)];
        assert!(matches!(out.try_send(sock.as_fd(), two), Ok(false)), "an empty queue: written whole");
    }
}
