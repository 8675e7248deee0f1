//! The receive side of a connection: a buffer in front of the socket, so one `read` syscall
//! takes in every request the client has sent so far (a client at queue depth 32 often has
//! several queued), and the worker that reads one request can see, without blocking, whether
//! more are already here.

use std::io;

use crate::proto::{CMD_WRITE, REQUEST_LEN, Request};

/// Bytes taken from the socket per read. Payloads at least half this long skip the buffer.
const CAPACITY: usize = 64 << 10;

/// What a socket must offer the inbox: plain reads of whatever is available.
pub trait Source {
    /// Reads at most `buf.len()` bytes; 0 means the peer closed its side.
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize>;
}

/// Buffered bytes from the socket: `buf[start..end]` not yet consumed.
pub struct Inbox {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("buffered", &(self.end - self.start)).finish()
    }
}

impl Default for Inbox {
    fn default() -> Self {
        Self { buf: vec![0u8; CAPACITY].into_boxed_slice(), start: 0, end: 0 }
    }
}

impl Inbox {
    /// Fills `out` completely, from the buffer first, then from the socket. An end of stream
    /// before `out` is full is `UnexpectedEof`.
    pub fn read_exact(&mut self, sock: &impl Source, out: &mut [u8]) -> io::Result<()> {
        let mut at = self.take(out);
        while at < out.len() {
            let rest = &mut out[at..];
            let n = if rest.len() >= CAPACITY / 2 {
                read(sock, rest)?
            } else {
                // Empty (take() drained it) until the read succeeds.
                (self.start, self.end) = (0, 0);
                self.end = read(sock, &mut self.buf)?;
                self.take(rest)
            };
            at += n;
        }
        Ok(())
    }

    /// The next request and its payload (a write's), if all of it is already buffered and
    /// `want` accepts it; it is then consumed. A header that does not decode is left for
    /// [`Inbox::read_exact`].
    pub fn next_buffered(&mut self, want: impl Fn(&Request) -> bool) -> Option<(Request, Vec<u8>)> {
        let held = self.buf.get(self.start..self.end)?;
        let h: &[u8; REQUEST_LEN] = held.get(..REQUEST_LEN)?.try_into().ok()?;
        let req = Request::decode(h).ok().filter(|r| want(r))?;
        let len = if req.kind == CMD_WRITE { usize::try_from(req.length).ok()? } else { 0 };
        let payload = held.get(REQUEST_LEN..REQUEST_LEN + len)?.to_vec();
        self.start += REQUEST_LEN + len;
        Some((req, payload))
    }

    /// True when nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Copies buffered bytes into the front of `out`; returns how many.
    fn take(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        n
    }
}

