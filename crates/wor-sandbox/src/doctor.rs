//! `wor doctor`: which layers this host supports, found by applying each one for real.
//!
//! Each probe runs the real start-up path with a profile that stops right after the layer in
//! question, so a layer is reported supported only if the sandbox could actually apply it (and
//! every layer before it) here.

use std::time::Duration;

use crate::launch::{Sandbox, SandboxExit, SandboxStdio};
use crate::layer::{SandboxError, SandboxLayer};
use crate::profile::{NetworkAccess, SandboxProfile};

/// One line of the doctor's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerReport {
    /// The layer.
    pub layer: SandboxLayer,
    /// Whether it could be applied on this host.
    pub supported: bool,
    /// Why not, or what was checked.
    pub detail: String,
}

/// Probes every layer in order.
pub async fn doctor(sandbox: &Sandbox) -> Vec<LayerReport> {
    let mut reports = Vec::new();
    for layer in SandboxLayer::ALL {
        let mut profile = SandboxProfile::new("/usr/nonexistent-probe");
        profile.probe_until = Some(layer);
        if layer == SandboxLayer::EgressProxy {
            profile.network = NetworkAccess::Proxy(Vec::new());
        }
        let result = match sandbox.spawn(&profile, SandboxStdio::Null).await {
            Ok(mut process) => process.wait_timeout(Duration::from_secs(10)).await,
            Err(error) => Err(error),
        };
        let (supported, detail) = match result {
            Ok(SandboxExit::Code(0)) => (true, "applied".to_owned()),
            Ok(other) => (false, format!("probe ended with {other:?}")),
            Err(SandboxError::Layer {
                layer: failed,
                reason,
            }) if failed == layer => (false, reason),
            Err(SandboxError::Layer { layer: failed, .. }) => {
                (false, format!("needs `{failed}`, which is unavailable"))
            }
            Err(other) => (false, other.to_string()),
        };
        reports.push(LayerReport {
            layer,
            supported,
            detail,
        });
    }
    reports
}
