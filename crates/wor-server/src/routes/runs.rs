//! Runs: start, list, inspect, cancel, and follow live over server-sent events.

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use wor_core::audit::Actor;
use wor_core::run::{IdempotencyKey, RunStatus};
use wor_core::step::Step;
use wor_core::{ApiKeyId, ProjectId, Role, RoutineId, RunId};
use wor_engine::{StartRun, Started, Trigger};
use wor_store::{RunFilter, RunRecord, RunStep, Store, StoreError};

use crate::AppState;
use crate::auth::{Caller, RunCaller};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath, page_limit, query_id};
use crate::views::rfc3339;

/// How often an events stream looks for new steps.
const EVENTS_POLL: Duration = Duration::from_millis(200);
/// At most this many steps are read, and turned into events, at a time: a long run's backlog
/// goes out in pieces, each one read after the last is sent.
const EVENTS_PAGE: u16 = 64;
/// How often a run's event stream checks that its key still opens anything.
const KEY_RECHECK: Duration = Duration::from_secs(2);
// A full page is read on from without waiting: an empty one would never end.
const _: () = assert!(EVENTS_PAGE > 0);

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StartRunBody {
    /// The requester's input: text or any JSON value. It enters the run labelled `requester`.
    #[serde(default)]
    #[schema(value_type = Value)]
    pub input: serde_json::Value,
    /// The memory thread, for routines with `[memory]` (default `default`).
    #[serde(default)]
    pub thread: Option<String>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct UsageView {
    pub turns: u64,
    pub tool_calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_microdollars: u64,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct RunView {
    pub id: String,
    pub routine_id: String,
    pub routine_version: i64,
    pub root_run_id: String,
    pub parent_run_id: Option<String>,
    /// queued, running, waiting_for_approval, succeeded, failed, cancelled, budget_exceeded or skipped.
    pub status: String,
    pub trigger: String,
    /// `slot:<unix ms>` for a scheduled run, `delivery:<id>` for a webhook's, `request:<key>`
    /// for a start under an idempotency key.
    pub trigger_key: Option<String>,
    /// The memory thread, for routines with `[memory]`.
    pub thread: Option<String>,
    /// The API key that started the run (`key_…`), when one did.
    pub started_by: Option<String>,
    /// The member who started the run from the console (`mem_…`), when one did.
    pub started_by_member: Option<String>,
    /// The final answer, or why the run ended.
    pub outcome: Option<String>,
    pub usage: UsageView,
    pub cancel_requested: bool,
    pub created_at: String,
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
}

impl From<RunRecord> for RunView {
    fn from(r: RunRecord) -> Self {
        RunView {
            id: r.id.to_string(),
            routine_id: r.routine_id.to_string(),
            routine_version: r.routine_version,
            root_run_id: r.root_run_id.to_string(),
            parent_run_id: r.parent_run_id.map(|p| p.to_string()),
            status: r.status.to_string(),
            trigger: r.trigger_kind.as_str().to_owned(),
            trigger_key: r.trigger_key,
            thread: r.thread,
            started_by: r.started_by.map(|k| k.to_string()),
            started_by_member: r.started_by_member.map(|m| m.to_string()),
            outcome: r.outcome,
            usage: UsageView {
                turns: r.usage.turns,
                tool_calls: r.usage.tool_calls,
                input_tokens: r.usage.input_tokens,
                output_tokens: r.usage.output_tokens,
                cost_microdollars: r.usage.cost_microdollars,
            },
            cancel_requested: r.cancel_requested,
            created_at: rfc3339(r.created_at),
            started_at: r.started_at.map(rfc3339),
            finished_at: r.finished_at.map(rfc3339),
        }
    }
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct RunStepView {
    pub seq: i64,
    /// input, memory, model_turn, tool_call, approval_used, tool_result or outcome.
    pub kind: &'static str,
    /// Where the content came from: trusted, requester, untrusted, model or engine.
    pub provenance: &'static str,
    /// The step's payload, in its kind's shape.
    #[schema(value_type = Object)]
    #[serde(serialize_with = "Step::write_payload")]
    pub payload: Step,
    pub created_at: String,
}

impl From<RunStep> for RunStepView {
    fn from(s: RunStep) -> Self {
        RunStepView {
            seq: s.seq,
            kind: s.step.kind().as_str(),
            provenance: s.provenance.as_str(),
            payload: s.step,
            created_at: rfc3339(s.created_at),
        }
    }
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct RunDetail {
    #[serde(flatten)]
    pub run: RunView,
    /// For a routine with `[output] schema`, the validated JSON result of a succeeded run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    pub steps: Vec<RunStepView>,
}

/// A run in a list: the run, and its validated result when it has one.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct RunListItem {
    #[serde(flatten)]
    pub run: RunView,
    /// For a routine with `[output] schema`, the validated JSON result of a succeeded run.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub result: Option<serde_json::Value>,
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RunListQuery {
    /// Only runs of this routine (`rtn_…`).
    pub routine_id: Option<String>,
    /// Only runs with this status.
    pub status: Option<String>,
    /// Only runs older than this one: the previous page's last id.
    pub before: Option<String>,
    /// At most this many (1 to 200, default 50).
    pub limit: Option<u32>,
}

/// The request header that names a start's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The answer's header that says a start under an idempotency key started nothing new.
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Starts a run of the routine's current version. With an `Idempotency-Key` header (1 to 255
/// visible ASCII characters), a request sent again under the same key, with the same input and
/// thread, starts nothing and answers `200` with the run the key started (header
/// `Idempotent-Replayed: true`); the same key with other input is a `422`. A key is the
/// routine's for as long as the run it started is kept.
#[utoipa::path(post, path = "/v1/routines/{routine_id}/runs", tag = "runs", security(("bearer" = [])),
    request_body = StartRunBody,
    params(("routine_id" = String, Path, description = "a `rtn_…` id", pattern = "^rtn_[0-9a-f]{32}$"),
        ("Idempotency-Key" = Option<String>, Header, description = "the requester's key for this start: 1 to 255 visible ASCII characters")),
    responses((status = 202, body = RunView, description = "the run started"),
        (status = 200, body = RunView, description = "the run this idempotency key already started",
            headers(("Idempotent-Replayed" = String, description = "`true`: nothing new was started"))),
        (status = 400, body = ErrorBody, description = "the body, the routine id or the `Idempotency-Key` is malformed"),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn start(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(routine): ApiPath<RoutineId>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<StartRunBody>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let started = start_run(
        &state,
        caller.project_id,
        caller.role,
        routine,
        Trigger::Api(caller.key_id),
        caller.actor(),
        body,
        key,
    )
    .await?;
    Ok(match started {
        Started::New(run) => (StatusCode::ACCEPTED, Json(RunView::from(run))).into_response(),
        Started::Earlier(run) => (
            StatusCode::OK,
            [(IDEMPOTENT_REPLAYED, "true")],
            Json(RunView::from(run)),
        )
            .into_response(),
    })
}

/// The request's `Idempotency-Key`, if it has one: a `400` naming what is wrong with a key
/// that cannot be one, or with a second such header.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let refused = |reason: String| {
        ApiError::bad_request(
            "invalid_idempotency_key",
            format!("the `Idempotency-Key` header is refused: {reason}"),
        )
    };
    if values.next().is_some() {
        return Err(refused("it is given more than once".to_owned()));
    }
    let text = value
        .to_str()
        .map_err(|_| refused("it is not visible ASCII".to_owned()))?;
    text.parse()
        .map(Some)
        .map_err(|e: wor_core::run::IdempotencyKeyError| refused(e.to_string()))
}

/// Starts a run of `routine`'s current version for a caller of `role` in `project`: the API's
/// and the console's one path (another project's routine is a 404, a role that cannot operate
/// runs a 403), under the requester's idempotency `key` when it gave one.
#[expect(
    clippy::too_many_arguments,
    reason = "the one start both front ends share"
)]
pub(crate) async fn start_run(
    state: &AppState,
    project: ProjectId,
    role: Role,
    routine: RoutineId,
    trigger: Trigger,
    actor: Actor,
    body: StartRunBody,
    key: Option<IdempotencyKey>,
) -> Result<Started, ApiError> {
    // Looked up before the role check: another project's routine is a 404, not a 403.
    state.store.get_routine(project, routine).await?;
    if !role.can_operate_runs() {
        return Err(ApiError::Forbidden(format!(
            "role `{role}` cannot start runs"
        )));
    }
    Ok(state
        .engine
        .start_run(StartRun {
            project,
            routine,
            input: body.input,
            trigger,
            actor: Some(actor),
            thread: body.thread,
            idempotency_key: key,
        })
        .await?)
}

/// Lists runs, newest first.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", security(("bearer" = [])), params(RunListQuery),
    responses((status = 200, body = [RunListItem]), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<RunListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<RunListItem>>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let filter = RunFilter {
        routine_id: query_id(query.routine_id.as_deref())?,
        status: query
            .status
            .as_deref()
            .map(str::parse::<RunStatus>)
            .transpose()
            .map_err(|e| ApiError::bad_request("invalid_status", e.to_string()))?,
        before: query_id(query.before.as_deref())?,
        limit: page_limit(query.limit)?,
        ..RunFilter::default()
    };
    let runs = state.store.list_runs(caller.project_id, &filter).await?;
    let succeeded: Vec<RunId> = runs
        .iter()
        .filter(|r| r.status == RunStatus::Succeeded)
        .map(|r| r.id)
        .collect();
    let mut results = state
        .store
        .run_results(caller.project_id, &succeeded)
        .await?;
    Ok(Json(
        runs.into_iter()
            .map(|run| RunListItem {
                result: results.remove(&run.id),
                run: run.into(),
            })
            .collect(),
    ))
}

/// One run with every step it took.
#[utoipa::path(get, path = "/v1/runs/{run_id}", tag = "runs", security(("bearer" = [])),
    params(("run_id" = String, Path, description = "a `run_…` id", pattern = "^run_[0-9a-f]{32}$")),
    responses((status = 200, body = RunDetail), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<RunId>,
) -> Result<Json<RunDetail>, ApiError> {
    let run = state.store.get_run(caller.project_id, id).await?;
    let steps = state.store.list_run_steps(caller.project_id, id, 0).await?;
    let result = steps.iter().rev().find_map(|s| match &s.step {
        Step::Output(output) => Some(output.result.clone()),
        _ => None,
    });
    Ok(Json(RunDetail {
        run: run.into(),
        result,
        steps: steps.into_iter().map(RunStepView::from).collect(),
    }))
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct OwnRunView {
    #[serde(flatten)]
    pub run: RunView,
    /// The roster tools the run may call (`CONNECTION/TOOL`).
    pub roster: Vec<String>,
    /// When the credential expires: the run's deadline when it was minted.
    pub credential_expires_at: String,
}

/// The run a run credential (`wrt_…`) belongs to: the one route that credential may call.
#[utoipa::path(get, path = "/v1/run", tag = "runs", security(("bearer" = [])),
    responses((status = 200, body = OwnRunView), (status = 401, body = ErrorBody)))]
