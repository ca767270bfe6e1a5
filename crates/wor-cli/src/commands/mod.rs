//! The subcommands.

mod approvals;
mod audit;
mod backup;
mod demo;
mod doctor;
mod egress;
mod keys;
mod member_invite;
mod members;
mod model_connections;
mod notify;
mod operator;
mod policy;
mod routines;
mod runs;
mod sandbox;
mod secrets;
mod serve;
mod serve_worker;
mod shell;
mod tool_connections;
mod webhooks;
mod worker;

use std::process::ExitCode;

use crate::client::ClientArgs;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Run the server: the HTTP API and a run worker in one process.
    Serve(serve::ServeArgs),
    /// The main job in one command: a routine run, a tool call held for approval and a blocked
    /// exfiltration attempt, on a temporary embedded server.
    Demo(demo::DemoArgs),
    /// Create the first project and its owner; print the owner's API key once (operator).
    Init(operator::InitArgs),
    /// Write a consistent copy of the embedded database while the server runs (operator; for
    /// PostgreSQL it names the `pg_dump` path).
    Backup(backup::BackupArgs),
    /// Restore a backup into an empty data dir; refused unless every audit chain verifies and
    /// every sealed secret opens under the key given (operator).
    Restore(backup::RestoreArgs),
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
    /// Routines: apply TOML definitions, list and show them.
    #[command(subcommand)]
    Routine(routines::RoutineCommand),
    /// Runs: start (and follow), list, get and cancel.
    #[command(subcommand)]
    Run(runs::RunCommand),
    /// Model connections: provider endpoints and their (sealed) API keys.
    #[command(subcommand, name = "model-connection")]
    ModelConnection(model_connections::ModelConnectionCommand),
    /// Tool connections: MCP servers and HTTP APIs, reviewed and pinned before use.
    #[command(subcommand)]
    Connection(Box<tool_connections::ToolConnectionCommand>),
    /// The encryption key ring (operator: works on the database directly).
    #[command(subcommand)]
    Secrets(secrets::SecretsCommand),
    /// The egress guard, as a local tool.
    #[command(subcommand)]
    Egress(egress::EgressCommand),
    /// The tamper-evident audit log: verify, export, and the checkpoint public key.
    #[command(subcommand)]
    Audit(audit::AuditCommand),
    /// Run a command in the mandatory sandbox, as a local tool would run (local).
    #[command(subcommand)]
    Sandbox(sandbox::SandboxCommand),
    /// A readiness report with an exit code for monitoring: sandbox layers, Wasm runtime,
    /// encryption key, database and migrations, clock skew, free disk (local).
    Doctor(doctor::DoctorArgs),
    /// Tool-call policies: the project's policy, and testing a decision offline.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// Approvals: tool calls waiting for a person's decision.
    #[command(subcommand)]
    Approvals(approvals::ApprovalsCommand),
    /// Webhooks: sign and verify bodies (local), and the delivery log of run webhooks.
    #[command(subcommand)]
    Webhook(webhooks::WebhookCommand),
    /// Workers of a scaled-out deployment: enrolment tokens (operator) and enrolling a worker.
    #[command(subcommand)]
    Worker(worker::WorkerCommand),
    /// Notification routes: approval requests sent to Slack or by email, and their delivery log.
    #[command(subcommand)]
    Notify(notify::NotifyCommand),
    /// Print a shell completion script (bash, zsh, fish, powershell, elvish) on standard output.
    Completions(shell::CompletionsArgs),
    /// Write the manual pages of `wor` and every subcommand into a directory.
    Manpages(shell::ManpagesArgs),
}

