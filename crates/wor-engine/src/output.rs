//! The check of a run's final answer against its routine's `[output] schema`: a matching
//! answer becomes the run's result as JSON (an `output` step, and the run's outcome as compact
//! JSON text); a wrong one is sent back to the model with the
//! violation while turns remain, and fails the run naming it when none do.

use serde_json::Value;
use wor_core::budget::BudgetUsage;
use wor_core::model::ChatMessage;
use wor_core::routine::{BudgetLimits, RoutineDefinition};
use wor_core::run::{Provenance, RunStatus};
use wor_core::run_loop::Ending;
use wor_core::step::{InputSource, InputStep, OutputStep, Step};
use wor_store::RunRecord;
use wor_tools::OutputSchema;

use crate::{Engine, EngineError};

/// What follows a final answer.
pub(crate) enum FinalAnswer {
    /// The run ends (with the validated JSON as its result when the routine has a schema).
    End(Ending),
    /// The model was asked to correct its answer; the loop goes on.
    Correct,
}

impl Engine {
    /// Checks `ending` (a run the loop ended with the model's answer) against the routine's
    /// output schema. A request to correct is recorded as an `input` step by the engine, so a
    /// resumed run sends it again, and pushed onto `messages`.
    pub(crate) async fn final_answer(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
        usage: BudgetUsage,
        limits: &BudgetLimits,
        ending: Ending,
        messages: &mut Vec<ChatMessage>,
    ) -> Result<FinalAnswer, EngineError> {
        let Some(output) = &definition.output else {
            return Ok(FinalAnswer::End(ending));
        };
        if ending.status != RunStatus::Succeeded {
            return Ok(FinalAnswer::End(ending));
        }
        // Compiled when the routine was applied; a failure here is a stored routine gone bad.
        let schema = match OutputSchema::compile(&output.schema) {
            Ok(schema) => schema,
            Err(e) => {
                return Ok(FinalAnswer::End(Ending::new(
                    RunStatus::Failed,
                    e.to_string(),
                )));
            }
        };
        let violation = match schema.check(&ending.outcome) {
            Ok(value) => {
                let result = serde_json::to_string(&value).unwrap_or_default();
                // Fenced by the lease like every step the driver writes.
                self.record(self.journal(run).step(
                    Provenance::Model,
                    Step::Output(OutputStep { result: value }),
                ))
                .await?;
                return Ok(FinalAnswer::End(Ending::new(RunStatus::Succeeded, result)));
            }
            Err(violation) => violation,
        };
        if usage.turns >= limits.turns {
            return Ok(FinalAnswer::End(Ending::new(
                RunStatus::Failed,
                format!("the final answer was not accepted: {violation}"),
            )));
        }
        let request = format!(
            "Your answer was not accepted: {violation}. Answer again with only a JSON value that \
             matches this JSON Schema, and nothing else: {}",
            output.schema
        );
        self.record(self.journal(run).step(
            Provenance::Engine,
            Step::Input(InputStep {
                input: Value::from(request.clone()),
                source: Some(InputSource::OutputSchema),
                boundary: None,
            }),
        ))
        .await?;
        messages.push(ChatMessage::user(request));
        Ok(FinalAnswer::Correct)
    }
}
