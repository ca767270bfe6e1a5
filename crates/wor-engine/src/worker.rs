//! Workers: a pool that claims queued runs and drives up to `workers` of them at once; put
//! back runs whose worker died; expire approvals nobody decided.
//!
//! One dispatcher claims and hands each claimed run to a driver task of its own, while a slot
//! is free. The limits are not counted here: every claim checks the routine's
//! `max_concurrent` and the project's running limit as it is written (`wor-store`), so they
//! hold across slots and processes alike. An idle pool asks the database for work once per
//! poll interval, whatever its size; it is woken sooner when this process queues a run or a
//! driver ends one, and on PostgreSQL when any process queues one (LISTEN/NOTIFY). The sweeps (expired leases, expired approvals) run once per process.

use std::sync::Arc;

use tokio::sync::{Semaphore, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::{Engine, EngineError};

/// How long the queued-run listener waits before reconnecting after an error.
const LISTEN_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// How often the process looks for approvals whose time ran out.
const APPROVAL_SWEEP: std::time::Duration = std::time::Duration::from_secs(1);

impl Engine {
    /// Puts runs whose worker stopped renewing its lease back in the queue. Returns how many.
    pub async fn requeue_expired(&self) -> Result<u64, EngineError> {
        Ok(self.store.requeue_expired_runs().await?)
    }

    /// Claims one queued run and drives it to its end. Returns whether there was one.
    pub async fn run_next(&self) -> Result<bool, EngineError> {
        match self.claim_next().await? {
            Some(run) => {
                self.drive(run).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Starts the sweeps alone (runs of dead workers put back, expired approvals decided as
    /// denied) until `shutdown`: for a process that drives no runs itself, such as
    /// `wor serve --role scheduler`. [`Engine::spawn_workers`] runs them with its pool.
    pub fn spawn_sweeps(&self, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        tokio::spawn(self.clone().sweep(shutdown))
    }

    /// Claims the oldest queued run the limits allow, leased to this process.
    async fn claim_next(&self) -> Result<Option<wor_store::RunRecord>, EngineError> {
        self.claim_for(&self.config.worker_id).await
    }

    /// Claims the oldest queued run the limits allow, leased to `holder`.
    pub(crate) async fn claim_for(
        &self,
        holder: &str,
    ) -> Result<Option<wor_store::RunRecord>, EngineError> {
        let began = wor_store::now_millis();
        let claimed = self
            .store
            .claim_run(holder, self.lease_ms(), self.config.max_running_per_project)
            .await?;
        if let Some(run) = &claimed {
            crate::metrics::run_claimed(run, began);
        }
        Ok(claimed)
    }

    /// Tells an idle pool of this process that there may be work: a run was queued or a
    /// running one ended (freeing a place under the limits).
    pub(crate) fn wake_workers(&self) {
        self.work.notify_one();
    }

    /// Starts the worker pool: up to `workers` runs driven at once (at least one), until
    /// `shutdown` turns true; then the runs in flight are stopped where they are (their
    /// steps say where to resume) and the returned task ends. The caller gives their leases
    /// back.
    pub fn spawn_workers(&self, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            let sweeps = tokio::spawn(engine.clone().sweep(shutdown.clone()));
            let listener = tokio::spawn(engine.clone().listen(shutdown.clone()));
            engine.dispatch(shutdown).await;
            let _ = sweeps.await;
            let _ = listener.await;
        })
    }

    /// Claims runs while a slot is free and drives each on a task of its own.
    async fn dispatch(&self, mut shutdown: watch::Receiver<bool>) {
        let slots = Arc::new(Semaphore::new(self.config.workers.max(1)));
        let mut drivers = JoinSet::new();
        loop {
            while let Some(ended) = drivers.try_join_next() {
                if let Err(error) = ended
                    && error.is_panic()
                {
                    tracing::error!(
                        category = "run",
                        "a run's driver panicked; its lease will expire and the run is resumed"
                    );
                }
            }
            if *shutdown.borrow() {
                break;
            }
            let slot = tokio::select! {
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
                _ = shutdown.changed() => break,
            };
            match self.claim_next().await {
                Ok(Some(run)) => {
                    let engine = self.clone();
                    drivers.spawn(async move {
                        if let Err(error) = engine.drive(run).await {
                            tracing::error!(category = "run", error = %error, "worker step failed");
                        }
                        drop(slot);
                        engine.wake_workers();
                    });
                    continue;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::error!(category = "run", error = %error, "claiming a run failed");
                }
            }
            drop(slot);
            tokio::select! {
                () = tokio::time::sleep(self.config.poll_interval) => {}
                () = self.work.notified() => {}
                _ = shutdown.changed() => break,
            }
        }
        drivers.abort_all();
        while drivers.join_next().await.is_some() {}
    }

    /// On PostgreSQL, wakes the pool whenever any process queues a run (LISTEN/NOTIFY), so
    /// that a run queued by another replica starts at once rather than at the next poll.
    /// Without a listener (SQLite, or the connection failing) the poll is the fallback.
    async fn listen(self, mut shutdown: watch::Receiver<bool>) {
        let mut listener = match self.store.work_listener().await {
            Ok(Some(listener)) => listener,
            Ok(None) => return,
            Err(error) => {
                tracing::error!(category = "run", error = %error,
                    "listening for queued runs failed; workers poll instead");
                return;
            }
        };
        loop {
            tokio::select! {
                heard = listener.queued() => match heard {
                    Ok(()) => self.wake_workers(),
                    Err(error) => {
                        tracing::warn!(category = "run", error = %error,
                            "the queued-run listener lost its connection; it reconnects");
                        self.wake_workers();
                        tokio::select! {
                            () = tokio::time::sleep(LISTEN_RETRY) => {}
                            _ = shutdown.changed() => return,
                        }
                    }
                },
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Looks for runs of dead workers every half lease and for expired approvals every
    /// second, until `shutdown`.
    async fn sweep(self, mut shutdown: watch::Receiver<bool>) {
        let mut last_requeue: Option<std::time::Instant> = None;
        loop {
            if *shutdown.borrow() {
                return;
            }
            if last_requeue.is_none_or(|t| t.elapsed() >= self.config.lease / 2) {
                match self.requeue_expired().await {
                    Ok(0) => {}
                    Ok(_) => self.wake_workers(),
                    Err(error) => {
                        tracing::error!(category = "run", error = %error, "requeueing expired runs failed");
                    }
                }
                last_requeue = Some(std::time::Instant::now());
            }
            match self.expire_approvals().await {
                Ok(0) => {}
                Ok(_) => self.wake_workers(),
                Err(error) => {
                    tracing::error!(category = "approval", error = %error, "expiring approvals failed");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(APPROVAL_SWEEP) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
