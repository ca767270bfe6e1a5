//! The agent loop of one run as a pure state machine: what comes next, given what happened.
//!
//! The driver (in `wor-engine`) does the I/O — asks the model, runs each call through the tool
//! pipeline, persists every step before the next — and reports each result here; this module
//! decides the order and the ends. Before every step it checks, in this order: a cancel
//! request, then every budget (turns, tool calls, tokens, cost, wall time). Then it answers the
//! oldest pending call of the last model turn, or, when none is left, reserves one model turn.
//! A turn without calls ends the run with its answer. Call ids are made unique within the run,
//! since steps and approvals are keyed by them.
//!
//! Within one call, [`Verdict::then`] says what follows the policy decision, and
//! [`CallResume::of`] what resuming a call recorded before a restart must do.
//!
//! A run resumed after a restart is rebuilt with [`RunLoop::resume`] from its stored usage,
//! the calls of its last turn that have no result yet, the call ids already used, and the
//! untrusted sources already in its context; it then goes on exactly where it stopped.

use std::collections::{BTreeSet, VecDeque};

use crate::budget::{BudgetExceeded, BudgetLimit, BudgetUsage, ModelPrice};
use crate::call::Verdict;
use crate::model::ToolCallRequest;
use crate::routine::BudgetLimits;
use crate::run::{Provenance, RunStatus};
use crate::step::{PendingCall, ToolResultStep, tool_source};

/// How a run ended, with the reason recorded as its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    pub status: RunStatus,
    pub outcome: String,
    /// The limit that ran out, when a budget ended the run.
    pub exhausted: Option<BudgetLimit>,
}

impl Ending {
    /// An ending with `outcome` as its reason; U+0000 in it becomes U+FFFD (`text.rs`), as
    /// outcomes can quote what a model or tool wrote.
    pub fn new(status: RunStatus, outcome: impl Into<String>) -> Self {
        let outcome = outcome.into();
        let outcome = match crate::text::replace_nul(&outcome) {
            std::borrow::Cow::Owned(clean) => clean,
            std::borrow::Cow::Borrowed(_) => outcome,
        };
        Ending {
            status,
            outcome,
            exhausted: None,
        }
    }

    /// A run whose cancel was requested.
    pub fn cancelled() -> Self {
        Ending::new(RunStatus::Cancelled, "cancelled on request")
    }

    /// A run that went over a budget, naming the limit.
    pub fn budget(exceeded: BudgetExceeded) -> Self {
        Ending {
            exhausted: Some(exceeded.limit),
            ..Ending::new(RunStatus::BudgetExceeded, exceeded.to_string())
        }
    }
}

/// What the driver does next.
#[derive(Debug, PartialEq)]
pub enum Next<C> {
    /// The run is over.
    End(Ending),
    /// Ask the model for a turn; the turn is already counted in [`RunLoop::usage`].
    CallModel,
    /// Run this call through the tool pipeline, then report with [`RunLoop::call_answered`].
    Answer(C),
}

/// What the tool pipeline made of one call.
#[derive(Debug, Clone, PartialEq)]
pub enum CallOutcome {
    /// The call has an answer for the model — a tool's result, a refusal or a denial — with
    /// its label and the run's usage now. An untrusted answer adds its tool to the context's
    /// untrusted sources.
    Answered {
        answer: ToolResultStep,
        provenance: Provenance,
        usage: BudgetUsage,
    },
    /// Running it would go over a budget.
    Budget(BudgetExceeded),
    /// The run must fail (a quarantine, a routine that fails on denial, a lost credential).
    Fail(String),
    /// The call waits for a person; the run parks.
    Parked,
    /// A cancel of the run was requested before the call could be reserved or parked: it did
    /// not run, and the run ends cancelled.
    Cancelled,
}

/// After a call: go on, end, or park.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterCall {
    Continue,
    End(Ending),
    Park,
}

/// The loop's state: limits, usage, the calls still to answer, the ids used, the untrusted
/// sources in the context.
#[derive(Debug, Clone)]
pub struct RunLoop<C> {
    limits: BudgetLimits,
    usage: BudgetUsage,
    pending: VecDeque<C>,
    call_ids: BTreeSet<String>,
    untrusted: BTreeSet<String>,
}

