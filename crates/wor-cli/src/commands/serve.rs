//! `wor serve`.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use tokio::net::TcpListener;
use wor_engine::{Engine, EngineConfig};
use wor_secrets::ControlPlaneSigningKey;
use wor_server::AppState;
use wor_store::{AuditConfig, AuditLog, Store};

use crate::config::{KeySource, ServerConfig, ServerFlags};
use crate::env;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    flags: ServerFlags,
    /// Address to listen on [default: 127.0.0.1:8080].
    #[arg(long, env = env::LISTEN, value_name = "ADDR")]
    listen: Option<String>,
    /// Production mode: refuses demo mode, a missing or example encryption key, default database
    /// credentials and a plaintext listener on a public address with no TLS-ending proxy named.
    #[arg(long)]
    production: bool,
    /// How many runs this process drives at once [default: `workers` in the file, else 16].
    #[arg(long, env = env::WORKERS, value_name = "N",
          value_parser = clap::value_parser!(u16).range(1..))]
    workers: Option<u16>,
    /// What this process does: `all` (the API, the console, the scheduler and a worker pool:
    /// the embedded default), `api` (the API and the console only), `scheduler` (schedules,
    /// outboxes, expired leases and approvals; serves only /healthz and /readyz), `worker`
    /// (drives runs it claims from the control plane it enrolled with, `wor worker enroll`;
    /// no database, no encryption key).
    #[arg(long, env = env::ROLE, value_enum, default_value_t = Role::All)]
    role: Role,
}

/// What one `wor serve` process does; several processes with different roles share one
/// PostgreSQL database (docs/deployment.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Everything in one process.
    All,
    /// The HTTP API and the console, without the scheduler or a worker pool.
    Api,
    /// Schedules, webhook and notification outboxes, sweeps of expired leases and approvals.
    Scheduler,
    /// A runtime worker that talks only to the control plane.
    Worker,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::All => "all",
            Role::Api => "api",
            Role::Scheduler => "scheduler",
            Role::Worker => "worker",
        }
    }
}

