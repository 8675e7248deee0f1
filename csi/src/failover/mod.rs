//! Automatic failover of replicated volumes (controller mode, with the Kubernetes node
//! directory). Every few seconds the controller reads the Nodes:
//!
//! - A node is lost when its daemon does not answer (or its pool failed) and either its Ready
//!   condition has not been True for `--failover-after`, or its storage heartbeat's Lease
//!   (`heartbeat.rs`) has expired: a crash-looping or hung daemon, or a dead pool device, on a
//!   node the kubelet keeps Ready. Its addresses are fenced on every other daemon (they refuse
//!   and cut its connections: a primary cut off from its members cannot record a generation,
//!   and it refuses writes without a majority), the Node is annotated so that the fence is
//!   known to be ours, and each volume whose primary was there is promoted on the most current
//!   in-sync copy: the daemons' generation rule decides (only an in-sync member of the newest
//!   generation a majority holds). A volume of two copies has no majority left; the fence is
//!   what makes promoting its in-sync survivor safe, so that promotion is forced. Events on the
//!   PV and its claim say what happened.
//! - Once the fence holds, the lost Node is tainted `node.kubernetes.io/out-of-service`
//!   (NoExecute): Kubernetes then detaches its volumes at once, and the pods there that use our
//!   volumes are deleted (`workload.rs`), so the workload is rescheduled next to the new primary
//!   instead of waiting for the eviction timeout and the attach-detach controller's six-minute
//!   force-detach. It is also tainted `failover.ferrite.dev/fenced` (NoSchedule) for as long as
//!   it is fenced.
//! - A fenced node whose Node is Ready, whose Lease is renewed and whose daemon answers again
//!   is rebuilt by the new primaries (from the last mark both hold: what changed); once it is in
//!   sync in every membership it belongs to, the fence is lifted, the annotation and our taints
//!   removed.
//! - A cordoned node's primaries are handed over to in-sync copies elsewhere, without a fence,
//!   volume by volume once it is not published (`maintenance.rs`).
//!
//! Stateless like the rest of the controller: the fences live in the daemons, the memberships
//! too, the annotation on the Node. Of several controller replicas only the holder of the
//! `ferrite-failover` Lease runs the loop (`lease.rs`). A node that never reported a Ready
//! condition is left alone.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferrite_proto::ferrite::v1 as pb;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, ObjectReference, PersistentVolume, Taint};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use tonic::Code;

use crate::nodes::{NodeDirectory, admin, trouble};

mod gone;
mod guard;
mod maintenance;
mod replace;
mod workload;

pub use guard::OVERRIDE;

/// The annotation on a Node the controller fenced: the blocks it fenced, comma-separated.
pub const FENCED: &str = "failover.ferrite.dev/fenced";
/// The owner of the fences failover makes: a NetworkFence's fence of the same block (or an
/// operator's) is a separate mark that failover's unfence leaves in place.
const FENCE_OWNER: &str = "failover";
/// The taint that has Kubernetes delete a lost node's pods and detach their volumes at once
/// (non-graceful node shutdown); ours carry [`TAINT_VALUE`], so that we remove only our own.
const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";
const TAINT_VALUE: &str = "ferrite-failover";
/// The Lease whose holder runs the failover loop, and how long a holder that stopped renewing
/// keeps it (several passes).
const LEASE: &str = "ferrite-failover";
const LEASE_FOR: Duration = Duration::from_secs(15);
/// How often the Nodes are looked at.
const EVERY: Duration = Duration::from_secs(3);
/// Every how many passes every daemon's memberships are read, for primaries on deleted nodes
/// (`gone.rs`) and lost copies (`replace.rs`).
const MEMBERSHIPS_EVERY: u32 = 5;
/// How long a daemon has to answer before it counts as unreachable.
const ANSWER: Duration = Duration::from_secs(5);

struct Failover {
    dir: Arc<dyn NodeDirectory>,
    client: kube::Client,
    nodes: Api<Node>,
    /// The Nodes and PersistentVolumes as watches keep them (no list of every one each pass).
    node_store: Store<Node>,
    volume_store: Store<PersistentVolume>,
    /// The nodes' storage heartbeats, and their namespace.
    heartbeats: Store<Lease>,
    lease_namespace: String,
    events: Recorder,
    /// The CSI driver name, to find its PersistentVolumes.
    driver: String,
    after: Duration,
    /// Taint a fenced node out-of-service (Kubernetes then detaches its volumes); without it,
    /// the controller deletes their VolumeAttachments itself.
    out_of_service: bool,
    /// Only the holder of the failover Lease runs a pass.
    leader: crate::lease::Leadership,
    /// Passes run so far (deleted nodes and lost copies are looked for every
    /// [`MEMBERSHIPS_EVERY`]).
    passes: std::sync::atomic::AtomicU32,
    lost_since: replace::LostSince,
}

