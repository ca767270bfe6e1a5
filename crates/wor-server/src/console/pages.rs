//! The console's pages and forms. Handlers parse, call the same store and engine functions
//! the API calls, and render; the separation-of-duties rules live in the engine only.

use std::collections::{BTreeSet, HashMap};

use askama::Template;
use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, Query, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use rand::TryRngCore;
use serde_json::{Value, json};
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::run::IdempotencyKey;
use wor_core::step::Step;
use wor_core::{ApprovalId, RoutineId, RunId};
use wor_engine::Approver;
use wor_store::{ApprovalAnswer, ApprovalFilter, ApprovalRecord, ApprovalStatus, SessionOrigin};

use super::client::ClientAddress;
use super::password::{check_new_password, hash_password, verify_password};
use super::session::{
    ConsoleMember, FORM_COOKIE, HeldFormToken, MaybeConsoleMember, SESSION_COOKIE, safe_next,
    set_cookie,
};
use super::{ConsoleConfig, ConsoleError, INBOX_LIMIT, INBOX_PAGE, PagePath, millis, render};
use crate::AppState;
use crate::error::ApiError;
use crate::views::rfc3339;

pub(super) type PageResult = Result<Response, ConsoleError>;

pub(super) fn form<T>(form: Result<Form<T>, FormRejection>) -> Result<T, ConsoleError> {
    form.map(|Form(value)| value)
        .map_err(|e| ConsoleError(ApiError::bad_request("invalid_form", e.body_text())))
}