pub async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut config = ServerConfig::resolve(&args.flags, args.listen.as_deref(), args.production)?;
    if let Some(workers) = args.workers {
        config.workers = usize::from(workers);
    }
    if args.role == Role::Worker {
        return super::serve_worker::run(&config).await;
    }
    let problems = config.production_problems();
    if !problems.is_empty() {
        for problem in &problems {
            eprintln!("error: production mode: {problem}");
        }
        eprintln!("error: refusing to start in production mode");
        return Ok(ExitCode::from(2));
    }
    let Reporting { metrics, traces } = reporting(&config)?;
    let tls = match &config.tls {
        Some(files) => Some(
            wor_server::tls::ReloadableTls::load(files.clone())
                .context("cannot set up TLS on the listener")
                .map_err(crate::UsageError)?,
        ),
        None => None,
    };
    // As `wor doctor` would warn: a certificate near its end, a CA's or one that names no
    // host is said when the server starts.
    if let Some(files) = &config.tls {
        warn_of_certificate(files);
    }
    // From here on SIGHUP (`systemctl reload`) reloads the certificate of a listener serving
    // TLS, and is otherwise only logged: never the default action, which would end the
    // process undrained, while it starts or once it serves.
    let hangup = spawn_hangup(tls.clone().filter(|_| args.role != Role::Scheduler))?;
    let (engine, audit) = open_engine(&config).await?;
    // The key that signs run envelopes is read before anything starts: a process that
    // cannot sign them claims no run and takes no request.
    let control_plane = match args.role {
        Role::All | Role::Api => Some(Arc::new(control_plane_key(&config)?)),
        Role::Scheduler | Role::Worker => None,
    };
    let store = engine.store().clone();
    let signalled = shutdown_signal()?;
    // The scheduler and the outboxes stop at the signal, while open requests drain: an
    // outbox then starts no further delivery, and waits only for those in flight.
    let (stop_triggers, triggers_stopped) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        signalled.await;
        let _ = stop_triggers.send(true);
    };
    let (stop_metrics, metrics_stopped) = tokio::sync::watch::channel(false);
    let metrics_served = match metrics {
        Some((handle, addr)) => {
            Some(serve_metrics(handle, addr, Some(store.clone()), metrics_stopped).await?)
        }
        None => None,
    };
    let (stop_traces, traces_stopped) = tokio::sync::watch::channel(false);
    let traces_sent =
        traces.map(|(exporter, spans)| export_traces(exporter, spans, traces_stopped));
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let local = listener.local_addr()?;
    tracing::info!(
        category = "lifecycle",
        listen = %local,
        database = store.backend().as_str(),
        production = config.production,
        role = args.role.as_str(),
        "server started"
    );
    let scheme = if tls.is_some() && args.role != Role::Scheduler {
        "https"
    } else {
        "http"
    };
    eprintln!("wor: listening on {scheme}://{local}");
    eprintln!("wor: role {}", args.role.as_str());
    let (stop_workers, workers_stopped) = tokio::sync::watch::channel(false);
    // The scheduler, outboxes and sweeps run wherever runs are fired or driven; the pool only
    // under `all`. An `api` process starts none of them.
    let triggers = matches!(args.role, Role::All | Role::Scheduler)
        .then(|| engine.spawn_triggers(triggers_stopped));
    // An `api` process listens for runs queued elsewhere: its remote workers' claims wait
    // for them.
    let worker = match args.role {
        Role::All => Some(engine.spawn_workers(workers_stopped)),
        Role::Scheduler => Some(engine.spawn_sweeps(workers_stopped)),
        Role::Api => Some(engine.spawn_work_listener(workers_stopped)),
        Role::Worker => None,
    };
    let mut state = AppState::new(engine.clone()).with_console(config.console.clone());
    if let Some(key) = control_plane {
        state = state.with_control_plane(key);
    }
    let served = match tls {
        _ if args.role == Role::Scheduler => {
            wor_server::serve_health(listener, state, shutdown).await
        }
        Some(tls) => wor_server::serve_tls(listener, tls, state, shutdown).await,
        None => wor_server::serve(listener, state, shutdown).await,
    };
    hangup.abort();
    // Runs in flight are given back, to be resumed at the next start rather than after
    // their lease runs out.
    let _ = stop_workers.send(true);
    if let Some(worker) = worker {
        let _ = worker.await;
    }
    if let Some(triggers) = triggers {
        let _ = triggers.await;
    }
    let _ = stop_metrics.send(true);
    // The spans of the runs just given back are sent before the process ends.
    let _ = stop_traces.send(true);
    if let Some(sent) = traces_sent {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(15), sent).await;
    }
    if let Some(served) = metrics_served {
        let _ = served.await;
    }
    let released = store.release_leases(&engine.config().worker_id).await?;
    if released > 0 {
        tracing::info!(
            category = "lifecycle",
            runs = released,
            "runs in flight given back for resumption"
        );
    }
    // Sign what this process appended, so it does not stay in the unsigned tail.
    if audit.checkpoint().await.is_err() {
        tracing::error!(category = "audit", "final audit checkpoint failed");
    }
    served?;
    store.close().await;
    tracing::info!(category = "lifecycle", "server stopped");
    Ok(ExitCode::SUCCESS)
}

/// The key that signs run envelopes and that workers pin at enrolment: from the environment,
/// else from (or created in) the data dir.
fn control_plane_key(config: &ServerConfig) -> anyhow::Result<ControlPlaneSigningKey> {
    match control_plane_key_in_env() {
        Some(text) => ControlPlaneSigningKey::from_base64(&text),
        None => ControlPlaneSigningKey::load_or_create(&config.data_dir).map(|(key, _)| key),
    }
    .with_context(|| {
        format!(
            "cannot load the control plane signing key ({})",
            env::CONTROL_PLANE_SIGNING_KEY
        )
    })
}

/// The control plane signing key the environment gives, when it gives one: it is read from
/// there before the data dir's file (`wor serve`, `wor doctor`).
pub(crate) fn control_plane_key_in_env() -> Option<String> {
    std::env::var(env::CONTROL_PLANE_SIGNING_KEY)
        .ok()
        .filter(|v| !v.trim().is_empty())
}

