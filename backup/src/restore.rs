//! Reading backups back: fetching and checking a chunk, writing it into a volume (for
//! `instant.rs`), and verifying chunks.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::StreamExt;

use crate::codec::Kind;
use crate::manifest::{BackupRef, ChunkRef, Manifest, chunk_path};
use crate::{Error, Pace, Progress, Result, Target};

const BLOCK: usize = 4096;
/// The pause before a chunk found bad is read again.
const MISREAD_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// Fetches and checks one chunk: its seal opens, it decompresses to `len` bytes, and its
/// plaintext hashes to its name.
pub(crate) async fn fetch_chunk(target: &Target, c: &ChunkRef, pace: &Pace) -> Result<Vec<u8>> {
    Ok(fetch_sealed(target, c, pace).await?.1)
}

/// The same, with the chunk's envelope as stored.
pub(crate) async fn fetch_sealed(target: &Target, c: &ChunkRef, pace: &Pace) -> Result<(bytes::Bytes, Vec<u8>)> {
    let path = chunk_path(&c.id);
    let (data, _) = target.get(&path, crate::codec::max_envelope(c.len as usize)).await.map_err(|e| {
        if e.is_not_found() {
            Error::corrupt(&target.name, format!("chunk {}", c.id), "it is missing from the target")
        } else {
            e
        }
    })?;
    pace.admit(data.len() as u64).await;
    let codec = target.codec.clone();
    let (id, len) = (c.id.clone(), c.len as usize);
    let target_name = target.name.clone();
    tokio::task::spawn_blocking(move || {
        let plain = codec.open(Kind::Chunk, &path, data.to_vec(), len)?;
        if plain.len() != len || codec.chunk_id(&plain) != id {
            return Err(Error::corrupt(&target_name, format!("chunk {id}"), "its contents do not match its name"));
        }
        Ok((data, plain))
    })
    .await
    .expect("checking a chunk does not panic")
}

/// Checks chunk `c`; found bad, again after a pause: a chunk is bad only if both reads say so.
async fn check_twice(target: &Target, c: &ChunkRef, pace: &Pace) -> Result<()> {
    match fetch_chunk(target, c, pace).await {
        Err(Error::Corrupt { why, .. }) => {
            tokio::time::sleep(MISREAD_PAUSE).await;
            let again = fetch_chunk(target, c, pace).await.map(drop);
            if again.is_ok() {
                tracing::warn!(target = %target.name, chunk = %c.id, first = %why, "a chunk read bad once and good again: kept");
            }
            again
        }
        read => read.map(drop),
    }
}

