//! The layers of the sandbox, in the order they are applied, and the errors that name them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One isolation layer. Start-up applies them in [`SandboxLayer::ALL`] order; if one cannot be
/// applied the process does not start and the error names the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxLayer {
    /// A new user namespace; the outer uid/gid mapped to 1000 inside.
    UserNamespace,
    /// A new pid namespace: the tool is its init and sees only its own processes.
    PidNamespace,
    /// A new, empty network namespace.
    NetworkNamespace,
    /// A new System V IPC / POSIX message queue namespace.
    IpcNamespace,
    /// A new hostname namespace.
    UtsNamespace,
    /// A new mount namespace, private propagation.
    MountNamespace,
    /// A tmpfs root with read-only binds, `/proc`, minimal `/dev`, `pivot_root`, remounted
    /// read-only.
    RootFilesystem,
    /// A private size-limited `/tmp` tmpfs, `noexec,nosuid,nodev`.
    PrivateTmp,
    /// The in-namespace listener of the parent's egress proxy (only with network access).
    EgressProxy,
    /// `setrlimit` limits.
    ResourceLimits,
    /// `PR_SET_NO_NEW_PRIVS`.
    NoNewPrivileges,
    /// Landlock: read-only binds, writable `/tmp` only, TCP only to the proxy, signal scoping.
    Landlock,
    /// The seccomp filter.
    Seccomp,
}

impl SandboxLayer {
    /// Every layer, in the order applied.
    pub const ALL: [SandboxLayer; 13] = [
        SandboxLayer::UserNamespace,
        SandboxLayer::PidNamespace,
        SandboxLayer::NetworkNamespace,
        SandboxLayer::IpcNamespace,
        SandboxLayer::UtsNamespace,
        SandboxLayer::MountNamespace,
        SandboxLayer::RootFilesystem,
        SandboxLayer::PrivateTmp,
        SandboxLayer::EgressProxy,
        SandboxLayer::ResourceLimits,
        SandboxLayer::NoNewPrivileges,
        SandboxLayer::Landlock,
        SandboxLayer::Seccomp,
    ];

    /// The kebab-case name (`user-namespace`, `landlock`).
    pub fn name(self) -> &'static str {
        match self {
            SandboxLayer::UserNamespace => "user-namespace",
            SandboxLayer::PidNamespace => "pid-namespace",
            SandboxLayer::NetworkNamespace => "network-namespace",
            SandboxLayer::IpcNamespace => "ipc-namespace",
            SandboxLayer::UtsNamespace => "uts-namespace",
            SandboxLayer::MountNamespace => "mount-namespace",
            SandboxLayer::RootFilesystem => "root-filesystem",
            SandboxLayer::PrivateTmp => "private-tmp",
            SandboxLayer::EgressProxy => "egress-proxy",
            SandboxLayer::ResourceLimits => "resource-limits",
            SandboxLayer::NoNewPrivileges => "no-new-privileges",
            SandboxLayer::Landlock => "landlock",
            SandboxLayer::Seccomp => "seccomp",
        }
    }

    /// Parses a [`SandboxLayer::name`].
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|layer| layer.name() == name)
    }
}

impl fmt::Display for SandboxLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why the sandbox refused to start a process, or lost it.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// A layer could not be applied: the process was not started.
    #[error("sandbox layer `{layer}` could not be applied: {reason}")]
    Layer {
        /// The layer.
        layer: SandboxLayer,
        /// What the kernel or the setup said.
        reason: String,
    },
    /// Every layer was applied but the program could not be executed.
    #[error("could not execute `{program}` in the sandbox: {reason}")]
    Exec {
        /// The program as given in the profile.
        program: String,
        /// Why.
        reason: String,
    },
    /// The profile is unusable (relative paths, bad allowlist entry...).
    #[error("invalid sandbox profile: {0}")]
    Profile(String),
    /// The helper process failed outside any layer (could not be spawned, died early, broke
    /// the start-up protocol).
    #[error("sandbox helper failed: {0}")]
    Helper(String),
    /// An I/O error on the parent side.
    #[error("sandbox i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The state directory (where each sandbox's root is made) cannot be made or used, such
    /// as one another user made first.
    #[error(
        "cannot use the sandbox state directory `{}` ({error}); give one of your own with `--state-dir` or `WOR_SANDBOX_DIR`",
        path.display()
    )]
    StateDir {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
}