/// The host of `tcp://host:port` (or `host:port`), without brackets.
fn host(endpoint: &str) -> &str {
    let hp = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    let h = hp.rsplit_once(':').map_or(hp, |(h, _)| h);
    h.trim_start_matches('[').trim_end_matches(']')
}

/// A Node's addresses.
fn addresses(n: &Node) -> impl Iterator<Item = String> + '_ {
    n.status.iter().flat_map(|s| s.addresses.iter().flatten()).map(|a| a.address.clone())
}

/// The fence block of one address (None for a name).
fn block(addr: &str) -> Option<String> {
    let ip = addr.parse::<std::net::IpAddr>().ok()?;
    Some(if ip.is_ipv4() { format!("{ip}/32") } else { format!("{ip}/128") })
}

/// Since when a Node's Ready condition is not True; None while it is True or was never reported.
fn not_ready_since(n: &Node) -> Option<Timestamp> {
    let c = n.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready")?;
    (c.status != "True").then(|| c.last_transition_time.as_ref().map_or(Timestamp::UNIX_EPOCH, |t| t.0))
}

/// How long a Lease has gone unrenewed, once that is longer than its own duration (None while
/// it holds). The duration is the Lease's: a heartbeat stopped on purpose renews for longer.
fn expired_for(lease: &Lease, now: Timestamp) -> Option<SignedDuration> {
    let spec = lease.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref()?.0;
    let since = now.duration_since(renewed);
    (since > SignedDuration::from_secs(i64::from(spec.lease_duration_seconds?))).then_some(since)
}

fn ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A store of every `K`, kept by a watch (with backoff) for as long as the process runs.
fn watched<K>(api: Api<K>) -> Store<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, watcher::Config::default())).default_backoff();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            if let Err(e) = ev {
                tracing::warn!("failover watch of {}: {e}", K::kind(&K::DynamicType::default()));
            }
        }
    });
    store
}

/// Starts the failover loop, with the client configuration kube-rs infers. Returns the drain
/// guard (`guard.rs`), which every replica answers, leader or not.
pub async fn start(
    dir: Arc<dyn NodeDirectory>,
    driver: &str,
    after: Duration,
    lease_namespace: &str,
    out_of_service: bool,
) -> anyhow::Result<Arc<dyn crate::webhook::Review>> {
    let client = kube::Client::try_default().await?;
    let me = std::env::var("POD_NAME").unwrap_or_else(|_| format!("ferrite-controller-{}", std::process::id()));
    let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| client.default_namespace().to_owned());
    let leader = crate::lease::Leadership::new(Api::namespaced(client.clone(), &namespace), LEASE, &me, LEASE_FOR);
    let reporter = Reporter { controller: "ferrite-failover".into(), instance: Some(me) };
    let nodes = Api::all(client.clone());
    let this = Arc::new(Failover {
        leader,
        dir,
        node_store: watched(Api::clone(&nodes)),
        volume_store: watched(Api::all(client.clone())),
        heartbeats: watched(Api::namespaced(client.clone(), lease_namespace)),
        lease_namespace: lease_namespace.to_owned(),
        nodes,
        events: Recorder::new(client.clone(), reporter),
        client,
        driver: driver.to_owned(),
        after,
        out_of_service,
        passes: std::sync::atomic::AtomicU32::new(0),
        lost_since: replace::LostSince::default(),
    });
    tracing::info!(after = ?after, "automatic failover of replicated volumes is on");
    let guard = Arc::clone(&this);
    tokio::spawn(async move {
        let synced = async {
            this.node_store.wait_until_ready().await?;
            this.heartbeats.wait_until_ready().await?;
            this.volume_store.wait_until_ready().await
        };
        if let Err(e) = synced.await {
            return tracing::error!("failover is off: the Node and PersistentVolume watches ended: {e}");
        }
        loop {
            match this.leader.hold().await {
                Ok(true) => {
                    if let Err(e) = this.pass().await {
                        tracing::warn!("failover pass: {e:#}");
                    }
                    let n = this.passes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if n.is_multiple_of(MEMBERSHIPS_EVERY) {
                        // Both read every daemon's memberships: one read serves the two.
                        let views = this.views("").await;
                        if let Err(e) = this.gone(&views).await {
                            tracing::warn!("failover of deleted nodes: {e:#}");
                        }
                        if let Err(e) = this.replace(&views).await {
                            tracing::warn!("replacing lost copies: {e:#}");
                        }
                    }
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("failover lease: {e:#}"),
            }
            tokio::time::sleep(EVERY).await;
        }
    });
    Ok(guard)
}

