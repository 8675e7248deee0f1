//! Room at the log head: the head segment while a batch fits, else a fresh segment, noted in
//! the segment chain before anything is written there (durable with the next store sync or
//! checkpoint: see `Meta::note_chain`).

use crate::ctx::{Ctx, FaultPoint};
use crate::error::{Error, ErrorKind, Result};
use crate::map::segments::SegState;
use crate::state::LogPos;
use crate::write::Log;

/// What the write path may ask of background work when the head needs a segment and none is
/// free. Implemented by the cleaner (`maint`), handed to the log when the pool opens: the write
/// path knows no cleaner internals.
pub(crate) trait MakeRoom: Send + Sync + std::fmt::Debug {
    /// Takes a checkpoint, which releases sealed segments nothing maps any more.
    fn checkpoint(&self, ctx: &Ctx, log: &Log) -> Result<()>;
    /// On the leader: cleans one victim and checkpoints so it comes free; false once no victim
    /// is left.
    fn clean_one(&self, ctx: &Ctx, log: &Log) -> Result<bool>;
    /// Whether the background cleaner is running now.
    fn cleaning(&self) -> bool;
}

/// Finds room for `len` bytes at the log head, opening a new segment if needed (noting the
/// move in the chain first). Returns where the batch goes.
pub(crate) fn reserve_room(ctx: &Ctx, log: &Log, len: u64, may_use_reserve: bool) -> Result<LogPos> {
    let seg_size = ctx.sb.segment_size;
    // Once the cleaner's moves have dipped into the reserve, the head they opened is theirs:
    // client writes sharing it would spend the reserve a segment at a time until the cleaner
    // could not finish its victim (and nothing could ever free space again). They wait instead.
    // (Counting free segments is a scan: only done while the head came from the reserve.)
    let (head, head_is_open, reserve_dipped) = {
        let st = ctx.state.read();
        let dipped = st.head_in_reserve && st.segs.count(SegState::Free) < ctx.opts.reserve_segments;
        (st.applied, st.segs.segs[st.applied.seg].state == SegState::Open, dipped)
    };
    if head_is_open && head.off + len <= seg_size && (may_use_reserve || !reserve_dipped) {
        return Ok(head);
    }
    let reserve = if may_use_reserve { 0 } else { ctx.opts.reserve_segments };
    let (mut seg, free_left) = {
        let mut st = ctx.state.write();
        let seg = st.segs.take_free(reserve);
        (seg, st.segs.count(SegState::Free) as u64)
    };
    if free_left < ctx.low_water() {
        ctx.wake.cleaner.raise();
    }
    if seg.is_none() && ctx.state.read().segs.any_empty_sealed(&ctx.pins) {
        // Empty segments are waiting for a checkpoint to release them.
        log.room.checkpoint(ctx, log)?;
        seg = ctx.state.write().segs.take_free(reserve);
    }
    // Out of space with dead space left: clean here, on the leader, rather than fail a write
    // the cleaner could make room for (its moves may use the reserve); each victim frees its
    // dead fraction, so it may take several. Not while the background cleaner runs: two
    // cleaners moving at once could together spend the whole reserve before either victim is
    // released, and the background one needs the leader for its moves. The write fails with
    // NoSpace instead, and the volume retries it once the cleaner has made room.
    let background_busy = log.room.cleaning();
    if seg.is_none() && !may_use_reserve && ctx.opts.background_cleaner && !background_busy {
        for _ in 0..64 {
            if !log.room.clean_one(ctx, log)? {
                break;
            }
            seg = ctx.state.write().segs.take_free(reserve);
            if seg.is_some() {
                break;
            }
        }
    }
    let Some(seg) = seg else {
        ctx.wake.cleaner.raise();
        return Err(Error::new(ErrorKind::NoSpace, "pool is full: no free segment for new writes"));
    };
    // Inline cleaning wrote its moves as batches of their own, which may have moved the head
    // (into a fresh segment, with a later sequence number): continue from where it is now.
    let (head, head_is_open) = {
        let mut st = ctx.state.write();
        let head = st.applied;
        let open = st.segs.segs[head.seg].state == SegState::Open;
        if head.seg != seg && open && head.off + len <= seg_size {
            st.segs.segs[seg].state = SegState::Free; // not needed after all
            return Ok(head);
        }
        (head, open)
    };
    let ready = ctx
        .backend
        .allocate(ctx.sb.segment_offset(seg, 0), seg_size)
        .map_err(|e| Error::io(format!("allocating segment {seg}"), e))
        .and_then(|()| ctx.fault(FaultPoint::RoomBeforeChain))
        .and_then(|()| ctx.meta.note_chain(head.seq, seg as u64));
    let mut st = ctx.state.write();
    if let Err(e) = ready {
        st.segs.segs[seg].state = SegState::Free;
        return Err(e);
    }
    debug_assert_eq!(st.applied, head, "only the leader moves the head");
    if head_is_open {
        st.segs.segs[head.seg].state = SegState::Sealed;
    }
    st.applied = LogPos { seq: head.seq, seg, off: 0 };
    st.head_in_reserve = st.segs.count(SegState::Free) < ctx.opts.reserve_segments;
    Ok(st.applied)
}
