//! `wor secrets …`: operator commands for the encryption key ring, on the database directly.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use secrecy::ExposeSecret;
use wor_store::{Store, Vault};

use crate::config::{ServerConfig, ServerFlags};
use crate::env;

#[derive(Debug, clap::Subcommand)]
pub enum SecretsCommand {
    /// Print a fresh random encryption key (32 bytes, base64) for WOR_ENCRYPTION_KEY.
    GenerateKey,
    /// Re-seal every stored secret under the primary key (WOR_ENCRYPTION_KEY), opening old
    /// values with the retired keys (WOR_ENCRYPTION_KEY_RETIRED, and a development key file in
    /// the data dir). Safe to interrupt and run again; afterwards the old keys can be dropped.
    Rotate {
        /// Re-seal at most this many secrets, then stop (to spread a rotation out).
        #[arg(long)]
        limit: Option<u64>,
        #[command(flatten)]
        flags: ServerFlags,
    },
    /// Open every stored secret with the current key ring and report any that fail: run it
    /// before dropping a retired key. Exits 1 if any secret cannot be opened.
    Verify {
        /// Print `{total, opened, failed: [...]}` as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        flags: ServerFlags,
    },
}

async fn open_vault(flags: &ServerFlags) -> anyhow::Result<(Store, Vault)> {
    let config = ServerConfig::resolve(flags, None, false)?;
    let store = Store::open_existing(config.database.as_deref(), &config.data_dir)
        .await
        .context("cannot open the database")?;
    // Never a new key kept: nothing stored would open under it. With nothing stored, a
    // throwaway key serves, written nowhere.
    let keys = if config.encryption_key_configured()? {
        config
            .key_ring()
            .context("cannot load the encryption key")?
            .0
    } else if store.count_sealed_secrets().await? == 0 {
        wor_secrets::KeyRing::generate()?.0
    } else {
        bail!(
            "no encryption key: {} is not set and `{}` has no development key",
            crate::env::ENCRYPTION_KEY,
            config.data_dir.display()
        );
    };
    let vault = Vault::new(store.clone(), Arc::new(keys));
    Ok((store, vault))
}

pub async fn run(cmd: SecretsCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        SecretsCommand::GenerateKey => {
            let (_, text) = wor_secrets::KeyRing::generate()?;
            eprintln!(
                "a new key follows; set it as {} and keep it secret:",
                env::ENCRYPTION_KEY
            );
            println!("{}", text.expose_secret());
            Ok(ExitCode::SUCCESS)
        }
        SecretsCommand::Rotate { limit, flags } => {
            let (store, vault) = open_vault(&flags).await?;
            let pending = vault.count_needing_rotation().await?.max(0) as u64;
            let total = limit.map_or(pending, |l| l.min(pending));
            eprintln!(
                "{pending} secret(s) not under the primary key {}; re-sealing {total}",
                vault.key_ring().primary_key_id()
            );
            let bar = indicatif::ProgressBar::new(total).with_style(
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} secrets  {elapsed}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let report = vault
                .rotate(limit, |r| {
                    bar.set_position(r.rotated + r.failed.len() as u64)
                })
                .await?;
            bar.finish();
            let left = vault.count_needing_rotation().await?;
            store.close().await;
            eprintln!("re-sealed {}; {left} left under other keys", report.rotated);
            for failure in &report.failed {
                eprintln!("error: {failure}");
            }
            if !report.failed.is_empty() {
                eprintln!(
                    "some secrets could not be opened: keep the old keys until they are fixed"
                );
                return Ok(ExitCode::FAILURE);
            }
            if left == 0 {
                eprintln!("done: no stored secret needs the retired keys any more");
            }
            Ok(ExitCode::SUCCESS)
        }
        SecretsCommand::Verify { json, flags } => {
            let (store, vault) = open_vault(&flags).await?;
            let (total, failed) = vault.verify_all().await?;
            store.close().await;
            let opened = total - failed.len() as u64;
            if json {
                super::print_json(&serde_json::json!({
                    "total": total,
                    "opened": opened,
                    "failed": failed.iter().map(ToString::to_string).collect::<Vec<_>>(),
                }))?;
            } else {
                for failure in &failed {
                    eprintln!("error: {failure}");
                }
                println!("{opened} of {total} stored secret(s) open");
            }
            Ok(if failed.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}