impl Failover {
    async fn pass(&self) -> anyhow::Result<()> {
        let now = Timestamp::now();
        for n in self.node_store.state() {
            let name = n.name_any();
            let not_ready = not_ready_since(&n)
                .map(|t| now.duration_since(t))
                .filter(|d| d.as_secs_f64() >= self.after.as_secs_f64());
            let silent = self
                .heartbeats
                .get(&ObjectRef::new(&crate::heartbeat::lease_name(&name)).within(&self.lease_namespace))
                .and_then(|l| expired_for(&l, now));
            let sign = match (not_ready, silent) {
                (Some(d), _) => Some(format!("not Ready for {}s", d.as_secs())),
                (None, Some(d)) => Some(format!("its storage heartbeat silent for {}s", d.as_secs())),
                (None, None) => None,
            };
            if let Some(sign) = sign {
                if let Some(why) = trouble(&*self.dir, &name, ANSWER).await {
                    self.fail_over(&n, &format!("{sign}, {why}")).await?;
                }
            } else if n.annotations().contains_key(FENCED)
                && ready(&n)
                && trouble(&*self.dir, &name, ANSWER).await.is_none()
            {
                self.rejoin(&n).await?;
            } else if maintenance::cordoned(&n)
                && ready(&n)
                && let Err(e) = self.hand_over(&n).await
            {
                tracing::warn!(node = %name, "planned handover: {e:#}");
            }
        }
        Ok(())
    }

    /// The other nodes' daemons that answer, with their view of every synchronous volume.
    async fn views(&self, except: &str) -> Vec<(String, Vec<pb::SyncVolume>)> {
        let mut out = Vec::new();
        for node in self.dir.nodes().into_iter().filter(|n| n != except) {
            let ask = async {
                let mut c = admin(&*self.dir, &node).await?;
                c.list_sync_replicas(pb::ListReplicationsRequest::default()).await
            };
            match tokio::time::timeout(ANSWER, ask).await {
                Ok(Ok(r)) => out.push((node, r.into_inner().volumes)),
                Ok(Err(e)) => tracing::warn!(node, error = %e.message(), "failover: daemon did not answer"),
                Err(_) => tracing::warn!(node, "failover: daemon did not answer within {ANSWER:?}"),
            }
        }
        out
    }

