//! What a volume's PersistentVolume says, for what a volume made by an earlier release does not
//! carry in its context. Only the controller's account writes this driver's PVs (the admission
//! policy `ferrite-controller-pvs`), so a PV is the controller's own record.

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, ListParams};

/// Whether the PV of `driver`'s volume `volume_id` has no node affinity (a remote-access volume,
/// accessible from every node); None when no PV names it. Pages through the PVs: called only for
/// volumes whose context predates the `remoteAccess` key.
pub async fn remote_access(client: &kube::Client, driver: &str, volume_id: &str) -> kube::Result<Option<bool>> {
    let api: Api<PersistentVolume> = Api::all(client.clone());
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await?;
        for spec in page.items.iter().filter_map(|pv| pv.spec.as_ref()) {
            if spec.csi.as_ref().is_some_and(|c| c.driver == driver && c.volume_handle == volume_id) {
                return Ok(Some(spec.node_affinity.is_none()));
            }
        }
        match page.metadata.continue_ {
            Some(next) if !next.is_empty() => params = params.continue_token(&next),
            _ => return Ok(None),
        }
    }
}
