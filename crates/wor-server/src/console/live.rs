//! Live updates for the console's script: server-sent events that say only that a page has
//! changed (`changed`), or that a run has ended (`end`); the script then fetches the page
//! again, so what is shown is always the server's escaped rendering, never data put into the
//! page by script. Pages work without them.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use wor_core::{ProjectId, RunId};
use wor_store::{ApprovalFilter, ApprovalStatus, Store};

use super::session::ConsoleMember;
use super::{ConsoleError, INBOX_LIMIT};
use crate::AppState;
use crate::error::ApiError;

/// How often a stream looks at the store.
const POLL: Duration = Duration::from_millis(500);

/// The ids of the project's pending approvals, newest first: the inbox's fingerprint.
async fn pending(store: &Store, project: ProjectId) -> Option<Vec<String>> {
    store
        .list_approvals(
            project,
            &ApprovalFilter {
                status: Some(ApprovalStatus::Pending),
                run_id: None,
                before: None,
                limit: INBOX_LIMIT,
            },
        )
        .await
        .ok()
        .map(|list| list.into_iter().map(|a| a.id.to_string()).collect())
}

/// `changed` each time the set of pending approvals changes.
pub async fn inbox(
    State(state): State<AppState>,
    member: ConsoleMember,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let project = member.session.project_id;
    let store = state.store.clone();
    let baseline = pending(&store, project).await;
    let stream = futures_util::stream::unfold(baseline, move |mut seen| {
        let store = store.clone();
        async move {
            loop {
                tokio::time::sleep(POLL).await;
                let now = pending(&store, project).await;
                if now.is_some() && now != seen {
                    seen = now;
                    return Some((Ok(Event::default().event("changed").data("inbox")), seen));
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// A run's fingerprint: its status and its last step.
async fn run_state(store: &Store, project: ProjectId, run: RunId) -> Option<(String, i64, bool)> {
    let record = store.get_run(project, run).await.ok()?;
    let last = store
        .list_run_steps(project, run, 0)
        .await
        .ok()?
        .last()
        .map_or(0, |s| s.seq);
    Some((record.status.to_string(), last, record.status.is_terminal()))
}

/// `changed` each time the run takes a step or changes status; `end` once it has ended.
pub async fn run(
    State(state): State<AppState>,
    member: ConsoleMember,
    Path(run_id): Path<String>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ConsoleError> {
    let project = member.session.project_id;
    let id: RunId = run_id
        .parse()
        .map_err(|_| ConsoleError(ApiError::NotFound))?;
    // Another project's run is not found, as its page is not.
    state.store.get_run(project, id).await?;
    let store = state.store.clone();
    let baseline = run_state(&store, project, id).await;
    let stream = futures_util::stream::unfold((baseline, false), move |(mut seen, ended)| {
        let store = store.clone();
        async move {
            if ended {
                return None;
            }
            loop {
                if let Some((_, _, true)) = &seen {
                    let end = Event::default().event("end").data("run");
                    return Some((Ok(end), (seen, true)));
                }
                tokio::time::sleep(POLL).await;
                let now = run_state(&store, project, id).await;
                if now.is_some() && now != seen {
                    seen = now;
                    if !matches!(seen, Some((_, _, true))) {
                        let changed = Event::default().event("changed").data("run");
                        return Some((Ok(changed), (seen, false)));
                    }
                }
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