    /// Fences `blocks` (`fence`) or lifts them on every daemon but `except`'s.
    async fn fence(&self, except: &str, blocks: &[String], fence: bool) -> Result<(), String> {
        let mut failed = Vec::new();
        for node in self.dir.nodes().into_iter().filter(|n| n != except) {
            let req = pb::FenceRequest { cidrs: blocks.to_vec(), owner: FENCE_OWNER.into() };
            let done = async {
                let mut c = admin(&*self.dir, &node).await?;
                if fence { c.fence_networks(req).await } else { c.unfence_networks(req).await }
            };
            match tokio::time::timeout(ANSWER, done).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failed.push(format!("{node}: {}", e.message())),
                Err(_) => failed.push(format!("{node}: no answer")),
            }
        }
        if failed.is_empty() { Ok(()) } else { Err(failed.join("; ")) }
    }

    async fn annotate(&self, node: &str, value: Option<String>) -> anyhow::Result<()> {
        let patch = serde_json::json!({"metadata": {"annotations": {FENCED: value}}});
        self.nodes.patch(node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }

    /// Adds (`on`) or removes our taints of node `name`: out-of-service (NoExecute, unless
    /// turned off) and fenced (NoSchedule). A compare-and-swap on the Node's resourceVersion (the node lifecycle
    /// controller changes taints too): a concurrent change makes it fail, and the next pass
    /// tries again.
    async fn taint(&self, name: &str, on: bool) -> anyhow::Result<()> {
        let n = self.nodes.get(name).await?;
        let ours = [(OUT_OF_SERVICE, "NoExecute"), (FENCED, "NoSchedule")];
        let held = n.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        let is_ours = |t: &Taint| ours.iter().any(|(k, _)| t.key == *k) && t.value.as_deref() == Some(TAINT_VALUE);
        let mut taints: Vec<Taint> = held.iter().filter(|t| !is_ours(t)).cloned().collect();
        if on {
            let added = ours.iter().filter(|(key, _)| *key != OUT_OF_SERVICE || self.out_of_service);
            taints.extend(added.map(|(key, effect)| Taint {
                key: (*key).to_owned(),
                value: Some(TAINT_VALUE.to_owned()),
                effect: (*effect).to_owned(),
                time_added: None,
            }));
        }
        if taints.len() == held.len() && held.iter().all(|t| taints.contains(t)) {
            return Ok(());
        }
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": n.resource_version()},
            "spec": {"taints": taints},
        });
        self.nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        tracing::warn!(node = name, tainted = on, out_of_service = self.out_of_service, "node taints (ours)");
        Ok(())
    }

    /// Fences a lost node (lost as `why` says) and promotes a copy of every volume whose primary
    /// it held.
    async fn fail_over(&self, n: &Node, why: &str) -> anyhow::Result<()> {
        let name = n.name_any();
        let mut addrs: BTreeSet<String> = addresses(n).collect();
        if let Some(at) = self.dir.admin_endpoint(&name) {
            addrs.insert(host(&at).to_owned());
        }
        let blocks: Vec<String> = addrs.iter().filter_map(|a| block(a)).collect();
        if blocks.is_empty() {
            anyhow::bail!("node {name} is lost but has no address to fence: its volumes are not failed over");
        }
        if !n.annotations().contains_key(FENCED) {
            tracing::warn!(node = %name, fence = ?blocks, "node lost ({why}): fencing it");
            // The annotation first: a fence whose author is not written down would never be lifted.
            self.annotate(&name, Some(blocks.join(","))).await?;
        }
        let fenced = self.fence(&name, &blocks, true).await;
        if let Err(e) = &fenced {
            tracing::warn!(node = %name, "the fence does not hold everywhere yet: {e}");
        }
        // Volumes whose primary was on the lost node, with the copies that answer, newest first.
        let mut lost: BTreeMap<String, Vec<(u64, String, bool)>> = BTreeMap::new();
        for (node, views) in self.views(&name).await {
            let me = self.dir.admin_endpoint(&node).map(|e| host(&e).to_owned()).unwrap_or_default();
            for v in views.into_iter().filter(|v| addrs.contains(host(&v.primary)) && v.role == "replica") {
                let in_sync = v.members.iter().any(|m| host(&m.endpoint) == me && m.state == "in-sync");
                lost.entry(v.volume).or_default().push((v.generation, node.clone(), in_sync));
            }
        }
        for (volume, mut copies) in lost {
            copies.sort_by(|a, b| b.cmp(a));
            match self.promote(&volume, &copies, fenced.is_ok()).await {
                Ok((to, generation)) => {
                    let note = format!(
                        "node {name} was lost ({why}): fenced it and promoted the copy on {to} \
                         (generation {generation})"
                    );
                    tracing::warn!(volume, "{note}");
                    self.event(&volume, Some(n), EventType::Warning, "FailedOver", "Failover", note).await;
                }
                Err(e) => {
                    let note = format!("node {name} was lost, and no copy could be promoted yet: {e}");
                    tracing::error!(volume, "{note}");
                    self.event(&volume, Some(n), EventType::Warning, "FailoverPending", "Failover", note).await;
                }
            }
        }
        if fenced.is_ok() {
            // The node can no longer write anywhere: its pods may run elsewhere, now.
            self.taint(&name, true).await?;
            self.delete_pods(&name).await?;
            if !self.out_of_service {
                self.detach(&name).await?;
            }
        }
        Ok(())
    }

    /// Promotes the first copy the daemons accept; returns its node and generation. Without a
    /// majority (two copies), an in-sync copy is promoted by force, once the fence holds.
    async fn promote(
        &self,
        volume: &str,
        copies: &[(u64, String, bool)],
        fenced: bool,
    ) -> Result<(String, u64), String> {
        let mut refused = Vec::new();
        for (_, node, in_sync) in copies {
            let mut c = admin(&*self.dir, node).await.map_err(|e| e.message().to_owned())?;
            let req = |force| pb::PromoteReplicationRequest { volume: volume.to_owned(), force };
            let done = match c.promote_sync_replica(req(false)).await {
                Err(e) if e.code() == Code::Unavailable && *in_sync && fenced => {
                    tracing::warn!(
                        volume,
                        node,
                        "no majority of the copies answers: the fenced old primary \
                        cannot take writes, promoting the in-sync copy by force"
                    );
                    c.promote_sync_replica(req(true)).await
                }
                other => other,
            };
            match done {
                Ok(v) => return Ok((node.clone(), v.into_inner().generation)),
                Err(e) => refused.push(format!("{node}: {}", e.message())),
            }
        }
        Err(refused.join("; "))
    }

    /// Lifts the fence of a node that came back once every membership it is in has it in sync.
    async fn rejoin(&self, n: &Node) -> anyhow::Result<()> {
        let name = n.name_any();
        let blocks: Vec<String> =
            n.annotations().get(FENCED).map(|v| v.split(',').map(str::to_owned).collect()).unwrap_or_default();
        let hosts: BTreeSet<&str> = blocks.iter().map(|b| b.split_once('/').map_or(b.as_str(), |(h, _)| h)).collect();
        let mut member_of = Vec::new();
        for (_, views) in self.views(&name).await {
            for v in views.iter().filter(|v| v.role == "primary") {
                let Some(m) = v.members.iter().find(|m| hosts.contains(host(&m.endpoint))) else { continue };
                if m.state != "in-sync" {
                    tracing::info!(node = %name, volume = %v.volume, state = %m.state, reason = %m.reason,
                        "returning node not in sync yet; fence kept");
                    return Ok(());
                }
                member_of.push(v.volume.clone());
            }
        }
        self.fence(&name, &blocks, false).await.map_err(|e| anyhow::anyhow!("lifting the fence of {name}: {e}"))?;
        self.taint(&name, false).await?;
        self.annotate(&name, None).await?;
        tracing::info!(node = %name, volumes = ?member_of, "returned node in sync everywhere: fence lifted");
        for volume in member_of {
            let note = format!(
                "node {name} came back, was rebuilt from what changed and is in sync again; its fence is lifted"
            );
            self.event(&volume, Some(n), EventType::Normal, "Rejoined", "Rebuild", note).await;
        }
        Ok(())
    }

    /// An Event on the PersistentVolume of engine volume `volume`, and on its claim, related to
    /// the Node it is about (Events of one kind about another node, or another failover of the
    /// same one, are separate Events rather than a count on the first one's note).
    async fn event(
        &self,
        volume: &str,
        node: Option<&Node>,
        kind: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let pvs = self.volume_store.state();
        let pv = pvs.iter().find(|pv| {
            pv.spec.as_ref().and_then(|s| s.csi.as_ref()).is_some_and(|c| {
                c.driver == self.driver && crate::ids::parse(&c.volume_handle).is_some_and(|(_, v)| v == volume)
            })
        });
        let Some(pv) = pv else { return };
        let mut regarding: Vec<ObjectReference> = vec![pv.object_ref(&())];
        regarding.extend(pv.spec.as_ref().and_then(|s| s.claim_ref.clone()));
        let secondary = node.map(|n| n.object_ref(&()));
        let ev = Event { type_: kind, reason: reason.into(), note: Some(note), action: action.into(), secondary };
        for r in regarding {
            if let Err(e) = self.events.publish(&ev, &r).await {
                tracing::warn!(volume, "publishing an event: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn node(ready: Option<&str>) -> Node {
        let conditions = ready.map(|s| {
            vec![NodeCondition {
                type_: "Ready".into(),
                status: s.into(),
                last_transition_time: Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
                ..Default::default()
            }]
        });
        Node { status: Some(NodeStatus { conditions, ..Default::default() }), ..Default::default() }
    }

    #[test]
    fn reads_readiness_and_hosts() {
        assert!(ready(&node(Some("True"))) && not_ready_since(&node(Some("True"))).is_none());
        for s in ["False", "Unknown"] {
            assert!(!ready(&node(Some(s))));
            assert_eq!(not_ready_since(&node(Some(s))), Some(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        }
        // Never reported: neither ready nor lost.
        assert!(!ready(&node(None)) && not_ready_since(&node(None)).is_none());
        assert_eq!(host("tcp://10.0.0.5:7070"), "10.0.0.5");
        assert_eq!(host("tcp://[fd00::5]:7070"), "fd00::5");
        assert_eq!(host("10.0.0.5:7070"), "10.0.0.5");
    }

    #[test]
    fn a_lease_expires_after_its_own_duration() {
        use k8s_openapi::api::coordination::v1::LeaseSpec;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        let now = Timestamp::now();
        let lease = |ago: i64, duration: Option<i32>| Lease {
            spec: Some(LeaseSpec {
                renew_time: Some(MicroTime(now - SignedDuration::from_secs(ago))),
                lease_duration_seconds: duration,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(expired_for(&lease(5, Some(10)), now), None);
        assert_eq!(expired_for(&lease(12, Some(10)), now), Some(SignedDuration::from_secs(12)));
        // A heartbeat stopped on purpose renewed for its restart grace.
        assert_eq!(expired_for(&lease(60, Some(120)), now), None);
        // Incomplete Leases say nothing.
        assert_eq!(expired_for(&lease(60, None), now), None);
        assert_eq!(expired_for(&Lease::default(), now), None);
    }
}