/// Refuses to make an encryption key for a database that already holds sealed secrets, or an
/// audit signing key for one that already holds signed checkpoints: a server started with the
/// key left out of its environment (after a restore, say) would otherwise come up with every
/// secret unreadable and every checkpoint failing verification.
async fn refuse_new_keys_for_kept_data(config: &ServerConfig, store: &Store) -> anyhow::Result<()> {
    if !config.encryption_key_configured()? {
        let sealed = store.count_sealed_secrets().await?;
        if sealed > 0 {
            bail!(
                "this database holds {sealed} sealed secret(s), but {} is not set and `{}` has no \
                 development key: set {} to the key they were sealed under",
                env::ENCRYPTION_KEY,
                config.data_dir.display(),
                env::ENCRYPTION_KEY
            );
        }
    }
    Ok(())
}

/// The audit signing key `config` names, for a database whose checkpoints it goes on signing:
/// never one made anew for a database that holds signed checkpoints, and never one other than
/// the key that signed the newest of them, whose checkpoints would leave the chain verifiable
/// by no one key. What `wor serve` and the operator commands that sign (`wor project create`,
/// `recover-owner`) start their audit writer with.
pub(crate) async fn kept_audit_key(
    config: &ServerConfig,
    store: &Store,
) -> anyhow::Result<wor_secrets::AuditSigningKey> {
    if !config.audit_signing_key_configured()
        && let Some(refusal) = unsigned_refusal(config, store.count_audit_checkpoints().await?)
    {
        bail!(refusal);
    }
    let key = config.audit_signing_key()?;
    let ours = wor_core::audit::key_id(&key.verifying_key());
    if let Some(refusal) = signer_refusal(&ours, store.newest_checkpoint_key_id().await?.as_deref())
    {
        bail!(refusal);
    }
    Ok(key)
}

/// Why a server with no audit signing key configured may not start on a database with
/// `signed` checkpoints: a key it made would sign on where another key signed.
pub(crate) fn unsigned_refusal(config: &ServerConfig, signed: i64) -> Option<String> {
    (signed > 0).then(|| {
        format!(
            "this database holds {signed} signed audit checkpoint(s), but {} is not set and `{}` \
             has no {}: set {} to the key that signed them",
            env::AUDIT_SIGNING_KEY,
            config.data_dir.display(),
            wor_secrets::AUDIT_SIGNING_KEY_FILE_NAME,
            env::AUDIT_SIGNING_KEY
        )
    })
}

/// Why the audit signing key `ours` (its key id) may not sign on after the newest checkpoint,
/// signed by `signer`.
pub(crate) fn signer_refusal(ours: &str, signer: Option<&str>) -> Option<String> {
    signer.filter(|signer| *signer != ours).map(|signer| {
        format!(
            "the newest audit checkpoint is signed by key {signer}, not by this audit signing key \
             ({ours}): use the key that signed it ({}), or the checkpoints signed from now on \
             would leave the chain verifiable by no one key",
            env::AUDIT_SIGNING_KEY
        )
    })
}

/// Refuses to serve a database with a secret sealed under a key `keys` does not hold: a server
/// on the wrong encryption key would fail every run that needs that secret, for good.
async fn refuse_a_ring_that_opens_none(
    store: &Store,
    keys: &wor_secrets::KeyRing,
    source: KeySource,
    config: &ServerConfig,
) -> anyhow::Result<()> {
    match ring_refusal(keys, source, config, &store.sealed_secret_key_ids().await?) {
        Some(refusal) => bail!(refusal),
        None => Ok(()),
    }
}