impl<C> RunLoop<C> {
    /// The loop of a run with `usage` so far, `pending` calls of its last turn (in the model's
    /// order), the call ids it has used and the untrusted sources in its context.
    pub fn resume(
        limits: BudgetLimits,
        usage: BudgetUsage,
        pending: Vec<C>,
        call_ids: BTreeSet<String>,
        untrusted: BTreeSet<String>,
    ) -> Self {
        RunLoop {
            limits,
            usage,
            pending: pending.into(),
            call_ids,
            untrusted,
        }
    }

    pub fn usage(&self) -> BudgetUsage {
        self.usage
    }

    pub fn limits(&self) -> BudgetLimits {
        self.limits
    }

    /// The untrusted sources in the context so far (`tool:CONNECTION/TOOL`, `webhook`, …).
    pub fn untrusted(&self) -> &BTreeSet<String> {
        &self.untrusted
    }

    /// The next step, given whether a cancel was requested and the wall time used so far.
    pub fn next(&mut self, cancel_requested: bool, elapsed_seconds: u64) -> Next<C> {
        if cancel_requested {
            return Next::End(Ending::cancelled());
        }
        if let Err(exceeded) = self.usage.check(&self.limits, elapsed_seconds) {
            return Next::End(Ending::budget(exceeded));
        }
        if let Some(call) = self.pending.pop_front() {
            return Next::Answer(call);
        }
        match self.usage.reserve_turn(&self.limits) {
            Ok(usage) => {
                self.usage = usage;
                Next::CallModel
            }
            Err(exceeded) => Next::End(Ending::budget(exceeded)),
        }
    }

    /// Counts a model turn's tokens and cost, and renames its calls whose ids are empty or
    /// already used in the run (some servers send `call_0` every turn): `call_0~N`.
    pub fn model_answered(
        &mut self,
        input_tokens: u64,
        output_tokens: u64,
        price: &ModelPrice,
        calls: &mut [ToolCallRequest],
    ) {
        self.usage = self
            .usage
            .add_model_usage(input_tokens, output_tokens, price);
        for call in calls {
            if call.id.is_empty() || self.call_ids.contains(&call.id) {
                let base = if call.id.is_empty() {
                    "call"
                } else {
                    call.id.as_str()
                };
                let mut n = self.call_ids.len();
                let mut candidate = format!("{base}~{n}");
                while self.call_ids.contains(&candidate) {
                    n = n.saturating_add(1);
                    candidate = format!("{base}~{n}");
                }
                call.id = candidate;
            }
            self.call_ids.insert(call.id.clone());
        }
    }

    /// The turn is recorded, with `calls` to answer (as recorded). Ends the run when the turn
    /// went over a budget, or, without calls, with the turn's `answer`.
    pub fn turn_recorded(
        &mut self,
        calls: Vec<C>,
        elapsed_seconds: u64,
        answer: impl FnOnce() -> String,
    ) -> Option<Ending> {
        if let Err(exceeded) = self.usage.check(&self.limits, elapsed_seconds) {
            return Some(Ending::budget(exceeded));
        }
        if calls.is_empty() {
            return Some(Ending::new(RunStatus::Succeeded, answer()));
        }
        self.pending = calls.into();
        None
    }

    /// What the pipeline made of the call last handed out.
    pub fn call_answered(&mut self, outcome: &CallOutcome) -> AfterCall {
        match outcome {
            CallOutcome::Answered {
                answer,
                provenance,
                usage,
            } => {
                self.usage = *usage;
                if *provenance == Provenance::Untrusted {
                    self.untrusted.insert(tool_source(&answer.tool));
                }
                AfterCall::Continue
            }
            CallOutcome::Budget(exceeded) => AfterCall::End(Ending::budget(*exceeded)),
            CallOutcome::Fail(reason) => {
                AfterCall::End(Ending::new(RunStatus::Failed, reason.clone()))
            }
            CallOutcome::Parked => AfterCall::Park,
            CallOutcome::Cancelled => AfterCall::End(Ending::cancelled()),
        }
    }
}

/// What follows a call's decision, in the order the pipeline persists it. Before the decision
/// come the roster, the pinned schema and the pinned arguments; a call that fails one of them
/// is refused back to the model and never decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDecision {
    /// Record the call with its refusal; the model is told why.
    RecordRefusal,
    /// Record the call, file an approval and park the run.
    RecordAndPark,
    /// Running it would go over the tool-call budget: the run ends, the call not recorded as
    /// started.
    Budget(BudgetExceeded),
    /// The call is counted (`usage`): record it as started and save the usage, then execute it
    /// and record its result.
    RecordAndExecute(BudgetUsage),
}

