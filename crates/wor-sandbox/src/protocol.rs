//! The start-up protocol between the parent and the helper, over a `SOCK_SEQPACKET` pair the
//! helper finds at fd 3. One JSON message per packet:
//!
//! 1. parent → helper: [`Request`] (profile and the per-operation root directory);
//! 2. sandbox init → parent: [`Report::Listener`] with the proxy listener as `SCM_RIGHTS`
//!    (network access only);
//! 3. helper → parent: [`Report::Running`] once `execve` succeeded, or [`Report::Failed`].
//!
//! After that the socket is the lifeline: when the parent closes its end (drop, exit, crash)
//! the helper kills the sandbox.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::layer::SandboxLayer;
use crate::profile::SandboxProfile;

/// The fd the helper finds the protocol socket at.
pub(crate) const CONTROL_FD: i32 = 3;
/// The argument that makes a binary act as the helper.
pub const HELPER_ARG: &str = "__wor-sandbox-helper";
/// Largest message.
pub(crate) const MAX_MESSAGE: usize = 1 << 20;

/// What the parent asks of the helper.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Request {
    pub profile: SandboxProfile,
    /// The per-operation host directory the tmpfs root is mounted on.
    pub root: PathBuf,
}

/// What the helper tells the parent.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Report {
    /// The fd in this packet's `SCM_RIGHTS` is the proxy listener.
    Listener,
    /// The tool is running.
    Running,
    /// Start-up failed; `layer` is `None` for an `execve` failure.
    Failed {
        layer: Option<SandboxLayer>,
        reason: String,
    },
}
