//! Failover of a fleet, simulated: the real controller (`ferrite_csi::kube::failover`: its watches of
//! a real API server, its passes, its gRPC calls) against N daemons reduced to what failover
//! calls, in this process, each on a loopback address of its own. Every volume has three copies
//! in three zones. A zone (a third of the nodes) goes silent at once: its daemons stop answering
//! (calls hang, as to a powered-off host behind a live switch) and their storage heartbeats
//! expire. The test checks that every volume whose primary was there gets a new primary on a
//! surviving copy, and only those, and prints how long that took (a table row per size; targets
//! live in the table, not in an assert: the bound below only keeps a hung run from
//! waiting forever). FERRITE_SIM (default "51:1,51:17,501:1,501:167") lists the runs: nodes and
//! how many of them are lost (from the first zone).

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::kube::ControlPlane;
use ferrite_csi::kube::failover::Metrics;
use ferrite_csi::shared::nodes::{Connections, NodeDirectory};
use ferrite_proto::ClientTls;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_server::{Admin, AdminServer};
use tonic::{Request, Response, Status};

const PORT: u16 = 7070;

struct Vol {
    name: String,
    /// Member node indexes, one per zone.
    members: [usize; 3],
    primary: usize,
    generation: u64,
}

/// What the daemons hold together: which node is silent, each volume's membership.
struct World {
    ips: Vec<String>,
    silent: Vec<bool>,
    volumes: Vec<Vol>,
    /// When each volume was promoted, and where.
    promoted: BTreeMap<usize, (Instant, usize)>,
    fence_calls: u64,
}

impl World {
    fn endpoint(&self, node: usize) -> String {
        format!("tcp://{}:{PORT}", self.ips[node])
    }
}

/// One node's daemon: the admin RPCs failover makes.
struct Daemon {
    me: usize,
    world: Arc<Mutex<World>>,
}

impl Daemon {
    /// A silent node's calls never end (the caller's timeout does).
    async fn answer(&self) {
        if self.world.lock().unwrap().silent[self.me] {
            std::future::pending::<()>().await;
        }
    }

