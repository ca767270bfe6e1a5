//! `wor serve --role worker`: a runtime worker of a scaled-out deployment.
//!
//! It talks only to the control plane it enrolled with (`wor worker enroll`), with requests
//! signed by its own key, and drives the runs it claims there (`wor_engine`'s `remote.rs`).
//! It takes no database URL and no encryption key, and refuses to start with either.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use wor_engine::{
    ControlPlaneLink, Engine, EngineConfig, LinkAnswer, LinkError, LinkFuture, WorkerEnd,
    WorkerTimings,
};
use wor_secrets::{EnvelopeLimits, EnvelopeOpener, RequestToSign, WorkerIdentity};
use wor_store::{AuditConfig, AuditLog, Store};

use crate::client::ApiClient;
use crate::config::ServerConfig;
use crate::env;

/// How often an idle worker says it is alive.
const HEARTBEAT: Duration = Duration::from_secs(10);
/// How long a request to the control plane waits for its answer: a lease renewal that fails
/// is tried again while the lease lasts.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopping worker lets its runs reach a step boundary before giving them back.
const DRAIN: Duration = Duration::from_secs(20);
/// How long a claim waits at the control plane for a run: well inside `REQUEST_TIMEOUT`.
const CLAIM_WAIT: Duration = Duration::from_secs(5);

/// What `wor worker enroll` left in the data dir.
#[derive(Debug, serde::Deserialize)]
struct Enrolment {
    worker_id: String,
    control_plane: String,
    control_plane_verifying_key: String,
    /// The file of certificates the enrolment trusted for the control plane, if any.
    #[serde(default)]
    ca_cert: Option<std::path::PathBuf>,
}

/// Requests to the control plane, signed with the worker's key.
struct SignedLink {
    client: ApiClient,
    identity: WorkerIdentity,
    worker_id: String,
}

impl ControlPlaneLink for SignedLink {
    fn post<'a>(
        &'a self,
        path: &'a str,
        body: Vec<u8>,
    ) -> LinkFuture<'a, Result<LinkAnswer, LinkError>> {
        Box::pin(async move {
            let headers = self
                .identity
                .sign_request(
                    &self.worker_id,
                    &RequestToSign {
                        method: "POST",
                        path_and_query: path,
                        body: &body,
                    },
                    wor_store::now_millis() / 1000,
                )
                .map_err(|e| LinkError(e.to_string()))?
                .to_header_values();
            let (status, body) = self
                .client
                .post_bytes(path, body, &headers)
                .await
                .map_err(|e| LinkError(format!("{e:#}")))?;
            Ok(LinkAnswer { status, body })
        })
    }
}

