//! The check of a run's final answer against its routine's `[output] schema`: a matching
//! answer becomes the run's result as JSON (an `output` step, and the run's outcome as compact
//! JSON text); a wrong one is sent back to the model with the
//! violation while turns remain, and fails the run naming it when none do.

use serde_json::Value;
use wor_core::model::ChatMessage;
use wor_core::routine::RoutineDefinition;
use wor_core::run::{Provenance, RunStatus};
use wor_core::run_loop::{Ending, RunLoop};
use wor_core::step::{InputSource, InputStep, OutputStep, PendingCall, Step};
use wor_store::RunRecord;
use wor_tools::OutputSchema;

use crate::{Engine, EngineError};

/// What follows a recorded model turn.
pub(crate) enum AfterTurn {
    /// The run ends (with the validated JSON as its result when the routine has a schema).
    End(Ending),
    /// The loop goes on: with the turn's calls, or after asking the model to correct its
    /// final answer.
    Continue,
}

impl Engine {
    /// What follows a model turn the loop has recorded, `ended` being what the loop made of
    /// it (`RunLoop::turn_recorded`). A final answer is checked against the routine's output
    /// schema; a request to correct it is recorded as an `input` step by the engine, so a
    /// resumed run sends it again, and pushed onto `messages`.
    pub(crate) async fn after_turn(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
        machine: &RunLoop<PendingCall>,
        ended: Option<Ending>,
        messages: &mut Vec<ChatMessage>,
    ) -> Result<AfterTurn, EngineError> {
        let Some(ending) = ended else {
            return Ok(AfterTurn::Continue);
        };
        let Some(output) = &definition.output else {
            return Ok(AfterTurn::End(ending));
        };
        if ending.status != RunStatus::Succeeded {
            return Ok(AfterTurn::End(ending));
        }
        // Compiled when the routine was applied; a failure here is a stored routine gone bad.
        let schema = match OutputSchema::compile(&output.schema) {
            Ok(schema) => schema,
            Err(e) => {
                return Ok(AfterTurn::End(Ending::new(
                    RunStatus::Failed,
                    e.to_string(),
                )));
            }
        };
        let violation = match schema.check(&ending.outcome) {
            Ok(value) => {
                let result = serde_json::to_string(&value).unwrap_or_default();
                // Fenced by the lease like every step the driver writes. A remote worker's
                // control plane checks the answer again and writes this step with the end.
                if !self.is_remote() {
                    self.record(self.journal(run).step(
                        Provenance::Model,
                        Step::Output(OutputStep { result: value }),
                    ))
                    .await?;
                }
                return Ok(AfterTurn::End(Ending::new(RunStatus::Succeeded, result)));
            }
            Err(violation) => violation,
        };
        if machine.usage().turns >= machine.limits().turns {
            return Ok(AfterTurn::End(Ending::new(
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
        Ok(AfterTurn::Continue)
    }
}
