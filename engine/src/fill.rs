//! The hook for a volume filled while it serves (an instant restore): before any client request
//! touches a range, the volume's [`Fill`] makes sure the range holds its data. The engine
//! knows nothing of where the data comes from; the daemon implements [`Fill`] over a backup.

use crate::error::Result;

/// Brings ranges of a volume to their final content before client requests touch them.
///
/// Called from the thread running a client request (a read, a write, a trim, an allocation
/// query), before the request does anything, with the range it covers; it may block (fetching
/// the data). Once `fill` returned Ok for a range, the range's content there is durable: a
/// later write to it must never be undone by the filler, even after a crash. An error fails the
/// client's request (EIO), nothing else.
pub trait Fill: Send + Sync + std::fmt::Debug {
    /// Brings [offset, offset+len) to its content before a request that does `access` to it.
    fn fill(&self, offset: u64, len: u64, access: Access) -> Result<()>;

    /// The parts of [offset, offset+len) not filled yet, as (offset, len) in order: an
    /// allocation query reports them as data without waiting for them.
    fn pending(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64)>>;
}

/// What a client request is about to do to the range it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read it, or write part of it: its content must be there.
    Read,
    /// Discard it: where the request covers a whole unit of the filler's, that unit's content
    /// is not needed (it reads as zeros afterwards); the filler may mark it filled instead.
    Trim,
}

/// `runs` (lengths with a value, in order from `offset`) with the ranges of `pending` set to
/// `value`: what an allocation query says of a range not filled yet.
pub(crate) fn overlay<T: Copy + PartialEq>(
    runs: Vec<(u64, T)>,
    offset: u64,
    pending: &[(u64, u64)],
    value: T,
) -> Vec<(u64, T)> {
    if pending.is_empty() {
        return runs;
    }
    let mut out: Vec<(u64, T)> = Vec::with_capacity(runs.len() + 2 * pending.len());
    let mut push = |len: u64, v: T| {
        if len == 0 {
            return;
        }
        match out.last_mut() {
            Some((n, last)) if *last == v => *n += len,
            _ => out.push((len, v)),
        }
    };
    let (mut at, mut p) = (offset, pending.iter().peekable());
    for (len, v) in runs {
        let end = at + len;
        while at < end {
            // Skip pending ranges that end before `at`.
            while p.peek().is_some_and(|&&(o, n)| o + n <= at) {
                p.next();
            }
            match p.peek() {
                Some(&&(o, n)) if o <= at => {
                    let stop = (o + n).min(end);
                    push(stop - at, value);
                    at = stop;
                }
                Some(&&(o, _)) if o < end => {
                    push(o - at, v);
                    at = o;
                }
                _ => {
                    push(end - at, v);
                    at = end;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn pending_ranges_overlay_the_runs() {
        let runs = vec![(4096, false), (8192, true), (4096, false)];
        assert_eq!(super::overlay(runs.clone(), 0, &[], true), runs);
        // One pending range across the first two runs, one inside the last.
        let got = super::overlay(runs, 1 << 20, &[((1 << 20) + 2048, 4096), ((1 << 20) + 14_336, 1024)], true);
        assert_eq!(got, [(2048, false), (10_240, true), (2048, false), (1024, true), (1024, false)]);
    }
}
