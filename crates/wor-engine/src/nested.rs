//! Routines used as tools: a roster entry `routine/NAME` offers routine NAME to the model as a
//! tool taking `{input}`. Calling it starts a nested run of that routine — its parent, root and
//! depth recorded, its budget capped by what is left of the root run's, nesting at most
//! [`MAX_NESTING_DEPTH`] deep — which the parent's worker drives at once, on a task of its own. A nested run that
//! waits for a person parks its parent too; when it ends, the parent is queued again and takes
//! its answer. Its output is untrusted for the parent, like any tool result. A remote worker's
//! parent asks the control plane for its nested run instead and parks until it ends
//! (`Engine::nested_for_worker`); any worker drives the nested run.

use serde_json::{Value, json};
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::budget::BudgetUsage;
use wor_core::call::{ToolClass, TriggerKind};
use wor_core::routine::{BudgetLimits, ROUTINE_CONNECTION, RosterEntry};
use wor_core::run::{Provenance, RunStatus};
use wor_core::run_loop::CallOutcome;
use wor_core::step::{InputSource, InputStep, PendingCall, new_boundary, untrusted_envelope};
use wor_store::{NestedPark, NewRun, ParentLink, RunRecord, StoreError};
use wor_tools::{PinnedToolDefinition, ToolDefinition};

use crate::call::{CallScope, cancel_poll};
use crate::run_tools::OfferedTool;
use crate::{Engine, EngineError};
/// How deep routines may call routines: a root run is depth 0.
pub const MAX_NESTING_DEPTH: i64 = 3;

/// What is left of `limits` after `used`, field by field.
pub(crate) fn remaining(limits: &BudgetLimits, used: &BudgetUsage) -> BudgetLimits {
    BudgetLimits {
        turns: limits.turns.saturating_sub(used.turns),
        tool_calls: limits.tool_calls.saturating_sub(used.tool_calls),
        input_tokens: limits.input_tokens.saturating_sub(used.input_tokens),
        output_tokens: limits.output_tokens.saturating_sub(used.output_tokens),
        cost_microdollars: limits
            .cost_microdollars
            .saturating_sub(used.cost_microdollars),
        wall_seconds: limits.wall_seconds,
    }
}

/// `limits` capped by a nested run's cap, field by field. A cap that cannot be read caps
/// everything at zero: a nested run never gets more than its root allows.
pub(crate) fn capped(limits: BudgetLimits, cap: Option<&Value>) -> BudgetLimits {
    let Some(cap) = cap else {
        return limits;
    };
    let field = |name: &str| cap.get(name).and_then(Value::as_u64).unwrap_or(0);
    BudgetLimits {
        turns: limits.turns.min(field("turns")),
        tool_calls: limits.tool_calls.min(field("tool_calls")),
        input_tokens: limits.input_tokens.min(field("input_tokens")),
        output_tokens: limits.output_tokens.min(field("output_tokens")),
        cost_microdollars: limits.cost_microdollars.min(field("cost_microdollars")),
        wall_seconds: limits.wall_seconds.min(field("wall_seconds")),
    }
}

fn routine_tool_definition(name: &str, description: &str) -> ToolDefinition {
    let schema = json!({
        "type": "object",
        "properties": {"input": {"type": "string", "description": "what to ask the routine"}},
        "required": ["input"],
        "additionalProperties": false
    });
    ToolDefinition {
        name: name.to_owned(),
        description: Some(if description.is_empty() {
            format!("Runs the routine `{name}` and returns its answer.")
        } else {
            description.to_owned()
        }),
        input_schema: schema.as_object().cloned().unwrap_or_default(),
        annotations: Some(json!({"routine": name})),
    }
}

impl Engine {
    /// Drives `run` to its end as an owned, boxed future: a task of its own can run it, and the
    /// explicit type breaks the cycle of a run driving a run.
    fn drive_owned(
        self,
        run: RunRecord,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), EngineError>> + Send>> {
        Box::pin(async move { self.drive(run).await })
    }

    /// The tool a roster entry `routine/NAME` offers: the routine must exist in the project.
    pub(crate) async fn routine_tool(
        &self,
        run: &RunRecord,
        name: &str,
        entry: &RosterEntry,
    ) -> Result<OfferedTool, EngineError> {
        let missing = || EngineError::MissingRosterRoutine {
            name: name.to_owned(),
        };
        let (description, content_hash) = match self.remote_claim(run.id) {
            Some(claim) => {
                let routine = Engine::claimed_routine_tool(&*claim?, name).ok_or_else(missing)?;
                (routine.description, routine.content_hash)
            }
            None => {
                let routine = match self.store.find_routine_by_name(run.project_id, name).await {
                    Ok(routine) => routine,
                    Err(StoreError::NotFound) => return Err(missing()),
                    Err(other) => return Err(other.into()),
                };
                let version = self
                    .routine_version(run.project_id, routine.id, routine.current_version)
                    .await?;
                (
                    version.definition.description.clone(),
                    version.content_hash.clone(),
                )
            }
        };
        // The routine's content hash is part of the pinned definition, so an approval of a
        // call binds to the routine exactly as it was when the call was approved.
        let mut definition = routine_tool_definition(name, &description);
        definition.annotations = Some(json!({"routine": name, "content_hash": content_hash}));
        let pin = PinnedToolDefinition::pin(definition);
        // A routine can do anything its own roster lets it: never read-only by default.
        Ok(OfferedTool::new(
            entry,
            ROUTINE_CONNECTION,
            name,
            pin,
            ToolClass::Consequential,
        ))
    }

