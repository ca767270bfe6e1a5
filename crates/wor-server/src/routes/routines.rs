//! Routines: applied as TOML, versioned immutably.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use wor_core::RoutineId;
use wor_core::audit::{AuditCategory, AuditEvent};
use wor_core::routine::RoutineDefinition;
use wor_engine::WebhookSecretKind;

use crate::AppState;
use crate::auth::{Caller, Configurer};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::views::rfc3339;

/// The largest routine source accepted.
const MAX_ROUTINE_BYTES: usize = 256 * 1024;

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyRoutine {
    /// The routine definition, in TOML (see docs/routines.md).
    pub toml: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct RoutineView {
    pub id: String,
    pub name: String,
    pub current_version: i64,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AppliedRoutineView {
    pub routine: RoutineView,
    pub version: i64,
    /// False when the definition equalled the current version and nothing was written.
    pub changed: bool,
    /// The routine's new inbound webhook secret, shown this once: made when a version first
    /// enables `[webhook]` and the routine has none.
    pub webhook_secret: Option<String>,
    /// The routine's new run webhook secret, shown this once: made when a version first sets
    /// `[notify]` and the routine has none. Receivers verify run webhooks with it.
    pub notify_secret: Option<String>,
    /// What the roster names that the project does not have (a tool connection, a routine):
    /// the routine is applied all the same, as it may be made first, and its runs fail until
    /// what it names is there.
    pub warnings: Vec<String>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct RoutineVersionSummary {
    pub version: i64,
    pub content_hash: String,
    pub created_at: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct RoutineDetail {
    pub routine: RoutineView,
    /// The current version's source, as applied, redacted of the project's secrets and of
    /// secret shapes.
    pub source_toml: String,
    /// The current version, parsed, with defaults filled in, redacted as `source_toml`.
    #[schema(value_type = Object)]
    pub definition: serde_json::Value,
    pub versions: Vec<RoutineVersionSummary>,
    /// The next firings of its `[schedule]` (RFC 3339, UTC); empty without one.
    pub next_firings: Vec<String>,
    /// Whether an inbound webhook secret exists (its value is never shown again).
    pub webhook_secret_configured: bool,
    /// Whether a run webhook (notify) secret exists.
    pub notify_secret_configured: bool,
}

impl From<wor_store::RoutineRecord> for RoutineView {
    fn from(r: wor_store::RoutineRecord) -> Self {
        RoutineView {
            id: r.id.to_string(),
            name: r.name,
            current_version: r.current_version,
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
        }
    }
}

/// The most memory entries a run of a routine may be given.
const MAX_MEMORY_ENTRIES: u32 = 1000;

/// Applies a routine: creates it, or makes a new immutable version if it changed.
#[utoipa::path(post, path = "/v1/routines", tag = "routines", security(("bearer" = [])),
    request_body = ApplyRoutine,
    responses((status = 200, body = AppliedRoutineView), (status = 201, body = AppliedRoutineView),
        (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn apply(
    State(state): State<AppState>,
    Configurer(caller): Configurer,
    ApiJson(body): ApiJson<ApplyRoutine>,
) -> Result<(StatusCode, Json<AppliedRoutineView>), ApiError> {
    if body.toml.len() > MAX_ROUTINE_BYTES {
        return Err(ApiError::bad_request(
            "invalid_routine",
            "the routine is larger than 256 KiB",
        ));
    }
    let definition = RoutineDefinition::from_toml(&body.toml)
        .map_err(|e| ApiError::bad_request("invalid_routine", e.message))?;
    // A routine is stored and shown as written: a project secret's value in it would sit in
    // the clear beside its sealed copy.
    if state
        .engine
        .project_redactor(caller.project_id)
        .await?
        .holds_live_secret(&body.toml)
    {
        return Err(ApiError::bad_request(
            "secret_in_routine",
            "the routine's TOML holds the value of one of the project's secrets; a routine is stored and shown as written, so a secret belongs in a connection's credentials, sealed (`wor connection create --bearer-env`, `--header-env`, or a model connection's key)",
        ));
    }
    if let Some(refusal) = definition.production_refusal().filter(|_| state.production) {
        return Err(ApiError::bad_request("invalid_routine", refusal));
    }
    if let Some(notify) = &definition.notify {
        state.engine.vet_notify_url(&notify.url).map_err(|denial| {
            ApiError::bad_request("invalid_routine", format!("`notify.url`: {denial}"))
        })?;
    }
    // Memory that recalls nothing, or more than a model could be given: refused when applied
    // (a stored version reads back as it was).
    let entries = definition.memory.max_entries;
    if definition.memory.enabled && !(1..=MAX_MEMORY_ENTRIES).contains(&entries) {
        return Err(ApiError::bad_request(
            "invalid_routine",
            format!("`memory.max_entries` must be from 1 to {MAX_MEMORY_ENTRIES}, not {entries}"),
        ));
    }
    // A schedule whose every time has passed still reads back from a stored version, but
    // applied now it would never start a run.
    if let Some(section) = &definition.schedule
        && let Ok(schedule) = section.compile()
        && schedule.next_after(wor_store::now_millis()).is_none()
    {
        return Err(ApiError::bad_request(
            "invalid_routine",
            format!(
                "`schedule.cron` `{}` fires no more: every time it names has passed",
                section.cron
            ),
        ));
    }
    if let Some(output) = &definition.output {
        wor_tools::OutputSchema::compile(&output.schema)
            .map_err(|e| ApiError::bad_request("invalid_routine", e.to_string()))?;
    }
    // The routine's own policy, with its roster modes, must validate against the schema.
    let mut policy = wor_policy::PolicyEngine::builder().roster(&definition.tools);
    if let Some(text) = &definition.policy {
        policy = policy.routine_policy(text.clone());
    }
    policy
        .build()
        .map_err(|e| ApiError::bad_request("invalid_routine", format!("`policy`: {e}")))?;
    if let Some(name) = &definition.model.connection {
        let known = state
            .store
            .list_model_connections(caller.project_id)
            .await?
            .into_iter()
            .any(|c| &c.name == name && c.status == wor_store::ConnectionStatus::Active);
        if !known {
            return Err(ApiError::bad_request(
                "invalid_routine",
                format!(
                    "`model.connection`: no active model connection named `{name}` in this project"
                ),
            ));
        }
    }
    let warnings = roster_gaps(&state, caller.project_id, &definition).await?;
    // The entry is staged with the new version: a crash before it is appended leaves it for
    // the audit writer's sweep, never a version without its entry.
    let content_hash = definition.content_hash();
    let entry = |applied: &wor_store::AppliedRoutine| {
        AuditEvent::new(
            caller.project_id,
            AuditCategory::RoutineApply,
            caller.actor(),
        )
        .subject("routine_id", applied.routine.id)
        .payload(serde_json::json!({
            "name": applied.routine.name,
            "version": applied.version,
            "content_hash": content_hash,
        }))
    };
    let (applied, staged) = state
        .store
        .apply_routine_staged(
            caller.project_id,
            &body.toml,
            &definition,
            Some(caller.key_id),
            Some(&entry),
        )
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "routine.apply", project_id = %caller.project_id,
        routine_id = %applied.routine.id, version = applied.version, changed = applied.changed,
        actor_key_id = %caller.key_id, "routine applied");
    let mut made = [None, None];
    for (slot, (wanted, kind)) in made.iter_mut().zip([
        (definition.webhook.enabled, WebhookSecretKind::Inbound),
        (definition.notify.is_some(), WebhookSecretKind::Notify),
    ]) {
        if wanted
            && let Some(secret) = state
                .engine
                .create_webhook_secret(caller.project_id, applied.routine.id, kind, caller.actor())
                .await?
        {
            *slot = Some(secrecy::ExposeSecret::expose_secret(&secret).to_owned());
        }
    }
    let [webhook_secret, notify_secret] = made;
    let status = if applied.changed && applied.version == 1 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(AppliedRoutineView {
            routine: applied.routine.into(),
            version: applied.version,
            changed: applied.changed,
            webhook_secret,
            notify_secret,
            warnings,
        }),
    ))
}

/// What `definition`'s roster names that `project` does not have, a sentence each: a tool
/// connection (or one not enabled), or a routine a `routine/NAME` entry calls (`deny` entries
/// call nothing).
async fn roster_gaps(
    state: &AppState,
    project: wor_core::ProjectId,
    definition: &RoutineDefinition,
) -> Result<Vec<String>, ApiError> {
    use wor_core::routine::{ROUTINE_CONNECTION, ToolMode};
    let called = || {
        definition
            .tools
            .iter()
            .filter(|entry| entry.mode != ToolMode::Deny)
            .filter_map(|entry| Some((entry, entry.split()?)))
    };
    let connections: std::collections::BTreeMap<String, wor_store::ToolConnectionStatus> =
        if called().any(|(_, (connection, _))| connection != ROUTINE_CONNECTION) {
            let listed = state.store.list_tool_connections(project).await?;
            listed.into_iter().map(|c| (c.name, c.status)).collect()
        } else {
            Default::default()
        };
    let routines: std::collections::BTreeSet<String> =
        if called().any(|(_, (connection, _))| connection == ROUTINE_CONNECTION) {
            let listed = state.store.list_routines(project).await?;
            listed.into_iter().map(|r| r.name).collect()
        } else {
            Default::default()
        };
    let mut gaps = Vec::new();
    for (entry, (connection, tool)) in called() {
        if connection == ROUTINE_CONNECTION {
            if !routines.contains(tool) && tool != definition.name.as_str() {
                gaps.push(format!(
                    "`tools`: `{}` calls routine `{tool}`, which this project does not have: \
                     the routine's runs fail until it is applied",
                    entry.tool
                ));
            }
        } else {
            match connections.get(connection) {
                None => gaps.push(format!(
                    "`tools`: `{}` names tool connection `{connection}`, which this project \
                     does not have: the routine's runs fail until it is made",
                    entry.tool
                )),
                Some(wor_store::ToolConnectionStatus::Enabled) => {}
                Some(status) => gaps.push(format!(
                    "`tools`: `{}` names tool connection `{connection}`, which is {status}: the \
                     routine's runs fail until it is enabled",
                    entry.tool
                )),
            }
        }
    }
    Ok(gaps)
}

/// Lists the project's routines.
#[utoipa::path(get, path = "/v1/routines", tag = "routines", security(("bearer" = [])),
    responses((status = 200, body = [RoutineView]), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<RoutineView>>, ApiError> {
    let routines = state.store.list_routines(caller.project_id).await?;
    Ok(Json(routines.into_iter().map(Into::into).collect()))
}

/// One routine: its current definition and its version history.
#[utoipa::path(get, path = "/v1/routines/{routine_id}", tag = "routines", security(("bearer" = [])),
    params(("routine_id" = String, Path, description = "a `rtn_…` id", pattern = "^rtn_[0-9a-f]{32}$")),
    responses((status = 200, body = RoutineDetail), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<RoutineId>,
) -> Result<Json<RoutineDetail>, ApiError> {
    let routine = state.store.get_routine(caller.project_id, id).await?;
    let current = state
        .store
        .get_routine_version(caller.project_id, id, routine.current_version)
        .await?;
    let versions = state
        .store
        .list_routine_versions(caller.project_id, id)
        .await?;
    let next_firings = state
        .engine
        .next_firings(caller.project_id, id, &current.definition, 5)
        .await?
        .into_iter()
        .map(wor_core::schedule::slot_rfc3339)
        .collect();
    let webhook_secret_configured = state
        .engine
        .has_webhook_secret(caller.project_id, id, WebhookSecretKind::Inbound)
        .await?;
    let notify_secret_configured = state
        .engine
        .has_webhook_secret(caller.project_id, id, WebhookSecretKind::Notify)
        .await?;
    // A secret written into the routine (a project secret's value, a key's shape) is shown
    // redacted, as in its runs' records: viewers read routines too.
    let redactor = state.engine.project_redactor(caller.project_id).await?;
    let mut definition =
        serde_json::to_value(&current.definition).map_err(|_| ApiError::Internal)?;
    redactor.redact_json(&mut definition);
    Ok(Json(RoutineDetail {
        next_firings,
        webhook_secret_configured,
        notify_secret_configured,
        routine: routine.into(),
        definition,
        source_toml: redactor.redact(&current.source_toml).into_owned(),
        versions: versions
            .into_iter()
            .map(
                |(version, content_hash, created_at)| RoutineVersionSummary {
                    version,
                    content_hash,
                    created_at: rfc3339(created_at),
                },
            )
            .collect(),
    }))
}
