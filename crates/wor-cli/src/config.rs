//! Server configuration from a TOML file, the environment and flags (in rising precedence),
//! converged into one [`ServerConfig`], and the checks production mode makes before start.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use base64::Engine;
use wor_core::audit::VerifyingKey;
use wor_secrets::{AUDIT_SIGNING_KEY_FILE_NAME, AuditSigningKey};

use crate::env;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_DATA_DIR: &str = ".wor";
pub const DEFAULT_MAX_RUNNING_PER_PROJECT: u64 = 16;

/// The example key printed in `docs/configuration.md`. Production refuses it: a key anyone can
/// read in the documentation protects nothing.
pub const DOCUMENTED_EXAMPLE_KEY: &str = "d29yLWV4YW1wbGUta2V5LWRvLW5vdC11c2UtaXQhISE=";

/// Passwords that ship as defaults with databases and tutorials.
const DEFAULT_PASSWORDS: &[&str] = &[
    "", "postgres", "password", "admin", "root", "changeme", "secret", "wor", "example", "test",
];

/// A claim of a run lasts this long unless its driver renews it (seconds): long enough for the
/// renewal every second to miss a few times, short enough that a run whose driver died is
/// resumed soon.
const DEFAULT_LEASE_SECONDS: u64 = 30;
const MIN_LEASE_SECONDS: u64 = 5;
/// The longest an approval may wait for a decision: a year.
const MAX_APPROVAL_TTL_SECONDS: u64 = 365 * 24 * 60 * 60;
const MAX_LEASE_SECONDS: u64 = 3600;

/// The configuration file's keys. Unknown keys are errors, so a typo never silently becomes a
/// default.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    data_dir: Option<PathBuf>,
    database: Option<String>,
    production: Option<bool>,
    demo: Option<bool>,
    max_running_per_project: Option<u64>,
    /// How many runs this process drives at once.
    workers: Option<usize>,
    /// How long an approval request waits for a decision, in seconds (default 24 hours).
    approval_ttl_seconds: Option<u64>,
    /// How long a claim of a run lasts unless its driver renews it, in seconds (default 30).
    lease_seconds: Option<u64>,
    egress: Option<EgressSection>,
    sandbox: Option<SandboxSection>,
    console: Option<ConsoleSection>,
    metrics: Option<MetricsSection>,
    traces: Option<TracesSection>,
    tls: Option<TlsSection>,
    /// Where people reach this server (`https://wor.example.com`), for links in notifications.
    public_url: Option<String>,
    notifications: Option<NotificationsSection>,
    /// Per-model prices, in microdollars per million tokens: `[prices."model-id"]`.
    #[serde(default)]
    prices: std::collections::BTreeMap<String, wor_core::budget::ModelPrice>,
}

/// `[egress]`: special-use destinations the operator allows. Only this file can list them;
/// nothing reachable through the API can.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EgressSection {
    #[serde(default)]
    allowed_cidrs: Vec<String>,
    #[serde(default)]
    model_cidrs: Vec<String>,
}

/// `[notifications]`: what the operator allows approval notifications to do.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NotificationsSection {
    /// Email routes may speak SMTP without TLS to a loopback relay (a local MTA that relays
    /// onward itself). Off by default: every relay needs STARTTLS.
    #[serde(default)]
    smtp_plaintext_loopback: bool,
    /// A PEM file of CA certificates trusted for SMTP relays besides the platform's roots (a
    /// relay whose certificate a private CA issued).
    #[serde(default)]
    smtp_ca_file: Option<PathBuf>,
}

/// `[sandbox]`: host directories stdio tool servers may be started from and read. Only this
/// file can list them; the API can only choose paths inside them.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SandboxSection {
    #[serde(default)]
    allowed_paths: Vec<PathBuf>,
}

/// `[metrics]`: the Prometheus endpoint, on a listener of its own.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsSection {
    /// `IP:PORT` (or `localhost:PORT`) of the metrics listener; without it no metrics are recorded or served.
    listen: Option<String>,
}

/// The operator's trace collector: its URL and the special-use ranges it may be in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracesConfig {
    pub endpoint: String,
    pub allowed_cidrs: Vec<String>,
    /// Tool servers (host patterns, as in a connection's allowlist) a run's trace context is
    /// passed to; no other tool server gets it.
    pub propagate_to: wor_egress::HostAllowlist,
}

/// `[traces]`: OpenTelemetry traces sent to the operator's collector over OTLP/HTTP.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TracesSection {
    /// The collector's OTLP/HTTP traces URL (`http://10.0.0.5:4318/v1/traces`); without it no
    /// spans are made or sent.
    endpoint: Option<String>,
    /// Special-use ranges the collector lives in (`10.0.0.5/32`), allowed for the exporter
    /// only: tools, models and webhooks are not let into them.
    #[serde(default)]
    allowed_cidrs: Vec<String>,
    /// Tool servers that get a run's trace context (`traceparent`), by host pattern
    /// (`tracker.internal.example`, `*.corp.example:8443`); none unless listed.
    #[serde(default)]
    propagate_to: Vec<String>,
}

/// `[tls]`: HTTPS on the listener, or the TLS-terminating proxy in front of it.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsSection {
    /// PEM certificate chain; reloaded with the key on SIGHUP.
    cert: Option<PathBuf>,
    /// PEM private key.
    key: Option<PathBuf>,
    /// A proxy in front terminates TLS: a plaintext listener is then accepted in production.
    #[serde(default)]
    behind_proxy: bool,
    /// The proxy's addresses (CIDRs): only their `X-Forwarded-For` is believed.
    #[serde(default)]
    proxy_cidrs: Vec<String>,
}

