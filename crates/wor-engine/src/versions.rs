//! Routine versions as the engine reads them, and the policies built from them. A version
//! never changes once written, so each is read and parsed once and then kept, up to a bound:
//! starting, scheduling and resuming runs of the same routine do not parse its TOML again.
//! The policy a run is decided by is built from its version and the project's policy text,
//! so it is kept under both (a changed project policy is another key) and its Cedar text is
//! not parsed and validated again for every run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use wor_core::canonical::sha256_hex;
use wor_core::{ProjectId, RoutineId};
use wor_policy::PolicyEngine;
use wor_store::{RoutineVersionRecord, RunRecord};

use crate::{Engine, EngineError};

/// At most this many versions are kept; past it the cache starts again empty.
const MAX_CACHED_VERSIONS: usize = 16_384;
/// At most this many built policies are kept; past it the cache starts again empty.
const MAX_CACHED_POLICIES: usize = 1_024;

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

/// The versions read and the policies built so far.
#[derive(Debug, Default)]
pub(crate) struct VersionCache {
    entries: Mutex<HashMap<Key, Arc<RoutineVersionRecord>>>,
    policies: Mutex<HashMap<PolicyKey, Arc<PolicyEngine>>>,
}

impl VersionCache {
    pub(crate) fn policy(&self, key: &PolicyKey) -> Option<Arc<PolicyEngine>> {
        self.policies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    pub(crate) fn keep_policy(&self, key: PolicyKey, policy: Arc<PolicyEngine>) {
        let mut policies = self
            .policies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if policies.len() >= MAX_CACHED_POLICIES {
            policies.clear();
        }
        policies.insert(key, policy);
    }

    fn get(&self, key: &Key) -> Option<Arc<RoutineVersionRecord>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    fn keep(&self, key: Key, version: Arc<RoutineVersionRecord>) {
        let mut entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if entries.len() >= MAX_CACHED_VERSIONS {
            entries.clear();
        }
        entries.insert(key, version);
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
            match self.versions.get(key) {
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
                    self.versions.keep(key, version.clone());
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
        if let Some(found) = self.versions.get(&key) {
            return Ok(found);
        }
        let read = Arc::new(
            self.store
                .get_routine_version(project, routine, version)
                .await?,
        );
        self.versions.keep(key, read.clone());
        Ok(read)
    }
}
