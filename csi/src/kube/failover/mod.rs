//! Automatic failover of replicated volumes (controller mode, with the Kubernetes node
//! directory). Every few seconds the controller reads the Nodes:
//!
//! - A node is lost when its daemon does not answer (or its pool failed) and either its Ready
//!   condition has not been True for `--failover-after`, or its storage heartbeat's Lease
//!   (`heartbeat.rs`) has expired: a crash-looping or hung daemon, or a dead pool device, on a
//!   node the kubelet keeps Ready. Its addresses are fenced on every other daemon (they refuse
//!   and cut its connections: a primary cut off from its members cannot record a generation,
//!   and it refuses writes without a majority), the fence is recorded (and the Node annotated)
//!   so that it is known to be ours, and each volume whose primary was there is promoted on the
//!   most current in-sync copy: the daemons' generation rule decides (only an in-sync member of the newest
//!   generation a majority holds). A volume of two copies has no majority left; the fence is
//!   what makes promoting its in-sync survivor safe, so that promotion is forced. Events on the
//!   PV and its claim say what happened.
//! - Once the fence holds, the pods on the lost node that use our volumes are deleted and our
//!   VolumeAttachments there too (`workload.rs`), so the workload is rescheduled next to the new
//!   primary instead of waiting for the eviction timeout and the attach-detach controller's
//!   six-minute force-detach. A lost Node that is not Ready is also tainted
//!   `failover.ferrite.dev/fenced` (NoSchedule) for as long as it is fenced, and, only when the
//!   operator asks for it (`--out-of-service-taint`), `node.kubernetes.io/out-of-service`; a
//!   Ready one is not tainted (it runs other applications' pods).
//! - Lost nodes are handled together, each node's errors its own (`lost.rs`).
//! - A fenced node whose Node is Ready, whose Lease is renewed and whose daemon answers again
//!   is rebuilt by the new primaries (from the last mark both hold: what changed); once it is in
//!   sync in every membership it belongs to, the fence is lifted, the annotation and our taints
//!   removed.
//! - A cordoned node's primaries are handed over to in-sync copies elsewhere, without a fence,
//!   volume by volume once it is not published (`maintenance.rs`).
//!
//! Stateless like the rest of the controller: the fences live in the daemons, the memberships
//! too, and which node each fence is for in a record in the controller's namespace
//! (`records.rs`; mirrored on the Node's annotation, which its kubelet could forge). Of several
//! controller replicas only the holder of the `ferrite-failover` Lease runs the loop (`lease.rs`). A node that never reported a Ready
//! condition is left alone.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferrite_proto::ferrite::v1 as pb;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, ObjectReference, PersistentVolume, Taint};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};

use crate::shared::nodes::{NodeDirectory, admin, trouble};

mod gone;
mod guard;
mod lost;
mod maintenance;
pub mod metrics;
mod protect;
mod pv_move;
mod records;
mod replace;
mod workload;

pub use guard::OVERRIDE;
pub use metrics::Metrics;

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
/// How long a failover waits for a daemon that did not answer the last time it was asked: a
/// silent bystander costs a pass this, not [`ANSWER`] (the periodic reads give it [`ANSWER`]).
const SILENT_ANSWER: Duration = Duration::from_secs(1);
/// How many daemons (or volumes) failover talks to at once: a zone of lost nodes costs a few
/// [`ANSWER`]s, not one per node.
const FAN_OUT: usize = 32;
/// How many Nodes a pass looks at at once: a look is one small call that a silent daemon makes
/// wait [`ANSWER`], so a zone of silent nodes is looked at in one [`ANSWER`], not one per 32.
const LOOK_FAN_OUT: usize = 256;

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
    /// The controller's own namespace, where only its account writes (the records of PV moves
    /// and of fences), and the fence records as a watch keeps them (`records.rs`).
    namespace: String,
    fence_records: Store<ConfigMap>,
    events: Recorder,
    /// The CSI driver name, to find its PersistentVolumes.
    driver: String,
    after: Duration,
    /// Taint a fenced node that is not Ready out-of-service (Kubernetes then deletes all its pods
    /// and detaches every driver's volumes); off by default: the controller deletes the pods
    /// using our volumes and our VolumeAttachments itself.
    out_of_service: bool,
    /// Only the holder of the failover Lease runs a pass, and every change checks it holds it
    /// still (`leading`); one renewal at a time.
    leader: crate::kube::lease::Leadership,
    renewing: tokio::sync::Mutex<()>,
    /// Passes run so far (deleted nodes and lost copies are looked for every
    /// [`MEMBERSHIPS_EVERY`]).
    passes: std::sync::atomic::AtomicU32,
    lost_since: replace::LostSince,
    /// The last volume the last replacement sweep stepped (the next starts after it), and
    /// whether a sweep is running (`replace.rs`).
    replaced_up_to: std::sync::Mutex<String>,
    sweeping: std::sync::atomic::AtomicBool,
    /// The daemons that did not answer the last time they were asked.
    silent: std::sync::Mutex<BTreeSet<String>>,
    metrics: Arc<Metrics>,
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

