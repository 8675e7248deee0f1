//! Copying a backup from one target to another (a second site, another provider): only the
//! chunks the destination lacks travel, each checked on the way. Under the same key (or both
//! without one) a chunk keeps its name and its sealed bytes go as they are; under another key
//! it is opened, named and sealed anew; so are the segments that list them, a segment at a time. At the destination a copy is a backup like any other:
//! it reads the condemned list first and commits within 0.9 x grace (see `prune.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use futures_util::StreamExt;

use crate::codec::Kind;
use crate::manifest::{BackupRef, ChunkRef, Index, Manifest, chunk_path};
use crate::prune::Swept;
use crate::restore::{fetch_chunk, fetch_sealed};
use crate::segment::SPAN;
use crate::{Error, Pace, Progress, Result, Target, prune};

/// Copies backup `b` from `from` to `to` (same volume and id there); the copy's manifest.
pub async fn copy(
    from: &Target,
    to: &Target,
    b: &BackupRef,
    progress: &(dyn Fn(&Progress) + Sync),
) -> Result<Manifest> {
    crate::writers::with_lease(to, async |lease| copy_leased(from, to, b, progress, lease).await).await
}

/// [`copy`] under the writer's `lease` at the destination.
async fn copy_leased(
    from: &Target,
    to: &Target,
    b: &BackupRef,
    progress: &(dyn Fn(&Progress) + Sync),
    lease: &crate::writers::Lease,
) -> Result<Manifest> {
    let m = Manifest::load(from, b).await?;
    if m.chunk_size != to.chunk_size() {
        return Err(Error::Invalid(format!(
            "backup {b} has {} byte chunks and target {} uses {}: a copy keeps its chunks",
            m.chunk_size,
            to.name,
            to.chunk_size()
        )));
    }
    if m.encrypted_volume && !to.is_sealed() {
        return Err(Error::Invalid(format!(
            "backup {b} is of an encrypted volume and target {} has no key-file: its copy would hold plaintext",
            to.name
        )));
    }
    let swept = prune::load_swept(to).await?;
    if Index::load(to, &b.volume).await?.backups.iter().any(|e| e.id == b.id) {
        return Err(Error::Conflict(format!("backup {b} already exists on target {}", to.name)));
    }
    let same_key = from.codec.key_check() == to.codec.key_check();
    let mut done = Progress { chunks_total: m.chunk_count(), bytes_total: m.chunk_bytes(), ..Progress::default() };
    progress(&done);
    let pace = Arc::new(Pace::new(to.config.bandwidth));
    let shared = Arc::new(swept);
    let (mut segments, mut uploaded, mut new_chunks) = (Vec::new(), 0, 0);
    let (mut sent, mut again, mut again_segments) = (HashSet::new(), Vec::new(), Vec::new());
    // A segment at a time: its chunks, then the segment as the destination names them.
    for n in m.segment_numbers() {
        let source = m.chunks_of_segment(from, n).await?;
        let mut copied = futures_util::stream::iter(source)
            .map(|c| {
                let (from, to, pace, swept) = (from.clone(), to.clone(), Arc::clone(&pace), Arc::clone(&shared));
                async move { copy_chunk(&from, &to, c.clone(), same_key, &pace, &swept).await.map(|r| (c, r)) }
            })
            .buffered(to.concurrency());
        let mut chunks = Vec::new();
        while let Some(r) = copied.next().await {
            let (source, (c, bytes)) = r?;
            if bytes > 0 && sent.insert(c.id.clone()) {
                uploaded += bytes;
                new_chunks += 1;
                if shared.condemned.contains(&c.id) {
                    // The source's reference of it (a copy under another key names it anew).
                    again.push((source, c.id.clone()));
                }
            }
            done.chunks_done += 1;
            done.bytes_done += u64::from(c.len);
            done.bytes_transferred = uploaded;
            progress(&done);
            chunks.push(c);
        }
        drop(copied);
        let stored = crate::segment::store(to, n * SPAN, &chunks, None, &shared, &pace).await?;
        uploaded += stored.uploaded;
        again_segments.extend(stored.again.map(|data| (stored.seg.id.clone(), data)));
        segments.push(stored.seg);
    }
    let copy = Manifest {
        segments,
        inline: Vec::new(),
        uploaded_bytes: uploaded,
        new_chunks,
        copied_from: Some(from.name.clone()),
        attempt: Some(lease.attempt().to_owned()),
        ..m
    };
    copy.commit(to, lease).await?;
    // As a backup does (create.rs): a condemned chunk sent again and swept meanwhile goes once more.
    for (source, id) in again {
        if to.head(&chunk_path(&id)).await?.is_none() {
            let force = Swept { condemned: [&id].into_iter().collect(), locked_at: shared.locked_at };
            copy_chunk(from, to, source, same_key, &pace, &force).await?;
        }
    }
    crate::segment::store_again(to, again_segments, &pace).await?;
    Ok(copy)
}

/// Copies one chunk unless `to` has it (not condemned there, and under an object lock in a
/// version fresh enough, as a backup would): its reference at the destination, and the bytes
/// uploaded (0 when it was there).
async fn copy_chunk(
    from: &Target,
    to: &Target,
    c: ChunkRef,
    same_key: bool,
    pace: &Pace,
    swept: &Swept,
) -> Result<(ChunkRef, u64)> {
    let unpaced = Pace::new(None);
    let (c, sealed) = if same_key {
        if !swept.condemned.contains(&c.id) && to.holds_fresh(&chunk_path(&c.id), swept.locked_at).await? {
            return Ok((c, 0));
        }
        // Checked as a restore would, then sent as it is (the same key opens it there).
        let (sealed, _) = fetch_sealed(from, &c, &unpaced).await?;
        (c, sealed)
    } else {
        let plain = fetch_chunk(from, &c, &unpaced).await?;
        let codec = to.codec.clone();
        let (id, sealed) = tokio::task::spawn_blocking(move || {
            let id = codec.chunk_id(&plain);
            let sealed = codec.seal(Kind::Chunk, &chunk_path(&id), &plain);
            (id, sealed)
        })
        .await
        .expect("sealing does not panic");
        let c = ChunkRef { id, ..c };
        if !swept.condemned.contains(&c.id) && to.holds_fresh(&chunk_path(&c.id), swept.locked_at).await? {
            return Ok((c, 0));
        }
        (c, sealed.into())
    };
    let bytes = sealed.len() as u64;
    pace.admit(bytes).await;
    to.put(&chunk_path(&c.id), sealed).await?;
    Ok((c, bytes))
}