/// Why `keys` cannot serve a database whose secrets are sealed under `sealed` (key ids, with
/// how many secrets each seals): the first of those keys the ring does not hold.
pub(crate) fn ring_refusal(
    keys: &wor_secrets::KeyRing,
    source: KeySource,
    config: &ServerConfig,
    sealed: &[(String, i64)],
) -> Option<String> {
    let held: Vec<String> = std::iter::once(keys.primary_key_id())
        .chain(keys.retired_key_ids())
        .map(|id| id.to_string())
        .collect();
    // The key the ring is made of, named as it was given.
    let primary = match source {
        KeySource::Environment => {
            format!("{} (key {})", env::ENCRYPTION_KEY, keys.primary_key_id())
        }
        KeySource::DevFileLoaded | KeySource::DevFileCreated => format!(
            "the development key file `{}` (key {}), used because {} is not set,",
            config
                .data_dir
                .join(wor_secrets::DEV_KEY_FILE_NAME)
                .display(),
            keys.primary_key_id(),
            env::ENCRYPTION_KEY
        ),
    };
    sealed
        .iter()
        .find(|(key_id, _)| !held.contains(key_id))
        .map(|(key_id, count)| {
            format!(
                "this database holds {count} secret(s) sealed under key {key_id}, which neither \
                 {primary} nor {} holds: start with the key they were sealed under in {} (during \
                 a rotation, the old one in {})",
                env::ENCRYPTION_KEY_RETIRED,
                env::ENCRYPTION_KEY,
                env::ENCRYPTION_KEY_RETIRED
            )
        })
}

/// Opens the database, the key ring, the audit log and the egress client of `config`, and
/// builds the engine on them (what `wor serve` and `wor demo` run).
pub(crate) async fn open_engine(config: &ServerConfig) -> anyhow::Result<(Engine, AuditLog)> {
    // A section that cannot be used is refused before the data dir gets a database or a key.
    let policy = egress_policy(config)?;
    let store = match Store::open(config.database.as_deref(), &config.data_dir).await {
        Ok(store) => store,
        Err(unusable @ wor_store::StoreError::UnsupportedUrl(_)) => {
            return Err(crate::UsageError(anyhow::Error::new(unusable)).into());
        }
        Err(error) => return Err(anyhow::Error::new(error).context("cannot open the database")),
    };
    refuse_new_keys_for_kept_data(config, &store).await?;
    let (keys, key_source) = config
        .key_ring()
        .context("cannot load the encryption key")?;
    // The demo's data dir is its own and temporary: a generated key there is expected.
    if key_source == KeySource::DevFileCreated && !config.demo {
        tracing::warn!(
            category = "secrets",
            "generated a development encryption key in the data dir"
        );
        {
            eprintln!(
                "wor: warning: no {} set; generated a development key in {} (production refuses this)",
                env::ENCRYPTION_KEY,
                config.data_dir.display()
            );
        }
    }
    refuse_a_ring_that_opens_none(&store, &keys, key_source, config).await?;
    let audit_key = kept_audit_key(config, &store).await?;
    let audit = AuditLog::start(store.clone(), audit_key, AuditConfig::default());
    // Model connections go out under a policy of their own, which alone opens the
    // operator's `[egress] model_cidrs`.
    let model_egress = wor_egress::EgressClient::new(policy.for_models())
        .context("cannot build the outbound client for models")?;
    let egress =
        wor_egress::EgressClient::new(policy).context("cannot build the outbound client")?;
    let vault = wor_store::Vault::new(store.clone(), Arc::new(keys));
    let resolver = egress.resolver().clone();
    let engine = Engine::new(
        store,
        vault,
        egress,
        audit.clone(),
        EngineConfig {
            production: config.production,
            max_running_per_project: config.max_running_per_project,
            workers: config.workers,
            approval_ttl: config.approval_ttl,
            lease: config.lease,
            stdio_allowed_roots: config.stdio_allowed_roots.clone(),
            protected_paths: vec![config.data_dir.clone()],
            prices: config.prices.clone(),
            console_url: config.public_url.clone(),
            smtp_plaintext_loopback: config.smtp_plaintext_loopback,
            smtp_root_certificates: config.smtp_root_certificates.clone(),
            trace_context_to: config
                .traces
                .as_ref()
                .map(|t| t.propagate_to.clone())
                .unwrap_or_default(),
            ..EngineConfig::default()
        },
    );
    // Stdio tool servers start only in the sandbox; its layers are applied (and any missing
    // one named) when a server starts.
    let sandbox = wor_sandbox::Sandbox::new(wor_sandbox::SandboxConfig {
        helper: std::env::current_exe().context("cannot find the wor binary")?,
        state_dir: config.data_dir.join("sandbox"),
        resolver,
        startup_timeout: std::time::Duration::from_secs(30),
    })
    .context("cannot prepare the sandbox's state directory")?;
    Ok((
        engine.with_sandbox(sandbox).with_model_egress(model_egress),
        audit,
    ))
}