pub async fn run(config: &ServerConfig) -> anyhow::Result<ExitCode> {
    // A worker holds the secrets of the runs it drives and nothing more.
    if config.database.is_some() {
        return Err(crate::usage(format!(
            "a worker takes no database URL: it talks only to the control plane; unset {} and --database",
            env::DATABASE_URL
        )));
    }
    if std::env::var_os(env::ENCRYPTION_KEY).is_some() {
        return Err(crate::usage(format!(
            "a worker holds no encryption key: unset {} (the control plane sends each run's secrets in its envelope)",
            env::ENCRYPTION_KEY
        )));
    }
    // A worker's model, tool and token counts are its own, served by it (its own `[metrics]
    // listen`) and its spans sent by it, as an `all` process does.
    let super::serve::Reporting { metrics, traces } = super::serve::reporting(config)?;
    // SIGHUP is only logged from here on: a worker has no certificate to reload.
    let hangup = super::serve::spawn_hangup(None)?;
    let enrolment_file = config.data_dir.join(super::worker::ENROLMENT_FILE_NAME);
    let text = std::fs::read_to_string(&enrolment_file).with_context(|| {
        format!(
            "cannot read {}: enrol this worker first with `wor worker enroll`",
            enrolment_file.display()
        )
    })?;
    let enrolment: Enrolment = serde_json::from_str(&text)
        .with_context(|| format!("{} is not an enrolment", enrolment_file.display()))?;
    super::worker::check_transport(&enrolment.control_plane).with_context(|| {
        format!(
            "the control plane {} recorded in {}",
            enrolment.control_plane,
            enrolment_file.display()
        )
    })?;
    let identity = WorkerIdentity::load(&config.data_dir)
        .context("cannot read the worker identity")?
        .with_context(|| {
            format!(
                "no worker identity in {}: enrol with `wor worker enroll`",
                config.data_dir.display()
            )
        })?;
    let pinned = wor_secrets::parse_verifying_key(&enrolment.control_plane_verifying_key)
        .context("the enrolment's control plane key is malformed")?;
    let opener = EnvelopeOpener::new(
        WorkerIdentity::load(&config.data_dir)?.context("the worker identity went away")?,
        enrolment.worker_id.clone(),
        pinned,
        EnvelopeLimits::default(),
    );
    let link = SignedLink {
        client: ApiClient::for_worker(
            &enrolment.control_plane,
            REQUEST_TIMEOUT,
            enrolment.ca_cert.as_deref(),
        )?,
        identity,
        worker_id: enrolment.worker_id.clone(),
    };
    let data_dir_held = hold_data_dir(&config.data_dir)?;
    let (engine, audit, scratch) = worker_engine(config, &enrolment.worker_id).await?;
    let engine = engine.with_control_plane(Arc::new(link), opener);
    // A control plane that cannot be reached yet (starting, or too busy to answer) is asked
    // again; one that answers with a refusal ends the start.
    let mut wait = Duration::from_millis(500);
    let answered = loop {
        match engine.heartbeat().await {
            Ok(answered) => break answered,
            Err(
                error @ (wor_engine::ClaimError::Link(_)
                | wor_engine::ClaimError::Refused { status: 500.., .. }),
            ) => {
                // The control plane's answer is quoted: escaped for the terminal.
                eprintln!(
                    "wor: {}; trying again in {} ms",
                    super::for_terminal(&error.to_string()),
                    wait.as_millis()
                );
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(refused) => {
                return Err(anyhow::Error::new(refused))
                    .context("the control plane refused this worker");
            }
        }
    };
    if answered != enrolment.worker_id {
        bail!(
            "the control plane knows this worker as `{answered}`, the enrolment says `{}`",
            enrolment.worker_id
        );
    }
    let shutdown = super::serve::shutdown_signal()?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // The metrics are answered, and the spans sent, until the drain is over.
    let (stop_reporting, reporting_stopped) = tokio::sync::watch::channel(false);
    let metrics_served = match metrics {
        Some((handle, addr)) => {
            Some(super::serve::serve_metrics(handle, addr, None, reporting_stopped.clone()).await?)
        }
        None => None,
    };
    let traces_sent = traces
        .map(|(exporter, spans)| super::serve::export_traces(exporter, spans, reporting_stopped));
    // Answered until the drain is over: a stopping worker is not ready.
    let (probes_stop, probes_stopped) = tokio::sync::watch::channel(false);
    // Probes only where the operator asked for a listener: a worker beside an `api` process
    // on one machine would otherwise take its default port.
    let probes = if config.listen_given {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen for probes on {}", config.listen))?;
        let local = listener.local_addr()?;
        let probed = engine.clone();
        let mut stopping = probes_stopped;
        eprintln!("wor: probes on http://{local}/healthz and /readyz");
        Some(tokio::spawn(wor_server::serve_probes(
            listener,
            move || probed.remote_ready(),
            async move {
                let _ = stopping.wait_for(|stop| *stop).await;
            },
        )))
    } else {
        None
    };
    tracing::info!(category = "lifecycle", role = "worker", worker_id = %enrolment.worker_id,
        "worker started");
    eprintln!("wor: role worker");
    eprintln!(
        "wor: worker {} driving runs of {}",
        enrolment.worker_id, enrolment.control_plane
    );
    let mut worker = engine.spawn_remote_worker(
        stopped,
        WorkerTimings {
            heartbeat: HEARTBEAT,
            drain: DRAIN,
            claim_wait: CLAIM_WAIT,
        },
    );
    // The worker's loop ends on its own only when the control plane revoked it.
    let ended = tokio::select! {
        () = shutdown => {
            eprintln!("wor: stopping: runs in flight are given back at their next step boundary");
            let _ = stop.send(true);
            worker.await
        }
        ended = &mut worker => ended,
    };
    // A loop that panicked ends the process as a failure, for its supervisor to restart.
    let revoked = ended.context("the worker's loop ended unexpectedly")? == WorkerEnd::Revoked;
    let _ = probes_stop.send(true);
    if let Some(probes) = probes {
        let _ = probes.await;
    }
    // The spans of the runs just given back are sent before the process ends.
    let _ = stop_reporting.send(true);
    if let Some(sent) = traces_sent {
        let _ = tokio::time::timeout(Duration::from_secs(15), sent).await;
    }
    if let Some(served) = metrics_served {
        let _ = served.await;
    }
    drop(audit);
    engine.store().close().await;
    drop(scratch);
    drop(data_dir_held);
    hangup.abort();
    tracing::info!(category = "lifecycle", "worker stopped");
    if revoked {
        bail!(
            "the control plane revoked worker {}: it stopped, and answers none of its requests; enrol a new worker (`wor worker enroll`, with a new data dir) to drive runs here",
            enrolment.worker_id
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The file in a worker's data dir that the running worker holds a lock on.
const DATA_DIR_LOCK: &str = "worker.lock";
/// How the names of the worker's scratch directories begin; the random letters and digits
/// that end them, and how many there are.
const SCRATCH_PREFIX: &str = "scratch-";
const SCRATCH_RANDOM_CHARS: usize = 6;

/// Takes the data dir for this process, which holds it until it exits (the lock goes with
/// the process, however it ends): a data dir holds one worker's identity, so a second worker
/// on it is refused. What is left of a worker's scratch directories there was then left by
/// one that was killed, and is removed.
fn hold_data_dir(data_dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    let path = data_dir.join(DATA_DIR_LOCK);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "another worker runs on the data dir {}: each worker needs a data dir of its own, enrolled with `wor worker enroll`",
            data_dir.display()
        ),
        Err(std::fs::TryLockError::Error(error)) => {
            return Err(error).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    remove_left_scratch(data_dir)?;
    Ok(file)
}

/// Removes the scratch directories that workers killed on this data dir left behind: those
/// named as a worker names them and holding only its scratch database's files. Anything else,
/// an operator's own files included, is left alone.
fn remove_left_scratch(data_dir: &std::path::Path) -> anyhow::Result<()> {
    let entries = std::fs::read_dir(data_dir)
        .with_context(|| format!("cannot list the data dir {}", data_dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", data_dir.display()))?;
        if !is_left_scratch(&entry) {
            continue;
        }
        let path = entry.path();
        match std::fs::remove_dir_all(&path) {
            Ok(()) => tracing::info!(category = "lifecycle", path = %path.display(),
                "removed the scratch directory a killed worker left"),
            Err(error) => tracing::warn!(category = "lifecycle", path = %path.display(),
                %error, "cannot remove the scratch directory a killed worker left"),
        }
    }
    Ok(())
}

/// Whether `entry` is a worker's scratch directory: a directory (not a link to one) named
/// [`SCRATCH_PREFIX`] and [`SCRATCH_RANDOM_CHARS`] letters or digits, holding nothing but
/// files of the scratch database.
fn is_left_scratch(entry: &std::fs::DirEntry) -> bool {
    let name = entry.file_name();
    let named = name
        .to_str()
        .and_then(|name| name.strip_prefix(SCRATCH_PREFIX))
        .is_some_and(|random| {
            random.len() == SCRATCH_RANDOM_CHARS
                && random.bytes().all(|b| b.is_ascii_alphanumeric())
        });
    if !named || !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
        return false;
    }
    let Ok(mut inside) = std::fs::read_dir(entry.path()) else {
        return false;
    };
    inside.all(|held| {
        held.is_ok_and(|held| {
            held.file_type().is_ok_and(|kind| kind.is_file())
                && held
                    .file_name()
                    .to_str()
                    .is_some_and(|name| name.starts_with(wor_store::SQLITE_FILE))
        })
    })
}

/// The engine a worker drives runs with: the server's egress rules, sandbox and limits, and —
/// because the engine type is built on a store — an empty scratch database in a private
/// directory of its own under the worker's data dir, removed on exit (one a killed worker
/// left stays there, not in the system's temporary directory, until the next worker on that
/// data dir starts). Nothing of a run is written to it: a remote worker's reads come from its
/// claims and its writes go to the control plane, and its vault's key is made here and never
/// leaves the process.
async fn worker_engine(
    config: &ServerConfig,
    worker_id: &str,
) -> anyhow::Result<(Engine, AuditLog, tempfile::TempDir)> {
    let scratch = tempfile::Builder::new()
        .prefix(SCRATCH_PREFIX)
        .rand_bytes(SCRATCH_RANDOM_CHARS)
        .tempdir_in(&config.data_dir)
        .context("cannot make the worker's scratch directory")?;
    let store = Store::open(None, scratch.path())
        .await
        .context("cannot open the worker's scratch database")?;
    let (keys, _) = wor_secrets::KeyRing::generate()?;
    let (signing, _) = wor_secrets::AuditSigningKey::generate()?;
    let audit = AuditLog::start(store.clone(), signing, AuditConfig::default());
    let policy = super::serve::egress_policy(config)?;
    let model_egress = wor_egress::EgressClient::new(policy.for_models())
        .context("cannot build the outbound client for models")?;
    let egress =
        wor_egress::EgressClient::new(policy).context("cannot build the outbound client")?;
    let resolver = egress.resolver().clone();
    let vault = wor_store::Vault::new(store.clone(), Arc::new(keys));
    let engine = Engine::new(
        store,
        vault,
        egress,
        audit.clone(),
        EngineConfig {
            worker_id: worker_id.to_owned(),
            production: config.production,
            workers: config.workers,
            lease: config.lease,
            stdio_allowed_roots: config.stdio_allowed_roots.clone(),
            protected_paths: vec![config.data_dir.clone()],
            prices: config.prices.clone(),
            trace_context_to: config
                .traces
                .as_ref()
                .map(|t| t.propagate_to.clone())
                .unwrap_or_default(),
            ..EngineConfig::default()
        },
    );
    let sandbox = wor_sandbox::Sandbox::new(wor_sandbox::SandboxConfig {
        helper: std::env::current_exe().context("cannot find the wor binary")?,
        state_dir: config.data_dir.join("sandbox"),
        resolver,
        startup_timeout: Duration::from_secs(30),
    })
    .context("cannot prepare the sandbox's state directory")?;
    Ok((
        engine.with_sandbox(sandbox).with_model_egress(model_egress),
        audit,
        scratch,
    ))
}
