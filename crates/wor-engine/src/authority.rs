//! Run-scoped authority (S14): the credential a run is driven with.
//!
//! When a worker claims a run it mints the run's token, expiring at the run's deadline (what is
//! left of its wall time). The engine holds no member's key: every tool call, nested routine
//! included, is executed only after the token is presented and found live — stored, before its
//! deadline, its run still running under this claim — and the tool is on the run's roster.
//! Parking or ending the run deletes the token in the same statement, so nothing executes for a
//! run that is no longer being driven here, whatever the driving code believes.

use std::collections::BTreeSet;
use std::time::Duration;

use wor_core::RunId;
use wor_core::routine::RoutineDefinition;
use wor_store::{RunRecord, RunToken};

use crate::{Engine, EngineError};

/// The credential of the run being driven, and the roster it may act on.
pub(crate) struct RunAuthority {
    run: RunId,
    token: RunToken,
    roster: BTreeSet<String>,
}

impl Engine {
    /// Mints the credential for a run this worker has just claimed, valid for `remaining` (the
    /// run's wall time left). Fails closed when the worker no longer holds the run.
    pub(crate) async fn mint_authority(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
        remaining: Duration,
    ) -> Result<RunAuthority, EngineError> {
        let remaining_ms = i64::try_from(remaining.as_millis()).unwrap_or(i64::MAX);
        let expires_at = wor_store::now_millis().saturating_add(remaining_ms);
        let token = self
            .store
            .mint_run_token(run.project_id, run.id, &self.config.worker_id, expires_at)
            .await?
            .ok_or_else(|| {
                EngineError::Refused("the run's lease was lost to another worker".to_owned())
            })?;
        Ok(RunAuthority {
            run: run.id,
            token,
            roster: definition.tools.iter().map(|e| e.tool.clone()).collect(),
        })
    }

    /// Whether the run may call `roster_name` now: its credential is live and the tool is on
    /// its roster. `Err` carries the reason the run must stop.
    pub(crate) async fn authorize_call(
        &self,
        authority: &RunAuthority,
        roster_name: &str,
    ) -> Result<Result<(), String>, EngineError> {
        let grant = self
            .store
            .authenticate_run_token(authority.token.expose())
            .await?;
        match grant {
            Some(grant) if grant.run_id == authority.run => {}
            _ => {
                return Ok(Err(
                    "the run's credential is no longer valid (the run passed its deadline, or was parked, ended or taken over); the call did not run"
                        .to_owned(),
                ));
            }
        }
        if !authority.roster.contains(roster_name) {
            return Ok(Err(format!(
                "`{roster_name}` is not on the run's roster; the call did not run"
            )));
        }
        Ok(Ok(()))
    }
}