/// Writes the runs of non-zero 4 KiB blocks of `data` at `offset`.
pub(crate) fn write_nonzero(volume: &ferrite_engine::Volume, offset: u64, data: &[u8]) -> ferrite_engine::Result<()> {
    let zero = |b: &[u8]| b.iter().all(|&x| x == 0);
    let mut start = None;
    for (n, block) in data.chunks(BLOCK).enumerate() {
        match (start, zero(block)) {
            (None, false) => start = Some(n),
            (Some(s), true) => {
                volume.write(offset + (s * BLOCK) as u64, &data[s * BLOCK..n * BLOCK])?;
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        volume.write(offset + (s * BLOCK) as u64, &data[s * BLOCK..])?;
    }
    Ok(())
}

/// Writes the raw image of backup `b` to `out`, in order (chunks the backup does not list as
/// zeros), fetching `concurrency` chunks ahead and checking each: no pool is needed, only the
/// target. `progress` sees the bytes written.
pub async fn export(
    target: &Target,
    b: &BackupRef,
    out: &mut (dyn std::io::Write + Send),
    progress: &(dyn Fn(&Progress) + Sync),
) -> Result<Manifest> {
    let m = Manifest::load(target, b).await?;
    let (cs, size) = (m.chunk_size, m.size);
    let listed: BTreeMap<u64, ChunkRef> = m.chunk_list(target).await?.into_iter().map(|c| (c.i, c)).collect();
    let mut done = Progress { chunks_total: m.chunk_count(), bytes_total: m.size, ..Progress::default() };
    let pace = Arc::new(Pace::new(target.config.bandwidth));
    let mut pieces = futures_util::stream::iter(0..size.div_ceil(cs))
        .map(|i| {
            let len = usize::try_from(cs.min(size - i * cs)).expect("chunks are at most 4 MiB");
            let (c, target, pace) = (listed.get(&i).cloned(), target.clone(), Arc::clone(&pace));
            async move {
                match c {
                    Some(c) => fetch_chunk(&target, &c, &pace).await.map(|data| (data, true)),
                    None => Ok((vec![0; len], false)),
                }
            }
        })
        .buffered(target.concurrency());
    while let Some(piece) = pieces.next().await {
        let (data, fetched) = piece?;
        out.write_all(&data).map_err(|e| Error::Invalid(format!("writing the image of {b}: {e}")))?;
        done.chunks_done += u64::from(fetched);
        done.bytes_done += data.len() as u64;
        done.bytes_transferred += if fetched { data.len() as u64 } else { 0 };
        progress(&done);
    }
    out.flush().map_err(|e| Error::Invalid(format!("writing the image of {b}: {e}")))?;
    Ok(m)
}

/// What `verify` found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub backups: u64,
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// Chunk name, what is wrong, the backups that list it.
    pub bad: Vec<(String, String, Vec<String>)>,
    /// Chunks in quarantine after it: found bad (by it or before) and not found good since.
    pub quarantined: u64,
}

/// Reads back the chunks of `backups` and checks each against its name; with `sample` (0-1),
/// a random share of them. One GET per chunk, each chunk once however many backups list it; a
/// chunk found bad is read again after a pause and only counts as bad if that read fails too.
/// Memory: the sampled chunks only (with the backups that list each), and one segment at a time.
pub async fn verify(
    target: &Target,
    backups: &[BackupRef],
    sample: Option<f64>,
    progress: &(dyn Fn(&Progress) + Sync),
) -> Result<VerifyReport> {
    // Names are uniform: a window of their first byte is a uniform sample, moved at random.
    let width = sample
        .map_or(256, |share| (0..=256u16).find(|&w| f64::from(w) >= share.clamp(0.0, 1.0) * 256.0).unwrap_or(256));
    let shift = u16::from(crate::codec::random::<1>()[0]);
    let sampled = |id: &str| {
        let first = id.get(..2).and_then(|h| u16::from_str_radix(h, 16).ok()).unwrap_or(0);
        (first + 256 - shift) % 256 < width
    };
    // Chunk name -> its length and the backups (by their place in `backups`) that list it.
    let mut users: BTreeMap<String, (u32, Vec<u32>)> = BTreeMap::new();
    let mut unreadable = Vec::new();
    for (n, b) in backups.iter().enumerate() {
        let m = Manifest::load(target, b).await?;
        let n = u32::try_from(n).expect("under 4 G backups");
        // Its segments are chunks too: sampled alike.
        let mut add = |c: ChunkRef| {
            if sampled(&c.id) {
                users.entry(c.id).or_insert_with(|| (c.len, Vec::new())).1.push(n);
            }
        };
        m.segments.iter().for_each(|s| add(s.as_chunk()));
        for s in m.segment_numbers() {
            match m.chunks_of_segment(target, s).await {
                Ok(chunks) => chunks.into_iter().for_each(&mut add),
                // A segment missing or damaged is a bad chunk of its backup, found unsampled.
                Err(Error::Corrupt { why, .. }) => {
                    let id = m.segment(s).map_or_else(String::new, |seg| seg.id.clone());
                    unreadable.push((id, why, vec![b.to_string()]));
                }
                Err(e) => return Err(e),
            }
        }
    }
    // A sampled one is checked below, with every backup that lists it.
    unreadable.retain(|(id, _, _)| !users.contains_key(id));
    let mut report = VerifyReport { backups: backups.len() as u64, bad: unreadable, ..VerifyReport::default() };
    let mut good = std::collections::HashSet::new();
    let mut done = Progress {
        chunks_total: users.len() as u64,
        bytes_total: users.values().map(|(len, _)| u64::from(*len)).sum(),
        ..Progress::default()
    };
    let pace = Arc::new(Pace::new(target.config.bandwidth));
    let mut results = futures_util::stream::iter(users)
        .map(|(id, (len, users))| {
            let (target, pace) = (target.clone(), pace.clone());
            let c = ChunkRef { i: 0, id, len };
            async move { (check_twice(&target, &c, &pace).await, c, users) }
        })
        .buffer_unordered(target.concurrency());
    while let Some((r, c, users)) = results.next().await {
        match r {
            Ok(()) => {
                good.insert(c.id.clone());
            }
            Err(Error::Corrupt { why, .. }) => {
                let users = users.iter().map(|&n| backups[n as usize].to_string()).collect();
                report.bad.push((c.id.clone(), why, users));
            }
            Err(e) => return Err(e),
        }
        report.chunks_checked += 1;
        report.bytes_checked += u64::from(c.len);
        done.chunks_done += 1;
        done.bytes_done += u64::from(c.len);
        progress(&done);
    }
    report.bad.sort();
    // The bad go to quarantine (the next backup that holds their data uploads them again); the
    // good that were there leave it.
    let bad: Vec<String> = report.bad.iter().map(|(id, _, _)| id.clone()).collect();
    crate::quarantine::add(target, &bad).await?;
    let quarantined = crate::quarantine::load(target).await?;
    report.quarantined = quarantined.len() as u64;
    if quarantined.iter().any(|id| good.contains(id)) {
        crate::quarantine::retain(target, |id| !good.contains(id)).await?;
        report.quarantined = quarantined.iter().filter(|id| !good.contains(*id)).count() as u64;
    }
    Ok(report)
}
