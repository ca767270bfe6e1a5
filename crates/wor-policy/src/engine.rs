//! Loading policies (parse, validate against the schema, read their decisions) and deciding.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::str::FromStr;
use std::sync::LazyLock;

use cedar_policy::{
    Authorizer, Context, Effect, Entities, Entity, EntityId, EntityTypeName, EntityUid, PolicyId,
    PolicySet, Request, Response, RestrictedExpression, Schema, ValidationMode, Validator,
};
use miette::Diagnostic;
use serde_json::Value;
use wor_core::canonical::to_canonical_json;
use wor_core::routine::{RosterEntry, ToolMode};

use crate::decision::{Decision, NO_POLICY_MATCHED, REQUEST_INVALID};
use crate::depth::{DepthExcess, MAX_EXPRESSION_DEPTH, MAX_POLICY_NESTING, check_depth};
use crate::error::{PolicyError, PolicyLocation, PolicySource};
use crate::request::DecisionRequest;
use crate::{DEFAULT_PROJECT_POLICY, SCHEMA};
use wor_core::call::Verdict;

/// What one loaded policy decides when it matches.
#[derive(Debug, Clone)]
struct PolicyMeaning {
    outcome: Verdict,
    /// The policy's id as text, and the line a decision's reasons show for it, made once.
    id: String,
    described: String,
}

/// The Cedar names the engine fills requests with, parsed once.
#[derive(Debug, Clone)]
struct CedarNames {
    routine: EntityTypeName,
    run: EntityTypeName,
    tool: EntityTypeName,
    arguments: EntityTypeName,
    argument_sources: EntityTypeName,
    call_tool: EntityUid,
}

/// The loaded, validated policies of one routine version: the project policy, the routine's
/// policy and its roster's modes. Build once per routine version; [`PolicyEngine::decide`] is
/// cheap and cannot fail.
#[derive(Debug)]
pub struct PolicyEngine {
    /// The schema and names every engine shares.
    built_in: &'static BuiltIn,
    policies: PolicySet,
    // INVARIANT: holds an entry for every policy id in `policies`.
    meanings: HashMap<PolicyId, PolicyMeaning>,
    authorizer: Authorizer,
    /// The routine, run and tool entities of recent calls, which are the same for every call of
    /// one run to one tool: built once, then cloned. Bounded; cleared when full.
    fixed_entities: std::sync::Mutex<HashMap<String, Entities>>,
}

/// Most distinct (routine, run, tool) entity sets kept by one engine.
const FIXED_ENTITIES_CAPACITY: usize = 256;

/// Gathers the policy texts of a [`PolicyEngine`].
#[derive(Debug, Clone)]
pub struct PolicyEngineBuilder {
    project: String,
    routine: Option<String>,
    roster: Vec<(String, ToolMode)>,
}

impl PolicyEngine {
    /// Starts with the built-in [`DEFAULT_PROJECT_POLICY`], no routine policy and no roster.
    pub fn builder() -> PolicyEngineBuilder {
        PolicyEngineBuilder {
            project: DEFAULT_PROJECT_POLICY.to_owned(),
            routine: None,
            roster: Vec::new(),
        }
    }

    /// Decides one call. Deny wins over confirm, confirm over allow; a call no policy matches is
    /// denied, and so is a call on which any policy fails to evaluate (it might have denied).
    pub fn decide(&self, request: &DecisionRequest) -> Decision {
        match self.build_cedar_request(request, None) {
            Ok((cedar_request, entities)) => {
                let response =
                    self.authorizer
                        .is_authorized(&cedar_request, &self.policies, &entities);
                self.interpret(request, &response)
            }
            Err(err) => Decision {
                outcome: Verdict::Deny,
                determining_policies: vec![REQUEST_INVALID.to_owned()],
                reasons: vec![err.to_string()],
            },
        }
    }

    /// How many policies the text of `source` holds: none for a text of only comments.
    pub fn policies_from(&self, source: PolicySource) -> usize {
        let prefix = format!("{}.", source.as_str());
        self.policies
            .policies()
            .filter(|policy| policy.id().to_string().starts_with(&prefix))
            .count()
    }

    /// Every loaded policy, with its id (`project.read-only-runs`, …).
    pub fn policy_set(&self) -> &PolicySet {
        &self.policies
    }

    pub fn schema(&self) -> &Schema {
        &self.built_in.schema
    }

    /// The Cedar request and entities [`PolicyEngine::decide`] evaluates for `request`,
    /// checked against the schema.
    pub fn cedar_request(
        &self,
        request: &DecisionRequest,
    ) -> Result<(Request, Entities), PolicyError> {
        self.build_cedar_request(request, Some(&self.built_in.schema))
    }

