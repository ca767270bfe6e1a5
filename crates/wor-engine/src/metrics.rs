//! The engine's operational metrics: one function per event, so a hook in the engine is one
//! line. They record through the `metrics` facade; with no recorder installed (no `[metrics]`
//! listener) each call does nothing.
//!
//! INVARIANT: every label value is one of a fixed set of `&'static str` (a status, a trigger,
//! a provider, a verdict): never a routine name, a tool's arguments, a URL or any other text
//! of a project, so the number of series does not grow with what projects hold.

use std::time::Duration;

use metrics::{counter, histogram};
use wor_core::budget::BudgetLimit;
use wor_core::call::{TriggerKind, Verdict};
use wor_core::model::ProviderKind;
use wor_core::run::RunStatus;
use wor_core::run_loop::Ending;
use wor_store::{ApprovalStatus, AttemptOutcome, RunRecord};

pub const RUNS_STARTED: &str = "wor_runs_started_total";
pub const RUNS_FINISHED: &str = wor_store::metrics::RUNS_FINISHED;
pub const BUDGET_EXHAUSTED: &str = "wor_budget_exhausted_total";
pub const RUN_DURATION: &str = "wor_run_duration_seconds";
pub const RUN_QUEUE_LAG: &str = "wor_run_queue_lag_seconds";
pub const SCHEDULE_LAG: &str = "wor_schedule_lag_seconds";
pub const MODEL_CALLS: &str = "wor_model_calls_total";
pub const MODEL_TOKENS: &str = "wor_model_tokens_total";
pub const TOOL_CALLS: &str = "wor_tool_calls_total";
pub const APPROVALS_DECIDED: &str = "wor_approvals_decided_total";
pub const WEBHOOK_DELIVERIES: &str = "wor_webhook_deliveries_total";
pub const NOTIFICATION_DELIVERIES: &str = "wor_notification_deliveries_total";

/// Describes the engine's metrics to the installed recorder (`# HELP` lines), with those of
/// the sandbox and the Wasm runtime it starts tools in.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_histogram};
    wor_sandbox::metrics::describe();
    wor_wasm::metrics::describe();
    describe_counter!(
        RUNS_STARTED,
        "Runs claimed by a worker for the first time, by trigger"
    );
    describe_counter!(
        RUNS_FINISHED,
        "Runs ended, by final status and trigger (cancelled while queued and skipped included)"
    );
    describe_counter!(
        BUDGET_EXHAUSTED,
        "Runs ended by an exhausted budget, by the limit (turns, tool_calls, input_tokens, output_tokens, cost_microdollars, wall_seconds)"
    );
    describe_histogram!(
        RUN_DURATION,
        Unit::Seconds,
        "From a run's first start to its end, without time parked for approvals"
    );
    describe_histogram!(
        SCHEDULE_LAG,
        Unit::Seconds,
        "From a schedule slot's time (plus jitter) to its run's being claimable: 0 for a run recorded ahead"
    );
    describe_histogram!(
        RUN_QUEUE_LAG,
        Unit::Seconds,
        "From a run's creation to its first claim by a worker"
    );
    describe_counter!(MODEL_CALLS, "Model calls answered, by provider");
    describe_counter!(
        MODEL_TOKENS,
        "Model tokens, by provider and direction (input, output)"
    );
    describe_counter!(
        TOOL_CALLS,
        "Tool calls decided, by decision (allow, confirm, deny), and allowed calls whose request the egress guard then refused (egress_refused; also counted as decided)"
    );
    describe_counter!(
        APPROVALS_DECIDED,
        "Approvals decided, by outcome (approved, denied, expired)"
    );
    describe_counter!(
        WEBHOOK_DELIVERIES,
        "Run webhook delivery attempts, by result (delivered, failed)"
    );
    describe_counter!(
        NOTIFICATION_DELIVERIES,
        "Approval notification delivery attempts, by channel (slack, email) and result (delivered, refused, egress_denied, unreachable, tls, waiting, undeliverable)"
    );
}

