//! Chunks a verify found bad (read twice, a pause apart, and bad both times: one misread, a
//! store's passing fault, moves nothing). Such a chunk is listed in `gc/quarantined`, then
//! moved out of `chunks/` to `quarantine/<id>` (kept for a look, never read again). The next
//! backup of a volume that still holds its data reads that chunk again even where the previous
//! backup lists it, finds it missing and uploads it anew (`--full` or not): then every backup
//! that lists it restores again. A later verify that finds it good drops it from the list, and so
//! does a prune once no manifest lists it.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::manifest::chunk_path;
use crate::target::FORMAT;
use crate::{Result, Target};

const LIST: &str = "gc/quarantined";
/// Most the list may decompress to (what earlier builds, uncapped, may have written).
const MAX_LIST: usize = 16 << 20;
/// Most chunks the list holds (~80 bytes each: well within [`MAX_LIST`]); a bad chunk found
/// past this stays where it is, reported, until the list has room.
const AT_MOST: usize = 100_000;

#[derive(Debug, Default, Serialize, Deserialize)]
struct Quarantined {
    format: u32,
    /// Chunk name -> when a verify found it bad (unix seconds).
    chunks: BTreeMap<String, u64>,
}

fn decode(target: &Target, plain: Option<Vec<u8>>) -> Result<Quarantined> {
    match plain {
        Some(data) => crate::manifest::decode(target, LIST, &data),
        None => Ok(Quarantined { format: FORMAT, ..Quarantined::default() }),
    }
}

/// The chunks in quarantine.
pub(crate) async fn load(target: &Target) -> Result<HashSet<String>> {
    let plain = match target.get_object(Kind::Quarantined, LIST, MAX_LIST).await {
        Ok((data, _)) => Some(data),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(e),
    };
    Ok(decode(target, plain)?.chunks.into_keys().collect())
}

/// Changes the list: adds `bad` while it has room, drops the chunks `keep` refuses. Returns
/// the chunks of `bad` it lists.
async fn change(target: &Target, bad: &[String], keep: impl Fn(&str) -> bool) -> Result<Vec<String>> {
    let mut listed = Vec::new();
    target
        .update_object(Kind::Quarantined, LIST, MAX_LIST, |plain| {
            let mut list = decode(target, plain)?;
            let before = list.chunks.clone();
            list.chunks.retain(|id, _| keep(id));
            listed.clear();
            for id in bad {
                if list.chunks.len() < AT_MOST || list.chunks.contains_key(id) {
                    list.chunks.entry(id.clone()).or_insert_with(crate::now_unix);
                    listed.push(id.clone());
                }
            }
            Ok((list.chunks != before).then(|| serde_json::to_vec(&list).expect("serialises")))
        })
        .await?;
    Ok(listed)
}

/// Puts chunks `bad` in quarantine: listed first (backups stop trusting them), then moved.
/// Those the list has no room for stay, logged.
pub(crate) async fn add(target: &Target, bad: &[String]) -> Result<()> {
    if bad.is_empty() {
        return Ok(());
    }
    let listed = change(target, bad, |_| true).await?;
    if listed.len() < bad.len() {
        tracing::error!(target = %target.name, left = bad.len() - listed.len(), "the quarantine list is full \
            ({AT_MOST} chunks): bad chunks stay in chunks/ until backups that hold them are deleted and pruned");
    }
    for id in &listed {
        match target.rename(&chunk_path(id), &format!("quarantine/{id}")).await {
            // Missing, which is what made it bad: nothing to move.
            Err(e) if e.is_not_found() => {}
            moved => moved?,
        }
    }
    Ok(())
}

/// Takes the chunks `keep` refuses out of quarantine (found good again, or listed nowhere).
pub(crate) async fn retain(target: &Target, keep: impl Fn(&str) -> bool) -> Result<()> {
    change(target, &[], keep).await.map(drop)
}