    /// `decide` builds without checking against the schema: every value here comes from a
    /// typed field, so the shape is fixed by this function (`cedar_request` checks it in
    /// tests), and the check would be most of a decision's cost.
    fn build_cedar_request(
        &self,
        request: &DecisionRequest,
        schema: Option<&Schema>,
    ) -> Result<(Request, Entities), PolicyError> {
        let bad = |e: &dyn std::fmt::Display| PolicyError::Request(e.to_string());
        let names = &self.built_in.names;
        let uid = |ty: &EntityTypeName, id: &str| {
            EntityUid::from_type_name_and_id(ty.clone(), EntityId::new(id))
        };
        let string = |s: &str| RestrictedExpression::new_string(s.to_owned());
        let long = |n: u64| RestrictedExpression::new_long(i64::try_from(n).unwrap_or(i64::MAX));

        let tool_ref = request.tool_ref();
        let run_uid = uid(&names.run, &request.run);
        let tool_uid = uid(&names.tool, &tool_ref);
        let hints = &request.annotations;
        // Everything the three fixed entities are built from; a hit skips evaluating them.
        let hint = |h: Option<bool>| match h {
            None => '-',
            Some(true) => 't',
            Some(false) => 'f',
        };
        let mut key =
            String::with_capacity(request.routine.len() + request.run.len() + tool_ref.len() + 32);
        for part in [
            request.routine.as_str(),
            request.run.as_str(),
            request.trigger.as_str(),
            tool_ref.as_str(),
            request.classification.as_str(),
        ] {
            key.push_str(part);
            key.push('\u{0}');
        }
        key.extend([
            hint(hints.read_only_hint),
            hint(hints.destructive_hint),
            hint(hints.idempotent_hint),
            hint(hints.open_world_hint),
        ]);
        let cached = if schema.is_none() {
            self.fixed_entities
                .lock()
                .ok()
                .and_then(|cache| cache.get(&key).cloned())
        } else {
            None
        };
        let fixed = match cached {
            Some(entities) => entities,
            None => {
                let routine_uid = uid(&names.routine, &request.routine);
                let routine = Entity::new_with_tags(
                    routine_uid.clone(),
                    [("name".to_owned(), string(&request.routine))],
                    [],
                    [],
                )
                .map_err(|e| bad(&e))?;
                let run = Entity::new_with_tags(
                    run_uid.clone(),
                    [("trigger".to_owned(), string(request.trigger.as_str()))],
                    [routine_uid],
                    [],
                )
                .map_err(|e| bad(&e))?;
                let annotations = RestrictedExpression::new_record(
                    [
                        ("read_only_hint", hints.read_only_hint),
                        ("destructive_hint", hints.destructive_hint),
                        ("idempotent_hint", hints.idempotent_hint),
                        ("open_world_hint", hints.open_world_hint),
                    ]
                    .into_iter()
                    .filter_map(|(k, v)| {
                        v.map(|v| (k.to_owned(), RestrictedExpression::new_bool(v)))
                    }),
                )
                .map_err(|e| bad(&e))?;
                let tool = Entity::new_with_tags(
                    tool_uid.clone(),
                    [
                        ("name".to_owned(), string(&request.tool)),
                        ("connection".to_owned(), string(&request.connection)),
                        (
                            "classification".to_owned(),
                            string(request.classification.as_str()),
                        ),
                        ("annotations".to_owned(), annotations),
                    ],
                    [],
                    [],
                )
                .map_err(|e| bad(&e))?;
                let built =
                    Entities::from_entities([routine, run, tool], schema).map_err(|e| bad(&e))?;
                if schema.is_none()
                    && let Ok(mut cache) = self.fixed_entities.lock()
                {
                    if cache.len() >= FIXED_ENTITIES_CAPACITY {
                        cache.clear();
                    }
                    cache.insert(key, built.clone());
                }
                built
            }
        };

        let arguments_uid = uid(&names.arguments, "call");
        let arguments = Entity::new_with_tags(
            arguments_uid.clone(),
            [],
            [],
            request.arguments.iter().map(|(name, value)| {
                let text = match value {
                    Value::String(s) => s.clone(),
                    other => to_canonical_json(other),
                };
                (name.clone(), RestrictedExpression::new_string(text))
            }),
        )
        .map_err(|e| bad(&e))?;

        let sources_uid = uid(&names.argument_sources, "call");
        let mut source_tags = Vec::with_capacity(request.argument_labels.0.len());
        for (name, label) in &request.argument_labels.0 {
            let record = RestrictedExpression::new_record([
                (
                    "trusted".to_owned(),
                    RestrictedExpression::new_bool(label.trusted()),
                ),
                (
                    "untrusted".to_owned(),
                    RestrictedExpression::new_bool(label.untrusted()),
                ),
                (
                    "generated".to_owned(),
                    RestrictedExpression::new_bool(label.generated()),
                ),
                (
                    "destination".to_owned(),
                    RestrictedExpression::new_bool(label.destination),
                ),
                (
                    "sources".to_owned(),
                    RestrictedExpression::new_set(label.sources().iter().map(|s| string(s))),
                ),
            ])
            .map_err(|e| bad(&e))?;
            source_tags.push((name.clone(), record));
        }
        let argument_sources =
            Entity::new_with_tags(sources_uid.clone(), [], [], source_tags).map_err(|e| bad(&e))?;
        let summary = request.argument_summary;
        let provenance = RestrictedExpression::new_record([
            (
                "all_trusted".to_owned(),
                RestrictedExpression::new_bool(summary.all_trusted),
            ),
            (
                "any_untrusted".to_owned(),
                RestrictedExpression::new_bool(summary.any_untrusted),
            ),
            (
                "destination_untrusted".to_owned(),
                RestrictedExpression::new_bool(summary.destination_untrusted),
            ),
            (
                "destination_not_trusted".to_owned(),
                RestrictedExpression::new_bool(summary.destination_not_trusted),
            ),
        ])
        .map_err(|e| bad(&e))?;

        let budget = RestrictedExpression::new_record([
            ("turns".to_owned(), long(request.budget_used.turns)),
            (
                "tool_calls".to_owned(),
                long(request.budget_used.tool_calls),
            ),
            (
                "cost_microdollars".to_owned(),
                long(request.budget_used.cost_microdollars),
            ),
        ])
        .map_err(|e| bad(&e))?;
        let context = Context::from_pairs([
            (
                "arguments".to_owned(),
                RestrictedExpression::new_entity_uid(arguments_uid),
            ),
            // Computed once, when the request was built.
            ("arguments_json".to_owned(), string(&request.arguments_json)),
            (
                "argument_sources".to_owned(),
                RestrictedExpression::new_entity_uid(sources_uid),
            ),
            ("arguments_provenance".to_owned(), provenance),
            (
                "untrusted_in_context".to_owned(),
                RestrictedExpression::new_bool(request.untrusted_in_context),
            ),
            (
                "untrusted_sources".to_owned(),
                RestrictedExpression::new_set(request.untrusted_sources.iter().map(|s| string(s))),
            ),
            ("budget_used".to_owned(), budget),
            ("trigger".to_owned(), string(request.trigger.as_str())),
            ("mode".to_owned(), string(mode_str(request.mode))),
        ])
        .map_err(|e| bad(&e))?;

        let entities = fixed
            .add_entities([arguments, argument_sources], schema)
            .map_err(|e| bad(&e))?;
        let cedar_request =
            Request::new(run_uid, names.call_tool.clone(), tool_uid, context, schema)
                .map_err(|e| bad(&e))?;
        Ok((cedar_request, entities))
    }

