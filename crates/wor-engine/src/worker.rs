//! Workers: a pool that claims queued runs and drives up to `workers` of them at once; put
//! back runs whose worker died; expire approvals nobody decided.
//!
//! One dispatcher claims runs, as many at once as there are free slots (one write for them
//! all), and hands each claimed run to a driver task of its own. The limits are not counted
//! here: every claim checks the routine's `max_concurrent` and the project's running limit as
//! it is written (`wor-store`), so they hold across slots and processes alike. An idle pool
//! asks the database for work once per poll interval, whatever its size; it is woken sooner
//! when this process queues a run or a driver ends one, and on PostgreSQL when any process
//! queues one (LISTEN/NOTIFY). The sweeps (expired leases, expired approvals, overdue
//! announcements) run once per process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::{Engine, EngineError};

/// A run claimed with the slot it is to be driven in.
type Claimed = (wor_store::RunRecord, OwnedSemaphorePermit);

/// This process's worker pool as the rest of the engine sees it: its slots, and while its
/// dispatcher runs, the way a run started here and claimed as it was created reaches it.
#[derive(Debug)]
pub(crate) struct Pool {
    slots: Arc<Semaphore>,
    started: Mutex<Option<mpsc::UnboundedSender<Claimed>>>,
    /// The pool is stopping: each run it drives is given back at its next step boundary.
    draining: AtomicBool,
}

impl Pool {
    pub(crate) fn new(workers: usize) -> Self {
        Pool {
            slots: Arc::new(Semaphore::new(workers.max(1))),
            started: Mutex::new(None),
            draining: AtomicBool::new(false),
        }
    }

    /// Whether the pool is stopping, so that a run it drives stops at its next step boundary.
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// A free slot of a running pool, for a run about to be started here; `None` when every
    /// slot is taken or no pool runs in this process.
    pub(crate) fn free_slot(&self) -> Option<OwnedSemaphorePermit> {
        let open = self
            .started
            .lock()
            .is_ok_and(|started| started.as_ref().is_some_and(|tx| !tx.is_closed()));
        if !open {
            return None;
        }
        self.slots.clone().try_acquire_owned().ok()
    }

    /// Hands a run claimed as it was started to the dispatcher; returns it when the
    /// dispatcher has stopped and no one will drive it here.
    fn hand_over(&self, claimed: Claimed) -> Option<Claimed> {
        let sender = match self.started.lock() {
            Ok(started) => started.clone(),
            Err(_) => None,
        };
        match sender {
            Some(sender) => sender.send(claimed).err().map(|returned| returned.0),
            None => Some(claimed),
        }
    }

    /// Opens the way in for runs claimed as they are started; closed when the receiver drops.
    fn open(&self) -> mpsc::UnboundedReceiver<Claimed> {
        // A pool opened again (after a drain) drives runs again.
        self.draining.store(false, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut started) = self.started.lock() {
            *started = Some(tx);
        }
        rx
    }
}