    /// Runs the nested routine of a call (or picks up the one a previous attempt started) and
    /// answers with its outcome; parks the parent while the nested run waits for a person.
    pub(crate) async fn call_routine(
        &self,
        scope: &CallScope<'_>,
        offered: &OfferedTool,
        pending: &PendingCall,
        input: &str,
        usage: BudgetUsage,
    ) -> Result<CallOutcome, EngineError> {
        let parent = scope.run;
        let call = &pending.call;
        if parent.depth + 1 > MAX_NESTING_DEPTH {
            let text = format!(
                "routine `{}` was not started: routines may nest at most {MAX_NESTING_DEPTH} deep",
                offered.tool
            );
            return Ok(scope.refuse(pending, usage, &text));
        }
        // A remote worker's control plane starts the nested run, which any worker drives.
        if self.is_remote() {
            return self
                .call_routine_remote(scope, offered, pending, usage)
                .await;
        }
        // The child's budget is what is left of its parent's, whose own limits were capped
        // the same way: so, transitively, of the root's.
        let mut left = remaining(&scope.limits, &usage);
        left.wall_seconds = scope.limits.wall_seconds.saturating_sub(scope.wall_spent);
        let (child, _) = self
            .nested_child(
                parent,
                &offered.tool,
                &call.id,
                &scope.redactor.redact(input),
                !scope.untrusted.is_empty(),
                left,
            )
            .await?;
        // Driven here, by the parent's worker, while the parent holds its lease.
        let began = wor_store::now_millis();
        if let Some(claimed) = self
            .store
            .claim_run_by_id(
                parent.project_id,
                child.id,
                &self.config.worker_id,
                self.lease_ms(),
            )
            .await?
        {
            crate::metrics::run_claimed(&claimed, began);
            // Driven while the parent keeps its lease; a cancel of the parent reaches the child.
            // On a task of its own: polled inside the parent's poll, each level of nesting
            // would deepen the stack Cedar evaluates on, until it refuses ("recursion limit").
            let mut driving = tokio::spawn(self.clone().drive_owned(claimed));
            // Not `Engine::until_stopped`, the guard of a model or tool call: it polls the same
            // things on the same ticks (`cancel_poll`, `renew_lease`), but it stops its wait on
            // a cancel or at the deadline by dropping the work, and the work here is another
            // run. Dropping the child's task would not stop it (a dropped `JoinHandle`
            // detaches) and aborting it would cut it off mid-step, holding its lease until it
            // expires and another worker resumes it from its steps. So a
            // cancel of the parent is passed on once and the wait goes on: the child ends
            // itself at its next step, as `cancelled`. There is no deadline of the wait's own:
            // the child's wall time is capped by what the parent had left, so it ends by then,
            // and its end is the answer the parent records (its usage included).
            let mut poll = cancel_poll();
            let mut cancel_passed_on = false;
            loop {
                tokio::select! {
                    driven = &mut driving => {
                        driven.map_err(|e| EngineError::NestedTask(e.to_string()))??;
                        break;
                    }
                    _ = poll.tick() => {
                        self.renew_lease(parent).await?;
                        if !cancel_passed_on && self.store.is_cancel_requested(parent.id).await? {
                            self.request_cancel(parent.project_id, child.id, None).await?;
                            cancel_passed_on = true;
                        }
                    }
                }
            }
        }
        let mut child = self.store.get_run(parent.project_id, child.id).await?;
        if !child.status.is_terminal() {
            // It waits for a person (or another worker has it): the parent waits too, holding
            // nothing, and is queued again when the child ends.
            match self
                .store
                .park_for_nested(
                    parent.project_id,
                    parent.id,
                    child.id,
                    &self.config.worker_id,
                    None,
                )
                .await?
            {
                NestedPark::Parked => return Ok(CallOutcome::Parked),
                NestedPark::NotHeld => return Err(EngineError::LeaseLost),
                NestedPark::ChildEnded => {
                    child = self.store.get_run(parent.project_id, child.id).await?;
                }
            }
        }
        let usage = with_child_usage(usage, &child.usage);
        // Saved now: once the call has its answer, nothing would add the child's usage again.
        self.store
            .save_usage(parent.id, &self.config.worker_id, &usage)
            .await?;
        Ok(nested_answer(
            scope,
            offered,
            pending,
            usage,
            &NestedEnd::of(&child),
        ))
    }