/// Registers SIGTERM and SIGINT handlers now, so a signal that arrives as soon as the server
/// says it is listening is not lost, and returns the future that completes on either.
pub(crate) fn shutdown_signal()
-> anyhow::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    shutdown_signal_then(|| {})
}

/// [`shutdown_signal`], calling `last` before the process ends at a second signal, for what
/// must not outlive it even then (the demo's temporary data dir).
pub(crate) fn shutdown_signal_then(
    last: impl FnOnce() + Send + 'static,
) -> anyhow::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        // A second signal while the process drains ends it at once, as a signal's death
        // would: what the drain had left to do is done by the next start (runs in flight
        // resume once their lease runs out).
        tokio::spawn(async move {
            let code = tokio::select! {
                _ = term.recv() => 128 + 15,
                _ = int.recv() => 128 + 2,
            };
            eprintln!(
                "wor: a second signal: stopping now, without the rest of the drain (runs in flight \
                 resume once their lease runs out)"
            );
            last();
            std::process::exit(code);
        });
    })
}

/// Handles every SIGHUP from now on: reloads the listener's certificate and key when it
/// serves `tls` (a file that does not load, or a certificate expired or not valid yet, leaves
/// the previous certificate in use, and says so), and otherwise says there is nothing to
/// reload. Either way the process goes on.
pub(crate) fn spawn_hangup(
    tls: Option<wor_server::tls::ReloadableTls>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;
    Ok(tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            let Some(tls) = &tls else {
                tracing::info!(
                    category = "lifecycle",
                    "SIGHUP: this process serves no TLS certificate; nothing to reload"
                );
                eprintln!("wor: SIGHUP: no TLS certificate to reload; going on");
                continue;
            };
            match tls.reload() {
                Ok(()) => {
                    tracing::info!(category = "lifecycle", "TLS certificate reloaded");
                    eprintln!("wor: TLS certificate reloaded");
                    warn_of_certificate(tls.files());
                }
                Err(error) => {
                    tracing::error!(
                        category = "lifecycle",
                        error = %error,
                        "TLS certificate reload failed; the previous one stays"
                    );
                    eprintln!("wor: error: {error}; the previous certificate stays in use");
                }
            }
        }
    }))
}

/// Logs what clients would hold against the listener's certificate
/// ([`wor_server::tls::CertificateFacts::warnings`]); one that cannot be read was already
/// refused by loading it.
fn warn_of_certificate(files: &wor_server::tls::TlsFiles) {
    let Ok(facts) = files.facts() else {
        return;
    };
    for warning in facts.warnings() {
        tracing::warn!(
            category = "config",
            days = facts.days_to_expiry(),
            "{warning}"
        );
    }
}

/// What `[metrics]` and `[traces]` set up in this process, before its engine starts so that
/// nothing the engine records is lost: the metrics recorder and where to serve it, the span
/// exporter and the sink spans arrive on. Each process reports what it does itself, a
/// scaled-out worker as an `all` process.
pub(crate) struct Reporting {
    pub(crate) metrics: Option<(wor_server::metrics::PrometheusHandle, std::net::SocketAddr)>,
    pub(crate) traces: Option<(
        wor_server::traces::TraceExporter,
        wor_engine::traces::SpanReceiver,
    )>,
}

/// Sets up [`Reporting`] as `config` says; what the configuration names and cannot be used is
/// a usage error (exit 2). A metrics listener anyone may reach is warned of.
pub(crate) fn reporting(config: &ServerConfig) -> anyhow::Result<Reporting> {
    if let Some(exposure) = config.metrics_exposure() {
        tracing::warn!(category = "config", "{exposure}");
    }
    let metrics = match config.metrics_listen {
        Some(addr) => Some((wor_server::metrics::install_recorder()?, addr)),
        None => None,
    };
    let traces = match &config.traces {
        Some(traces) => Some(trace_exporter(config, traces)?),
        None => None,
    };
    Ok(Reporting { metrics, traces })
}