/// `[console]`: password hashing and sign-in limits of the web console. Every key is
/// optional; leaving one out keeps its safe default.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleSection {
    argon2_memory_kib: Option<u32>,
    argon2_iterations: Option<u32>,
    argon2_parallelism: Option<u32>,
    invitation_ttl_hours: Option<u64>,
    session_idle_minutes: Option<u64>,
    session_absolute_hours: Option<u64>,
    max_failed_sign_ins_per_account: Option<u32>,
    max_failed_sign_ins_per_address: Option<u32>,
    lockout_minutes: Option<u64>,
    /// The console is reached over HTTPS (TLS ends in a proxy in front of `wor serve`): its
    /// cookies carry `Secure`. Default: on in production mode, off otherwise.
    secure_cookies: Option<bool>,
    /// Proxies (CIDRs) whose `X-Forwarded-For` names the client for the sign-in limit.
    #[serde(default)]
    trusted_proxies: Vec<String>,
}

/// Least argon2id memory accepted: below this the hash is cheap to attack.
const MIN_ARGON2_MEMORY_KIB: u32 = 8 * 1024;

impl ConsoleSection {
    /// The console's settings; its cookies carry `Secure` unless the operator says otherwise
    /// when `reached_over_https` (production mode, or TLS served by this process).
    fn resolve(
        self,
        reached_over_https: bool,
    ) -> anyhow::Result<wor_server::console::ConsoleConfig> {
        use std::time::Duration;
        let defaults = wor_server::console::ConsoleConfig::default();
        let positive = |value: Option<u64>, key: &str, unit: u64, default: Duration| match value {
            Some(0) => bail!("`[console] {key}` must be at least 1"),
            Some(n) => Ok(Duration::from_secs(n.saturating_mul(unit))),
            None => Ok(default),
        };
        let at_least_one = |value: Option<u32>, key: &str, default: u32| match value {
            Some(0) => bail!("`[console] {key}` must be at least 1"),
            Some(n) => Ok(n),
            None => Ok(default),
        };
        let config = wor_server::console::ConsoleConfig {
            argon2_memory_kib: match self.argon2_memory_kib {
                Some(kib) if kib < MIN_ARGON2_MEMORY_KIB => {
                    bail!("`[console] argon2_memory_kib` must be at least {MIN_ARGON2_MEMORY_KIB}")
                }
                Some(kib) => kib,
                None => defaults.argon2_memory_kib,
            },
            argon2_iterations: at_least_one(
                self.argon2_iterations,
                "argon2_iterations",
                defaults.argon2_iterations,
            )?,
            argon2_parallelism: at_least_one(
                self.argon2_parallelism,
                "argon2_parallelism",
                defaults.argon2_parallelism,
            )?,
            invitation_ttl: positive(
                self.invitation_ttl_hours,
                "invitation_ttl_hours",
                3600,
                defaults.invitation_ttl,
            )?,
            session_idle: positive(
                self.session_idle_minutes,
                "session_idle_minutes",
                60,
                defaults.session_idle,
            )?,
            session_absolute: positive(
                self.session_absolute_hours,
                "session_absolute_hours",
                3600,
                defaults.session_absolute,
            )?,
            max_failures_per_account: at_least_one(
                self.max_failed_sign_ins_per_account,
                "max_failed_sign_ins_per_account",
                defaults.max_failures_per_account,
            )?,
            max_failures_per_address: at_least_one(
                self.max_failed_sign_ins_per_address,
                "max_failed_sign_ins_per_address",
                defaults.max_failures_per_address,
            )?,
            lockout: positive(
                self.lockout_minutes,
                "lockout_minutes",
                60,
                defaults.lockout,
            )?,
            secure_cookies: self.secure_cookies.unwrap_or(reached_over_https),
            trusted_proxies: self
                .trusted_proxies
                .iter()
                .map(|text| {
                    text.parse::<ipnet::IpNet>()
                        .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                        .map_err(|_| {
                            anyhow::anyhow!(
                                "`[console] trusted_proxies`: `{text}` is not an address or a CIDR"
                            )
                        })
                })
                .collect::<anyhow::Result<_>>()?,
        };
        wor_server::console::password::check_parameters(&config)
            .map_err(|e| anyhow::anyhow!("`[console]`: {e}"))?;
        Ok(config)
    }
}

/// Values given on the command line (or through their environment variables, which clap reads).
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ServerFlags {
    /// TOML configuration file.
    #[arg(long, env = env::CONFIG, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of the embedded database and generated keys [default: ./.wor].
    #[arg(long, env = env::DATA_DIR, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Database URL, `postgres://…`; without it the embedded SQLite database in the data dir.
    #[arg(long, env = env::DATABASE_URL, value_name = "URL", hide_env_values = true)]
    pub database: Option<String>,
}

/// Everything `wor serve` runs with.
#[derive(Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Whether `listen` was given (flag, environment or file) rather than the default: a
    /// worker serves its probes only then.
    pub listen_given: bool,
    pub data_dir: PathBuf,
    pub database: Option<String>,
    pub production: bool,
    pub demo: bool,
    /// The operator's `[egress] allowed_cidrs`.
    pub egress_allowed_cidrs: Vec<String>,
    /// The operator's `[egress] model_cidrs`: open to model connections only.
    pub egress_model_cidrs: Vec<String>,
    /// At most this many runs of one project run at once.
    pub max_running_per_project: u64,
    /// How many runs this process drives at once.
    pub workers: usize,
    /// How long an approval request waits for a decision before it counts as denied.
    pub approval_ttl: std::time::Duration,
    /// How long a claim of a run lasts unless renewed: a run whose driver died waits this long
    /// before another resumes it.
    pub lease: std::time::Duration,
    /// The operator's `[sandbox] allowed_paths`.
    pub stdio_allowed_roots: Vec<PathBuf>,
    /// What each model costs; a model without a price costs nothing against budgets.
    pub prices: std::collections::BTreeMap<String, wor_core::budget::ModelPrice>,
    /// The web console's `[console]` settings.
    pub console: wor_server::console::ConsoleConfig,
    /// Where people reach this server, for links in notifications (`public_url`).
    pub public_url: Option<String>,
    /// Where `GET /metrics` is served (`[metrics] listen`); `None`: no metrics at all.
    pub metrics_listen: Option<SocketAddr>,
    /// Where spans are sent (`[traces]`); `None`: no traces at all.
    pub traces: Option<TracesConfig>,
    /// The certificate and key the listener serves HTTPS with (`[tls] cert`, `key`).
    pub tls: Option<wor_server::tls::TlsFiles>,
    /// `[tls] behind_proxy`: a proxy in front terminates TLS.
    pub behind_proxy: bool,
    /// `[notifications] smtp_plaintext_loopback`.
    pub smtp_plaintext_loopback: bool,
    /// `[notifications] smtp_ca_file`: the certificates in it (DER), trusted for SMTP relays.
    pub smtp_root_certificates: Vec<Vec<u8>>,
    encryption_key: Option<String>,
    audit_signing_key: Option<String>,
    encryption_key_retired: Option<String>,
}

