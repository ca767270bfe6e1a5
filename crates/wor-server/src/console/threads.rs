//! Threads: the conversation view of a routine that keeps memory. A member writes a message,
//! which starts a run on the thread with the message as its input, through the path
//! `POST /v1/routines/{id}/runs` takes (the member is its starter). Each earlier run is a turn:
//! what was asked and what was answered, each with its provenance (an answer given with
//! untrusted content in context is untrusted, and the page says from where, as the thread's
//! memory stores it), and the calls it held, linked to the page that decides them.
//!
//! The page works without script: the form posts and redirects, a reload shows the answer.
//! With the console's script, [`events`] says when the page changed (the script fetches it
//! again) and passes on the model's redacted text as it is written, which the script appends
//! as text to the turn being answered.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::time::Duration;

use askama::Template;
use axum::Form;
use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect};
use futures_util::Stream;
use wor_core::run::{Provenance, RunStatus};
use wor_core::step::{Step, untrusted_source};
use wor_core::{ProjectId, RoutineId, RunId};
use wor_engine::DEFAULT_THREAD;
use wor_store::{ApprovalFilter, RunRecord, Store};

use super::pages::{Banner, PageResult, form, start_form_key, start_key_for};
use super::session::ConsoleMember;
use super::{ConsoleError, INBOX_LIMIT, PagePath, render};
use crate::AppState;
use crate::error::ApiError;
use crate::routes::runs::{StartRunBody, start_run};
use crate::views::rfc3339;

/// The latest turns a thread's page shows.
const TURNS: u32 = 50;
/// The threads a routine's list shows, the most recently used first.
const THREADS: u32 = 100;
/// How often the live stream passes on text; the store is read every [`STORE_EVERY`] ticks.
const TICK: Duration = Duration::from_millis(100);
const STORE_EVERY: u32 = 5;

/// A thread's address: its page, with the name as a query parameter (any printable text).
fn thread_href(routine: RoutineId, thread: &str) -> String {
    let name: String = url::form_urlencoded::byte_serialize(thread.as_bytes()).collect();
    format!("/console/routines/{routine}/thread?name={name}")
}

/// The routine, when it exists in `project` and its current version keeps memory; otherwise
/// not found (a routine without memory has no threads).
async fn memory_routine(
    state: &AppState,
    project: ProjectId,
    id: RoutineId,
) -> Result<(RoutineId, String), ConsoleError> {
    let routine = state.store.get_routine(project, id).await?;
    let current = state
        .store
        .get_routine_version(project, id, routine.current_version)
        .await?;
    if !current.definition.memory.enabled {
        return Err(ConsoleError(ApiError::NotFound));
    }
    Ok((id, routine.name))
}

struct ThreadRow {
    name: String,
    href: String,
    runs: u64,
    last_at: String,
}

#[derive(Template)]
#[template(path = "console/threads.html")]
struct ThreadsPage {
    banner: Banner,
    routine_id: String,
    routine: String,
    threads: Vec<ThreadRow>,
    may_start: bool,
    /// The message form's key (`pages::start_form_key`).
    start_key: String,
}

/// A routine's threads, with the form that starts a new one.
pub async fn list(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(routine_id): PagePath<RoutineId>,
) -> PageResult {
    let project = member.session.project_id;
    let (id, routine) = memory_routine(&state, project, routine_id).await?;
    let threads = state
        .store
        .list_threads(project, id, THREADS)
        .await?
        .into_iter()
        .map(|t| ThreadRow {
            href: thread_href(id, &t.thread),
            name: t.thread,
            runs: t.runs,
            last_at: rfc3339(t.last_at),
        })
        .collect();
    Ok(render(
        StatusCode::OK,
        &ThreadsPage {
            banner: (&member).into(),
            routine_id: id.to_string(),
            routine,
            threads,
            may_start: member.session.role.can_operate_runs(),
            start_key: start_key_for(member.session.role.can_operate_runs())?,
        },
    ))
}

/// The thread a page or a stream is about: `default` when none is named.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThreadQuery {
    #[serde(default)]
    name: String,
}

impl ThreadQuery {
    fn thread(&self) -> &str {
        match self.name.trim() {
            "" => DEFAULT_THREAD,
            name => name,
        }
    }
}

