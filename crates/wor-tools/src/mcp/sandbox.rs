//! Stdio MCP servers and the seam where the sandbox plugs in.
//!
//! This crate never spawns a process. A stdio server is started by a [`SandboxLauncher`],
//! which the engine supplies from `wor-sandbox`; the only launcher here,
//! [`SandboxUnavailable`], refuses every launch.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use secrecy::SecretString;
use tokio::io::{AsyncRead, AsyncWrite};
use wor_egress::HostAllowlist;

/// How to start a stdio MCP server inside the sandbox.
#[derive(Clone)]
pub struct StdioCommand {
    /// The program, resolved inside the sandbox's view of the filesystem.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// The whole environment it gets (the sandbox clears everything else): the secrets this
    /// connection declares.
    pub env: Vec<(String, SecretString)>,
    /// Hosts the sandbox's egress proxy lets it reach.
    pub egress_allowlist: HostAllowlist,
    /// Host paths the server needs to read (its package, its data), bound read-only at the
    /// same place inside; the system runtime (`/usr` and the loader) is always there.
    pub read_only_paths: Vec<std::path::PathBuf>,
}

impl fmt::Debug for StdioCommand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let env_names: Vec<&str> = self.env.iter().map(|(name, _)| name.as_str()).collect();
        f.debug_struct("StdioCommand")
            .field("program", &self.program)
            .field("args", &self.args)
            .field("env", &env_names)
            .field("egress_allowlist", &self.egress_allowlist)
            .field("read_only_paths", &self.read_only_paths)
            .finish()
    }
}

/// Keeps a launched server alive; dropping it must stop the process and remove its
/// temporary root.
pub trait ProcessGuard: Send + Sync + fmt::Debug {}

/// A running sandboxed server: its pipes and the guard that owns it.
pub struct LaunchedProcess {
    /// The server's standard input.
    pub stdin: Box<dyn AsyncWrite + Send + Unpin>,
    /// The server's standard output.
    pub stdout: Box<dyn AsyncRead + Send + Unpin>,
    /// Owns the process; dropped when the session ends.
    pub guard: Box<dyn ProcessGuard>,
}

impl fmt::Debug for LaunchedProcess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaunchedProcess")
            .field("guard", &self.guard)
            .finish_non_exhaustive()
    }
}

/// A stdio server could not be started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// There is no sandbox in this build; an unsandboxed process is never started instead.
    #[error("stdio MCP servers run only in the sandbox, which is not available in this build")]
    SandboxUnavailable,
    /// The sandbox refused or failed to start the server.
    #[error("the sandbox could not start `{program}`: {reason}")]
    Failed {
        /// The program.
        program: String,
        /// Why (names no secret).
        reason: String,
    },
}

/// The future a [`SandboxLauncher`] returns.
pub type LaunchFuture<'a> =
    Pin<Box<dyn Future<Output = Result<LaunchedProcess, LaunchError>> + Send + 'a>>;

/// Starts a stdio MCP server inside the sandbox and hands back its pipes.
///
/// An implementation must refuse ([`LaunchError`]) rather than start the process with less
/// isolation than the sandbox requires.
pub trait SandboxLauncher: Send + Sync + fmt::Debug {
    /// Starts `command`.
    fn launch<'a>(&'a self, command: &'a StdioCommand) -> LaunchFuture<'a>;
}

/// The launcher of a build without a sandbox: refuses every launch.
#[derive(Debug, Clone, Copy, Default)]
pub struct SandboxUnavailable;

impl SandboxLauncher for SandboxUnavailable {
    fn launch<'a>(&'a self, _command: &'a StdioCommand) -> LaunchFuture<'a> {
        Box::pin(std::future::ready(Err(LaunchError::SandboxUnavailable)))
    }
}
