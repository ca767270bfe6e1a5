//! The engine's trace spans: one function per event, so a hook in the engine is one line, as
//! for [`crate::metrics`]. A finished span is handed to the sink `wor serve` installs when the
//! operator configures `[traces]`; without one each call does nothing.
//!
//! A run is one trace: its trace id is the run id's 128 bits, and the run span's id and each
//! tool call's span id are derived from the run id (and the call id), so the spans of a run
//! that parks, resumes in another worker or is decided by a person in a request all join the
//! same tree without any trace state being stored.
//!
//! INVARIANT: a span carries ids, fixed words, numbers and times only. [`Attribute`] values
//! are `&'static str` words, integers, or ids of this crate's typed kinds: no prompt, argument,
//! result, header, URL, routine name, model-chosen call id or secret can be put in one.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;
use wor_core::call::Verdict;
use wor_core::ids::{ApprovalId, ProjectId, RoutineId, RunId};
use wor_core::model::ProviderKind;
use wor_core::run::RunStatus;
use wor_core::run_loop::CallOutcome;
use wor_store::{ApprovalRecord, ApprovalStatus, AttemptOutcome, RunRecord};

/// What a span stands for; its name is [`SpanKind::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// A run, from its first start to its end.
    Run,
    /// One model call of a run.
    ModelTurn,
    /// One proposed tool call, from its decision to its answer (or to its hold, when it
    /// waits for a person).
    ToolCall,
    /// Policy deciding a tool call.
    ToolDecision,
    /// A held call waiting for a person, from the request to the decision or expiry.
    ApprovalWait,
    /// The tool running the call.
    ToolExecution,
    /// One attempt to deliver a run webhook.
    WebhookDelivery,
}

impl SpanKind {
    /// The span's name as exported.
    pub fn name(self) -> &'static str {
        match self {
            Self::Run => "wor.run",
            Self::ModelTurn => "wor.model_turn",
            Self::ToolCall => "wor.tool_call",
            Self::ToolDecision => "wor.tool_call.decision",
            Self::ApprovalWait => "wor.tool_call.approval_wait",
            Self::ToolExecution => "wor.tool_call.execution",
            Self::WebhookDelivery => "wor.webhook.delivery",
        }
    }
}

/// An attribute's value: never free text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttributeValue {
    /// One of a fixed set of words (a status, a trigger, a provider, a decision).
    Word(&'static str),
    /// A count, a number of tokens, an HTTP status code.
    Int(i64),
    /// A typed id, as it prints.
    Id(TypedId),
}

/// An id of one of the kinds a span may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypedId {
    Run(RunId),
    Project(ProjectId),
    Routine(RoutineId),
    Approval(ApprovalId),
}

impl fmt::Display for TypedId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Run(id) => id.fmt(f),
            Self::Project(id) => id.fmt(f),
            Self::Routine(id) => id.fmt(f),
            Self::Approval(id) => id.fmt(f),
        }
    }
}

/// One attribute of a span.
pub type Attribute = (&'static str, AttributeValue);

/// A finished span, as the sink receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedSpan {
    pub kind: SpanKind,
    /// The run's id as 16 bytes.
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_span_id: Option<[u8; 8]>,
    pub start: SystemTime,
    pub end: SystemTime,
    /// `false` when the span's outcome is a failure (a failed run, a tool error, a webhook
    /// the receiver refused).
    pub ok: bool,
    pub attributes: Vec<Attribute>,
}

/// How many finished spans wait for the exporter at most; past that, spans are dropped (and
/// counted) rather than slowing a run down.
pub const SINK_CAPACITY: usize = 4096;

/// How many waiting spans make a full batch: the exporter is woken to send them without
/// waiting for its next tick.
pub const SINK_BATCH: usize = 512;

/// Where finished spans wait for the exporter. Finishing a span takes this lock for one push
/// and wakes no one (only a span that fills a batch does), so a run's path never waits for
/// the exporter or hands its work to another thread; the exporter takes what waits in one go.
#[derive(Debug, Default)]
struct Sink {
    waiting: Mutex<Vec<FinishedSpan>>,
    batch_full: Notify,
}

