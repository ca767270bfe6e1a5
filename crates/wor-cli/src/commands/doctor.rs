//! `wor doctor`: a readiness report for monitoring. Each check is applied for real and says
//! `ok`, `warn` or `FAIL` with a reason; the exit status is 0 only when nothing failed.
//!
//! Checks: every sandbox layer and the Wasm runtime, the encryption key (and what production
//! mode would refuse), the database (reachable, migrations), the clock against the database's,
//! free disk in the data dir, the listeners' addresses (each bound and let go at once), and the
//! listener's TLS certificate when one is configured. It changes nothing: no database or key
//! is created.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use serde_json::json;

use super::sandbox::{self, SandboxFlags};
use crate::config::{ServerConfig, ServerFlags};
use crate::env;

/// Clock difference with the database beyond which approvals' and run credentials' expiries
/// (written with one clock, compared with the other) are off by too much.
const MAX_CLOCK_SKEW: Duration = Duration::from_secs(2);
/// Free space in the data dir below which the check fails, and below which it warns.
const DISK_FAIL_BYTES: u64 = 512 * 1024 * 1024;
const DISK_WARN_BYTES: u64 = 2 * 1024 * 1024 * 1024;
/// A listener certificate expiring sooner than this fails the check; sooner than the second,
/// it warns.
const CERT_FAIL_DAYS: i64 = 7;

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Print `{ready, checks: [{check, status, detail}]}` as JSON.
    #[arg(long)]
    json: bool,
    /// Only the sandbox layers and the Wasm runtime (what a host needs to run local tools).
    #[arg(long)]
    sandbox_only: bool,
    #[command(flatten)]
    flags: SandboxFlags,
    #[command(flatten)]
    server: ServerFlags,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

#[derive(Debug)]
struct Check {
    name: String,
    status: Status,
    detail: String,
}

fn check(name: &str, status: Status, detail: impl Into<String>) -> Check {
    Check {
        name: name.to_owned(),
        status,
        detail: detail.into(),
    }
}

