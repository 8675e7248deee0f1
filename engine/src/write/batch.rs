//! One batch: its header and data encoded into one aligned buffer, written with one write at
//! the place the room reservation gave it, then applied to the maps. The cleaner's moves are
//! written here too, as ordinary batches naming their layers.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use crate::ctx::Ctx;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{BatchHeader, Entry, EntryKind, block_crc};
use crate::io::{AlignedBuf, BLOCK};
use crate::map::segments::SegState;
use crate::state::apply;
use crate::write::Log;
use crate::write::queue::MAX_ENTRIES;
use crate::write::req::{Payload, Req};
use crate::write::room::reserve_room;

/// Data bytes copied and checksummed before they are handed to the store (see `write_batch`).
const PREP_PIECE: usize = 256 << 10;

/// Data blocks a batch can still carry in the head segment, keeping room for the largest header.
pub(crate) fn head_room_blocks(ctx: &Ctx) -> u64 {
    let st = ctx.state.read();
    let head = st.applied;
    if st.segs.segs[head.seg].state != SegState::Open {
        return 0;
    }
    let header = BatchHeader::blocks_for(MAX_ENTRIES, usize::try_from(ctx.max_batch_blocks).unwrap_or(usize::MAX));
    ((ctx.sb.segment_size - head.off) / BLOCK as u64).saturating_sub(header as u64)
}

/// Builds, writes and applies one batch. Fails the whole batch with NoSpace if no segment can
/// take it; an unmap-only batch may use the reserve.
pub(crate) fn write_batch(ctx: &Ctx, log: &Log, reqs: &[Req], scratch: &mut AlignedBuf) -> Result<()> {
    let mut entries = Vec::with_capacity(reqs.len());
    let mut data_blocks = 0usize;
    // A volume deleted meanwhile maps to layer 0, which never exists: replay and apply skip it.
    let heads: Vec<u64> = {
        let st = ctx.state.read();
        let head = |v: &u64| st.volumes.get(v).map_or(0, |e| e.rec.layer);
        reqs.iter()
            .map(|r| match r {
                Req::Write { volume, .. } | Req::Unmap { volume, .. } => head(volume),
                Req::Move { layer, .. } => *layer,
                _ => 0,
            })
            .collect()
    };
    for (r, &layer) in reqs.iter().zip(&heads) {
        match r {
            Req::Write { lba, data, .. } | Req::Move { lba, data, .. } => {
                let blocks = u32::try_from(data.len() / BLOCK).expect("requests are split below 4 GiB");
                entries.push(Entry { layer, lba: *lba, blocks, kind: EntryKind::Data });
                data_blocks += data.len() / BLOCK;
            }
            Req::Unmap { lba, blocks, .. } => {
                let mut done = 0;
                while done < *blocks {
                    let n = (*blocks - done).min(u64::from(u32::MAX));
                    let n32 = u32::try_from(n).expect("bounded");
                    entries.push(Entry { layer, lba: lba + done, blocks: n32, kind: EntryKind::Unmap });
                    done += n;
                }
            }
            Req::Flush { .. } | Req::Barrier { .. } => {}
        }
    }
    let hb = BatchHeader::blocks_for(entries.len(), data_blocks);
    let len = (hb + data_blocks) * BLOCK;
    if scratch.len() < len {
        *scratch = AlignedBuf::new(len);
    }
    // Unmap-only batches and the cleaner's moves may use the reserve: both give space back.
    let may_use_reserve = reqs.iter().all(|r| matches!(r, Req::Unmap { .. } | Req::Move { .. }));
    let pos = reserve_room(ctx, log, len as u64, may_use_reserve)?;
    let mut header = BatchHeader {
        seq: pos.seq,
        generation: ctx.state.read().generation,
        uuid_tag: ctx.sb.uuid_tag(),
        entries,
        crcs: Vec::with_capacity(data_blocks),
    };
    let offset = ctx.sb.segment_offset(pos.seg, pos.off);
    // The data goes to the store a piece at a time as it is copied and checksummed, so the
    // device works while the next piece is prepared; the header, which holds every checksum,
    // goes last. Every byte of scratch[..len] is written: the header (zero-padded by
    // encode_into) and the data.
    let (head_buf, mut rest) = scratch[..len].split_at_mut(hb * BLOCK);
    let mut head_buf = Some(head_buf);
    let mut datas = reqs.iter().filter_map(|r| match r {
        Req::Write { data, .. } | Req::Move { data, .. } => Some(&data[..]),
        _ => None,
    });
    let mut cur: &[u8] = &[];
    let mut at = offset + (hb * BLOCK) as u64;
    let mut pieces = std::iter::from_fn(|| {
        while cur.is_empty() {
            let Some(d) = datas.next() else {
                let h = head_buf.take()?;
                header.encode_into(h);
                return Some((&*h, offset));
            };
            cur = d;
        }
        let (src, tail) = cur.split_at(cur.len().min(PREP_PIECE));
        cur = tail;
        let (dst, r) = std::mem::take(&mut rest).split_at_mut(src.len());
        rest = r;
        dst.copy_from_slice(src);
        header.crcs.extend(src.chunks(BLOCK).map(block_crc));
        let piece = (&*dst, at);
        at += src.len() as u64;
        Some(piece)
    });
    let written = ctx.backend.write_pieces(&mut pieces);
    if let Err(e) = written {
        let e = Error::io(format!("writing log batch {} at segment {} offset {}", pos.seq, pos.seg, pos.off), e);
        // ENOSPC from the filesystem under a sparse file: nothing was acknowledged, the head does
        // not move, and the next batch overwrites whatever part of this one landed.
        if e.kind() != ErrorKind::NoSpace {
            ctx.poison(&e);
        }
        return Err(e);
    }
    ctx.media_bytes.fetch_add(len as u64, Ordering::Relaxed);
    let client: usize = reqs.iter().map(|r| if let Req::Write { data, .. } = r { data.len() } else { 0 }).sum();
    ctx.client_bytes.fetch_add(client as u64, Ordering::Relaxed);
    let mut st = ctx.state.write();
    apply(&mut st, &header, pos);
    if st.log_bytes_since_ckpt >= ctx.opts.checkpoint_bytes {
        ctx.wake.checkpoint.raise();
    }
    Ok(())
}

