//! The caller's project's audit log, page by page, for export and offline verification.
//! Read-only: the API has no route that writes or deletes audit entries.

use axum::Json;
use axum::extract::State;
use wor_core::audit::{AuditCheckpoint, AuditEntry};

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiQuery;

/// Largest page the API returns.
pub const MAX_AUDIT_PAGE: i64 = 1000;
const DEFAULT_AUDIT_PAGE: i64 = 100;

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Return entries with a sequence number above this one (default 0: from the start).
    pub after: Option<i64>,
    /// At most this many entries, 1 to 1000 (default 100).
    pub limit: Option<i64>,
}

/// One page of the chain: its entries in order and the signed checkpoints among them.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AuditPage {
    /// Entries exactly as hashed; see `docs/audit.md` for the encoding.
    #[schema(value_type = Vec<Object>)]
    pub entries: Vec<AuditEntry>,
    /// Checkpoints whose sequence number falls within this page's entries.
    #[schema(value_type = Vec<Object>)]
    pub checkpoints: Vec<AuditCheckpoint>,
    /// Pass as `after` for the next page; `null` on the last page.
    pub next_after: Option<i64>,
}

/// The project's audit entries after `after`, with their checkpoints. Any role may read.
#[utoipa::path(get, path = "/v1/audit", tag = "audit", security(("bearer" = [])),
    params(AuditQuery),
    responses((status = 200, body = AuditPage), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody)))]
pub async fn list_audit(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<AuditQuery>,
) -> Result<Json<AuditPage>, ApiError> {
    // Every role from viewer up reads the log; the project comes from the key alone.
    let after = query.after.unwrap_or(0);
    let limit = query.limit.unwrap_or(DEFAULT_AUDIT_PAGE);
    if after < 0 {
        return Err(ApiError::bad_request(
            "invalid_query",
            "`after` must be 0 or more",
        ));
    }
    if !(1..=MAX_AUDIT_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_query",
            format!("`limit` must be between 1 and {MAX_AUDIT_PAGE}"),
        ));
    }
    let entries = state
        .store
        .audit_entries(caller.project_id, after, limit)
        .await?;
    let last = entries.last().map(|e| e.seq);
    let checkpoints = match last {
        Some(last) => {
            state
                .store
                .audit_checkpoints(caller.project_id, after, Some(last))
                .await?
        }
        None => Vec::new(),
    };
    let full = i64::try_from(entries.len()).unwrap_or(i64::MAX) == limit;
    Ok(Json(AuditPage {
        entries,
        checkpoints,
        next_after: last.filter(|_| full),
    }))
}
