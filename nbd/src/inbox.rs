//! The receive side of a connection: splits the bytes a client sends into requests with their
//! payloads, however they arrive. No I/O here: the connection receives into [`Inbox::space`]
//! (a buffer that takes in every request the client has sent so far with one receive, or,
//! for a write too large for it, the write's own payload) and takes out [`Inbox::next_event`] events.

use crate::handshake::MAX_REQUEST;
use crate::proto::{CMD_DISC, CMD_WRITE, DecodeError, REQUEST_LEN, Request};

/// The buffer's size. A write whose header and payload do not fit is received into a payload
/// buffer of its own.
const CAPACITY: usize = 64 << 10;

/// What the client sent next.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// A request, with its whole payload for a write (empty otherwise).
    Request(Request, Vec<u8>),
    /// A write longer than [`MAX_REQUEST`]: its payload was skipped, so framing holds, and the
    /// request must be refused.
    Oversized(Request),
    /// NBD_CMD_DISC.
    Disconnect,
    /// A header with the wrong magic: framing is lost and the connection must end.
    BadMagic(u32),
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
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("buffered", &(self.end - self.start)).field("state", &self.state).finish()
    }
}

impl Default for Inbox {
    fn default() -> Self {
        Self { buf: vec![0u8; CAPACITY].into_boxed_slice(), start: 0, end: 0, state: State::Header, admitted: false }
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
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        debug_assert!(self.end < CAPACITY, "a full buffer always holds a whole event");
        &mut self.buf[self.end..]
    }

    /// `n` bytes were received into the last [`Inbox::space`].
    pub fn received(&mut self, n: usize) {
        match &mut self.state {
            State::Payload { got, .. } => *got += n,
            _ => self.end += n,
        }
    }

    /// The next event, once all of it was received.
    pub fn next_event(&mut self) -> Option<Event> {
        self.next_event_with(|_| true)
    }

    /// The next event, asking `admit` about each request as soon as its header is here and
    /// before anything is allocated for it. A request refused stays where it is, and is asked
    /// about again by the next call; one admitted is not asked about again.
    pub fn next_event_with(&mut self, mut admit: impl FnMut(&Request) -> bool) -> Option<Event> {
        loop {
            match &mut self.state {
                State::Payload { data, got, .. } if *got == data.len() => {
                    let State::Payload { req, data, .. } = std::mem::replace(&mut self.state, State::Header) else {
                        unreachable!("matched above")
                    };
                    return Some(Event::Request(req, data));
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
                return Some(Event::Request(req, Vec::new()));
            }
            if req.length > MAX_REQUEST {
                self.start += REQUEST_LEN;
                self.admitted = false;
                self.state = State::Skip { req, left: u64::from(req.length) };
                continue;
            }
            let len = req.length as usize;
            if let Some(payload) = held.get(REQUEST_LEN..REQUEST_LEN + len) {
                let payload = payload.to_vec();
                self.start += REQUEST_LEN + len;
                self.admitted = false;
                return Some(Event::Request(req, payload));
            }
            if REQUEST_LEN + len <= CAPACITY {
                // The rest of it fits the buffer: wait for it there.
                return None;
            }
            let mut data = vec![0u8; len];
            let got = held.len() - REQUEST_LEN;
            data[..got].copy_from_slice(&held[REQUEST_LEN..]);
            (self.start, self.end) = (0, 0);
            self.admitted = false;
            self.state = State::Payload { req, data, got };
        }
    }
}

/// Splits `bytes`, received at most `step` bytes at a time, into the events a connection takes
/// out after each receive, up to a bad header (after which a connection reads nothing more).
/// Returns them with the number of receives. For tests and fuzzing.
pub fn split(bytes: &[u8], step: usize) -> (Vec<Event>, usize) {
    let mut inbox = Inbox::default();
    let (mut events, mut receives, mut at) = (Vec::new(), 0, 0);
    while at < bytes.len() {
        let space = inbox.space();
        let n = space.len().min(step).min(bytes.len() - at);
        space[..n].copy_from_slice(&bytes[at..at + n]);
        inbox.received(n);
        at += n;
        receives += 1;
        while let Some(e) = inbox.next_event() {
            let stop = matches!(e, Event::BadMagic(_));
            events.push(e);
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
    fn a_large_write_is_received_into_its_own_buffer() {
        let payload: Vec<u8> = (0..1_000_000).map(pattern).collect();
        let mut bytes = req(CMD_WRITE, 1, 1_000_000).encode().to_vec();
        bytes.extend_from_slice(&payload);
        bytes.extend_from_slice(&req(CMD_READ, 2, 4096).encode());
        let (events, receives) = split(&bytes, usize::MAX);
        assert_eq!(
            events,
            [Event::Request(req(CMD_WRITE, 1, 1_000_000), payload), Event::Request(req(CMD_READ, 2, 4096), vec![])]
        );
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
        assert_eq!(events, [Event::Oversized(req(CMD_WRITE, 1, len)), Event::Request(req(CMD_READ, 2, 4096), vec![])]);
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
        assert_eq!(inbox.next_event_with(&mut admit), Some(Event::Request(req(CMD_READ, 1, 4096), vec![])));
        assert_eq!(inbox.next_event_with(&mut admit), None, "the write's payload is not all here");
        inbox.space()[..4096].copy_from_slice(&[5u8; 4096]);
        inbox.received(4096);
        assert_eq!(inbox.next_event_with(&mut admit), Some(Event::Request(req(CMD_WRITE, 2, 8192), vec![5u8; 8192])));
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
                sent.push(Event::Request(r, payload));
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
