//! `ferrite daemon`: opens (or creates) the pool, serves NBD and the admin API, and shuts down
//! cleanly on SIGTERM/SIGINT (stop listening, drain the log, flush, checkpoint).

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::sync::Arc;

use anyhow::{Context, Result};
use ferrite_engine::{Pool, PoolOptions};
use ferrite_nbd::{Exports, Server};
use ferrite_proto::ferrite::v1::admin_server::AdminServer;
use ferrite_proto::ferrite::v1::backups_server::BackupsServer;
use ferrite_proto::ferrite::v1::mirror_server::MirrorServer;
use ferrite_proto::ferrite::v1::replica_server::ReplicaServer;
use ferrite_tls::ServerTls;
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::Connected;

use crate::api::admin::AdminService;
use crate::authz::Role;
use crate::authz::layer::{Authorize, Source};
use crate::base::config::Config;
use crate::base::size::format_size;
use crate::net::grpc::admin_server;
use crate::net::listen;
use crate::net::unix::bind_unix;
use crate::records::attachments::Attachments;
use crate::records::exports::ExportTable;
use crate::records::fence::NbdAdmission;

/// The engine's options as the configuration sets them.
pub fn pool_options(cfg: &Config) -> PoolOptions {
    PoolOptions {
        segment_size: cfg.segment_size,
        overcommit_ratio: cfg.overcommit_ratio,
        write_delay: cfg.write_delay,
        idle_cleaning: cfg.idle_cleaning,
        readahead: cfg.readahead,
        discard: cfg.pool_discard,
        ..PoolOptions::default()
    }
}

fn open_pool(cfg: &Config) -> Result<Pool> {
    let opts = pool_options(cfg);
    if cfg.pool_path.exists() {
        let pool = Pool::open(&cfg.pool_path, &cfg.meta_dir, opts).with_context(|| {
            let hint = if cfg.meta_dir.exists() {
                ""
            } else {
                " (no pool metadata yet: a device or an existing file is formatted with `ferrite pool format`)"
            };
            format!("opening pool {}{hint}", cfg.pool_path.display())
        })?;
        let r = pool.recovery_report();
        tracing::info!(
            uuid = %pool.stats().uuid,
            path = %cfg.pool_path.display(),
            replayed_batches = r.batches_replayed,
            from_tail = r.batches_from_tail,
            truncated = r.truncated.as_deref().unwrap_or("no"),
            "pool opened"
        );
        Ok(pool)
    } else {
        let size = cfg.pool_size.for_file(&cfg.pool_path, cfg.segment_size)?;
        let pool = Pool::create(&cfg.pool_path, &cfg.meta_dir, size, opts)
            .with_context(|| format!("creating pool {}", cfg.pool_path.display()))?;
        tracing::info!(uuid = %pool.stats().uuid, path = %cfg.pool_path.display(),
            size = %format_size(size), "pool created");
        Ok(pool)
    }
}

/// Binds an optional TCP listener.
async fn bind_tcp(addr: Option<std::net::SocketAddr>, what: &str) -> Result<Option<TcpListener>> {
    match addr {
        Some(a) => Ok(Some(TcpListener::bind(a).await.with_context(|| format!("binding {what} {a}"))?)),
        None => Ok(None),
    }
}

/// Makes what holds volume data private to the daemon: files it creates from now on get no
/// group or other bits (RocksDB's included), the data and metadata directories are 0700, and a
/// pool file is 0600. Modes an older daemon left looser are tightened, with a warning.
fn make_private(cfg: &Config) -> Result<()> {
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&cfg.data_dir)
        .with_context(|| format!("creating {}", cfg.data_dir.display()))?;
    let tighten = |path: &std::path::Path, mode: u32| -> Result<()> {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.permissions().mode() & 0o077 != 0 => {
                tracing::warn!(path = %path.display(), "tightening permissions: volume data is private to the daemon");
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                    .with_context(|| format!("restricting {}", path.display()))
            }
            _ => Ok(()),
        }
    };
    tighten(&cfg.data_dir, 0o700)?;
    if cfg.key_dir.is_dir() {
        tighten(&cfg.key_dir, 0o700)?;
    }
    if cfg.pool_path.is_file() {
        tighten(&cfg.pool_path, 0o600)?;
    }
    if cfg.meta_dir.is_dir() {
        tighten(&cfg.meta_dir, 0o700)?;
        for entry in std::fs::read_dir(&cfg.meta_dir)?.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_file()) {
                tighten(&entry.path(), 0o600)?;
            }
        }
    }
    Ok(())
}