impl Verdict {
    /// The next transitions of a call with this verdict, given the run's usage and limits.
    pub fn then(self, usage: BudgetUsage, limits: &BudgetLimits) -> AfterDecision {
        match self {
            Verdict::Deny => AfterDecision::RecordRefusal,
            Verdict::Confirm => AfterDecision::RecordAndPark,
            Verdict::Allow => match usage.reserve_tool_call(limits) {
                Ok(usage) => AfterDecision::RecordAndExecute(usage),
                Err(exceeded) => AfterDecision::Budget(exceeded),
            },
        }
    }
}

/// Where one call of the last turn stood when its run stopped, read from its steps: what
/// resuming it must do so that nothing is repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResume {
    /// No decision was recorded: the call goes through the whole pipeline.
    Fresh,
    /// Policy denied it: the model is told so again.
    Refused,
    /// It was held for a person: its approval decides.
    Held,
    /// It started (allowed, or with an approval used) and has no result, so it may have had
    /// its effect. A routine call finds its nested run again; any other call is not repeated
    /// without a person (its outcome is unknown).
    Started { routine: bool },
}

impl CallResume {
    /// From how far the call got: its recorded decision, if any, and whether an approval
    /// was used to start it.
    pub fn of(pending: &PendingCall) -> Self {
        let Some(recorded) = &pending.recorded else {
            return CallResume::Fresh;
        };
        let routine = recorded.calls_routine();
        match recorded.decision {
            _ if pending.started_with_approval => CallResume::Started { routine },
            Verdict::Allow => CallResume::Started { routine },
            Verdict::Confirm => CallResume::Held,
            Verdict::Deny => CallResume::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::budget::BudgetLimit;
    use crate::step::ToolCallStep;

    fn limits(turns: u64, tool_calls: u64) -> BudgetLimits {
        BudgetLimits {
            turns,
            tool_calls,
            input_tokens: 1_000,
            output_tokens: 1_000,
            cost_microdollars: 1_000,
            wall_seconds: 60,
        }
    }

    fn call(id: &str) -> ToolCallRequest {
        ToolCallRequest {
            id: id.to_owned(),
            name: "t".to_owned(),
            arguments: serde_json::json!({}),
            thought_signature: None,
        }
    }

    fn answered_by(tool: &str, provenance: Provenance, usage: BudgetUsage) -> CallOutcome {
        CallOutcome::Answered {
            answer: ToolResultStep {
                tool: tool.to_owned(),
                result: crate::model::ToolResult {
                    tool_call_id: "a".to_owned(),
                    content: "r".to_owned(),
                    is_error: false,
                },
                nul_replaced: false,
            },
            provenance,
            usage,
        }
    }

    fn fresh(limits: BudgetLimits) -> RunLoop<ToolCallRequest> {
        RunLoop::resume(
            limits,
            BudgetUsage::default(),
            Vec::new(),
            BTreeSet::new(),
            BTreeSet::new(),
        )
    }

    #[test]
    fn a_turn_without_calls_ends_the_run_with_its_answer() {
        let mut run = fresh(limits(3, 3));
        assert_eq!(run.next(false, 0), Next::CallModel);
        assert_eq!(run.usage().turns, 1);
        let ending = run.turn_recorded(Vec::new(), 0, || "done".to_owned());
        assert_eq!(ending, Some(Ending::new(RunStatus::Succeeded, "done")));
    }

    #[test]
    fn calls_are_answered_in_order_before_the_next_turn() {
        let mut run = fresh(limits(3, 3));
        assert_eq!(run.next(false, 0), Next::CallModel);
        assert_eq!(
            run.turn_recorded(vec![call("a"), call("b")], 0, String::new),
            None
        );
        assert_eq!(run.next(false, 0), Next::Answer(call("a")));
        let usage = run.usage();
        let answered = answered_by("c/t", Provenance::Untrusted, usage);
        assert_eq!(run.call_answered(&answered), AfterCall::Continue);
        assert_eq!(run.next(false, 0), Next::Answer(call("b")));
        assert!(run.untrusted().contains("tool:c/t"));
        assert_eq!(run.next(false, 0), Next::CallModel);
        assert_eq!(run.usage().turns, 2);
    }

    #[test]
    fn cancel_comes_before_everything_and_the_budget_before_any_step() {
        // A run that used its one turn, which asked for call `a`.
        let mut run = RunLoop::resume(
            limits(1, 1),
            BudgetUsage {
                turns: 1,
                ..BudgetUsage::default()
            },
            vec![call("a")],
            BTreeSet::new(),
            BTreeSet::new(),
        );
        let Next::End(ending) = run.clone().next(true, 999) else {
            panic!("a cancel ends the run");
        };
        assert_eq!(ending.status, RunStatus::Cancelled);
        let Next::End(ending) = run.clone().next(false, 60) else {
            panic!("the wall time ends the run");
        };
        assert_eq!(ending.status, RunStatus::BudgetExceeded);
        assert!(ending.outcome.contains("wall"), "{}", ending.outcome);
        // A resumed run answers its pending call first, then has no turn left.
        assert_eq!(run.next(false, 0), Next::Answer(call("a")));
        let Next::End(ending) = run.next(false, 0) else {
            panic!("no turn is left");
        };
        assert_eq!(ending.status, RunStatus::BudgetExceeded);
    }

    #[test]
    fn outcomes_of_the_pipeline_end_park_or_go_on() {
        let mut run = fresh(limits(3, 3));
        let exceeded = BudgetExceeded {
            limit: BudgetLimit::ToolCalls,
            used: 4,
            allowed: 3,
        };
        assert_eq!(
            run.call_answered(&CallOutcome::Budget(exceeded)),
            AfterCall::End(Ending::budget(exceeded))
        );
        assert_eq!(
            run.call_answered(&CallOutcome::Fail("quarantined".to_owned())),
            AfterCall::End(Ending::new(RunStatus::Failed, "quarantined"))
        );
        assert_eq!(run.call_answered(&CallOutcome::Parked), AfterCall::Park);
        assert_eq!(
            run.call_answered(&CallOutcome::Cancelled),
            AfterCall::End(Ending::cancelled())
        );
    }

    #[test]
    fn reused_and_empty_call_ids_are_made_unique() {
        let mut run = RunLoop::<ToolCallRequest>::resume(
            limits(3, 3),
            BudgetUsage::default(),
            Vec::new(),
            ["call_0".to_owned()].into(),
            BTreeSet::new(),
        );
        let mut calls = vec![call("call_0"), call("call_1"), call("call_1"), call("")];
        run.model_answered(1, 1, &ModelPrice::default(), &mut calls);
        let ids: BTreeSet<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids.len(), 4, "{calls:?}");
        assert!(!ids.contains("call_0"));
        assert!(ids.contains("call_1"));
        assert!(ids.iter().all(|id| !id.is_empty()));
    }

    #[test]
    fn only_an_allowed_call_within_budget_is_executed() {
        let limits = limits(3, 1);
        let none = BudgetUsage::default();
        assert_eq!(
            Verdict::Deny.then(none, &limits),
            AfterDecision::RecordRefusal
        );
        assert_eq!(
            Verdict::Confirm.then(none, &limits),
            AfterDecision::RecordAndPark
        );
        let AfterDecision::RecordAndExecute(usage) = Verdict::Allow.then(none, &limits) else {
            panic!("an allowed call within budget runs");
        };
        assert_eq!(usage.tool_calls, 1);
        assert!(matches!(
            Verdict::Allow.then(usage, &limits),
            AfterDecision::Budget(BudgetExceeded {
                limit: BudgetLimit::ToolCalls,
                ..
            })
        ));
    }

    #[test]
    fn a_resumed_call_repeats_nothing_that_may_have_happened() {
        let pending =
            |decision: Option<Verdict>, started_with_approval: bool, tool: &str| PendingCall {
                call: call("a"),
                recorded: decision.map(|decision| ToolCallStep {
                    tool: tool.to_owned(),
                    model_name: "t".to_owned(),
                    call_id: "a".to_owned(),
                    arguments: serde_json::Map::new(),
                    arguments_hash: String::new(),
                    pinned_keys: Vec::new(),
                    pin_hash: String::new(),
                    decision,
                    determining_policies: Vec::new(),
                    reasons: Vec::new(),
                    untrusted_sources: BTreeSet::new(),
                    argument_labels: None,
                }),
                started_with_approval,
            };
        assert_eq!(
            CallResume::of(&pending(None, false, "mail/send")),
            CallResume::Fresh
        );
        assert_eq!(
            CallResume::of(&pending(Some(Verdict::Deny), false, "mail/send")),
            CallResume::Refused
        );
        assert_eq!(
            CallResume::of(&pending(Some(Verdict::Confirm), false, "mail/send")),
            CallResume::Held
        );
        assert_eq!(
            CallResume::of(&pending(Some(Verdict::Allow), false, "mail/send")),
            CallResume::Started { routine: false }
        );
        // An approved call that was started is started, whatever its first decision said.
        assert_eq!(
            CallResume::of(&pending(Some(Verdict::Confirm), true, "routine/digest")),
            CallResume::Started { routine: true }
        );
        // Only the `routine` connection is a routine call, not a name that starts with it.
        assert_eq!(
            CallResume::of(&pending(Some(Verdict::Allow), false, "routines/x")),
            CallResume::Started { routine: false }
        );
    }

    #[derive(Debug, Clone)]
    enum Event {
        Turn { calls: u8, tokens: u16 },
        Call { untrusted: bool, fail: bool },
        Cancel,
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            (0u8..4, 0u16..400).prop_map(|(calls, tokens)| Event::Turn { calls, tokens }),
            (any::<bool>(), prop::bool::weighted(0.05))
                .prop_map(|(untrusted, fail)| Event::Call { untrusted, fail }),
            Just(Event::Cancel),
        ]
    }