/// Where the key ring's primary key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    Environment,
    DevFileLoaded,
    DevFileCreated,
}

impl ServerConfig {
    /// Converges file, environment and flags. `listen` and `production` come from `serve`'s own
    /// flags; `None` / `false` there means "not given". What it cannot use is a
    /// [`UsageError`](crate::UsageError).
    pub fn resolve(
        flags: &ServerFlags,
        listen: Option<&str>,
        production_flag: bool,
    ) -> anyhow::Result<Self> {
        Self::converge(flags, listen, production_flag).map_err(|err| crate::UsageError(err).into())
    }

    fn converge(
        flags: &ServerFlags,
        listen: Option<&str>,
        production_flag: bool,
    ) -> anyhow::Result<Self> {
        let file = match &flags.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let listen_given = listen.is_some() || file.listen.is_some();
        let listen_text = listen
            .map(str::to_owned)
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen = listen_address(&listen_text).context("the listen address")?;
        let production = production_flag
            || env_flag(env::ENV, &["production"], &["development"])?
            || file.production.unwrap_or(false);
        let tls = file.tls.unwrap_or_default();
        let tls_files = match (tls.cert, tls.key) {
            (Some(cert), Some(key)) => Some(wor_server::tls::TlsFiles { cert, key }),
            (None, None) => None,
            _ => bail!("`[tls]` needs both `cert` and `key`"),
        };
        if tls.behind_proxy && tls.proxy_cidrs.is_empty() {
            bail!(
                "`[tls] behind_proxy = true` needs `proxy_cidrs`: the proxy's addresses, the only \
                 ones whose forwarded client addresses are believed"
            );
        }
        if !tls.behind_proxy && !tls.proxy_cidrs.is_empty() {
            bail!("`[tls] proxy_cidrs` is given without `behind_proxy = true`");
        }
        // Checked here, in the operator's words: they join `[console] trusted_proxies` below.
        for text in &tls.proxy_cidrs {
            if text.parse::<ipnet::IpNet>().is_err() && text.parse::<std::net::IpAddr>().is_err() {
                bail!("`[tls] proxy_cidrs`: `{text}` is not an address or a CIDR");
            }
        }
        let mut console_section = file.console.unwrap_or_default();
        console_section
            .trusted_proxies
            .extend(tls.proxy_cidrs.iter().cloned());
        // A console this process serves over HTTPS itself is reached over HTTPS.
        let reached_over_https = production || tls_files.is_some();
        let demo =
            env_flag(env::DEMO, &["1", "true"], &["0", "false"])? || file.demo.unwrap_or(false);
        let encryption_key = std::env::var(env::ENCRYPTION_KEY)
            .ok()
            .filter(|k| !k.is_empty());
        let encryption_key_retired = std::env::var(env::ENCRYPTION_KEY_RETIRED)
            .ok()
            .filter(|k| !k.trim().is_empty());
        let audit_signing_key = std::env::var(env::AUDIT_SIGNING_KEY)
            .ok()
            .filter(|k| !k.trim().is_empty());
        Ok(ServerConfig {
            listen,
            listen_given,
            data_dir: match flags.data_dir.clone().or(file.data_dir) {
                Some(dir) if dir.as_os_str().is_empty() => {
                    bail!("`data_dir` is empty: name a directory (default `{DEFAULT_DATA_DIR}`)")
                }
                Some(dir) => dir,
                None => PathBuf::from(DEFAULT_DATA_DIR),
            },
            database: flags.database.clone().or(file.database),
            production,
            demo,
            egress_allowed_cidrs: file
                .egress
                .as_ref()
                .map(|e| e.allowed_cidrs.clone())
                .unwrap_or_default(),
            egress_model_cidrs: file.egress.map(|e| e.model_cidrs).unwrap_or_default(),
            max_running_per_project: match file.max_running_per_project {
                Some(0) => bail!("`max_running_per_project` must be at least 1"),
                Some(n) => n,
                None => DEFAULT_MAX_RUNNING_PER_PROJECT,
            },
            workers: match file.workers {
                Some(0) => bail!("`workers` must be at least 1"),
                // As `--workers` takes them.
                Some(n) if n > usize::from(u16::MAX) => {
                    bail!("`workers` is at most {}, not {n}", u16::MAX)
                }
                Some(n) => n,
                None => wor_engine::DEFAULT_WORKERS,
            },
            approval_ttl: match file.approval_ttl_seconds {
                Some(0) => bail!("`approval_ttl_seconds` must be at least 1"),
                Some(n) if n > MAX_APPROVAL_TTL_SECONDS => bail!(
                    "`approval_ttl_seconds` is at most {MAX_APPROVAL_TTL_SECONDS} (365 days), not {n}"
                ),
                Some(n) => std::time::Duration::from_secs(n),
                None => wor_engine::DEFAULT_APPROVAL_TTL,
            },
            lease: match file.lease_seconds {
                Some(n @ MIN_LEASE_SECONDS..=MAX_LEASE_SECONDS) => {
                    std::time::Duration::from_secs(n)
                }
                Some(n) => bail!(
                    "`lease_seconds` must be {MIN_LEASE_SECONDS} to {MAX_LEASE_SECONDS}, not {n}"
                ),
                None => std::time::Duration::from_secs(DEFAULT_LEASE_SECONDS),
            },
            stdio_allowed_roots: match file.sandbox {
                Some(section) => {
                    for path in &section.allowed_paths {
                        if !path.is_absolute() || path.parent().is_none() {
                            bail!(
                                "`[sandbox] allowed_paths`: `{}` must be an absolute directory other than `/`",
                                path.display()
                            );
                        }
                    }
                    section.allowed_paths
                }
                None => Vec::new(),
            },
            prices: file.prices,
            console: console_section.resolve(reached_over_https)?,
            smtp_plaintext_loopback: file
                .notifications
                .as_ref()
                .is_some_and(|n| n.smtp_plaintext_loopback),
            smtp_root_certificates: match file
                .notifications
                .as_ref()
                .and_then(|n| n.smtp_ca_file.as_ref())
            {
                Some(path) => smtp_roots(path)?,
                None => Vec::new(),
            },
            public_url: match file.public_url {
                Some(url) => {
                    let parsed = url::Url::parse(&url)
                        .map_err(|e| anyhow::anyhow!("`public_url` is not a URL: {e}"))?;
                    if !matches!(parsed.scheme(), "http" | "https") || parsed.cannot_be_a_base() {
                        bail!("`public_url` must be an http or https URL");
                    }
                    Some(url.trim_end_matches('/').to_owned())
                }
                None => None,
            },
            metrics_listen: match file.metrics.and_then(|m| m.listen) {
                Some(text) => Some(listen_address(&text).context("`[metrics] listen`")?),
                None => None,
            },
            traces: match file.traces {
                Some(TracesSection {
                    endpoint: Some(endpoint),
                    allowed_cidrs,
                    propagate_to,
                }) => Some(TracesConfig {
                    endpoint,
                    allowed_cidrs,
                    propagate_to: wor_egress::HostAllowlist::parse(&propagate_to)
                        .map_err(|e| anyhow::anyhow!("`[traces] propagate_to`: {e}"))?,
                }),
                Some(TracesSection {
                    endpoint: None,
                    allowed_cidrs,
                    propagate_to,
                }) if !allowed_cidrs.is_empty() || !propagate_to.is_empty() => {
                    bail!(
                        "`[traces] allowed_cidrs` and `propagate_to` are set without `[traces] endpoint`"
                    )
                }
                _ => None,
            },
            tls: tls_files,
            behind_proxy: tls.behind_proxy,
            encryption_key,
            encryption_key_retired,
            audit_signing_key,
        })
    }