/// The TLS server configs of the TCP listeners (None: plaintext), from `tls-cert`, `tls-key`
/// and `tls-client-ca`, reloaded when the files change.
struct TlsConfigs {
    nbd: Option<Arc<ServerTls>>,
    admin: Option<Arc<ServerTls>>,
    metrics: Option<Arc<ServerTls>>,
}

impl TlsConfigs {
    fn load(cfg: &Config) -> Result<Self> {
        let Some(t) = &cfg.tls else { return Ok(Self { nbd: None, admin: None, metrics: None }) };
        let make = |alpn: &[&[u8]]| -> Result<Option<Arc<ServerTls>>> {
            Ok(Some(Arc::new(ferrite_tls::reload::server(&t.cert, &t.key, t.client_ca.as_deref(), alpn)?)))
        };
        Ok(Self {
            nbd: make(&[])?,
            admin: if cfg.insecure_admin_listen { None } else { make(&[b"h2", crate::sync::wire::ALPN])? },
            metrics: make(&[b"http/1.1"])?,
        })
    }
}

/// Whether an NBD client's certificate identity holds `nbd-client` (or is an operator).
fn nbd_role(policy: &Arc<crate::authz::Policy>) -> ferrite_nbd::tls::RoleCheck {
    let policy = Arc::clone(policy);
    Arc::new(move |cert| policy.caller(&ferrite_tls::identities(cert)).acts_as(crate::authz::Role::NbdClient))
}

/// The services of the admin listeners, served alike on the Unix socket and on TCP.
#[derive(Clone)]
struct AdminServices {
    admin: AdminServer<AdminService>,
    backups: BackupsServer<crate::api::backups::BackupService>,
    replica: ReplicaServer<crate::replica::receive::ReplicaService>,
    mirror: MirrorServer<crate::sync::serve::MirrorService>,
}