    fn view(&self, w: &World, v: &Vol) -> pb::SyncVolume {
        let members = v
            .members
            .iter()
            .map(|&m| pb::SyncMember {
                endpoint: w.endpoint(m),
                state: if m == v.primary { "primary" } else { "in-sync" }.into(),
                ..Default::default()
            })
            .collect();
        pb::SyncVolume {
            volume: v.name.clone(),
            role: if v.primary == self.me { "primary" } else { "replica" }.into(),
            generation: v.generation,
            primary: w.endpoint(v.primary),
            members,
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl Admin for Daemon {
    async fn pool_status(&self, _: Request<pb::PoolStatusRequest>) -> Result<Response<pb::PoolStatusResponse>, Status> {
        self.answer().await;
        Ok(Response::new(pb::PoolStatusResponse::default()))
    }

    async fn list_sync_replicas(
        &self,
        _: Request<pb::ListReplicationsRequest>,
    ) -> Result<Response<pb::ListSyncReplicasResponse>, Status> {
        self.answer().await;
        let w = self.world.lock().unwrap();
        let volumes = w.volumes.iter().filter(|v| v.members.contains(&self.me)).map(|v| self.view(&w, v)).collect();
        Ok(Response::new(pb::ListSyncReplicasResponse { volumes }))
    }

    async fn fence_networks(&self, _: Request<pb::FenceRequest>) -> Result<Response<pb::FenceResponse>, Status> {
        self.answer().await;
        self.world.lock().unwrap().fence_calls += 1;
        Ok(Response::new(pb::FenceResponse::default()))
    }

    async fn unfence_networks(&self, _: Request<pb::FenceRequest>) -> Result<Response<pb::FenceResponse>, Status> {
        self.answer().await;
        Ok(Response::new(pb::FenceResponse::default()))
    }

    /// The daemons' rule: a copy takes over only with a majority of its members answering.
    async fn promote_sync_replica(
        &self,
        req: Request<pb::PromoteReplicationRequest>,
    ) -> Result<Response<pb::SyncVolume>, Status> {
        self.answer().await;
        let mut w = self.world.lock().unwrap();
        let at = w
            .volumes
            .iter()
            .position(|v| v.name == req.get_ref().volume)
            .ok_or_else(|| Status::not_found("no such volume"))?;
        let answering = w.volumes[at].members.iter().filter(|&&m| !w.silent[m]).count();
        if !w.volumes[at].members.contains(&self.me) || answering < 2 {
            return Err(Status::unavailable("no majority of the members answers"));
        }
        let v = &mut w.volumes[at];
        v.primary = self.me;
        v.generation += 1;
        w.promoted.insert(at, (Instant::now(), self.me));
        let view = self.view(&w, &w.volumes[at]);
        Ok(Response::new(view))
    }
}

#[derive(Debug)]
struct Directory {
    names: Vec<String>,
    ips: Vec<String>,
    kept: Connections,
}

impl NodeDirectory for Directory {
    fn nodes(&self) -> Vec<String> {
        self.names.clone()
    }
    fn admin_endpoint(&self, node: &str) -> Option<String> {
        let i = self.names.iter().position(|n| n == node)?;
        Some(format!("tcp://{}:{PORT}", self.ips[i]))
    }
    fn tls(&self) -> Option<Arc<ClientTls>> {
        None
    }
    fn connections(&self) -> Option<&Connections> {
        Some(&self.kept)
    }
}

fn name(i: usize) -> String {
    format!("sim-{i:03}")
}

fn lease(i: usize, renewed: &str, secs: u32) -> serde_json::Value {
    serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": format!("ferrite-node-{}", name(i)), "namespace": "ferrite-node-lease"},
        "spec": {"holderIdentity": name(i), "leaseDurationSeconds": secs, "renewTime": renewed}})
}

fn list(items: Vec<serde_json::Value>) -> String {
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

/// A Lease's MicroTime (RFC 3339, UTC) of `t`.
fn micro(t: std::time::SystemTime) -> String {
    let t = time::OffsetDateTime::from(t);
    let (y, mo, d) = (t.year(), u8::from(t.month()), t.day());
    let (h, mi, s, us) = (t.hour(), t.minute(), t.second(), t.microsecond());
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{us:06}Z")
}

/// One run at `n` nodes: what the table prints.
async fn run(cp: &ControlPlane, n: usize, lose: usize, world: Arc<Mutex<World>>, metrics: &Metrics) -> String {
    let lost: Vec<usize> = (0..lose).collect();
    let affected: Vec<usize> = {
        let w = world.lock().unwrap();
        (0..w.volumes.len()).filter(|&v| lost.contains(&w.volumes[v].primary)).collect()
    };
    let fault = Instant::now();
    {
        let mut w = world.lock().unwrap();
        for &i in &lost {
            w.silent[i] = true;
        }
    }
    // Their heartbeats were renewed for the last time now, for a second, all at once.
    let last = micro(std::time::SystemTime::now());
    cp.with_stdin(&["replace", "-f", "-"], &list(lost.iter().map(|&i| lease(i, &last, 1)).collect()));
    let limit = Duration::from_secs(std::env::var("FERRITE_SIM_LIMIT_S").map_or(300, |s| s.parse().unwrap()));
    loop {
        let done = {
            let w = world.lock().unwrap();
            affected.iter().filter(|v| w.promoted.contains_key(v)).count()
        };
        if done == affected.len() {
            break;
        }
        assert!(fault.elapsed() < limit, "{n} nodes: {done} of {} volumes promoted after {limit:?}", affected.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (times, fence_calls) = {
        let w = world.lock().unwrap();
        for (v, (_, to)) in &w.promoted {
            assert!(affected.contains(v), "volume {v} was promoted although its primary was not lost");
            assert!(!lost.contains(to), "volume {v} was promoted on a lost node");
            assert!(w.volumes[*v].members.contains(to));
        }
        let times: Vec<f64> = affected.iter().map(|v| w.promoted[v].0.duration_since(fault).as_secs_f64()).collect();
        (times, w.fence_calls)
    };
    let first = times.iter().copied().fold(f64::INFINITY, f64::min);
    let last = times.iter().copied().fold(0.0, f64::max);
    // The controller's metrics say the same, once the last promotions' answers reached it.
    let promoted = format!("ferrite_failover_promotions_total{{outcome=\"promoted\"}} {}", affected.len());
    let counted = Instant::now();
    while !metrics.render().lines().any(|l| l == promoted) && counted.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = metrics.render();
    let value = |line: &str| -> f64 {
        let found = text.lines().find_map(|l| l.strip_prefix(line)?.strip_prefix(' '));
        found.unwrap_or_else(|| panic!("{line} not in:\n{text}")).parse().unwrap()
    };
    assert_eq!(value("ferrite_failover_leader"), 1.0);
    assert_eq!(value("ferrite_failover_nodes_lost_total"), lose as f64);
    assert_eq!(value("ferrite_failover_promotions_total{outcome=\"promoted\"}"), affected.len() as f64);
    assert_eq!(value("ferrite_failover_recovery_seconds_count"), affected.len() as f64);
    let mean = value("ferrite_failover_recovery_seconds_sum") / affected.len() as f64;
    // From the last renewal (a clock read just after `fault`, kept to the microsecond) to each promotion,
    // which the controller times when the promotion's answer reaches it.
    assert!(mean > first - 0.5 && mean < last + 1.0, "mean recovery {mean:.1} s, promotions {first:.1}-{last:.1} s");
    assert_eq!(value("ferrite_failover_errors_total"), 0.0);
    format!("| {n} | {} | {} | {first:.1} s | {last:.1} s | {fence_calls} |", lost.len(), affected.len())
}

#[test]
fn a_zone_lost_at_once_fails_over_together() {
    let Some(bin) = common::kube::binaries() else { return };
    let runs: Vec<(usize, usize)> = std::env::var("FERRITE_SIM")
        .unwrap_or_else(|_| "51:1,51:17,501:1,501:167".into())
        .split(',')
        .map(|r| {
            let (n, lost) = r.trim().split_once(':').unwrap();
            (n.parse().unwrap(), lost.parse().unwrap())
        })
        .collect();
    let mut rows = Vec::new();
    for (n, lose) in runs {
        assert!(lose <= n / 3, "the lost nodes are in one zone");
        let dir = tempfile::tempdir().unwrap();
        let cp = ControlPlane::start(dir.path(), &bin, None);
        // A runtime per size: dropping it ends that controller and its daemons.
        let rt = controller_runtime(&cp);
        rows.push(rt.block_on(fleet(&cp, n, lose)));
    }
    println!("| nodes | lost at once | volumes whose primary was lost | first promoted | all promoted | fence calls |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
}

/// The controller's account on `cp` (a token: rustls takes no v1 client certificate, which the
/// test CA's admin one is) in KUBECONFIG, and a runtime for the controller and its daemons.
fn controller_runtime(cp: &ControlPlane) -> tokio::runtime::Runtime {
    cp.ok(&["create", "serviceaccount", "ferrite-controller"]);
    cp.ok(&[
        "create",
        "clusterrolebinding",
        "sim",
        "--clusterrole=cluster-admin",
        "--serviceaccount=default:ferrite-controller",
    ]);
    let kubeconfig = cp.token_kubeconfig("default", "ferrite-controller", "controller.kubeconfig");
    // SAFETY: set before the runtime (and so the controller's client) exists; no other thread
    // of this process reads the environment.
    unsafe { std::env::set_var("KUBECONFIG", &kubeconfig) };
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Starts the daemons of `world` (one per node, on its address) and the controller over them.
async fn daemons_and_controller(world: &Arc<Mutex<World>>, n: usize) -> Arc<Metrics> {
    let ips = world.lock().unwrap().ips.clone();
    for (i, ip) in ips.iter().enumerate() {
        let svc = AdminServer::new(Daemon { me: i, world: Arc::clone(world) });
        let listener = tokio::net::TcpListener::bind((ip.as_str(), PORT)).await.unwrap();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming));
    }
    let directory = Arc::new(Directory { names: (0..n).map(name).collect(), ips, kept: Connections::default() });
    let metrics = Arc::new(Metrics::default());
    let after = Duration::from_secs(20);
    ferrite_csi::kube::failover::start(directory, DRIVER, after, "ferrite-node-lease", false, Arc::clone(&metrics))
        .await
        .unwrap();
    metrics
}

const DRIVER: &str = "csi.ferrite.dev";

/// Five nodes. Node 0 is lost; node 3's daemon is silent all along while its heartbeat stays
/// fresh (a daemon the controller cannot reach, or one in a planned restart). Volume `a` lives
/// on nodes 0, 1 and 2; volume `b` on 0, 3 and 4. Each has a pod on node 0. Node 3 holds
/// nothing of `a`: the fence holds on every daemon holding `a`, so `a` is promoted and its pod
/// released at once. Node 3 holds `b`: the lost node might still write `b` through it, so `b`'s
/// pod stays, counted and named in an Event, until the fence holds there.
#[test]
fn a_silent_bystander_holds_up_no_release() {
    let Some(bin) = common::kube::binaries() else { return };
    let dir = tempfile::tempdir().unwrap();
    let cp = ControlPlane::start(dir.path(), &bin, None);
    let rt = controller_runtime(&cp);
    rt.block_on(async {
        let n = 5;
        cp.ok(&["create", "namespace", "ferrite-node-lease"]);
        let nodes =
            (0..n).map(|i| serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name(i)}}));
        cp.with_stdin(&["create", "-f", "-"], &list(nodes.collect()));
        let now = micro(std::time::SystemTime::now());
        cp.with_stdin(&["create", "-f", "-"], &list((0..n).map(|i| lease(i, &now, 3600)).collect()));
        let mut objects = Vec::new();
        for v in ["a", "b"] {
            objects.push(serde_json::json!({"apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": format!("pv-{v}")},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                    "claimRef": {"namespace": "default", "name": format!("data-{v}")},
                    "csi": {"driver": DRIVER, "volumeHandle": format!("_/vol-{v}")}}}));
            objects.push(serde_json::json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("pod-{v}"), "namespace": "default"},
                "spec": {"nodeName": name(0), "automountServiceAccountToken": false,
                    "containers": [{"name": "app", "image": "app"}],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": format!("data-{v}")}}]}}));
        }
        // The ServiceAccount admission wants the namespace's default account, which the
        // controller manager makes a moment after it starts.
        let text = list(objects);
        let start = Instant::now();
        loop {
            let out = cp.kubectl(&["get", "serviceaccount", "default", "-o", "name"]);
            if out.status.success() {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "no default ServiceAccount");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        cp.with_stdin(&["create", "-f", "-"], &text);

        let ips: Vec<String> = (0..n).map(|i| format!("127.0.9.{}", 1 + i)).collect();
        let vol = |k: &str, members: [usize; 3]| Vol { name: format!("vol-{k}"), members, primary: 0, generation: 1 };
        let world = Arc::new(Mutex::new(World {
            ips,
            silent: vec![false, false, false, true, false],
            volumes: vec![vol("a", [0, 1, 2]), vol("b", [0, 3, 4])],
            promoted: BTreeMap::new(),
            fence_calls: 0,
        }));
        let metrics = daemons_and_controller(&world, n).await;
        tokio::time::sleep(Duration::from_secs(8)).await;
        assert!(world.lock().unwrap().promoted.is_empty(), "nothing moves before a node is lost");

        // Node 0 is lost: its daemon goes silent and its heartbeat expires.
        world.lock().unwrap().silent[0] = true;
        let last = micro(std::time::SystemTime::now());
        cp.with_stdin(&["replace", "-f", "-"], &list(vec![lease(0, &last, 1)]));
        let pods = || {
            let out = cp.ok(&["get", "pods", "-o", "name"]);
            out.lines().map(str::to_owned).collect::<Vec<_>>()
        };
        let fault = Instant::now();
        while pods().contains(&"pod/pod-a".to_owned()) {
            assert!(fault.elapsed() < Duration::from_secs(60), "pod-a is still on the lost node: {:?}", pods());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let released = fault.elapsed();
        let a_to = world.lock().unwrap().promoted.get(&0).map(|p| p.1);
        assert!(matches!(a_to, Some(1 | 2)), "a is promoted on one of its copies: {a_to:?}");
        // b's pod stays while node 3 lacks the fence, pass after pass, and says why.
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(pods(), vec!["pod/pod-b".to_owned()]);
        let withheld =
            metrics.render().lines().find(|l| l.starts_with("ferrite_failover_release_withheld ")).map(str::to_owned);
        assert_eq!(withheld.as_deref(), Some("ferrite_failover_release_withheld 1"));
        let events = cp.ok(&["get", "events", "-A", "--field-selector", "reason=FenceIncomplete", "-o", "json"]);
        assert!(events.contains(&name(3)) && events.contains("vol-b"), "{events}");
        assert!(!world.lock().unwrap().promoted.contains_key(&1), "b has no majority: not promoted");

        // Node 3 answers again and takes the fence: b's pod goes too.
        world.lock().unwrap().silent[3] = false;
        let back = Instant::now();
        while !pods().is_empty() {
            assert!(back.elapsed() < Duration::from_secs(30), "pod-b stays after the fence holds: {:?}", pods());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        println!("a silent bystander: pod-a released {released:.1?} after the loss; pod-b once node 3 took the fence");
    });
}

/// `n` nodes in three zones, their daemons and the controller; then `lose` of them lost.
async fn fleet(cp: &ControlPlane, n: usize, lose: usize) -> String {
    cp.ok(&["create", "namespace", "ferrite-node-lease"]);
    let nodes = (0..n).map(|i| serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name(i)}}));
    cp.with_stdin(&["create", "-f", "-"], &list(nodes.collect()));
    let now = micro(std::time::SystemTime::now());
    cp.with_stdin(&["create", "-f", "-"], &list((0..n).map(|i| lease(i, &now, 3600)).collect()));

    // Two volumes per node as primary, their copies at the same place in the two other zones.
    let ips: Vec<String> = (0..n).map(|i| format!("127.0.{}.{}", 1 + i / 200, 1 + i % 200)).collect();
    let zone = n / 3;
    let volumes = (0..2 * n)
        .map(|k| {
            let p = k % (3 * zone);
            let (z, at) = (p / zone, p % zone);
            let member = |dz: usize| ((z + dz) % 3) * zone + at;
            Vol { name: format!("vol-{k:04}"), members: [p, member(1), member(2)], primary: p, generation: 1 }
        })
        .collect();
    let world = Arc::new(Mutex::new(World {
        ips: ips.clone(),
        silent: vec![false; n],
        volumes,
        promoted: BTreeMap::new(),
        fence_calls: 0,
    }));
    let metrics = daemons_and_controller(&world, n).await;
    // The watches fill their stores; the first passes see every node healthy.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(world.lock().unwrap().promoted.is_empty(), "nothing moves while every node is healthy");
    assert_eq!(
        metrics.render().lines().find(|l| l.starts_with("ferrite_failover_lost_nodes ")),
        Some("ferrite_failover_lost_nodes 0")
    );
    run(cp, n, lose, world, &metrics).await
}