    /// The key ring secrets are sealed under. With `WOR_ENCRYPTION_KEY` set, a development key
    /// file left in the data dir joins as a retired key, so `wor secrets rotate` can move its
    /// values to the real key. Without it (development only) the key file in the data dir is
    /// used, created on first start.
    pub fn key_ring(&self) -> anyhow::Result<(wor_secrets::KeyRing, KeySource)> {
        let retired = self.encryption_key_retired.as_deref().unwrap_or("");
        match &self.encryption_key {
            Some(primary) => {
                // A variable that holds no key is one the command cannot use: exit 2.
                let mut ring = wor_secrets::KeyRing::from_env_values(Some(primary), retired)
                    .map_err(|error| {
                        crate::UsageError(anyhow::Error::new(error).context(format!(
                            "{} or {}",
                            env::ENCRYPTION_KEY,
                            env::ENCRYPTION_KEY_RETIRED
                        )))
                    })?;
                if let Some(dev) = wor_secrets::load_dev_key(&self.data_dir)? {
                    ring = ring.with_retired_ring(dev);
                }
                Ok((ring, KeySource::Environment))
            }
            None if self.production => bail!("{} is not set", env::ENCRYPTION_KEY),
            None if !retired.is_empty() => bail!(
                "{} is set without {}: retired keys need a primary key",
                env::ENCRYPTION_KEY_RETIRED,
                env::ENCRYPTION_KEY
            ),
            None => {
                let (ring, origin) = wor_secrets::load_or_create_dev_key(&self.data_dir)?;
                Ok((
                    ring,
                    match origin {
                        wor_secrets::DevKeyOrigin::Created => KeySource::DevFileCreated,
                        wor_secrets::DevKeyOrigin::Loaded => KeySource::DevFileLoaded,
                    },
                ))
            }
        }
    }

    /// Whether `WOR_ENCRYPTION_KEY` is set.
    pub fn encryption_key_set(&self) -> bool {
        self.encryption_key.is_some()
    }

    /// Whether a key is configured without making one: `WOR_ENCRYPTION_KEY`, or a development
    /// key file already in the data dir.
    pub fn encryption_key_configured(&self) -> anyhow::Result<bool> {
        Ok(self.encryption_key.is_some() || wor_secrets::load_dev_key(&self.data_dir)?.is_some())
    }

    /// The audit signing key: from the environment, else `audit-signing.key` in the data dir,
    /// created (mode 0600) when missing.
    pub fn audit_signing_key(&self) -> anyhow::Result<AuditSigningKey> {
        AuditSigningKey::from_env_or_dir(self.audit_signing_key.as_deref(), &self.data_dir).map_err(
            |error| {
                let error = anyhow::Error::new(error).context(format!(
                    "cannot load the audit signing key ({})",
                    env::AUDIT_SIGNING_KEY
                ));
                // A variable that holds no key is one the command cannot use: exit 2. A key
                // file that cannot be read or made is a failure.
                if self.audit_signing_key.is_some() {
                    crate::UsageError(error).into()
                } else {
                    error
                }
            },
        )
    }

    /// Whether `WOR_AUDIT_SIGNING_KEY` gives the audit signing key.
    pub fn audit_signing_key_set(&self) -> bool {
        self.audit_signing_key.is_some()
    }

    /// Whether an audit signing key is configured without making one: `WOR_AUDIT_SIGNING_KEY`,
    /// or the key file already in the data dir.
    pub fn audit_signing_key_configured(&self) -> bool {
        self.audit_signing_key.is_some() || self.data_dir.join(AUDIT_SIGNING_KEY_FILE_NAME).exists()
    }

    /// The key that verifies this installation's checkpoints, without creating a signing key.
    pub fn audit_verifying_key(&self) -> anyhow::Result<VerifyingKey> {
        if !self.audit_signing_key_configured() {
            bail!(
                "no audit signing key: {} is not set and `{}` has no {AUDIT_SIGNING_KEY_FILE_NAME} \
                 (give the public key that verifies the chain with --public-key instead)",
                env::AUDIT_SIGNING_KEY,
                self.data_dir.display()
            );
        }
        Ok(self.audit_signing_key()?.verifying_key())
    }