/// The taints failover puts on fenced node `n`: fenced (NoSchedule) and, when asked for
/// (`--out-of-service-taint`), out-of-service (NoExecute). Only on a node that is not Ready: a
/// Ready node (a dead daemon under a live kubelet) runs other applications' pods, which a
/// NoExecute taint would evict and a NoSchedule one keep from coming back; there failover
/// touches only the pods using our volumes and our VolumeAttachments.
fn ours(n: &Node, out_of_service: bool) -> Vec<(&'static str, &'static str)> {
    if ready(n) {
        return Vec::new();
    }
    let mut ours = vec![(FENCED, "NoSchedule")];
    if out_of_service {
        ours.push((OUT_OF_SERVICE, "NoExecute"));
    }
    ours
}

/// Whether failover's out-of-service taint goes on a fenced node: when `asked` for, and `safe`
/// (no volume's release waits for its fence) or ours is on already (`held`).
fn out_of_service_now(asked: bool, safe: bool, held: &[Taint]) -> bool {
    let put = held.iter().any(|t| t.key == OUT_OF_SERVICE && t.value.as_deref() == Some(TAINT_VALUE));
    asked && (safe || put)
}

/// A node's taints with ours (`wanted`, as key and effect) and no other of ours: the taints of
/// others are kept as they are, and one with the key and effect of ours stands in for it
/// (Kubernetes refuses two; we never remove or replace what we did not add).
fn taints(held: &[Taint], wanted: &[(&str, &str)]) -> Vec<Taint> {
    let is_ours =
        |t: &Taint| t.value.as_deref() == Some(TAINT_VALUE) && [FENCED, OUT_OF_SERVICE].contains(&t.key.as_str());
    let mut taints: Vec<Taint> = held.iter().filter(|t| !is_ours(t)).cloned().collect();
    for (key, effect) in wanted {
        let ours = held.iter().find(|t| t.key == *key && t.effect == *effect && is_ours(t));
        if taints.iter().any(|t| t.key == *key && t.effect == *effect) {
            continue;
        }
        taints.push(ours.cloned().unwrap_or_else(|| Taint {
            key: (*key).to_owned(),
            value: Some(TAINT_VALUE.to_owned()),
            effect: (*effect).to_owned(),
            time_added: None,
        }));
    }
    taints
}