/// A random token for a form: one before sign-in, or a start form's `start_key`.
pub(super) fn form_token() -> Result<String, ConsoleError> {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.try_fill_bytes(&mut bytes).map_err(|_| {
        tracing::error!(category = "console", "random source failed");
        ConsoleError(ApiError::Internal)
    })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The idempotency key of a start that a console form sent: its page's `start_key` (a
/// random value rendered with the form) hashed with the form's `fields` as sent, so the same
/// form sent again (a second click, a reload that posts again) starts one run and goes to it,
/// while the form sent with other fields starts another. None when the form has no key.
pub(super) fn start_form_key(page_key: &str, fields: &[&str]) -> Option<IdempotencyKey> {
    if page_key.is_empty() {
        return None;
    }
    let mut sent = Vec::new();
    for field in std::iter::once(page_key).chain(fields.iter().copied()) {
        // As eight bytes on every platform: servers of one database hash alike.
        sent.extend_from_slice(&u64::try_from(field.len()).unwrap_or(u64::MAX).to_le_bytes());
        sent.extend_from_slice(field.as_bytes());
    }
    // A digest's hex under a prefix is always a key.
    format!("console-{}", wor_core::canonical::sha256_hex(&sent))
        .parse()
        .ok()
}

/// A start form's `start_key` for a member who may start runs; none for one who sees no form.
pub(super) fn start_key_for(may_start: bool) -> Result<String, ConsoleError> {
    if may_start {
        form_token()
    } else {
        Ok(String::new())
    }
}

/// Who is signed in, for the page header.
pub(super) struct Banner {
    pub(super) name: String,
    pub(super) role: String,
    pub(super) csrf: String,
}

impl From<&ConsoleMember> for Banner {
    fn from(member: &ConsoleMember) -> Self {
        Banner {
            name: member.session.member_name.clone(),
            role: member.session.role.to_string(),
            csrf: member.session.csrf_token.clone(),
        }
    }
}

pub async fn home(MaybeConsoleMember(member): MaybeConsoleMember) -> Response {
    match member {
        Some(_) => Redirect::to("/console/approvals").into_response(),
        None => Redirect::to("/console/sign-in").into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// Sign-in and sign-out

#[derive(Template)]
#[template(path = "console/sign_in.html")]
struct SignInPage {
    csrf: String,
    /// The console page to return to after sign-in (already checked by `safe_next`).
    next: String,
    project: String,
    name: String,
    notice: Option<&'static str>,
    error: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
pub struct SignInQuery {
    #[serde(default)]
    project: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    password_set: Option<String>,
    /// Set when a form was sent with a session that had ended ([`super::session::SESSION_ENDED_PAGE`]).
    #[serde(default)]
    session_ended: Option<String>,
    #[serde(default)]
    next: String,
}

/// Where a member goes after sign-in: the page they asked for, when it is one of this
/// console's, else the inbox.
fn after_sign_in(next: &str) -> &str {
    safe_next(next).unwrap_or("/console/approvals")
}

/// A page with a form for someone not signed in (`csrf` picks the page's token field): a
/// fresh form token, in the page and in its own cookie.
pub(super) fn form_page<T: askama::Template>(
    config: &ConsoleConfig,
    status: StatusCode,
    mut page: T,
    csrf: impl FnOnce(&mut T) -> &mut String,
    held: HeldFormToken,
) -> Result<Response, ConsoleError> {
    let token = match held.0 {
        Some(token) => token,
        None => form_token()?,
    };
    csrf(&mut page).clone_from(&token);
    let mut response = render(status, &page);
    response.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(config, FORM_COOKIE, &token, "/console", None),
    );
    Ok(response)
}

/// The sign-in form, with a fresh form token in its own cookie.
fn sign_in_form(
    config: &ConsoleConfig,
    status: StatusCode,
    page: SignInPage,
    held: HeldFormToken,
) -> Result<Response, ConsoleError> {
    form_page(config, status, page, |p| &mut p.csrf, held)
}

pub async fn sign_in_page(
    State(state): State<AppState>,
    MaybeConsoleMember(member): MaybeConsoleMember,
    held: HeldFormToken,
    query: Result<Query<SignInQuery>, axum::extract::rejection::QueryRejection>,
) -> PageResult {
    let query = query.map(|Query(q)| q).unwrap_or_default();
    // A member who just set a password through an invitation is asked to sign in with it,
    // even in a browser signed in as someone else (whose session signing in replaces).
    if member.is_some() && query.password_set.is_none() {
        return Ok(Redirect::to(after_sign_in(&query.next)).into_response());
    }
    sign_in_form(
        &state.console,
        StatusCode::OK,
        SignInPage {
            csrf: String::new(),
            next: safe_next(&query.next).unwrap_or_default().to_owned(),
            project: query.project,
            name: query.name,
            notice: match (&query.password_set, &query.session_ended) {
                (Some(_), _) => Some("Your password is set. Sign in with it."),
                (None, Some(_)) => {
                    Some("Your session ended, so what you last sent was not done. Sign in again.")
                }
                (None, None) => None,
            },
            error: None,
        },
        held,
    )
}

#[derive(Debug, serde::Deserialize)]
pub struct SignInForm {
    project: String,
    name: String,
    password: String,
    #[serde(default)]
    next: String,
}

/// The one message for an unknown project, an unknown member, a member without a password
/// and a wrong password, so the form tells nobody which names exist.
const SIGN_IN_REFUSED: &str = "That project, name and password do not match.";

/// What a locked-out client is told: the configured lockout window, in words.
fn locked_out(lockout: std::time::Duration) -> String {
    let seconds = lockout.as_secs().max(1);
    let (count, unit) = if seconds.is_multiple_of(3600) {
        (seconds / 3600, "hour")
    } else if seconds.is_multiple_of(60) {
        (seconds / 60, "minute")
    } else {
        (seconds, "second")
    };
    let plural = if count == 1 { "" } else { "s" };
    format!("Too many failed sign-ins. Wait {count} {unit}{plural}, then try again.")
}

pub async fn sign_in(
    State(state): State<AppState>,
    parts: Parts,
    held: HeldFormToken,
    body: Result<Form<SignInForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let config = &state.console;
    let client = ClientAddress::of(&parts, &config.trusted_proxies);
    let address = client.text();
    let account_scope = format!("account:{}\n{}", body.project, body.name);
    let address_scope = format!("address:{}", client.lockout_key());
    let now = wor_store::now_millis();
    let since = now.saturating_sub(millis(config.lockout));
    // Sign-in state that can no longer be used is deleted as sign-ins happen.
    state
        .store
        .purge_console_state(now, millis(config.session_idle), since)
        .await?;
    // The attempt counts as a failure before the password is checked, so attempts sent at
    // once cannot all pass the count; a right password takes it back.
    let reserved = state
        .store
        .reserve_sign_in_attempt(
            &[
                (&account_scope, i64::from(config.max_failures_per_account)),
                (&address_scope, i64::from(config.max_failures_per_address)),
            ],
            since,
        )
        .await?;
    let locked = reserved.is_none();
    let account = if locked {
        None
    } else {
        state
            .store
            .sign_in_account(&body.project, &body.name)
            .await?
    };
    let verified = !locked
        && verify_password(
            config,
            account.as_ref().map(|a| a.phc.clone()),
            body.password,
        )
        .await
        .map_err(|error| {
            tracing::error!(category = "console", error = %error, "a password could not be checked");
            ConsoleError(ApiError::Internal)
        })?;
    let account = match account {
        Some(account) if verified => account,
        _ => {
            // Attempts refused by the lockout are not audited one by one: the failure that
            // reached the limit was, and nobody can write to the chain without a limit.
            let audited = if locked {
                None
            } else {
                state.store.project_id_by_name(&body.project).await?
            };
            if let Some(project) = audited {
                state
                    .audit
                    .append(
                        AuditEvent::new(
                            project,
                            AuditCategory::ConsoleSignInFailure,
                            Actor::ConsoleVisitor,
                        )
                        .payload(json!({
                            "name": wor_core::quote::excerpt(&body.name, 100),
                            "address": address,
                            "reason": if locked { "locked_out" } else { "wrong_name_or_password" },
                        })),
                    )
                    .await?;
            }
            tracing::warn!(
                category = "console",
                action = "sign_in.refused",
                locked,
                "a console sign-in was refused"
            );
            let (status, error) = if locked {
                (StatusCode::TOO_MANY_REQUESTS, locked_out(config.lockout))
            } else {
                (StatusCode::UNAUTHORIZED, SIGN_IN_REFUSED.to_owned())
            };
            return sign_in_form(
                config,
                status,
                SignInPage {
                    csrf: String::new(),
                    next: safe_next(&body.next).unwrap_or_default().to_owned(),
                    project: body.project,
                    name: body.name,
                    notice: None,
                    error: Some(error),
                },
                held,
            );
        }
    };
    if let Some(at) = reserved {
        state
            .store
            .release_sign_in_attempt(&[&address_scope], at)
            .await?;
    }
    state
        .store
        .clear_sign_in_failures(&account_scope, since)
        .await?;
    open_session(
        &state,
        &parts,
        account.project_id,
        account.member_id,
        address,
        None,
        after_sign_in(&body.next),
    )
    .await
}

/// Opens a console session for `member` (whose credential the caller checked), audits the
/// sign-in (`via` names a way other than the password), and sends the browser to `target`
/// with the session cookie set and the form cookie cleared.
pub(super) async fn open_session(
    state: &AppState,
    parts: &Parts,
    project: wor_core::ProjectId,
    member: wor_core::MemberId,
    address: String,
    via: Option<&'static str>,
    target: &str,
) -> PageResult {
    let config = &state.console;
    let origin = SessionOrigin {
        address: address.clone(),
        user_agent: parts
            .headers
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned(),
    };
    let mut payload = json!({ "address": address });
    if let (Some(via), Some(fields)) = (via, payload.as_object_mut()) {
        fields.insert("via".to_owned(), Value::from(via));
    }
    // The entry is staged with the session: a crash before it is appended leaves it for the
    // audit writer's sweep, never a session without its entry.
    let recorded = AuditEvent::new(
        project,
        AuditCategory::ConsoleSignIn,
        Actor::ConsoleMember { member_id: member },
    )
    .subject("member_id", member)
    .payload(payload);
    let (token, staged) = state
        .store
        .create_console_session_staged(
            project,
            member,
            millis(config.session_absolute),
            &origin,
            Some(recorded),
        )
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "console", action = "sign_in", project_id = %project,
        member_id = %member, "a member signed in to the console");
    let mut response = Redirect::to(target).into_response();
    let headers = response.headers_mut();
    headers.append(
        header::SET_COOKIE,
        set_cookie(
            config,
            SESSION_COOKIE,
            token.expose(),
            "/",
            Some(millis(config.session_absolute) / 1000),
        ),
    );
    Ok(response)
}

pub async fn sign_out(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    let recorded = AuditEvent::new(
        member.session.project_id,
        AuditCategory::ConsoleSignOut,
        member.actor(),
    )
    .subject("member_id", member.session.member_id);
    let staged = state
        .store
        .end_console_session(&member.token, recorded)
        .await?;
    state.engine.append_staged_or_log(staged).await;
    let mut response = Redirect::to("/console/sign-in").into_response();
    response.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(&state.console, SESSION_COOKIE, "", "/", Some(0)),
    );
    Ok(response)
}

// ---------------------------------------------------------------------------------------------
// Invitations

#[derive(Template)]
#[template(path = "console/invitation.html")]
struct InvitationPage {
    csrf: String,
    member_name: String,
    expires_at: String,
    min_chars: usize,
    error: Option<String>,
}

fn invitation_gone() -> ConsoleError {
    ConsoleError(ApiError::LinkGone(
        "This invitation link cannot be used: it was used already, it expired, or a newer link replaced it. Ask an admin of your project for a new one.",
    ))
}

fn invitation_form(
    config: &ConsoleConfig,
    status: StatusCode,
    page: InvitationPage,
    held: HeldFormToken,
) -> Result<Response, ConsoleError> {
    form_page(config, status, page, |p| &mut p.csrf, held)
}

pub async fn invitation_page(
    State(state): State<AppState>,
    Path(token): Path<String>,
    held: HeldFormToken,
) -> PageResult {
    let invitation = state
        .store
        .invitation(&token)
        .await?
        .ok_or_else(invitation_gone)?;
    invitation_form(
        &state.console,
        StatusCode::OK,
        InvitationPage {
            csrf: String::new(),
            member_name: invitation.member_name,
            expires_at: rfc3339(invitation.expires_at),
            min_chars: super::password::MIN_PASSWORD_CHARS,
            error: None,
        },
        held,
    )
}

#[derive(Debug, serde::Deserialize)]
pub struct SetPasswordForm {
    password: String,
    repeat: String,
}

pub async fn accept_invitation(
    State(state): State<AppState>,
    Path(token): Path<String>,
    held: HeldFormToken,
    body: Result<Form<SetPasswordForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let invitation = state
        .store
        .invitation(&token)
        .await?
        .ok_or_else(invitation_gone)?;
    if let Err(rule) = check_new_password(&body.password, &body.repeat, &invitation.member_name) {
        return invitation_form(
            &state.console,
            StatusCode::BAD_REQUEST,
            InvitationPage {
                csrf: String::new(),
                member_name: invitation.member_name,
                expires_at: rfc3339(invitation.expires_at),
                min_chars: super::password::MIN_PASSWORD_CHARS,
                error: Some(rule.to_string()),
            },
            held,
        );
    }
    let phc = hash_password(&state.console, body.password)
        .await
        .map_err(|error| {
            tracing::error!(category = "console", error = %error, "a password could not be hashed");
            ConsoleError(ApiError::Internal)
        })?;
    // The entry is staged with the password: a crash before it is appended leaves it for the
    // audit writer's sweep.
    let entry = |invitation: &wor_store::InvitationRecord| {
        AuditEvent::new(
            invitation.project_id,
            AuditCategory::MemberSetPassword,
            Actor::ConsoleMember {
                member_id: invitation.member_id,
            },
        )
        .subject("member_id", invitation.member_id)
    };
    let (accepted, staged) = state
        .store
        .accept_invitation(&token, &phc, &entry)
        .await?
        .ok_or_else(invitation_gone)?;
    state.engine.append_staged_or_log([staged]).await;
    let project = state.store.get_project(accepted.project_id).await?;
    let target = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("project", &project.name)
        .append_pair("name", &accepted.member_name)
        .append_pair("password_set", "1")
        .finish();
    // The form cookie stays: another form before sign-in, open in another tab, still works.
    Ok(Redirect::to(&format!("/console/sign-in?{target}")).into_response())
}

// ---------------------------------------------------------------------------------------------
// Approvals

/// One argument of a held call, as the tool will receive it.
struct ArgumentRow {
    name: String,
    value: String,
    pinned: bool,
    /// Where its values can have come from, as the decision labelled them; `None` for calls
    /// held before arguments were labelled.
    source: Option<String>,
    /// Some value of it appears in untrusted content.
    untrusted: bool,
    /// The approver's edit set it: the model's value is not what the tool receives.
    edited: bool,
    /// Its name or value holds characters that would hide or reorder text, shown escaped.
    hidden: bool,
}

struct ApprovalCard {
    id: String,
    run_id: String,
    tool: String,
    kind: String,
    arguments: Vec<ArgumentRow>,
    policies: Vec<String>,
    reasons: Vec<String>,
    untrusted_sources: Vec<SourceLink>,
    routine: String,
    routine_version: i64,
    run_input: String,
    requested_at: String,
    expires_at: String,
    expires_in: String,
    binding_hash: String,
    /// Why this member may not decide; `None` when they may.
    refusal: Option<String>,
    /// `pending`, or how it was settled.
    status: String,
    /// Who decided, when and why, once decided.
    decision: Option<String>,
}

#[derive(Template)]
#[template(path = "console/approvals.html")]
struct ApprovalsPage {
    banner: Banner,
    approvals: Vec<ApprovalCard>,
    /// The `before` of the next, older page, when there is one.
    older: Option<String>,
    /// This is not the newest page.
    paged: bool,
    /// On the newest page, what it showed, for its event stream to compare with.
    seen: Option<String>,
}

/// One approval on a page of its own: where an email's link leads.
#[derive(Template)]
#[template(path = "console/approval.html")]
struct ApprovalPage {
    banner: Banner,
    a: ApprovalCard,
    /// The edit-and-approve form, for a pending call held by policy this member may decide.
    edit: Option<EditForm>,
}

/// The form that corrects a held call's arguments and approves the edited call.
struct EditForm {
    fields: Vec<EditField>,
    /// What is wrong with the edit as a whole (policy denies it, it changes nothing).
    error: Option<String>,
    reason: String,
}

/// One argument in the edit form: pinned ones are shown, never sent.
struct EditField {
    /// The field's position, for its element ids.
    index: usize,
    name: String,
    /// The value as the approver edits it: a string as it is, anything else as JSON.
    text: String,
    /// Edited as JSON (the value is not a string).
    json: bool,
    pinned: bool,
    error: Option<String>,
    /// Its text holds characters that would hide or reorder text, shown escaped.
    hidden: bool,
}

/// The form's name of argument `name`'s field.
const ARGUMENT_FIELD: &str = "arg.";

/// Whether `text` has line breaks and every one is CRLF.
fn breaks_are_crlf(text: &str) -> bool {
    text.contains("\r\n") && !text.replace("\r\n", "").contains(['\r', '\n'])
}

/// Whether argument `name` or any string or key of its `value` holds a character that would
/// hide or reorder text. Iterative, so any depth is safe.
fn holds_hidden(name: &str, value: &Value) -> bool {
    let hides = |text: &str| text.chars().any(wor_core::text::is_hidden);
    if hides(name) {
        return true;
    }
    let mut pending = vec![value];
    while let Some(value) = pending.pop() {
        match value {
            Value::String(text) if hides(text) => return true,
            Value::Array(items) => pending.extend(items),
            Value::Object(map) => {
                if map.keys().any(|key| hides(key)) {
                    return true;
                }
                pending.extend(map.values());
            }
            _ => {}
        }
    }
    false
}

/// `text` as the page shows it, what would hide in it escaped (as [`super::Shown`] writes it).
fn shown_text(text: &str) -> std::borrow::Cow<'_, str> {
    wor_core::text::shown(text, |_| false)
}

