//! A PV re-created to move its node affinity (where the API server refuses the patch), so that a
//! crash at any step never leaves its claim Lost. The intent is written first, where only the
//! controller's account may write: a ConfigMap in the controller's own namespace
//! ([`RECORD_PREFIX`] + the PV's name, labelled [`RECORD_LABEL`] so that the next leader finds
//! every one with one list), holding the PV to create and the uid of the one to delete. Then the
//! old PV is deleted (a uid precondition: never a PV someone made since), its finalizers cleared
//! (the same), the new one created, and the record deleted. Whichever controller leads next
//! finishes a move from where it stopped: the old PV still there → delete it; absent → create;
//! another uid → done.
//!
//! Nothing a tenant writes starts or steers a move (releases before 0.3 kept the record on the
//! claim, where anyone who may edit the claim could write one: those annotations are ignored).
//! And before a PV is created the record is checked against the cluster all the same
//! ([`checked`]): a PV of this driver, under the name its claim is bound to, naming that claim by
//! its uid, for a volume a daemon holds. Each record's failure is its own (a log line and an
//! Event); the pass goes on.

use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde::{Deserialize, Serialize};

use super::Failover;

/// The record's name: this prefix and the PV's name.
const RECORD_PREFIX: &str = "ferrite-pv-move-";
/// The label of every record (the moves to finish, found with one list).
const RECORD_LABEL: &str = "failover.ferrite.dev/pv-move";
/// The record's key holding the [`Move`] as JSON.
const KEY: &str = "move.json";

/// One re-creation, as the record holds it.
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

/// The claim a move's PV names (namespace, name, uid).
fn claim_of(pv: &PersistentVolume) -> Option<(String, String, String)> {
    let c = pv.spec.as_ref()?.claim_ref.as_ref()?;
    Some((c.namespace.clone()?, c.name.clone()?, c.uid.clone()?))
}

/// Whether the PV `m` would create is one this controller may create: of `driver`, the PV
/// `claim` is bound to (its `volumeName`), naming that claim by namespace, name and uid. The
/// volume's existence is checked apart (it takes the daemons).
fn checked(m: &Move, driver: &str, claim: &PersistentVolumeClaim) -> Result<(), String> {
    let name = m.pv.name_any();
    let Some(spec) = m.pv.spec.as_ref().filter(|s| s.csi.as_ref().is_some_and(|c| c.driver == driver)) else {
        return Err(format!("PersistentVolume {name} would not be a volume of {driver}"));
    };
    if spec.host_path.is_some() || spec.local.is_some() || spec.nfs.is_some() {
        return Err(format!("PersistentVolume {name} would name a source besides its CSI volume"));
    }
    let bound_to = claim.spec.as_ref().and_then(|s| s.volume_name.as_deref());
    if bound_to != Some(name.as_str()) {
        return Err(format!("the claim is bound to {bound_to:?}, not to PersistentVolume {name}"));
    }
    let names = |(ns, n, uid)| (Some(ns), Some(n), Some(uid));
    if claim_of(&m.pv).map(names) != Some((claim.namespace(), Some(claim.name_any()), claim.uid())) {
        return Err(format!("PersistentVolume {name} would name another claim than the one it moves for"));
    }
    Ok(())
}

