//! Room at the log head: the head segment while a batch fits, else a fresh segment, recorded
//! durably in the segment chain before anything is written there.

use crate::error::{Error, ErrorKind, Result};
use crate::map::segments::SegState;
use crate::pool::Inner;
use crate::state::LogPos;

/// Finds room for `len` bytes at the log head, opening a new segment if needed (recording the
/// move durably first). Returns where the batch goes.
pub(crate) fn reserve_room(inner: &Inner, len: u64, may_use_reserve: bool) -> Result<LogPos> {
    let seg_size = inner.sb.segment_size;
    // Once the cleaner's moves have dipped into the reserve, the head they opened is theirs:
    // client writes sharing it would spend the reserve a segment at a time until the cleaner
    // could not finish its victim (and nothing could ever free space again). They wait instead.
    // (Counting free segments is a scan: only done while the head came from the reserve.)
    let (head, head_is_open, reserve_dipped) = {
        let st = inner.state.read();
        let dipped = st.head_in_reserve && st.segs.count(SegState::Free) < inner.opts.reserve_segments;
        (st.applied, st.segs.segs[st.applied.seg].state == SegState::Open, dipped)
    };
    if head_is_open && head.off + len <= seg_size && (may_use_reserve || !reserve_dipped) {
        return Ok(head);
    }
    let reserve = if may_use_reserve { 0 } else { inner.opts.reserve_segments };
    let (mut seg, free_left) = {
        let mut st = inner.state.write();
        let seg = st.segs.take_free(reserve);
        (seg, st.segs.count(SegState::Free) as u64)
    };
    if free_left < crate::maint::cleaner::low_water(inner) {
        inner.cleaner.kick();
    }
    if seg.is_none() && inner.state.read().segs.any_empty_sealed(&inner.pins) {
        // Empty segments are waiting for a checkpoint to release them.
        inner.checkpoint()?;
        seg = inner.state.write().segs.take_free(reserve);
    }
    // Out of space with dead space left: clean here, on the leader, rather than fail a write
    // the cleaner could make room for (its moves may use the reserve); each victim frees its
    // dead fraction, so it may take several. Not while the background cleaner runs: two
    // cleaners moving at once could together spend the whole reserve before either victim is
    // released, and the background one needs the leader for its moves. The write fails with
    // NoSpace instead, and the volume retries it once the cleaner has made room.
    let background_busy = inner.cleaner.stats.active.load(std::sync::atomic::Ordering::Acquire);
    if seg.is_none() && !may_use_reserve && inner.opts.background_cleaner && !background_busy {
        for _ in 0..64 {
            if !crate::maint::cleaner::clean_inline(inner)? {
                break;
            }
            seg = inner.state.write().segs.take_free(reserve);
            if seg.is_some() {
                break;
            }
        }
    }
    let Some(seg) = seg else {
        inner.cleaner.kick();
        return Err(Error::new(ErrorKind::NoSpace, "pool is full: no free segment for new writes"));
    };
    // Inline cleaning wrote its moves as batches of their own, which may have moved the head
    // (into a fresh segment, with a later sequence number): continue from where it is now.
    let (head, head_is_open) = {
        let mut st = inner.state.write();
        let head = st.applied;
        let open = st.segs.segs[head.seg].state == SegState::Open;
        if head.seg != seg && open && head.off + len <= seg_size {
            st.segs.segs[seg].state = SegState::Free; // not needed after all
            return Ok(head);
        }
        (head, open)
    };
    let ready = inner
        .backend
        .allocate(inner.sb.segment_offset(seg, 0), seg_size)
        .map_err(|e| Error::io(format!("allocating segment {seg}"), e))
        .and_then(|()| inner.meta.put_chain(head.seq, seg as u64));
    let mut st = inner.state.write();
    if let Err(e) = ready {
        st.segs.segs[seg].state = SegState::Free;
        return Err(e);
    }
    debug_assert_eq!(st.applied, head, "only the leader moves the head");
    if head_is_open {
        st.segs.segs[head.seg].state = SegState::Sealed;
    }
    st.applied = LogPos { seq: head.seq, seg, off: 0 };
    st.head_in_reserve = st.segs.count(SegState::Free) < inner.opts.reserve_segments;
    Ok(st.applied)
}
