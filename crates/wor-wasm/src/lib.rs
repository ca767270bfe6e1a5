//! Wasm tools: WebAssembly components (WASI preview 2) implementing the `wor:tool` world
//! (`wit/tool.wit`), run under hard limits.
//!
//! - Every call gets a fresh instance from a pre-instantiated component on a pooling allocator,
//!   so nothing carries over between calls and starting one costs little.
//! - Fuel bounds the instructions a call may execute, an epoch deadline its wall time (also
//!   while the host awaits on its behalf), and a resource limiter its linear memory.
//! - The guest sees no host directory unless one is declared (read-only), no environment
//!   variable but those declared, and no sockets at all.
//! - Outgoing HTTP (wasi-http) is the only network, and every request goes through the egress
//!   guard with the tool's host allowlist; without an allowlist every request is refused.
//!
//! INVARIANT: nothing a component does reaches the network except through [`EgressClient`].

mod host;
mod http;
pub mod metrics;
#[cfg(feature = "testing")]
pub mod testing;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
pub use tokio::sync::Semaphore;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ResourceLimiter, Store,
    Trap,
};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpView};
use wor_egress::{EgressClient, HostAllowlist};

mod bindings {
    wasmtime::component::bindgen!({
        path: "wit/tool.wit",
        world: "tool",
        exports: { default: async },
    });
}

use bindings::ToolPre;
pub use host::{HostedTool, MAX_COMPONENT_BYTES, WasmHost};

/// How often the epoch advances: the resolution of the wall-time deadline.
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Fuel a call may use before it yields to the async runtime (so a busy guest does not hold a
/// thread, and a cancel or timeout gets through).
const FUEL_YIELD_INTERVAL: u64 = 10_000_000;
/// The most linear memory any instance can have; a tool's own limit is at most this.
pub const MAX_MEMORY_BYTES: usize = 256 << 20;
/// The most instances alive at once across all Wasm tools of the process; a call waits for a
/// free one (within its deadline) rather than fail.
pub const POOL_INSTANCES: u32 = 64;

/// What one call may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WasmLimits {
    /// Fuel: roughly, the instructions the call may execute.
    pub fuel: u64,
    /// Bytes of linear memory, all of the instance's memories together (at most
    /// [`MAX_MEMORY_BYTES`]).
    pub memory_bytes: usize,
    /// Wall time of the call, including HTTP requests made on its behalf.
    pub timeout: Duration,
}

impl Default for WasmLimits {
    fn default() -> Self {
        Self {
            fuel: 1_000_000_000,
            memory_bytes: 64 << 20,
            timeout: Duration::from_secs(30),
        }
    }
}

/// What a component may see: declared environment variables, declared read-only directories,
/// and the hosts its HTTP requests may reach.
#[derive(Debug, Clone, Default)]
pub struct WasmGrants {
    /// Environment variables (name, value), and no others.
    pub env: Vec<(String, String)>,
    /// Host directories, each visible read-only at its guest path.
    pub read_only_dirs: Vec<(PathBuf, String)>,
    /// Hosts outgoing HTTP may reach, through the egress guard; `None`: no network at all.
    pub allowlist: Option<HostAllowlist>,
}