    fn interpret(&self, request: &DecisionRequest, response: &Response) -> Decision {
        // Cedar skips a policy that fails to evaluate; that policy might have denied, so it
        // counts as a deny here.
        let failed: Vec<(String, Verdict, String)> = response
            .diagnostics()
            .errors()
            .map(|err| {
                let cedar_policy::AuthorizationError::PolicyEvaluationError(err) = err;
                (
                    err.policy_id().to_string(),
                    Verdict::Deny,
                    format!(
                        "policy `{}` failed to evaluate ({}), so the call is denied",
                        err.policy_id(),
                        err.inner()
                    ),
                )
            })
            .collect();
        let matched = response
            .diagnostics()
            .reason()
            .map(|id| match self.meanings.get(id) {
                Some(meaning) => (
                    meaning.id.clone(),
                    meaning.outcome,
                    meaning.described.clone(),
                ),
                // Every loaded policy has a meaning; an unknown one is treated as a deny.
                None => (
                    id.to_string(),
                    Verdict::Deny,
                    format!("policy `{id}` is unknown, so the call is denied"),
                ),
            });
        let all: Vec<(String, Verdict, String)> = matched.chain(failed).collect();

        let mut decision = match all.iter().map(|(_, outcome, _)| *outcome).max() {
            None => Decision {
                outcome: Verdict::Deny,
                determining_policies: vec![NO_POLICY_MATCHED.to_owned()],
                reasons: vec![format!(
                    "no policy permits calling `{}` with mode `{}`",
                    request.tool_ref(),
                    mode_str(request.mode)
                )],
            },
            Some(strongest) => {
                let mut determining: Vec<(String, String)> = all
                    .into_iter()
                    .filter(|(_, outcome, _)| *outcome == strongest)
                    .map(|(id, _, reason)| (id, reason))
                    .collect();
                determining.sort();
                let (determining_policies, reasons) = determining.into_iter().unzip();
                Decision {
                    outcome: strongest,
                    determining_policies,
                    reasons,
                }
            }
        };
        if request.untrusted_in_context {
            for (name, label) in &request.argument_labels.0 {
                if label.destination && !label.trusted_only() {
                    decision.reasons.push(format!(
                        "destination argument `{name}` is {}",
                        label.describe()
                    ));
                }
            }
            let sources: Vec<&str> = request
                .untrusted_sources
                .iter()
                .map(String::as_str)
                .collect();
            decision.reasons.push(if sources.is_empty() {
                "untrusted content is in the context (no source named)".to_owned()
            } else {
                format!(
                    "untrusted content is in the context from: {}",
                    sources.join(", ")
                )
            });
        }
        decision
    }
}