fn ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A store of every `K`, kept by a watch (with backoff) for as long as the process runs.
fn watched<K>(api: Api<K>, config: watcher::Config) -> Store<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config)).default_backoff();
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
    metrics: Arc<Metrics>,
) -> anyhow::Result<Arc<dyn crate::kube::webhook::Review>> {
    let client = kube::Client::try_default().await?;
    let me = std::env::var("POD_NAME").unwrap_or_else(|_| format!("ferrite-controller-{}", std::process::id()));
    let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| client.default_namespace().to_owned());
    let leader =
        crate::kube::lease::Leadership::new(Api::namespaced(client.clone(), &namespace), LEASE, &me, LEASE_FOR);
    let reporter = Reporter { controller: "ferrite-failover".into(), instance: Some(me) };
    let nodes = Api::all(client.clone());
    let this = Arc::new(Failover {
        leader,
        renewing: tokio::sync::Mutex::new(()),
        dir,
        node_store: watched(Api::clone(&nodes), watcher::Config::default()),
        volume_store: watched(Api::all(client.clone()), watcher::Config::default()),
        heartbeats: watched(Api::namespaced(client.clone(), lease_namespace), watcher::Config::default()),
        lease_namespace: lease_namespace.to_owned(),
        fence_records: watched(
            Api::namespaced(client.clone(), &namespace),
            watcher::Config::default().labels(records::LABEL),
        ),
        namespace: namespace.clone(),
        nodes,
        events: Recorder::new(client.clone(), reporter),
        client,
        driver: driver.to_owned(),
        after,
        out_of_service,
        passes: std::sync::atomic::AtomicU32::new(0),
        lost_since: replace::LostSince::default(),
        replaced_up_to: std::sync::Mutex::default(),
        sweeping: std::sync::atomic::AtomicBool::new(false),
        silent: std::sync::Mutex::default(),
        metrics,
    });
    tracing::info!(after = ?after, "automatic failover of replicated volumes is on");
    let guard = Arc::clone(&this);
    tokio::spawn(async move {
        let synced = async {
            this.node_store.wait_until_ready().await?;
            this.heartbeats.wait_until_ready().await?;
            this.fence_records.wait_until_ready().await?;
            this.volume_store.wait_until_ready().await
        };
        if let Err(e) = synced.await {
            return tracing::error!("failover is off: the Node and PersistentVolume watches ended: {e}");
        }
        loop {
            let held = this.leader.hold().await;
            this.metrics.leader.set(i64::from(matches!(held, Ok(true))));
            match held {
                Ok(true) => {
                    this.pass().await;
                    this.metrics.passes.inc();
                    let n = this.passes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if n.is_multiple_of(MEMBERSHIPS_EVERY) {
                        // Both read every daemon's memberships: one read serves the two.
                        let views = this.views(&BTreeSet::new(), false).await;
                        if let Err(e) = this.gone(&views).await {
                            tracing::warn!("failover of deleted nodes: {e:#}");
                        }
                        // Replacement beside the passes, one sweep at a time (`replace.rs`).
                        if !this.sweeping.swap(true, std::sync::atomic::Ordering::AcqRel) {
                            let sweep = Arc::clone(&this);
                            tokio::spawn(async move {
                                if let Err(e) = sweep.replace(&views).await {
                                    tracing::warn!("replacing lost copies: {e:#}");
                                }
                                sweep.sweeping.store(false, std::sync::atomic::Ordering::Release);
                            });
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

/// What one pass makes of a Node.
enum Look {
    /// Lost since then, as the string says: failed over.
    Lost(String, Timestamp),
    /// Fenced by us, Ready, its daemon answers: rebuilt, then unfenced.
    Back,
    /// Its fence lifted but on some daemons: lifted there too.
    Unfence,
    /// Cordoned (maintenance) or its daemon pod stopping on purpose (as the string says): its
    /// unpublished primaries handed over.
    HandOver(&'static str),
    Fine,
}

impl Failover {
    /// Looks at every node at once ([`LOOK_FAN_OUT`] at a time), fails the lost ones over together,
    /// then lets the returned ones rejoin and the cordoned ones hand over; a node's error is
    /// its own.
    async fn pass(&self) {
        let now = Timestamp::now();
        let looks: Vec<(Arc<Node>, Look)> = futures_util::stream::iter(self.node_store.state())
            .map(|n| async move {
                let look = self.look(&n, now).await;
                (n, look)
            })
            .buffer_unordered(LOOK_FAN_OUT)
            .collect()
            .await;
        let lost: Vec<(Arc<Node>, String, Timestamp)> = looks
            .iter()
            .filter_map(|(n, l)| match l {
                Look::Lost(why, since) => Some((Arc::clone(n), why.clone(), *since)),
                _ => None,
            })
            .collect();
        self.metrics.lost_nodes.set(i64::try_from(lost.len()).unwrap_or(i64::MAX));
        if !lost.is_empty() {
            self.fail_over(lost).await;
        }
        // Returning nodes wait for their copies to be in sync: one read of the memberships
        // serves them all.
        let back = looks.iter().any(|(_, l)| matches!(l, Look::Back));
        let views = if back { self.views(&BTreeSet::new(), false).await } else { Vec::new() };
        let views = &views;
        futures_util::stream::iter(looks)
            .for_each_concurrent(FAN_OUT, |(n, look)| async move {
                let done = match look {
                    Look::Back => self.rejoin(&n, views).await,
                    Look::Unfence => self.unfence_rest(&n).await,
                    Look::HandOver(why) => self.hand_over(&n, why).await,
                    Look::Lost(..) | Look::Fine => Ok(()),
                };
                if let Err(e) = done {
                    self.failed(&n, &e).await;
                }
            })
            .await;
    }

    /// What node `n` needs: a node is lost when it is not Ready for `--failover-after` or its
    /// storage heartbeat expired, and its daemon does not answer (or its pool failed).
    async fn look(&self, n: &Node, now: Timestamp) -> Look {
        let name = n.name_any();
        let not_ready =
            not_ready_since(n).map(|t| now.duration_since(t)).filter(|d| d.as_secs_f64() >= self.after.as_secs_f64());
        let heartbeat = self
            .heartbeats
            .get(&ObjectRef::new(&crate::kube::heartbeat::lease_name(&name)).within(&self.lease_namespace));
        let silent = heartbeat.as_ref().and_then(|l| expired_for(l, now));
        let sign = match (not_ready, silent) {
            (Some(d), _) => Some((format!("not Ready for {}s", d.as_secs()), d)),
            (None, Some(d)) => Some((format!("its storage heartbeat silent for {}s", d.as_secs()), d)),
            (None, None) => None,
        };
        // Our records, not the Node's annotations (which its kubelet may write).
        let fenced = self.recorded(&name, FENCED).is_some();
        if let Some((sign, since)) = sign {
            return match trouble(&*self.dir, &name, ANSWER).await {
                Some(why) => Look::Lost(format!("{sign}, {why}"), now - since),
                None => Look::Fine,
            };
        }
        if !ready(n) {
            return Look::Fine;
        }
        if fenced {
            return if trouble(&*self.dir, &name, ANSWER).await.is_none() { Look::Back } else { Look::Fine };
        }
        if self.recorded(&name, lost::UNFENCE).is_some() {
            Look::Unfence
        } else if maintenance::cordoned(n, fenced) {
            Look::HandOver("is cordoned")
        } else if heartbeat.is_some_and(|l| l.annotations().contains_key(crate::kube::heartbeat::STOPPING)) {
            Look::HandOver("is restarting its daemon")
        } else {
            Look::Fine
        }
    }

    /// A node's failover step failed: a log line and a Warning Event on the Node; the pass goes on.
    async fn failed(&self, n: &Node, e: &anyhow::Error) {
        self.metrics.errors.inc();
        self.warn(n, "FailoverError", "Failover", e).await;
    }

    /// A lost node's release waits for its fence (`lost.rs`): a log line and a Warning Event on
    /// the Node, each pass until it holds.
    async fn fence_incomplete(&self, n: &Node, e: &anyhow::Error) {
        self.warn(n, "FenceIncomplete", "Release", e).await;
    }

    /// A log line and a Warning Event `reason` on Node `n`.
    async fn warn(&self, n: &Node, reason: &str, action: &str, e: &anyhow::Error) {
        let name = n.name_any();
        tracing::warn!(node = %name, "failover: {e:#}");
        let ev = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(format!("{e:#}")),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.events.publish(&ev, &n.object_ref(&())).await {
            tracing::warn!(node = %name, "publishing an event: {e}");
        }
    }

    /// The node each PersistentVolume of this driver names in its handle (a volume that lives
    /// there, or is served from there), by engine volume; not replicated ones' `_`.
    fn homes(&self) -> Vec<(String, String)> {
        let pvs = self.volume_store.state();
        let handles = pvs.iter().filter_map(|pv| pv.spec.as_ref()?.csi.as_ref().filter(|c| c.driver == self.driver));
        handles
            .filter_map(|c| crate::shared::ids::parse(&c.volume_handle))
            .filter(|(node, _)| *node != crate::shared::ids::ANY)
            .map(|(node, volume)| (volume.to_owned(), node.to_owned()))
            .collect()
    }

    /// Each node by its addresses (`all`'s) and its daemon's endpoint host (the directory's).
    fn by_host(&self, all: &[Arc<Node>]) -> BTreeMap<String, String> {
        let mut by_host: BTreeMap<String, String> =
            all.iter().flat_map(|n| addresses(n).map(|a| (a, n.name_any())).collect::<Vec<_>>()).collect();
        for n in self.dir.nodes() {
            if let Some(e) = self.dir.admin_endpoint(&n) {
                by_host.insert(host(&e).to_owned(), n);
            }
        }
        by_host
    }

    /// Before every change: this replica still holds the failover Lease with time to spare. It
    /// renewed it within a third of its duration, else renews it now; a replica that lost it (a
    /// pause, cut off from the API server) changes nothing more, so that two never act at once.
    async fn leading(&self) -> anyhow::Result<()> {
        let _one = self.renewing.lock().await;
        if self.leader.renewed_within(LEASE_FOR / 3) || self.leader.hold().await? {
            Ok(())
        } else {
            anyhow::bail!("this replica no longer holds the {LEASE} Lease: it changes nothing")
        }
    }

    /// How long to wait for `node`'s daemon: [`ANSWER`], or in a `hurry` (a failover) only
    /// [`SILENT_ANSWER`] if it did not answer the last time.
    fn wait_for(&self, node: &str, hurry: bool) -> Duration {
        let silent = hurry && self.silent.lock().expect("not poisoned").contains(node);
        if silent { SILENT_ANSWER } else { ANSWER }
    }

    /// Records whether `node`'s daemon answered.
    fn answered(&self, node: &str, answered: bool) {
        let mut silent = self.silent.lock().expect("not poisoned");
        if answered {
            silent.remove(node);
        } else {
            silent.insert(node.to_owned());
        }
    }

    /// The daemons outside `except` that answer, with their view of every synchronous volume
    /// ([`FAN_OUT`] asked at a time, each within [`Self::wait_for`]).
    async fn views(&self, except: &BTreeSet<String>, hurry: bool) -> Vec<(String, Vec<pb::SyncVolume>)> {
        let nodes = self.dir.nodes().into_iter().filter(|n| !except.contains(n));
        futures_util::stream::iter(nodes)
            .map(|node| async move {
                let ask = async {
                    let mut c = admin(&*self.dir, &node).await?;
                    c.list_sync_replicas(pb::ListReplicationsRequest::default()).await
                };
                let wait = self.wait_for(&node, hurry);
                let answer = tokio::time::timeout(wait, ask).await;
                self.answered(&node, matches!(answer, Ok(Ok(_))));
                match answer {
                    Ok(Ok(r)) => Some((node, r.into_inner().volumes)),
                    Ok(Err(e)) => {
                        tracing::warn!(node, error = %e.message(), "failover: daemon did not answer");
                        None
                    }
                    Err(_) => {
                        tracing::warn!(node, "failover: daemon did not answer within {wait:?}");
                        None
                    }
                }
            })
            .buffer_unordered(FAN_OUT)
            .filter_map(|v| async { v })
            .collect()
            .await
    }

    /// Fences `blocks` (`fence`) or lifts them on every daemon outside `except`: which did, and
    /// why each other one did not. Each call checks leadership first: a round over hundreds of
    /// daemons, some silent, outlasts one renewal.
    async fn fence(&self, except: &BTreeSet<String>, blocks: &[String], fence: bool, hurry: bool) -> protect::Fenced {
        let nodes: Vec<String> = self.dir.nodes().into_iter().filter(|n| !except.contains(n)).collect();
        let results: Vec<(String, Result<(), String>)> = futures_util::stream::iter(nodes)
            .map(|node| async move {
                if let Err(e) = self.leading().await {
                    return (node, Err(e.to_string()));
                }
                let req = pb::FenceRequest { cidrs: blocks.to_vec(), owner: FENCE_OWNER.into() };
                let done = async {
                    let mut c = admin(&*self.dir, &node).await?;
                    if fence { c.fence_networks(req).await } else { c.unfence_networks(req).await }
                };
                let done = tokio::time::timeout(self.wait_for(&node, hurry), done).await;
                self.answered(&node, matches!(done, Ok(Ok(_))));
                let done = match done {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(e.message().to_owned()),
                    Err(_) => Err("no answer".to_owned()),
                };
                (node, done)
            })
            .buffer_unordered(FAN_OUT)
            .collect()
            .await;
        self.metrics.fence_round(fence);
        let mut round = protect::Fenced::default();
        for (node, done) in results {
            match done {
                Ok(()) => round.held.insert(node),
                Err(why) => round.missing.insert(node, why).is_none(),
            };
        }
        round
    }

    /// Adds (`on`) or removes our taints of node `n` (`taints`). A compare-and-swap on the
    /// Node's resourceVersion (the node lifecycle controller changes taints too): a concurrent
    /// change makes it fail, and the next pass tries again. Returns whether the out-of-service
    /// taint is on the node (ours or someone else's).
    /// `out_of_service`: whether the out-of-service taint (if asked for) may go on now: it has
    /// Kubernetes release every driver's volumes, so not while a volume's fence is withheld (one
    /// put on earlier stays).
    async fn taint(&self, name: &str, on: bool, out_of_service: bool) -> anyhow::Result<bool> {
        let n = self.nodes.get(name).await?;
        let held = n.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        let wanted =
            if on { ours(&n, out_of_service_now(self.out_of_service, out_of_service, &held)) } else { Vec::new() };
        let taints = taints(&held, &wanted);
        let out_of_service = taints.iter().any(|t| t.key == OUT_OF_SERVICE);
        if taints.len() == held.len() && held.iter().all(|t| taints.contains(t)) {
            return Ok(out_of_service);
        }
        self.leading().await?;
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": n.resource_version()},
            "spec": {"taints": taints},
        });
        self.nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        tracing::warn!(node = name, tainted = ?wanted, "node taints (ours)");
        Ok(out_of_service)
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
                c.driver == self.driver && crate::shared::ids::parse(&c.volume_handle).is_some_and(|(_, v)| v == volume)
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

    fn taint(key: &str, value: &str, effect: &str) -> Taint {
        Taint { key: key.into(), value: Some(value.into()), effect: effect.into(), time_added: None }
    }

    #[test]
    fn failover_taints_only_a_node_that_is_not_ready_and_only_if_asked() {
        assert!(ours(&node(Some("True")), true).is_empty(), "a Ready node is never tainted");
        assert_eq!(ours(&node(Some("Unknown")), false), vec![(FENCED, "NoSchedule")]);
        assert_eq!(ours(&node(Some("False")), true), vec![(FENCED, "NoSchedule"), (OUT_OF_SERVICE, "NoExecute")]);
    }

    #[test]
    fn the_out_of_service_taint_waits_for_every_fence() {
        let theirs = [taint(OUT_OF_SERVICE, "nodeshutdown", "NoExecute")];
        let mine = [taint(OUT_OF_SERVICE, TAINT_VALUE, "NoExecute")];
        assert!(!out_of_service_now(false, true, &[]), "only when asked for");
        assert!(out_of_service_now(true, true, &[]));
        assert!(!out_of_service_now(true, false, &[]) && !out_of_service_now(true, false, &theirs));
        assert!(out_of_service_now(true, false, &mine), "one put on earlier stays");
    }

    #[test]
    fn never_removes_or_duplicates_a_taint_it_did_not_add() {
        let theirs = taint(OUT_OF_SERVICE, "nodeshutdown", "NoExecute");
        let other = taint("dedicated", "db", "NoSchedule");
        let held = vec![theirs.clone(), other.clone()];
        // Adding ours: the operator's out-of-service taint stands for ours (no 422 duplicate).
        let on = taints(&held, &[(FENCED, "NoSchedule"), (OUT_OF_SERVICE, "NoExecute")]);
        assert_eq!(on, vec![theirs.clone(), other.clone(), taint(FENCED, TAINT_VALUE, "NoSchedule")]);
        // Removing ours leaves theirs.
        assert_eq!(taints(&on, &[]), held);
        // Ours already there: unchanged (same time_added), and removed when no longer wanted.
        let mine = vec![other.clone(), taint(OUT_OF_SERVICE, TAINT_VALUE, "NoExecute")];
        assert_eq!(taints(&mine, &[(OUT_OF_SERVICE, "NoExecute")]), mine);
        assert_eq!(taints(&mine, &[(FENCED, "NoSchedule")]), vec![other, taint(FENCED, TAINT_VALUE, "NoSchedule")]);
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
