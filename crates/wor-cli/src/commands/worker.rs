//! `wor worker`: enrolment tokens (operator, on the database directly) and enrolling a worker
//! with the control plane (on the worker's machine).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::json;
use wor_secrets::{WorkerIdentity, WorkerPublicKeys};
use wor_store::WorkerRevocation;

use crate::client::ApiClient;
use crate::config::{ServerConfig, ServerFlags};

/// File in a worker's data dir naming its id, its control plane and the key it pinned there.
pub(crate) const ENROLMENT_FILE_NAME: &str = "worker-enrolment.json";

#[derive(Debug, clap::Subcommand)]
pub enum WorkerCommand {
    /// Enrolment tokens for new workers (operator: works on the database directly).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Enrol this machine as a worker: make its key pair here (the private keys stay in a 0600
    /// file in --data-dir) and register the public keys with the control plane.
    Enroll(EnrollArgs),
    /// List enrolled workers: id, status, when last heard from, name (operator: works on the
    /// database directly).
    List {
        /// Print the workers as a JSON array.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        flags: ServerFlags,
    },
    /// Revoke a worker: every request it signs is refused from now on, and the runs it holds
    /// go back to the queue at once, their credentials ended (operator: works on the database
    /// directly).
    Revoke {
        /// The worker's `wkr_…` id, as `wor worker list` shows it.
        worker_id: String,
        #[command(flatten)]
        flags: ServerFlags,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum TokenCommand {
    /// Make a single-use enrolment token and print it once, alone on stdout.
    Create {
        /// Minutes until the token expires.
        #[arg(long, default_value_t = 60,
              value_parser = clap::value_parser!(u32).range(1..=10_080))]
        ttl_minutes: u32,
        #[command(flatten)]
        flags: ServerFlags,
    },
}

#[derive(Debug, clap::Args)]
pub struct EnrollArgs {
    /// Base URL of the control plane (an API process). Plain http only to a loopback address.
    #[arg(long, value_name = "URL")]
    control_plane: String,
    /// The enrolment token `wor worker token create` printed; best given in the environment
    /// (`WOR_WORKER_ENROLMENT_TOKEN`), which keeps it out of the process list and shell history.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "WOR_WORKER_ENROLMENT_TOKEN",
        hide_env_values = true
    )]
    token: String,
    /// The worker's own data directory, where its identity is kept.
    #[arg(long, value_name = "DIR")]
    data_dir: PathBuf,
    /// A name for this worker, shown to operators [default: the host name, else `worker`].
    #[arg(long)]
    name: Option<String>,
    /// A PEM file of certificates to trust for an `https` control plane beside the system's
    /// (a private CA); its path is recorded, and the worker trusts it too unless it is given
    /// WOR_CA_CERT [env: WOR_CA_CERT].
    #[arg(long, value_name = "FILE")]
    ca_cert: Option<PathBuf>,
}

pub async fn run(command: WorkerCommand) -> anyhow::Result<ExitCode> {
    match command {
        WorkerCommand::Token(TokenCommand::Create { ttl_minutes, flags }) => {
            create_token(&flags, ttl_minutes).await
        }
        WorkerCommand::Enroll(args) => enroll(args).await,
        WorkerCommand::List { json, flags } => list(&flags, json).await,
        WorkerCommand::Revoke { worker_id, flags } => revoke(&flags, &worker_id).await,
    }
}

async fn open_store(flags: &ServerFlags) -> anyhow::Result<wor_store::Store> {
    let config = ServerConfig::resolve(flags, None, false)?;
    wor_store::Store::open_existing(config.database.as_deref(), &config.data_dir)
        .await
        .context("cannot open the database")
}

