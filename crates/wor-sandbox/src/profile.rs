//! What one sandboxed process gets: [`SandboxProfile`], the binds of its read-only view, its
//! resource limits and its network access. A profile is data: the parent sends it to the
//! helper, which applies it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::layer::SandboxLayer;

/// Port the egress proxy listens on inside the sandbox's own network namespace.
pub const PROXY_PORT: u16 = 3128;

/// A read-only bind of a host path into the sandbox's view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bind {
    /// The host path (file or directory).
    pub source: PathBuf,
    /// Where it appears inside the sandbox (absolute).
    pub target: PathBuf,
}

impl Bind {
    /// `path` at the same place inside.
    pub fn same(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        Self {
            source: path.clone(),
            target: path,
        }
    }
}

/// Limits set with `setrlimit` before the tool starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceLimits {
    /// Address space (`RLIMIT_AS`), bytes.
    pub address_space_bytes: u64,
    /// CPU time (`RLIMIT_CPU`), seconds.
    pub cpu_seconds: u64,
    /// Open files (`RLIMIT_NOFILE`).
    pub open_files: u64,
    /// Processes and threads of the sandbox's user (`RLIMIT_NPROC`, counted per user namespace).
    pub processes: u64,
    /// Largest file the tool may write (`RLIMIT_FSIZE`), bytes.
    pub file_size_bytes: u64,
}

impl Default for ResourceLimits {
    fn default() -> Self {
        Self {
            // Generous: V8 (node) reserves several GiB of address space up front.
            address_space_bytes: 8 << 30,
            cpu_seconds: 300,
            open_files: 256,
            processes: 128,
            file_size_bytes: 64 << 20,
        }
    }
}

/// The network a sandboxed process may use.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetworkAccess {
    /// Its own empty network namespace; not even loopback is up.
    #[default]
    None,
    /// Only HTTP `CONNECT` through the parent's egress proxy, to these allowlist entries
    /// (`HostPattern` syntax); `HTTPS_PROXY`/`HTTP_PROXY` point at it.
    Proxy(Vec<String>),
}

/// Everything one sandboxed process gets. Nothing else from the host is visible to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxProfile {
    /// Absolute path of the executable, as seen inside the sandbox.
    pub program: PathBuf,
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// The whole environment of the process (names and values); nothing is inherited.
    pub env: Vec<(String, String)>,
    /// Read-only binds; the executable and its runtime must be among them.
    pub binds: Vec<Bind>,
    /// Size of the private `/tmp` (tmpfs, `noexec,nosuid,nodev`), bytes.
    pub tmp_size_bytes: u64,
    /// `setrlimit` limits.
    pub limits: ResourceLimits,
    /// Network access.
    pub network: NetworkAccess,
    /// Test switch: behave as if this layer were unavailable on the host. It can only make
    /// start-up fail, never weaken a layer.
    pub simulate_unavailable: Option<SandboxLayer>,
    /// Used by [`crate::doctor`]: stop successfully right after applying this layer.
    #[serde(default)]
    pub(crate) probe_until: Option<SandboxLayer>,
}

impl SandboxProfile {
    /// A profile running `program` with the host's system runtime bound read-only
    /// ([`system_runtime_binds`]), plus the program itself when it lives elsewhere.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        let program = program.into();
        let mut binds = system_runtime_binds();
        if !binds.iter().any(|b| program.starts_with(&b.target)) {
            binds.push(Bind::same(program.clone()));
        }
        Self {
            program,
            args: Vec::new(),
            env: Vec::new(),
            binds,
            tmp_size_bytes: 64 << 20,
            limits: ResourceLimits::default(),
            network: NetworkAccess::None,
            simulate_unavailable: None,
            probe_until: None,
        }
    }

    /// Adds arguments.
    pub fn args<S: Into<String>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Declares one environment variable.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Adds a read-only bind.
    pub fn bind(mut self, bind: Bind) -> Self {
        self.binds.push(bind);
        self
    }

    /// Sets the network access.
    pub fn network(mut self, network: NetworkAccess) -> Self {
        self.network = network;
        self
    }
}

/// The host's shared runtime: `/usr` and, where they are real directories, `/bin`, `/sbin`,
/// `/lib`, `/lib32`, `/lib64` (merged-`/usr` symlinks are recreated as symlinks), and
/// `/etc/ld.so.cache` for the dynamic linker. Paths that do not exist are left out.
pub fn system_runtime_binds() -> Vec<Bind> {
    let mut binds = vec![Bind::same("/usr")];
    for dir in ["/bin", "/sbin", "/lib", "/lib32", "/lib64"] {
        let path = Path::new(dir);
        if path.symlink_metadata().is_ok() {
            binds.push(Bind::same(dir));
        }
    }
    if Path::new("/etc/ld.so.cache").exists() {
        binds.push(Bind::same("/etc/ld.so.cache"));
    }
    binds
}

/// `name` looked up on `PATH` the way a shell would (absolute and relative paths as given).
pub fn resolve_program(name: &str, path_var: Option<&str>) -> Option<PathBuf> {
    if name.contains('/') {
        return std::fs::canonicalize(name).ok();
    }
    path_var
        .unwrap_or("/usr/local/bin:/usr/bin:/bin")
        .split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(name))
        .find(|candidate| candidate.is_file())
        .and_then(|found| std::fs::canonicalize(found).ok())
}