fn query(query: Result<Query<ThreadQuery>, QueryRejection>) -> Result<ThreadQuery, ConsoleError> {
    query
        .map(|Query(q)| q)
        .map_err(|e| ConsoleError(ApiError::bad_request("invalid_query", e.body_text())))
}

/// An untrusted source of an answer, and the step of the run it came from.
struct SourceRow {
    name: String,
    step: i64,
}

/// A call a turn held for approval.
struct HeldRow {
    id: String,
    tool: String,
    status: String,
}

/// One run of the thread: what was asked, what was answered, and how far it is.
struct TurnRow {
    run_id: String,
    status: String,
    /// The run has not ended: its answer is still to come.
    active: bool,
    at: String,
    /// Who wrote the message: a member's name, a key, or how the run started.
    author: String,
    message: String,
    /// The message's label (`requester`, or `untrusted` for a webhook's payload).
    message_provenance: String,
    /// The answer, once the run succeeded.
    answer: Option<String>,
    /// `model`, or `untrusted` when untrusted content was in the run's context.
    answer_provenance: String,
    /// The untrusted content that was in context, and where it came from.
    sources: Vec<SourceRow>,
    /// Why a run that did not succeed ended.
    ended: Option<String>,
    held: Vec<HeldRow>,
}

#[derive(Template)]
#[template(path = "console/thread.html")]
struct ThreadPage {
    banner: Banner,
    routine_id: String,
    routine: String,
    thread: String,
    turns: Vec<TurnRow>,
    /// The live stream's address, while a turn is being answered.
    live: Option<String>,
    may_start: bool,
    /// The message form's key (`pages::start_form_key`).
    start_key: String,
}

/// Who started `run`, as a person reads it; member names are looked up once per page.
async fn author(
    store: &Store,
    project: ProjectId,
    run: &RunRecord,
    names: &mut HashMap<wor_core::MemberId, String>,
) -> Result<String, ConsoleError> {
    if let Some(member) = run.started_by_member {
        if let Some(name) = names.get(&member) {
            return Ok(name.clone());
        }
        let name = match store.get_member(project, member).await {
            Ok(m) => m.name,
            Err(wor_store::StoreError::NotFound) => member.to_string(),
            Err(other) => return Err(other.into()),
        };
        names.insert(member, name.clone());
        return Ok(name);
    }
    Ok(match run.started_by {
        Some(key) => format!("key {key}"),
        None => format!("a {} trigger", run.trigger_kind.as_str()),
    })
}

async fn turn(
    store: &Store,
    project: ProjectId,
    run: RunRecord,
    names: &mut HashMap<wor_core::MemberId, String>,
) -> Result<TurnRow, ConsoleError> {
    let steps = store.list_run_steps(project, run.id, 0).await?;
    let (message, message_provenance) = steps
        .iter()
        .find_map(|s| match &s.step {
            Step::Input(input) => Some((input.text(), s.provenance)),
            _ => None,
        })
        .unwrap_or((String::new(), Provenance::Requester));
    // The same rule as the memory the run leaves: one untrusted step in context makes the
    // answer untrusted. Each source is listed once, with the first step it came from.
    let mut sources: Vec<SourceRow> = Vec::new();
    for step in &steps {
        if let Some(name) = untrusted_source(&step.step, step.provenance)
            && !sources.iter().any(|s| s.name == name)
        {
            sources.push(SourceRow {
                name,
                step: step.seq,
            });
        }
    }
    let held = store
        .list_approvals(
            project,
            &ApprovalFilter {
                status: None,
                run_id: Some(run.id),
                before: None,
                limit: INBOX_LIMIT,
            },
        )
        .await?
        .into_iter()
        .rev()
        .map(|a| HeldRow {
            id: a.id.to_string(),
            tool: a.tool,
            status: a.status.as_str().to_owned(),
        })
        .collect();
    let (answer, ended) = match run.status {
        RunStatus::Succeeded => (Some(run.outcome.clone().unwrap_or_default()), None),
        status if status.is_terminal() => (
            None,
            Some(match &run.outcome {
                Some(why) => format!("{status}: {why}"),
                None => status.to_string(),
            }),
        ),
        _ => (None, None),
    };
    Ok(TurnRow {
        author: author(store, project, &run, names).await?,
        run_id: run.id.to_string(),
        status: run.status.to_string(),
        active: !run.status.is_terminal(),
        at: rfc3339(run.created_at),
        message,
        message_provenance: message_provenance.as_str().to_owned(),
        answer,
        answer_provenance: if sources.is_empty() {
            Provenance::Model
        } else {
            Provenance::Untrusted
        }
        .as_str()
        .to_owned(),
        sources,
        ended,
        held,
    })
}

