//! Live updates for the console's script: server-sent events that say only that a page has
//! changed (`changed`), or that a run has ended (`end`); the script then fetches the page
//! again, so what is shown is always the server's escaped rendering, never data put into the
//! page by script. Pages work without them.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use wor_core::canonical::sha256_hex;
use wor_core::run::RunStatus;
use wor_core::{ApprovalId, ProjectId, RunId};
use wor_store::{ApprovalFilter, ApprovalStatus, Store, StoreError};

use super::session::ConsoleMember;
use super::{ConsoleError, INBOX_LIMIT, INBOX_PAGE, PagePath};
use crate::AppState;
use crate::error::ApiError;

/// How often a stream looks at the store.
const POLL: Duration = Duration::from_millis(500);
/// How often a stream asks again whether its session is live.
const SESSION_RECHECK: Duration = Duration::from_secs(2);

/// The session a stream was opened under, asked about again every [`SESSION_RECHECK`]
/// without being used: signed out, ended by an admin, idle or expired, or its member
/// removed, the stream ends; an open page does not keep its session from idling out.
pub(super) struct SessionWatch {
    store: Store,
    token: String,
    idle_ms: i64,
    checked: tokio::time::Instant,
}

impl SessionWatch {
    pub(super) fn new(state: &AppState, member: &ConsoleMember) -> Self {
        SessionWatch {
            store: state.store.clone(),
            token: member.token.clone(),
            idle_ms: super::millis(state.console.session_idle),
            checked: tokio::time::Instant::now(),
        }
    }

    /// Whether the stream may go on; a store that cannot answer is asked again at the next
    /// recheck.
    pub(super) async fn still_open(&mut self) -> bool {
        if self.checked.elapsed() < SESSION_RECHECK {
            return true;
        }
        self.checked = tokio::time::Instant::now();
        match self
            .store
            .console_session_opens(&self.token, self.idle_ms)
            .await
        {
            Ok(open) => {
                if !open {
                    tracing::info!(
                        category = "auth",
                        "a console live stream ended: its session is no longer live"
                    );
                }
                open
            }
            Err(error) => {
                tracing::warn!(category = "auth", %error,
                    "the session of a console live stream could not be checked");
                true
            }
        }
    }
}

/// The ids of the project's newest `limit` pending approvals, newest first.
async fn pending(
    store: &Store,
    project: ProjectId,
    limit: u32,
) -> Result<Vec<ApprovalId>, StoreError> {
    let approvals = store
        .list_approvals(
            project,
            &ApprovalFilter {
                status: Some(ApprovalStatus::Pending),
                run_id: None,
                before: None,
                limit,
            },
        )
        .await?;
    Ok(approvals.into_iter().map(|a| a.id).collect())
}

/// A short digest of the newest page of pending approvals (`ids`, newest first): what the
/// inbox's newest page showed, which its stream compares with when it connects.
pub(crate) fn inbox_fingerprint<'a>(ids: impl IntoIterator<Item = &'a ApprovalId>) -> String {
    let joined = ids
        .into_iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    let digest = sha256_hex(joined.as_bytes());
    digest.get(..16).unwrap_or(&digest).to_owned()
}

/// What the inbox's newest page showed (its `data-live` link carries it): the stream says
/// `changed` at once when the pending approvals moved before it connected.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboxPageSeen {
    seen: Option<String>,
}

/// `changed` each time the set of pending approvals changes, and at once if the newest page
/// (`?seen=…`, [`inbox_fingerprint`]) is no longer what is pending.
pub async fn inbox(
    State(state): State<AppState>,
    member: ConsoleMember,
    query: Result<Query<InboxPageSeen>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ConsoleError> {
    let project = member.session.project_id;
    let Query(page) =
        query.map_err(|e| ConsoleError(ApiError::bad_request("invalid_query", e.body_text())))?;
    let store = state.store.clone();
    let moved = match page.seen {
        Some(seen) => inbox_fingerprint(&pending(&store, project, INBOX_PAGE + 1).await?) != seen,
        None => false,
    };
    let baseline = pending(&store, project, INBOX_LIMIT).await.ok();
    let watch = SessionWatch::new(&state, &member);
    let stream = futures_util::stream::unfold(
        (baseline, moved, watch),
        move |(mut seen, moved, mut watch)| {
            let store = store.clone();
            async move {
                if moved {
                    return Some((
                        Ok(Event::default().event("changed").data("inbox")),
                        (seen, false, watch),
                    ));
                }
                loop {
                    tokio::time::sleep(POLL).await;
                    if !watch.still_open().await {
                        return None;
                    }
                    let now = pending(&store, project, INBOX_LIMIT).await.ok();
                    if now.is_some() && now != seen {
                        seen = now;
                        return Some((
                            Ok(Event::default().event("changed").data("inbox")),
                            (seen, false, watch),
                        ));
                    }
                }
            }
        },
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// A run's fingerprint: its status and its last step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RunSeen {
    status: RunStatus,
    step: i64,
}

/// The run as it is now: its status and the number of its last step.
async fn run_state(store: &Store, project: ProjectId, run: RunId) -> Option<RunSeen> {
    let record = store.get_run(project, run).await.ok()?;
    let step = store.last_run_step_seq(project, run).await.ok()?;
    Some(RunSeen {
        status: record.status,
        step,
    })
}

/// What the run's page showed when it was rendered (its `data-live` link carries it), so a
/// step written before the stream connects is not missed: the stream compares with it, and
/// says `changed` at once if the run has moved since.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunPageSeen {
    status: Option<String>,
    step: Option<i64>,
}

impl RunPageSeen {
    fn parse(self) -> Result<Option<RunSeen>, ApiError> {
        match (self.status, self.step) {
            (None, None) => Ok(None),
            (Some(status), Some(step)) => {
                let status = status
                    .parse::<RunStatus>()
                    .map_err(|e| ApiError::bad_request("invalid_query", e.to_string()))?;
                Ok(Some(RunSeen { status, step }))
            }
            _ => Err(ApiError::bad_request(
                "invalid_query",
                "`status` and `step` go together: the run's status and last step as the page showed them",
            )),
        }
    }
}

/// `changed` each time the run takes a step or changes status, and at once if it has since
/// the page (`?status=…&step=…`) was rendered; `end` once it has ended.
pub async fn run(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<RunId>,
    query: Result<Query<RunPageSeen>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ConsoleError> {
    let project = member.session.project_id;
    // Another project's run is not found, as its page is not.
    state.store.get_run(project, id).await?;
    let Query(page) =
        query.map_err(|e| ConsoleError(ApiError::bad_request("invalid_query", e.body_text())))?;
    let store = state.store.clone();
    let baseline = match page.parse()? {
        Some(seen) => Some(seen),
        None => run_state(&store, project, id).await,
    };
    let watch = SessionWatch::new(&state, &member);
    let stream = futures_util::stream::unfold(
        (baseline, false, watch),
        move |(mut seen, ended, mut watch)| {
            let store = store.clone();
            async move {
                if ended {
                    return None;
                }
                loop {
                    if seen.is_some_and(|s| s.status.is_terminal()) {
                        let end = Event::default().event("end").data("run");
                        return Some((Ok(end), (seen, true, watch)));
                    }
                    if !watch.still_open().await {
                        return None;
                    }
                    let now = run_state(&store, project, id).await;
                    if now.is_some() && now != seen {
                        seen = now;
                        if !seen.is_some_and(|s| s.status.is_terminal()) {
                            let changed = Event::default().event("changed").data("run");
                            return Some((Ok(changed), (seen, false, watch)));
                        }
                        continue;
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        },
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