/// Whether `a` and `b` hold the same lines, whichever of CRLF, CR or LF breaks them.
fn same_lines(a: &str, b: &str) -> bool {
    let lines = |text: &str| text.replace("\r\n", "\n").replace('\r', "\n");
    lines(a) == lines(b)
}

fn edit_form(approval: &ApprovalRecord) -> EditForm {
    let fields = match &approval.arguments {
        Value::Object(arguments) => arguments
            .iter()
            .enumerate()
            .map(|(index, (name, value))| EditField {
                index,
                name: name.clone(),
                // A string as it is (the page's escaper shows what would hide in it), anything
                // else as JSON whose hidden characters are JSON escapes, so it reads back the same.
                text: match value {
                    Value::String(text) => text.clone(),
                    other => wor_core::text::json_shown(other),
                },
                json: !value.is_string(),
                pinned: approval.pinned_keys.contains(name),
                error: None,
                hidden: value
                    .as_str()
                    .is_some_and(|text| text.chars().any(wor_core::text::is_hidden)),
            })
            .collect(),
        _ => Vec::new(),
    };
    EditForm {
        fields,
        error: None,
        reason: String::new(),
    }
}

/// Whether `member` gets the edit form for `approval` as the card shows it.
fn editable(approval: &ApprovalRecord, card: &ApprovalCard) -> bool {
    approval.status == ApprovalStatus::Pending
        && approval.kind == wor_store::ApprovalKind::Policy
        && card.refusal.is_none()
        && names_are_told_apart(&approval.arguments)
}

