//! Wasm tool connections: a component file run by `wor-wasm`, its tools pinned like any other.
//!
//! The component's SHA-256 is part of every tool definition it lists (as the annotation
//! `component_sha256`), so replacing the file changes every pin and quarantines the connection
//! at the next run start, exactly as a changed MCP tool does. Compiled components are kept by
//! digest: a run start compiles only a file it has not seen.

use std::collections::{HashMap, VecDeque};

use std::sync::{Arc, Mutex};
use tokio::io::AsyncReadExt;

use wor_core::ProjectId;
use wor_store::ToolConnectionRecord;
use wor_tools::ToolSession;
use wor_wasm::{Semaphore, WasmComponent, WasmGrants, WasmLimits, WasmRuntime, WasmTool};

use crate::Engine;

/// The largest component file accepted.
const MAX_COMPONENT_BYTES: u64 = 64 << 20;
/// Compiled components kept at most; the oldest is dropped beyond this.
const MAX_CACHED_COMPONENTS: usize = 32;
/// Wasm instances one project may hold at once: a quarter of the pool, so no project can take
/// it all.
const PROJECT_SHARE: usize = wor_wasm::POOL_INSTANCES as usize / 4;

/// The process's Wasm runtime, made at first use, and the components compiled on it by digest.
#[derive(Clone, Default)]
pub(crate) struct WasmHost {
    state: Arc<Mutex<WasmHostState>>,
}

#[derive(Default)]
struct WasmHostState {
    runtime: Option<WasmRuntime>,
    /// By digest, oldest first.
    components: VecDeque<(String, WasmComponent)>,
    /// Each project's share of the instance pool.
    shares: HashMap<ProjectId, Arc<Semaphore>>,
}

impl std::fmt::Debug for WasmHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmHost").finish_non_exhaustive()
    }
}

impl WasmHost {
    /// `project`'s share of the instance pool, shared by all its Wasm tools.
    fn share(&self, project: ProjectId) -> Result<Arc<Semaphore>, String> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| "the Wasm runtime is unusable".to_owned())?;
        Ok(state
            .shares
            .entry(project)
            .or_insert_with(|| Arc::new(Semaphore::new(PROJECT_SHARE)))
            .clone())
    }

    /// The compiled component for `bytes` (whose SHA-256 is `digest`), compiling it off the
    /// async threads when it is new.
    async fn component(&self, digest: &str, bytes: Vec<u8>) -> Result<WasmComponent, String> {
        let runtime = {
            let mut state = self
                .state
                .lock()
                .map_err(|_| "the Wasm runtime is unusable".to_owned())?;
            if let Some((_, component)) = state.components.iter().find(|(d, _)| d == digest) {
                return Ok(component.clone());
            }
            match &state.runtime {
                Some(runtime) => runtime.clone(),
                None => {
                    let runtime = WasmRuntime::new().map_err(|e| e.to_string())?;
                    state.runtime = Some(runtime.clone());
                    runtime
                }
            }
        };
        let component = tokio::task::spawn_blocking(move || runtime.load(&bytes))
            .await
            .map_err(|e| format!("compiling the component failed: {e}"))?
            .map_err(|e| e.to_string())?;
        if let Ok(mut state) = self.state.lock() {
            if state.components.len() >= MAX_CACHED_COMPONENTS {
                state.components.pop_front();
            }
            state
                .components
                .push_back((digest.to_owned(), component.clone()));
        }
        Ok(component)
    }
}

impl Engine {
    /// Loads a `wasm` connection's component (its path checked against the operator's allowed
    /// roots like a stdio program), with its declared environment (values opened from the vault
    /// now), read-only directories, and HTTP only to its allowlist through the egress guard.
    pub(crate) async fn open_wasm_session(
        &self,
        record: &ToolConnectionRecord,
        allowlist: Option<wor_egress::HostAllowlist>,
    ) -> Result<ToolSession, String> {
        let name = &record.name;
        let (spec, env) = self.local_command(record).await?;
        let bytes = read_component(&spec.program)
            .await
            .map_err(|e| format!("tool connection `{name}`: {e}"))?;
        let digest = wor_core::canonical::sha256_hex(&bytes);
        let component = self
            .wasm
            .component(&digest, bytes)
            .await
            .map_err(|e| format!("tool connection `{name}`: {e}"))?;
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
            // The resolved paths, as checked above, so a link swapped in later is not followed.
            read_only_dirs: spec
                .read_only_paths
                .iter()
                .map(|path| {
                    std::fs::canonicalize(path)
                        .map(|real| (real, path.clone()))
                        .map_err(|e| {
                            format!("tool connection `{name}`: `{path}` cannot be resolved: {e}")
                        })
                })
                .collect::<Result<_, _>>()?,
            allowlist,
        };
        let tool = WasmTool::new(
            component,
            grants,
            WasmLimits::default(),
            self.egress.clone(),
        )
        .map_err(|e| format!("tool connection `{name}`: {e}"))?
        .with_share(self.wasm.share(record.project_id)?);
        Ok(ToolSession::Wasm {
            tool: Box::new(tool),
            digest,
        })
    }
}

/// Reads a component file once, refusing anything but a regular file and more than
/// [`MAX_COMPONENT_BYTES`]; what is hashed is what is compiled.
async fn read_component(path: &str) -> Result<Vec<u8>, String> {
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| format!("its component cannot be read: {e}"))?;
    let metadata = file
        .metadata()
        .await
        .map_err(|e| format!("its component cannot be read: {e}"))?;
    if !metadata.is_file() {
        return Err("its component is not a regular file".to_owned());
    }
    let mut bytes = Vec::new();
    file.take(MAX_COMPONENT_BYTES + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| format!("its component cannot be read: {e}"))?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_COMPONENT_BYTES {
        return Err(format!(
            "its component is larger than {MAX_COMPONENT_BYTES} bytes"
        ));
    }
    Ok(bytes)
}
