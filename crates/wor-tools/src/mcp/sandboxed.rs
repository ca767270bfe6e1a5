//! The launcher that starts stdio MCP servers in the mandatory sandbox (`wor-sandbox`).
//!
//! The server gets exactly what its command declares: its environment variables, read-only
//! paths, and — only when its allowlist names hosts — network through the egress guard's proxy.
//! If the sandbox cannot apply a layer, the launch fails and names it; nothing starts with less.

use std::fmt;

use secrecy::ExposeSecret;
use wor_sandbox::{Bind, NetworkAccess, Sandbox, SandboxProfile, SandboxStdio, SandboxedProcess};

use super::sandbox::{
    LaunchError, LaunchFuture, LaunchedProcess, ProcessGuard, SandboxLauncher, StdioCommand,
};

/// Starts stdio MCP servers in `wor-sandbox`.
#[derive(Debug, Clone)]
pub struct Sandboxed {
    sandbox: Sandbox,
}

impl Sandboxed {
    pub fn new(sandbox: Sandbox) -> Self {
        Sandboxed { sandbox }
    }
}

/// Keeps the sandboxed process alive; dropping it kills the whole tree and removes its root.
struct SandboxedGuard {
    _process: SandboxedProcess,
}

impl fmt::Debug for SandboxedGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SandboxedGuard").finish_non_exhaustive()
    }
}

impl ProcessGuard for SandboxedGuard {}

impl SandboxLauncher for Sandboxed {
    fn launch<'a>(&'a self, command: &'a StdioCommand) -> LaunchFuture<'a> {
        Box::pin(async move {
            let failed = |reason: String| LaunchError::Failed {
                program: command.program.clone(),
                reason,
            };
            let mut profile = SandboxProfile::new(&command.program).args(command.args.clone());
            for (name, value) in &command.env {
                profile = profile.env(name.clone(), value.expose_secret().to_owned());
            }
            for path in &command.read_only_paths {
                profile = profile.bind(Bind::same(path.clone()));
            }
            let hosts: Vec<String> = command
                .egress_allowlist
                .patterns()
                .iter()
                .map(|p| p.to_string())
                .collect();
            if !hosts.is_empty() {
                profile = profile.network(NetworkAccess::Proxy(hosts));
            }
            let mut process = self
                .sandbox
                .spawn(&profile, SandboxStdio::Piped)
                .await
                .map_err(|e| failed(e.to_string()))?;
            let stdin = process
                .stdin
                .take()
                .ok_or_else(|| failed("the sandbox gave no stdin pipe".to_owned()))?;
            let stdout = process
                .stdout
                .take()
                .ok_or_else(|| failed("the sandbox gave no stdout pipe".to_owned()))?;
            Ok(LaunchedProcess {
                stdin: Box::new(stdin),
                stdout: Box::new(stdout),
                guard: Box::new(SandboxedGuard { _process: process }),
            })
        })
    }
}