/// Serves the metrics of this process on `addr` until `stopped` changes, the gauges read from
/// the database only where there is one.
pub(crate) async fn serve_metrics(
    handle: wor_server::metrics::PrometheusHandle,
    addr: std::net::SocketAddr,
    store: Option<wor_store::Store>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for metrics on {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!("wor: metrics on http://{local}/metrics");
    let state = wor_server::metrics::MetricsState { handle, store };
    Ok(tokio::spawn(wor_server::metrics::serve(
        listener,
        state,
        async move {
            let _ = stopped.changed().await;
        },
    )))
}

/// Sends this process's spans to the collector until `stopped` changes, then what is left.
pub(crate) fn export_traces(
    exporter: wor_server::traces::TraceExporter,
    spans: wor_engine::traces::SpanReceiver,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(wor_server::traces::export(spans, exporter, async move {
        let _ = stopped.changed().await;
    }))
}

/// The trace exporter of `[traces]` and the sink the engine's spans arrive on. The exporter
/// sends through an egress client of its own: the server's production rules, the ranges
/// listed for the collector only, and an allowlist of the collector's host alone.
pub(crate) fn trace_exporter(
    config: &ServerConfig,
    traces: &crate::config::TracesConfig,
) -> anyhow::Result<(
    wor_server::traces::TraceExporter,
    wor_engine::traces::SpanReceiver,
)> {
    let exporter = trace_exporter_for(config, traces)?;
    let spans = wor_engine::traces::install_sink()?;
    Ok((exporter, spans))
}

/// The exporter `[traces]` describes, checked as `wor serve` and `wor doctor` check it: what
/// the section says and cannot be used is a usage error (exit 2), among it a collector at an
/// address the section's `allowed_cidrs` leave closed; the rest is the host's.
pub(crate) fn trace_exporter_for(
    config: &ServerConfig,
    traces: &crate::config::TracesConfig,
) -> anyhow::Result<wor_server::traces::TraceExporter> {
    let policy = wor_egress::EgressPolicy::from_config(&wor_egress::EgressConfig {
        production: config.production,
        allowed_cidrs: traces.allowed_cidrs.clone(),
        model_cidrs: Vec::new(),
    })
    .context("invalid `[traces] allowed_cidrs`")
    .map_err(crate::UsageError)?;
    // A collector named by its address is checked now, where each export would otherwise be
    // refused by the egress guard with nothing said but that it failed.
    let literal = url::Url::parse(&traces.endpoint)
        .ok()
        .and_then(|url| match url.host() {
            Some(url::Host::Ipv4(ip)) => Some(std::net::IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => Some(std::net::IpAddr::V6(ip)),
            _ => None,
        });
    if let Some(ip) = literal
        && let Err(range) = policy.check_address(ip)
    {
        return Err(crate::UsageError(anyhow::anyhow!(
            "`[traces] endpoint` is at {ip}, in {range}, which the egress guard refuses: list a range holding it in `[traces] allowed_cidrs`"
        ))
        .into());
    }
    let egress = wor_egress::EgressClient::new(policy)
        .context("cannot build the trace exporter's outbound client")?;
    let exporter = match wor_server::traces::exporter(&traces.endpoint, egress) {
        Ok(exporter) => exporter,
        Err(
            unusable @ (wor_server::traces::TraceExportError::Endpoint(_)
            | wor_server::traces::TraceExportError::Allowlist(_)),
        ) => return Err(crate::UsageError(unusable.into()).into()),
        Err(other) => return Err(other.into()),
    };
    Ok(exporter)
}

/// The server-wide egress policy: production flag and the operator's CIDRs from the file.
pub(crate) fn egress_policy(config: &ServerConfig) -> anyhow::Result<wor_egress::EgressPolicy> {
    wor_egress::EgressPolicy::from_config(&wor_egress::EgressConfig {
        production: config.production,
        allowed_cidrs: config.egress_allowed_cidrs.clone(),
        model_cidrs: config.egress_model_cidrs.clone(),
    })
    .context("invalid `[egress]` section")
    .map_err(|error| crate::UsageError(error).into())
}
