//! The Prometheus endpoint: `GET /metrics` in the text exposition format, on a listener of its
//! own that the operator configures (`[metrics] listen`), never on the API's.
//!
//! Counters and histograms are recorded where their events happen (`wor_engine::metrics`,
//! `wor_store::metrics`, `wor_egress::metrics`) through the `metrics` facade into the one
//! recorder installed here. Gauges of state — the approval backlog, the database pool — are
//! read from the store when scraped. No label carries a project's text.

use std::future::Future;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics::gauge;
/// What renders this process's metrics, made by [`install_recorder`].
pub use metrics_exporter_prometheus::PrometheusHandle;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tokio::net::TcpListener;
use wor_store::Store;

pub const APPROVALS_PENDING: &str = "wor_approvals_pending";
pub const APPROVAL_OLDEST_AGE: &str = "wor_approval_oldest_pending_age_seconds";
pub const DB_POOL_CONNECTIONS: &str = "wor_db_pool_connections";
pub const DB_POOL_MAX: &str = "wor_db_pool_max_connections";

/// Upper bounds of the time histograms, in seconds: from a fast audit commit to a long run.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
    1800.0, 3600.0,
];
/// Upper bounds of the audit batch-size histogram.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Why the metrics recorder could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot set up the metrics recorder: {0}")]
    Build(#[from] metrics_exporter_prometheus::BuildError),
}

/// Installs the process's one metrics recorder and describes every metric. Call once, before
/// the engine starts; without it every metric call is a no-op.
pub fn install_recorder() -> Result<PrometheusHandle, MetricsError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), SECONDS_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(wor_store::metrics::AUDIT_BATCH.to_owned()),
            BATCH_BUCKETS,
        )?
        .install_recorder()?;
    wor_engine::metrics::describe();
    wor_store::metrics::describe();
    wor_egress::metrics::describe();
    metrics::describe_gauge!(APPROVALS_PENDING, "Approvals waiting for a decision");
    metrics::describe_gauge!(
        APPROVAL_OLDEST_AGE,
        metrics::Unit::Seconds,
        "Age of the oldest approval waiting for a decision (0 when none waits)"
    );
    metrics::describe_gauge!(
        DB_POOL_CONNECTIONS,
        "Database pool connections, by state (idle, in_use)"
    );
    metrics::describe_gauge!(DB_POOL_MAX, "Most connections the database pool opens");
    Ok(handle)
}

/// What the metrics endpoint reads.
#[derive(Debug, Clone)]
pub struct MetricsState {
    pub handle: PrometheusHandle,
    /// The deployment's database, for the gauges read from it at each scrape (the approval
    /// backlog, the pool's connections); `None` for a remote worker, which has none.
    pub store: Option<Store>,
}

/// The metrics listener's router: `GET /metrics` and nothing else.
pub fn router(state: MetricsState) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .with_state(state)
}

/// Serves the metrics router on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    state: MetricsState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn scrape(State(state): State<MetricsState>) -> Response {
    if let Some(store) = &state.store {
        store_gauges(store).await;
    }
    state.handle.run_upkeep();
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.handle.render(),
    )
        .into_response()
}

/// Sets the gauges read from the database: the approval backlog and the pool's connections.
async fn store_gauges(store: &Store) {
    match store.pending_approval_backlog().await {
        Ok((pending, oldest)) => {
            gauge!(APPROVALS_PENDING).set(pending as f64);
            let age_ms = oldest.map_or(0, |at| wor_store::now_millis().saturating_sub(at).max(0));
            gauge!(APPROVAL_OLDEST_AGE).set(age_ms as f64 / 1000.0);
        }
        // The gauges keep their last value; the scrape still answers with everything else.
        Err(error) => {
            tracing::warn!(
                category = "metrics",
                kind = error.kind(),
                "reading the approval backlog failed"
            );
        }
    }
    let pool = store.pool();
    let size = f64::from(pool.size());
    let idle = pool.num_idle() as f64;
    gauge!(DB_POOL_CONNECTIONS, "state" => "idle").set(idle);
    gauge!(DB_POOL_CONNECTIONS, "state" => "in_use").set((size - idle).max(0.0));
    gauge!(DB_POOL_MAX).set(f64::from(pool.options().get_max_connections()));
}
