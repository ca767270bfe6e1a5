//! Workers: claim queued runs and drive them; put back runs whose worker died.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{Engine, EngineError};

/// How often a worker looks for approvals whose time ran out.
const APPROVAL_SWEEP: std::time::Duration = std::time::Duration::from_secs(1);

impl Engine {
    /// Puts runs whose worker stopped renewing its lease back in the queue. Returns how many.
    pub async fn requeue_expired(&self) -> Result<u64, EngineError> {
        Ok(self.store.requeue_expired_runs().await?)
    }

    /// Claims one queued run and drives it to its end. Returns whether there was one.
    pub async fn run_next(&self) -> Result<bool, EngineError> {
        let lease = i64::try_from(self.config.lease.as_millis()).unwrap_or(i64::MAX);
        match self
            .store
            .claim_run(
                &self.config.worker_id,
                lease,
                self.config.max_running_per_project,
            )
            .await?
        {
            Some(run) => {
                self.drive(run).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// A worker task that drives runs until `shutdown` turns true. It looks for runs of dead
    /// workers every half lease and for expired approvals every second, not on every poll: an
    /// idle engine only reads.
    pub fn spawn_worker(&self, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            let mut last_requeue: Option<std::time::Instant> = None;
            let mut last_expiry: Option<std::time::Instant> = None;
            loop {
                if *shutdown.borrow() {
                    return;
                }
                if last_requeue.is_none_or(|t| t.elapsed() >= engine.config.lease / 2) {
                    if let Err(error) = engine.requeue_expired().await {
                        tracing::error!(category = "run", error = %error, "requeueing expired runs failed");
                    }

                    last_requeue = Some(std::time::Instant::now());
                }
                if last_expiry.is_none_or(|t| t.elapsed() >= APPROVAL_SWEEP) {
                    if let Err(error) = engine.expire_approvals().await {
                        tracing::error!(category = "approval", error = %error, "expiring approvals failed");
                    }
                    last_expiry = Some(std::time::Instant::now());
                }
                let worked = tokio::select! {
                    result = engine.run_next() => match result {
                        Ok(worked) => worked,
                        Err(error) => {
                            tracing::error!(category = "run", error = %error, "worker step failed");
                            false
                        }
                    },
                    _ = shutdown.changed() => return,
                };
                if !worked {
                    tokio::select! {
                        () = tokio::time::sleep(engine.config.poll_interval) => {},
                        _ = shutdown.changed() => return,
                    }
                }
            }
        })
    }
}