fn seconds_between(from_ms: i64, to_ms: i64) -> f64 {
    Duration::from_millis(u64::try_from(to_ms.saturating_sub(from_ms)).unwrap_or(0)).as_secs_f64()
}

/// The scheduler recorded the run of a slot due at `due_ms` (its time plus jitter) at
/// `recorded_ms`; a run recorded ahead of its slot is claimable from it on, a lag of 0.
pub(crate) fn slot_started(due_ms: i64, recorded_ms: i64) {
    histogram!(SCHEDULE_LAG).record(seconds_between(due_ms, recorded_ms));
}

/// A worker claimed `run`; `claim_began_ms` is when the claim was asked for. Only a first
/// claim (its `started_at` written by this claim) counts as a start.
pub(crate) fn run_claimed(run: &RunRecord, claim_began_ms: i64) {
    let Some(started) = run.started_at else {
        return;
    };
    if started < claim_began_ms {
        return;
    }
    counter!(RUNS_STARTED, "trigger" => run.trigger_kind.as_str()).increment(1);
    // A run recorded ahead of its slot waits from the slot, not from when it was recorded.
    let queued = run
        .not_before
        .map_or(run.created_at, |at| at.max(run.created_at));
    histogram!(RUN_QUEUE_LAG).record(seconds_between(queued, started));
}

/// The limit that ended a `budget_exceeded` run, as the run loop typed it; `other` for an
/// ending that carries none.
fn exhausted_limit(ending: &Ending) -> &'static str {
    ending.exhausted.map_or("other", BudgetLimit::as_str)
}

/// A worker ended `run` as `ending` says.
pub(crate) fn run_finished(run: &RunRecord, ending: &Ending) {
    let status = ending.status;
    counter!(RUNS_FINISHED, "status" => status.as_str(), "trigger" => trigger(run.trigger_kind))
        .increment(1);
    if status == RunStatus::BudgetExceeded {
        counter!(BUDGET_EXHAUSTED, "limit" => exhausted_limit(ending)).increment(1);
    }
    if let Some(started) = run.started_at {
        let active = wor_store::now_millis()
            .saturating_sub(started)
            .saturating_sub(run.parked_ms);
        histogram!(RUN_DURATION, "status" => status.as_str()).record(seconds_between(0, active));
    }
}

fn trigger(kind: TriggerKind) -> &'static str {
    kind.as_str()
}

/// A model answered a call of a run.
pub(crate) fn model_called(provider: ProviderKind, input_tokens: u64, output_tokens: u64) {
    let provider = provider.as_str();
    counter!(MODEL_CALLS, "provider" => provider).increment(1);
    counter!(MODEL_TOKENS, "provider" => provider, "direction" => "input").increment(input_tokens);
    counter!(MODEL_TOKENS, "provider" => provider, "direction" => "output")
        .increment(output_tokens);
}

/// Policy decided a proposed tool call.
pub(crate) fn tool_call_decided(verdict: Verdict) {
    counter!(TOOL_CALLS, "decision" => verdict.as_str()).increment(1);
}

/// The egress guard refused the request of an allowed (or approved) tool call.
pub(crate) fn tool_call_refused_by_egress() {
    counter!(TOOL_CALLS, "decision" => "egress_refused").increment(1);
}

/// A person decided an approval (`approved` or `denied`).
pub(crate) fn approval_decided(status: ApprovalStatus) {
    counter!(APPROVALS_DECIDED, "outcome" => status.as_str()).increment(1);
}

/// `count` approvals expired undecided.
pub(crate) fn approvals_expired(count: usize) {
    if count > 0 {
        counter!(APPROVALS_DECIDED, "outcome" => ApprovalStatus::Expired.as_str())
            .increment(u64::try_from(count).unwrap_or(u64::MAX));
    }
}