/// Writes the cleaner's moves: at the cold head (`cold.rs`), or, with `cold_head` off, into the
/// log as batches; only on the leader (inside a barrier). Each move is
/// (layer, lba, whole blocks of data). Batches fill the head segment's tail before a new
/// segment is started, as client batches do, so moved data packs densely.
pub(crate) fn write_moves(ctx: &Ctx, log: &Log, moves: Vec<(u64, u64, Vec<u8>)>) -> Result<()> {
    if ctx.opts.cold_head {
        return crate::write::cold::write_cold(ctx, log, moves);
    }
    let mut scratch = AlignedBuf::new(BLOCK);
    let mut queue: VecDeque<(u64, u64, Payload)> =
        moves.into_iter().map(|(layer, lba, data)| (layer, lba, Payload::new(data))).collect();
    while !queue.is_empty() {
        let room = head_room_blocks(ctx);
        let limit = if room > 0 { room.min(ctx.max_batch_blocks) } else { ctx.max_batch_blocks };
        let mut batch: Vec<Req> = Vec::new();
        let mut blocks = 0;
        while let Some((layer, lba, data)) = queue.pop_front() {
            let n = (data.len() / BLOCK) as u64;
            if batch.len() == MAX_ENTRIES || blocks == limit {
                queue.push_front((layer, lba, data));
                break;
            }
            if blocks + n > limit {
                // Split: what fits goes now, the rest heads the next batch.
                let fit = usize::try_from(limit - blocks).expect("small") * BLOCK;
                queue.push_front((layer, lba + (limit - blocks), data.slice(fit..data.len())));
                batch.push(Req::Move { layer, lba, data: data.slice(0..fit) });
                break;
            }
            blocks += n;
            batch.push(Req::Move { layer, lba, data });
        }
        write_batch(ctx, log, &batch, &mut scratch)?;
    }
    Ok(())
}