fn mode_str(mode: ToolMode) -> &'static str {
    match mode {
        ToolMode::Auto => "auto",
        ToolMode::Confirm => "confirm",
        ToolMode::Deny => "deny",
    }
}

impl PolicyEngineBuilder {
    /// Replaces the built-in default project policy.
    pub fn project_policy(mut self, text: impl Into<String>) -> Self {
        self.project = text.into();
        self
    }

    pub fn routine_policy(mut self, text: impl Into<String>) -> Self {
        self.routine = Some(text.into());
        self
    }

    /// One roster tool (`CONNECTION/TOOL`) and its mode: `deny` and `confirm` become a policy
    /// each (`roster.CONNECTION/TOOL`); `auto` adds none.
    pub fn roster_tool(mut self, tool: impl Into<String>, mode: ToolMode) -> Self {
        self.roster.push((tool.into(), mode));
        self
    }

    /// Every tool of a routine's roster; see [`PolicyEngineBuilder::roster_tool`].
    pub fn roster(mut self, entries: &[RosterEntry]) -> Self {
        self.roster
            .extend(entries.iter().map(|e| (e.tool.clone(), e.mode)));
        self
    }

    /// Parses every policy text, validates it against the schema and reads each policy's
    /// decision.
    pub fn build(self) -> Result<PolicyEngine, PolicyError> {
        let built_in = built_in()?;
        let validator = &built_in.validator;
        let mut policies = PolicySet::new();
        let mut meanings = HashMap::new();
        load(
            validator,
            PolicySource::Project,
            &self.project,
            &mut policies,
            &mut meanings,
        )?;
        if let Some(routine) = &self.routine {
            load(
                validator,
                PolicySource::Routine,
                routine,
                &mut policies,
                &mut meanings,
            )?;
        }
        let roster = roster_policies(&self.roster);
        load(
            validator,
            PolicySource::Roster,
            &roster,
            &mut policies,
            &mut meanings,
        )?;
        Ok(PolicyEngine {
            built_in,
            policies,
            meanings,
            authorizer: Authorizer::new(),
            fixed_entities: std::sync::Mutex::new(HashMap::new()),
        })
    }
}

/// What every engine shares: the built-in schema, its validator and the Cedar names.
#[derive(Debug)]
struct BuiltIn {
    schema: Schema,
    validator: Validator,
    names: CedarNames,
}

/// [`BuiltIn`], made once per process: parsing the schema is most of what building an engine
/// costs (about 0.85 of 1.5 ms in a release build), and every build would parse the same text.
fn built_in() -> Result<&'static BuiltIn, PolicyError> {
    static BUILT_IN: LazyLock<Result<BuiltIn, String>> = LazyLock::new(|| {
        let (schema, _warnings) =
            Schema::from_cedarschema_str(SCHEMA).map_err(|e| e.to_string())?;
        Ok(BuiltIn {
            validator: Validator::new(schema.clone()),
            schema,
            names: cedar_names()?,
        })
    });
    BUILT_IN
        .as_ref()
        .map_err(|e| PolicyError::BuiltInSchema(e.clone()))
}

