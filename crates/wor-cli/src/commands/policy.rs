//! `wor policy test`: the decision policy would give for one tool call, offline; and
//! `wor policy show | set | reset`: the project's policy (clients of the API).

use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;
use wor_core::call::Verdict;
use wor_policy::{PolicyEngine, ToolCallDescription};

use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
pub enum PolicyCommand {
    /// Decide one tool call with the default project policy and a routine policy. Prints the
    /// outcome, the policies that determined it and why; exit 0 allow, 10 confirm, 11 deny,
    /// 2 bad input.
    Test {
        /// The routine's policy (Cedar).
        #[arg(short = 'f', long = "file", value_name = "POLICY.cedar")]
        file: PathBuf,
        /// The tool call (JSON; docs/policies.md).
        #[arg(long, value_name = "CALL.json")]
        call: PathBuf,
        /// Use this project policy instead of the built-in default.
        #[arg(long, value_name = "PROJECT.cedar")]
        project: Option<PathBuf>,
        /// Print the decision as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the project's policy (the built-in default until one is set).
    Show(ClientArgs),
    /// Replace the project's policy with a Cedar file, or with a template filled with the
    /// tools it names (docs/policies.md); it is validated first.
    Set {
        #[arg(
            short = 'f',
            long = "file",
            value_name = "POLICY.cedar",
            required_unless_present = "template",
            conflicts_with = "template"
        )]
        file: Option<PathBuf>,
        /// A project policy template: `trusted-arguments`.
        #[arg(long, value_name = "NAME", requires = "tools")]
        template: Option<String>,
        /// A tool the template lists, `CONNECTION/TOOL` (repeat).
        #[arg(long = "tool", value_name = "CONNECTION/TOOL", requires = "template")]
        tools: Vec<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Go back to the built-in default policy.
    Reset(ClientArgs),
}

const EXIT_CONFIRM: u8 = 10;
const EXIT_DENY: u8 = 11;
const EXIT_USAGE: u8 = 2;

pub async fn run(cmd: PolicyCommand) -> anyhow::Result<ExitCode> {
    let (view, client) = match cmd {
        PolicyCommand::Test {
            file,
            call,
            project,
            json,
        } => return test(file, call, project, json),
        PolicyCommand::Show(client) => (ApiClient::new(&client)?.get("/v1/policy").await?, client),
        PolicyCommand::Set {
            file,
            template,
            tools,
            client,
        } => {
            let text = match (file, template) {
                (Some(file), _) => std::fs::read_to_string(&file)
                    .map_err(|e| crate::usage(format!("cannot read `{}`: {e}", file.display())))?,
                (None, Some(template)) => wor_policy::fill_template(&template, &tools)?,
                (None, None) => return Err(crate::usage("give --file or --template")),
            };
            let view = ApiClient::new(&client)?
                .put("/v1/policy", &json!({ "text": text }))
                .await?;
            eprintln!("project policy set");
            (view, client)
        }
        PolicyCommand::Reset(client) => {
            let view = ApiClient::new(&client)?.delete("/v1/policy").await?;
            eprintln!("project policy reset to the built-in default");
            (view, client)
        }
    };
    if client.json {
        super::print_json(&view)?;
    } else {
        if view.get("is_default").and_then(serde_json::Value::as_bool) == Some(true) {
            eprintln!("(the built-in default policy)");
        }
        print!("{}", super::field(&view, "/text"));
    }
    Ok(ExitCode::SUCCESS)
}

fn test(
    file: PathBuf,
    call: PathBuf,
    project: Option<PathBuf>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let usage = |message: String| {
        eprintln!("error: {message}");
        Ok(ExitCode::from(EXIT_USAGE))
    };
    let read = |path: &PathBuf| {
        std::fs::read_to_string(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))
    };
    let routine_text = match read(&file) {
        Ok(text) => text,
        Err(message) => return usage(message),
    };
    let call_text = match read(&call) {
        Ok(text) => text,
        Err(message) => return usage(message),
    };
    let description: ToolCallDescription = match serde_json::from_str(&call_text) {
        Ok(description) => description,
        Err(e) => return usage(format!("`{}`: {e}", call.display())),
    };
    let tool = description.tool.clone();
    let mode = description.mode;
    let request = match description.into_request() {
        Ok(request) => request,
        Err(message) => return usage(format!("`{}`: {message}", call.display())),
    };
    let mut builder = PolicyEngine::builder()
        .routine_policy(routine_text)
        .roster_tool(tool, mode);
    if let Some(path) = &project {
        match read(path) {
            Ok(text) => builder = builder.project_policy(text),
            Err(message) => return usage(message),
        }
    }
    let engine = match builder.build() {
        Ok(engine) => engine,
        Err(e) => return usage(e.to_string()),
    };
    let decision = engine.decide(&request);
    let labels = request.argument_labels();
    if json {
        let mut value = serde_json::to_value(&decision)?;
        if let Some(object) = value.as_object_mut() {
            object.insert("argument_sources".to_owned(), serde_json::to_value(labels)?);
        }
        super::print_json(&value)?;
    } else {
        println!("{}", decision.outcome);
        println!(
            "determined by: {}",
            decision.determining_policies.join(", ")
        );
        for reason in &decision.reasons {
            println!("  {reason}");
        }
        if !labels.0.is_empty() {
            println!("argument sources:");
            for line in labels.describe() {
                println!("  {line}");
            }
        }
    }
    Ok(match decision.outcome {
        Verdict::Allow => ExitCode::SUCCESS,
        Verdict::Confirm => ExitCode::from(EXIT_CONFIRM),
        Verdict::Deny => ExitCode::from(EXIT_DENY),
    })
}
