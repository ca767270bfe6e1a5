//! The project's policy (read by everyone, replaced or reset by an admin, with the validation
//! error naming the line) and its audit log with the result of verifying the whole chain.
//! Both go through the API's own functions.

use askama::Template;
use axum::Form;
use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect};
use wor_core::ProjectId;
use wor_core::audit::Verification;

use super::pages::{Banner, PageResult, form};
use super::session::ConsoleMember;
use super::{ConsoleError, render};
use crate::AppState;
use crate::error::ApiError;
use crate::routes::policy::{current, set_policy};
use crate::views::rfc3339;

#[derive(Template)]
#[template(path = "console/policy.html")]
struct PolicyPage {
    banner: Banner,
    text: String,
    is_default: bool,
    updated_at: String,
    can_edit: bool,
    /// Why the submitted text was refused (it names the line), with the text kept in the form.
    error: Option<String>,
}

async fn policy_page(
    state: &AppState,
    member: &ConsoleMember,
    status: StatusCode,
    submitted: Option<(String, String)>,
) -> PageResult {
    let policy = current(state, member.session.project_id).await?;
    let (text, error) = match submitted {
        Some((text, error)) => (text, Some(error)),
        None => (policy.text, None),
    };
    Ok(render(
        status,
        &PolicyPage {
            banner: member.into(),
            text,
            is_default: policy.is_default,
            updated_at: policy.updated_at.unwrap_or_default(),
            can_edit: member.session.role.can_configure(),
            error,
        },
    ))
}

pub async fn policy(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    policy_page(&state, &member, StatusCode::OK, None).await
}

#[derive(Debug, serde::Deserialize)]
pub struct PolicyForm {
    #[serde(default)]
    text: String,
    /// `save` (the default) or `reset` to the built-in policy.
    #[serde(default)]
    action: Option<String>,
}

pub async fn set(
    State(state): State<AppState>,
    member: ConsoleMember,
    body: Result<Form<PolicyForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let text = match body.action.as_deref() {
        None | Some("save") => Some(body.text.as_str()),
        Some("reset") => None,
        Some(_) => {
            return Err(ConsoleError(ApiError::bad_request(
                "invalid_form",
                "`action` is `save` or `reset`",
            )));
        }
    };
    let session = &member.session;
    match set_policy(
        &state,
        session.project_id,
        session.role,
        member.actor(),
        None,
        text,
    )
    .await
    {
        Ok(()) => Ok(Redirect::to("/console/policy").into_response()),
        // A policy that does not validate: the form again, with the text and the error.
        Err(ApiError::BadRequest { message, .. }) => {
            policy_page(
                &state,
                &member,
                StatusCode::BAD_REQUEST,
                Some((body.text, message)),
            )
            .await
        }
        Err(other) => Err(ConsoleError(other)),
    }
}

/// Audit entries on one page.
const AUDIT_PAGE: i64 = 100;

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    #[serde(default)]
    after: i64,
    /// Verify the whole chain on this view: it reads every entry of the project's log.
    #[serde(default)]
    verify: bool,
}

/// The projects whose chain a console view is verifying. A verification reads every entry of a
/// project's log: one at a time for a project, and a view that asks meanwhile is told so
/// rather than queued.
static VERIFYING: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<ProjectId>>> =
    std::sync::LazyLock::new(Default::default);

/// A project's turn to verify its chain, given back when dropped.
struct VerifyingTurn(ProjectId);

impl VerifyingTurn {
    /// The turn, unless a verification of `project`'s chain is running.
    fn take(project: ProjectId) -> Option<Self> {
        let mut verifying = VERIFYING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        verifying.insert(project).then(|| Self(project))
    }
}

impl Drop for VerifyingTurn {
    fn drop(&mut self) {
        VERIFYING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.0);
    }
}

struct AuditRow {
    seq: i64,
    at: String,
    category: String,
    actor: String,
    subjects: String,
    payload: String,
}

#[derive(Template)]
#[template(path = "console/audit.html")]
struct AuditPage {
    banner: Banner,
    intact: bool,
    /// The verification's result in words.
    verdict: String,
    entries: Vec<AuditRow>,
    next_after: Option<i64>,
}

pub async fn audit(
    State(state): State<AppState>,
    member: ConsoleMember,
    query: Result<Query<AuditQuery>, QueryRejection>,
) -> PageResult {
    let Query(query) =
        query.map_err(|e| ConsoleError(ApiError::bad_request("invalid_query", e.body_text())))?;
    if query.after < 0 {
        return Err(ConsoleError(ApiError::bad_request(
            "invalid_query",
            "`after` must be 0 or more",
        )));
    }
    let project = member.session.project_id;
    let turn = query.verify.then(|| VerifyingTurn::take(project));
    let verification = match &turn {
        Some(Some(_)) => Some(
            state
                .store
                .verify_audit_chain(project, &state.audit.verifying_key(), &[])
                .await?,
        ),
        _ => None,
    };
    drop(turn);
    let (intact, verdict) = match (query.verify, verification) {
        (false, _) => (
            true,
            "not run on this view; it reads every entry of the log.".to_owned(),
        ),
        (true, None) => (
            true,
            "another view is verifying this chain; ask again in a moment.".to_owned(),
        ),
        (true, Some(Verification::Intact(summary))) => (
            true,
            format!(
                "Intact: {} entries, {} signed checkpoints{}; {} entries after the last checkpoint rest on the hash chain alone.",
                summary.entries,
                summary.checkpoints,
                summary
                    .last_checkpoint_seq
                    .map(|s| format!(" (the last at entry {s})"))
                    .unwrap_or_default(),
                summary.unsigned_tail
            ),
        ),
        (true, Some(Verification::Broken(at))) => (false, format!("Broken at {at}.")),
    };
    let entries = state
        .store
        .audit_entries(project, query.after, AUDIT_PAGE)
        .await?;
    let next_after = (i64::try_from(entries.len()).unwrap_or(0) == AUDIT_PAGE)
        .then(|| entries.last().map(|e| e.seq))
        .flatten();
    let entries = entries
        .into_iter()
        .map(|e| AuditRow {
            seq: e.seq,
            at: rfc3339(e.at),
            category: e.category,
            actor: pretty(&e.actor),
            subjects: pretty(&e.subjects),
            payload: pretty(&e.payload),
        })
        .collect();
    Ok(render(
        StatusCode::OK,
        &AuditPage {
            banner: (&member).into(),
            intact,
            verdict,
            entries,
            next_after,
        },
    ))
}

/// A value as pretty JSON text.
fn pretty<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_projects_chain_is_verified_by_one_view_at_a_time() {
        let (one, other) = (ProjectId::new(), ProjectId::new());
        let turn = VerifyingTurn::take(one);
        assert!(turn.is_some());
        assert!(VerifyingTurn::take(one).is_none(), "one view at a time");
        let elsewhere = VerifyingTurn::take(other);
        assert!(elsewhere.is_some(), "another project's view goes on");
        drop(turn);
        assert!(VerifyingTurn::take(one).is_some(), "the turn comes back");
    }
}
