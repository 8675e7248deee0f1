//! A thread's batch: while it holds one, what it sends (a mirror stream's frames, an NBD
//! connection's replies) is written once, when the batch ends, instead of once per request. A
//! server's loop holds one while it starts a turn's requests (one write to each member for the
//! turn), and a mirror stream's ack reader while it runs the completions of an ack (one write of
//! the client's replies for all the requests the ack answered).

use std::cell::RefCell;
use std::sync::Arc;

thread_local! {
    /// The connections this thread pushes at the end of its batch, while it holds one.
    static HELD: RefCell<Option<Vec<Arc<dyn Push>>>> = const { RefCell::new(None) };
}

/// What a batch pushes at its end: a connection with frames or replies queued.
pub trait Push: Send + Sync {
    fn push_now(&self);
}

/// While it lives, the connections this thread sends on are pushed when it drops, not at each
/// send; nested batches are one.
#[derive(Debug)]
pub struct Batch {
    outermost: bool,
}

impl Batch {
    pub fn hold() -> Self {
        let outermost = HELD.with_borrow_mut(|h| {
            let outermost = h.is_none();
            h.get_or_insert_with(Vec::new);
            outermost
        });
        Self { outermost }
    }

    /// Pushes `p` now, or at the end of this thread's batch if it holds one.
    pub fn push<P: Push + 'static>(p: &Arc<P>) {
        let held = HELD.with_borrow_mut(|h| {
            h.as_mut().map(|held| {
                if !held.iter().any(|q| std::ptr::addr_eq(Arc::as_ptr(q), Arc::as_ptr(p))) {
                    held.push(Arc::clone(p) as Arc<dyn Push>);
                }
            })
        });
        if held.is_none() {
            p.push_now();
        }
    }

    /// Pushes what this thread's batch holds so far (before it waits for an answer to it), and
    /// what those pushes held in turn.
    pub fn flush() {
        while let Some(held) = HELD.with_borrow_mut(|h| h.as_mut().map(std::mem::take)).filter(|h| !h.is_empty()) {
            for p in held {
                p.push_now();
            }
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if self.outermost {
            Self::flush();
            HELD.with_borrow_mut(|h| h.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_pushes_each_connection_once_at_its_end() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        struct Count(AtomicUsize);
        impl Push for Count {
            fn push_now(&self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let c = Arc::new(Count(AtomicUsize::new(0)));
        let n = || c.0.load(Ordering::SeqCst);
        Batch::push(&c);
        assert_eq!(n(), 1, "without a batch, at once");
        {
            let _b = Batch::hold();
            Batch::push(&c);
            Batch::push(&c);
            drop(Batch::hold());
            assert_eq!(n(), 1, "held, also past a nested batch's end");
        }
        assert_eq!(n(), 2, "once for the batch");
        {
            let _b = Batch::hold();
            Batch::push(&c);
            Batch::flush();
            assert_eq!(n(), 3, "before waiting for an answer");
            Batch::push(&c);
        }
        assert_eq!(n(), 4);
    }
}
