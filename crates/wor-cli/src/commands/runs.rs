//! `wor run …`: start, follow, inspect and cancel runs (clients of the API).

use std::process::ExitCode;

use serde_json::{Value, json};
use wor_core::run::IdempotencyKey;
use wor_core::step::Step;

use super::routines::routine_id;
use super::{field, for_terminal, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
pub enum RunCommand {
    /// Start a run of a routine (by name or `rtn_…` id).
    Start {
        routine: String,
        /// The requester's input, as text.
        #[arg(long, conflicts_with = "input_json")]
        input: Option<String>,
        /// The requester's input, as a JSON value.
        #[arg(long, value_name = "JSON")]
        input_json: Option<String>,
        /// Show the run live until it ends; exit 0 only if it succeeded. With `--json`, the
        /// live view goes to stderr and the ended run (with its `result`) to stdout.
        #[arg(long)]
        follow: bool,
        /// The memory thread, for routines with `[memory]` [default: default].
        #[arg(long)]
        thread: Option<String>,
        /// This start's own key (1 to 255 visible ASCII characters): the same command run
        /// again with the same key, after a crash or a lost answer, starts nothing and shows
        /// the run the key started; with other input it is refused.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a run and its steps.
    Get {
        /// A `run_…` id.
        id: wor_core::RunId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List runs, newest first.
    List {
        /// Only runs of this routine (name or id).
        #[arg(long)]
        routine: Option<String>,
        /// Only runs with this status.
        #[arg(long, value_parser = run_status)]
        status: Option<String>,
        /// At most this many (1 to 200).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=200))]
        limit: u32,
        /// Only runs older than this one (a `run_…` id): the last run of the page before.
        #[arg(long, value_name = "RUN_ID")]
        before: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Cancel a run.
    Cancel {
        /// A `run_…` id.
        id: wor_core::RunId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a run live until it ends; exit 0 only if it succeeded (`--json`: as for `start`).
    Follow {
        /// A `run_…` id.
        id: wor_core::RunId,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// A run's `result` (routines with `[output] schema`), compact, takes the place of its outcome.
pub(crate) fn summary(run: &Value) -> String {
    let usage = run.get("usage").cloned().unwrap_or(Value::Null);
    let n = |k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
    let ended = match run.get("result") {
        Some(result) => format!("result {result}"),
        // One line a run: an outcome of several lines is joined.
        None => field(run, "/outcome")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    };
    format!(
        "{}  {:<20}  turns {} tools {} tokens {}/{}  {}",
        field(run, "/id"),
        field(run, "/status"),
        n("turns"),
        n("tool_calls"),
        n("input_tokens"),
        n("output_tokens"),
        ended,
    )
}

/// One line for a step (as the API shows it), for people watching a run.
pub(crate) fn describe_step(step: &Value) -> String {
    let provenance = field(step, "/provenance");
    let kind = field(step, "/kind");
    let payload = step.get("payload").cloned().unwrap_or(Value::Null);
    match Step::from_stored(kind, payload) {
        Ok(step) => format!("[{provenance}] {}", step.describe()),
        // A newer server's step this client does not know: named, not guessed at.
        Err(error) => format!("[{provenance}] {kind} ({error})"),
    }
}

/// [`describe_step`] for a person who has just watched `streamed` written: a model turn whose
/// text is all of it is not shown again, only its calls. Text the stream did not carry
/// whole (a follower that fell behind) is shown as recorded.
fn describe_step_after(step: &Value, streamed: &str) -> String {
    let payload = step.get("payload").cloned().unwrap_or(Value::Null);
    match Step::from_stored(field(step, "/kind"), payload) {
        Ok(Step::ModelTurn(mut turn)) if !streamed.is_empty() && turn.message.text == streamed => {
            turn.message.text.clear();
            let calls = Step::ModelTurn(turn).describe();
            let sep = if calls.is_empty() { "" } else { " " };
            format!(
                "[{}] (the text above){sep}{calls}",
                field(step, "/provenance")
            )
        }
        _ => describe_step(step),
    }
}

/// What a person watching is told when `step` holds a call for a decision: that the run
/// waits for one, and where to find it.
fn waiting_hint(step: &Value, run: &str) -> Option<String> {
    let payload = step.get("payload").cloned().unwrap_or(Value::Null);
    let held = matches!(
        Step::from_stored(field(step, "/kind"), payload),
        Ok(Step::ToolCall(call)) if call.decision == wor_core::call::Verdict::Confirm
    );
    held.then(|| {
        format!(
            "  waiting for a person to decide this call: `wor approvals list --run {run}`, then \
             `wor approvals show ID`"
        )
    })
}

/// Prints `line` for a person watching: on stdout, or on stderr when stdout is kept for JSON.
fn watch_line(json: bool, line: &str) {
    if json {
        eprintln!("{}", for_terminal(line));
    } else {
        println!("{}", for_terminal(line));
    }
}

/// Follows run `id` until it ends. With `json`, what is shown live goes to stderr and stdout
/// gets the ended run as the API shows it (its steps and, for a routine with an output
/// schema, its `result`).
async fn follow(api: &ApiClient, id: &str, json: bool) -> anyhow::Result<ExitCode> {
    let mut last = Value::Null;
    // The model's text as it is written, on one line ended when the next step arrives.
    let mut in_text = false;
    // That text since the last step, for the turn that records it.
    let mut streamed = String::new();
    api.events(
        &format!("/v1/runs/{id}/events"),
        |event, data| match event {
            "text" => {
                let delta = field(&data, "/delta");
                if json {
                    eprint!("{}", for_terminal(delta));
                } else {
                    print!("{}", for_terminal(delta));
                    let _ = std::io::Write::flush(&mut std::io::stdout());
                }
                streamed.push_str(delta);
                in_text = true;
            }
            "step" => {
                if std::mem::take(&mut in_text) {
                    watch_line(json, "");
                }
                watch_line(
                    json,
                    &describe_step_after(&data, &std::mem::take(&mut streamed)),
                );
                if let Some(hint) = waiting_hint(&data, id) {
                    watch_line(json, &hint);
                }
            }
            "end" => last = data,
            _ => {}
        },
    )
    .await?;
    if last.is_null() || json {
        last = api.get(&format!("/v1/runs/{id}")).await?;
    }
    eprintln!("{}", for_terminal(&summary(&last)));
    if json {
        print_json(&last)?;
    }
    Ok(if field(&last, "/status") == "succeeded" {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A run's validated result (routines with `[output] schema`), indented, under its summary.
fn print_result(run: &Value) -> anyhow::Result<()> {
    if let Some(result) = run.get("result") {
        println!(
            "result:\n{}",
            for_terminal(&serde_json::to_string_pretty(result)?)
        );
    }
    Ok(())
}

pub async fn run(cmd: RunCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        RunCommand::Start {
            routine,
            input,
            input_json,
            follow: live,
            thread,
            idempotency_key,
            client,
        } => {
            let input = match (input, input_json) {
                (_, Some(text)) => serde_json::from_str(&text)
                    .map_err(|e| crate::usage(format!("--input-json is not valid JSON: {e}")))?,
                (Some(text), None) => Value::String(text),
                (None, None) => Value::Null,
            };
            if let Some(key) = &idempotency_key {
                key.parse::<IdempotencyKey>()
                    .map_err(|e| crate::usage(format!("--idempotency-key is refused: {e}")))?;
            }
            let api = ApiClient::new(&client)?;
            let id = routine_id(&api, &routine).await?;
            let path = format!("/v1/routines/{id}/runs");
            let body = json!({ "input": input, "thread": thread });
            let (run, earlier) = match &idempotency_key {
                Some(key) => api.post_idempotent(&path, &body, key).await?,
                None => (api.post(&path, &body).await?, false),
            };
            let run_id = field(&run, "/id").to_owned();
            if earlier {
                eprintln!(
                    "this idempotency key already started run {run_id}: nothing new was started"
                );
            }
            // A start the overlap policy passed over is recorded, not run: said, not only shown.
            let skipped = field(&run, "/status") == "skipped";
            if skipped {
                eprintln!(
                    "run {run_id} was recorded skipped, not run: {}",
                    for_terminal(field(&run, "/outcome"))
                );
            }
            if live {
                if !earlier && !skipped {
                    eprintln!("run {run_id} started");
                }
                return follow(&api, &run_id, client.json).await;
            }
            if client.json {
                print_json(&run)?;
            } else {
                println!("{run_id}");
            }
        }
        RunCommand::Get { id, client } => {
            let run = ApiClient::new(&client)?
                .get(&format!("/v1/runs/{id}"))
                .await?;
            if client.json {
                print_json(&run)?;
            } else {
                println!("{}", for_terminal(&summary(&run)));
                print_result(&run)?;
                for step in run
                    .get("steps")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    println!("  {}", for_terminal(&describe_step(step)));
                }
            }
        }
        RunCommand::List {
            routine,
            status,
            limit,
            before,
            client,
        } => {
            let api = ApiClient::new(&client)?;
            let mut query = url::form_urlencoded::Serializer::new(String::new());
            query.append_pair("limit", &limit.to_string());
            if let Some(routine) = routine {
                query.append_pair("routine_id", &routine_id(&api, &routine).await?.to_string());
            }
            if let Some(status) = &status {
                query.append_pair("status", status);
            }
            if let Some(before) = &before {
                query.append_pair("before", before);
            }
            let runs = api.get(&format!("/v1/runs?{}", query.finish())).await?;
            if client.json {
                print_json(&runs)?;
            } else {
                for r in runs.as_array().into_iter().flatten() {
                    println!("{}", for_terminal(&summary(r)));
                }
            }
        }
        RunCommand::Cancel { id, client } => {
            let run = ApiClient::new(&client)?
                .post(&format!("/v1/runs/{id}/cancel"), &Value::Null)
                .await?;
            if client.json {
                print_json(&run)?;
            } else {
                println!("{}", for_terminal(&summary(&run)));
            }
        }
        RunCommand::Follow { id, client } => {
            return follow(&ApiClient::new(&client)?, &id.to_string(), client.json).await;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A run status as `--status` takes it: one of the statuses a run has.
fn run_status(text: &str) -> Result<String, String> {
    wor_core::run::RunStatus::ALL
        .iter()
        .find(|status| status.as_str() == text)
        .map(|status| status.as_str().to_owned())
        .ok_or_else(|| {
            let known: Vec<&str> = wor_core::run::RunStatus::ALL
                .iter()
                .map(|status| status.as_str())
                .collect();
            format!("not a run status; one of {}", known.join(", "))
        })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{summary, waiting_hint};

    #[test]
    fn a_run_is_summed_up_on_one_line() {
        let run = json!({
            "id": "run_1",
            "status": "failed",
            "usage": {"turns": 1},
            "outcome": "the model said:\nno\n  and stopped",
        });
        let line = summary(&run);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.ends_with("the model said: no and stopped"), "{line}");
    }

    #[test]
    fn a_held_call_tells_the_watcher_where_to_decide_it() {
        let call = |decision: &str| {
            json!({"kind": "tool_call", "payload": {
                "tool": "mail/send", "model_name": "mail__send", "call_id": "c1",
                "arguments": {}, "arguments_hash": "h", "pinned_keys": [], "pin_hash": "p",
                "decision": decision,
            }})
        };
        let hint = waiting_hint(&call("confirm"), "run_1").expect("a hint");
        assert!(hint.contains("wor approvals list --run run_1"), "{hint}");
        for other in [call("allow"), json!({"kind": "tool_result", "payload": {}})] {
            assert_eq!(waiting_hint(&other, "run_1"), None, "{other}");
        }
    }
}
