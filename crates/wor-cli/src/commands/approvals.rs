//! `wor approvals …`: list, show and decide the tool calls waiting for a person (clients of
//! the API).

use std::process::ExitCode;

use serde_json::{Value, json};

use super::{field, one_line, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
pub enum ApprovalsCommand {
    /// List approvals, newest first (pending ones by default).
    List {
        /// Only approvals with this status.
        #[arg(long, default_value = "pending",
            value_parser = ["pending", "approved", "denied", "expired", "cancelled", "all"])]
        status: String,
        /// Only approvals of this run (`run_…`).
        #[arg(long)]
        run: Option<wor_core::RunId>,
        /// At most this many (1 to 200).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=200))]
        limit: u32,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show one approval: the exact call, why it needs a decision, and its run.
    Show {
        /// An `apr_…` id.
        id: wor_core::ApprovalId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Approve exactly this call; its run goes on and runs it once. With `--edit`, approve it
    /// with some arguments corrected: the edited call runs instead, if policy allows it.
    Approve {
        /// An `apr_…` id.
        id: wor_core::ApprovalId,
        /// Why (recorded with the decision and in the audit log).
        #[arg(long)]
        reason: String,
        /// Correct an argument before approving: `NAME=JSON` (`text='"hello"'`), repeatable;
        /// pinned arguments cannot be edited.
        #[arg(long = "edit", value_name = "NAME=JSON")]
        edits: Vec<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Deny this call; its run goes on without it, or fails, as its routine says.
    Deny {
        /// An `apr_…` id.
        id: wor_core::ApprovalId,
        /// Why (recorded with the decision and in the audit log).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

fn summary(approval: &Value) -> String {
    format!(
        "{}  {:<9}  {}  run {}  expires {}",
        field(approval, "/id"),
        field(approval, "/status"),
        field(approval, "/tool"),
        field(approval, "/run_id"),
        field(approval, "/expires_at"),
    )
}

/// Prints approval `approval` (the API's view) for a person deciding it.
pub(crate) fn show(approval: &Value) {
    print!("{}", super::for_terminal(&shown(approval)));
}

/// Approval `approval` as [`show`] prints it, one line each.
fn shown(approval: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "approval   {}", field(approval, "/id"));
    let _ = writeln!(out, "status     {}", field(approval, "/status"));
    let _ = writeln!(
        out,
        "routine    {}  run {} ({}, trigger {})",
        field(approval, "/routine"),
        field(approval, "/run_id"),
        field(approval, "/run/status"),
        field(approval, "/run/trigger"),
    );
    if let Some(input) = approval.get("run_input") {
        let _ = writeln!(out, "run input  {input}");
    }
    let _ = writeln!(out, "tool       {}", one_line(field(approval, "/tool")));
    let _ = writeln!(out, "definition {}", field(approval, "/pin_hash"));
    let pinned: Vec<&str> = approval
        .get("pinned_keys")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let print_arguments = |out: &mut String, arguments: Option<&Value>| {
        if let Some(Value::Object(arguments)) = arguments {
            for (key, value) in arguments {
                let mark = if pinned.contains(&key.as_str()) {
                    "  (pinned by the routine)"
                } else {
                    ""
                };
                // A key that is not a plain name is shown quoted: an argument's name is the
                // model's to choose, and may hold anything.
                let plain = !key.is_empty()
                    && key
                        .chars()
                        .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'));
                let key = if plain {
                    key.clone()
                } else {
                    Value::String(key.clone()).to_string()
                };
                let _ = writeln!(out, "  {key} = {value}{mark}");
            }
        }
    };
    // An approval given with an edit binds the edited call: that is what runs.
    match approval.get("edited_arguments").filter(|v| v.is_object()) {
        Some(edited) => {
            let _ = writeln!(
                out,
                "arguments as edited by the approver (exactly what will be sent):"
            );
            print_arguments(&mut out, Some(edited));
            let _ = writeln!(out, "arguments the model asked for (not sent):");
            print_arguments(&mut out, approval.get("arguments"));
        }
        None => {
            let _ = writeln!(out, "arguments (exactly what will be sent):");
            print_arguments(&mut out, approval.get("arguments"));
        }
    }
    // Labels recorded since arguments were labelled; older approvals have none.
    if let Some(labels) = approval
        .pointer("/why/argument_sources")
        .filter(|v| !v.is_null())
        .and_then(|v| {
            serde_json::from_value::<wor_core::provenance::ArgumentLabels>(v.clone()).ok()
        })
    {
        // An edited argument is the approver's: the labels are of the model's call.
        let heading = if approval
            .get("edited_arguments")
            .is_some_and(Value::is_object)
        {
            "where the model's arguments come from:"
        } else {
            "where the arguments come from:"
        };
        let _ = writeln!(out, "{heading}");
        for line in labels.describe() {
            let _ = writeln!(out, "  {}", one_line(&line));
        }
    }
    let list = |pointer: &str| -> Vec<&str> {
        approval
            .pointer(pointer)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect()
    };
    let _ = writeln!(
        out,
        "why ({}):",
        list("/why/determining_policies").join(", ")
    );
    for reason in list("/why/reasons") {
        let _ = writeln!(out, "  {}", one_line(reason));
    }
    let _ = writeln!(out, "binding    {}", field(approval, "/binding_hash"));
    let _ = writeln!(out, "requested  {}", field(approval, "/requested_at"));
    let _ = writeln!(out, "expires    {}", field(approval, "/expires_at"));
    let text = |pointer: &str| approval.pointer(pointer).and_then(Value::as_str);
    match (field(approval, "/status"), text("/decided_by_member")) {
        ("pending", _) => {}
        (_, Some(member)) => {
            let _ = writeln!(
                out,
                "decided    {} by {member}: {}",
                field(approval, "/decided_at"),
                one_line(field(approval, "/decision_reason")),
            );
        }
        // Expired or cancelled: nobody decided it.
        (status, None) => {
            let _ = writeln!(
                out,
                "{status:<10} {}{}",
                text("/decided_at").unwrap_or("(no time recorded)"),
                text("/decision_reason")
                    .map(|reason| format!(": {}", one_line(reason)))
                    .unwrap_or_default(),
            );
        }
    }
    out
}

pub async fn run(cmd: ApprovalsCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ApprovalsCommand::List {
            status,
            run,
            limit,
            client,
        } => {
            let mut query = format!("/v1/approvals?limit={limit}");
            if status != "all" {
                query.push_str(&format!("&status={status}"));
            }
            if let Some(run) = run {
                query.push_str(&format!("&run_id={run}"));
            }
            let approvals = ApiClient::new(&client)?.get(&query).await?;
            if client.json {
                print_json(&approvals)?;
            } else {
                for approval in approvals.as_array().into_iter().flatten() {
                    println!("{}", super::for_terminal(&summary(approval)));
                }
            }
        }
        ApprovalsCommand::Show { id, client } => {
            let approval = ApiClient::new(&client)?
                .get(&format!("/v1/approvals/{id}"))
                .await?;
            if client.json {
                print_json(&approval)?;
            } else {
                show(&approval);
            }
        }
        ApprovalsCommand::Approve {
            id,
            reason,
            edits,
            client,
        } if !edits.is_empty() => {
            let mut arguments = serde_json::Map::new();
            for edit in &edits {
                let Some((name, value)) = edit.split_once('=') else {
                    return Err(crate::usage(format!("`--edit {edit}`: expected NAME=JSON")));
                };
                let value: Value = serde_json::from_str(value).map_err(|e| {
                    crate::usage(format!(
                        "`--edit {name}=…`: the value is not JSON ({e}); quote text as '\"text\"'"
                    ))
                })?;
                if arguments.insert(name.to_owned(), value).is_some() {
                    return Err(crate::usage(format!(
                        "`--edit {name}=…` is given more than once: give each argument once"
                    )));
                }
            }
            let approval = ApiClient::new(&client)?
                .post(
                    &format!("/v1/approvals/{id}/edit-and-approve"),
                    &json!({ "arguments": arguments, "reason": reason }),
                )
                .await?;
            if client.json {
                print_json(&approval)?;
            } else {
                println!("{}", super::for_terminal(&summary(&approval)));
            }
        }
        ApprovalsCommand::Approve {
            id, reason, client, ..
        } => {
            decide(&id, "approve", &reason, &client).await?;
        }
        ApprovalsCommand::Deny { id, reason, client } => {
            decide(&id, "deny", &reason, &client).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn decide(
    id: &wor_core::ApprovalId,
    verb: &str,
    reason: &str,
    client: &ClientArgs,
) -> anyhow::Result<()> {
    let approval = ApiClient::new(client)?
        .post(
            &format!("/v1/approvals/{id}/{verb}"),
            &json!({ "reason": reason }),
        )
        .await?;
    if client.json {
        print_json(&approval)?;
    } else {
        println!("{}", super::for_terminal(&summary(&approval)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::shown;

    #[test]
    fn an_edited_approval_shows_the_edited_arguments_as_what_is_sent() {
        let approval = json!({
            "id": "apr_1",
            "status": "approved",
            "tool": "mail/send",
            "pinned_keys": ["from"],
            "arguments": {"to": "attacker@evil.example", "from": "desk@corp.example"},
            "edited_arguments": {"to": "ops@corp.example", "from": "desk@corp.example"},
        });
        let text = shown(&approval);
        let sent = text
            .find("arguments as edited by the approver (exactly what will be sent):")
            .expect(&text);
        let asked = text
            .find("arguments the model asked for (not sent):")
            .expect(&text);
        assert!(sent < asked, "{text}");
        let edited = text.get(sent..asked).unwrap();
        assert!(edited.contains("to = \"ops@corp.example\""), "{text}");
        assert!(
            edited.contains("from = \"desk@corp.example\"  (pinned by the routine)"),
            "{text}"
        );
        let requested = text.get(asked..).unwrap();
        assert!(
            requested.contains("to = \"attacker@evil.example\""),
            "{text}"
        );
        assert!(!edited.contains("attacker"), "{text}");

        // An argument's name is the model's: one that is not a plain name is quoted, so it
        // cannot pass for lines of the listing.
        let forged = shown(&json!({"arguments": {
            "a\narguments the model asked for (not sent):\n  to": "x",
            "to": "ops@corp.example",
        }}));
        assert!(
            !forged
                .lines()
                .any(|l| l.starts_with("arguments the model asked for")),
            "{forged}"
        );
        assert!(
            forged.contains(r#"  "a\narguments the model asked for (not sent):\n  to" = "x""#),
            "{forged}"
        );
        // A reason on one line, whatever it holds.
        let decided =
            shown(&json!({"status": "denied", "decision_reason": "no\nbinding    forged"}));
        assert!(decided.contains("no\\nbinding    forged"), "{decided}");

        // An approval nobody decided says what became of it, and names nobody.
        let expired = shown(&json!({"status": "expired", "decided_at": "2026-12-01T10:00:00Z"}));
        assert!(
            expired.contains("expired    2026-12-01T10:00:00Z\n") && !expired.contains(" by "),
            "{expired}"
        );
        let approved = shown(
            &json!({"status": "approved", "decided_at": "2026-12-01T10:00:00Z",
            "decided_by_member": "mem_1", "decision_reason": "ok"}),
        );
        assert!(
            approved.contains("decided    2026-12-01T10:00:00Z by mem_1: ok"),
            "{approved}"
        );

        // Without an edit, the requested arguments are what is sent.
        let plain = shown(&json!({"arguments": {"to": "a@b.example"}}));
        assert!(
            plain.contains("arguments (exactly what will be sent):\n  to = \"a@b.example\"\n"),
            "{plain}"
        );
        assert!(!plain.contains("not sent"), "{plain}");
    }
}
