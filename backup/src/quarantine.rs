//! Chunks a verify found bad. Such a chunk is listed in `gc/quarantined`, then moved out of
//! `chunks/` to `quarantine/<id>` (kept for a look, never read again). The next backup of a
//! volume that still holds its data reads that chunk again even where the previous backup lists
//! it, finds it missing and uploads it anew (`--full` or not): then every backup that lists it
//! restores again. A later verify that finds it good drops it from the list, and so does a prune
//! once no manifest lists it.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::codec::Kind;
use crate::manifest::chunk_path;
use crate::target::FORMAT;
use crate::{Result, Target};

const LIST: &str = "gc/quarantined";
/// Most the list may decompress to (some 100 000 chunks).
const MAX_LIST: usize = 16 << 20;

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

/// Changes the list: adds `bad`, drops the chunks `keep` refuses.
async fn change(target: &Target, bad: &[String], keep: impl Fn(&str) -> bool) -> Result<()> {
    target
        .update_object(Kind::Quarantined, LIST, MAX_LIST, |plain| {
            let mut list = decode(target, plain)?;
            let before = list.chunks.clone();
            list.chunks.retain(|id, _| keep(id));
            for id in bad {
                list.chunks.entry(id.clone()).or_insert_with(crate::now_unix);
            }
            Ok((list.chunks != before).then(|| serde_json::to_vec(&list).expect("serialises")))
        })
        .await
}

/// Puts chunks `bad` in quarantine: listed first (backups stop trusting them), then moved.
pub(crate) async fn add(target: &Target, bad: &[String]) -> Result<()> {
    if bad.is_empty() {
        return Ok(());
    }
    change(target, bad, |_| true).await?;
    for id in bad {
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
    change(target, &[], keep).await
}
