//! The receive side of a connection: splits the bytes a client sends into requests with their
//! payloads, however they arrive. No I/O here: the connection receives into [`Inbox::space`]
//! (a buffer that takes in every request the client has sent so far with one receive, or, for
//! a write longer than [`MAX_HELD_WRITE`], the write's own payload) and takes out
//! [`Inbox::next_event`] events. A held write's payload is lent out of the buffer, so a write
//! run at once costs no copy before the engine's.

use std::borrow::Cow;

use crate::handshake::MAX_REQUEST;
use crate::proto::{CMD_DISC, CMD_WRITE, DecodeError, REQUEST_LEN, Request};

/// The buffer's size at first: requests and writes up to nearly 64 KiB.
const SMALL: usize = 64 << 10;
/// Its size once grown ([`Inbox::grow`]): several writes of [`MAX_HELD_WRITE`], so that one
/// receive drains what the socket holds (a Unix socket's sender can queue about 200 KiB; with
/// 64 KiB a 128 KiB write took two receives, and the client two wake-ups).
pub const LARGE: usize = 512 << 10;

/// Longest write whose payload is held in the buffer (once it has room for it); a longer one is
/// received into a buffer of its own, straight from the socket, which the request then keeps.
pub const MAX_HELD_WRITE: u32 = 128 << 10;

/// What the client sent next.
#[derive(Debug, PartialEq, Eq)]
pub enum Event<'a> {
    /// A request, with its whole payload for a write (empty otherwise): lent from the buffer
    /// (until the next call), or a buffer of its own.
    Request(Request, Cow<'a, [u8]>),
    /// A write longer than [`MAX_REQUEST`]: its payload was skipped, so framing holds, and the
    /// request must be refused.
    Oversized(Request),
    /// NBD_CMD_DISC.
    Disconnect,
    /// A header with the wrong magic: framing is lost and the connection must end.
    BadMagic(u32),
}

impl Event<'_> {
    /// The same event, its payload its own.
    pub fn into_owned(self) -> Event<'static> {
        match self {
            Self::Request(r, p) => Event::Request(r, Cow::Owned(p.into_owned())),
            Self::Oversized(r) => Event::Oversized(r),
            Self::Disconnect => Event::Disconnect,
            Self::BadMagic(m) => Event::BadMagic(m),
        }
    }
}

#[derive(Debug)]
enum State {
    /// Between requests: the next header (and a small write's payload) comes into `buf`.
    Header,
    /// Receiving a large write's payload straight into its own buffer.
    Payload { req: Request, data: Vec<u8>, got: usize },
    /// Skipping `left` more bytes of an oversized write's payload.
    Skip { req: Request, left: u64 },
}

/// Received bytes not yet taken (`buf[start..end]`), and where the stream is.
pub struct Inbox {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    state: State,
    /// The request whose header is at `start` was admitted (see [`Inbox::next_event_with`]).
    admitted: bool,
    /// A write that a grown buffer would have held got a buffer of its own.
    short: bool,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("buffered", &(self.end - self.start)).field("state", &self.state).finish()
    }
}

impl Default for Inbox {
    fn default() -> Self {
        let buf = vec![0u8; SMALL].into_boxed_slice();
        Self { buf, start: 0, end: 0, state: State::Header, admitted: false, short: false }
    }
}