/// Whether every argument's name, as a page shows it (what would hide in it escaped), is one
/// no other argument's name shows as: the edit form's fields are named so, and a field must
/// reach the one argument it was shown for. A name holding a right-to-left override and a name
/// holding the text of its escape show alike; such a call is not edited on a page.
fn names_are_told_apart(arguments: &Value) -> bool {
    let Value::Object(arguments) = arguments else {
        return true;
    };
    let shown: BTreeSet<std::borrow::Cow<'_, str>> =
        arguments.keys().map(|name| shown_text(name)).collect();
    shown.len() == arguments.len()
}

/// A JSON value as the text a person reads: strings as they are, the rest as JSON.
pub(super) fn text_of(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => serde_json::to_string_pretty(other).unwrap_or_default(),
    }
}

fn texts(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::Array(items)) => items.iter().map(text_of).collect(),
        Some(Value::Null) | None => Vec::new(),
        Some(other) => vec![text_of(other)],
    }
}

/// The arguments the tool receives: the edited call's, once an approver edited it, each
/// edited one marked and its source the edit.
fn argument_rows(approval: &ApprovalRecord) -> Vec<ArgumentRow> {
    let labels = approval
        .why
        .get("argument_sources")
        .filter(|v| !v.is_null())
        .and_then(|v| {
            serde_json::from_value::<wor_core::provenance::ArgumentLabels>(v.clone()).ok()
        })
        .unwrap_or_default();
    match approval.arguments_sent() {
        Value::Object(fields) => fields
            .iter()
            .map(|(name, value)| {
                let edited = approval.edited_to(name, value);
                let label = labels.0.get(name).filter(|_| !edited);
                ArgumentRow {
                    name: name.clone(),
                    value: wor_core::text::json_shown(value),
                    pinned: approval.pinned_keys.contains(name),
                    source: if edited {
                        Some("the approver's edit".to_owned())
                    } else {
                        label.map(wor_core::provenance::ArgumentLabel::describe)
                    },
                    untrusted: label.is_some_and(wor_core::provenance::ArgumentLabel::untrusted),
                    edited,
                    hidden: holds_hidden(name, value),
                }
            })
            .collect(),
        other => vec![ArgumentRow {
            name: "(arguments)".to_owned(),
            value: serde_json::to_string_pretty(other).unwrap_or_default(),
            pinned: false,
            source: None,
            untrusted: false,
            edited: false,
            hidden: holds_hidden("", other),
        }],
    }
}

