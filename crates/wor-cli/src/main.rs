//! `wor`: the one binary of Work on Repeat — the server, the operator commands that work on
//! the database directly, and a client of the HTTP API. This is the composition root: it reads
//! configuration and wires the crates together; it holds no business rules.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line program's output is its interface"
)]

mod client;
mod commands;
mod config;
mod demo_tools;
mod env;
mod logging;

use std::process::ExitCode;

use clap::Parser;

use crate::commands::Command;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "wor",
    version,
    about = "Work on Repeat: run AI agent routines whose every tool call is bounded",
    long_about = "Work on Repeat runs AI agent routines on a schedule, on a signed webhook or on \
                  request, and bounds what they can do even when their model is hijacked.\n\n\
                  Server and operator commands: serve, init, project, secrets, backup, restore, \
                  worker token, worker list, worker revoke.\n\
                  Local commands: sandbox exec, doctor, egress check, policy test, webhook sign, \
                  webhook verify.\n\
                  Client commands (need --server/WOR_SERVER and WOR_API_KEY): whoami, member, key, \
                  model-connection, connection, routine, run, approvals, policy show/set/reset, \
                  webhook deliveries, notify, audit export.\n\
                  A worker of a scaled-out deployment: worker enroll, then serve --role worker.\n\
                  Audit: audit verify, audit public-key (operator) and audit export (client).\n\
                  Shell: completions, manpages.",
    after_help = EXIT_CODES
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// What the exit status of every command means; shown by `wor --help`.
const EXIT_CODES: &str = "Exit codes:\n  \
    0    success\n  \
    1    failure, or a check that said no: an error, a run that did not succeed (run start \
    --follow), a URL refused (egress check), an invalid signature (webhook verify), a broken \
    chain (audit verify), a failed readiness check such as an unsupported sandbox layer (doctor)\n  \
    2    usage: bad arguments or configuration (a config file, flag or variable the command \
    cannot use, a client's WOR_API_KEY, one the server refuses included, or --server among \
    them), or production mode refusing to start\n  \
    10   policy test: the call would wait for a person (confirm)\n  \
    11   policy test: the call would be denied\n  \
    130  serve, demo: a second SIGINT ended the drain at once (143: a second SIGTERM)\n  \
    141  what read the output closed it first (`wor run list | head -1`)\n  \
    sandbox exec exits with the command's own status (137 when it was killed or timed out)";

fn main() -> ExitCode {
    // Before anything else: the sandbox helper is this binary re-executed, and it forks.
    wor_sandbox::main_if_helper();
    // The allocator commits its arenas up front. Where the kernel backs anonymous memory with
    // transparent huge pages, each touched piece of an arena then holds 2 MiB: about 20 MiB
    // more at rest. They are turned off for this process and those it starts; where the kernel
    // cannot, that costs memory only, so the answer is not needed.
    let _ = rustix::thread::disable_transparent_huge_pages(true);
    quiet_on_closed_stdout();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and the version, on stdout as clap prints them.
        Err(err) if !err.use_stderr() => err.exit(),
        // A refused argument is quoted as typed: escaped, as every other error is.
        Err(err) => {
            eprint!("{}", commands::for_terminal(&err.render().to_string()));
            return ExitCode::from(2);
        }
    };
    if let Err(err) = logging::init(
        cli.command.default_log_level(),
        cli.command.makes_outbound_connections(),
    ) {
        eprintln!("error: {}", commands::for_terminal(&error_text(&err)));
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli.command.run()) {
        Ok(code) => code,
        Err(err) => {
            // An error can quote what a server, a backup or a database holds: escaped, so
            // none of it can move the cursor or rewrite lines already shown.
            eprintln!("error: {}", commands::for_terminal(&error_text(&err)));
            if err.chain().any(|cause| cause.is::<UsageError>()) {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// `error` and its causes, each after a colon, as `{:#}` writes them, without a cause that the
/// message before it already ends with (an error that quotes its source in its own message).
fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let said = cause.to_string();
        if text.is_empty() {
            text = said;
        } else if !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
    }
    text
}

/// The exit status of a process whose output was closed by its reader: a SIGPIPE death's
/// (128 + 13).
const CLOSED_PIPE_EXIT: i32 = 141;

/// Standard output for a command that streams it with `write!` rather than `println!`, ended
/// as [`quiet_on_closed_stdout`] ends a `println!` when what reads it has gone.
pub(crate) struct Stdout(pub(crate) std::io::StdoutLock<'static>);

impl Stdout {
    fn closed<T>(result: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(error) = &result
            && error.kind() == std::io::ErrorKind::BrokenPipe
        {
            std::process::exit(CLOSED_PIPE_EXIT);
        }
        result
    }
}

impl std::io::Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Self::closed(self.0.write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Self::closed(self.0.flush())
    }
}

/// Ends the process quietly, as a pipeline expects, when what reads its output has gone
/// (`wor run list | head -1`): the standard library answers a write to a closed pipe with a
/// panic in `println!` (and clap_complete with one of its own), which would otherwise print
/// a panic message and exit 101. The exit status is a SIGPIPE death's (128 + 13).
fn quiet_on_closed_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        let printing = payload.starts_with("failed printing to stdout")
            || payload.starts_with("failed to write completion file");
        if printing && (payload.contains("Broken pipe") || payload.contains("BrokenPipe")) {
            std::process::exit(CLOSED_PIPE_EXIT);
        }
        report(info);
    }));
}

/// A command given something it cannot use — a server's configuration, a client's key or
/// server URL — as against one that failed at its work: `wor` exits with 2 for it, as
/// [`EXIT_CODES`] says. It reads as the error it wraps, causes and all.
#[derive(Debug)]
pub(crate) struct UsageError(pub(crate) anyhow::Error);

/// `message` as a [`UsageError`].
pub(crate) fn usage(message: impl std::fmt::Display) -> anyhow::Error {
    UsageError(anyhow::Error::msg(message.to_string())).into()
}

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for UsageError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_its_message_already_quotes_is_told_once() {
        let io = std::io::Error::from_raw_os_error(17);
        /// An error that quotes its source in its message and gives it as its source too.
        #[derive(Debug)]
        struct Quoting(std::io::Error);
        impl std::fmt::Display for Quoting {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "cannot make `/d`: {}", self.0)
            }
        }
        impl std::error::Error for Quoting {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let both = anyhow::Error::new(Quoting(std::io::Error::from_raw_os_error(17)))
            .context("cannot open the database");
        assert_eq!(
            error_text(&both),
            format!("cannot open the database: cannot make `/d`: {io}")
        );
        // Causes that add something are all told.
        let chained = anyhow::anyhow!("root").context("middle").context("top");
        assert_eq!(error_text(&chained), "top: middle: root");
    }
}
