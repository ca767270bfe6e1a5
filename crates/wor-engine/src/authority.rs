//! Run-scoped authority (S14): the credential a run is driven with.
//!
//! When a worker claims a run it mints the run's token, expiring at the run's deadline (what is
//! left of its wall time). The engine holds no member's key: every tool call, nested routine
//! included, is answered only after the token is presented and found live — stored, before its
//! deadline, its run still running under this claim — and executed only when the tool is on the
//! run's roster.
//! Parking, ending or claiming the run again deletes the token in the same transaction, so
//! nothing executes for a run that is no longer being driven here, whatever the driving code
//! believes.

use std::collections::BTreeSet;
use std::time::Duration;

use wor_core::RunId;
use wor_core::routine::RoutineDefinition;
use wor_store::{RunRecord, RunToken, RunWritten};

use crate::{Engine, EngineError};

/// The credential of the run being driven, its deadline, and the roster it may act on.
pub(crate) struct RunAuthority {
    run: RunId,
    token: RunToken,
    expires_at: i64,
    roster: BTreeSet<String>,
}

impl RunAuthority {
    /// The credential, to present with the write that reserves a call.
    pub(crate) fn token(&self) -> &RunToken {
        &self.token
    }

    /// Whether the run's deadline has passed.
    pub(crate) fn expired(&self) -> bool {
        wor_store::now_millis() >= self.expires_at
    }

    /// Time left until the run's deadline (zero once it has passed).
    pub(crate) fn remaining(&self) -> Duration {
        let left = self.expires_at.saturating_sub(wor_store::now_millis());
        Duration::from_millis(u64::try_from(left).unwrap_or(0))
    }

    /// Whether `roster_name` (`CONNECTION/TOOL`) is on the run's roster.
    pub(crate) fn allows(&self, roster_name: &str) -> bool {
        self.roster.contains(roster_name)
    }
}

/// Where a run's credential stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    Live,
    /// Its deadline (the run's wall time) has passed.
    Expired,
    /// Deleted or superseded: the run was parked, ended or claimed by another worker.
    Ended,
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
        // A remote worker's credential was minted for its claim and came in the envelope.
        let (token, expires_at) = match self.remote_claim(run.id) {
            Some(claim) => {
                let (token, expires_at) = Engine::claimed_credential(&*claim?);
                (RunToken::presented(token), expires_at)
            }
            None => {
                self.mint_credential(run, &self.config.worker_id, remaining)
                    .await?
            }
        };
        Ok(RunAuthority {
            run: run.id,
            token,
            expires_at,
            roster: definition.tools.iter().map(|e| e.tool.clone()).collect(),
        })
    }

    /// Mints a credential for `run`, held by `holder` (this process, or a remote worker the
    /// run was just claimed for), valid for `remaining`; returns it and its expiry (Unix
    /// milliseconds). A journal write: fenced by the lease, so a holder that lost the run gets
    /// nothing, and committed with the other runs' writes, not on a transaction of its own.
    pub(crate) async fn mint_credential(
        &self,
        run: &RunRecord,
        holder: &str,
        remaining: Duration,
    ) -> Result<(RunToken, i64), EngineError> {
        let remaining_ms = i64::try_from(remaining.as_millis()).unwrap_or(i64::MAX);
        let expires_at = wor_store::now_millis().saturating_add(remaining_ms);
        let token = RunToken::generate()?;
        match self
            .audit
            .record(self.journal_for(run, holder).minting(&token, expires_at))
            .await?
        {
            RunWritten::Committed { .. } => Ok((token, expires_at)),
            RunWritten::LeaseLost => Err(EngineError::LeaseLost),
            RunWritten::CredentialEnded | RunWritten::CancelRequested => {
                Err(EngineError::InvalidState(
                    "a write made whatever the credential and the cancel was refused for one"
                        .to_owned(),
                ))
            }
        }
    }

    /// Presents the run's credential: live, past its deadline, or ended.
    pub(crate) async fn credential_standing(
        &self,
        authority: &RunAuthority,
    ) -> Result<Standing, EngineError> {
        if authority.expired() {
            return Ok(Standing::Expired);
        }
        // A remote worker cannot read the credential's row: the control plane checks it in
        // every write it takes, the one that reserves a call included.
        if self.is_remote() {
            return Ok(Standing::Live);
        }
        let grant = self
            .store
            .authenticate_run_token(authority.token.expose())
            .await?;
        Ok(match grant {
            Some(grant) if grant.run_id == authority.run => Standing::Live,
            _ => Standing::Ended,
        })
    }
}

/// The wall time `run` spent running before this claim, in seconds: from its first start,
/// less the time it was parked for a person.
pub(crate) fn wall_spent_before(run: &RunRecord) -> u64 {
    run.started_at
        .map(|s| {
            let spent = wor_store::now_millis()
                .saturating_sub(s)
                .saturating_sub(run.parked_ms);
            u64::try_from(spent / 1000).unwrap_or(0)
        })
        .unwrap_or(0)
}