impl Inbox {
    /// Where the next bytes from the socket go (never empty); report them with
    /// [`Inbox::received`]. Take every event out with [`Inbox::next_event`] first: the buffer only
    /// has room once what it holds was taken.
    pub fn space(&mut self) -> &mut [u8] {
        if let State::Payload { data, got, .. } = &mut self.state {
            return &mut data[*got..];
        }
        // What is held is at most one partial request: move it to the front once the room
        // behind it is short (a receive then always has a quarter of the buffer or more, and a
        // held request, at most MAX_HELD_WRITE and its header, always fits).
        let cap = self.buf.len();
        if self.start > 0 && (self.start == self.end || cap - self.end < cap / 4) {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        debug_assert!(self.end < cap, "a full buffer always holds a whole event");
        &mut self.buf[self.end..]
    }

    /// Bytes [`Inbox::grow`] would add, once the client sent a write that only a grown buffer
    /// holds; 0 otherwise.
    pub fn growth(&self) -> usize {
        if self.short { LARGE.saturating_sub(self.buf.len()) } else { 0 }
    }

    /// Grows the buffer to [`LARGE`] bytes, keeping what it holds; returns the bytes added. Not
    /// while a receive into [`Inbox::space`] is in flight: the buffer moves.
    pub fn grow(&mut self) -> usize {
        let added = LARGE.saturating_sub(self.buf.len());
        if added > 0 {
            let mut buf = vec![0u8; LARGE].into_boxed_slice();
            buf[..self.end].copy_from_slice(&self.buf[..self.end]);
            self.buf = buf;
        }
        added
    }

    /// `n` bytes were received into the last [`Inbox::space`].
    pub fn received(&mut self, n: usize) {
        match &mut self.state {
            State::Payload { got, .. } => *got += n,
            _ => self.end += n,
        }
    }

    /// The next event, once all of it was received.
    pub fn next_event(&mut self) -> Option<Event<'_>> {
        self.next_event_with(|_| true)
    }

    /// The next event, asking `admit` about each request as soon as its header is here and
    /// before anything is allocated for it. A request refused stays where it is, and is asked
    /// about again by the next call; one admitted is not asked about again.
    pub fn next_event_with(&mut self, mut admit: impl FnMut(&Request) -> bool) -> Option<Event<'_>> {
        loop {
            match &mut self.state {
                State::Payload { data, got, .. } if *got == data.len() => {
                    let State::Payload { req, data, .. } = std::mem::replace(&mut self.state, State::Header) else {
                        unreachable!("matched above")
                    };
                    return Some(Event::Request(req, Cow::Owned(data)));
                }
                State::Payload { .. } => return None,
                State::Skip { req, left } => {
                    let n = (self.end - self.start).min(usize::try_from(*left).unwrap_or(usize::MAX));
                    self.start += n;
                    *left -= n as u64;
                    if *left > 0 {
                        return None;
                    }
                    let req = *req;
                    self.state = State::Header;
                    return Some(Event::Oversized(req));
                }
                State::Header => {}
            }
            let held = &self.buf[self.start..self.end];
            let h: &[u8; REQUEST_LEN] = held.get(..REQUEST_LEN)?.try_into().expect("REQUEST_LEN bytes");
            let req = match Request::decode(h) {
                Ok(r) => r,
                Err(DecodeError::BadMagic(m)) => return Some(Event::BadMagic(m)),
            };
            if req.kind == CMD_DISC {
                self.start += REQUEST_LEN;
                return Some(Event::Disconnect);
            }
            if !self.admitted {
                if !admit(&req) {
                    return None;
                }
                self.admitted = true;
            }
            if req.kind != CMD_WRITE {
                self.start += REQUEST_LEN;
                self.admitted = false;
                return Some(Event::Request(req, Cow::Borrowed(&[])));
            }
            if req.length > MAX_REQUEST {
                self.start += REQUEST_LEN;
                self.admitted = false;
                self.state = State::Skip { req, left: u64::from(req.length) };
                continue;
            }
            let len = req.length as usize;
            let fits = REQUEST_LEN + len <= self.buf.len();
            self.short |= !fits && req.length <= MAX_HELD_WRITE;
            if fits && req.length <= MAX_HELD_WRITE {
                if held.len() < REQUEST_LEN + len {
                    // Held here once the rest of it came.
                    return None;
                }
                let at = self.start + REQUEST_LEN;
                self.start = at + len;
                self.admitted = false;
                return Some(Event::Request(req, Cow::Borrowed(&self.buf[at..at + len])));
            }
            // Its own buffer, with what of it is here already (a grown buffer may hold all of it
            // and more); the rest is received straight into it.
            let mut data = vec![0u8; len];
            let got = (held.len() - REQUEST_LEN).min(len);
            data[..got].copy_from_slice(&held[REQUEST_LEN..REQUEST_LEN + got]);
            self.start += REQUEST_LEN + got;
            self.admitted = false;
            self.state = State::Payload { req, data, got };
        }
    }
}