/// One attempt to deliver a run webhook.
pub(crate) fn webhook_attempted(outcome: &AttemptOutcome) {
    let result = match outcome {
        AttemptOutcome::Delivered { .. } => "delivered",
        AttemptOutcome::Failed { .. } => "failed",
    };
    counter!(WEBHOOK_DELIVERIES, "result" => result).increment(1);
}

/// The channel a notification goes out on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotificationChannel {
    Slack,
    Email,
}

impl NotificationChannel {
    fn as_str(self) -> &'static str {
        match self {
            NotificationChannel::Slack => "slack",
            NotificationChannel::Email => "email",
        }
    }
}

/// What came of one attempt to deliver a notification, by class: the delivery log keeps the
/// text of each failure, the metric only which kind it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeliveryResult {
    Delivered,
    /// The service answered with an error: Slack's `ok: false` or an HTTP error status, or an
    /// SMTP relay's negative reply (a refused login, `451 try again later`).
    Refused,
    /// The egress guard refused the destination.
    EgressDenied,
    /// The destination did not resolve, accept a connection or answer in time.
    Unreachable,
    /// Encryption could not be set up: no STARTTLS offered, or a failed TLS handshake.
    Tls,
    /// An update that waits for its message's post.
    Waiting,
    /// It cannot go out as it stands: its route is gone, its secrets cannot be opened, the
    /// message cannot be built, or plaintext is not allowed to that relay.
    Undeliverable,
}

impl DeliveryResult {
    fn as_str(self) -> &'static str {
        match self {
            DeliveryResult::Delivered => "delivered",
            DeliveryResult::Refused => "refused",
            DeliveryResult::EgressDenied => "egress_denied",
            DeliveryResult::Unreachable => "unreachable",
            DeliveryResult::Tls => "tls",
            DeliveryResult::Waiting => "waiting",
            DeliveryResult::Undeliverable => "undeliverable",
        }
    }

    /// The class of a request or connection the egress guard did not complete.
    pub(crate) fn of_egress(error: &wor_egress::EgressError) -> Self {
        use wor_egress::EgressError;
        match error {
            EgressError::Denied(_) => DeliveryResult::EgressDenied,
            EgressError::Resolve { .. }
            | EgressError::ResolverSetup(_)
            | EgressError::Timeout(_)
            | EgressError::Request(_)
            | EgressError::Unreachable { .. } => DeliveryResult::Unreachable,
            EgressError::ResponseTooLarge { .. } => DeliveryResult::Refused,
            EgressError::Build(_) => DeliveryResult::Undeliverable,
        }
    }
}

/// One attempt to deliver an approval notification.
pub(crate) fn notification_attempted(channel: NotificationChannel, result: DeliveryResult) {
    counter!(NOTIFICATION_DELIVERIES, "channel" => channel.as_str(), "result" => result.as_str())
        .increment(1);
}
#[cfg(test)]
mod tests {
    use wor_core::budget::{BudgetExceeded, BudgetLimit};
    use wor_core::run::RunStatus;
    use wor_core::run_loop::Ending;

    #[test]
    fn a_budget_ending_carries_the_limit_that_ran_out() {
        for limit in [
            BudgetLimit::Turns,
            BudgetLimit::ToolCalls,
            BudgetLimit::InputTokens,
            BudgetLimit::OutputTokens,
            BudgetLimit::Cost,
            BudgetLimit::WallTime,
        ] {
            let ending = Ending::budget(BudgetExceeded {
                limit,
                used: 3,
                allowed: 2,
            });
            assert_eq!(super::exhausted_limit(&ending), limit.as_str());
        }
        // An outcome that merely reads like one names no limit.
        let text = Ending::new(
            RunStatus::BudgetExceeded,
            "budget `turns` exhausted: 3 of 2",
        );
        assert_eq!(super::exhausted_limit(&text), "other");
    }
}
