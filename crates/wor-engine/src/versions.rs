//! Routine versions as the engine reads them. A version never changes once written, so each
//! is read and parsed once and then kept, up to a bound: starting, scheduling and resuming
//! runs of the same routine do not parse its TOML again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use wor_core::{ProjectId, RoutineId};
use wor_store::RoutineVersionRecord;

use crate::{Engine, EngineError};

/// At most this many versions are kept; past it the cache starts again empty.
const MAX_CACHED_VERSIONS: usize = 16_384;

type Key = (ProjectId, RoutineId, i64);

/// The versions read so far.
#[derive(Debug, Default)]
pub(crate) struct VersionCache {
    entries: Mutex<HashMap<Key, Arc<RoutineVersionRecord>>>,
}

impl VersionCache {
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