    /// Why the metrics listener may be reachable from hosts that should not read it: bound to
    /// every address, or to a public one. `GET /metrics` asks for no credential.
    pub fn metrics_exposure(&self) -> Option<String> {
        let addr = self.metrics_listen?;
        // `::ffff:0.0.0.0` binds every IPv4 address as `0.0.0.0` does.
        let ip = addr.ip().to_canonical();
        let reach = if ip.is_unspecified() {
            "every address of this host"
        } else if wor_egress::classify(ip).is_none() {
            "a public address"
        } else {
            return None;
        };
        Some(format!(
            "the metrics listener {addr} is on {reach}, and `GET /metrics` asks for no \
             credential: bind `[metrics] listen` to loopback or a private address that only the \
             scraper reaches"
        ))
    }

    /// Production refuses to start with demo mode, without an encryption key, or with any
    /// default credential. Returns every problem found, not only the first.
    pub fn production_problems(&self) -> Vec<String> {
        if !self.production {
            return Vec::new();
        }
        let mut problems = Vec::new();
        if self.demo {
            problems.push(format!(
                "demo mode is on ({} or `demo = true`); production never runs demo mode",
                env::DEMO
            ));
        }
        match &self.encryption_key {
            None => problems.push(format!(
                "{} is not set; production needs a 32-byte base64 key (generate one with `wor secrets generate-key`)",
                env::ENCRYPTION_KEY
            )),
            Some(key) => {
                if let Some(problem) = encryption_key_problem(key) {
                    problems.push(problem);
                }
            }
        }
        if self.tls.is_none() && !self.behind_proxy && !self.listen.ip().is_loopback() {
            problems.push(format!(
                "the listener {} is plaintext on a non-loopback address; configure `[tls] cert` \
                 and `key`, or `[tls] behind_proxy = true` with the proxy's `proxy_cidrs`",
                self.listen
            ));
        }
        if let Some(problem) = self
            .database
            .as_deref()
            .and_then(database_credential_problem)
        {
            problems.push(problem);
        }
        problems
    }
}

/// The CA certificates of `[notifications] smtp_ca_file`, as DER; a file without one, or
/// with one that is not PEM, is refused at start.
fn smtp_roots(path: &Path) -> anyhow::Result<Vec<Vec<u8>>> {
    let certificates = pem_certificates(path).map_err(|reason| {
        anyhow::anyhow!(
            "`[notifications] smtp_ca_file` {} cannot be used: {reason}",
            path.display()
        )
    })?;
    Ok(certificates.into_iter().map(|c| c.to_vec()).collect())
}

/// The most of a file of certificates read: certificates, not a disk image.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// The certificates of the PEM file at `path` (its other blocks, a key say, passed over), each
/// parsed, so that a damaged one is named when the file is read rather than at first use; why
/// not, when the file cannot be read, is larger than 1 MiB, holds a block that is not PEM or a
/// certificate that does not parse, or holds none. For the operator's files of certificates to
/// trust: `[notifications] smtp_ca_file`, and a client's `--ca-cert`.
pub(crate) fn pem_certificates(
    path: &Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let mut bytes = Vec::new();
    {
        use std::io::Read as _;
        std::fs::File::open(path)
            .and_then(|file| file.take(MAX_PEM_BYTES + 1).read_to_end(&mut bytes))
            .map_err(|e| format!("cannot read it: {e}"))?;
    }
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_PEM_BYTES {
        return Err(format!("it is larger than {} MiB", MAX_PEM_BYTES >> 20));
    }
    let mut certificates = Vec::new();
    for (n, certificate) in CertificateDer::pem_slice_iter(&bytes).enumerate() {
        let number = n + 1;
        let certificate =
            certificate.map_err(|e| format!("certificate {number} is not PEM: {e}"))?;
        x509_parser::parse_x509_certificate(&certificate)
            .map_err(|e| format!("certificate {number} does not parse: {e}"))?;
        certificates.push(certificate);
    }
    if certificates.is_empty() {
        return Err("it holds no `BEGIN CERTIFICATE` block".to_owned());
    }
    Ok(certificates)
}

fn read_file(path: &Path) -> anyhow::Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read configuration file `{}`", path.display()))?;
    toml::from_str(&text)
        .with_context(|| format!("invalid configuration file `{}`", path.display()))
}

/// Whether variable `name` turns its setting on: a value of `on`; unset, empty or a value of
/// `off` leaves it off. Any other value is refused, naming both lists: a misspelt
/// `WOR_ENV=prod` must not quietly leave production mode off.
fn env_flag(name: &str, on: &[&str], off: &[&str]) -> anyhow::Result<bool> {
    let value = match std::env::var(name) {
        Ok(value) => value,
        Err(std::env::VarError::NotPresent) => return Ok(false),
        Err(std::env::VarError::NotUnicode(_)) => bail!("{name} is not valid UTF-8"),
    };
    let value = value.trim();
    if on.contains(&value) {
        Ok(true)
    } else if value.is_empty() || off.contains(&value) {
        Ok(false)
    } else {
        bail!(
            "{name} is `{}`: set it to {} to turn it on, or {} (or leave it unset) to leave it off",
            value.chars().take(40).collect::<String>(),
            on.join(" or "),
            off.join(" or ")
        )
    }
}

fn encryption_key_problem(key: &str) -> Option<String> {
    let bytes = match base64::engine::general_purpose::STANDARD.decode(key.trim()) {
        Ok(bytes) => bytes,
        Err(_) => return Some(format!("{} is not valid base64", env::ENCRYPTION_KEY)),
    };
    if bytes.len() != 32 {
        return Some(format!(
            "{} decodes to {} bytes; it must be exactly 32",
            env::ENCRYPTION_KEY,
            bytes.len()
        ));
    }
    let all_same = bytes.windows(2).all(|w| w.first() == w.get(1));
    if key.trim() == DOCUMENTED_EXAMPLE_KEY || all_same {
        return Some(format!(
            "{} is a default or example key; generate a fresh one",
            env::ENCRYPTION_KEY
        ));
    }
    None
}