/// One read from the socket, retried on EINTR; 0 bytes is `UnexpectedEof`.
fn read(sock: &impl Source, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match sock.read_some(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// Hands out its bytes in reads of at most `step` bytes.
    struct Chunked {
        data: RefCell<Vec<u8>>,
        step: usize,
        reads: RefCell<usize>,
    }

    impl Source for Chunked {
        fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
            *self.reads.borrow_mut() += 1;
            let mut data = self.data.borrow_mut();
            let n = buf.len().min(self.step).min(data.len());
            buf[..n].copy_from_slice(&data[..n]);
            data.drain(..n);
            Ok(n)
        }
    }

    fn pattern(i: usize) -> u8 {
        u8::try_from(i % 251).expect("below 251")
    }

    fn req(kind: u16, cookie: u64) -> Request {
        Request { flags: 0, kind, cookie, offset: cookie * 4096, length: 4096 }
    }

    #[test]
    fn reads_across_refills_and_sees_buffered_requests() {
        let mut bytes = Vec::new();
        for c in 0..3 {
            bytes.extend_from_slice(&req(crate::proto::CMD_READ, c).encode());
        }
        bytes.extend_from_slice(&req(crate::proto::CMD_WRITE, 3).encode());
        let payload: Vec<u8> = (0..100_000).map(pattern).collect();
        bytes.extend_from_slice(&payload);
        let sock = Chunked { data: RefCell::new(bytes), step: 50, reads: RefCell::new(0) };
        let mut inbox = Inbox::default();
        let mut h = [0u8; REQUEST_LEN];
        inbox.read_exact(&sock, &mut h).unwrap();
        assert_eq!(Request::decode(&h).unwrap().cookie, 0);
        // 50 bytes came in: the second header is only partly here.
        assert_eq!(inbox.next_buffered(|_| true), None);
        inbox.read_exact(&sock, &mut h).unwrap();
        assert_eq!(Request::decode(&h).unwrap().cookie, 1);
        // The refill for it brought in all of the third header and part of the fourth.
        let is_read = |r: &Request| r.kind == crate::proto::CMD_READ;
        assert_eq!(inbox.next_buffered(is_read).map(|r| r.0.cookie), Some(2));
        assert_eq!(inbox.next_buffered(is_read), None);
        inbox.read_exact(&sock, &mut h).unwrap();
        assert_eq!(Request::decode(&h).unwrap().kind, crate::proto::CMD_WRITE);
        let mut got = vec![0u8; payload.len()];
        inbox.read_exact(&sock, &mut got).unwrap();
        assert_eq!(got, payload);
        assert_eq!(inbox.read_exact(&sock, &mut h).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn one_read_takes_in_many_requests() {
        let mut bytes = Vec::new();
        for c in 0..32 {
            bytes.extend_from_slice(&req(crate::proto::CMD_READ, c).encode());
        }
        let sock = Chunked { data: RefCell::new(bytes), step: usize::MAX, reads: RefCell::new(0) };
        let mut inbox = Inbox::default();
        let mut h = [0u8; REQUEST_LEN];
        inbox.read_exact(&sock, &mut h).unwrap();
        let rest: Vec<u64> = std::iter::from_fn(|| inbox.next_buffered(|_| true)).map(|r| r.0.cookie).collect();
        assert_eq!(rest, (1..32).collect::<Vec<_>>());
        assert_eq!(*sock.reads.borrow(), 1);
    }

    #[test]
    fn a_write_is_taken_only_with_all_of_its_payload() {
        let mut bytes = req(crate::proto::CMD_READ, 0).encode().to_vec();
        for (cookie, len) in [(1u64, 100u32), (2, 100_000)] {
            bytes.extend_from_slice(&Request { flags: 0, kind: CMD_WRITE, cookie, offset: 0, length: len }.encode());
            bytes.extend((0..len as usize).map(pattern));
        }
        let sock = Chunked { data: RefCell::new(bytes), step: usize::MAX, reads: RefCell::new(0) };
        let mut inbox = Inbox::default();
        let mut h = [0u8; REQUEST_LEN];
        inbox.read_exact(&sock, &mut h).unwrap();
        let (w, payload) = inbox.next_buffered(|_| true).unwrap();
        assert_eq!((w.cookie, payload.len()), (1, 100));
        assert!(payload.iter().enumerate().all(|(i, &b)| b == pattern(i)));
        // The second write's payload is not all here yet: it stays for the blocking reader.
        assert_eq!(inbox.next_buffered(|_| true), None);
        inbox.read_exact(&sock, &mut h).unwrap();
        assert_eq!(Request::decode(&h).unwrap().cookie, 2);
        let mut payload = vec![0u8; 100_000];
        inbox.read_exact(&sock, &mut payload).unwrap();
        assert!(payload.iter().enumerate().all(|(i, &b)| b == pattern(i)));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, failure_persistence: None, ..Default::default() })]

        /// However the bytes arrive, and whichever requests are taken from the buffer rather
        /// than read, the stream splits into exactly the requests and payloads that were sent.
        #[test]
        fn framing_does_not_depend_on_how_bytes_arrive(
            reqs in proptest::collection::vec((proptest::bool::ANY, 0u32..70_000), 1..40),
            step in 1usize..100_000,
            take_buffered in proptest::bool::ANY,
        ) {
            let mut bytes = Vec::new();
            let mut sent = Vec::new();
            for (i, &(write, len)) in reqs.iter().enumerate() {
                let kind = if write { CMD_WRITE } else { crate::proto::CMD_READ };
                let r = Request { flags: 0, kind, cookie: i as u64, offset: 0, length: len };
                bytes.extend_from_slice(&r.encode());
                let payload: Vec<u8> = if write { (0..len as usize).map(|j| pattern(i + j)).collect() } else { Vec::new() };
                bytes.extend_from_slice(&payload);
                sent.push((r, payload));
            }
            let sock = Chunked { data: RefCell::new(bytes), step, reads: RefCell::new(0) };
            let mut inbox = Inbox::default();
            let mut got = Vec::new();
            while got.len() < sent.len() {
                let mut h = [0u8; REQUEST_LEN];
                inbox.read_exact(&sock, &mut h).unwrap();
                let r = Request::decode(&h).unwrap();
                let mut payload = vec![0u8; if r.kind == CMD_WRITE { r.length as usize } else { 0 }];
                inbox.read_exact(&sock, &mut payload).unwrap();
                got.push((r, payload));
                if take_buffered {
                    got.extend(std::iter::from_fn(|| inbox.next_buffered(|_| true)));
                }
            }
            proptest::prop_assert!(got == sent);
            proptest::prop_assert!(inbox.is_empty());
            let mut h = [0u8; 1];
            proptest::prop_assert_eq!(inbox.read_exact(&sock, &mut h).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        }
    }

    /// Delivers its bytes in one read, then fails every read after.
    struct Failing(RefCell<Option<Vec<u8>>>);

    impl Source for Failing {
        fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
            let data = self.0.borrow_mut().take().ok_or_else(|| io::Error::other("connection reset"))?;
            buf[..data.len()].copy_from_slice(&data);
            Ok(data.len())
        }
    }

    #[test]
    fn a_failed_read_leaves_nothing_buffered() {
        let sock = Failing(RefCell::new(Some(req(crate::proto::CMD_READ, 0).encode()[..20].to_vec())));
        let mut inbox = Inbox::default();
        let mut h = [0u8; REQUEST_LEN];
        assert_eq!(inbox.read_exact(&sock, &mut h).unwrap_err().to_string(), "connection reset");
        assert!(inbox.is_empty(), "stale bytes would be read as the next request");
    }

    #[test]
    fn a_bad_header_is_left_for_the_reader() {
        let mut bytes = req(crate::proto::CMD_READ, 0).encode().to_vec();
        bytes.extend_from_slice(&[0xAB; REQUEST_LEN]);
        let sock = Chunked { data: RefCell::new(bytes), step: usize::MAX, reads: RefCell::new(0) };
        let mut inbox = Inbox::default();
        let mut h = [0u8; REQUEST_LEN];
        inbox.read_exact(&sock, &mut h).unwrap();
        assert_eq!(inbox.next_buffered(|_| true), None);
        inbox.read_exact(&sock, &mut h).unwrap();
        assert_eq!(h, [0xAB; REQUEST_LEN]);
    }
}