async fn list(flags: &ServerFlags, json: bool) -> anyhow::Result<ExitCode> {
    let store = open_store(flags).await?;
    let workers = store.list_workers().await;
    store.close().await;
    let workers = workers?;
    if json {
        super::print_json(&serde_json::Value::Array(
            workers
                .iter()
                .map(|w| {
                    json!({
                        "id": w.id,
                        "name": w.name,
                        "status": w.status.as_str(),
                        "enrolled_at": wor_server::views::rfc3339(w.enrolled_at),
                        "last_seen_at": w.last_seen_at.map(wor_server::views::rfc3339),
                    })
                })
                .collect(),
        ))?;
    } else if workers.is_empty() {
        eprintln!("no worker is enrolled");
    } else {
        for w in &workers {
            let seen = w
                .last_seen_at
                .map_or_else(|| "never".to_owned(), wor_server::views::rfc3339);
            println!(
                "{}  {:<7}  last seen {seen}  {}",
                w.id,
                w.status.as_str(),
                w.name
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn revoke(flags: &ServerFlags, worker_id: &str) -> anyhow::Result<ExitCode> {
    let store = open_store(flags).await?;
    let revoked = store.revoke_worker(worker_id).await;
    store.close().await;
    match revoked? {
        WorkerRevocation::Revoked { runs_released } => {
            eprintln!(
                "revoked worker {worker_id}; {runs_released} run(s) it held went back to the queue"
            );
            Ok(ExitCode::SUCCESS)
        }
        WorkerRevocation::AlreadyRevoked => {
            eprintln!("worker {worker_id} was already revoked");
            Ok(ExitCode::SUCCESS)
        }
        WorkerRevocation::Unknown => {
            bail!("no worker has the id `{worker_id}` (see `wor worker list`)")
        }
    }
}

async fn create_token(flags: &ServerFlags, ttl_minutes: u32) -> anyhow::Result<ExitCode> {
    let store = open_store(flags).await?;
    let token = store
        .create_worker_enrolment_token(i64::from(ttl_minutes) * 60_000)
        .await?;
    store.close().await;
    eprintln!(
        "created worker enrolment token {} (single use, expires in {ttl_minutes} min)",
        token.id
    );
    println!("{}", token.expose());
    Ok(ExitCode::SUCCESS)
}

/// Plain http carries the enrolment token in clear: only to this machine.
pub(crate) fn check_transport(control_plane: &str) -> anyhow::Result<()> {
    let url = url::Url::parse(control_plane).map_err(|e| {
        crate::usage(format!(
            "--control-plane `{control_plane}` is not a URL: {e}"
        ))
    })?;
    let loopback = match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(name)) => name == "localhost",
        None => false,
    };
    match url.scheme() {
        "https" => Ok(()),
        "http" if loopback => Ok(()),
        "http" => Err(crate::usage(
            "--control-plane must be https:// unless it is on loopback: the enrolment token would cross the network in clear",
        )),
        other => Err(crate::usage(format!(
            "--control-plane must be an https:// URL, not `{other}:`"
        ))),
    }
}

async fn enroll(args: EnrollArgs) -> anyhow::Result<ExitCode> {
    check_transport(&args.control_plane)?;
    let enrolment_file = args.data_dir.join(ENROLMENT_FILE_NAME);
    if enrolment_file.exists() {
        bail!(
            "this data dir already belongs to an enrolled worker ({}); use a new data dir to enrol another",
            enrolment_file.display()
        );
    }
    // A retry after a failed registration keeps the key pair already made.
    let (identity, _) = WorkerIdentity::load_or_create(&args.data_dir)
        .context("cannot make or read the worker identity")?;
    let public: WorkerPublicKeys = identity.public_keys();
    let name = args.name.unwrap_or_else(default_name);
    let ca_cert = ApiClient::enrolment_ca_cert(args.ca_cert.as_deref())?;
    // Recorded in a JSON file, before the token is spent.
    let ca_cert_recorded = ca_cert
        .as_deref()
        .map(|path| {
            path.to_str().ok_or_else(|| {
                crate::usage(format!(
                    "the --ca-cert path {} is not UTF-8, so the enrolment cannot record it",
                    path.display()
                ))
            })
        })
        .transpose()?;
    let client = ApiClient::without_key(&args.control_plane, ca_cert.as_deref())?;
    let answer = client
        .post(
            wor_server::internal::ENROLL_PATH,
            &json!({
                "token": args.token,
                "name": name,
                "signing_public_key": public.signing_base64(),
                "exchange_public_key": public.exchange_base64(),
            }),
        )
        .await
        .context("the enrolment did not go through (the worker identity made for it is kept for a retry)")?;
    let worker_id = answer
        .get("worker_id")
        .and_then(|v| v.as_str())
        .context("the control plane's answer names no worker id")?;
    let pinned = answer
        .get("control_plane_verifying_key")
        .and_then(|v| v.as_str())
        .context("the control plane's answer has no verifying key")?;
    wor_secrets::parse_verifying_key(pinned)
        .context("the control plane's verifying key is malformed")?;
    let mut enrolment = serde_json::Map::new();
    enrolment.insert("worker_id".to_owned(), json!(worker_id));
    enrolment.insert("control_plane".to_owned(), json!(args.control_plane));
    enrolment.insert("control_plane_verifying_key".to_owned(), json!(pinned));
    if let Some(path) = ca_cert_recorded {
        enrolment.insert("ca_cert".to_owned(), json!(path));
    }
    write_enrolment(&enrolment_file, &serde_json::Value::Object(enrolment))?;
    eprintln!(
        "enrolled as worker {worker_id}; identity in {}",
        args.data_dir.display()
    );
    println!("{worker_id}");
    Ok(ExitCode::SUCCESS)
}

fn write_enrolment(path: &Path, value: &serde_json::Value) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, format!("{text}\n"))
        .with_context(|| format!("cannot write {}", path.display()))
}

fn default_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty() && h.len() <= 100)
        .unwrap_or_else(|| "worker".to_owned())
}
