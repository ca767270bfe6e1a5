//! The process's Wasm host: one runtime made at first use, components compiled once by the
//! SHA-256 of their file, and each owner's share of the instance pool.
//!
//! A component file is read once, refused unless it is a regular file of at most
//! [`MAX_COMPONENT_BYTES`], and what is hashed is what is compiled, so the digest a tool's pins
//! carry names exactly the code that runs.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::path::Path;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;
use tokio::sync::Semaphore;
use wor_egress::EgressClient;

use crate::{
    POOL_INSTANCES, WasmComponent, WasmError, WasmGrants, WasmLimits, WasmRuntime, WasmTool,
};

/// The largest component file accepted.
pub const MAX_COMPONENT_BYTES: u64 = 64 << 20;
/// Compiled components kept at most; the oldest is dropped beyond this.
const MAX_CACHED_COMPONENTS: usize = 32;
/// Wasm instances one owner may hold at once: a quarter of the pool, so no owner can take it
/// all.
const OWNER_SHARE: usize = POOL_INSTANCES as usize / 4;

/// The runtime, the components compiled on it by digest, and each owner's (a project's) share
/// of the instance pool. Cheap to clone; clones share everything.
pub struct WasmHost<O> {
    state: Arc<Mutex<HostState<O>>>,
}

struct HostState<O> {
    runtime: Option<WasmRuntime>,
    /// By digest, oldest first.
    components: VecDeque<(String, WasmComponent)>,
    shares: HashMap<O, Arc<Semaphore>>,
}

impl<O> Clone for WasmHost<O> {
    fn clone(&self) -> Self {
        Self {
            state: self.state.clone(),
        }
    }
}

impl<O> Default for WasmHost<O> {
    fn default() -> Self {
        Self {
            state: Arc::new(Mutex::new(HostState {
                runtime: None,
                components: VecDeque::new(),
                shares: HashMap::new(),
            })),
        }
    }
}

impl<O> std::fmt::Debug for WasmHost<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmHost").finish_non_exhaustive()
    }
}

/// A component ready to run for one owner, and the SHA-256 (hex) of its file.
#[derive(Debug, Clone)]
pub struct HostedTool {
    pub tool: WasmTool,
    pub digest: String,
}

impl<O: Eq + Hash> WasmHost<O> {
    /// The component at `path` as a tool of `owner`, with `grants` and the default limits: the
    /// file read once, compiled off the async threads unless a file with the same digest was
    /// compiled before, its calls capped by `owner`'s share of the pool.
    pub async fn open(
        &self,
        owner: O,
        path: &Path,
        grants: WasmGrants,
        egress: EgressClient,
    ) -> Result<HostedTool, WasmError> {
        let bytes = read_component(path)
            .await
            .inspect_err(crate::metrics::start_failed)?;
        let digest = hex::encode(Sha256::digest(&bytes));
        let component = self.component(&digest, bytes).await?;
        let tool = WasmTool::new(component, grants, WasmLimits::default(), egress)?
            .with_share(self.share(owner)?);
        Ok(HostedTool { tool, digest })
    }

    /// `owner`'s share of the instance pool, shared by all its Wasm tools.
    fn share(&self, owner: O) -> Result<Arc<Semaphore>, WasmError> {
        let mut state = self.state.lock().map_err(|_| WasmError::Unusable)?;
        Ok(state
            .shares
            .entry(owner)
            .or_insert_with(|| Arc::new(Semaphore::new(OWNER_SHARE)))
            .clone())
    }

    /// The compiled component for `bytes` (whose SHA-256 is `digest`), compiling it off the
    /// async threads when it is new.
    async fn component(&self, digest: &str, bytes: Vec<u8>) -> Result<WasmComponent, WasmError> {
        let runtime = {
            let mut state = self.state.lock().map_err(|_| WasmError::Unusable)?;
            if let Some((_, component)) = state.components.iter().find(|(d, _)| d == digest) {
                return Ok(component.clone());
            }
            match &state.runtime {
                Some(runtime) => runtime.clone(),
                None => {
                    let runtime = WasmRuntime::new()?;
                    state.runtime = Some(runtime.clone());
                    runtime
                }
            }
        };
        let component = tokio::task::spawn_blocking(move || runtime.load(&bytes))
            .await
            .map_err(|e| WasmError::Component(format!("compiling stopped: {e}")))??;
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

/// Reads a component file once, refusing anything but a regular file and more than
/// [`MAX_COMPONENT_BYTES`].
async fn read_component(path: &Path) -> Result<Vec<u8>, WasmError> {
    let read = |source| WasmError::Read {
        path: path.to_owned(),
        source,
    };
    let file = tokio::fs::File::open(path).await.map_err(read)?;
    let metadata = file.metadata().await.map_err(read)?;
    if !metadata.is_file() {
        return Err(WasmError::NotAFile {
            path: path.to_owned(),
        });
    }
    let mut bytes = Vec::new();
    file.take(MAX_COMPONENT_BYTES + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(read)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_COMPONENT_BYTES {
        return Err(WasmError::TooLarge {
            path: path.to_owned(),
            limit: MAX_COMPONENT_BYTES,
        });
    }
    Ok(bytes)
}
