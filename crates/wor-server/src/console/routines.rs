//! Routines: the list, and a routine's page with its current TOML, its versions with a line
//! diff between any two, its schedule's next firings and its webhook address. Everything comes
//! from the functions `GET /v1/routines/{id}` calls.

use askama::Template;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use similar::{ChangeTag, TextDiff};
use wor_core::RoutineId;
use wor_engine::WebhookSecretKind;

use super::pages::{Banner, PageResult};
use super::session::ConsoleMember;
use super::{ConsoleError, render};
use crate::AppState;
use crate::error::ApiError;
use crate::views::rfc3339;

/// How many of the schedule's next firings are shown.
const FIRINGS: usize = 5;

struct RoutineRow {
    id: String,
    name: String,
    version: i64,
    updated_at: String,
}

#[derive(Template)]
#[template(path = "console/routines.html")]
struct RoutinesPage {
    banner: Banner,
    routines: Vec<RoutineRow>,
}

pub async fn list(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    let routines = state
        .store
        .list_routines(member.session.project_id)
        .await?
        .into_iter()
        .map(|r| RoutineRow {
            id: r.id.to_string(),
            name: r.name,
            version: r.current_version,
            updated_at: rfc3339(r.updated_at),
        })
        .collect();
    Ok(render(
        StatusCode::OK,
        &RoutinesPage {
            banner: (&member).into(),
            routines,
        },
    ))
}

/// Which two versions to compare, as the diff form sends them.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiffQuery {
    from: Option<i64>,
    to: Option<i64>,
}

struct VersionRow {
    version: i64,
    content_hash: String,
    created_at: String,
    /// Chosen as the diff's old side / new side.
    from: bool,
    to: bool,
}

/// One line of a diff: `-` removed, `+` added, ` ` the same.
struct DiffLine {
    sign: &'static str,
    class: &'static str,
    text: String,
}

#[derive(Template)]
#[template(path = "console/routine.html")]
struct RoutinePage {
    banner: Banner,
    id: String,
    name: String,
    version: i64,
    source_toml: String,
    versions: Vec<VersionRow>,
    next_firings: Vec<String>,
    has_schedule: bool,
    /// The path signed webhooks start runs at, when the routine accepts them.
    webhook_path: Option<String>,
    webhook_scheme: String,
    webhook_secret_configured: bool,
    /// The compared versions and their diff, when two were chosen.
    diff: Option<(i64, i64, Vec<DiffLine>)>,
}

/// The lines of `old` and `new`, marked as removed, added or kept.
fn line_diff(old: &str, new: &str) -> Vec<DiffLine> {
    TextDiff::from_lines(old, new)
        .iter_all_changes()
        .map(|change| {
            let (sign, class) = match change.tag() {
                ChangeTag::Delete => ("-", "del"),
                ChangeTag::Insert => ("+", "ins"),
                ChangeTag::Equal => (" ", "same"),
            };
            DiffLine {
                sign,
                class,
                text: change.value().trim_end_matches('\n').to_owned(),
            }
        })
        .collect()
}

pub async fn show(
    State(state): State<AppState>,
    member: ConsoleMember,
    Path(routine_id): Path<String>,
    query: Result<Query<DiffQuery>, QueryRejection>,
) -> PageResult {
    let Query(query) =
        query.map_err(|e| ConsoleError(ApiError::bad_request("invalid_query", e.body_text())))?;
    let project = member.session.project_id;
    let id: RoutineId = routine_id
        .parse()
        .map_err(|_| ConsoleError(ApiError::NotFound))?;
    let routine = state.store.get_routine(project, id).await?;
    let current = state
        .store
        .get_routine_version(project, id, routine.current_version)
        .await?;
    let versions = state.store.list_routine_versions(project, id).await?;
    let next_firings = state
        .engine
        .next_firings(project, id, &current.definition, FIRINGS)
        .await?
        .into_iter()
        .map(wor_core::schedule::slot_rfc3339)
        .collect();
    let webhook_secret_configured = state
        .engine
        .has_webhook_secret(project, id, WebhookSecretKind::Inbound)
        .await?;
    let diff = match (query.from, query.to) {
        (Some(from), Some(to)) => {
            // A version that does not exist is a 404, as in the API.
            let old = state.store.get_routine_version(project, id, from).await?;
            let new = state.store.get_routine_version(project, id, to).await?;
            Some((from, to, line_diff(&old.source_toml, &new.source_toml)))
        }
        (None, None) => None,
        _ => {
            return Err(ConsoleError(ApiError::bad_request(
                "invalid_query",
                "choose both versions to compare",
            )));
        }
    };
    let (chosen_from, chosen_to) = match &diff {
        Some((from, to, _)) => (*from, *to),
        None => (
            routine.current_version.saturating_sub(1).max(1),
            routine.current_version,
        ),
    };
    let webhook = &current.definition.webhook;
    let page = RoutinePage {
        banner: (&member).into(),
        id: routine.id.to_string(),
        name: routine.name,
        version: routine.current_version,
        has_schedule: current.definition.schedule.is_some(),
        source_toml: current.source_toml,
        versions: versions
            .into_iter()
            .map(|(version, content_hash, created_at)| VersionRow {
                from: version == chosen_from,
                to: version == chosen_to,
                version,
                content_hash,
                created_at: rfc3339(created_at),
            })
            .collect(),
        next_firings,
        webhook_path: webhook.enabled.then(|| format!("/hooks/{id}")),
        webhook_scheme: match webhook.scheme {
            wor_core::routine::WebhookScheme::Wor => "wor-timestamp / wor-signature",
            wor_core::routine::WebhookScheme::Standard => "Standard Webhooks",
        }
        .to_owned(),
        webhook_secret_configured,
        diff,
    };
    Ok(render(StatusCode::OK, &page))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_diff_marks_removed_added_and_kept_lines() {
        let lines = line_diff("a = 1\nb = 2\nc = 3\n", "a = 1\nb = 20\nc = 3\nd = 4\n");
        let shown: Vec<String> = lines
            .iter()
            .map(|l| format!("{}{}", l.sign, l.text))
            .collect();
        assert_eq!(shown, [" a = 1", "-b = 2", "+b = 20", " c = 3", "+d = 4"]);
    }
}
