//! Operator commands that work on the database directly, whether the server runs or not.

use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_store::{AuditConfig, AuditLog, CreatedProject, Store};

use crate::config::{ServerConfig, ServerFlags};

#[derive(Debug, clap::Args)]
pub struct InitArgs {
    #[command(flatten)]
    flags: ServerFlags,
    /// Name of the first project.
    #[arg(long, default_value = "default")]
    project: String,
    /// Name of the project's owner.
    #[arg(long, default_value = "owner")]
    owner: String,
}

#[derive(Debug, clap::Subcommand)]
pub enum ProjectCommand {
    /// Create a project and its owner; print the owner's API key once.
    Create {
        /// The project's name (unique).
        name: String,
        /// Name of the project's owner.
        #[arg(long, default_value = "owner")]
        owner: String,
        #[command(flatten)]
        flags: ServerFlags,
    },
    /// List every project.
    List {
        /// Print the projects as a JSON array of `{id, name}`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        flags: ServerFlags,
    },
}

async fn open(flags: &ServerFlags) -> anyhow::Result<Store> {
    let config = ServerConfig::resolve(flags, None, false)?;
    Store::open(config.database.as_deref(), &config.data_dir)
        .await
        .context("cannot open the database")
}

/// Creates a project and records it, its owner and the owner's key in its audit log, with
/// the operator as actor, then signs the new chain's head.
async fn create_audited(
    flags: &ServerFlags,
    store: &Store,
    name: &str,
    owner: &str,
) -> anyhow::Result<CreatedProject> {
    let config = ServerConfig::resolve(flags, None, false)?;
    let audit = AuditLog::start(
        store.clone(),
        config.audit_signing_key()?,
        AuditConfig::default(),
    );
    let created = store.create_project(name, owner).await?;
    let project = created.project.id;
    let key_id = store
        .list_api_keys(project)
        .await?
        .first()
        .map(|k| k.id)
        .context("the new project has no owner key")?;
    let events = [
        AuditEvent::new(project, AuditCategory::ProjectCreate, Actor::Operator)
            .subject("project_id", project)
            .payload(json!({ "name": name })),
        AuditEvent::new(project, AuditCategory::MemberCreate, Actor::Operator)
            .subject("member_id", created.owner.id)
            .payload(json!({ "name": owner, "role": created.owner.role })),
        AuditEvent::new(project, AuditCategory::KeyCreate, Actor::Operator)
            .subject("key_id", key_id)
            .subject("member_id", created.owner.id)
            .payload(json!({ "role": created.owner.role, "service": false })),
    ];
    for event in events {
        audit
            .append(event)
            .await
            .context("cannot write the audit log")?;
    }
    audit
        .checkpoint()
        .await
        .context("cannot sign the audit log")?;
    Ok(created)
}

fn check_name(name: &str, what: &str) -> anyhow::Result<()> {
    if name.trim().is_empty() || name.trim() != name || name.len() > 100 {
        bail!("{what} name must be 1 to 100 characters with no leading or trailing space");
    }
    Ok(())
}

/// The key alone on stdout, so `KEY=$(wor init)` captures exactly it.
fn report(created: &CreatedProject) {
    eprintln!(
        "created project `{}` ({}) with owner `{}` ({})",
        created.project.name, created.project.id, created.owner.name, created.owner.id
    );
    eprintln!("the owner's API key follows on stdout; it is shown only this once:");
    println!("{}", created.owner_key.expose());
}

pub async fn init(args: InitArgs) -> anyhow::Result<ExitCode> {
    check_name(&args.project, "project")?;
    check_name(&args.owner, "owner")?;
    let store = open(&args.flags).await?;
    if store.count_projects().await? > 0 {
        bail!(
            "already initialised: this database has projects; add another with `wor project create NAME`"
        );
    }
    let created = create_audited(&args.flags, &store, &args.project, &args.owner).await?;
    report(&created);
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

pub async fn project(cmd: ProjectCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ProjectCommand::Create { name, owner, flags } => {
            check_name(&name, "project")?;
            check_name(&owner, "owner")?;
            let store = open(&flags).await?;
            let created = create_audited(&flags, &store, &name, &owner).await?;
            report(&created);
            store.close().await;
        }
        ProjectCommand::List { json, flags } => {
            let store = open(&flags).await?;
            let projects = store.list_projects().await?;
            store.close().await;
            if json {
                super::print_json(&serde_json::Value::Array(
                    projects
                        .iter()
                        .map(|p| json!({ "id": p.id.to_string(), "name": p.name }))
                        .collect(),
                ))?;
            } else {
                for project in projects {
                    println!("{}  {}", project.id, project.name);
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
