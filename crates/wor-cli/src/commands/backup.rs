//! `wor backup` and `wor restore` (operator: work on the database directly).
//!
//! A backup is the embedded SQLite database copied while the server runs; it holds sealed
//! secrets as ciphertexts and never a key. A restore puts it into a fresh data directory and
//! accepts it only after every project's audit chain verifies and every sealed secret opens
//! under the key ring given now — a wrong key is refused before anything runs on the copy.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use wor_core::audit::Verification;
use wor_store::{BackupError, Store, Vault};

use crate::config::{ServerConfig, ServerFlags};
use crate::env;

#[derive(Debug, clap::Args)]
pub struct BackupArgs {
    /// The file to write: a consistent SQLite copy of the database, mode 0600. It must not
    /// exist. The encryption key and the audit signing key are never in it.
    #[arg(long, value_name = "FILE")]
    to: PathBuf,
    #[command(flatten)]
    flags: ServerFlags,
}

#[derive(Debug, clap::Args)]
pub struct RestoreArgs {
    /// A file written by `wor backup`.
    #[arg(long, value_name = "FILE")]
    from: PathBuf,
    /// The checkpoint key (base64, from `wor audit public-key`) to verify the audit chains
    /// with; default: WOR_AUDIT_SIGNING_KEY or `audit-signing.key` in the data dir.
    #[arg(long, value_name = "KEY", value_parser = super::public_key_argument)]
    public_key: Option<wor_core::audit::VerifyingKey>,
    /// Print `{projects, audit_entries, sealed_secrets}` of the accepted restore as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    flags: ServerFlags,
}

pub async fn backup(args: BackupArgs) -> anyhow::Result<ExitCode> {
    let config = ServerConfig::resolve(&args.flags, None, false)?;
    if config.database.as_deref().is_some_and(is_postgres) {
        eprintln!("error: {}", BackupError::Postgres);
        return Ok(ExitCode::from(2));
    }
    let store = Store::open_existing(config.database.as_deref(), &config.data_dir)
        .await
        .context("cannot open the database")?;
    let made = store.backup_into(&args.to).await;
    store.close().await;
    made?;
    let size = std::fs::metadata(&args.to).map(|m| m.len()).unwrap_or(0);
    tracing::info!(category = "backup", bytes = size, "backup written");
    eprintln!(
        "wrote {} ({size} bytes); keep {} and the audit signing key apart from it: a restore needs them",
        args.to.display(),
        env::ENCRYPTION_KEY
    );
    Ok(ExitCode::SUCCESS)
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

pub async fn restore(args: RestoreArgs) -> anyhow::Result<ExitCode> {
    let config = ServerConfig::resolve(&args.flags, None, false)?;
    if let Some(url) = config.database.as_deref() {
        if is_postgres(url) {
            return Err(crate::usage(
                "the database is PostgreSQL: restore a `pg_dump` with `pg_restore`, then check it \
                 with `wor audit verify` and `wor secrets verify` (see docs/operations.md)",
            ));
        }
        return Err(crate::usage(
            "`wor restore` writes the embedded database of --data-dir; give no --database",
        ));
    }
    // What to restore is looked for first: a backup that is not there is the mistake to name.
    if !args.from.exists() {
        return Err(crate::usage(format!(
            "no backup file at `{}`",
            args.from.display()
        )));
    }
    // A restore never makes a key: a fresh one would open none of the backup's secrets.
    if !config.encryption_key_configured()? {
        bail!(
            "no encryption key: set {} to the key of the server the backup came from (or put \
             its `{}` in `{}`)",
            env::ENCRYPTION_KEY,
            wor_secrets::DEV_KEY_FILE_NAME,
            config.data_dir.display()
        );
    }
    let audit_key = match &args.public_key {
        Some(key) => *key,
        None => config.audit_verifying_key()?,
    };
    let (keys, _) = config
        .key_ring()
        .context("cannot load the encryption key")?;
    let restored = wor_store::restore_sqlite(&args.from, &config.data_dir).await?;
    match check_restored(&restored.store, keys, &audit_key).await {
        Ok(summary) => {
            restored.store.close().await;
            tracing::info!(category = "backup", "backup restored");
            if args.json {
                super::print_json(&serde_json::json!({
                    "projects": summary.projects,
                    "audit_entries": summary.entries,
                    "sealed_secrets": summary.secrets,
                }))?;
            } else {
                println!("{}", summary.text());
            }
            eprintln!(
                "restored into {}: start it with `wor serve --data-dir {}`, with {} and {} (or \
                 its `{}` in the data dir) as the backed-up server had them",
                config.data_dir.display(),
                config.data_dir.display(),
                crate::env::ENCRYPTION_KEY,
                crate::env::AUDIT_SIGNING_KEY,
                wor_secrets::AUDIT_SIGNING_KEY_FILE_NAME,
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(problem) => {
            restored.discard().await;
            eprintln!("error: {}", super::for_terminal(&format!("{problem:#}")));
            eprintln!(
                "error: the restore is refused; what it wrote is removed, and the data dir too \
                 if it made it"
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

/// What a restore accepted.
struct RestoreSummary {
    projects: usize,
    entries: i64,
    secrets: u64,
}

impl RestoreSummary {
    fn text(&self) -> String {
        let key_note = if self.secrets == 0 {
            "no sealed secrets, so the key was not checked"
        } else {
            "every one opens"
        };
        format!(
            "restored: {} project(s), audit intact ({} entries), {} sealed secret(s): {key_note}",
            self.projects, self.entries, self.secrets
        )
    }
}

/// Opens every sealed secret and verifies every project's audit chain on the restored copy.
async fn check_restored(
    store: &Store,
    keys: wor_secrets::KeyRing,
    audit_key: &wor_core::audit::VerifyingKey,
) -> anyhow::Result<RestoreSummary> {
    let vault = Vault::new(store.clone(), Arc::new(keys));
    let (total, failed) = vault.verify_all().await?;
    if let Some(first) = failed.first() {
        bail!(
            "wrong encryption key: {} of {total} sealed secret(s) in the backup do not open under \
             {} (first: {first})",
            failed.len(),
            env::ENCRYPTION_KEY
        );
    }
    let projects = store.list_projects().await?;
    let mut entries = 0i64;
    for project in &projects {
        match store
            .verify_audit_chain(project.id, audit_key, &[])
            .await
            .with_context(|| format!("cannot read the audit log of `{}`", project.id))?
        {
            Verification::Intact(summary) => entries += summary.entries,
            // A checkpoint signed by another key is the operator's key, not a tampered chain.
            Verification::Broken(found) => match &found.reason {
                wor_core::audit::BreakReason::UnknownKey { key_id } => bail!(
                    "the audit checkpoints of `{}` are signed by key `{key_id}`, not by the audit \
                     key given here (key {}): give {} of the server the backup came from, or its \
                     public key with --public-key",
                    project.id,
                    wor_core::audit::key_id(audit_key),
                    env::AUDIT_SIGNING_KEY
                ),
                _ => bail!(
                    "the audit chain of `{}` is broken at entry {}: {}",
                    project.id,
                    found.seq,
                    found.reason
                ),
            },
        }
    }
    Ok(RestoreSummary {
        projects: projects.len(),
        entries,
        secrets: total,
    })
}
