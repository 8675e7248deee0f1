//! A PV re-created to move its node affinity (where the API server refuses the patch), so that a
//! crash at any step never leaves its claim Lost. The intent is written first, on the claim:
//! the PV to create (annotation [`MOVING`]) and the uid of the one to delete, with a label
//! ([`MOVING_LABEL`]) that lets the next leader find it with one list. Then the old PV is
//! deleted (a uid precondition: never a PV someone made since), its finalizers cleared (the
//! same), the new one created, and the intent removed. Whichever controller leads next finds a
//! claim still labelled and finishes the move from where it stopped: the old PV still there →
//! delete it; absent → create; another uid → done.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use serde::{Deserialize, Serialize};

use super::Failover;

/// The annotation on a claim whose PV is being re-created: a [`Move`] as JSON.
pub(super) const MOVING: &str = "failover.ferrite.dev/moving-pv";
/// The label beside it (the claims to finish, found with one list).
const MOVING_LABEL: &str = "failover.ferrite.dev/moving-pv";

/// One re-creation, as the claim records it.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Move {
    /// The uid of the PV being replaced.
    pub old_uid: String,
    /// The PV to create in its place.
    pub pv: PersistentVolume,
}

/// What is left of a move, given the PV under its name now (its uid, if any).
#[derive(Debug, PartialEq, Eq)]
enum Next {
    DeleteOld,
    Create,
    Done,
}

fn next(m: &Move, now: Option<&str>) -> Next {
    match now {
        Some(uid) if uid == m.old_uid => Next::DeleteOld,
        Some(_) => Next::Done,
        None => Next::Create,
    }
}

impl Failover {
    /// Replaces `old` by `new` (the same name), recording the move on the claim first.
    pub(super) async fn move_pv(&self, old: &PersistentVolume, new: PersistentVolume) -> anyhow::Result<()> {
        let claim = old.spec.as_ref().and_then(|s| s.claim_ref.clone());
        let (Some(ns), Some(name)) = (claim.as_ref().and_then(|c| c.namespace.clone()), claim.and_then(|c| c.name))
        else {
            anyhow::bail!("PersistentVolume {} has no claim: not re-created", old.name_any());
        };
        let m = Move { old_uid: old.uid().unwrap_or_default(), pv: new };
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
        self.leading().await?;
        let intent = serde_json::json!({"metadata": {
            "labels": {MOVING_LABEL: "true"},
            "annotations": {MOVING: serde_json::to_string(&m)?},
        }});
        claims.patch(&name, &PatchParams::default(), &Patch::Merge(&intent)).await?;
        self.finish_move(&claims, &name, &m).await
    }

    /// Finishes the moves a controller (this one, or one that died) recorded on claims.
    pub(super) async fn resume_moves(&self) -> anyhow::Result<()> {
        let all: Api<PersistentVolumeClaim> = Api::all(self.client.clone());
        for claim in all.list(&ListParams::default().labels(MOVING_LABEL)).await? {
            let Some(m) = claim.annotations().get(MOVING).and_then(|a| serde_json::from_str::<Move>(a).ok()) else {
                continue;
            };
            let ns = claim.namespace().unwrap_or_default();
            tracing::warn!(claim = %claim.name_any(), namespace = %ns, pv = %m.pv.name_any(), "finishing an interrupted PersistentVolume move");
            let claims = Api::namespaced(self.client.clone(), &ns);
            self.finish_move(&claims, &claim.name_any(), &m).await?;
        }
        Ok(())
    }

    async fn finish_move(&self, claims: &Api<PersistentVolumeClaim>, claim: &str, m: &Move) -> anyhow::Result<()> {
        let api: Api<PersistentVolume> = Api::all(self.client.clone());
        let name = m.pv.name_any();
        let only_old = Preconditions { uid: Some(m.old_uid.clone()), resource_version: None };
        for _ in 0..100 {
            let now = api.get_opt(&name).await?;
            let step = next(m, now.as_ref().and_then(|p| p.metadata.uid.as_deref()));
            self.leading().await?;
            match step {
                Next::DeleteOld => {
                    let dp = DeleteParams { preconditions: Some(only_old.clone()), ..DeleteParams::default() };
                    match api.delete(&name, &dp).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409) => {}
                        Err(e) => return Err(e.into()),
                    }
                    // Only the finalizers of the object we deleted (a precondition on its uid).
                    let clear = serde_json::json!({"metadata": {"finalizers": null, "uid": m.old_uid}});
                    match api.patch(&name, &PatchParams::default(), &Patch::Merge(&clear)).await {
                        Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
                        Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Next::Create => match api.create(&PostParams::default(), &m.pv).await {
                    Ok(_) => tracing::warn!(pv = %name, "PersistentVolume re-created with the copies' affinity"),
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(e) => return Err(e.into()),
                },
                Next::Done => {
                    let done = serde_json::json!({"metadata": {"labels": {MOVING_LABEL: null}, "annotations": {MOVING: null}}});
                    claims.patch(claim, &PatchParams::default(), &Patch::Merge(&done)).await?;
                    return Ok(());
                }
            }
        }
        anyhow::bail!(
            "PersistentVolume {name} is not re-created yet (the old one is still being deleted): the next pass goes on"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_resumes_from_what_the_api_server_holds() {
        let m = Move { old_uid: "old".into(), pv: PersistentVolume::default() };
        assert_eq!(next(&m, Some("old")), Next::DeleteOld, "killed before or during the delete");
        assert_eq!(next(&m, None), Next::Create, "killed between the delete and the create");
        assert_eq!(next(&m, Some("new")), Next::Done, "killed after the create");
        let back: Move = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back.old_uid, "old");
    }
}