impl AdminServices {
    /// Serves every service to the connections of `incoming`, each call through `authorize`.
    async fn serve<I, IO, IE>(self, authorize: Authorize, incoming: I, what: &'static str) -> Result<()>
    where
        I: tokio_stream::Stream<Item = Result<IO, IE>>,
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Connected + Unpin + Send + 'static,
        IE: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        admin_server()
            .layer(authorize)
            .add_service(self.admin)
            .add_service(self.replica)
            .add_service(self.mirror)
            .add_service(self.backups)
            .serve_with_incoming(incoming)
            .await
            .context(what)
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(cfg: Config) -> Result<()> {
    make_private(&cfg)?;
    let admin_listener = bind_unix(&cfg.admin_socket, 0o600)?;
    let nbd_listener = bind_unix(&cfg.nbd_socket, 0o660)?;
    let tcp = bind_tcp(cfg.nbd_listen, "NBD listener").await?;
    let admin_tcp = bind_tcp(cfg.admin_listen, "admin listener").await?;
    let fences = crate::records::fence::Fences::load(&cfg.data_dir)?;
    let metrics = bind_tcp(cfg.metrics_listen, "metrics listener").await?;
    let pool = {
        let cfg = cfg.clone();
        Arc::new(tokio::task::spawn_blocking(move || open_pool(&cfg)).await??)
    };
    // Before exports and devices come back: those of volumes whose key is here can serve.
    let keys = crate::records::keys::KeyDir::new(&cfg.key_dir);
    {
        let (keys, pool) = (keys.clone(), Arc::clone(&pool));
        tokio::task::spawn_blocking(move || keys.unlock_all(&pool)).await?;
    }
    let rotations = crate::records::rotations::Rotations::restore(Arc::clone(&pool), &cfg.data_dir)?;
    let policy = Arc::new(crate::authz::Policy::new(cfg.roles.clone()));
    // Primaries refuse writes until their membership is re-established: set before any export
    // or device can take a write.
    let sync = crate::sync::SyncHub::new(Arc::clone(&pool), Arc::clone(&policy), &cfg)?;
    sync.resume();
    // Restores still filling their volumes: each volume's fill is set before it can serve.
    let (restores, resuming) = crate::records::restores::Restores::load(Arc::clone(&pool), &cfg.data_dir)?;
    restores.resume(resuming, cfg.backup_targets.clone());
    let exports = Arc::new(Exports::default());
    let export_table = Arc::new(ExportTable::restore(Arc::clone(&pool), Arc::clone(&exports), &cfg.data_dir)?);
    {
        // A primary that stepped down ends its publication: its node's client sees the
        // connection cut rather than a read-only copy, and the volume can be published where
        // the new primary is.
        let (mut rx, exports) = (sync.steps_down(), Arc::clone(&export_table));
        tokio::spawn(async move {
            while let Some(volume) = rx.recv().await {
                if let Err(e) = crate::records::publications::unpublish(&exports, &volume).await {
                    tracing::warn!(volume, error = %e.message(), "the stepped-down volume's publication stays");
                }
            }
        });
    }
    let tls = TlsConfigs::load(&cfg)?;
    let mut nbd = Server::new(Arc::clone(&exports));
    nbd.admission = Some(Arc::new(NbdAdmission(Arc::clone(&fences))));
    nbd.limits = cfg.limits.nbd();
    nbd.tls = ferrite_nbd::tls::Tls { mode: cfg.nbd_tls, acceptor: tls.nbd.clone(), role: Some(nbd_role(&policy)) };
    let nbd = Arc::new(nbd);
    let links = crate::records::attachments::kernel_nbd::Links {
        nbd: Some(Arc::clone(&nbd)),
        tls: cfg.tls.clone(),
        hold: cfg.device_hold,
        request_timeout: cfg.nbd_device_timeout,
    };
    let attachments = Arc::new(
        Attachments::restore(Some(&pool), &cfg.data_dir, ferrite_ublk::hold::path(&cfg.admin_socket), links, cfg.ublk)
            .await?,
    );
    let mut tasks = tokio::task::JoinSet::new();
    {
        let nbd = Arc::clone(&nbd);
        tasks.spawn(async move { nbd.serve_unix_listener(nbd_listener).await.context("NBD unix listener") });
    }
    if let Some(l) = tcp {
        let nbd = Arc::clone(&nbd);
        tasks.spawn(async move { nbd.serve_tcp(l).await.context("NBD TCP listener") });
    }
    let replication = crate::replica::Replication::new(
        Arc::clone(&pool),
        Arc::clone(&export_table),
        Arc::clone(&attachments),
        &cfg,
        Arc::clone(&policy),
    )?;
    let listeners = crate::api::metrics::Listeners::default();
    let backup_outcomes = Arc::new(crate::records::backup_outcomes::BackupOutcomes::load(&cfg.data_dir));
    if let Some(l) = metrics {
        let stats = Arc::clone(&listeners.metrics);
        let gate =
            listen::Gate::new(Arc::clone(&policy), Some(&[Role::Operator, Role::Metrics]), cfg.limits.max_connections);
        let clients = listen::accept(
            l,
            "metrics",
            Arc::clone(&fences),
            &cfg.limits,
            tls.metrics.clone(),
            Some(Arc::new(gate)),
            stats,
        );
        let sources = crate::api::metrics::Sources {
            pool: Arc::clone(&pool),
            nbd: Arc::clone(&nbd),
            listeners: listeners.clone(),
            replication: Arc::clone(&replication),
            sync: Arc::clone(&sync),
            restores: Arc::clone(&restores),
            backups: Arc::clone(&backup_outcomes),
            fences: Arc::clone(&fences),
            tls_cert: cfg.tls.as_ref().map(|t| t.cert.clone()),
        };
        let limits = cfg.limits.clone();
        tasks.spawn(async move {
            crate::api::metrics::serve(clients, sources, limits).await;
            Err(anyhow::anyhow!("metrics listener stopped"))
        });
    }
    let outcomes = Arc::clone(&backup_outcomes);
    let found: ferrite_backup::Found = Arc::new(move |target, report| outcomes.verified(target, report));
    ferrite_backup::schedule_verifies(Arc::clone(&pool), &cfg.backup_targets, found);
    let services = AdminServices {
        admin: AdminServer::new(AdminService {
            pool: Arc::clone(&pool),
            nbd: Arc::clone(&nbd),
            cfg: cfg.clone(),
            exports: export_table,
            attachments: Arc::clone(&attachments),
            fences: Arc::clone(&fences),
            replication: Arc::clone(&replication),
            sync: Arc::clone(&sync),
            keys,
            rotations,
            policy: Arc::clone(&policy),
        }),
        backups: BackupsServer::new(crate::api::backups::BackupService::new(
            Arc::clone(&pool),
            cfg.backup_targets.clone(),
            crate::records::keys::KeyDir::new(&cfg.key_dir),
            restores,
            backup_outcomes,
            Arc::clone(&policy),
        )),
        replica: ReplicaServer::new(crate::replica::receive::ReplicaService(Arc::clone(&replication)))
            .max_decoding_message_size(crate::replica::MAX_PUSH_MESSAGE),
        mirror: MirrorServer::new(crate::sync::serve::MirrorService(Arc::clone(&sync)))
            .max_decoding_message_size(crate::sync::MAX_MESSAGE),
    };
    tokio::spawn(Arc::clone(&replication).schedule());
    if let Some(l) = admin_tcp {
        let gate = Arc::new(listen::Gate::new(Arc::clone(&policy), None, cfg.limits.max_connections));
        let clients = listen::accept(
            l,
            "admin",
            Arc::clone(&fences),
            &cfg.limits,
            tls.admin.clone(),
            Some(gate),
            listeners.admin,
        );
        tasks.spawn(serve_admin_tcp(clients, &cfg, tls.admin.is_some(), &policy, &sync, services.clone()));
    }
    let authorize = Authorize::new(policy, Source::Local);
    tasks.spawn(services.serve(authorize, UnixListenerStream::new(admin_listener), "admin API server"));
    tracing::info!(
        admin = %cfg.admin_socket.display(),
        nbd = %cfg.nbd_socket.display(),
        nbd_tcp = %cfg.nbd_listen.map(|a| a.to_string()).unwrap_or_else(|| "off".into()),
        admin_tcp = %cfg.admin_listen.map(|a| a.to_string()).unwrap_or_else(|| "off".into()),
        metrics = %cfg.metrics_listen.map(|a| a.to_string()).unwrap_or_else(|| "off".into()),
        "ferrite daemon ready"
    );
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let outcome = tokio::select! {
        _ = term.recv() => Ok("SIGTERM"),
        _ = int.recv() => Ok("SIGINT"),
        Some(r) = tasks.join_next() => Err(r.map_err(anyhow::Error::from).and_then(|r| r).err()
            .unwrap_or_else(|| anyhow::anyhow!("a listener stopped"))),
    };
    tasks.abort_all();
    shut_down(&cfg, &attachments, &exports, pool, outcome).await
}

/// The admin API on TCP (`admin-listen`), to the `clients` its listener accepted: synchronous
/// replicas' streams (their own ALPN) go to the mirror, the rest is gRPC.
fn serve_admin_tcp(
    mut clients: tokio::sync::mpsc::Receiver<listen::Guarded>,
    cfg: &Config,
    secure: bool,
    policy: &Arc<crate::authz::Policy>,
    sync: &Arc<crate::sync::SyncHub>,
    services: AdminServices,
) -> impl Future<Output = Result<()>> + use<> {
    if !secure {
        tracing::warn!(address = %cfg.admin_listen.map(|a| a.to_string()).unwrap_or_default(),
            "insecure-admin-listen: the admin API listens on TCP WITHOUT TLS OR AUTHENTICATION; \
             anyone who reaches this address controls the daemon");
    }
    // Synchronous replicas' streams (their own ALPN) go to the mirror; the rest is gRPC.
    let (grpc, incoming) = tokio::sync::mpsc::channel(16);
    let streams = crate::sync::serve::MirrorService(Arc::clone(sync));
    tokio::spawn(async move {
        while let Some(c) = clients.recv().await {
            if c.alpn() == Some(crate::sync::wire::ALPN) {
                tokio::spawn(crate::sync::serve::serve_framed(streams.clone(), c));
            } else if grpc.send(c).await.is_err() {
                break;
            }
        }
    });
    let incoming = tokio_stream::wrappers::ReceiverStream::new(incoming).map(Ok::<_, std::io::Error>);
    let source = if secure { Source::Certificate } else { Source::Local };
    let authorize = Authorize::new(Arc::clone(policy), source);
    services.serve(authorize, incoming, "admin API TCP server")
}

/// After the signal (or a listener's end, `outcome`): the sockets go, devices stay for the
/// next daemon, NBD connections end, the pool closes.
async fn shut_down(
    cfg: &Config,
    attachments: &Attachments,
    exports: &Exports,
    pool: Arc<Pool>,
    outcome: Result<&'static str>,
) -> Result<()> {
    let _ = std::fs::remove_file(&cfg.admin_socket);
    let _ = std::fs::remove_file(&cfg.nbd_socket);
    // Devices stay for the next daemon: ublk ones frozen (user recovery), kernel NBD ones cut
    // unrepaired; then every NBD client's connection ends before the pool closes, so none sees
    // an error for a request in flight (a closed pool would answer one).
    let _frozen = attachments.freeze().await;
    let cut = exports.close_all();
    if cut > 0 {
        tracing::info!(connections = cut, "NBD connections cut for shutdown");
    }
    let closed = tokio::task::spawn_blocking(move || pool.shutdown()).await?;
    match outcome {
        Ok(sig) => {
            closed.context("closing the pool")?;
            tracing::info!(signal = sig, "shut down cleanly: log drained, flushed, checkpointed");
            Ok(())
        }
        Err(e) => Err(e),
    }
}
