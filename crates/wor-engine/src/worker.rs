//! Workers: claim queued runs and drive them; put back runs whose worker died.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{Engine, EngineError};

impl Engine {
    /// Claims one queued run and drives it to its end. Returns whether there was one.
    pub async fn run_next(&self) -> Result<bool, EngineError> {
        self.store.requeue_expired_runs().await?;
        let lease = i64::try_from(self.config.lease.as_millis()).unwrap_or(i64::MAX);
        match self.store.claim_run(&self.config.worker_id, lease).await? {
            Some(run) => {
                self.drive(run).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// A worker task that drives runs until `shutdown` turns true.
    pub fn spawn_worker(&self, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            loop {
                if *shutdown.borrow() {
                    return;
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