fn time_left(expires_at: i64) -> String {
    let minutes = (expires_at - wor_store::now_millis()) / 60_000;
    match minutes {
        m if m <= 0 => "less than a minute".to_owned(),
        m if m < 120 => format!("{m} min"),
        m => format!("{} h {} min", m / 60, m % 60),
    }
}

/// The requester's input among a run's `steps`, as text.
fn run_input(steps: &[wor_store::RunStep]) -> String {
    steps
        .iter()
        .find_map(|s| match &s.step {
            Step::Input(input) => Some(input.text()),
            _ => None,
        })
        .unwrap_or_default()
}

/// An untrusted source that was in context when a call was held, and the step it came from.
struct SourceLink {
    name: String,
    step: Option<i64>,
}

fn approver(member: &ConsoleMember) -> Approver {
    Approver {
        key_id: None,
        member_id: Some(member.session.member_id),
        role: member.session.role,
    }
}

/// Which page of the inbox: the held calls older than `before` (an `apr_…` id), or the newest.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboxQuery {
    #[serde(default)]
    before: String,
}

pub async fn approvals(
    State(state): State<AppState>,
    member: ConsoleMember,
    query: Result<Query<InboxQuery>, axum::extract::rejection::QueryRejection>,
) -> PageResult {
    let Query(query) =
        query.map_err(|e| ConsoleError(ApiError::bad_request("invalid_query", e.body_text())))?;
    let before = match query.before.trim() {
        "" => None,
        id => Some(id.parse::<ApprovalId>().map_err(|_| {
            ConsoleError(ApiError::bad_request(
                "invalid_query",
                "`before` is not an approval id",
            ))
        })?),
    };
    let project = member.session.project_id;
    // One more than a page, to know whether an older page exists.
    let mut pending = state
        .store
        .list_approvals(
            project,
            &ApprovalFilter {
                status: Some(ApprovalStatus::Pending),
                run_id: None,
                before,
                limit: INBOX_PAGE + 1,
            },
        )
        .await?;
    let seen = before
        .is_none()
        .then(|| super::live::inbox_fingerprint(pending.iter().map(|a| &a.id)));
    let older = (pending.len() > INBOX_PAGE as usize).then(|| {
        pending.truncate(INBOX_PAGE as usize);
        pending.last().map(|a| a.id.to_string()).unwrap_or_default()
    });
    let cards = approval_cards(&state, &member, pending).await?;
    Ok(render(
        StatusCode::OK,
        &ApprovalsPage {
            banner: (&member).into(),
            approvals: cards,
            older,
            paged: before.is_some(),
            seen,
        },
    ))
}

/// The page of one approval, pending or settled; another project's is the 404 page.
pub async fn approval(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ApprovalId>,
) -> PageResult {
    let approval = state
        .store
        .get_approval(member.session.project_id, id)
        .await?;
    let card = approval_card(&state, &member, approval.clone()).await?;
    let edit = editable(&approval, &card).then(|| edit_form(&approval));
    Ok(render(
        StatusCode::OK,
        &ApprovalPage {
            banner: (&member).into(),
            a: card,
            edit,
        },
    ))
}