impl Command {
    /// The log level when `WOR_LOG` is not set: the demo's output is its narrative.
    pub fn default_log_level(&self) -> &'static str {
        match self {
            Command::Demo(_) => "warn",
            Command::Completions(_) | Command::Manpages(_) => "error",
            _ => "info",
        }
    }

    /// Whether the command runs routines, and so makes outbound connections whose failures
    /// only its log records (`wor serve` in any role, `wor demo`); the others are clients of a
    /// server, or touch no network.
    pub fn makes_outbound_connections(&self) -> bool {
        matches!(self, Command::Serve(_) | Command::Demo(_))
    }

    pub async fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            Command::Serve(args) => serve::run(args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Init(args) => operator::init(args).await,
            Command::Backup(args) => backup::backup(args).await,
            Command::Restore(args) => backup::restore(args).await,
            Command::Project(cmd) => operator::project(cmd).await,
            Command::Whoami(args) => members::whoami(args).await,
            Command::Member(cmd) => members::run(cmd).await,
            Command::Key(cmd) => keys::run(cmd).await,
            Command::Egress(cmd) => egress::run(cmd).await,
            Command::Routine(cmd) => routines::run(cmd).await,
            Command::Run(cmd) => runs::run(cmd).await,
            Command::ModelConnection(cmd) => model_connections::run(cmd).await,
            Command::Connection(cmd) => tool_connections::run(*cmd).await,
            Command::Secrets(cmd) => secrets::run(cmd).await,
            Command::Audit(cmd) => audit::run(cmd).await,
            Command::Sandbox(sandbox::SandboxCommand::Exec(args)) => sandbox::exec(args).await,
            Command::Doctor(args) => doctor::run(args).await,
            Command::Policy(cmd) => policy::run(cmd).await,
            Command::Approvals(cmd) => approvals::run(cmd).await,
            Command::Webhook(cmd) => webhooks::run(cmd).await,
            Command::Notify(cmd) => notify::run(cmd).await,
            Command::Worker(cmd) => worker::run(cmd).await,
            Command::Completions(args) => Ok(shell::completions(&args)),
            Command::Manpages(args) => shell::manpages(&args),
        }
    }
}

/// `text` as it may reach a terminal: text a run, a tool or a person wrote is shown, never
/// obeyed, so every control character but a newline and a tab (C0, DEL and C1: escape
/// sequences, carriage returns, bells), and the invisible characters that reorder or hide
/// text ([`wor_core::text::is_hidden`]), is written as its `\u{…}` escape.
pub(crate) fn for_terminal(text: &str) -> std::borrow::Cow<'_, str> {
    wor_core::text::shown(text, |c| c == '\r')
}

/// `text` on one line: its line breaks written as `\n`, so that what someone else wrote cannot
/// pass for lines of the output around it.
pub(crate) fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains(['\n', '\r']) {
        std::borrow::Cow::Owned(text.replace('\n', "\\n").replace('\r', "\\r"))
    } else {
        std::borrow::Cow::Borrowed(text)
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

/// The id of a resource the command was given as `given`: an id of `prefix` as it is,
/// checked (a malformed one is a usage error), or else the id of the `what` of that name in
/// the listing at `list`.
pub(crate) async fn id_or_name<T>(
    api: &crate::client::ApiClient,
    given: &str,
    prefix: &str,
    what: &str,
    list: &str,
) -> anyhow::Result<T>
where
    T: std::str::FromStr<Err = wor_core::IdError>,
{
    use anyhow::Context as _;
    if given
        .strip_prefix(prefix)
        .is_some_and(|rest| rest.starts_with('_'))
    {
        return given.parse().map_err(crate::usage);
    }
    let listed = api.get(list).await?;
    let id = listed
        .as_array()
        .into_iter()
        .flatten()
        .find(|item| item.get("name").and_then(serde_json::Value::as_str) == Some(given))
        .and_then(|item| item.get("id").and_then(serde_json::Value::as_str))
        .with_context(|| {
            format!(
                "there is no {what} named `{}` in the project",
                for_terminal(given)
            )
        })?;
    id.parse()
        .with_context(|| format!("the server named {what} `{given}` with a malformed id"))
}

/// A checkpoint key given on the command line (`--public-key`), read as clap reads an
/// argument: one that is not a key is a usage error, exit 2.
pub(crate) fn public_key_argument(text: &str) -> Result<wor_core::audit::VerifyingKey, String> {
    wor_secrets::parse_verifying_key(text).map_err(|error| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::for_terminal;

    #[test]
    fn control_characters_reach_the_terminal_escaped_and_text_as_it_is() {
        assert_eq!(for_terminal("plain\ttext\nnext"), "plain\ttext\nnext");
        assert_eq!(
            for_terminal("\u{1b}[2J\u{1b}]0;pwned\u{7}\rRED\u{7f}\u{9b}31m"),
            "\\u{1b}[2J\\u{1b}]0;pwned\\u{7}\\u{d}RED\\u{7f}\\u{9b}31m"
        );
        assert_eq!(for_terminal("héllo — ✓"), "héllo — ✓");
        assert_eq!(
            for_terminal("a\u{202e}b\u{200b}c\u{200d}d"),
            "a\\u{202e}b\\u{200b}c\u{200d}d"
        );
    }
}
