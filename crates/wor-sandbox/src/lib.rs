//! The mandatory Linux sandbox of Work on Repeat: every local process (stdio MCP servers,
//! command tools) runs here, and nowhere else.
//!
//! A sandboxed process gets its own user (outer uid mapped to 1000), pid, network, IPC, UTS
//! and mount namespaces; a tmpfs root holding only explicit read-only binds, `pivot_root`ed
//! into and remounted read-only; a private size-limited `noexec,nosuid,nodev` `/tmp`;
//! resource limits; no-new-privileges; Landlock (read-only binds, writable `/tmp` only, TCP
//! only to the egress proxy, signals scoped); a seccomp deny list; a cleared environment
//! holding only what its [`SandboxProfile`] declares; and network only through the parent's
//! egress proxy ([`wor_egress::connect_proxy`]) with the profile's allowlist.
//!
//! It must never fall back to weaker isolation: if a layer cannot be applied the process does
//! not start and the error names the [`SandboxLayer`].
//!
//! Code map: [`profile`] is what a process gets; [`layer`] names the layers and errors;
//! [`launch`] is the parent side ([`Sandbox`], [`SandboxedProcess`]); [`helper`] is the child
//! side, run in a re-exec'd helper process; `seccomp` builds the filter; [`doctor`] probes
//! the host.
//!
//! Architecture invariant: `unsafe` appears only in [`helper`] (taking fd 3, `fork`,
//! `unshare`) and in [`launch`]'s `pre_exec`, which makes only async-signal-safe calls.

pub mod doctor;
pub mod helper;
pub mod launch;
pub mod layer;
pub mod metrics;
pub mod profile;
mod protocol;
mod seccomp;

pub use doctor::{LayerReport, doctor};
pub use helper::{INSIDE_ID, main_if_helper};
pub use launch::{
    ROOT_PREFIX, Sandbox, SandboxConfig, SandboxExit, SandboxOutput, SandboxStdio, SandboxedProcess,
};
pub use layer::{SandboxError, SandboxLayer};
pub use profile::{
    Bind, NetworkAccess, PROXY_PORT, ResourceLimits, SandboxProfile, resolve_program,
    system_runtime_binds,
};
pub use protocol::HELPER_ARG;