pub async fn own_run(
    State(state): State<AppState>,
    RunCaller(grant): RunCaller,
) -> Result<Json<OwnRunView>, ApiError> {
    let run = state.store.get_run(grant.project_id, grant.run_id).await?;
    let version = state
        .store
        .get_routine_version(grant.project_id, grant.routine_id, grant.routine_version)
        .await?;
    Ok(Json(OwnRunView {
        run: run.into(),
        roster: version
            .definition
            .tools
            .into_iter()
            .map(|entry| entry.tool)
            .collect(),
        credential_expires_at: rfc3339(grant.expires_at),
    }))
}

/// Cancels a run: a queued run at once (one asked before is ended by a worker), a running one at
/// its next step, a parked one by a worker it is queued for, and its nested runs still going.
/// Asking again, or of a run that has ended with nothing under it still going, changes nothing
/// and records nothing.
#[utoipa::path(post, path = "/v1/runs/{run_id}/cancel", tag = "runs", security(("bearer" = [])),
    params(("run_id" = String, Path, description = "a `run_…` id", pattern = "^run_[0-9a-f]{32}$")),
    responses((status = 200, body = RunView), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn cancel(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<RunId>,
) -> Result<Json<RunView>, ApiError> {
    let run = cancel_run(&state, caller.project_id, caller.role, caller.actor(), id).await?;
    tracing::info!(category = "run", action = "run.cancel", project_id = %caller.project_id, run_id = %id,
        actor_key_id = %caller.key_id, "run cancel requested");
    Ok(Json(run.into()))
}

/// Asks run `id` of `project` to stop, for a caller with `role`, and audits it as `actor` when
/// that asked any run to stop: the API's and the console's one path. Another project's run is
/// not found, before the role check.
pub(crate) async fn cancel_run(
    state: &AppState,
    project: ProjectId,
    role: Role,
    actor: Actor,
    id: RunId,
) -> Result<RunRecord, ApiError> {
    state.store.get_run(project, id).await?;
    if !role.can_operate_runs() {
        return Err(ApiError::Forbidden(format!(
            "role `{role}` cannot cancel runs"
        )));
    }
    let asked = state
        .engine
        .request_cancel(project, id, Some(actor))
        .await?;
    Ok(asked.run)
}

/// The run's steps as server-sent events (`event: step`), the model's text as it is written
/// (`event: text`, `{"delta": …}`, redacted; only while this server drives the run), then
/// `event: end` with the run once it has ended. A stream whose key is revoked (or whose
/// member is removed) ends within seconds, without `end`.
#[utoipa::path(get, path = "/v1/runs/{run_id}/events", tag = "runs", security(("bearer" = [])),
    params(("run_id" = String, Path, description = "a `run_…` id", pattern = "^run_[0-9a-f]{32}$")),
    responses((status = 200, description = "text/event-stream of `step` and `text` events and one `end` event"),
        (status = 404, body = ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<RunId>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    state.store.get_run(caller.project_id, id).await?;
    // Subscribed before the first read, so no text written after it is missed; the text
    // written before it by the model call under way comes with it.
    let text = state.engine.watch_text(id);
    let stream = step_stream(
        state.store.clone(),
        caller.project_id,
        id,
        caller.key_id,
        text,
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

struct Follow {
    store: Store,
    project: ProjectId,
    run: RunId,
    /// The key the stream was opened with, checked again every [`KEY_RECHECK`]: revoked (or
    /// its member removed), the stream ends.
    key: ApiKeyId,
    key_checked: tokio::time::Instant,
    last_seq: i64,
    pending: std::collections::VecDeque<Event>,
    ended: bool,
    /// The model's redacted text deltas; `None` once the run ended in this process.
    text: Option<tokio::sync::broadcast::Receiver<String>>,
    /// The text the model call under way had written when the watch began: sent once the
    /// steps recorded before it are out, ahead of the deltas that follow it.
    so_far: Option<String>,
    /// Deltas received and not sent yet: they go out after the steps recorded before their
    /// model call began (the previous call's result among them) and before the turn they
    /// belong to, so they wait for the next read of the steps.
    held: Vec<String>,
}

impl Follow {
    /// Takes every text delta that has already arrived, once the steps recorded before the
    /// watch began are out (the text so far first), to be sent after the next read of steps.
    fn drain_text(&mut self) {
        use tokio::sync::broadcast::error::TryRecvError;
        if self.so_far.is_some() {
            return;
        }
        while let Some(text) = self.text.as_mut() {
            match text.try_recv() {
                Ok(delta) => self.held.push(delta),
                Err(TryRecvError::Lagged(_)) => {}
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Closed) => self.text = None,
            }
        }
    }

    /// Queues the deltas held so far.
    fn send_held(&mut self) {
        for delta in std::mem::take(&mut self.held) {
            self.push_text(delta);
        }
    }

    /// Queues the oldest deltas held, as many as make up `len` bytes of text: those of a
    /// turn whose text is that long (a turn that only called tools streamed none).
    fn send_held_up_to(&mut self, len: usize) {
        let mut sent = 0usize;
        let mut taken = 0usize;
        for delta in &self.held {
            if sent >= len {
                break;
            }
            sent = sent.saturating_add(delta.len());
            taken += 1;
        }
        let deltas: Vec<String> = self.held.drain(..taken).collect();
        for delta in deltas {
            self.push_text(delta);
        }
    }

    fn push_text(&mut self, delta: String) {
        if let Ok(event) = Event::default()
            .event("text")
            .json_data(serde_json::json!({ "delta": delta }))
        {
            self.pending.push_back(event);
        }
    }

    /// Waits for the next poll of the steps, passing on text deltas that arrive meanwhile.
    async fn wait(&mut self) {
        use tokio::sync::broadcast::error::RecvError;
        // Before the first steps are out, deltas wait in the channel (see `drain_text`).
        let Some(text) = self.text.as_mut().filter(|_| self.so_far.is_none()) else {
            tokio::time::sleep(EVENTS_POLL).await;
            return;
        };
        let poll = tokio::time::sleep(EVENTS_POLL);
        tokio::pin!(poll);
        loop {
            tokio::select! {
                () = &mut poll => return,
                delta = text.recv() => match delta {
                    Ok(delta) => {
                        self.held.push(delta);
                        return;
                    }
                    // A watcher too slow for the text misses some; the steps still come.
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => {
                        self.text = None;
                        return;
                    }
                },
            }
        }
    }
}

fn step_stream(
    store: Store,
    project: ProjectId,
    run: RunId,
    key: ApiKeyId,
    text: wor_engine::TextWatch,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let follow = Follow {
        store,
        project,
        run,
        key,
        key_checked: tokio::time::Instant::now(),
        last_seq: 0,
        pending: Default::default(),
        ended: false,
        text: Some(text.deltas),
        so_far: Some(text.so_far),
        held: Vec::new(),
    };
    futures_util::stream::unfold(follow, |mut f| async move {
        loop {
            if let Some(event) = f.pending.pop_front() {
                return Some((Ok(event), f));
            }
            if f.ended {
                return None;
            }
            if f.key_checked.elapsed() >= KEY_RECHECK {
                match f.store.api_key_opens(f.key).await {
                    Ok(true) => f.key_checked = tokio::time::Instant::now(),
                    Ok(false) => {
                        tracing::info!(category = "auth", run_id = %f.run, key_id = %f.key,
                            "a run's event stream ended: its key no longer opens anything");
                        return None;
                    }
                    // Asked again at the next poll.
                    Err(error) => {
                        tracing::warn!(category = "auth", %error,
                            "the key of a followed run could not be checked");
                    }
                }
            }
            // Text already written goes out before the steps that follow it.
            f.drain_text();
            // Read the status first: steps written before a run ends are all seen below.
            let read = async {
                let record = f.store.get_run(f.project, f.run).await?;
                let steps = f
                    .store
                    .list_run_steps_page(f.project, f.run, f.last_seq, EVENTS_PAGE)
                    .await?;
                Ok::<_, StoreError>((record, steps))
            };
            let (record, steps) = match read.await {
                Ok(read) => read,
                // The run is gone: nothing more will come.
                Err(StoreError::NotFound) => {
                    f.ended = true;
                    continue;
                }
                // Read again at the next poll: a step is never skipped, nor the end sent ahead
                // of steps a failed read did not return.
                Err(error) => {
                    tracing::warn!(category = "run", %error,
                        "a followed run could not be read; it is read again at the next poll");
                    f.wait().await;
                    continue;
                }
            };
            // A run that has ended writes no more text: what is still on its way goes out with
            // the steps, ahead of the end.
            if record.status.is_terminal() {
                f.drain_text();
            }
            // A full page may have more behind it: read on once it is out, without waiting.
            let more = steps.len() == usize::from(EVENTS_PAGE);
            for step in steps {
                f.last_seq = step.seq;
                // Text held goes before the turn it belongs to: the deltas of a turn with text
                // make up its text, so as many as its text is long go out ahead of it.
                if let wor_core::step::Step::ModelTurn(turn) = &step.step {
                    f.send_held_up_to(turn.message.text.len());
                }
                match Event::default()
                    .event("step")
                    .json_data(RunStepView::from(step))
                {
                    Ok(event) => f.pending.push_back(event),
                    Err(error) => {
                        tracing::error!(category = "run", %error, seq = f.last_seq,
                            "a run step does not serialise; it is left out of the events");
                    }
                }
            }
            if more {
                continue;
            }
            // The steps recorded before the watch began are queued: the text after them next.
            if let Some(so_far) = f.so_far.take()
                && !so_far.is_empty()
            {
                f.push_text(so_far);
            }
            // The steps recorded so far are queued: the text of the turn under way after them.
            f.send_held();
            if record.status.is_terminal() {
                if let Ok(event) = Event::default()
                    .event("end")
                    .json_data(RunView::from(record))
                {
                    f.pending.push_back(event);
                }
                f.ended = true;
            } else if f.pending.is_empty() {
                f.wait().await;
            }
        }
    })
}
