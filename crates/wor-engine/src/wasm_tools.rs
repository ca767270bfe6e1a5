//! Wasm tool connections: a component file run by `wor-wasm`'s host, its tools pinned like any
//! other.
//!
//! The component's SHA-256 is part of every tool definition it lists (as the annotation
//! `component_sha256`), so replacing the file changes every pin and quarantines the connection
//! at the next run start, exactly as a changed MCP tool does. Loading, the cache of compiled
//! components and each project's share of the instance pool are [`wor_wasm::WasmHost`]'s; this
//! module only turns a stored connection into what the host opens.

use std::path::Path;

use wor_store::ToolConnectionRecord;
use wor_tools::ToolSession;
use wor_wasm::WasmGrants;

use crate::Engine;
use crate::tool_connections::ConnectionError;

impl Engine {
    /// Loads a `wasm` connection's component (its path checked against the operator's allowed
    /// roots like a stdio program), with its declared environment (values opened from the vault
    /// now), read-only directories, and HTTP only to its allowlist through the egress guard.
    pub(crate) async fn open_wasm_session(
        &self,
        record: &ToolConnectionRecord,
        allowlist: Option<wor_egress::HostAllowlist>,
    ) -> Result<ToolSession, ConnectionError> {
        let (spec, env) = self.local_command(record).await?;
        let wasm = |source| ConnectionError::Wasm {
            connection: record.name.clone(),
            source,
        };
        // WASI takes plain strings: the values live in the call's store only.
        let env = env
            .into_iter()
            .map(|(variable, value)| {
                (
                    variable,
                    secrecy::ExposeSecret::expose_secret(&value).to_owned(),
                )
            })
            .collect();
        let grants = WasmGrants {
            env,
            read_only_dirs: WasmGrants::resolve_read_only_dirs(&spec.read_only_paths)
                .map_err(wasm)?,
            allowlist,
        };
        let hosted = self
            .wasm
            .open(
                record.project_id,
                Path::new(&spec.program),
                grants,
                self.egress.clone(),
            )
            .await
            .map_err(wasm)?;
        Ok(ToolSession::Wasm {
            tool: Box::new(hosted.tool),
            digest: hosted.digest,
        })
    }
}
