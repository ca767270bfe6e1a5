//! What the engine knows about a proposed tool call, gathered into one value for policy.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use wor_core::call::{ToolClass, TriggerKind};
use wor_core::canonical::to_canonical_json;
use wor_core::provenance::{
    ArgumentLabel, ArgumentLabels, ArgumentSummary, ContentIndex, ValueLabel, ValueOrigin,
};
use wor_core::routine::ToolMode;

/// What a tool says about itself (MCP annotations): hints for display only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolAnnotations {
    #[serde(default)]
    pub read_only_hint: Option<bool>,
    #[serde(default)]
    pub destructive_hint: Option<bool>,
    #[serde(default)]
    pub idempotent_hint: Option<bool>,
    #[serde(default)]
    pub open_world_hint: Option<bool>,
}

/// What the run has used so far. A nested run counts its own usage here; its limits are
/// capped by what its root had left when it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetUsed {
    #[serde(default)]
    pub turns: u64,
    #[serde(default)]
    pub tool_calls: u64,
    #[serde(default)]
    pub cost_microdollars: u64,
}

/// One proposed tool call as policy sees it. Built with [`DecisionRequest::builder`].
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionRequest {
    pub(crate) routine: String,
    pub(crate) run: String,
    pub(crate) trigger: TriggerKind,
    pub(crate) connection: String,
    pub(crate) tool: String,
    pub(crate) classification: ToolClass,
    pub(crate) annotations: ToolAnnotations,
    pub(crate) mode: ToolMode,
    pub(crate) arguments: Map<String, Value>,
    /// The canonical JSON of `arguments`, computed once by [`DecisionRequestBuilder::build`].
    pub(crate) arguments_json: String,
    pub(crate) untrusted_in_context: bool,
    pub(crate) untrusted_sources: BTreeSet<String>,
    /// Where each argument's values can have come from; an argument the caller did not label
    /// is labelled unexamined and destination-like by [`DecisionRequestBuilder::build`].
    pub(crate) argument_labels: ArgumentLabels,
    /// Computed once from `argument_labels` by [`DecisionRequestBuilder::build`].
    pub(crate) argument_summary: ArgumentSummary,
    pub(crate) budget_used: BudgetUsed,
}

impl DecisionRequest {
    /// Starts a request for calling `CONNECTION/TOOL` (`connection`, `tool`) from a run of
    /// `routine`. Until set: trigger `api`, mode `auto`, no arguments, no untrusted content,
    /// nothing used, no annotations.
    pub fn builder(
        routine: impl Into<String>,
        run: impl Into<String>,
        connection: impl Into<String>,
        tool: impl Into<String>,
        classification: ToolClass,
    ) -> DecisionRequestBuilder {
        DecisionRequestBuilder(DecisionRequest {
            routine: routine.into(),
            run: run.into(),
            trigger: TriggerKind::Api,
            connection: connection.into(),
            tool: tool.into(),
            classification,
            annotations: ToolAnnotations::default(),
            mode: ToolMode::Auto,
            arguments: Map::new(),
            arguments_json: String::new(),
            untrusted_in_context: false,
            untrusted_sources: BTreeSet::new(),
            argument_labels: ArgumentLabels::default(),
            argument_summary: ArgumentSummary::default(),
            budget_used: BudgetUsed::default(),
        })
    }

    /// `CONNECTION/TOOL`, the tool's roster name and its Cedar entity id.
    pub fn tool_ref(&self) -> String {
        format!("{}/{}", self.connection, self.tool)
    }

    pub fn mode(&self) -> ToolMode {
        self.mode
    }

    pub fn untrusted_sources(&self) -> &BTreeSet<String> {
        &self.untrusted_sources
    }

    pub fn untrusted_in_context(&self) -> bool {
        self.untrusted_in_context
    }

    /// The labels policy decided on (every argument has one).
    pub fn argument_labels(&self) -> &ArgumentLabels {
        &self.argument_labels
    }
}

/// Fills a [`DecisionRequest`] from a tool call; see [`DecisionRequest::builder`].
#[derive(Debug, Clone)]
pub struct DecisionRequestBuilder(DecisionRequest);

impl DecisionRequestBuilder {
    pub fn trigger(mut self, trigger: TriggerKind) -> Self {
        self.0.trigger = trigger;
        self
    }

    /// The tool's mode on the routine's roster.
    pub fn mode(mut self, mode: ToolMode) -> Self {
        self.0.mode = mode;
        self
    }

    pub fn annotations(mut self, annotations: ToolAnnotations) -> Self {
        self.0.annotations = annotations;
        self
    }

    /// The call's arguments after schema validation and pinning (pipeline steps 2 and 3).
    pub fn arguments(mut self, arguments: Map<String, Value>) -> Self {
        self.0.arguments = arguments;
        self
    }

