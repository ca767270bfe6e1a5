//! Operator commands that work on the database directly, whether the server runs or not.

use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::json;
use wor_core::ProjectId;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_store::{
    AuditConfig, AuditLog, CreatedProject, ProjectRecord, StagedEvent, Store, StoreError,
};

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
    /// Let someone manage a project again when no owner key is left: make a new owner key for
    /// the owner named by --owner (a new owner member when the project has none of that name);
    /// print it once. Recorded in the project's audit log with the operator as actor.
    RecoverOwner {
        /// The project's name or `prj_…` id.
        project: String,
        /// The owner to give the key to; a new owner member when no member has this name.
        #[arg(long, default_value = "owner")]
        owner: String,
        #[command(flatten)]
        flags: ServerFlags,
    },
}

/// The database of `flags`, made when missing only for a command that makes a project.
async fn open(flags: &ServerFlags, create: bool) -> anyhow::Result<Store> {
    let config = ServerConfig::resolve(flags, None, false)?;
    let opened = if create {
        Store::open(config.database.as_deref(), &config.data_dir).await
    } else {
        Store::open_existing(config.database.as_deref(), &config.data_dir).await
    };
    opened.context("cannot open the database")
}

/// The audit log's one writer, for an operator command: signing with the key the database's
/// checkpoints were signed with, as `wor serve` does (never a key made anew beside them).
async fn start_audit(flags: &ServerFlags, store: &Store) -> anyhow::Result<AuditLog> {
    let config = ServerConfig::resolve(flags, None, false)?;
    let key = super::serve::kept_audit_key(&config, store).await?;
    Ok(AuditLog::start(store.clone(), key, AuditConfig::default()))
}

/// The audit entries of project `name` made with owner `owner` by the operator: the project,
/// its owner and the owner's key.
pub(crate) fn project_entries<'a>(
    name: &'a str,
    owner: &'a str,
) -> impl Fn(&ProjectRecord, &wor_store::MemberRecord, &wor_store::ApiKeyRecord) -> Vec<AuditEvent>
+ Sync
+ 'a {
    move |project, member, key| {
        vec![
            AuditEvent::new(project.id, AuditCategory::ProjectCreate, Actor::Operator)
                .subject("project_id", project.id)
                .payload(json!({ "name": name })),
            AuditEvent::new(project.id, AuditCategory::MemberCreate, Actor::Operator)
                .subject("member_id", member.id)
                .payload(json!({ "name": owner, "role": member.role })),
            AuditEvent::new(project.id, AuditCategory::KeyCreate, Actor::Operator)
                .subject("key_id", key.id)
                .subject("member_id", member.id)
                .payload(json!({ "role": member.role, "service": false })),
        ]
    }
}

/// Creates a project and records it, its owner and the owner's key in its audit log, with
/// the operator as actor, then signs the new chain's head.
async fn create_audited(
    flags: &ServerFlags,
    store: &Store,
    name: &str,
    owner: &str,
) -> anyhow::Result<CreatedProject> {
    let audit = start_audit(flags, store).await?;
    // The entries are staged with the project: a command stopped before they are appended
    // leaves them for the audit writer's next sweep, never a project without its entries.
    let (created, staged) = store
        .create_project_staged(name, owner, Some(&project_entries(name, owner)))
        .await?;
    record_and_sign(&audit, staged).await?;
    Ok(created)
}

fn check_name(name: &str, what: &str) -> anyhow::Result<()> {
    wor_core::name::check_name(name).map_err(|err| anyhow::anyhow!("{what} name {err}"))
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
    let store = open(&args.flags, true).await?;
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
            let store = open(&flags, true).await?;
            let created = create_audited(&flags, &store, &name, &owner).await?;
            report(&created);
            store.close().await;
        }
        ProjectCommand::RecoverOwner {
            project,
            owner,
            flags,
        } => {
            check_name(&owner, "owner")?;
            let store = open(&flags, false).await?;
            recover_owner(&flags, &store, &project, &owner).await?;
            store.close().await;
        }
        ProjectCommand::List { json, flags } => {
            let store = open(&flags, false).await?;
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

/// The project a command names, by `prj_…` id or by name.
async fn find_project(store: &Store, project: &str) -> anyhow::Result<ProjectRecord> {
    let found = match project.parse::<ProjectId>() {
        Ok(id) => store.get_project(id).await,
        Err(_) => store.find_project(project).await,
    };
    match found {
        Err(StoreError::NotFound) => bail!("no project named `{project}`"),
        other => Ok(other?),
    }
}

/// Makes a new owner key (and owner, if needed), records it in the project's audit log with
/// the operator as actor, signs the chain's head and prints the key once on stdout.
async fn recover_owner(
    flags: &ServerFlags,
    store: &Store,
    project: &str,
    owner: &str,
) -> anyhow::Result<()> {
    let project = find_project(store, project).await?;
    let audit = start_audit(flags, store).await?;
    // The entries are staged with the new key: a command stopped before they are appended
    // leaves them for the audit writer's next sweep, never an owner key without its entry.
    let entries = |recovered: &wor_store::RecoveredOwner| {
        let mut events = Vec::new();
        if recovered.owner_created {
            events.push(
                AuditEvent::new(project.id, AuditCategory::MemberCreate, Actor::Operator)
                    .subject("member_id", recovered.owner.id)
                    .payload(
                        json!({ "name": owner, "role": recovered.owner.role, "recovery": true }),
                    ),
            );
        }
        events.push(
            AuditEvent::new(project.id, AuditCategory::KeyCreate, Actor::Operator)
                .subject("key_id", recovered.key.id)
                .subject("member_id", recovered.owner.id)
                .payload(json!({
                    "name": recovered.key.name,
                    "role": recovered.key.role,
                    "service": false,
                    "recovery": true,
                })),
        );
        events
    };
    let (recovered, staged) = store.recover_owner(project.id, owner, &entries).await?;
    record_and_sign(&audit, staged).await?;
    let who = if recovered.owner_created {
        "new owner"
    } else {
        "owner"
    };
    eprintln!(
        "created owner key {} for {who} `{}` ({}) of project `{}` ({})",
        recovered.key.id, recovered.owner.name, recovered.owner.id, project.name, project.id
    );
    eprintln!("the API key follows on stdout; it is shown only this once:");
    println!("{}", recovered.plaintext.expose());
    Ok(())
}

/// Appends the entries `staged` with an operator's change to the audit log, then signs the
/// chain's new head: what an operator did is recorded and checkpointed before the command
/// reports it.
async fn record_and_sign(audit: &AuditLog, staged: Vec<StagedEvent>) -> anyhow::Result<()> {
    audit
        .append_staged(staged)
        .await
        .context("cannot write the audit log")?;
    audit
        .checkpoint()
        .await
        .context("cannot sign the audit log")?;
    Ok(())
}