pub async fn run(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let mut checks: Vec<Check> = sandbox::layers(&args.flags)
        .await?
        .into_iter()
        .map(|(layer, supported, detail)| Check {
            name: layer,
            status: if supported { Status::Ok } else { Status::Fail },
            // A supported layer is printed as `supported`, as before the report grew.
            detail: if supported { String::new() } else { detail },
        })
        .collect();
    if !args.sandbox_only {
        // `wor serve` takes its listener from WOR_LISTEN (or `--listen`) before the file.
        let listen = std::env::var(env::LISTEN).ok().filter(|l| !l.is_empty());
        match ServerConfig::resolve(&args.server, listen.as_deref(), false) {
            Ok(config) => server_checks(&config, &mut checks).await,
            Err(error) => checks.push(check("configuration", Status::Fail, format!("{error:#}"))),
        }
    }
    let ready = checks.iter().all(|c| c.status != Status::Fail);
    if args.json {
        super::print_json(&json!({
            "ready": ready,
            "checks": checks.iter().map(|c| json!({
                "check": c.name,
                "status": c.status.as_str(),
                "detail": c.detail,
            })).collect::<Vec<_>>(),
        }))?;
    } else {
        for c in &checks {
            // A detail can quote what the database or a file holds.
            let detail = super::for_terminal(&c.detail);
            match c.status {
                Status::Ok if c.detail.is_empty() => println!("{:<20} supported", c.name),
                Status::Ok => println!("{:<20} ok: {detail}", c.name),
                Status::Warn => println!("{:<20} warn: {detail}", c.name),
                Status::Fail => println!("{:<20} FAIL: {detail}", c.name),
            }
        }
        println!(
            "{}",
            if ready {
                "ready"
            } else {
                "NOT READY: see the failed checks above"
            }
        );
    }
    Ok(if ready {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn server_checks(config: &ServerConfig, checks: &mut Vec<Check>) {
    let probed = wor_store::probe(config.database.as_deref(), &config.data_dir).await;
    let sealed = probed
        .as_ref()
        .ok()
        .and_then(|p| p.keys.as_ref())
        .map_or(0, |keys| keys.sealed.iter().map(|(_, count)| count).sum());
    checks.push(key_check(config, sealed));
    checks.push(audit_key_check(config));
    checks.push(control_plane_key_check(config));
    // The sections `wor serve` refuses to start on, checked as it checks them.
    checks.push(match super::serve::egress_policy(config) {
        Ok(policy) => check(
            "egress",
            Status::Ok,
            format!(
                "{} operator range(s) open to tools, {} to models only",
                policy.allowed_cidrs().len(),
                policy.model_cidrs().len()
            ),
        ),
        Err(error) => check("egress", Status::Fail, format!("{error:#}")),
    });
    if let Some(traces) = &config.traces {
        checks.push(match super::serve::trace_exporter_for(config, traces) {
            Ok(_) => check(
                "traces",
                Status::Ok,
                format!("spans go to {}", traces.endpoint),
            ),
            Err(error) => check("traces", Status::Fail, format!("{error:#}")),
        });
    }
    for problem in config.production_problems() {
        checks.push(check("production", Status::Fail, problem));
    }
    checks.push(match bind_problem(config.listen) {
        Some((status, why)) => check("listen", status, why),
        None => check(
            "listen",
            Status::Ok,
            format!("{} can be listened on", config.listen),
        ),
    });
    if let Some(addr) = config.metrics_listen {
        let mut problems: Vec<(Status, String)> = bind_problem(addr).into_iter().collect();
        // Each is bound alone above, so a clash between the two shows only here.
        if listeners_clash(addr, config.listen) {
            problems.push((
                Status::Fail,
                format!(
                    "{addr} is where the API listens too ({}): `wor serve` cannot bind both; \
                     give `[metrics] listen` a port of its own",
                    config.listen
                ),
            ));
        }
        problems.extend(
            config
                .metrics_exposure()
                .map(|exposure| (Status::Warn, exposure)),
        );
        checks.push(if problems.is_empty() {
            check(
                "metrics",
                Status::Ok,
                format!("served on {addr}, an address only this host or its network reaches"),
            )
        } else {
            let status = if problems.iter().any(|(status, _)| *status == Status::Fail) {
                Status::Fail
            } else {
                Status::Warn
            };
            let why: Vec<String> = problems.into_iter().map(|(_, why)| why).collect();
            check("metrics", status, why.join("; "))
        });
    }
    match &probed {
        Ok(found) if found.applied_migration < found.latest_migration => checks.push(check(
            "database",
            Status::Warn,
            format!(
                "{} reachable; migrations at {} of {}: `wor serve` applies the rest when it starts",
                found.backend.as_str(),
                found.applied_migration,
                found.latest_migration
            ),
        )),
        Ok(found) if found.applied_migration > found.latest_migration => checks.push(check(
            "database",
            Status::Fail,
            format!(
                "migrations at {}, newer than this release knows ({}): a newer `wor` wrote it",
                found.applied_migration, found.latest_migration
            ),
        )),
        Ok(found) => checks.push(check(
            "database",
            Status::Ok,
            format!(
                "{} reachable; migrations current ({})",
                found.backend.as_str(),
                found.latest_migration
            ),
        )),
        Err(error) => checks.push(check(
            "database",
            Status::Fail,
            wor_secrets::redact_shapes(&error.to_string()).into_owned(),
        )),
    }
    // An audit log whose append-only triggers were dropped or altered can be edited in place.
    if let Some(Some(unguarded)) = probed.as_ref().ok().map(|p| p.audit_unguarded.as_ref()) {
        checks.push(if unguarded.is_empty() {
            check(
                "audit",
                Status::Ok,
                "the audit log is append-only (its triggers as the migrations made them)"
                    .to_owned(),
            )
        } else {
            check(
                "audit",
                Status::Fail,
                format!(
                    "the audit log is not append-only: {}; someone with the database's \
                     credentials altered it. `wor audit verify` shows whether entries changed",
                    unguarded.join(", ")
                ),
            )
        });
    }
    match probed.as_ref().ok().map(|p| p.server_now_ms) {
        Some(Some(server_ms)) => {
            let skew_ms = wor_store::now_millis().saturating_sub(server_ms);
            let skew = Duration::from_millis(skew_ms.unsigned_abs());
            let status = if skew > MAX_CLOCK_SKEW {
                Status::Fail
            } else {
                Status::Ok
            };
            checks.push(check(
                "clock-skew",
                status,
                format!(
                    "{skew_ms} ms against the database (at most {} ms)",
                    MAX_CLOCK_SKEW.as_millis()
                ),
            ));
        }
        Some(None) => checks.push(check(
            "clock-skew",
            Status::Ok,
            "the embedded database has this host's clock",
        )),
        None => checks.push(check(
            "clock-skew",
            Status::Fail,
            "not measured: the database is unreachable",
        )),
    }
    if let Some(keys) = probed.as_ref().ok().and_then(|p| p.keys.as_ref()) {
        checks.push(keys_in_use_check(config, keys));
    }
    checks.push(disk_check(config));
    if let Some(files) = &config.tls {
        checks.push(tls_check(files));
    }
}

/// The listener's certificate loads with its key, how long until it expires, and what
/// clients would hold against it (a CA certificate, no name).
fn tls_check(files: &wor_server::tls::TlsFiles) -> Check {
    if let Err(error) = files.load() {
        return check("tls", Status::Fail, error.to_string());
    }
    match files.facts() {
        Ok(facts) => {
            let warnings = facts.warnings();
            let status = if facts.days_to_expiry() < CERT_FAIL_DAYS || facts.not_valid_yet() {
                Status::Fail
            } else if warnings.is_empty() {
                Status::Ok
            } else {
                Status::Warn
            };
            let detail = if warnings.is_empty() {
                format!("`{}` {}", files.cert.display(), facts.expiry())
            } else {
                warnings.join("; ")
            };
            check("tls", status, detail)
        }
        Err(error) => check(
            "tls",
            Status::Fail,
            format!("the certificate cannot be read: {error}"),
        ),
    }
}

/// Whether two listeners' addresses would keep `wor serve` from binding both: one port (not
/// 0, which each binds anew) on one address, or on `0.0.0.0` and an IPv4 address, or on `[::]`
/// (which takes IPv4 too, as Linux binds it by default) and any address.
fn listeners_clash(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    let covers = |wide: std::net::IpAddr, other: std::net::IpAddr| match wide {
        std::net::IpAddr::V4(ip) => ip.is_unspecified() && other.is_ipv4(),
        std::net::IpAddr::V6(ip) => ip.is_unspecified(),
    };
    // `[::ffff:127.0.0.1]` is 127.0.0.1 to the kernel.
    let (ip_a, ip_b) = (a.ip().to_canonical(), b.ip().to_canonical());
    a.port() == b.port()
        && a.port() != 0
        && (ip_a == ip_b || covers(ip_a, ip_b) || covers(ip_b, ip_a))
}

/// Whether `wor serve` could listen on `addr`: it is bound and let go at once. A warning when
/// something holds it (`wor serve` itself, when it runs), a failure when it cannot be bound.
fn bind_problem(addr: std::net::SocketAddr) -> Option<(Status, String)> {
    use std::io::ErrorKind;
    let error = std::net::TcpListener::bind(addr).err()?;
    Some(match error.kind() {
        ErrorKind::AddrInUse => (
            Status::Warn,
            format!(
                "{addr} is in use: by `wor serve` if it is running, else another process \
                 holds it and `wor serve` would not start"
            ),
        ),
        ErrorKind::AddrNotAvailable => (
            Status::Fail,
            format!(
                "{addr} is an address of no interface of this host: `wor serve` cannot listen on it"
            ),
        ),
        ErrorKind::PermissionDenied if addr.port() < 1024 => (
            Status::Fail,
            format!(
                "this user may not listen on {addr}: a port below 1024 needs root or \
                 CAP_NET_BIND_SERVICE"
            ),
        ),
        _ => (
            Status::Fail,
            format!("{addr} cannot be listened on: {error}"),
        ),
    })
}

/// The encryption key's state; `sealed` is how many secrets the database holds sealed (0 when
/// it could not be read).
fn key_check(config: &ServerConfig, sealed: i64) -> Check {
    if config.encryption_key_set() {
        return match config.key_ring() {
            Ok((ring, _)) => check(
                "encryption-key",
                Status::Ok,
                format!(
                    "{} (primary key id {}); a key from the environment carries no date, so its \
                     age is not known",
                    env::ENCRYPTION_KEY,
                    ring.primary_key_id()
                ),
            ),
            Err(error) => check("encryption-key", Status::Fail, format!("{error:#}")),
        };
    }
    let file = config.data_dir.join(wor_secrets::DEV_KEY_FILE_NAME);
    // A key file `wor serve` would refuse (a loose mode, not a key) is not ready either.
    if let Err(error) = wor_secrets::load_dev_key(&config.data_dir) {
        return check("encryption-key", Status::Fail, format!("{error:#}"));
    }
    let status = if config.production {
        Status::Fail
    } else {
        Status::Warn
    };
    match std::fs::metadata(&file).and_then(|m| m.modified()) {
        Ok(modified) => {
            let days = SystemTime::now()
                .duration_since(modified)
                .unwrap_or_default()
                .as_secs()
                / 86_400;
            check(
                "encryption-key",
                status,
                format!(
                    "development key file `{}`, {days} day(s) old; production needs {}",
                    file.display(),
                    env::ENCRYPTION_KEY
                ),
            )
        }
        // Where secrets are sealed already, a key made now would open none of them.
        Err(_) if sealed > 0 => check(
            "encryption-key",
            Status::Fail,
            format!(
                "no {} and no development key file, and the database holds {sealed} sealed \
                 secret(s): `wor serve` refuses to start without the key they were sealed under",
                env::ENCRYPTION_KEY
            ),
        ),
        Err(_) => check(
            "encryption-key",
            status,
            format!(
                "no {} and no development key file: `wor serve` would generate one (production refuses)",
                env::ENCRYPTION_KEY
            ),
        ),
    }
}

/// The audit signing key as `wor serve` would load it: from the environment, or from its file
/// in the data dir, which must be the server's alone. None yet is fine: a first start makes one.
fn audit_key_check(config: &ServerConfig) -> Check {
    const NAME: &str = "audit-signing-key";
    if config.audit_signing_key_set() {
        return match config.audit_signing_key() {
            Ok(key) => check(
                NAME,
                Status::Ok,
                format!(
                    "{} (key id {})",
                    env::AUDIT_SIGNING_KEY,
                    wor_core::audit::key_id(&key.verifying_key())
                ),
            ),
            Err(error) => check(NAME, Status::Fail, format!("{error:#}")),
        };
    }
    match wor_secrets::AuditSigningKey::load_existing(&config.data_dir) {
        Ok(Some(key)) => check(
            NAME,
            Status::Ok,
            format!(
                "`{}` (key id {})",
                config
                    .data_dir
                    .join(wor_secrets::AUDIT_SIGNING_KEY_FILE_NAME)
                    .display(),
                wor_core::audit::key_id(&key.verifying_key())
            ),
        ),
        Ok(None) => check(
            NAME,
            Status::Ok,
            "none yet: `wor serve` makes one in the data dir on its first start",
        ),
        Err(error) => check(NAME, Status::Fail, format!("{error:#}")),
    }
}

/// The key that signs run envelopes for scaled-out workers, as `wor serve` (role `all` or
/// `api`) reads it: from the environment, else the data dir's file, which it makes when there
/// is none. Nothing is made here.
fn control_plane_key_check(config: &ServerConfig) -> Check {
    const NAME: &str = "control-plane-key";
    if let Some(text) = super::serve::control_plane_key_in_env() {
        return match wor_secrets::ControlPlaneSigningKey::from_base64(&text) {
            Ok(_) => check(NAME, Status::Ok, env::CONTROL_PLANE_SIGNING_KEY),
            Err(error) => check(
                NAME,
                Status::Fail,
                format!("{}: {error}", env::CONTROL_PLANE_SIGNING_KEY),
            ),
        };
    }
    let file = config
        .data_dir
        .join(wor_secrets::CONTROL_PLANE_SIGNING_KEY_FILE_NAME);
    match wor_secrets::ControlPlaneSigningKey::load_existing(&config.data_dir) {
        Ok(Some(_)) => check(NAME, Status::Ok, format!("`{}`", file.display())),
        Ok(None) => check(
            NAME,
            Status::Ok,
            "none yet: `wor serve` makes one in the data dir on its first start",
        ),
        Err(error) => check(NAME, Status::Fail, format!("`{}`: {error}", file.display())),
    }
}

/// The keys against the database, as `wor serve` checks them before it starts: the key ring
/// holds every key a secret is sealed under, and the audit signing key is the one that signed
/// the newest checkpoint. Neither key is made here.
fn keys_in_use_check(config: &ServerConfig, keys: &wor_store::KeysInUse) -> Check {
    const NAME: &str = "keys-in-use";
    let sealed: i64 = keys.sealed.iter().map(|(_, count)| count).sum();
    let ring = match config.encryption_key_configured() {
        Ok(true) => match config.key_ring() {
            Ok(ring) => Some(ring),
            Err(error) => return check(NAME, Status::Fail, format!("{error:#}")),
        },
        Ok(false) => None,
        Err(error) => return check(NAME, Status::Fail, format!("{error:#}")),
    };
    match &ring {
        Some((ring, source)) => {
            if let Some(refusal) = super::serve::ring_refusal(ring, *source, config, &keys.sealed) {
                return check(NAME, Status::Fail, refusal);
            }
        }
        None if sealed > 0 => {
            return check(
                NAME,
                Status::Fail,
                format!(
                    "this database holds {sealed} sealed secret(s), and no encryption key is set \
                     ({}) or in the data dir: `wor serve` would refuse to start",
                    env::ENCRYPTION_KEY
                ),
            );
        }
        None => {}
    }
    let signer = if config.audit_signing_key_configured() {
        match config.audit_signing_key() {
            Ok(key) => {
                let ours = wor_core::audit::key_id(&key.verifying_key());
                if let Some(refusal) =
                    super::serve::signer_refusal(&ours, keys.checkpoint_signer.as_deref())
                {
                    return check(NAME, Status::Fail, refusal);
                }
                Some(ours)
            }
            Err(error) => return check(NAME, Status::Fail, format!("{error:#}")),
        }
    } else {
        if let Some(refusal) = super::serve::unsigned_refusal(config, keys.checkpoints) {
            return check(NAME, Status::Fail, refusal);
        }
        None
    };
    let secrets = match sealed {
        0 => "no secret is sealed yet".to_owned(),
        n => format!("the key ring opens all {n} sealed secret(s)"),
    };
    let checkpoints = match (keys.checkpoints, signer) {
        (0, _) => "no audit checkpoint is signed yet".to_owned(),
        (n, Some(ours)) => {
            format!("the audit signing key ({ours}) signed the newest of {n} checkpoint(s)")
        }
        (n, None) => format!("{n} audit checkpoint(s) signed"),
    };
    check(NAME, Status::Ok, format!("{secrets}; {checkpoints}"))
}

fn disk_check(config: &ServerConfig) -> Check {
    // The data dir, or the nearest directory above it that exists yet.
    let mut dir = config.data_dir.as_path();
    while !dir.exists() {
        match dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => dir = parent,
            _ => {
                dir = std::path::Path::new(".");
                break;
            }
        }
    }
    match rustix::fs::statvfs(dir) {
        Ok(stats) => {
            let free = stats.f_bavail.saturating_mul(stats.f_frsize);
            let status = if free < DISK_FAIL_BYTES {
                Status::Fail
            } else if free < DISK_WARN_BYTES {
                Status::Warn
            } else {
                Status::Ok
            };
            check(
                "disk",
                status,
                format!(
                    "{} MiB free in `{}` (fails under {} MiB)",
                    free / (1024 * 1024),
                    dir.display(),
                    DISK_FAIL_BYTES / (1024 * 1024)
                ),
            )
        }
        Err(error) => check(
            "disk",
            Status::Fail,
            format!("cannot read free space in `{}`: {error}", dir.display()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_clash_only_where_serve_could_not_bind_both() {
        let clash = |a: &str, b: &str| listeners_clash(a.parse().unwrap(), b.parse().unwrap());
        for (a, b) in [
            ("127.0.0.1:9000", "127.0.0.1:9000"),
            ("0.0.0.0:9000", "127.0.0.1:9000"),
            ("[::]:9000", "127.0.0.1:9000"),
            ("[::]:9000", "[::1]:9000"),
            ("[::ffff:127.0.0.1]:9000", "127.0.0.1:9000"),
            ("0.0.0.0:9000", "[::ffff:10.0.0.1]:9000"),
        ] {
            assert!(clash(a, b) && clash(b, a), "{a} {b}");
        }
        for (a, b) in [
            ("127.0.0.1:0", "127.0.0.1:0"),
            ("0.0.0.0:9000", "[::1]:9000"),
            ("127.0.0.1:9000", "127.0.0.2:9000"),
            ("127.0.0.1:9000", "127.0.0.1:9001"),
        ] {
            assert!(!clash(a, b) && !clash(b, a), "{a} {b}");
        }
    }
}