impl WasmGrants {
    /// Each declared directory at its real path, seen by the guest under the path declared,
    /// so a link swapped in after this check is not followed.
    pub fn resolve_read_only_dirs(
        declared: &[String],
    ) -> Result<Vec<(PathBuf, String)>, WasmError> {
        declared
            .iter()
            .map(|path| {
                std::fs::canonicalize(path)
                    .map(|real| (real, path.clone()))
                    .map_err(|source| WasmError::Directory {
                        path: path.clone(),
                        source,
                    })
            })
            .collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WasmError {
    #[error("the Wasm runtime cannot be set up: {0}")]
    Setup(String),
    #[error("not a usable Wasm tool component: {0}")]
    Component(String),
    #[error("the Wasm tool cannot start: {0}")]
    Instantiate(String),
    #[error("the Wasm tool ran out of fuel (more than {0} units of work)")]
    OutOfFuel(u64),
    #[error("the Wasm tool passed its deadline of {0:?}")]
    Deadline(Duration),
    #[error("the Wasm tool reached its memory limit of {0} bytes")]
    MemoryLimit(usize),
    #[error("the Wasm tool trapped: {0}")]
    Trap(String),
    #[error("the Wasm tool's tool list is not valid: {0}")]
    ToolList(String),
    #[error("cannot read the component at {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the component at {path} is not a regular file")]
    NotAFile { path: PathBuf },
    #[error("the component at {path} is larger than {limit} bytes")]
    TooLarge { path: PathBuf, limit: u64 },
    /// A declared read-only directory that cannot be resolved to a real path.
    #[error("`{path}` cannot be resolved: {source}")]
    Directory {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The host's state was left half-changed by a panic elsewhere.
    #[error("the Wasm runtime is unusable")]
    Unusable,
}

/// The engine every Wasm tool of the process runs on: one pooling allocator, one epoch
/// ticker. Cheap to clone.
#[derive(Clone)]
pub struct WasmRuntime {
    engine: Engine,
    linker: Arc<Linker<Host>>,
    /// One permit per instance the pool can hold.
    slots: Arc<Semaphore>,
}

impl std::fmt::Debug for WasmRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmRuntime").finish_non_exhaustive()
    }
}

impl WasmRuntime {
    pub fn new() -> Result<Self, WasmError> {
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(POOL_INSTANCES)
            .total_core_instances(POOL_INSTANCES * 8)
            .total_memories(POOL_INSTANCES * 2)
            .total_tables(POOL_INSTANCES * 8)
            .total_stacks(POOL_INSTANCES)
            .max_memory_size(MAX_MEMORY_BYTES)
            // Per component at most what the pool holds per slot on average, so a component
            // that loads always fits in one slot.
            .max_core_instances_per_component(8)
            .max_memories_per_component(2)
            .max_tables_per_component(8);
        let mut config = Config::new();
        config
            .consume_fuel(true)
            .epoch_interruption(true)
            .memory_reservation(u64::try_from(MAX_MEMORY_BYTES).unwrap_or(u64::MAX))
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(|e| WasmError::Setup(e.to_string()))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| WasmError::Setup(e.to_string()))?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker)
            .map_err(|e| WasmError::Setup(e.to_string()))?;
        start_epoch_ticker(&engine)?;
        Ok(Self {
            engine,
            linker: Arc::new(linker),
            slots: Arc::new(Semaphore::new(POOL_INSTANCES as usize)),
        })
    }

    /// Compiles a component and resolves its imports once, so each call only instantiates.
    /// A component importing anything the host does not provide is refused here.
    pub fn load(&self, bytes: &[u8]) -> Result<WasmComponent, WasmError> {
        let loaded = self.compile(bytes);
        if let Err(error) = &loaded {
            metrics::start_failed(error);
        }
        loaded
    }

    fn compile(&self, bytes: &[u8]) -> Result<WasmComponent, WasmError> {
        let component = Component::new(&self.engine, bytes)
            .map_err(|e| WasmError::Component(format!("{e:#}")))?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| WasmError::Component(format!("{e:#}")))?;
        let pre = ToolPre::new(pre).map_err(|e| WasmError::Component(format!("{e:#}")))?;
        Ok(WasmComponent {
            pre,
            slots: self.slots.clone(),
        })
    }

    /// [`WasmRuntime::load`] of a file.
    pub fn load_file(&self, path: &Path) -> Result<WasmComponent, WasmError> {
        let bytes = std::fs::read(path).map_err(|source| {
            let error = WasmError::Read {
                path: path.to_owned(),
                source,
            };
            metrics::start_failed(&error);
            error
        })?;
        self.load(&bytes)
    }
}

