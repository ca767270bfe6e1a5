//! `wor audit …`: verify a project's chain in the database or an exported file, export it
//! through the API, and print the key that verifies checkpoints.
//!
//! `verify` exits 0 when every chain checked is intact and 1 otherwise (a broken chain, or a
//! chain that could not be read).

use std::io::{BufRead as _, BufWriter, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use wor_core::ProjectId;
use wor_core::audit::{
    Anchor, AuditCheckpoint, AuditEntry, ChainVerifier, Verification, VerifyingKey,
};
use wor_secrets::verifying_key_to_base64;
use wor_store::Store;

use crate::client::{ApiClient, ClientArgs};
use crate::config::{ServerConfig, ServerFlags};

#[derive(Debug, clap::Subcommand)]
pub enum AuditCommand {
    /// Check hash chains and checkpoint signatures; print the first bad entry and why.
    Verify(Box<VerifyArgs>),
    /// Write your project's audit log as JSON lines (client of `GET /v1/audit`).
    Export {
        /// The only format: one JSON object per line, `"type": "entry"` or `"checkpoint"`.
        #[arg(long, value_enum, default_value = "jsonl")]
        format: ExportFormat,
        /// Write here instead of stdout.
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Print the public key that verifies checkpoints (base64), from the audit signing key
    /// (`WOR_AUDIT_SIGNING_KEY`, or the data dir's key file); never makes one.
    PublicKey {
        #[command(flatten)]
        flags: ServerFlags,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExportFormat {
    Jsonl,
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Only this project (default: every project in the database).
    #[arg(long, value_name = "ID")]
    project: Option<ProjectId>,
    /// Verify an export made by `wor audit export` instead of the database.
    #[arg(long, value_name = "FILE", requires = "public_key")]
    file: Option<PathBuf>,
    /// The checkpoint key (base64, from `wor audit public-key`); default: this installation's.
    #[arg(long, value_name = "KEY", value_parser = super::public_key_argument)]
    public_key: Option<wor_core::audit::VerifyingKey>,
    /// `SEQ:HASH` of an entry recorded earlier outside the database (a previous verify's
    /// head); catches a chain cut back behind it. Repeatable.
    #[arg(long, value_name = "SEQ:HASH")]
    anchor: Vec<Anchor>,
    /// Print a JSON array with one object per project checked: `project`, `intact`, and the
    /// chain's summary or where it breaks.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    flags: ServerFlags,
}

pub async fn run(cmd: AuditCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        AuditCommand::Verify(args) => verify(*args).await,
        AuditCommand::Export {
            format: ExportFormat::Jsonl,
            output,
            client,
        } => export(&client, output).await,
        AuditCommand::PublicKey { flags } => {
            let config = ServerConfig::resolve(&flags, None, false)?;
            // Never a new signing key: its public half would verify nothing stored.
            let key = config.audit_verifying_key()?;
            println!("{}", verifying_key_to_base64(&key));
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn verify(args: VerifyArgs) -> anyhow::Result<ExitCode> {
    let config = ServerConfig::resolve(&args.flags, None, false)?;
    let key = || -> anyhow::Result<_> {
        Ok(match &args.public_key {
            Some(key) => *key,
            None => config.audit_verifying_key()?,
        })
    };
    if let Some(file) = &args.file {
        let (project, verification) = verify_file(file, &key()?, &args.anchor, args.project)?;
        return report_all(&[(project, verification)], args.json);
    }
    // The database is looked for before the key, so a data dir without one says so.
    let store = Store::open_existing(config.database.as_deref(), &config.data_dir)
        .await
        .context("cannot open the database")?;
    let key = key()?;
    let projects = match args.project {
        Some(project) => vec![
            store
                .get_project(project)
                .await
                .with_context(|| format!("project `{project}` does not exist in this database"))?
                .id,
        ],
        None => store
            .list_projects()
            .await?
            .into_iter()
            .map(|p| p.id)
            .collect(),
    };
    if projects.len() > 1 && !args.anchor.is_empty() {
        bail!("--anchor needs --project: an anchor belongs to one project's chain");
    }
    let mut verified = Vec::with_capacity(projects.len());
    for project in projects {
        let verification = store
            .verify_audit_chain(project, &key, &args.anchor)
            .await
            .with_context(|| format!("cannot read the audit log of `{project}`"))?;
        verified.push((project, verification));
    }
    store.close().await;
    report_all(&verified, args.json)
}

/// Prints every project's outcome, as text or JSON; `FAILURE` when any chain is broken.
fn report_all(verified: &[(ProjectId, Verification)], json: bool) -> anyhow::Result<ExitCode> {
    let intact = verified
        .iter()
        .all(|(_, v)| matches!(v, Verification::Intact(_)));
    if json {
        super::print_json(&Value::Array(
            verified
                .iter()
                .map(|(project, verification)| verification_json(*project, verification))
                .collect(),
        ))?;
    } else {
        for (project, verification) in verified {
            report(*project, verification);
        }
    }
    Ok(if intact {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn verification_json(project: ProjectId, verification: &Verification) -> Value {
    match verification {
        Verification::Intact(summary) => json!({
            "project": project.to_string(),
            "intact": true,
            "entries": summary.entries,
            "head_hash": summary.head_hash,
            "checkpoints": summary.checkpoints,
            "last_checkpoint_seq": summary.last_checkpoint_seq,
            "unsigned_tail": summary.unsigned_tail,
        }),
        Verification::Broken(found) => json!({
            "project": project.to_string(),
            "intact": false,
            "broken_at": found.seq,
            "reason": found.reason.to_string(),
        }),
    }
}

/// Prints one project's outcome.
fn report(project: ProjectId, verification: &Verification) {
    match verification {
        Verification::Intact(summary) => {
            let signed = match summary.last_checkpoint_seq {
                Some(seq) => format!("last checkpoint at entry {seq}"),
                None => "no checkpoint".to_owned(),
            };
            println!(
                "{project}: intact: {} entries, {} checkpoints, {signed}, {} unsigned after it; head {}:{}",
                summary.entries,
                summary.checkpoints,
                summary.unsigned_tail,
                summary.entries,
                summary.head_hash
            );
        }
        Verification::Broken(found) => {
            println!("{project}: BROKEN at entry {}: {}", found.seq, found.reason);
        }
    }
}

/// Verifies an export. Entries must come in chain order, as `wor audit export` writes them.
fn verify_file(
    path: &PathBuf,
    key: &VerifyingKey,
    anchors: &[Anchor],
    expected: Option<ProjectId>,
) -> anyhow::Result<(ProjectId, Verification)> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open `{}`", path.display()))?;
    let mut entries = Vec::new();
    let mut checkpoints = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read `{}`", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("`{}` line {}", path.display(), number + 1);
        let value: Value =
            serde_json::from_str(&line).with_context(|| format!("{} is not JSON", at()))?;
        match value.get("type").and_then(Value::as_str) {
            Some("entry") => entries.push(
                serde_json::from_value::<AuditEntry>(value)
                    .with_context(|| format!("{} is not an audit entry", at()))?,
            ),
            Some("checkpoint") => checkpoints.push(
                serde_json::from_value::<AuditCheckpoint>(value)
                    .with_context(|| format!("{} is not a checkpoint", at()))?,
            ),
            _ => bail!("{} has no `type` of `entry` or `checkpoint`", at()),
        }
    }
    let project = expected
        .or_else(|| entries.first().map(|e| e.project_id))
        .or_else(|| checkpoints.first().map(|c| c.project_id))
        .context("the file holds no entries")?;
    let mut verifier = ChainVerifier::new(project, key, checkpoints, anchors);
    for entry in &entries {
        verifier.push(entry);
    }
    Ok((project, verifier.finish()))
}

async fn export(client: &ClientArgs, output: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let api = ApiClient::new(client)?;
    let sink: Box<dyn std::io::Write> = match &output {
        // The project's record of who did what: readable by its owner alone, as a backup is.
        Some(path) => Box::new({
            use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("cannot create `{}`", path.display()))?;
            // A file that was there keeps its mode on opening: it is made the owner's alone.
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .with_context(|| format!("cannot make `{}` private", path.display()))?;
            file
        }),
        None => Box::new(crate::Stdout(std::io::stdout().lock())),
    };
    let mut out = BufWriter::new(sink);
    let mut after = 0;
    let mut count = 0usize;
    loop {
        let page = api
            .get(&format!("/v1/audit?after={after}&limit=1000"))
            .await?;
        for (kind, field) in [("entry", "entries"), ("checkpoint", "checkpoints")] {
            for item in page
                .get(field)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let mut line = item.clone();
                if let Some(object) = line.as_object_mut() {
                    object.insert("type".to_owned(), json!(kind));
                }
                serde_json::to_writer(&mut out, &line)?;
                out.write_all(b"\n")?;
                count += usize::from(kind == "entry");
            }
        }
        match page.get("next_after").and_then(Value::as_i64) {
            Some(next) if next > after => after = next,
            _ => break,
        }
    }
    out.flush()?;
    eprintln!("exported {count} audit entries");
    Ok(ExitCode::SUCCESS)
}