static SINK: OnceLock<Sink> = OnceLock::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// The sink was installed already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a trace sink is installed already")]
pub struct SinkInstalled;

/// The exporter's end of the sink.
#[derive(Debug, Clone, Copy)]
pub struct SpanReceiver {
    sink: &'static Sink,
}

impl SpanReceiver {
    /// Completes when a full batch ([`SINK_BATCH`] spans) waits, or at once when one filled
    /// since the last call.
    pub async fn batch_full(&self) {
        self.sink.batch_full.notified().await;
    }

    /// Every span waiting, oldest first; the sink is left empty.
    pub fn take(&self) -> Vec<FinishedSpan> {
        let mut waiting = self
            .sink
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        std::mem::take(&mut *waiting)
    }
}

/// Installs the process's trace sink and returns the receiving end: from now on, every span
/// the engine finishes waits there. Only the first call succeeds.
pub fn install_sink() -> Result<SpanReceiver, SinkInstalled> {
    let mut installed = false;
    let sink = SINK.get_or_init(|| {
        installed = true;
        Sink::default()
    });
    if installed {
        Ok(SpanReceiver { sink })
    } else {
        Err(SinkInstalled)
    }
}

/// Spans dropped because the exporter fell behind.
pub fn dropped_spans() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

fn enabled() -> bool {
    SINK.get().is_some()
}

