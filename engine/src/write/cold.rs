//! The cold head: where the cleaner's moves go, apart from fresh client writes.
//!
//! Blocks the cleaner moves have outlived every overwrite since they were written: they are cold
//! by definition, and mixing them into the segments fresh (hot) writes fill makes each of those
//! segments a mix of soon-dead and long-lived blocks, which the cleaner must then move again. A
//! head of their own keeps segments homogeneous (Rosenblum & Ousterhout; SepBIT, FAST'22).
//!
//! The cold head is not part of the sequenced log. Its segments hold data blocks only (no batch
//! headers): a move is made durable by the next checkpoint, which syncs the store before it
//! commits the maps that point there, and the victim is released only after that commit. A
//! crash before it loses nothing: the durable maps still point at the victim, which is intact,
//! and replay of the client batches after the checkpoint applies on top of them as always. The
//! checkpoint also records the cold head's position, so that after a reopen the cold head
//! continues in the same segment (what lies past that position was never committed).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use crate::ctx::Ctx;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{Entry, EntryKind, block_crc};
use crate::io::{AlignedBuf, BLOCK};
use crate::map::segments::SegState;
use crate::state::{ColdHead, map_entries};
use crate::write::Log;

/// Writes the cleaner's moves (layer, lba, whole blocks of data), in the order given, densely
/// at the cold head, and maps them. Only on the leader (inside a barrier): nothing else changes
/// the maps meanwhile, so what the caller found still mapped is still mapped here.
pub(crate) fn write_cold(ctx: &Ctx, log: &Log, moves: Vec<(u64, u64, Vec<u8>)>) -> Result<()> {
    let mut queue: VecDeque<(u64, u64, Vec<u8>)> = moves.into();
    let mut buf = AlignedBuf::new(BLOCK);
    while !queue.is_empty() {
        let head = cold_room(ctx, log)?;
        let room = usize::try_from((ctx.sb.segment_size - head.off) / BLOCK as u64).expect("small");
        // Straight into the write buffer; a move that does not fit leaves its rest at the front
        // of the queue for the next segment.
        let len = queue.iter().map(|(_, _, d)| d.len() / BLOCK).sum::<usize>().min(room) * BLOCK;
        if buf.len() < len {
            buf = AlignedBuf::new(len);
        }
        let mut entries = Vec::new();
        let mut at = 0;
        while at < len {
            let (layer, lba, data) = queue.pop_front().expect("len counts only what is queued");
            let fit = data.len().min(len - at);
            buf[at..at + fit].copy_from_slice(&data[..fit]);
            entries.push(entry(layer, lba, fit / BLOCK));
            if fit < data.len() {
                queue.push_front((layer, lba + (fit / BLOCK) as u64, data[fit..].to_vec()));
            }
            at += fit;
        }
        let crcs: Vec<u32> = buf[..len].chunks(BLOCK).map(block_crc).collect();
        let offset = ctx.sb.segment_offset(head.seg, head.off);
        if let Err(e) = ctx.backend.write_at(&buf[..len], offset) {
            let e = Error::io(format!("writing moved blocks at segment {} offset {}", head.seg, head.off), e);
            if e.kind() != ErrorKind::NoSpace {
                ctx.poison(&e);
            }
            return Err(e);
        }
        ctx.media_bytes.fetch_add(len as u64, Ordering::Relaxed);
        let mut st = ctx.state.write();
        let pba = st.segs.pba(head.seg, head.off / BLOCK as u64);
        map_entries(&mut st, &entries, pba, &crcs);
        // Age for victim choice: the moved blocks are as old as the log is now.
        st.segs.segs[head.seg].last_seq = st.applied.seq.saturating_sub(1);
        let off = head.off + len as u64;
        if off >= ctx.sb.segment_size {
            st.segs.segs[head.seg].state = SegState::Sealed;
            st.cold = None;
        } else {
            st.cold = Some(ColdHead { seg: head.seg, off });
        }
    }
    Ok(())
}

fn entry(layer: u64, lba: u64, blocks: usize) -> Entry {
    Entry { layer, lba, blocks: u32::try_from(blocks).expect("at most a segment"), kind: EntryKind::Data }
}

/// The cold head, opening a segment for it if there is none. Moves may take the reserve: they
/// always give back more than they take. With none free, a checkpoint releases the victims
/// already emptied (as the client head does, `room.rs`).
fn cold_room(ctx: &Ctx, log: &Log) -> Result<ColdHead> {
    if let Some(head) = ctx.state.read().cold {
        return Ok(head);
    }
    let mut seg = ctx.state.write().segs.take_free(0);
    if seg.is_none() && ctx.state.read().segs.any_empty_sealed(&ctx.pins) {
        log.room.checkpoint(ctx, log)?;
        seg = ctx.state.write().segs.take_free(0);
    }
    let Some(seg) = seg else {
        return Err(Error::new(ErrorKind::NoSpace, "pool is full: no free segment for the cleaner's moves"));
    };
    if let Err(e) = ctx.backend.allocate(ctx.sb.segment_offset(seg, 0), ctx.sb.segment_size) {
        ctx.state.write().segs.segs[seg].state = SegState::Free;
        return Err(Error::io(format!("allocating segment {seg}"), e));
    }
    let head = ColdHead { seg, off: 0 };
    let mut st = ctx.state.write();
    st.segs.segs[seg].cold = true;
    st.cold = Some(head);
    Ok(head)
}