    /// Marks untrusted content as present in the context, with no named source.
    pub fn untrusted_in_context(mut self) -> Self {
        self.0.untrusted_in_context = true;
        self
    }

    /// Names one source of untrusted content in the context (`webhook`, `tool:mail/read`, …);
    /// this also marks untrusted content as present.
    pub fn untrusted_source(mut self, source: impl Into<String>) -> Self {
        self.0.untrusted_in_context = true;
        self.0.untrusted_sources.insert(source.into());
        self
    }

    pub fn budget_used(mut self, used: BudgetUsed) -> Self {
        self.0.budget_used = used;
        self
    }

    /// Where each argument's values can have come from (`wor_core::provenance`).
    pub fn argument_labels(mut self, labels: ArgumentLabels) -> Self {
        self.0.argument_labels = labels;
        self
    }

    pub fn build(mut self) -> DecisionRequest {
        // Fail closed: an argument nobody labelled is neither trusted nor safe as a destination.
        for name in self.0.arguments.keys() {
            if !self.0.argument_labels.0.contains_key(name) {
                self.0.argument_labels.0.insert(
                    name.clone(),
                    ArgumentLabel {
                        destination: true,
                        values: vec![ValueLabel {
                            path: name.clone(),
                            origin: ValueOrigin::Unexamined,
                        }],
                    },
                );
            }
        }
        self.0.argument_summary = self.0.argument_labels.summary();
        // The map is moved out and back to encode it without a copy.
        let arguments = Value::Object(std::mem::take(&mut self.0.arguments));
        self.0.arguments_json = to_canonical_json(&arguments);
        if let Value::Object(map) = arguments {
            self.0.arguments = map;
        }
        self.0
    }
}

/// The JSON form of a tool call for `wor policy test --call CALL.json` (docs/policies.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallDescription {
    #[serde(default = "default_routine")]
    pub routine: String,
    #[serde(default = "default_run")]
    pub run: String,
    /// `CONNECTION/TOOL`.
    pub tool: String,
    pub classification: ToolClass,
    #[serde(default)]
    pub annotations: ToolAnnotations,
    #[serde(default)]
    pub arguments: Map<String, Value>,
    #[serde(default)]
    pub provenance: ProvenanceDescription,
    #[serde(default)]
    pub budget_used: BudgetUsed,
    #[serde(default = "default_trigger")]
    pub trigger: TriggerKind,
    #[serde(default = "default_mode")]
    pub mode: ToolMode,
}

/// The run's provenance state in a [`ToolCallDescription`]: the flag and sources, and the
/// content the call's arguments are labelled against — trusted texts (instructions, the
/// requester's input) and untrusted texts by source. A source named in `untrusted` is in the
/// context too.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProvenanceDescription {
    #[serde(default)]
    pub untrusted_in_context: bool,
    #[serde(default)]
    pub untrusted_sources: BTreeSet<String>,
    #[serde(default)]
    pub trusted: Vec<String>,
    #[serde(default)]
    pub untrusted: BTreeMap<String, String>,
    /// Arguments the routine's author pinned.
    #[serde(default)]
    pub pinned_keys: Vec<String>,
}

fn default_routine() -> String {
    "routine".to_owned()
}
fn default_run() -> String {
    "run".to_owned()
}
fn default_trigger() -> TriggerKind {
    TriggerKind::Api
}
fn default_mode() -> ToolMode {
    ToolMode::Auto
}

/// Why a described call is not a request policy can decide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallDescriptionError {
    #[error("`{0}` is not CONNECTION/TOOL")]
    NotConnectionTool(String),
}

impl ToolCallDescription {
    /// The request, or why `tool` is not `CONNECTION/TOOL`.
    pub fn into_request(self) -> Result<DecisionRequest, CallDescriptionError> {
        let Some((connection, tool)) = self.tool.split_once('/') else {
            return Err(CallDescriptionError::NotConnectionTool(self.tool));
        };
        let mut builder = DecisionRequest::builder(
            self.routine,
            self.run,
            connection,
            tool,
            self.classification,
        )
        .trigger(self.trigger)
        .mode(self.mode)
        .annotations(self.annotations);
        let provenance = self.provenance;
        let mut content = ContentIndex::new();
        for text in &provenance.trusted {
            content.add_trusted(text);
        }
        for (source, text) in &provenance.untrusted {
            content.add_untrusted(source, text);
            builder = builder.untrusted_source(source.clone());
        }
        builder = builder
            .argument_labels(content.label(&self.arguments, &provenance.pinned_keys))
            .arguments(self.arguments)
            .budget_used(self.budget_used);
        if provenance.untrusted_in_context {
            builder = builder.untrusted_in_context();
        }
        for source in provenance.untrusted_sources {
            builder = builder.untrusted_source(source);
        }
        Ok(builder.build())
    }
}