    /// The nested run of `parent`'s call `call_id` to routine `name`: the one a previous
    /// attempt started, or a new one, queued, with `input` (redacted already; `untrusted`
    /// when a model with untrusted content in front of it wrote it) and a budget of `left`;
    /// and whether it was started now.
    pub(crate) async fn nested_child(
        &self,
        parent: &RunRecord,
        name: &str,
        call_id: &str,
        input: &str,
        untrusted: bool,
        left: BudgetLimits,
    ) -> Result<(RunRecord, bool), EngineError> {
        let routine = match self
            .store
            .find_routine_by_name(parent.project_id, name)
            .await
        {
            Ok(routine) => routine,
            Err(StoreError::NotFound) => {
                return Err(EngineError::MissingRosterRoutine {
                    name: name.to_owned(),
                });
            }
            Err(other) => return Err(other.into()),
        };
        let key = format!("parent:{}:{}", parent.id, call_id);
        if let Some(child) = self
            .store
            .run_by_trigger_key(parent.project_id, routine.id, &key)
            .await?
        {
            return Ok((child, false));
        }
        let version = self
            .routine_version(parent.project_id, routine.id, routine.current_version)
            .await?;
        let input = Value::from(input);
        let (input_step, provenance) = if untrusted {
            // Written by a model that had untrusted content in front of it.
            (
                InputStep::untrusted(input, InputSource::Parent),
                Provenance::Untrusted,
            )
        } else {
            (InputStep::requested(input), Provenance::Requester)
        };
        // The nested run's `run.start` is staged with it: a crash before it is appended here
        // leaves it for the audit writer's sweep.
        let depth = parent.depth + 1;
        let started = |id: wor_core::RunId| {
            AuditEvent::new(
                parent.project_id,
                AuditCategory::RunStart,
                Actor::Run { run_id: parent.id },
            )
            .subject("run_id", id)
            .subject("routine_id", routine.id)
            .runs(parent.root_run_id, Some(parent.id))
            .payload(json!({
                "routine_version": version.version,
                "trigger": "routine",
                "depth": depth,
            }))
        };
        let (created, staged) = self
            .store
            .create_run_staged(
                parent.project_id,
                NewRun {
                    routine_id: routine.id,
                    routine_version: version.version,
                    trigger_kind: TriggerKind::Routine,
                    // Whoever started the root started this too: they still may not approve
                    // its calls.
                    started_by: parent.started_by,
                    started_by_member: parent.started_by_member,
                    max_concurrent: u64::MAX / 2,
                    status: RunStatus::Queued,
                    outcome: None,
                    trigger_key: Some(key),
                    input_provenance: provenance,
                    thread: None,
                    memory: None,
                    parent: Some(ParentLink {
                        root: parent.root_run_id,
                        parent: parent.id,
                        depth,
                        budget_cap: serde_json::to_value(left).unwrap_or(Value::Null),
                    }),
                    skip_at: None,
                },
                input_step,
                None,
                Some(&started),
            )
            .await?;
        // The nested run exists and its entry is on disk, whatever the append.
        self.append_staged_or_log(staged).await;
        Ok((created, true))
    }
}

/// How a nested run ended, as its parent's call is answered with it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NestedEnd {
    pub run_id: wor_core::RunId,
    pub status: RunStatus,
    pub outcome: Option<String>,
}

impl NestedEnd {
    pub(crate) fn of(child: &RunRecord) -> Self {
        NestedEnd {
            run_id: child.id,
            status: child.status,
            outcome: child.outcome.clone(),
        }
    }
}

/// The parent's usage with its ended child's added.
pub(crate) fn with_child_usage(usage: BudgetUsage, child: &BudgetUsage) -> BudgetUsage {
    BudgetUsage {
        turns: usage.turns.saturating_add(child.turns),
        tool_calls: usage.tool_calls.saturating_add(child.tool_calls),
        input_tokens: usage.input_tokens.saturating_add(child.input_tokens),
        output_tokens: usage.output_tokens.saturating_add(child.output_tokens),
        cost_microdollars: usage
            .cost_microdollars
            .saturating_add(child.cost_microdollars),
    }
}

/// The answer of a routine call whose nested run ended: its status, id and outcome, untrusted
/// for the parent like any tool result.
pub(crate) fn nested_answer(
    scope: &CallScope<'_>,
    offered: &OfferedTool,
    pending: &PendingCall,
    usage: BudgetUsage,
    child: &NestedEnd,
) -> CallOutcome {
    let text = format!(
        "{} ({}): {}",
        child.status,
        child.run_id,
        child.outcome.as_deref().unwrap_or_default()
    );
    let content = untrusted_envelope(&offered.roster_name, &new_boundary(), &text);
    scope
        .answer(
            pending,
            usage,
            content,
            child.status != RunStatus::Succeeded,
        )
        .with_provenance(Provenance::Untrusted)
}