    proptest! {
        /// Whatever the model and the pipeline do, the loop never hands out a step beyond a
        /// limit, every call id is unique, and once it ends it ends for good.
        #[test]
        fn the_loop_never_steps_past_a_limit(
            events in prop::collection::vec(event(), 1..80),
            turns in 1u64..6,
            tool_calls in 0u64..8,
        ) {
            let limits = limits(turns, tool_calls);
            let mut run = fresh(limits);
            let mut seen_ids = BTreeSet::new();
            let mut events = events.into_iter();
            let mut model_turns = 0u64;
            loop {
                let event = events.next();
                let cancel = matches!(event, Some(Event::Cancel) | None);
                match run.next(cancel, 0) {
                    Next::End(ending) => {
                        prop_assert!(cancel || ending.status == RunStatus::BudgetExceeded
                            || ending.status == RunStatus::Succeeded);
                        break;
                    }
                    Next::CallModel => {
                        model_turns += 1;
                        prop_assert!(model_turns <= limits.turns);
                        let (calls, tokens) = match event {
                            Some(Event::Turn { calls, tokens }) => (calls, tokens),
                            _ => (1, 10),
                        };
                        let mut requests: Vec<ToolCallRequest> =
                            (0..calls).map(|_| call("call_0")).collect();
                        run.model_answered(u64::from(tokens), 1, &ModelPrice::default(), &mut requests);
                        for request in &requests {
                            prop_assert!(seen_ids.insert(request.id.clone()), "id {} reused", request.id);
                        }
                        if let Some(ending) = run.turn_recorded(requests, 0, String::new) {
                            prop_assert!(ending.status != RunStatus::Cancelled);
                            break;
                        }
                    }
                    Next::Answer(_) => {
                        let (untrusted, fail) = match event {
                            Some(Event::Call { untrusted, fail }) => (untrusted, fail),
                            _ => (false, false),
                        };
                        let outcome = if fail {
                            CallOutcome::Fail("refused".to_owned())
                        } else {
                            match run.usage().reserve_tool_call(&run.limits()) {
                                Ok(usage) => answered_by(
                                    "c/t",
                                    if untrusted { Provenance::Untrusted } else { Provenance::Engine },
                                    usage,
                                ),
                                Err(exceeded) => CallOutcome::Budget(exceeded),
                            }
                        };
                        match run.call_answered(&outcome) {
                            AfterCall::Continue => {
                                prop_assert!(run.usage().tool_calls <= limits.tool_calls);
                            }
                            AfterCall::End(_) | AfterCall::Park => break,
                        }
                    }
                }
            }
            prop_assert!(run.usage().turns <= limits.turns);
            prop_assert!(run.usage().tool_calls <= limits.tool_calls);
        }
    }
}
