//! The subcommands.

mod keys;
mod members;
mod operator;
mod sandbox;
mod serve;

use std::process::ExitCode;

use crate::client::ClientArgs;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Run the server: API, console, scheduler and worker in one process.
    Serve(serve::ServeArgs),
    /// Create the first project and its owner; print the owner's API key once (operator).
    Init(operator::InitArgs),
    /// Manage projects (operator: works on the database directly).
    #[command(subcommand)]
    Project(operator::ProjectCommand),
    /// Show the project, member and role of the key in WOR_API_KEY.
    Whoami(ClientArgs),
    /// Members of your project.
    #[command(subcommand)]
    Member(members::MemberCommand),
    /// API keys of your project.
    #[command(subcommand)]
    Key(keys::KeyCommand),
    /// Run a command in the mandatory sandbox, as a local tool would run (local).
    #[command(subcommand)]
    Sandbox(sandbox::SandboxCommand),
    /// Report which sandbox layers this host supports, by applying each one (local).
    Doctor(sandbox::DoctorArgs),
}

impl Command {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            Command::Serve(args) => serve::run(args).await,
            Command::Init(args) => operator::init(args).await,
            Command::Project(cmd) => operator::project(cmd).await,
            Command::Whoami(args) => members::whoami(args).await,
            Command::Member(cmd) => members::run(cmd).await,
            Command::Key(cmd) => keys::run(cmd).await,
            Command::Sandbox(sandbox::SandboxCommand::Exec(args)) => sandbox::exec(args).await,
            Command::Doctor(args) => sandbox::doctor(args).await,
        }
    }
}

/// Prints `value` as pretty JSON on stdout.
pub(crate) fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// The string at a JSON pointer (`/project/name`) as display text, `-` when absent.
pub(crate) fn field<'a>(value: &'a serde_json::Value, pointer: &str) -> &'a str {
    value
        .pointer(pointer)
        .and_then(|v| v.as_str())
        .unwrap_or("-")
}
