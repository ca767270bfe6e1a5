//! `wor member invite`: a client of `POST /v1/invitations`.

use std::process::ExitCode;

use serde_json::json;

use super::{field, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Args)]
pub struct InviteArgs {
    /// The member's name; a name not in the project adds a member.
    name: String,
    /// owner, admin, approver or viewer: needed for a new member; for an existing one it
    /// must match their role.
    #[arg(long)]
    role: Option<String>,
    #[command(flatten)]
    client: ClientArgs,
}

pub async fn run(args: InviteArgs) -> anyhow::Result<ExitCode> {
    let created = ApiClient::new(&args.client)?
        .post(
            "/v1/invitations",
            &json!({ "name": args.name, "role": args.role }),
        )
        .await?;
    if args.client.json {
        print_json(&created)?;
        return Ok(ExitCode::SUCCESS);
    }
    let server = args.client.server.trim_end_matches('/');
    eprintln!(
        "{} `{}` ({}, role {}); give them this link, which works once, until {}:",
        if created.get("new_member") == Some(&serde_json::Value::Bool(true)) {
            "added and invited member"
        } else {
            "invited member"
        },
        field(&created, "/member/name"),
        field(&created, "/member/id"),
        field(&created, "/member/role"),
        field(&created, "/expires_at"),
    );
    println!("{server}{}", field(&created, "/path"));
    Ok(ExitCode::SUCCESS)
}
