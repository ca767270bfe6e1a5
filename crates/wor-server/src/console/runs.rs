//! The runs list, filtered by routine, status, trigger and time, and cancelling a run. Both
//! use what the API uses: the store's run filter and the API's cancel path.

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect};
use wor_core::call::TriggerKind;
use wor_core::run::RunStatus;
use wor_core::{RoutineId, RunId};
use wor_store::RunFilter;

use super::pages::{Banner, PageResult};
use super::session::ConsoleMember;
use super::{ConsoleError, PagePath, render};
use crate::AppState;
use crate::error::ApiError;
use crate::views::rfc3339;

/// Runs on one page of the list.
const PAGE: u32 = 50;

/// The ways a run can start, as the list's trigger filter offers them.
pub const TRIGGERS: [TriggerKind; 4] = TriggerKind::ALL;

/// The list's filters as a browser sends them: every field may be empty (no filter).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunsQuery {
    #[serde(default)]
    routine: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    trigger: String,
    /// `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM` (UTC), as a date or datetime-local field sends it.
    #[serde(default)]
    from: String,
    #[serde(default)]
    to: String,
    #[serde(default)]
    before: String,
}

fn invalid(field: &str, value: &str) -> ConsoleError {
    ConsoleError(ApiError::bad_request(
        "invalid_filter",
        format!(
            "`{}` is not a valid {field}",
            wor_core::quote::excerpt(value, 80)
        ),
    ))
}

/// Milliseconds of a `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM[:SS]` time in UTC.
fn parse_time(field: &str, text: &str) -> Result<Option<i64>, ConsoleError> {
    if text.is_empty() {
        return Ok(None);
    }
    let parsed = chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M")
        .or_else(|_| chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S"))
        .or_else(|_| {
            chrono::NaiveDate::parse_from_str(text, "%Y-%m-%d")
                .map(|d| d.and_hms_opt(0, 0, 0).unwrap_or_default())
        })
        .map_err(|_| invalid(field, text))?;
    Ok(Some(parsed.and_utc().timestamp_millis()))
}

fn parse_id<T: std::str::FromStr>(field: &str, text: &str) -> Result<Option<T>, ConsoleError> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| invalid(field, text))
}

impl RunsQuery {
    /// The store's filter; a value that is not one is a 400, never ignored.
    fn filter(&self) -> Result<RunFilter, ConsoleError> {
        let trigger = match self.trigger.as_str() {
            "" => None,
            other => Some(
                other
                    .parse::<TriggerKind>()
                    .map_err(|_| invalid("trigger", other))?,
            ),
        };
        Ok(RunFilter {
            routine_id: parse_id::<RoutineId>("routine", &self.routine)?,
            status: parse_id::<RunStatus>("status", &self.status)?,
            before: parse_id::<RunId>("page", &self.before)?,
            limit: PAGE,
            trigger_kind: trigger,
            created_after: parse_time("start time", &self.from)?,
            created_before: parse_time("end time", &self.to)?,
        })
    }
}

struct RunRow {
    id: String,
    routine: String,
    routine_version: i64,
    status: String,
    trigger: String,
    created_at: String,
    cost_microdollars: u64,
    outcome: String,
    /// The validated result (routines with `[output] schema`), compact and cut to fit.
    result: Option<String>,
}

struct Choice {
    value: String,
    label: String,
    selected: bool,
}

#[derive(Template)]
#[template(path = "console/runs.html")]
struct RunsPage {
    banner: Banner,
    routines: Vec<Choice>,
    statuses: Vec<Choice>,
    triggers: Vec<Choice>,
    from: String,
    to: String,
    runs: Vec<RunRow>,
    /// The next page's link, when this page is full.
    next: Option<String>,
}

fn choices(options: impl IntoIterator<Item = (String, String)>, current: &str) -> Vec<Choice> {
    options
        .into_iter()
        .map(|(value, label)| Choice {
            selected: value == current,
            value,
            label,
        })
        .collect()
}

pub async fn list(
    State(state): State<AppState>,
    member: ConsoleMember,
    query: Result<Query<RunsQuery>, QueryRejection>,
) -> PageResult {
    let Query(query) =
        query.map_err(|e| ConsoleError(ApiError::bad_request("invalid_filter", e.body_text())))?;
    let filter = query.filter()?;
    let project = member.session.project_id;
    let routines = state.store.list_routines(project).await?;
    let names: BTreeMap<RoutineId, String> =
        routines.iter().map(|r| (r.id, r.name.clone())).collect();
    let runs = state.store.list_runs(project, &filter).await?;
    let succeeded: Vec<RunId> = runs
        .iter()
        .filter(|r| r.status == RunStatus::Succeeded)
        .map(|r| r.id)
        .collect();
    let mut results = state.store.run_results(project, &succeeded).await?;
    let next = (runs.len() == PAGE as usize)
        .then(|| runs.last())
        .flatten()
        .map(|last| {
            url::form_urlencoded::Serializer::new(String::new())
                .append_pair("routine", &query.routine)
                .append_pair("status", &query.status)
                .append_pair("trigger", &query.trigger)
                .append_pair("from", &query.from)
                .append_pair("to", &query.to)
                .append_pair("before", &last.id.to_string())
                .finish()
        });
    let page = RunsPage {
        banner: (&member).into(),
        routines: choices(
            routines.iter().map(|r| (r.id.to_string(), r.name.clone())),
            &query.routine,
        ),
        statuses: choices(
            RunStatus::ALL.map(|s| (s.as_str().to_owned(), s.as_str().replace('_', " "))),
            &query.status,
        ),
        triggers: choices(
            TRIGGERS.map(|t| (t.as_str().to_owned(), t.as_str().to_owned())),
            &query.trigger,
        ),
        from: query.from.clone(),
        to: query.to.clone(),
        runs: runs
            .into_iter()
            .map(|run| RunRow {
                id: run.id.to_string(),
                routine: names.get(&run.routine_id).cloned().unwrap_or_default(),
                routine_version: run.routine_version,
                status: run.status.to_string(),
                trigger: run.trigger_kind.as_str().to_owned(),
                created_at: rfc3339(run.created_at),
                cost_microdollars: run.usage.cost_microdollars,
                result: results
                    .remove(&run.id)
                    .map(|result| result.to_string().chars().take(120).collect()),
                outcome: run.outcome.unwrap_or_default().chars().take(120).collect(),
            })
            .collect(),
        next,
    };
    Ok(render(StatusCode::OK, &page))
}

/// Asks a run to stop, through the API's own cancel path (role check and audit included).
pub async fn cancel(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<RunId>,
) -> PageResult {
    crate::routes::runs::cancel_run(
        &state,
        member.session.project_id,
        member.session.role,
        member.actor(),
        id,
    )
    .await?;
    tracing::info!(category = "run", action = "run.cancel", project_id = %member.session.project_id,
        run_id = %id, member_id = %member.session.member_id, "run cancel requested in the console");
    Ok(Redirect::to(&format!("/console/runs/{id}")).into_response())
}