/// Advances the engine's epoch every [`EPOCH_TICK`] for as long as the engine lives. Without
/// it no deadline would interrupt a guest, so failing to start it fails the runtime.
fn start_epoch_ticker(engine: &Engine) -> Result<(), WasmError> {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("wor-wasm-epoch".to_owned())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        })
        .map(drop)
        .map_err(|e| WasmError::Setup(format!("the epoch ticker cannot start: {e}")))
}

/// A compiled, pre-instantiated component.
#[derive(Clone)]
pub struct WasmComponent {
    pre: ToolPre<Host>,
    slots: Arc<Semaphore>,
}

impl std::fmt::Debug for WasmComponent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmComponent").finish_non_exhaustive()
    }
}

/// A component with what it may see and use: what a Wasm tool connection runs.
#[derive(Debug, Clone)]
pub struct WasmTool {
    component: WasmComponent,
    grants: Arc<WasmGrants>,
    limits: WasmLimits,
    egress: EgressClient,
    /// The share of instances its owner (a project) may hold at once, if capped.
    share: Option<Arc<Semaphore>>,
}

impl WasmTool {
    pub fn new(
        component: WasmComponent,
        grants: WasmGrants,
        limits: WasmLimits,
        egress: EgressClient,
    ) -> Result<Self, WasmError> {
        if limits.memory_bytes > MAX_MEMORY_BYTES {
            return Err(WasmError::Setup(format!(
                "a memory limit of {} bytes is more than the runtime's {MAX_MEMORY_BYTES}",
                limits.memory_bytes
            )));
        }
        for (host, _) in &grants.read_only_dirs {
            if !host.is_dir() {
                return Err(WasmError::Setup(format!(
                    "declared directory {} does not exist",
                    host.display()
                )));
            }
        }
        Ok(Self {
            component,
            grants: Arc::new(grants),
            limits,
            egress,
            share: None,
        })
    }

    /// Caps the instances this tool's calls hold at once to the permits of `share` (shared by
    /// every tool of one owner), so one owner cannot take the whole pool.
    #[must_use]
    pub fn with_share(mut self, share: Arc<Semaphore>) -> Self {
        self.share = Some(share);
        self
    }

    /// The component's tools: a JSON array of `{name, description, input_schema}`.
    pub async fn list_tools(&self) -> Result<Vec<Value>, WasmError> {
        let text = self
            .invoke(|tool, store| Box::pin(tool.call_list_tools(store)))
            .await?;
        let list: Value =
            serde_json::from_str(&text).map_err(|e| WasmError::ToolList(e.to_string()))?;
        match list {
            Value::Array(tools) => Ok(tools),
            _ => Err(WasmError::ToolList("not a JSON array".to_owned())),
        }
    }

    /// Calls tool `name` with `arguments`: `Ok(Err(text))` is the tool's own error.
    pub async fn call_tool(
        &self,
        name: &str,
        arguments: &Value,
    ) -> Result<Result<String, String>, WasmError> {
        let name = name.to_owned();
        let arguments = arguments.to_string();
        self.invoke(move |tool, store| {
            Box::pin(async move { tool.call_call_tool(store, &name, &arguments).await })
        })
        .await
    }

