//! `wor policy test`: the decision policy would give for one tool call, offline.

use std::path::PathBuf;
use std::process::ExitCode;

use wor_policy::{Outcome, PolicyEngine, ToolCallDescription};

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
}

const EXIT_CONFIRM: u8 = 10;
const EXIT_DENY: u8 = 11;
const EXIT_USAGE: u8 = 2;

pub fn run(cmd: PolicyCommand) -> anyhow::Result<ExitCode> {
    let PolicyCommand::Test {
        file,
        call,
        project,
        json,
    } = cmd;
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
    if json {
        super::print_json(&serde_json::to_value(&decision)?)?;
    } else {
        println!("{}", decision.outcome);
        println!(
            "determined by: {}",
            decision.determining_policies.join(", ")
        );
        for reason in &decision.reasons {
            println!("  {reason}");
        }
    }
    Ok(match decision.outcome {
        Outcome::Allow => ExitCode::SUCCESS,
        Outcome::Confirm => ExitCode::from(EXIT_CONFIRM),
        Outcome::Deny => ExitCode::from(EXIT_DENY),
    })
}
