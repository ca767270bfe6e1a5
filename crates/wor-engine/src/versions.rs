//! Routine versions as the engine reads them, and the policies and schedules built from them.
//! A version never changes once written, so each is read and parsed once and then kept, up
//! to a bound: starting, scheduling and resuming runs of the same routine do not parse its
//! TOML again, and a scheduler pass does not compile its cron expression and time zone again.
//! The policy a run is decided by is built from its version and the project's policy text,
//! so it is kept under both (a changed project policy is another key) and its Cedar text is
//! not parsed and validated again for every run.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use wor_core::canonical::sha256_hex;
use wor_core::schedule::{Schedule, ScheduleError};
use wor_core::{ProjectId, RoutineId};
use wor_policy::PolicyEngine;
use wor_store::{RoutineVersionRecord, RunRecord};

use crate::{Engine, EngineError};

/// At most this many versions are kept; past it the cache starts again empty.
const MAX_CACHED_VERSIONS: usize = 16_384;
/// At most this many built policies are kept; past it the cache starts again empty.
const MAX_CACHED_POLICIES: usize = 1_024;
/// At most this many compiled schedules are kept; past it the cache starts again empty.
const MAX_CACHED_SCHEDULES: usize = 16_384;

pub(crate) type Key = (ProjectId, RoutineId, i64);

/// What a run's policy is built from: its routine version and the project's policy text
/// (`None`: the built-in default), by digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PolicyKey {
    version: Key,
    project_policy: Option<String>,
}

impl PolicyKey {
    pub(crate) fn new(run: &RunRecord, project_policy: Option<&str>) -> Self {
        PolicyKey {
            version: (run.project_id, run.routine_id, run.routine_version),
            project_policy: project_policy.map(|text| sha256_hex(text.as_bytes())),
        }
    }
}

/// Values kept under their keys, up to `max` of them: past it the map starts again empty
/// (what it holds is rebuilt on demand, so forgetting it costs only the rebuilding).
#[derive(Debug)]
struct Bounded<K, V> {
    map: Mutex<HashMap<K, Arc<V>>>,
    max: usize,
}

impl<K: Eq + Hash, V> Bounded<K, V> {
    fn new(max: usize) -> Self {
        Bounded {
            map: Mutex::new(HashMap::new()),
            max,
        }
    }

    fn get(&self, key: &K) -> Option<Arc<V>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    fn keep(&self, key: K, value: Arc<V>) {
        let mut map = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.len() >= self.max {
            map.clear();
        }
        map.insert(key, value);
    }
}

/// The versions read, and the policies and schedules built, so far.
#[derive(Debug)]
pub(crate) struct VersionCache {
    entries: Bounded<Key, RoutineVersionRecord>,
    policies: Bounded<PolicyKey, PolicyEngine>,
    schedules: Bounded<Key, Schedule>,
}

impl Default for VersionCache {
    fn default() -> Self {
        VersionCache {
            entries: Bounded::new(MAX_CACHED_VERSIONS),
            policies: Bounded::new(MAX_CACHED_POLICIES),
            schedules: Bounded::new(MAX_CACHED_SCHEDULES),
        }
    }
}

impl VersionCache {
    pub(crate) fn policy(&self, key: &PolicyKey) -> Option<Arc<PolicyEngine>> {
        self.policies.get(key)
    }

    pub(crate) fn keep_policy(&self, key: PolicyKey, policy: Arc<PolicyEngine>) {
        self.policies.keep(key, policy);
    }

    /// The compiled `[schedule]` of version `key`, `version`; `None` when it has none. A
    /// schedule that does not compile is not kept: the scheduler stops it when it is refused.
    pub(crate) fn schedule(
        &self,
        key: Key,
        version: &RoutineVersionRecord,
    ) -> Option<Result<Arc<Schedule>, ScheduleError>> {
        let section = version.definition.schedule.as_ref()?;
        if let Some(compiled) = self.schedules.get(&key) {
            return Some(Ok(compiled));
        }
        Some(section.compile().map(|compiled| {
            let compiled = Arc::new(compiled);
            self.schedules.keep(key, compiled.clone());
            compiled
        }))
    }
}

impl Engine {
    /// The versions named by `wanted`, from the cache or read together: what a scheduler page
    /// needs, in one statement per 200 rather than one each. A version missing from the
    /// answer is read again alone by [`Engine::routine_version`], which reports why; so is
    /// every version of a page whose batch read fails (one stored routine that no longer
    /// parses, say), so one bad routine never holds up the others.
    pub(crate) async fn routine_versions(
        &self,
        wanted: &[Key],
    ) -> HashMap<Key, Arc<RoutineVersionRecord>> {
        let mut found = HashMap::with_capacity(wanted.len());
        let mut missing = Vec::new();
        for key in wanted {
            match self.versions.entries.get(key) {
                Some(version) => {
                    found.insert(*key, version);
                }
                None => missing.push(*key),
            }
        }
        if missing.is_empty() {
            return found;
        }
        match self.store.get_routine_versions(&missing).await {
            Ok(read) => {
                for (project, version) in read {
                    let key = (project, version.routine_id, version.version);
                    let version = Arc::new(version);
                    self.versions.entries.keep(key, version.clone());
                    found.insert(key, version);
                }
            }
            Err(error) => {
                tracing::warn!(category = "schedule", error = %error, versions = missing.len(),
                    "routine versions could not be read together; each is read alone");
            }
        }
        found
    }

    /// Version `version` of a routine of `project`.
    pub(crate) async fn routine_version(
        &self,
        project: ProjectId,
        routine: RoutineId,
        version: i64,
    ) -> Result<Arc<RoutineVersionRecord>, EngineError> {
        let key = (project, routine, version);
        if let Some(found) = self.versions.entries.get(&key) {
            return Ok(found);
        }
        // A remote worker reads the version of the run it drives from its claim.
        if self.remote.is_some() {
            return crate::remote::RemoteRuns::version(routine, version)
                .ok_or(EngineError::LeaseLost);
        }
        let read = Arc::new(
            self.store
                .get_routine_version(project, routine, version)
                .await?,
        );
        self.versions.entries.keep(key, read.clone());
        Ok(read)
    }
}