/// Edits a held call's arguments and approves the edited call, under the API's rules (the
/// engine's [`wor_engine::Engine::approve_edited`]): a field that is not valid JSON, an
/// argument the tool's schema refuses, or an edit policy denies is shown on the form again,
/// by field, and nothing is decided.
pub async fn edit_and_approve(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ApprovalId>,
    body: Result<Form<Vec<(String, String)>>, FormRejection>,
) -> PageResult {
    let fields = form(body)?;
    let project = member.session.project_id;
    let approval = state.store.get_approval(project, id).await?;
    // Who may edit is who may decide: anyone else learns nothing of their edit.
    if let Some(refusal) = state
        .engine
        .approval_refusal(project, &approval, approver(&member))
        .await?
    {
        return Err(ConsoleError(refusal.into()));
    }
    if approval.status != wor_store::ApprovalStatus::Pending {
        return Err(ConsoleError(
            wor_engine::EngineError::from(wor_engine::DecisionRefusal::NotPending(approval.status))
                .into(),
        ));
    }
    if !names_are_told_apart(&approval.arguments) {
        return Err(ConsoleError(ApiError::bad_request(
            "invalid_form",
            "two of this call's arguments show the same name, so a field cannot be told to \
             reach one of them: approve or deny the call as it is",
        )));
    }
    let mut shown = edit_form(&approval);
    let mut edits = serde_json::Map::new();
    for (key, text) in &fields {
        if key == "reason" {
            shown.reason.clone_from(text);
            continue;
        }
        let Some(name) = key.strip_prefix(ARGUMENT_FIELD) else {
            continue;
        };
        // A name holding characters that would hide was shown, and so sent back, escaped.
        let name = approval
            .arguments
            .as_object()
            .and_then(|arguments| {
                arguments
                    .keys()
                    .find(|key| key.as_str() == name || shown_text(key) == name)
            })
            .map_or(name, String::as_str);
        // Browsers send a text area's line breaks as CRLF.
        let sent = text;
        let text = sent.replace("\r\n", "\n");
        let original = approval.arguments.get(name);
        let value = if original.is_none_or(Value::is_string) {
            match original.and_then(Value::as_str) {
                // Whatever its line breaks were, a browser sends them all as CRLF: text with
                // the original's lines, as the page showed them (what would hide in them
                // escaped), is the original, left as the model wrote it. An edit is taken as
                // typed: an escape shown there and kept is sent as the text it reads as.
                Some(before)
                    if same_lines(before, sent) || same_lines(&shown_text(before), sent) =>
                {
                    Value::String(before.to_owned())
                }
                // An edit of text whose every line break was CRLF keeps them CRLF.
                Some(before) if breaks_are_crlf(before) => {
                    Value::String(text.replace('\n', "\r\n"))
                }
                _ => Value::String(text.clone()),
            }
        } else {
            match crate::extract::json_field(&text) {
                Ok(value) => value,
                Err(error) => {
                    if let Some(field) = shown
                        .fields
                        .iter_mut()
                        .find(|f| f.name == name && !f.pinned)
                    {
                        field.text = text;
                        field.error = Some(error.to_string());
                    }
                    continue;
                }
            }
        };
        // A pinned argument keeps showing its value; one sent anyway is the engine's to refuse.
        if let Some(field) = shown
            .fields
            .iter_mut()
            .find(|f| f.name == name && !f.pinned)
        {
            field.text = text;
        }
        if original != Some(&value) {
            edits.insert(name.to_owned(), value);
        }
    }
    let (status, error) = if shown.fields.iter().any(|f| f.error.is_some()) {
        (StatusCode::BAD_REQUEST, None)
    } else if edits.is_empty() {
        (
            StatusCode::BAD_REQUEST,
            Some(wor_engine::EditRefusal::Unchanged.to_string()),
        )
    } else {
        match state
            .engine
            .approve_edited(
                project,
                id,
                approver(&member),
                &Value::Object(edits),
                &shown.reason,
            )
            .await
        {
            Ok(decided) => {
                return Ok(
                    Redirect::to(&format!("/console/runs/{}", decided.run_id)).into_response()
                );
            }
            Err(wor_engine::EngineError::EditRefused(refusal)) => {
                let status = ApiError::from(wor_engine::EngineError::EditRefused(refusal.clone()))
                    .status_and_code()
                    .0;
                let mut whole = Vec::new();
                for (argument, message) in refusal.by_argument() {
                    match argument.and_then(|name| shown.fields.iter_mut().find(|f| f.name == name))
                    {
                        Some(field) => field.error = Some(message),
                        None => whole.push(message),
                    }
                }
                if whole.is_empty() && !shown.fields.iter().any(|f| f.error.is_some()) {
                    whole.push(refusal.to_string());
                }
                (status, (!whole.is_empty()).then(|| whole.join("; ")))
            }
            // A missing or overlong reason is the form's to show.
            Err(wor_engine::EngineError::Decision(
                refusal @ (wor_engine::DecisionRefusal::NoReason
                | wor_engine::DecisionRefusal::ReasonTooLong),
            )) => (StatusCode::BAD_REQUEST, Some(refusal.to_string())),
            Err(other) => return Err(other.into()),
        }
    };
    shown.error = error;
    let approval = state.store.get_approval(project, id).await?;
    let card = approval_card(&state, &member, approval).await?;
    Ok(render(
        status,
        &ApprovalPage {
            banner: (&member).into(),
            a: card,
            edit: Some(shown),
        },
    ))
}

/// What the console shows of one approval, for `member`.
async fn approval_card(
    state: &AppState,
    member: &ConsoleMember,
    approval: ApprovalRecord,
) -> Result<ApprovalCard, ConsoleError> {
    approval_cards(state, member, vec![approval])
        .await?
        .pop()
        .ok_or(ConsoleError(ApiError::NotFound))
}

/// What the console shows of each of `approvals`, for `member`, in their order. What the
/// cards need is read for the page at once: their runs in one statement, the runs' input and
/// untrusted steps in another, each routine's name and each starter's key once.
async fn approval_cards(
    state: &AppState,
    member: &ConsoleMember,
    approvals: Vec<ApprovalRecord>,
) -> Result<Vec<ApprovalCard>, ConsoleError> {
    let project = member.session.project_id;
    let run_ids: Vec<RunId> = approvals.iter().map(|a| a.run_id).collect();
    let runs = state.store.get_runs(project, &run_ids).await?;
    let steps = state
        .store
        .input_and_untrusted_steps(project, &run_ids)
        .await?;
    // An approval's run is in its project: one missing was deleted under the page.
    let page_runs = approvals
        .iter()
        .map(|a| runs.get(&a.run_id).ok_or(ConsoleError(ApiError::NotFound)))
        .collect::<Result<Vec<_>, _>>()?;
    let refusals = state
        .engine
        .approval_refusals(project, &page_runs, approver(member))
        .await?;
    let mut routines: HashMap<RoutineId, String> = HashMap::new();
    let mut cards = Vec::with_capacity(approvals.len());
    for ((approval, run), refusal) in approvals.into_iter().zip(page_runs).zip(refusals) {
        let routine = match routines.get(&run.routine_id) {
            Some(name) => name.clone(),
            None => {
                let name = state.store.get_routine(project, run.routine_id).await?.name;
                routines.insert(run.routine_id, name.clone());
                name
            }
        };
        let run_steps = steps.get(&run.id).map(Vec::as_slice).unwrap_or_default();
        cards.push(card_of(state, member, approval, run, routine, run_steps, refusal).await?);
    }
    Ok(cards)
}