fn cedar_names() -> Result<CedarNames, String> {
    let ty = |name: &str| EntityTypeName::from_str(name).map_err(|e| e.to_string());
    Ok(CedarNames {
        routine: ty("Routine")?,
        run: ty("Run")?,
        tool: ty("Tool")?,
        arguments: ty("Arguments")?,
        argument_sources: ty("ArgumentSources")?,
        call_tool: EntityUid::from_str(r#"Action::"call_tool""#).map_err(|e| e.to_string())?,
    })
}

/// The Cedar text of the roster's `confirm` and `deny` modes.
fn roster_policies(roster: &[(String, ToolMode)]) -> String {
    let mut text = String::new();
    for (tool, mode) in roster {
        let decision = match mode {
            ToolMode::Auto => continue,
            ToolMode::Confirm => "confirm",
            ToolMode::Deny => "deny",
        };
        let tool = tool.escape_default();
        let _ = writeln!(
            text,
            "@id(\"{tool}\")\n@decision(\"{decision}\")\n\
             @reason(\"the roster sets mode {decision} for this tool\")\n\
             permit (principal, action == Action::\"call_tool\", resource == Tool::\"{tool}\");"
        );
    }
    text
}

/// The byte offset of the first label of a Cedar diagnostic.
fn first_offset(diagnostic: &dyn Diagnostic) -> Option<usize> {
    diagnostic
        .labels()
        .and_then(|mut labels| labels.next())
        .map(|label| label.offset())
}

/// Best effort: where `needle` first appears in `text`.
fn find(source: PolicySource, text: &str, needle: &str) -> PolicyLocation {
    PolicyLocation::at_offset(source, text, text.find(needle))
}

fn load(
    validator: &Validator,
    source: PolicySource,
    text: &str,
    into: &mut PolicySet,
    meanings: &mut HashMap<PolicyId, PolicyMeaning>,
) -> Result<(), PolicyError> {
    // Before Cedar sees the text: its parser recurses on nesting (`depth.rs`).
    check_depth(text).map_err(|excess| match excess {
        DepthExcess::Nesting { offset } => PolicyError::TooDeep {
            at: PolicyLocation::at_offset(source, text, Some(offset)),
            limit: MAX_POLICY_NESTING,
        },
        DepthExcess::Expression { offset } => PolicyError::ExpressionTooDeep {
            at: PolicyLocation::at_offset(source, text, Some(offset)),
            limit: MAX_EXPRESSION_DEPTH,
        },
    })?;
    let parsed = PolicySet::from_str(text).map_err(|errs| PolicyError::Syntax {
        at: PolicyLocation::at_offset(source, text, first_offset(&errs)),
        message: errs.to_string(),
    })?;
    if let Some(template) = parsed.templates().next() {
        return Err(PolicyError::Template {
            at: find(source, text, &template.to_string()),
        });
    }
    let validation = validator.validate(&parsed, ValidationMode::Strict);
    if let Some(err) = validation.validation_errors().next() {
        return Err(PolicyError::Schema {
            at: PolicyLocation::at_offset(source, text, first_offset(err)),
            message: err.to_string(),
        });
    }
    for policy in parsed.policies() {
        let name = policy
            .annotation("id")
            .map_or_else(|| policy.id().to_string(), str::to_owned);
        let decision = policy.annotation("decision");
        let outcome = match (policy.effect(), decision) {
            (Effect::Forbid, None | Some("deny")) => Verdict::Deny,
            (Effect::Permit, None) => Verdict::Allow,
            (Effect::Forbid, Some(value)) => {
                return Err(PolicyError::ForbidWithDecision {
                    at: find(source, text, &format!("\"{value}\"")),
                    value: value.to_owned(),
                });
            }
            (Effect::Permit, Some(value)) => {
                Verdict::parse(value).ok_or_else(|| PolicyError::UnknownDecision {
                    at: find(source, text, &format!("\"{value}\"")),
                    value: value.to_owned(),
                })?
            }
        };
        let id = PolicyId::new(format!("{}.{name}", source.as_str()));
        if meanings.contains_key(&id) {
            return Err(PolicyError::DuplicateId {
                at: find(source, text, &format!("\"{name}\"")),
                id: id.to_string(),
            });
        }
        into.add(policy.new_id(id.clone()))
            .map_err(|e| PolicyError::DuplicateId {
                at: find(source, text, &format!("\"{name}\"")),
                id: format!("{id} ({e})"),
            })?;
        let why = policy
            .annotation("reason")
            .map_or(String::new(), |r| format!(": {r}"));
        meanings.insert(
            id.clone(),
            PolicyMeaning {
                outcome,
                id: id.to_string(),
                described: format!("policy `{id}` decides {outcome}{why}"),
            },
        );
    }
    Ok(())
}