/// One thread's conversation, oldest turn first, with the form that writes the next message.
pub async fn show(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(routine_id): PagePath<RoutineId>,
    thread: Result<Query<ThreadQuery>, QueryRejection>,
) -> PageResult {
    let thread = query(thread)?;
    let thread = thread.thread();
    let project = member.session.project_id;
    let (id, routine) = memory_routine(&state, project, routine_id).await?;
    let runs = state.store.thread_runs(project, id, thread, TURNS).await?;
    let mut names = HashMap::new();
    let mut turns = Vec::with_capacity(runs.len());
    for run in runs {
        turns.push(turn(&state.store, project, run, &mut names).await?);
    }
    let live = turns.iter().any(|t| t.active).then(|| {
        let name: String = url::form_urlencoded::byte_serialize(thread.as_bytes()).collect();
        format!("/console/routines/{id}/thread/events?name={name}")
    });
    Ok(render(
        StatusCode::OK,
        &ThreadPage {
            banner: (&member).into(),
            routine_id: id.to_string(),
            routine,
            thread: thread.to_owned(),
            turns,
            live,
            may_start: member.session.role.can_operate_runs(),
            start_key: start_key_for(member.session.role.can_operate_runs())?,
        },
    ))
}

/// A message as the thread's form sends it.
#[derive(Debug, serde::Deserialize)]
pub struct MessageForm {
    #[serde(default)]
    thread: String,
    message: String,
    #[serde(default)]
    start_key: String,
}

/// Starts a run on the thread with the message as its input (text, labelled `requester`),
/// through the API's path; its starter is the member. Goes back to the thread, at the new turn.
pub async fn write(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(routine_id): PagePath<RoutineId>,
    body: Result<Form<MessageForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let session = &member.session;
    let (id, _) = memory_routine(&state, session.project_id, routine_id).await?;
    if body.message.trim().is_empty() {
        return Err(ConsoleError(ApiError::bad_request(
            "invalid_message",
            "write a message first",
        )));
    }
    let thread = match body.thread.trim() {
        "" => DEFAULT_THREAD.to_owned(),
        name => name.to_owned(),
    };
    let key = start_form_key(&body.start_key, &[&body.message, &thread]);
    let run = start_run(
        &state,
        session.project_id,
        session.role,
        id,
        wor_engine::Trigger::Console(session.member_id),
        member.actor(),
        StartRunBody {
            input: serde_json::Value::String(body.message),
            thread: Some(thread.clone()),
        },
        key,
    )
    .await?
    .into_run();
    let to = format!("{}#turn-{}", thread_href(id, &thread), run.id);
    Ok(Redirect::to(&to).into_response())
}

/// What the live stream compares between two reads: each turn's status and last step.
type Fingerprint = Vec<(RunId, RunStatus, i64)>;

async fn fingerprint(
    store: &Store,
    project: ProjectId,
    routine: RoutineId,
    thread: &str,
) -> Option<Fingerprint> {
    let runs = store
        .thread_runs(project, routine, thread, TURNS)
        .await
        .ok()?;
    let mut seen = Vec::with_capacity(runs.len());
    for run in runs {
        let last = if run.status.is_terminal() {
            0
        } else {
            store.last_run_step_seq(project, run.id).await.ok()?
        };
        seen.push((run.id, run.status, last));
    }
    Some(seen)
}

struct Follow {
    store: Store,
    engine: wor_engine::Engine,
    project: ProjectId,
    routine: RoutineId,
    thread: String,
    seen: Option<Fingerprint>,
    /// The text of each active run this process drives, as it is written.
    text: Vec<(RunId, tokio::sync::broadcast::Receiver<String>)>,
    pending: VecDeque<Event>,
    ticks: u32,
    ended: bool,
    /// The session the stream was opened under: it ends with it.
    session: super::live::SessionWatch,
}