/// One card from what [`approval_cards`] read for it.
async fn card_of(
    state: &AppState,
    member: &ConsoleMember,
    approval: ApprovalRecord,
    run: &wor_store::RunRecord,
    routine: String,
    steps: &[wor_store::RunStep],
    refusal: Option<wor_engine::ApproverRefusal>,
) -> Result<ApprovalCard, ConsoleError> {
    let project = member.session.project_id;
    let decision = match approval.status {
        ApprovalStatus::Pending => None,
        ApprovalStatus::Approved | ApprovalStatus::Denied => {
            let who = match approval.decided_by_member {
                Some(id) => match state.store.get_member(project, id).await {
                    Ok(m) => m.name,
                    Err(wor_store::StoreError::NotFound) => id.to_string(),
                    Err(other) => return Err(other.into()),
                },
                None => "a service key".to_owned(),
            };
            Some(format!(
                "{} by {who} at {}: {}",
                if approval.status == ApprovalStatus::Approved {
                    "Approved"
                } else {
                    "Denied"
                },
                approval.decided_at.map(rfc3339).unwrap_or_default(),
                approval.decision_reason.as_deref().unwrap_or_default()
            ))
        }
        ApprovalStatus::Expired => {
            Some("Expired without a decision: the call did not run.".to_owned())
        }
        ApprovalStatus::Cancelled => {
            Some("Cancelled: the run ended before anyone decided.".to_owned())
        }
    };
    Ok(ApprovalCard {
        id: approval.id.to_string(),
        run_id: run.id.to_string(),
        tool: approval.tool.clone(),
        kind: approval.kind.as_str().to_owned(),
        arguments: argument_rows(&approval),
        policies: texts(approval.why.get("determining_policies")),
        reasons: texts(approval.why.get("reasons")),
        untrusted_sources: texts(approval.why.get("untrusted_sources"))
            .into_iter()
            .map(|name| SourceLink {
                step: untrusted_step_of(steps, &name),
                name,
            })
            .collect(),
        routine,
        routine_version: run.routine_version,
        run_input: run_input(steps),
        requested_at: rfc3339(approval.requested_at),
        expires_at: rfc3339(approval.expires_at),
        expires_in: time_left(approval.expires_at),
        binding_hash: approval.binding_hash,
        refusal: refusal.map(|refusal| refusal.to_string()),
        status: approval.status.as_str().to_owned(),
        decision,
    })
}

#[derive(Debug, serde::Deserialize)]
pub struct DecideForm {
    reason: String,
}

pub async fn decide(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath((id, verdict)): PagePath<(ApprovalId, String)>,
    body: Result<Form<DecideForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let verdict = match verdict.as_str() {
        "approve" => ApprovalAnswer::Approve,
        "deny" => ApprovalAnswer::Deny,
        _ => return Err(ConsoleError(ApiError::NotFound)),
    };
    // The API's own path: the engine looks the approval up in the session's project and
    // applies separation of duties.
    let decided = state
        .engine
        .decide_approval(
            member.session.project_id,
            id,
            approver(&member),
            verdict,
            &body.reason,
        )
        .await?;
    Ok(Redirect::to(&format!("/console/runs/{}", decided.run_id)).into_response())
}

// ---------------------------------------------------------------------------------------------
// Runs

struct StepRow {
    seq: i64,
    kind: String,
    provenance: String,
    /// Where the content came from, in words: the requester, the model, which tool.
    source: String,
    at: String,
    text: String,
}

/// One budget of a run: what it used against what its routine allows.
struct BudgetRow {
    name: &'static str,
    used: u64,
    allowed: u64,
    /// `used` as a whole percentage of `allowed`, at most 100, for the bar.
    percent: u64,
}

impl BudgetRow {
    fn new(name: &'static str, used: u64, allowed: u64) -> Self {
        let percent = if allowed == 0 {
            100
        } else {
            u64::try_from((u128::from(used) * 100 / u128::from(allowed)).min(100)).unwrap_or(100)
        };
        BudgetRow {
            name,
            used,
            allowed,
            percent,
        }
    }
}

/// Where a step's content came from, as a person reads it.
fn step_source(step: &wor_store::RunStep) -> String {
    match &step.step {
        Step::ToolResult(result) => format!("tool {}", result.tool),
        Step::ToolCall(call) => format!("the tool call of {}", call.tool),
        Step::ApprovalUsed(used) => format!("the approval used of {}", used.tool),
        Step::Input(input) => match input.source {
            Some(source) => source.as_str().to_owned(),
            None => "the run's input".to_owned(),
        },
        Step::Memory(_) => "memory".to_owned(),
        Step::ModelTurn(_) => "the model".to_owned(),
        Step::Output(_) => "the model's answer, checked against the output schema".to_owned(),
        Step::Outcome(_) => "the engine".to_owned(),
    }
}

/// The first step of `steps` each untrusted source (as the policy names it, `tool:NAME`) came
/// from, so the inbox can link to it.
fn untrusted_step_of(steps: &[wor_store::RunStep], source: &str) -> Option<i64> {
    steps
        .iter()
        .find(|s| {
            wor_core::step::untrusted_source(&s.step, s.provenance).as_deref() == Some(source)
        })
        .map(|s| s.seq)
}

struct RunApprovalRow {
    tool: String,
    status: String,
    decision_reason: String,
}