impl Failover {
    fn records(&self) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Replaces `old` by `new` (the same name), recording the move first.
    pub(super) async fn move_pv(&self, old: &PersistentVolume, new: PersistentVolume) -> anyhow::Result<()> {
        let name = new.name_any();
        anyhow::ensure!(claim_of(old).is_some(), "PersistentVolume {name} has no claim: not re-created");
        let m = Move { old_uid: old.uid().unwrap_or_default(), pv: new };
        let record = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("{RECORD_PREFIX}{name}")),
                labels: Some([(RECORD_LABEL.to_owned(), "true".to_owned())].into()),
                ..Default::default()
            },
            data: Some([(KEY.to_owned(), serde_json::to_string(&m)?)].into()),
            ..Default::default()
        };
        self.leading().await?;
        match self.records().create(&PostParams::default(), &record).await {
            Ok(_) => {}
            // An unfinished move of the same PV: finished first, this one on a later pass.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                anyhow::bail!("PersistentVolume {name} is being moved already")
            }
            Err(e) => return Err(e.into()),
        }
        self.finish_move(&m).await
    }

    /// Finishes the moves a controller (this one, or one that died) recorded; each record's
    /// error is its own.
    pub(super) async fn resume_moves(&self) {
        let list = match self.records().list(&ListParams::default().labels(RECORD_LABEL)).await {
            Ok(l) => l,
            Err(e) => return tracing::warn!("listing the PersistentVolume moves to finish: {e}"),
        };
        for record in list {
            let parsed = record.data.as_ref().and_then(|d| d.get(KEY)).map(|t| serde_json::from_str::<Move>(t));
            let m = match parsed {
                Some(Ok(m)) => m,
                _ => {
                    let e = anyhow::anyhow!("the record holds no move: left for the operator to delete");
                    self.move_failed(&record, None, &e).await;
                    continue;
                }
            };
            tracing::warn!(pv = %m.pv.name_any(), "finishing an interrupted PersistentVolume move");
            if let Err(e) = self.finish_move(&m).await {
                self.move_failed(&record, Some(&m), &e).await;
            }
        }
    }

    /// A move that could not go on: a log line, an Event on its record and on the claim.
    async fn move_failed(&self, record: &ConfigMap, m: Option<&Move>, e: &anyhow::Error) {
        self.metrics.errors.inc();
        tracing::warn!(record = %record.name_any(), "a PersistentVolume move: {e:#}");
        let ev = Event {
            type_: EventType::Warning,
            reason: "MoveFailed".into(),
            note: Some(format!("re-creating the PersistentVolume with its copies' affinity: {e:#}")),
            action: "Replace".into(),
            secondary: None,
        };
        let mut about: Vec<ObjectReference> = vec![record.object_ref(&())];
        about.extend(m.and_then(|m| m.pv.spec.as_ref()?.claim_ref.clone()));
        for r in about {
            if let Err(e) = self.events.publish(&ev, &r).await {
                tracing::warn!("publishing an event: {e}");
            }
        }
    }

    /// Checks `m` against its claim and the daemons ([`checked`], and a daemon holds its volume).
    async fn check(&self, m: &Move) -> anyhow::Result<()> {
        let name = m.pv.name_any();
        let (ns, claim, _) =
            claim_of(&m.pv).ok_or_else(|| anyhow::anyhow!("PersistentVolume {name} names no claim"))?;
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
        let Some(claim) = claims.get_opt(&claim).await? else {
            anyhow::bail!("claim {ns}/{claim} of PersistentVolume {name} no longer exists: not created");
        };
        checked(m, &self.driver, &claim).map_err(|e| anyhow::anyhow!("{e}: not created"))?;
        let handle = m.pv.spec.as_ref().and_then(|s| s.csi.as_ref()).map(|c| c.volume_handle.as_str());
        let Some((hint, volume)) = handle.and_then(crate::shared::ids::parse) else {
            anyhow::bail!("PersistentVolume {name} names no volume of this driver: not created");
        };
        let found = crate::shared::copies::locate(&*self.dir, hint, volume).await?;
        if found.primary.is_none() && found.copies.is_empty() {
            anyhow::bail!("no daemon holds volume {volume} of PersistentVolume {name}: not created");
        }
        Ok(())
    }

    async fn finish_move(&self, m: &Move) -> anyhow::Result<()> {
        let api: Api<PersistentVolume> = Api::all(self.client.clone());
        let name = m.pv.name_any();
        let only_old = Preconditions { uid: Some(m.old_uid.clone()), resource_version: None };
        for _ in 0..100 {
            let now = api.get_opt(&name).await?;
            let step = next(m, now.as_ref().and_then(|p| p.metadata.uid.as_deref()));
            if step == Next::Create {
                self.check(m).await?;
            }
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
                    match self.records().delete(&format!("{RECORD_PREFIX}{name}"), &DeleteParams::default()).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 404 => {}
                        Err(e) => return Err(e.into()),
                    }
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
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, HostPathVolumeSource, PersistentVolumeClaimSpec, PersistentVolumeSpec,
    };

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

    fn claim(volume: &str) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data".into()),
                namespace: Some("shop".into()),
                uid: Some("c1".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec { volume_name: Some(volume.into()), ..Default::default() }),
            ..Default::default()
        }
    }

    fn pv(name: &str, driver: &str, claim_uid: &str) -> Move {
        let claim_ref = ObjectReference {
            namespace: Some("shop".into()),
            name: Some("data".into()),
            uid: Some(claim_uid.into()),
            ..Default::default()
        };
        let csi =
            CSIPersistentVolumeSource { driver: driver.into(), volume_handle: "_/v".into(), ..Default::default() };
        let spec = PersistentVolumeSpec { claim_ref: Some(claim_ref), csi: Some(csi), ..Default::default() };
        let meta = ObjectMeta { name: Some(name.into()), ..Default::default() };
        Move { old_uid: "old".into(), pv: PersistentVolume { metadata: meta, spec: Some(spec), ..Default::default() } }
    }

    #[test]
    fn only_this_drivers_pv_for_the_claim_bound_to_it_is_created() {
        const D: &str = "csi.ferrite.dev";
        assert_eq!(checked(&pv("pvc-1", D, "c1"), D, &claim("pvc-1")), Ok(()));
        let refused = |m: Move, c: PersistentVolumeClaim| checked(&m, D, &c).unwrap_err();
        assert!(refused(pv("pvc-1", "other.csi", "c1"), claim("pvc-1")).contains("not be a volume of"));
        assert!(refused(pv("grab", D, "c1"), claim("pvc-1")).contains("not to PersistentVolume grab"));
        assert!(refused(pv("pvc-1", D, "c2"), claim("pvc-1")).contains("another claim"));
        let mut host = pv("pvc-1", D, "c1");
        host.pv.spec.as_mut().unwrap().host_path = Some(HostPathVolumeSource { path: "/".into(), type_: None });
        assert!(refused(host, claim("pvc-1")).contains("source besides"));
        let mut unbound = claim("pvc-1");
        unbound.spec.as_mut().unwrap().volume_name = None;
        assert!(refused(pv("pvc-1", D, "c1"), unbound).contains("bound to None"));
    }
}
