//! `wor whoami` and `wor member …`: clients of the API.

use std::process::ExitCode;

use serde_json::json;

use super::{field, for_terminal, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
pub enum MemberCommand {
    /// List the project's members.
    List(ClientArgs),
    /// Add a member; print their first API key once on stdout.
    Create {
        /// The member's name (unique in the project).
        name: String,
        /// owner, admin, approver or viewer.
        #[arg(long)]
        role: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Invite a member to the web console: print a single-use link where they set their
    /// password. A new name adds the member with `--role`.
    Invite(super::member_invite::InviteArgs),
    /// Change a member's role. Nobody grants a role above their own or changes a member who
    /// outranks them, and the project's last owner cannot be demoted. The new role holds from
    /// the member's next request, in their console sessions and as the most any of their keys
    /// may do: a key acts with the lower of its own role and its member's, so a demotion
    /// reaches every key at once, and a promotion reaches none made for the lower role (make
    /// the member a new key for it).
    Role {
        /// A `mem_…` id, or the member's name.
        member: String,
        /// owner, admin, approver or viewer.
        role: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show one member (`--json`: as the API shows them).
    Show {
        /// A `mem_…` id, or the member's name.
        member: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// The id of `member`: a `mem_…` id (a malformed one is a usage error), or the id of the
/// member of that name.
async fn member_id(api: &ApiClient, member: &str) -> anyhow::Result<wor_core::MemberId> {
    super::id_or_name(
        api,
        member,
        wor_core::MemberId::PREFIX,
        "member",
        "/v1/members",
    )
    .await
}

pub async fn whoami(args: ClientArgs) -> anyhow::Result<ExitCode> {
    let me = ApiClient::new(&args)?.get("/v1/whoami").await?;
    if args.json {
        print_json(&me)?;
    } else {
        println!(
            "project  {} ({})",
            field(&me, "/project/name"),
            field(&me, "/project/id")
        );
        println!("key      {}", field(&me, "/key_id"));
        println!("member   {}", field(&me, "/member_id"));
        println!("role     {}", field(&me, "/role"));
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn run(cmd: MemberCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        MemberCommand::List(args) => {
            let members = ApiClient::new(&args)?.get("/v1/members").await?;
            if args.json {
                print_json(&members)?;
            } else {
                for m in members.as_array().into_iter().flatten() {
                    println!(
                        "{}  {:<8}  {}",
                        field(m, "/id"),
                        field(m, "/role"),
                        field(m, "/name")
                    );
                }
            }
        }
        MemberCommand::Create { name, role, client } => {
            let created = ApiClient::new(&client)?
                .post("/v1/members", &json!({ "name": name, "role": role }))
                .await?;
            if client.json {
                print_json(&created)?;
            } else {
                eprintln!(
                    "created member `{}` ({}) with role {}; their API key follows, shown only once:",
                    field(&created, "/member/name"),
                    field(&created, "/member/id"),
                    field(&created, "/member/role"),
                );
                println!("{}", field(&created, "/key/api_key"));
            }
        }
        MemberCommand::Invite(args) => return super::member_invite::run(args).await,
        MemberCommand::Role {
            member,
            role,
            client,
        } => {
            let api = ApiClient::new(&client)?;
            let id = member_id(&api, &member).await?;
            let before = api.get(&format!("/v1/members/{id}")).await?;
            let after = api
                .patch(&format!("/v1/members/{id}"), &json!({ "role": role }))
                .await?;
            if client.json {
                print_json(&after)?;
            } else if field(&before, "/role") == field(&after, "/role") {
                println!(
                    "member `{}` ({}) already has role {}; nothing changed",
                    field(&after, "/name"),
                    field(&after, "/id"),
                    field(&after, "/role"),
                );
            } else {
                println!(
                    "member `{}` ({}) is now {} (was {})",
                    field(&after, "/name"),
                    field(&after, "/id"),
                    field(&after, "/role"),
                    field(&before, "/role"),
                );
            }
        }
        MemberCommand::Show { member, client } => {
            let api = ApiClient::new(&client)?;
            let id = member_id(&api, &member).await?;
            let member = api.get(&format!("/v1/members/{id}")).await?;
            if client.json {
                print_json(&member)?;
            } else {
                println!(
                    "member   {} ({})",
                    for_terminal(field(&member, "/name")),
                    field(&member, "/id")
                );
                println!("role     {}", field(&member, "/role"));
                println!("created  {}", field(&member, "/created_at"));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