fn emit(span: FinishedSpan) {
    let Some(sink) = SINK.get() else {
        return;
    };
    let waiting = {
        let mut waiting = sink.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        if waiting.len() >= SINK_CAPACITY {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        waiting.push(span);
        waiting.len()
    };
    if waiting == SINK_BATCH {
        sink.batch_full.notify_one();
    }
}

fn trace_id(run: RunId) -> [u8; 16] {
    *run.uuid().as_bytes()
}

/// A span id from the SHA-256 of `parts` (the first 8 bytes; never all zero, which OTLP
/// reads as no id).
fn derived_span_id(parts: &[&[u8]]) -> [u8; 8] {
    use sha2::{Digest as _, Sha256};
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(u64::try_from(part.len()).unwrap_or(0).to_be_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize();
    match digest.first_chunk::<8>() {
        Some(id) if *id != [0; 8] => *id,
        _ => 1_u64.to_be_bytes(),
    }
}

/// The W3C `traceparent` of `run`'s span while traces are on: what a tool server the operator
/// named may parent its own spans to (`EngineConfig::trace_context_to`). Ids only.
pub(crate) fn traceparent(run: &RunRecord) -> Option<String> {
    if !enabled() {
        return None;
    }
    let hex = |bytes: &[u8]| {
        bytes.iter().fold(String::new(), |mut text, byte| {
            text.push_str(&format!("{byte:02x}"));
            text
        })
    };
    Some(format!(
        "00-{}-{}-01",
        hex(&trace_id(run.id)),
        hex(&run_span_id(run.id))
    ))
}

fn run_span_id(run: RunId) -> [u8; 8] {
    derived_span_id(&[b"run", run.uuid().as_bytes()])
}

/// The call id is text the model chose: it goes into the hash only, never into a span.
fn call_span_id(run: RunId, call_id: &str) -> [u8; 8] {
    derived_span_id(&[b"call", run.uuid().as_bytes(), call_id.as_bytes()])
}

/// A fresh span id for a span no other span refers to by derivation.
fn fresh_span_id(run: RunId, kind: SpanKind) -> [u8; 8] {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    derived_span_id(&[
        kind.name().as_bytes(),
        run.uuid().as_bytes(),
        &n.to_be_bytes(),
        &nanos.to_be_bytes(),
        &std::process::id().to_be_bytes(),
    ])
}

fn millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

fn run_ids(run: &RunRecord) -> Vec<Attribute> {
    vec![
        ("wor.run.id", AttributeValue::Id(TypedId::Run(run.id))),
        (
            "wor.project.id",
            AttributeValue::Id(TypedId::Project(run.project_id)),
        ),
    ]
}

fn child(run: &RunRecord, kind: SpanKind, parent: [u8; 8], start: SystemTime) -> FinishedSpan {
    FinishedSpan {
        kind,
        trace_id: trace_id(run.id),
        span_id: fresh_span_id(run.id, kind),
        parent_span_id: Some(parent),
        start,
        end: SystemTime::now(),
        ok: true,
        attributes: run_ids(run),
    }
}

/// A worker ended `run` with `status`: the run's span, from its first start (its creation if
/// it never started) to now.
pub(crate) fn run_finished(run: &RunRecord, status: RunStatus) {
    if !enabled() {
        return;
    }
    let mut attributes = run_ids(run);
    attributes.extend([
        (
            "wor.routine.id",
            AttributeValue::Id(TypedId::Routine(run.routine_id)),
        ),
        (
            "wor.run.trigger",
            AttributeValue::Word(run.trigger_kind.as_str()),
        ),
        ("wor.run.status", AttributeValue::Word(status.as_str())),
        (
            "wor.run.parked_ms",
            AttributeValue::Int(run.parked_ms.max(0)),
        ),
    ]);
    emit(FinishedSpan {
        kind: SpanKind::Run,
        trace_id: trace_id(run.id),
        span_id: run_span_id(run.id),
        parent_span_id: None,
        start: millis(run.started_at.unwrap_or(run.created_at)),
        end: SystemTime::now(),
        ok: status == RunStatus::Succeeded,
        attributes,
    });
}

/// A model call of `run` that began at `began`: answered with these token counts (`None`:
/// it ended the run instead — failed, cancelled or out of time).
pub(crate) fn model_turn(
    run: &RunRecord,
    provider: ProviderKind,
    began: SystemTime,
    tokens: Option<(u64, u64)>,
) {
    if !enabled() {
        return;
    }
    let mut span = child(run, SpanKind::ModelTurn, run_span_id(run.id), began);
    span.attributes.push((
        "wor.model.provider",
        AttributeValue::Word(provider.as_str()),
    ));
    match tokens {
        Some((input, output)) => {
            span.attributes.extend([
                ("wor.outcome", AttributeValue::Word("answered")),
                (
                    "wor.model.input_tokens",
                    AttributeValue::Int(i64::try_from(input).unwrap_or(i64::MAX)),
                ),
                (
                    "wor.model.output_tokens",
                    AttributeValue::Int(i64::try_from(output).unwrap_or(i64::MAX)),
                ),
            ]);
        }
        None => {
            span.ok = false;
            span.attributes
                .push(("wor.outcome", AttributeValue::Word("ended_run")));
        }
    }
    emit(span);
}

/// Policy decided call `call_id` of `run`; the decision began at `began`.
pub(crate) fn tool_call_decided(
    run: &RunRecord,
    call_id: &str,
    began: SystemTime,
    verdict: Verdict,
) {
    if !enabled() {
        return;
    }
    let mut span = child(
        run,
        SpanKind::ToolDecision,
        call_span_id(run.id, call_id),
        began,
    );
    span.attributes.push((
        "wor.tool_call.decision",
        AttributeValue::Word(verdict.as_str()),
    ));
    emit(span);
}

/// The tool ran call `call_id` of `run` from `began`; `is_error` as the result said.
pub(crate) fn tool_executed(run: &RunRecord, call_id: &str, began: SystemTime, is_error: bool) {
    if !enabled() {
        return;
    }
    let mut span = child(
        run,
        SpanKind::ToolExecution,
        call_span_id(run.id, call_id),
        began,
    );
    span.ok = !is_error;
    span.attributes.push((
        "wor.outcome",
        AttributeValue::Word(if is_error { "error" } else { "ok" }),
    ));
    emit(span);
}

/// A fresh call `call_id` of `run` went through the pipeline from `began` and came to
/// `outcome` (an error is reported as `error`).
pub(crate) fn tool_call_answered<E>(
    run: &RunRecord,
    call_id: &str,
    began: SystemTime,
    outcome: &Result<CallOutcome, E>,
) {
    if !enabled() {
        return;
    }
    let (word, ok) = match outcome {
        Ok(CallOutcome::Answered { answer, .. }) => {
            if answer.result.is_error {
                ("answered_error", false)
            } else {
                ("answered", true)
            }
        }
        Ok(CallOutcome::Parked) => ("held", true),
        Ok(CallOutcome::Budget(_)) => ("budget_exceeded", false),
        Ok(CallOutcome::Fail(_)) => ("failed_run", false),
        Ok(CallOutcome::Cancelled) => ("cancelled", false),
        Err(_) => ("error", false),
    };
    let mut attributes = run_ids(run);
    attributes.push(("wor.outcome", AttributeValue::Word(word)));
    emit(FinishedSpan {
        kind: SpanKind::ToolCall,
        trace_id: trace_id(run.id),
        span_id: call_span_id(run.id, call_id),
        parent_span_id: Some(run_span_id(run.id)),
        start: began,
        end: SystemTime::now(),
        ok,
        attributes,
    });
}

/// A held call's approval was decided or expired: the wait, from the request to now.
pub(crate) fn approval_waited(approval: &ApprovalRecord) {
    if !enabled() {
        return;
    }
    let outcome = match approval.status {
        ApprovalStatus::Approved => "approved",
        ApprovalStatus::Denied => "denied",
        ApprovalStatus::Expired => "expired",
        ApprovalStatus::Pending => "pending",
        ApprovalStatus::Cancelled => "cancelled",
    };
    let mut attributes = vec![
        (
            "wor.run.id",
            AttributeValue::Id(TypedId::Run(approval.run_id)),
        ),
        (
            "wor.project.id",
            AttributeValue::Id(TypedId::Project(approval.project_id)),
        ),
        (
            "wor.approval.id",
            AttributeValue::Id(TypedId::Approval(approval.id)),
        ),
    ];
    attributes.push(("wor.outcome", AttributeValue::Word(outcome)));
    emit(FinishedSpan {
        kind: SpanKind::ApprovalWait,
        trace_id: trace_id(approval.run_id),
        span_id: fresh_span_id(approval.run_id, SpanKind::ApprovalWait),
        parent_span_id: Some(call_span_id(approval.run_id, &approval.call_id)),
        start: millis(approval.requested_at),
        end: approval.decided_at.map_or_else(SystemTime::now, millis),
        ok: approval.status == ApprovalStatus::Approved,
        attributes,
    });
}

/// One attempt to deliver a webhook of run `run_id`, begun at `began`; its attempt number.
pub(crate) fn webhook_attempted(
    project_id: ProjectId,
    run_id: RunId,
    began: SystemTime,
    attempt: i64,
    outcome: &AttemptOutcome,
) {
    if !enabled() {
        return;
    }
    let (result, status) = match outcome {
        AttemptOutcome::Delivered { status_code } => ("delivered", Some(*status_code)),
        AttemptOutcome::Failed { status_code, .. } => ("failed", *status_code),
    };
    let mut attributes = vec![
        ("wor.run.id", AttributeValue::Id(TypedId::Run(run_id))),
        (
            "wor.project.id",
            AttributeValue::Id(TypedId::Project(project_id)),
        ),
        ("wor.webhook.attempt", AttributeValue::Int(attempt)),
        ("wor.outcome", AttributeValue::Word(result)),
    ];
    if let Some(status) = status {
        attributes.push((
            "http.response.status_code",
            AttributeValue::Int(i64::from(status)),
        ));
    }
    emit(FinishedSpan {
        kind: SpanKind::WebhookDelivery,
        trace_id: trace_id(run_id),
        span_id: fresh_span_id(run_id, SpanKind::WebhookDelivery),
        parent_span_id: Some(run_span_id(run_id)),
        start: began,
        end: SystemTime::now(),
        ok: result == "delivered",
        attributes,
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_derived_span_id_is_the_first_eight_bytes_of_the_sha256_of_its_length_prefixed_parts() {
        // Fixed across versions: a run parked by one version and resumed by the next keeps
        // the span ids its children name as their parent.
        let uuid: Vec<u8> = (0..16).collect();
        let id = super::derived_span_id(&[b"call", &uuid, b"call_1"]);
        assert_eq!(id, 0xc3bf_0272_1339_4e3b_u64.to_be_bytes());
    }
}