#[derive(Template)]
#[template(path = "console/run.html")]
struct RunPage {
    banner: Banner,
    id: String,
    routine: String,
    routine_version: i64,
    status: String,
    trigger: String,
    outcome: String,
    /// For a routine with `[output] schema`, the validated result, as indented JSON.
    result: String,
    created_at: String,
    finished_at: String,
    turns: u64,
    tool_calls: u64,
    input_tokens: u64,
    output_tokens: u64,
    cost_microdollars: u64,
    /// The cost in US dollars, for reading.
    cost_dollars: String,
    budgets: Vec<BudgetRow>,
    /// Whether this member may cancel the run now (it has not ended, nor been asked to).
    can_cancel: bool,
    cancel_requested: bool,
    /// The run has not ended: the page follows it live.
    active: bool,
    /// The last step shown (0 before the first): the live stream says `changed` at once if
    /// the run has moved on since this page was rendered.
    last_step: i64,
    approvals: Vec<RunApprovalRow>,
    steps: Vec<StepRow>,
}

pub async fn run(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<RunId>,
) -> PageResult {
    let project = member.session.project_id;
    let run = state.store.get_run(project, id).await?;
    let routine = state.store.get_routine(project, run.routine_id).await?;
    let version = state
        .store
        .get_routine_version(project, run.routine_id, run.routine_version)
        .await?;
    let limits = &version.definition.budget;
    let steps = state.store.list_run_steps(project, run.id, 0).await?;
    // Wall time stops while the run waits for a person: up to the park it is in, if any.
    let end = run.finished_at.unwrap_or_else(wor_store::now_millis);
    let end = run.parked_at.map_or(end, |parked| end.min(parked));
    let wall_seconds = run
        .started_at
        .map(|started| (end - started - run.parked_ms).max(0) / 1000)
        .unwrap_or(0);
    let usage = &run.usage;
    let budgets = vec![
        BudgetRow::new("Model turns", usage.turns, limits.turns),
        BudgetRow::new("Tool calls", usage.tool_calls, limits.tool_calls),
        BudgetRow::new("Input tokens", usage.input_tokens, limits.input_tokens),
        BudgetRow::new("Output tokens", usage.output_tokens, limits.output_tokens),
        BudgetRow::new(
            "Cost (µ$)",
            usage.cost_microdollars,
            limits.cost_microdollars,
        ),
        BudgetRow::new(
            "Wall time (s)",
            u64::try_from(wall_seconds).unwrap_or(0),
            limits.wall_seconds,
        ),
    ];
    let approvals = state
        .store
        .list_approvals(
            project,
            &ApprovalFilter {
                status: None,
                run_id: Some(run.id),
                before: None,
                limit: INBOX_LIMIT,
            },
        )
        .await?;
    let result = steps
        .iter()
        .rev()
        .find_map(|s| match &s.step {
            Step::Output(output) => serde_json::to_string_pretty(&output.result).ok(),
            _ => None,
        })
        .unwrap_or_default();
    let page = RunPage {
        banner: (&member).into(),
        id: run.id.to_string(),
        routine: routine.name,
        routine_version: run.routine_version,
        status: run.status.to_string(),
        trigger: run.trigger_kind.as_str().to_owned(),
        outcome: run.outcome.clone().unwrap_or_default(),
        result,
        created_at: rfc3339(run.created_at),
        finished_at: run.finished_at.map(rfc3339).unwrap_or_default(),
        turns: run.usage.turns,
        tool_calls: run.usage.tool_calls,
        input_tokens: run.usage.input_tokens,
        output_tokens: run.usage.output_tokens,
        cost_microdollars: run.usage.cost_microdollars,
        cost_dollars: format!(
            "{}.{:06}",
            run.usage.cost_microdollars / 1_000_000,
            run.usage.cost_microdollars % 1_000_000
        ),
        budgets,
        can_cancel: !run.status.is_terminal()
            && !run.cancel_requested
            && member.session.role.can_operate_runs(),
        cancel_requested: run.cancel_requested,
        active: !run.status.is_terminal(),
        last_step: steps.last().map_or(0, |s| s.seq),
        approvals: approvals
            .into_iter()
            .map(|a| RunApprovalRow {
                tool: a.tool,
                status: a.status.as_str().to_owned(),
                decision_reason: a.decision_reason.unwrap_or_default(),
            })
            .collect(),
        steps: steps
            .into_iter()
            .map(|step| StepRow {
                source: step_source(&step),
                seq: step.seq,
                kind: step.step.kind().as_str().to_owned(),
                provenance: step.provenance.as_str().to_owned(),
                at: rfc3339(step.created_at),
                text: step
                    .step
                    .to_stored()
                    .ok()
                    .and_then(|payload| serde_json::to_string_pretty(&payload).ok())
                    .unwrap_or_default(),
            })
            .collect(),
    };
    Ok(render(StatusCode::OK, &page))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_whose_names_show_alike_are_not_edited_on_a_page() {
        assert!(names_are_told_apart(
            &serde_json::json!({"to": 1, "text": 2})
        ));
        assert!(names_are_told_apart(&serde_json::json!({"x\u{202e}": 1})));
        // One name holds a right-to-left override, the other the text of its escape.
        assert!(!names_are_told_apart(
            &serde_json::json!({"x\u{202e}": 1, "x\\u{202e}": 2})
        ));
    }

    #[test]
    fn text_a_browser_sends_back_unchanged_has_the_same_lines() {
        // A browser sends every line break of a text area as CRLF.
        assert!(same_lines("a\nb\r\nc\rd", "a\r\nb\r\nc\r\nd"));
        assert!(same_lines("\nfirst", "\r\nfirst"));
        assert!(!same_lines("a\nb", "a\r\nb "));
        assert!(!same_lines("\nfirst", "first"));
        // Only text whose every break is CRLF keeps CRLF when edited.
        assert!(breaks_are_crlf("a\r\nb\r\n"));
        assert!(!breaks_are_crlf("a\r\nb\nc"));
        assert!(!breaks_are_crlf("a\rb\r\nc"));
        assert!(!breaks_are_crlf("one line"));
    }
}