    /// One call on a fresh instance under the limits.
    async fn invoke<R>(
        &self,
        call: impl for<'a> FnOnce(
            &'a bindings::Tool,
            &'a mut Store<Host>,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = wasmtime::Result<R>> + Send + 'a>,
        >,
    ) -> Result<R, WasmError> {
        let limits = self.limits;
        let deadline = tokio::time::Instant::now() + limits.timeout;
        // The owner's share and a pool slot first, waiting within the call's deadline; both are
        // held until the instance is gone (declared before the store, dropped after it).
        let permits = tokio::time::timeout_at(deadline, async {
            let share = match &self.share {
                Some(share) => Some(share.clone().acquire_owned().await?),
                None => None,
            };
            let slot = self.component.slots.clone().acquire_owned().await?;
            Ok::<_, tokio::sync::AcquireError>((share, slot))
        })
        .await;
        let _permits = match permits {
            Err(_) => return Err(WasmError::Deadline(limits.timeout)),
            Ok(Err(_)) => {
                return Err(WasmError::Setup(
                    "the Wasm runtime is shutting down".to_owned(),
                ));
            }
            Ok(Ok(permits)) => permits,
        };
        let mut store = self.store().inspect_err(metrics::start_failed)?;
        // Whether the failure came while instantiating, before the tool's own code was called.
        let run = async {
            let tool = match self.component.pre.instantiate_async(&mut store).await {
                Ok(tool) => tool,
                Err(error) => return Err((true, error)),
            };
            call(&tool, &mut store)
                .await
                .map_err(|error| (false, error))
        };
        match tokio::time::timeout_at(deadline, run).await {
            Err(_) => Err(WasmError::Deadline(limits.timeout)),
            Ok(Ok(value)) => Ok(value),
            Ok(Err((instantiating, error))) => {
                let error = classify(&error, &store, limits);
                if instantiating {
                    metrics::start_failed(&error);
                }
                Err(error)
            }
        }
    }

    fn store(&self) -> Result<Store<Host>, WasmError> {
        let mut wasi = WasiCtxBuilder::new();
        for (name, value) in &self.grants.env {
            wasi.env(name, value);
        }
        for (host, guest) in &self.grants.read_only_dirs {
            wasi.preopened_dir(host, guest, wasmtime_wasi::FsPerms::ReadOnly)
                .map_err(|e| WasmError::Setup(format!("{}: {e}", host.display())))?;
        }
        wasi.allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        let host = Host {
            wasi: wasi.build(),
            http: WasiHttpCtx::new(),
            hooks: http::EgressHooks::new(self.egress.clone(), self.grants.clone()),
            table: ResourceTable::new(),
            limiter: MemoryLimiter {
                max_bytes: self.limits.memory_bytes,
                used: 0,
                refused: false,
            },
        };
        let mut store = Store::new(self.component.pre.engine(), host);
        store.limiter(|host| &mut host.limiter);
        store
            .set_fuel(self.limits.fuel)
            .map_err(|e| WasmError::Setup(e.to_string()))?;
        store
            .fuel_async_yield_interval(Some(FUEL_YIELD_INTERVAL))
            .map_err(|e| WasmError::Setup(e.to_string()))?;
        let ticks = self.limits.timeout.as_millis() / EPOCH_TICK.as_millis().max(1);
        store.set_epoch_deadline(u64::try_from(ticks).unwrap_or(u64::MAX).max(1));
        store.epoch_deadline_trap();
        Ok(store)
    }
}

/// What a failed call came to, most specific first.
fn classify(error: &wasmtime::Error, store: &Store<Host>, limits: WasmLimits) -> WasmError {
    if store.data().limiter.refused {
        return WasmError::MemoryLimit(limits.memory_bytes);
    }
    match error.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => WasmError::OutOfFuel(limits.fuel),
        Some(Trap::Interrupt) => WasmError::Deadline(limits.timeout),
        Some(trap) => WasmError::Trap(trap.to_string()),
        None => WasmError::Instantiate(format!("{error:#}")),
    }
}

/// Refuses linear memory beyond the tool's limit, counted over every memory of the instance,
/// and remembers that it did.
struct MemoryLimiter {
    max_bytes: usize,
    used: usize,
    refused: bool,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.used.saturating_add(desired.saturating_sub(current));
        if total > self.max_bytes {
            self.refused = true;
            return Ok(false);
        }
        self.used = total;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// What a store holds for one call.
struct Host {
    wasi: WasiCtx,
    http: WasiHttpCtx,
    hooks: http::EgressHooks,
    table: ResourceTable,
    limiter: MemoryLimiter,
}

impl WasiView for Host {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for Host {
    fn http(&mut self) -> wasmtime_wasi_http::WasiHttpCtxView<'_> {
        wasmtime_wasi_http::WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: &mut self.hooks,
        }
    }
}