/// How long a stopping pool lets the runs it drives reach a step boundary (the end of a model
/// turn, or of a tool call and the recording of its result) before it stops them where they
/// are: a tool call stopped in flight is asked about when its run resumes.
pub const POOL_DRAIN: std::time::Duration = std::time::Duration::from_secs(20);

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

    /// Claims up to `max` of the oldest queued runs the limits allow, leased to `holder`, in
    /// one write.
    async fn claim_as(
        &self,
        holder: &str,
        max: usize,
    ) -> Result<Vec<wor_store::RunRecord>, EngineError> {
        let began = wor_store::now_millis();
        let claimed = self.store.claim_runs(self.claim_terms(holder), max).await?;
        for run in &claimed.runs {
            crate::metrics::run_claimed(run, began);
        }
        for run in &claimed.unreadable {
            self.end_unreadable(holder, run).await;
        }
        Ok(claimed.runs)
    }

    /// Ends a claimed run whose stored row does not read as a run: failed, saying why, in one
    /// journal write with its audit entry, so that it leaves the queue instead of heading
    /// every claim. Nothing else of the run can be read, so no webhook announces it; a failure
    /// here is logged, and the run's lease then expires and it is claimed again.
    async fn end_unreadable(&self, holder: &str, run: &wor_store::UnreadableRun) {
        use wor_core::audit::{Actor, AuditCategory, AuditEvent};
        use wor_core::run::RunStatus;
        tracing::error!(category = "run", action = "run.unreadable", project_id = %run.project,
            run_id = %run.id, "a claimed run's stored row does not read as a run; it fails");
        let outcome = wor_secrets::redact_shapes(&format!(
            "its stored record cannot be read: {}",
            run.reason
        ))
        .into_owned();
        let event = AuditEvent::new(
            run.project,
            AuditCategory::RunEnd,
            Actor::Run { run_id: run.id },
        )
        .subject("run_id", run.id)
        .payload(serde_json::json!({ "status": RunStatus::Failed.as_str(), "outcome": outcome }));
        let end = wor_store::RunWrite::new(run.project, run.id, holder, self.lease_ms())
            .end(RunStatus::Failed, &outcome)
            .audit(event);
        match self.audit.record(end).await {
            Ok(wor_store::RunWritten::Committed {
                cancelled_approvals,
                ..
            }) => {
                for cancelled in cancelled_approvals {
                    self.notify_approval_changed_or_log(run.project, cancelled, "cancelled", None)
                        .await;
                }
            }
            Ok(
                wor_store::RunWritten::LeaseLost
                | wor_store::RunWritten::CredentialEnded
                | wor_store::RunWritten::CancelRequested,
            ) => {}
            Err(error) => {
                tracing::error!(category = "run", project_id = %run.project, run_id = %run.id,
                    kind = error.kind(), "an unreadable run could not be ended; its lease will expire");
            }
        }
    }

    /// The terms runs are claimed on for `holder`: this process's lease, under the project
    /// limit.
    pub(crate) fn claim_terms<'a>(&self, holder: &'a str) -> wor_store::ClaimTerms<'a> {
        wor_store::ClaimTerms {
            worker: holder,
            lease_ms: self.lease_ms(),
            max_per_project: self.config.max_running_per_project,
        }
    }

    /// Claims the oldest queued run the limits allow, leased to `holder`.
    pub(crate) async fn claim_for(
        &self,
        holder: &str,
    ) -> Result<Option<wor_store::RunRecord>, EngineError> {
        Ok(self.claim_as(holder, 1).await?.pop())
    }

    /// Drives `run`, claimed by this process as it was started, in `slot` of the pool. When
    /// the pool has stopped meanwhile, gives the run back to the queue at once (or, should
    /// that fail, when its lease runs out).
    pub(crate) async fn drive_started(
        &self,
        run: wor_store::RunRecord,
        slot: OwnedSemaphorePermit,
    ) {
        if let Some((run, slot)) = self.pool.hand_over((run, slot)) {
            drop(slot);
            self.give_back(&run, &self.config.worker_id).await;
            self.wake_workers();
        }
    }

    /// Tells an idle pool of this process, and the remote workers' claims waiting here, that
    /// there may be work: a run was queued or a running one ended (freeing a place under the
    /// limits).
    pub(crate) fn wake_workers(&self) {
        self.work.notify_one();
        self.work_seen.send_replace(());
    }

    /// Listens for runs queued by other processes (PostgreSQL's LISTEN/NOTIFY) until
    /// `shutdown`, for a process without a worker pool whose remote workers' claims wait
    /// for work (`wor serve --role api`); [`Engine::spawn_workers`] listens for its pool.
    pub fn spawn_work_listener(&self, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        tokio::spawn(self.clone().listen(shutdown))
    }

    /// Starts the worker pool: up to `workers` runs driven at once (at least one), until
    /// `shutdown` turns true; then it claims no more, each run in flight stops at its next
    /// step boundary, those still going after [`POOL_DRAIN`] are stopped where they are (their
    /// steps say where to resume), and the returned task ends. The caller gives their leases
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
        let slots = self.pool.slots.clone();
        let mut started = self.pool.open();
        let mut drivers = JoinSet::new();
        loop {
            while let Ok((run, slot)) = started.try_recv() {
                self.spawn_driver(&mut drivers, run, slot);
            }
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
            let first = tokio::select! {
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
                Some((run, slot)) = started.recv() => {
                    self.spawn_driver(&mut drivers, run, slot);
                    continue;
                }
                _ = shutdown.changed() => break,
            };
            // Every free slot is offered to one claim: runs queued together start together.
            // Only one slot is held while claiming, so a run started here meanwhile can still
            // take a free one; a claimed run that finds no slot left goes back to the queue.
            let mut first = Some(first);
            match self
                .claim_as(&self.config.worker_id, 1 + slots.available_permits())
                .await
            {
                Ok(runs) if !runs.is_empty() => {
                    for run in runs {
                        match first
                            .take()
                            .or_else(|| slots.clone().try_acquire_owned().ok())
                        {
                            Some(slot) => self.spawn_driver(&mut drivers, run, slot),
                            None => self.give_back(&run, &self.config.worker_id).await,
                        }
                    }
                    continue;
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::error!(category = "run", error = %error, "claiming a run failed");
                }
            }
            drop(first);
            tokio::select! {
                () = tokio::time::sleep(self.config.poll_interval) => {}
                () = self.work.notified() => {}
                Some((run, slot)) = started.recv() => self.spawn_driver(&mut drivers, run, slot),
                _ = shutdown.changed() => break,
            }
        }
        // Runs handed over but not yet driven go back to the queue with the rest.
        started.close();
        while let Ok((run, slot)) = started.try_recv() {
            drop(slot);
            self.give_back(&run, &self.config.worker_id).await;
        }
        // Each run in flight finishes the step it is in and stops there; those still going
        // after the drain are stopped where they are.
        self.pool.draining.store(true, Ordering::Relaxed);
        let drained = tokio::time::timeout(POOL_DRAIN, async {
            while drivers.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                category = "lifecycle",
                runs = drivers.len(),
                "runs still in a step when the drain ended are stopped where they are"
            );
            drivers.abort_all();
            while drivers.join_next().await.is_some() {}
        }
    }

    /// Drives `run` in `slot` on a task of its own; the slot is freed when the run stops.
    fn spawn_driver(
        &self,
        drivers: &mut JoinSet<()>,
        run: wor_store::RunRecord,
        slot: OwnedSemaphorePermit,
    ) {
        let engine = self.clone();
        drivers.spawn(async move {
            let id = run.id;
            match engine.drive(run).await {
                Ok(()) => {}
                Err(EngineError::Stopping) => {
                    tracing::info!(category = "run", action = "run.handed_back", run_id = %id,
                        "the pool is stopping; the run stopped at a step boundary");
                }
                Err(error) => {
                    tracing::error!(category = "run", run_id = %id, error = %error, "worker step failed");
                }
            }
            drop(slot);
            engine.wake_workers();
        });
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

    /// Looks for runs of dead workers every half lease, and every second for expired
    /// approvals and for runs whose park or end was not announced (their process stopped
    /// first), until `shutdown`.
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
            if let Err(error) = self.announce_overdue().await {
                tracing::error!(category = "run", error = %error, "queueing overdue announcements failed");
            }
            tokio::select! {
                () = tokio::time::sleep(APPROVAL_SWEEP) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