impl Follow {
    /// Watches the text of every active turn not yet watched.
    fn watch(&mut self) {
        let active: Vec<RunId> = self
            .seen
            .iter()
            .flatten()
            .filter(|(_, status, _)| !status.is_terminal())
            .map(|(run, _, _)| *run)
            .collect();
        self.text.retain(|(run, _)| active.contains(run));
        for run in active {
            if !self.text.iter().any(|(r, _)| *r == run) {
                let watch = self.engine.watch_text(run);
                // What the turn's model call wrote before the watch began comes first.
                self.push_text(run, watch.so_far);
                self.text.push((run, watch.deltas));
            }
        }
    }

    /// Queues `delta` of `run`'s text as a `text` event naming its run.
    fn push_text(&mut self, run: RunId, delta: String) {
        if delta.is_empty() {
            return;
        }
        let data = serde_json::json!({ "run": run.to_string(), "delta": delta });
        if let Ok(event) = Event::default().event("text").json_data(data) {
            self.pending.push_back(event);
        }
    }

    /// Queues the text that has arrived, as `text` events naming their run.
    fn drain_text(&mut self) {
        use tokio::sync::broadcast::error::TryRecvError;
        let mut arrived = Vec::new();
        for (run, receiver) in &mut self.text {
            loop {
                match receiver.try_recv() {
                    Ok(delta) => arrived.push((*run, delta)),
                    Err(TryRecvError::Lagged(_)) => {}
                    Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                }
            }
        }
        for (run, delta) in arrived {
            self.push_text(run, delta);
        }
    }

    fn any_active(&self) -> bool {
        self.seen
            .iter()
            .flatten()
            .any(|(_, status, _)| !status.is_terminal())
    }
}

/// `changed` once the thread is first read, then each time a turn of the thread takes a step or
/// changes status (and when a new turn starts), `text` with `{"run", "delta"}` for the model's redacted text as it is
/// written (only while this server drives the run), and `end` once no turn is active.
pub async fn events(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(routine_id): PagePath<RoutineId>,
    thread: Result<Query<ThreadQuery>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ConsoleError> {
    let thread = query(thread)?.thread().to_owned();
    let project = member.session.project_id;
    // Another project's routine, or one without memory, is not found, as its page is not.
    let (routine, _) = memory_routine(&state, project, routine_id).await?;
    // No baseline: the first read counts as a change, so a turn that moved between the
    // page's rendering and this stream's start is not missed (one extra fetch of the page).
    let mut follow = Follow {
        store: state.store.clone(),
        engine: state.engine.clone(),
        project,
        routine,
        thread,
        seen: None,
        text: Vec::new(),
        pending: VecDeque::new(),
        ticks: 0,
        ended: false,
        session: super::live::SessionWatch::new(&state, &member),
    };
    // The text of turns already being answered is watched from the start.
    follow.seen = fingerprint(&follow.store, project, routine, &follow.thread).await;
    follow.watch();
    follow.seen = None;
    let stream = futures_util::stream::unfold(follow, |mut f| async move {
        loop {
            if let Some(event) = f.pending.pop_front() {
                return Some((Ok(event), f));
            }
            if f.ended {
                return None;
            }
            tokio::time::sleep(TICK).await;
            if !f.session.still_open().await {
                return None;
            }
            f.drain_text();
            f.ticks = f.ticks.wrapping_add(1);
            if f.ticks % STORE_EVERY != 0 {
                continue;
            }
            let now = fingerprint(&f.store, f.project, f.routine, &f.thread).await;
            if now.is_some() && now != f.seen {
                f.seen = now;
                f.watch();
                // Text written before the step that holds it goes out first.
                f.drain_text();
                if f.any_active() {
                    f.pending
                        .push_back(Event::default().event("changed").data("thread"));
                } else {
                    f.pending
                        .push_back(Event::default().event("end").data("thread"));
                    f.ended = true;
                }
            } else if !f.any_active() && f.seen.is_some() {
                f.pending
                    .push_back(Event::default().event("end").data("thread"));
                f.ended = true;
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