/// Splits `bytes`, received at most `step` bytes at a time, into the events a connection takes
/// out after each receive, up to a bad header (after which a connection reads nothing more).
/// Returns them (payloads copied out) with the number of receives. For tests and fuzzing.
pub fn split(bytes: &[u8], step: usize) -> (Vec<Event<'static>>, usize) {
    let mut inbox = Inbox::default();
    let (mut events, mut receives, mut at) = (Vec::new(), 0, 0);
    while at < bytes.len() {
        if inbox.growth() > 0 {
            inbox.grow();
        }
        let space = inbox.space();
        let n = space.len().min(step).min(bytes.len() - at);
        space[..n].copy_from_slice(&bytes[at..at + n]);
        inbox.received(n);
        at += n;
        receives += 1;
        while let Some(e) = inbox.next_event() {
            let stop = matches!(e, Event::BadMagic(_));
            events.push(e.into_owned());
            if stop {
                return (events, receives);
            }
        }
    }
    (events, receives)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::CMD_READ;

    fn pattern(i: usize) -> u8 {
        u8::try_from(i % 251).expect("below 251")
    }

    fn req(kind: u16, cookie: u64, length: u32) -> Request {
        Request { flags: 0, kind, cookie, offset: cookie * 4096, length }
    }

    fn ev(r: Request, payload: Vec<u8>) -> Event<'static> {
        Event::Request(r, Cow::Owned(payload))
    }

    #[test]
    fn one_receive_takes_in_many_requests() {
        let bytes: Vec<u8> = (0..32).flat_map(|c| req(CMD_READ, c, 4096).encode()).collect();
        let (events, receives) = split(&bytes, usize::MAX);
        assert_eq!(receives, 1);
        let cookies: Vec<u64> =
            events.iter().map(|e| if let Event::Request(r, _) = e { r.cookie } else { panic!("{e:?}") }).collect();
        assert_eq!(cookies, (0..32).collect::<Vec<_>>());
    }

    #[test]
    fn held_writes_are_lent_from_the_buffer_and_longer_ones_have_their_own() {
        let mut bytes = Vec::new();
        for (cookie, len) in [(1usize, MAX_HELD_WRITE), (2, MAX_HELD_WRITE), (3, MAX_HELD_WRITE + 4096)] {
            bytes.extend_from_slice(&req(CMD_WRITE, u64::try_from(cookie).unwrap(), len).encode());
            bytes.extend((0..len as usize).map(|i| pattern(i + cookie)));
        }
        let mut inbox = Inbox::default();
        let mut first = bytes[..REQUEST_LEN + MAX_HELD_WRITE as usize].to_vec();
        let space = inbox.space();
        let n = space.len();
        space.copy_from_slice(&first[..n]);
        inbox.received(n);
        assert_eq!(inbox.next_event(), None);
        assert_eq!(inbox.growth(), LARGE - SMALL, "a 64 KiB buffer gives a 128 KiB write a buffer of its own");
        first.drain(..n);
        inbox.space()[..first.len()].copy_from_slice(&first);
        inbox.received(first.len());
        assert!(matches!(inbox.next_event(), Some(Event::Request(_, Cow::Owned(_)))));
        assert_eq!(inbox.grow(), LARGE - SMALL);
        assert_eq!(inbox.growth(), 0);
        let (mut at, mut lent) = (REQUEST_LEN + MAX_HELD_WRITE as usize, vec![(1, false)]);
        while at < bytes.len() {
            let space = inbox.space();
            let n = space.len().min(bytes.len() - at);
            space[..n].copy_from_slice(&bytes[at..at + n]);
            inbox.received(n);
            at += n;
            while let Some(Event::Request(r, payload)) = inbox.next_event() {
                let want: Vec<u8> =
                    (0..r.length as usize).map(|i| pattern(i + usize::try_from(r.cookie).unwrap())).collect();
                assert_eq!(*payload, want[..], "request {}", r.cookie);
                lent.push((r.cookie, matches!(payload, Cow::Borrowed(_))));
            }
        }
        assert_eq!(lent, [(1, false), (2, true), (3, false)]);
    }

    #[test]
    fn a_large_write_is_received_into_its_own_buffer() {
        let payload: Vec<u8> = (0..1_000_000).map(pattern).collect();
        let mut bytes = req(CMD_WRITE, 1, 1_000_000).encode().to_vec();
        bytes.extend_from_slice(&payload);
        bytes.extend_from_slice(&req(CMD_READ, 2, 4096).encode());
        let (events, receives) = split(&bytes, usize::MAX);
        assert_eq!(events, [ev(req(CMD_WRITE, 1, 1_000_000), payload), ev(req(CMD_READ, 2, 4096), vec![])]);
        // The buffer's worth, then the rest of the payload in one, then the read.
        assert_eq!(receives, 3);
    }

    #[test]
    fn an_oversized_write_is_skipped_and_the_stream_goes_on() {
        let len = MAX_REQUEST + 1;
        let mut bytes = req(CMD_WRITE, 1, len).encode().to_vec();
        bytes.resize(bytes.len() + len as usize, 7);
        bytes.extend_from_slice(&req(CMD_READ, 2, 4096).encode());
        let (events, _) = split(&bytes, 1 << 20);
        assert_eq!(events, [Event::Oversized(req(CMD_WRITE, 1, len)), ev(req(CMD_READ, 2, 4096), vec![])]);
    }

    #[test]
    fn a_refused_request_stays_until_admitted_and_is_asked_about_once() {
        let mut bytes = req(CMD_READ, 1, 4096).encode().to_vec();
        bytes.extend_from_slice(&req(CMD_WRITE, 2, 8192).encode());
        bytes.extend_from_slice(&[5u8; 4096]); // half of the write's payload
        let mut inbox = Inbox::default();
        inbox.space()[..bytes.len()].copy_from_slice(&bytes);
        inbox.received(bytes.len());
        assert_eq!(inbox.next_event_with(|_| false), None);
        let mut asked = Vec::new();
        let mut admit = |r: &Request| {
            asked.push(r.cookie);
            true
        };
        assert_eq!(inbox.next_event_with(&mut admit), Some(ev(req(CMD_READ, 1, 4096), vec![])));
        assert_eq!(inbox.next_event_with(&mut admit), None, "the write's payload is not all here");
        inbox.space()[..4096].copy_from_slice(&[5u8; 4096]);
        inbox.received(4096);
        assert_eq!(inbox.next_event_with(&mut admit), Some(ev(req(CMD_WRITE, 2, 8192), vec![5u8; 8192])));
        assert_eq!(asked, [1, 2], "each request is admitted once");
    }

    #[test]
    fn disconnect_and_bad_magic_are_events() {
        let mut bytes = req(CMD_DISC, 1, 0).encode().to_vec();
        bytes.extend_from_slice(&[0xAB; REQUEST_LEN]);
        bytes.extend_from_slice(&req(CMD_READ, 2, 4096).encode());
        let (events, _) = split(&bytes, 5);
        assert_eq!(events, [Event::Disconnect, Event::BadMagic(0xABAB_ABAB)]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, failure_persistence: None, ..Default::default() })]

        /// However the bytes arrive, the stream splits into exactly the requests and payloads
        /// that were sent.
        #[test]
        fn framing_does_not_depend_on_how_bytes_arrive(
            reqs in proptest::collection::vec((proptest::bool::ANY, 0u32..150_000), 1..40),
            step in 1usize..200_000,
        ) {
            let mut bytes = Vec::new();
            let mut sent = Vec::new();
            for (i, &(write, len)) in reqs.iter().enumerate() {
                let r = Request { flags: 0, kind: if write { CMD_WRITE } else { CMD_READ }, cookie: i as u64, offset: 0, length: len };
                bytes.extend_from_slice(&r.encode());
                let payload: Vec<u8> = if write { (0..len as usize).map(|j| pattern(i + j)).collect() } else { Vec::new() };
                bytes.extend_from_slice(&payload);
                sent.push(ev(r, payload));
            }
            let (events, _) = split(&bytes, step);
            proptest::prop_assert!(events == sent);
        }

        /// Arbitrary bytes never panic the decoder, and what it takes out never claims more
        /// bytes than came in.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..4096), step in 1usize..300) {
            let (events, _) = split(&bytes, step);
            proptest::prop_assert!(events.len() <= bytes.len() / REQUEST_LEN);
        }
    }
}