fn database_credential_problem(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return None;
    }
    // A socket connection (`host=/run/postgresql`) authenticates by peer, not by password.
    let over_socket = parsed.host_str().is_none_or(str::is_empty)
        || parsed
            .query_pairs()
            .any(|(k, v)| k == "host" && v.starts_with('/'));
    if over_socket {
        return None;
    }
    let password = parsed.password().unwrap_or("");
    let user = parsed.username();
    if DEFAULT_PASSWORDS.contains(&password) || password == user {
        return Some(format!(
            "the database URL uses a default or empty password for user `{user}`; set a real one"
        ));
    }
    None
}

/// The address a listener binds: `IP:PORT` (`[IPv6]:PORT`), or `localhost:PORT`, the IPv4
/// loopback. Other host names are refused rather than looked up: every command that reads the
/// configuration reads this, offline ones too, and none should depend on a resolver.
fn listen_address(text: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let form = "is not of the form `IP:PORT`, `[IPv6]:PORT` or `localhost:PORT`";
    let Some((host, port)) = text.rsplit_once(':') else {
        bail!("`{text}` {form}: it has no port");
    };
    let port: u16 = port
        .parse()
        .map_err(|_| anyhow::anyhow!("`{text}` {form}: `{port}` is not a port (0 to 65535)"))?;
    if host.is_empty() {
        bail!("`{text}` {form}: it has no host (all addresses are `0.0.0.0:{port}`)");
    }
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if host.contains([':', '[', ']']) {
        bail!("`{text}` {form}: an IPv6 address is written `[ADDRESS]:PORT`");
    }
    bail!("`{text}` {form}: a host name other than `localhost` is not looked up; give its address")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listen_address_is_an_ip_and_port_or_localhost_and_port() {
        for (text, want) in [
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("[::1]:9000", "[::1]:9000"),
            ("localhost:8080", "127.0.0.1:8080"),
            ("LocalHost:0", "127.0.0.1:0"),
        ] {
            assert_eq!(listen_address(text).unwrap().to_string(), want, "{text}");
        }
        for (text, says) in [
            ("8080", "has no port"),
            (":8080", "has no host"),
            ("localhost:http", "is not a port"),
            ("localhost:65536", "is not a port"),
            ("::1:8080", "`[ADDRESS]:PORT`"),
            ("wor.example:8080", "is not looked up"),
        ] {
            let refused = format!("{:#}", listen_address(text).unwrap_err());
            assert!(refused.contains(says), "{text}: {refused}");
        }
    }

    #[test]
    fn smtp_ca_file_is_read_as_pem_certificates_and_one_without_any_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["relay.test".to_owned()]).unwrap();
        let pem = dir.path().join("relay-ca.pem");
        std::fs::write(&pem, made.cert.pem()).unwrap();
        let file: FileConfig = toml::from_str(&format!(
            "[notifications]\nsmtp_ca_file = {:?}\n",
            pem.display().to_string()
        ))
        .unwrap();
        let path = file.notifications.unwrap().smtp_ca_file.unwrap();
        assert_eq!(smtp_roots(&path).unwrap(), vec![made.cert.der().to_vec()]);
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let refused = smtp_roots(&empty).unwrap_err().to_string();
        assert!(
            refused.contains("holds no `BEGIN CERTIFICATE` block"),
            "{refused}"
        );
        assert!(smtp_roots(&dir.path().join("missing.pem")).is_err());
    }

    fn config(production: bool, demo: bool, key: Option<&str>, db: Option<&str>) -> ServerConfig {
        ServerConfig {
            listen: DEFAULT_LISTEN.parse().unwrap(),
            listen_given: false,
            data_dir: PathBuf::from("x"),
            database: db.map(str::to_owned),
            production,
            demo,
            egress_allowed_cidrs: Vec::new(),
            egress_model_cidrs: Vec::new(),
            max_running_per_project: DEFAULT_MAX_RUNNING_PER_PROJECT,
            workers: wor_engine::DEFAULT_WORKERS,
            approval_ttl: wor_engine::DEFAULT_APPROVAL_TTL,
            lease: std::time::Duration::from_secs(DEFAULT_LEASE_SECONDS),
            stdio_allowed_roots: Vec::new(),
            prices: Default::default(),
            console: Default::default(),
            public_url: None,
            metrics_listen: None,
            traces: None,
            tls: None,
            behind_proxy: false,
            smtp_plaintext_loopback: false,
            smtp_root_certificates: Vec::new(),
            encryption_key: key.map(str::to_owned),
            encryption_key_retired: None,
            audit_signing_key: None,
        }
    }

    const GOOD_KEY: &str = "q6mZ2k0kq3c7b1pY8Jx0M1yJc4pN9rO2vW6tU5sR3aE=";

    #[test]
    fn a_metrics_listener_on_every_or_a_public_address_is_called_exposed() {
        for (listen, exposed) in [
            ("127.0.0.1:9464", None),
            ("10.0.3.7:9464", None),
            ("[fd00::7]:9464", None),
            ("0.0.0.0:9464", Some("every address of this host")),
            ("[::]:9464", Some("every address of this host")),
            ("[::ffff:0.0.0.0]:9464", Some("every address of this host")),
            ("203.0.113.9:9464", None),
            ("8.8.4.4:9464", Some("a public address")),
        ] {
            let config = ServerConfig {
                metrics_listen: Some(listen.parse().unwrap()),
                ..config(false, false, None, None)
            };
            let found = config.metrics_exposure();
            match exposed {
                None => assert_eq!(found, None, "{listen}"),
                Some(reach) => {
                    let said = found.unwrap_or_else(|| panic!("{listen} is exposed"));
                    assert!(
                        said.contains(reach) && said.contains("no credential"),
                        "{said}"
                    );
                }
            }
        }
        assert_eq!(config(false, false, None, None).metrics_exposure(), None);
    }

    #[test]
    fn the_lease_comes_from_the_file_within_its_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        let flags = ServerFlags {
            config: Some(path.clone()),
            ..ServerFlags::default()
        };
        std::fs::write(&path, "").unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(config.lease, std::time::Duration::from_secs(30));
        std::fs::write(&path, "lease_seconds = 5\n").unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(config.lease, std::time::Duration::from_secs(5));
        for refused in ["4", "3601"] {
            std::fs::write(&path, format!("lease_seconds = {refused}\n")).unwrap();
            let error = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap_err();
            assert!(
                format!("{error:#}").contains("`lease_seconds` must be 5 to 3600"),
                "{error:#}"
            );
        }
    }

    #[test]
    fn file_values_out_of_their_bounds_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        let flags = ServerFlags {
            config: Some(path.clone()),
            ..ServerFlags::default()
        };
        for (text, complaint) in [
            (
                "approval_ttl_seconds = 99999999999999",
                "`approval_ttl_seconds` is at most",
            ),
            ("data_dir = \"\"", "`data_dir` is empty"),
            (
                "[tls]\nbehind_proxy = true\nproxy_cidrs = [\"garbage\"]",
                "`[tls] proxy_cidrs`: `garbage` is not an address or a CIDR",
            ),
        ] {
            std::fs::write(&path, format!("{text}\n")).unwrap();
            let error = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap_err();
            assert!(
                format!("{error:#}").contains(complaint),
                "{text}: {error:#}"
            );
        }
        std::fs::write(&path, "approval_ttl_seconds = 31536000\n").unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(
            config.approval_ttl,
            std::time::Duration::from_secs(31_536_000)
        );
    }

    #[test]
    fn prices_come_from_the_file_and_typos_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        std::fs::write(
            &path,
            "[prices.\"m\"]\ninput_microdollars_per_mtok = 3\noutput_microdollars_per_mtok = 15\n",
        )
        .unwrap();
        let flags = ServerFlags {
            config: Some(path.clone()),
            ..ServerFlags::default()
        };
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(config.prices["m"].output_microdollars_per_mtok, 15);
        std::fs::write(&path, "[prices.\"m\"]\ninput_per_mtok = 3\n").unwrap();
        let error = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap_err();
        assert!(format!("{error:#}").contains("input_per_mtok"), "{error:#}");
    }

    #[test]
    fn trace_context_goes_only_to_listed_tool_servers_and_a_bad_entry_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        let flags = ServerFlags {
            config: Some(path.clone()),
            ..ServerFlags::default()
        };
        let resolve = |text: &str| {
            std::fs::write(&path, text).unwrap();
            ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false)
        };
        let endpoint = "[traces]\nendpoint = \"http://10.0.0.5:4318/v1/traces\"\n";
        let none = resolve(endpoint).unwrap();
        assert!(none.traces.unwrap().propagate_to.patterns().is_empty());
        let listed = resolve(&format!("{endpoint}propagate_to = [\"tracker.example\"]\n")).unwrap();
        let propagate_to = listed.traces.unwrap().propagate_to;
        let url = wor_egress::EgressUrl::parse("https://tracker.example/mcp").unwrap();
        assert!(propagate_to.allows(url.host(), url.port()));
        let other = wor_egress::EgressUrl::parse("https://other.example/mcp").unwrap();
        assert!(!propagate_to.allows(other.host(), other.port()));
        let bad = resolve(&format!("{endpoint}propagate_to = [\"https://x/\"]\n")).unwrap_err();
        assert!(format!("{bad:#}").contains("propagate_to"), "{bad:#}");
        let alone = resolve("[traces]\npropagate_to = [\"tracker.example\"]\n").unwrap_err();
        assert!(format!("{alone:#}").contains("without"), "{alone:#}");
    }

    #[test]
    fn the_worker_pool_size_comes_from_the_file_and_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        let flags = ServerFlags {
            config: Some(path.clone()),
            ..ServerFlags::default()
        };
        std::fs::write(&path, "").unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(config.workers, wor_engine::DEFAULT_WORKERS);
        std::fs::write(&path, "workers = 64\n").unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(config.workers, 64);
        for (text, says) in [
            ("workers = 0\n", "must be at least 1"),
            ("workers = 100000000\n", "is at most 65535"),
        ] {
            std::fs::write(&path, text).unwrap();
            let error = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap_err();
            assert!(format!("{error:#}").contains(says), "{error:#}");
        }
    }

    #[test]
    fn console_settings_come_from_the_file_with_safe_defaults_and_floors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        let flags = ServerFlags {
            config: Some(path.clone()),
            ..ServerFlags::default()
        };
        std::fs::write(&path, "").unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(
            config.console,
            wor_server::console::ConsoleConfig::default()
        );
        std::fs::write(
            &path,
            "[console]\nargon2_memory_kib = 65536\nargon2_iterations = 3\nsession_idle_minutes = 5\n",
        )
        .unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert_eq!(config.console.argon2_memory_kib, 65536);
        assert_eq!(config.console.argon2_iterations, 3);
        assert_eq!(config.console.session_idle.as_secs(), 300);
        assert!(
            !config.console.secure_cookies,
            "plain HTTP outside production"
        );
        assert!(config.console.trusted_proxies.is_empty());
        std::fs::write(
            &path,
            "production = true\n[console]\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n",
        )
        .unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert!(
            config.console.secure_cookies,
            "Secure by default in production"
        );
        assert_eq!(
            config.console.trusted_proxies,
            vec![
                "10.0.0.0/8".parse::<ipnet::IpNet>().unwrap(),
                "::1/128".parse().unwrap()
            ]
        );
        std::fs::write(
            &path,
            "production = true\n[console]\nsecure_cookies = false\n",
        )
        .unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert!(!config.console.secure_cookies, "the operator's word");
        std::fs::write(&path, "[tls]\ncert = \"c.pem\"\nkey = \"k.pem\"\n").unwrap();
        let config = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap();
        assert!(
            config.console.secure_cookies,
            "Secure by default when this process serves HTTPS"
        );
        for (text, complaint) in [
            ("trusted_proxies = [\"a proxy\"]", "trusted_proxies"),
            ("argon2_memory_kib = 1024", "argon2_memory_kib"),
            ("argon2_parallelism = 0", "argon2_parallelism"),
            ("lockout_minutes = 0", "lockout_minutes"),
            ("session_idle = 5", "session_idle"),
        ] {
            std::fs::write(&path, format!("[console]\n{text}\n")).unwrap();
            let error = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap_err();
            assert!(
                format!("{error:#}").contains(complaint),
                "{text}: {error:#}"
            );
        }
    }

    /// The example file in docs/configuration.md loads, and production mode accepts it with a
    /// real key: an operator who starts from it is not refused.
    #[test]
    fn the_documented_example_file_loads_and_production_accepts_it() {
        let doc = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/configuration.md"
        ));
        let example = doc
            .split_once("## Example file")
            .and_then(|(_, rest)| rest.split_once("```toml\n"))
            .and_then(|(_, rest)| rest.split_once("\n```"))
            .map(|(block, _)| block)
            .expect("docs/configuration.md has an example file");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        std::fs::write(&path, example).unwrap();
        let flags = ServerFlags {
            config: Some(path),
            ..ServerFlags::default()
        };
        let mut config = ServerConfig::resolve(&flags, None, false).unwrap();
        assert!(config.production, "the example is a production file");
        assert_eq!(config.listen.to_string(), "0.0.0.0:8443");
        assert!(config.console.secure_cookies);
        config.encryption_key = Some(GOOD_KEY.to_owned());
        assert_eq!(config.production_problems(), Vec::<String>::new());
    }

    #[test]
    fn production_refuses_a_plaintext_public_listener_unless_a_proxy_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wor.toml");
        let flags = ServerFlags {
            config: Some(path.clone()),
            ..ServerFlags::default()
        };
        let problems = |text: &str, listen: &str| {
            std::fs::write(&path, text).unwrap();
            let mut config = ServerConfig::resolve(&flags, Some(listen), false).unwrap();
            config.encryption_key = Some(GOOD_KEY.to_owned());
            config.production_problems()
        };
        let plaintext = |p: &Vec<String>| p.iter().any(|m| m.contains("plaintext"));
        assert!(plaintext(&problems("production = true\n", "0.0.0.0:8080")));
        assert!(plaintext(&problems("production = true\n", "[::]:8080")));
        assert!(!plaintext(&problems(
            "production = true\n",
            "127.0.0.1:8080"
        )));
        assert!(!plaintext(&problems("production = true\n", "[::1]:8080")));
        assert!(!plaintext(&problems("", "0.0.0.0:8080")), "development");
        let behind =
            "production = true\n[tls]\nbehind_proxy = true\nproxy_cidrs = [\"10.1.0.0/24\"]\n";
        assert_eq!(problems(behind, "0.0.0.0:8080"), Vec::<String>::new());
        std::fs::write(&path, behind).unwrap();
        let config = ServerConfig::resolve(&flags, Some("0.0.0.0:8080"), false).unwrap();
        assert_eq!(
            config.console.trusted_proxies,
            vec!["10.1.0.0/24".parse::<ipnet::IpNet>().unwrap()],
            "forwarded addresses are believed from the proxy only"
        );
        let with_tls = "production = true\n[tls]\ncert = \"c.pem\"\nkey = \"k.pem\"\n";
        assert!(!plaintext(&problems(with_tls, "0.0.0.0:8443")));
        for (text, complaint) in [
            ("[tls]\nbehind_proxy = true\n", "needs `proxy_cidrs`"),
            (
                "[tls]\nproxy_cidrs = [\"10.0.0.1\"]\n",
                "without `behind_proxy",
            ),
            ("[tls]\ncert = \"c.pem\"\n", "both `cert` and `key`"),
            (
                "[tls]\nbehind_proxy = true\nproxy_cidrs = [\"a proxy\"]\n",
                "`[tls] proxy_cidrs`: `a proxy` is not an address or a CIDR",
            ),
        ] {
            std::fs::write(&path, text).unwrap();
            let error = ServerConfig::resolve(&flags, Some("127.0.0.1:0"), false).unwrap_err();
            assert!(
                format!("{error:#}").contains(complaint),
                "{text}: {error:#}"
            );
        }
    }

    #[test]
    fn development_has_no_production_problems() {
        assert!(
            config(false, true, None, None)
                .production_problems()
                .is_empty()
        );
    }

    #[test]
    fn production_accepts_a_real_key_and_password() {
        let c = config(
            true,
            false,
            Some(GOOD_KEY),
            Some("postgres://wor:Xk9!vQ2@db:5432/wor"),
        );
        assert_eq!(c.production_problems(), Vec::<String>::new());
    }

    #[test]
    fn production_names_each_problem() {
        let p = config(true, true, None, None).production_problems();
        assert!(p.iter().any(|m| m.contains("demo mode")), "{p:?}");
        assert!(
            p.iter()
                .any(|m| m.contains("WOR_ENCRYPTION_KEY is not set")),
            "{p:?}"
        );
        for bad in [
            DOCUMENTED_EXAMPLE_KEY,
            "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            "short",
            "%%%",
        ] {
            let p = config(true, false, Some(bad), None).production_problems();
            assert_eq!(p.len(), 1, "{bad}: {p:?}");
        }
        for bad in [
            "postgres://postgres:postgres@db/wor",
            "postgres://wor@db/wor",
            "postgresql://admin:admin@db/wor",
            "postgres://wor:changeme@10.0.0.5/wor",
        ] {
            let p = config(true, false, Some(GOOD_KEY), Some(bad)).production_problems();
            assert!(
                p.iter().any(|m| m.contains("default or empty password")),
                "{bad}: {p:?}"
            );
            assert!(
                !p.iter()
                    .any(|m| m.contains(":changeme") || m.contains(":postgres@"))
            );
        }
        let socket = config(
            true,
            false,
            Some(GOOD_KEY),
            Some("postgres:///wor?host=/run/postgresql"),
        );
        assert!(socket.production_problems().is_empty());
    }
}
