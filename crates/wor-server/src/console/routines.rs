//! Routines: the list, and a routine's page with its current TOML, its versions with a line
//! diff between any two, its schedule's next firings and its webhook address. Everything comes
//! from the functions `GET /v1/routines/{id}` calls. A member who may operate runs starts one
//! with an input, through the path `POST /v1/routines/{id}/runs` takes.

use askama::Template;
use axum::Form;
use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect};
use similar::{ChangeTag, TextDiff};
use wor_core::RoutineId;
use wor_engine::WebhookSecretKind;

use super::pages::{Banner, PageResult, form, start_form_key, start_key_for};
use super::session::ConsoleMember;
use super::{ConsoleError, PagePath, render};
use crate::AppState;
use crate::error::ApiError;
use crate::routes::runs::{StartRunBody, start_run};
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
    /// Whether the member may start runs (not a viewer).
    may_start: bool,
    /// Whether the routine keeps memory, and so runs belong to threads.
    memory: bool,
    /// The start form's key (`pages::start_form_key`).
    start_key: String,
}

/// How long a diff of two versions may search for the smallest one; past it, the diff shown
/// is correct but may mark more lines than it had to. Two versions that share nothing, at the
/// largest size a routine may have, would otherwise hold a worker thread for minutes.
const DIFF_DEADLINE: std::time::Duration = std::time::Duration::from_millis(100);

/// The lines of `old` and `new`, marked as removed, added or kept.
fn line_diff(old: &str, new: &str) -> Vec<DiffLine> {
    line_diff_within(old, new, DIFF_DEADLINE)
}

/// [`line_diff`], searching for the smallest diff for at most `deadline`.
fn line_diff_within(old: &str, new: &str, deadline: std::time::Duration) -> Vec<DiffLine> {
    TextDiff::configure()
        .timeout(deadline)
        .diff_lines(old, new)
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
    PagePath(id): PagePath<RoutineId>,
    query: Result<Query<DiffQuery>, QueryRejection>,
) -> PageResult {
    let Query(query) =
        query.map_err(|e| ConsoleError(ApiError::bad_request("invalid_query", e.body_text())))?;
    let project = member.session.project_id;
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
    // A secret written into the routine is shown redacted, as the API shows it.
    let redactor = state.engine.project_redactor(project).await?;
    let diff = match (query.from, query.to) {
        (Some(from), Some(to)) => {
            // A version that does not exist is a 404, as in the API.
            let old = state.store.get_routine_version(project, id, from).await?;
            let new = state.store.get_routine_version(project, id, to).await?;
            Some((
                from,
                to,
                line_diff(
                    &redactor.redact(&old.source_toml),
                    &redactor.redact(&new.source_toml),
                ),
            ))
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
        source_toml: redactor.redact(&current.source_toml).into_owned(),
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
        may_start: member.session.role.can_operate_runs(),
        memory: current.definition.memory.enabled,
        start_key: start_key_for(member.session.role.can_operate_runs())?,
    };
    Ok(render(StatusCode::OK, &page))
}

/// A run's input as the start form sends it: text, or JSON when `json` is ticked.
#[derive(Debug, serde::Deserialize)]
pub struct StartForm {
    input: String,
    #[serde(default)]
    json: Option<String>,
    #[serde(default)]
    thread: String,
    #[serde(default)]
    start_key: String,
}

impl StartForm {
    /// The start's idempotency key (`pages::start_form_key`): the input, whether it is JSON
    /// and the thread, as sent.
    fn key(&self) -> Option<wor_core::run::IdempotencyKey> {
        let kind = if self.json.is_some() { "json" } else { "text" };
        start_form_key(&self.start_key, &[&self.input, kind, &self.thread])
    }

    /// The API's body for this form: the input as text, or parsed as JSON (a 400 naming the
    /// parser's complaint when it is not), and the thread when one is named.
    pub(super) fn body(self) -> Result<StartRunBody, ConsoleError> {
        let input = if self.json.is_some() {
            crate::extract::json_field(&self.input).map_err(|e| {
                ConsoleError(ApiError::bad_request(
                    "invalid_input",
                    format!("the input marked JSON is refused: {e}"),
                ))
            })?
        } else {
            serde_json::Value::String(self.input)
        };
        let thread = Some(self.thread.trim().to_owned()).filter(|t| !t.is_empty());
        Ok(StartRunBody { input, thread })
    }
}

/// Starts a run of the routine's current version through the API's path (the same role check,
/// engine start and `run.start` audit entry); its starter is the member, who therefore may not
/// decide its approvals. Goes to the new run's page.
pub async fn start(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(routine): PagePath<RoutineId>,
    body: Result<Form<StartForm>, FormRejection>,
) -> PageResult {
    let form = form(body)?;
    let key = form.key();
    let body = form.body()?;
    let session = &member.session;
    let run = start_run(
        &state,
        session.project_id,
        session.role,
        routine,
        wor_engine::Trigger::Console(session.member_id),
        member.actor(),
        body,
        key,
    )
    .await?
    .into_run();
    Ok(Redirect::to(&format!("/console/runs/{}", run.id)).into_response())
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

    /// Past its deadline the search gives up on the smallest diff: what is shown still reads
    /// back into both versions, with more lines marked than needed. Two versions of the
    /// largest size that share no line would otherwise hold a thread for minutes.
    #[test]
    fn a_diff_past_its_deadline_is_whole_but_not_the_smallest() {
        let old = format!("x\n{}", "a\n".repeat(1000));
        let new = format!("{}y\n", "a\n".repeat(1000));
        let kept = |lines: &[DiffLine]| lines.iter().filter(|l| l.class == "same").count();
        let side = |lines: &[DiffLine], keep: &str| {
            lines
                .iter()
                .filter(|l| l.class == "same" || l.class == keep)
                .map(|l| format!("{}\n", l.text))
                .collect::<String>()
        };
        let smallest = line_diff(&old, &new);
        assert_eq!(kept(&smallest), 1000);
        let given_up = line_diff_within(&old, &new, std::time::Duration::ZERO);
        assert_eq!(kept(&given_up), 0, "the search stopped at once");
        for lines in [&smallest, &given_up] {
            assert_eq!(side(lines, "del"), old);
            assert_eq!(side(lines, "ins"), new);
        }
    }
}
