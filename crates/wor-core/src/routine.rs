//! Routine definitions: the TOML a person writes, parsed and validated into one value.
//!
//! Every error names the field and the line it is on. A definition is immutable once applied;
//! its [`RoutineDefinition::content_hash`] tells whether an apply changed anything.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};
use toml::Spanned;

use crate::canonical::canonical_hash;
use crate::model::ProviderKind;
use crate::replay::ReplayScript;

/// The deepest the `toml` parser nests arrays and inline tables before it refuses a document
/// (its own bound, which keeps its recursion, and ours over the values, off the end of the
/// stack); a test holds it to the parser's behaviour.
pub const MAX_TOML_NESTING: usize = 80;

/// Why a routine definition was refused. The message names the field and the line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RoutineError {
    pub message: String,
    /// 1-based line of the offending text, when known.
    pub line: Option<usize>,
}

/// A routine's name: 1 to 64 of `a-z`, `0-9` and `-`, starting with a letter.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RoutineName(String);

/// A text that is not a routine name; the message quotes at most 80 characters of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a routine name: use 1 to 64 of a-z, 0-9 and `-`, starting with a letter")]
pub struct RoutineNameError(String);

impl RoutineName {
    pub fn parse(text: &str) -> Result<Self, RoutineNameError> {
        let ok = (1..=64).contains(&text.len())
            && text.starts_with(|c: char| c.is_ascii_lowercase())
            && text
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if ok {
            Ok(RoutineName(text.to_owned()))
        } else {
            Err(RoutineNameError(crate::quote::excerpt(text, 80)))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RoutineName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for RoutineName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        RoutineName::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// `[model]`: the model identity `(provider, connection, model)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub provider: ProviderKind,
    /// The model connection's name; required except for `replay`.
    #[serde(default)]
    pub connection: Option<String>,
    /// The provider's model id, e.g. `claude-sonnet-4-5`.
    pub model: String,
    /// Output tokens asked for per turn.
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// For `replay`: the script, inline (see docs/replay.md), checked when applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<ReplayScript>,
}

/// `[budget]`: limits on one run (and, for nested routines, on its root run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetLimits {
    #[serde(default = "default_turns", deserialize_with = "positive_u64")]
    pub turns: u64,
    #[serde(default = "default_tool_calls", deserialize_with = "positive_u64")]
    pub tool_calls: u64,
    #[serde(default = "default_input_tokens", deserialize_with = "positive_u64")]
    pub input_tokens: u64,
    #[serde(default = "default_output_tokens", deserialize_with = "positive_u64")]
    pub output_tokens: u64,
    /// Cost in millionths of a US dollar, priced by the server's per-model price table.
    #[serde(default = "default_cost", deserialize_with = "positive_u64")]
    pub cost_microdollars: u64,
    #[serde(default = "default_wall_seconds", deserialize_with = "positive_u64")]
    pub wall_seconds: u64,
}

fn default_turns() -> u64 {
    20
}
fn default_tool_calls() -> u64 {
    50
}
fn default_input_tokens() -> u64 {
    500_000
}
fn default_output_tokens() -> u64 {
    50_000
}
fn default_cost() -> u64 {
    5_000_000
}
fn default_wall_seconds() -> u64 {
    900
}

fn positive_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let value = i64::deserialize(d)?;
    u64::try_from(value).ok().filter(|v| *v > 0).ok_or_else(|| {
        serde::de::Error::custom(format!("must be a positive whole number, not {value}"))
    })
}

impl Default for BudgetLimits {
    fn default() -> Self {
        BudgetLimits {
            turns: default_turns(),
            tool_calls: default_tool_calls(),
            input_tokens: default_input_tokens(),
            output_tokens: default_output_tokens(),
            cost_microdollars: default_cost(),
            wall_seconds: default_wall_seconds(),
        }
    }
}

/// What happens when a run starts while others of the same routine are active.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapPolicy {
    /// The new run is not started (recorded as skipped).
    Skip,
    /// The new run waits until a slot frees.
    Queue,
    /// The new run is recorded, and the routine's active runs beyond the newest `max_runs`
    /// are cancelled to make room.
    CancelPrevious,
}

/// `[concurrency]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencySection {
    #[serde(default = "one", deserialize_with = "positive_u64")]
    pub max_runs: u64,
    #[serde(default = "queue")]
    pub overlap: OverlapPolicy,
}

fn one() -> u64 {
    1
}
fn queue() -> OverlapPolicy {
    OverlapPolicy::Queue
}

impl Default for ConcurrencySection {
    fn default() -> Self {
        ConcurrencySection {
            max_runs: 1,
            overlap: OverlapPolicy::Queue,
        }
    }
}

/// How a roster tool may be called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolMode {
    /// Runs when policy allows.
    Auto,
    /// Always waits for a person's approval of the exact call.
    Confirm,
    /// Never runs; the model gets a clear refusal.
    Deny,
}

/// The connection name rosters use for other routines: `routine/NAME`.
pub const ROUTINE_CONNECTION: &str = "routine";

/// What a run does when a person denies one of its calls, or nobody decides in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDenial {
    /// The model is told the call was denied, and the run goes on.
    #[default]
    Continue,
    /// The run ends as failed, naming the denied call.
    Fail,
}

/// `[approvals]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalsSection {
    #[serde(default)]
    pub on_denial: OnDenial,
    /// The member who applied the run's routine version may not decide its approvals either.
    #[serde(default)]
    pub separate_from_author: bool,
}

impl ApprovalsSection {
    fn is_default(&self) -> bool {
        *self == ApprovalsSection::default()
    }
}

/// How an inbound webhook proves it comes from the sender holding the routine's secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookScheme {
    /// `wor-timestamp` and `wor-signature` headers: hex HMAC-SHA256 of `${timestamp}.${body}`.
    #[default]
    Wor,
    /// Standard Webhooks: `webhook-id`, `webhook-timestamp`, `webhook-signature`.
    Standard,
}

/// `[webhook]`: whether a signed HTTP request may start a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSection {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default)]
    pub scheme: WebhookScheme,
}

impl WebhookSection {
    fn is_default(&self) -> bool {
        *self == WebhookSection::default()
    }
}

/// A run event a run webhook can be sent for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunEvent {
    /// The run succeeded.
    Finished,
    /// A call waits for a person's approval.
    WaitingForApproval,
    /// The run failed or was cancelled.
    Failed,
    /// A budget limit ended the run.
    BudgetExceeded,
}

impl RunEvent {
    pub const ALL: [RunEvent; 4] = [
        RunEvent::Finished,
        RunEvent::WaitingForApproval,
        RunEvent::Failed,
        RunEvent::BudgetExceeded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunEvent::Finished => "run.finished",
            RunEvent::WaitingForApproval => "run.waiting_for_approval",
            RunEvent::Failed => "run.failed",
            RunEvent::BudgetExceeded => "run.budget_exceeded",
        }
    }
}

fn all_events() -> Vec<RunEvent> {
    RunEvent::ALL.to_vec()
}

/// `[notify]`: where run webhooks go, and for which events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotifySection {
    /// An `http` or `https` URL, reached through the egress guard.
    pub url: String,
    #[serde(default = "all_events")]
    pub events: Vec<RunEvent>,
}

/// `[memory]`: whether runs of a thread remember what earlier runs were asked and answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    #[serde(default)]
    pub enabled: bool,
    /// How many of the latest entries a run is given.
    #[serde(default = "default_memory_entries")]
    pub max_entries: u32,
}

fn default_memory_entries() -> u32 {
    20
}

impl Default for MemorySection {
    fn default() -> Self {
        MemorySection {
            enabled: false,
            max_entries: default_memory_entries(),
        }
    }
}

impl MemorySection {
    fn is_default(&self) -> bool {
        *self == MemorySection::default()
    }
}

/// One `[[tools]]` entry: a tool the routine may use, and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RosterEntry {
    /// `CONNECTION/TOOL`: a tool connection's name and one of its pinned tools.
    pub tool: String,
    pub mode: ToolMode,
    /// Arguments the author fixes: hidden from the model, always overriding what it writes.
    #[serde(default)]
    pub pinned: BTreeMap<String, serde_json::Value>,
}

impl RosterEntry {
    /// The connection and tool names of `tool`.
    pub fn split(&self) -> Option<(&str, &str)> {
        self.tool.split_once('/')
    }
}

/// A complete, validated routine definition.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoutineDefinition {
    pub name: RoutineName,
    pub description: String,
    pub instructions: String,
    pub model: ModelSection,
    pub budget: BudgetLimits,
    pub concurrency: ConcurrencySection,
    pub tools: Vec<RosterEntry>,
    /// The routine's own Cedar policy, added to the project's (docs/policies.md). Validated
    /// against the policy schema when the routine is applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(skip_serializing_if = "ApprovalsSection::is_default")]
    pub approvals: ApprovalsSection,
    /// When the routine runs on its own (docs/webhooks.md, docs/routines.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule: Option<crate::schedule::ScheduleSection>,
    #[serde(skip_serializing_if = "WebhookSection::is_default")]
    pub webhook: WebhookSection,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifySection>,
    #[serde(skip_serializing_if = "MemorySection::is_default")]
    pub memory: MemorySection,
    /// The shape the run's final answer must have (docs/models.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<OutputSection>,
}

/// `[output]`: the JSON Schema a run's final answer must match. The run's result is then the
/// validated JSON; a model whose answer does not match is asked to correct it while turns
/// remain, and the run fails naming the violation when none do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// The JSON Schema (an object), written as a TOML table or as JSON text. It may not refer
    /// to remote documents (nothing is fetched); it is compiled when the routine is applied.
    pub schema: serde_json::Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoutine {
    name: RoutineName,
    #[serde(default)]
    description: String,
    instructions: Spanned<String>,
    model: Spanned<ModelSection>,
    #[serde(default)]
    budget: BudgetLimits,
    #[serde(default)]
    concurrency: ConcurrencySection,
    #[serde(default)]
    tools: Vec<Spanned<RosterEntry>>,
    #[serde(default)]
    policy: Option<Spanned<String>>,
    #[serde(default)]
    approvals: ApprovalsSection,
    #[serde(default)]
    schedule: Option<Spanned<crate::schedule::ScheduleSection>>,
    #[serde(default)]
    webhook: WebhookSection,
    #[serde(default)]
    notify: Option<Spanned<NotifySection>>,
    #[serde(default)]
    memory: MemorySection,
    #[serde(default)]
    output: Option<Spanned<OutputSection>>,
}

/// Where each turn of `[model.script]` starts, read again only to place an error.
#[derive(Deserialize)]
struct ScriptTurnSpans {
    model: ModelSpans,
}

#[derive(Deserialize)]
struct ModelSpans {
    script: ScriptSpans,
}

#[derive(Deserialize)]
struct ScriptSpans {
    turns: Vec<Spanned<serde::de::IgnoredAny>>,
}

/// The span of turn `turn` (counted from 1) of the routine's replay script.
fn script_turn_span(text: &str, turn: usize) -> Option<std::ops::Range<usize>> {
    let spans: ScriptTurnSpans = toml::from_str(text).ok()?;
    spans
        .model
        .script
        .turns
        .get(turn.checked_sub(1)?)
        .map(Spanned::span)
}

/// The key whose value starts at `offset`, as `section.key` (`budget.turns`), read from the
/// text: the bare key before the `=` on that line, under the nearest table header above it.
/// `None` where the value is not on a `key = value` line of its own (an inline table's, an
/// array's element).
fn key_at(text: &str, offset: usize) -> Option<String> {
    let before = text.get(..offset)?;
    let line_start = before.rfind('\n').map_or(0, |at| at + 1);
    let (key, _) = before.get(line_start..)?.split_once('=')?;
    let key = key.trim();
    let bare = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    };
    if !bare(key) {
        return None;
    }
    let section = before
        .get(..line_start)?
        .lines()
        .rev()
        .map(str::trim)
        // A header, its comment left out: `[budget] # note`.
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .find(|l| l.starts_with('[') && l.ends_with(']'))
        .map(|header| header.trim_matches(|c| c == '[' || c == ']').trim())
        .filter(|header| bare(header));
    Some(match section {
        Some(section) => format!("{section}.{key}"),
        None => key.to_owned(),
    })
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(1, |before| before.matches('\n').count() + 1)
}

/// Where a string or key holds U+0000 once its escapes are read (`\u0000`, `\U00000000`,
/// `\x00`), as `` `notify.url` `` or `` a key of `tools[2].pinned` ``: no stored text may carry
/// it (PostgreSQL text cannot hold it); `None` when none does. A replay model's script is left
/// out: it plays a model's replies, in which a run replaces U+0000 as in any model's. The text
/// is only read again when it has an escape at all; U+0000 itself is no TOML a parser reads.
fn nul_field(text: &str) -> Option<String> {
    if !text.contains('\\') {
        return None;
    }
    let mut table: toml::Table = toml::from_str(text).ok()?;
    if let Some(toml::Value::Table(model)) = table.get_mut("model") {
        model.remove("script");
    }
    let holds_nul = |table: &toml::Table| table.keys().any(|k| k.contains('\0'));
    if holds_nul(&table) {
        return Some("a top-level key".to_owned());
    }
    let mut pending: Vec<(String, &toml::Value)> =
        table.iter().map(|(k, v)| (k.clone(), v)).collect();
    while let Some((field, value)) = pending.pop() {
        match value {
            toml::Value::String(s) if s.contains('\0') => return Some(format!("`{field}`")),
            toml::Value::Array(items) => pending.extend(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (format!("{field}[{i}]"), v)),
            ),
            toml::Value::Table(inner) => {
                if holds_nul(inner) {
                    return Some(format!("a key of `{field}`"));
                }
                pending.extend(inner.iter().map(|(k, v)| (format!("{field}.{k}"), v)));
            }
            _ => {}
        }
    }
    None
}

impl RoutineDefinition {
    /// Parses and validates a routine written in TOML.
    pub fn from_toml(text: &str) -> Result<Self, RoutineError> {
        let raw: RawRoutine = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(text, s.start));
            let mut message = e.message().trim().to_owned();
            if message.contains("max recursion depth") {
                message =
                    format!("arrays and inline tables nest deeper than {MAX_TOML_NESTING} levels");
            } else if let Some(key) = e.span().and_then(|s| key_at(text, s.start)) {
                // A value refused for what it is names its key, as every other refusal does.
                if !message.contains(&format!("`{key}`")) {
                    message = format!("`{key}`: {message}");
                }
            }
            if let Some(line) = line {
                message = format!("line {line}: {message}");
            }
            RoutineError { message, line }
        })?;
        if let Some(field) = nul_field(text) {
            return Err(RoutineError {
                message: format!("{field} holds a NUL character (U+0000)"),
                line: None,
            });
        }
        let at = |span: std::ops::Range<usize>, message: String| {
            let line = line_of(text, span.start);
            RoutineError {
                message: format!("line {line}: {message}"),
                line: Some(line),
            }
        };
        if raw.instructions.get_ref().trim().is_empty() {
            return Err(at(
                raw.instructions.span(),
                "`instructions` must not be empty".to_owned(),
            ));
        }
        let model_span = raw.model.span();
        let model = raw.model.into_inner();
        match (model.provider, &model.connection, &model.script) {
            (ProviderKind::Replay, Some(_), _) => {
                return Err(at(
                    model_span,
                    "`model.connection` is not used with provider `replay`".into(),
                ));
            }
            (ProviderKind::Replay, None, None) => {
                return Err(at(
                    model_span,
                    "`model.script` is required with provider `replay`".into(),
                ));
            }
            (kind, None, _) if kind.needs_connection() => {
                return Err(at(
                    model_span,
                    "`model.connection` names the model connection to use".into(),
                ));
            }
            (kind, _, Some(_)) if kind.needs_connection() => {
                return Err(at(
                    model_span,
                    "`model.script` is only for provider `replay`".into(),
                ));
            }
            _ => {}
        }
        if let Some(script) = &model.script {
            script.validate().map_err(|e| {
                let span = e
                    .turn()
                    .and_then(|turn| script_turn_span(text, turn))
                    .unwrap_or_else(|| model_span.clone());
                at(span, format!("`model.script`: {e}"))
            })?;
        }
        if model.model.trim().is_empty() {
            return Err(at(model_span, "`model.model` must name a model".into()));
        }
        let mut tools = Vec::with_capacity(raw.tools.len());
        for entry in raw.tools {
            let span = entry.span();
            let entry = entry.into_inner();
            let Some((connection, tool)) = entry.split() else {
                return Err(at(
                    span,
                    format!("`tools.tool` `{}` must be CONNECTION/TOOL", entry.tool),
                ));
            };
            if connection.is_empty() || tool.is_empty() {
                return Err(at(
                    span,
                    format!("`tools.tool` `{}` must be CONNECTION/TOOL", entry.tool),
                ));
            }
            if tools.iter().any(|t: &RosterEntry| t.tool == entry.tool) {
                return Err(at(
                    span,
                    format!("`tools.tool` `{}` is listed twice", entry.tool),
                ));
            }
            tools.push(entry);
        }
        let policy = match raw.policy {
            Some(policy) if policy.get_ref().trim().is_empty() => {
                return Err(at(
                    policy.span(),
                    "`policy` must hold Cedar policies, or be left out".to_owned(),
                ));
            }
            Some(policy) => Some(policy.into_inner()),
            None => None,
        };
        let schedule = match raw.schedule {
            Some(section) => {
                let span = section.span();
                let section = section.into_inner();
                section.compile().map_err(|e| at(span, e.to_string()))?;
                Some(section)
            }
            None => None,
        };
        let notify = match raw.notify {
            Some(section) => {
                let span = section.span();
                let section = section.into_inner();
                // A scheme is case-insensitive (RFC 3986): `HTTPS://` is `https://`.
                let scheme = section
                    .url
                    .split_once("://")
                    .map(|(s, _)| s.to_ascii_lowercase());
                if !matches!(scheme.as_deref(), Some("http" | "https")) {
                    return Err(at(
                        span,
                        format!(
                            "`notify.url` `{}` must be an http:// or https:// URL",
                            section.url
                        ),
                    ));
                }
                if section.events.is_empty() {
                    return Err(at(
                        span,
                        "`notify.events` must name at least one event".to_owned(),
                    ));
                }
                Some(section)
            }
            None => None,
        };
        let output = match raw.output {
            Some(section) => {
                let span = section.span();
                let section = section.into_inner();
                let schema = match section.schema {
                    serde_json::Value::String(text) => {
                        serde_json::from_str(&text).map_err(|e| {
                            at(
                                span.clone(),
                                format!("`output.schema` is not valid JSON: {e}"),
                            )
                        })?
                    }
                    other => other,
                };
                // JSON written as a TOML string has escapes of its own.
                if crate::text::json_holds_nul(&schema) {
                    return Err(at(
                        span,
                        "`output.schema` holds a NUL character (U+0000)".to_owned(),
                    ));
                }
                if !schema.is_object() {
                    return Err(at(
                        span,
                        "`output.schema` must be a JSON Schema object".to_owned(),
                    ));
                }
                if crate::json_depth::value_nesting(&schema) > crate::json_depth::MAX_JSON_NESTING {
                    return Err(at(
                        span,
                        format!(
                            "`output.schema` nests deeper than {} levels",
                            crate::json_depth::MAX_JSON_NESTING
                        ),
                    ));
                }
                Some(OutputSection { schema })
            }
            None => None,
        };
        Ok(RoutineDefinition {
            name: raw.name,
            description: raw.description,
            instructions: raw.instructions.into_inner(),
            model,
            budget: raw.budget,
            concurrency: raw.concurrency,
            tools,
            policy,
            approvals: raw.approvals,
            schedule,
            webhook: raw.webhook,
            notify,
            memory: raw.memory,
            output,
        })
    }

    /// SHA-256 of the definition's canonical JSON: equal definitions, equal hashes, whatever
    /// the formatting of the TOML they came from.
    pub fn content_hash(&self) -> String {
        canonical_hash(&serde_json::to_value(self).unwrap_or(serde_json::Value::Null))
    }

    /// Why production mode refuses this routine, if it does: the `replay` model is for demos
    /// and tests only.
    pub fn production_refusal(&self) -> Option<&'static str> {
        (self.model.provider == ProviderKind::Replay).then_some(
            "provider `replay` is a scripted model for demos and tests; production refuses it",
        )
    }

    /// The roster entry for `CONNECTION/TOOL`, if the routine lists it.
    pub fn roster_entry(&self, tool: &str) -> Option<&RosterEntry> {
        self.tools.iter().find(|t| t.tool == tool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The complete example of docs/routines.md reads as written, every section in its place.
    #[test]
    fn the_documented_complete_example_reads() {
        let doc = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/routines.md"
        ));
        let start = doc.find("## A complete example").expect("the section");
        let block = doc[start..].split("```toml\n").nth(1).expect("its TOML");
        let text = block.split("\n```").next().expect("its end");
        let routine = RoutineDefinition::from_toml(text).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            routine
                .policy
                .is_some_and(|p| p.contains("mail-only-to-our-domain"))
        );
        assert!(routine.notify.is_some() && routine.schedule.is_some());
        assert!(routine.memory.enabled);
    }

    const EXAMPLE: &str = r#"
name = "inbox-triage"
description = "Sort the support inbox"
instructions = "Read the inbox and file each message."

[model]
provider = "anthropic"
connection = "main"
model = "claude-sonnet-4-5"

[budget]
turns = 5
cost_microdollars = 100000

[[tools]]
tool = "mail/read_inbox"
mode = "auto"

[[tools]]
tool = "mail/send"
mode = "confirm"
pinned = { from = "support@example.com" }
"#;

    #[test]
    fn parses_a_complete_routine_with_defaults() {
        let r = RoutineDefinition::from_toml(EXAMPLE).unwrap();
        assert_eq!(r.name.as_str(), "inbox-triage");
        assert_eq!(r.budget.turns, 5);
        assert_eq!(r.budget.tool_calls, 50, "unset limits take their defaults");
        assert_eq!(r.concurrency, ConcurrencySection::default());
        assert_eq!(r.tools.len(), 2);
        let send = r.roster_entry("mail/send").unwrap();
        assert_eq!(send.mode, ToolMode::Confirm);
        assert_eq!(send.pinned["from"], "support@example.com");
        assert_eq!(send.split(), Some(("mail", "send")));
    }

    #[test]
    fn hash_ignores_formatting_but_not_content() {
        let a = RoutineDefinition::from_toml(EXAMPLE).unwrap();
        let reformatted = EXAMPLE.replace("turns = 5", "turns    =    5 # five");
        let b = RoutineDefinition::from_toml(&reformatted).unwrap();
        assert_eq!(a.content_hash(), b.content_hash());
        let c = RoutineDefinition::from_toml(&EXAMPLE.replace("turns = 5", "turns = 6")).unwrap();
        assert_ne!(a.content_hash(), c.content_hash());
    }

    fn error(text: &str) -> RoutineError {
        RoutineDefinition::from_toml(text).unwrap_err()
    }

    #[test]
    fn errors_name_the_field_and_line() {
        let e = error(&EXAMPLE.replace("mode = \"confirm\"", "mode = \"sometimes\""));
        assert_eq!(e.line, Some(21), "{e}");
        assert!(e.message.contains("sometimes"), "{e}");

        let e = error(&EXAMPLE.replace("turns = 5", "turns = 0"));
        assert_eq!(e.line, Some(12), "{e}");
        assert!(
            e.message.contains("positive") && e.message.contains("`budget.turns`"),
            "{e}"
        );
        let e = error(&EXAMPLE.replace("turns = 5", "turns = \"five\""));
        assert!(e.message.contains("`budget.turns`"), "{e}");
        let e = error(
            &EXAMPLE
                .replace("[budget]", "[budget] # the run's limits")
                .replace("turns = 5", "turns = -1"),
        );
        assert!(e.message.contains("`budget.turns`"), "{e}");

        let e = error(&EXAMPLE.replace("name = \"inbox-triage\"", "name = \"Inbox Triage\""));
        assert_eq!(e.line, Some(2), "{e}");
        assert!(e.message.contains("routine name"), "{e}");

        let e = error(&EXAMPLE.replace("turns = 5", "turns = 5\nturnz = 3"));
        assert!(e.message.contains("turnz"), "{e}");

        let e = error(&EXAMPLE.replace("connection = \"main\"\n", ""));
        assert!(e.message.contains("model.connection"), "{e}");
        assert_eq!(e.line, Some(6), "{e}");

        let e = error(&EXAMPLE.replace("mail/send", "mail/read_inbox"));
        assert!(
            e.message.contains("listed twice") && e.line == Some(19),
            "{e}"
        );

        let e = error(&EXAMPLE.replace("mail/send", "send"));
        assert!(e.message.contains("CONNECTION/TOOL"), "{e}");

        let e = error(&EXAMPLE.replace("Read the inbox and file each message.", "  "));
        assert!(e.message.contains("instructions"), "{e}");

        let e = error("name = \"x\"\ninstructions = ");
        assert!(e.line.is_some(), "{e}");
    }

    #[test]
    fn an_output_schema_is_a_table_or_json_text_and_an_object() {
        let plain = RoutineDefinition::from_toml(EXAMPLE).unwrap();
        assert_eq!(plain.output, None);
        let hash = plain.content_hash();
        let table =
            format!("{EXAMPLE}\n[output]\nschema = {{ type = \"object\", required = [\"a\"] }}\n");
        let text = format!(
            "{EXAMPLE}\n[output]\nschema = '{{\"type\": \"object\", \"required\": [\"a\"]}}'\n"
        );
        let from_table = RoutineDefinition::from_toml(&table).unwrap();
        let from_text = RoutineDefinition::from_toml(&text).unwrap();
        assert_eq!(
            from_table.output.as_ref().map(|o| &o.schema),
            Some(&serde_json::json!({"type": "object", "required": ["a"]}))
        );
        assert_eq!(from_table, from_text);
        assert_ne!(from_table.content_hash(), hash);
        let e = error(&format!("{EXAMPLE}\n[output]\nschema = '[1, 2]'\n"));
        assert!(e.message.contains("must be a JSON Schema object"), "{e}");
        let e = error(&format!("{EXAMPLE}\n[output]\nschema = '{{nope'\n"));
        assert!(e.message.contains("not valid JSON"), "{e}");
        let deep = format!("{}{}", "[".repeat(70), "]".repeat(70));
        let e = error(&format!(
            "{EXAMPLE}\n[output]\nschema = '{{\"enum\": {deep}}}'\n"
        ));
        assert!(e.message.contains("deeper than 64"), "{e}");
    }

    #[test]
    fn replay_needs_a_script_and_no_connection() {
        let replay = EXAMPLE
            .replace("provider = \"anthropic\"", "provider = \"replay\"")
            .replace("connection = \"main\"\n", "");
        let e = error(&replay);
        assert!(e.message.contains("model.script"), "{e}");
        let with_script = replay.replace(
            "model = \"claude-sonnet-4-5\"",
            "model = \"demo\"\nscript = { turns = [{ text = \"hi\" }] }",
        );
        let r = RoutineDefinition::from_toml(&with_script).unwrap();
        assert_eq!(r.model.provider, ProviderKind::Replay);
    }

    #[test]
    fn a_malformed_replay_script_is_refused_with_its_line_and_field() {
        let routine = |script: &str| {
            format!(
                "name = \"scripted\"\ninstructions = \"Go.\"\n[model]\nprovider = \"replay\"\nmodel = \"demo\"\n{script}"
            )
        };
        let good = "[[model.script.turns]]\ntext = \"one\"\n\n[[model.script.turns]]\ntool_calls = [{ name = \"t\", arguments = { a = 1 } }]\n";
        let parsed = RoutineDefinition::from_toml(&routine(good)).unwrap();
        assert_eq!(parsed.model.script.unwrap().turns.len(), 2);
        for (script, expected, line) in [
            (
                "[[model.script.turns]]\ntext = \"one\"\ntypo = 1\n",
                "unknown field `typo`",
                8,
            ),
            (
                "[[model.script.turns]]\ntext = \"one\"\n\n[[model.script.turns]]\ntool_calls = [{ name = \"t\", arguments = {}, arguments_after = \"m\" }]\n",
                "`model.script`: tool call `t` of turn 2 has both `arguments` and `arguments_after`",
                9,
            ),
            (
                "[[model.script.turns]]\ntext = \"one\"\n[[model.script.turns]]\nrepeat = true\n",
                "`model.script`: turn 2 has neither text nor tool calls",
                8,
            ),
            (
                "script = { turns = [] }\n",
                "`model.script`: the script has no turns",
                3,
            ),
            (
                "script = \"turns.toml\"\n",
                "invalid type: string \"turns.toml\"",
                6,
            ),
            (
                "[[model.script.turns]]\ntext = \"one\"\ntool_calls = \"t\"\n",
                "invalid type: string \"t\", expected a sequence",
                8,
            ),
            (
                "[[model.script.turns]]\ntext = \"one\"\nwhen = \"always\"\n",
                "invalid type: string \"always\"",
                8,
            ),
            (
                "[[model.script.turns]]\ntool_calls = [{ arguments = {} }]\n",
                "missing field `name`",
                7,
            ),
        ] {
            let e = error(&routine(script));
            assert!(e.message.contains(expected), "{script}: {e}");
            assert_eq!(e.line, Some(line), "{script}: {e}");
            assert!(e.message.starts_with(&format!("line {line}: ")), "{e}");
        }
    }

    #[test]
    fn toml_nested_past_the_parser_limit_is_refused_naming_it() {
        let routine = |levels: usize| {
            let value = format!("{}1{}", "[".repeat(levels), "]".repeat(levels));
            EXAMPLE.replace(
                "pinned = { from = \"support@example.com\" }",
                &format!("pinned = {{ from = {value} }}"),
            )
        };
        // `pinned` is an inline table: one level, and the arrays in it the rest.
        let deepest = MAX_TOML_NESTING - 1;
        let r = RoutineDefinition::from_toml(&routine(deepest)).unwrap();
        assert!(r.roster_entry("mail/send").unwrap().pinned["from"].is_array());
        let e = error(&routine(deepest + 1));
        assert_eq!(
            e.message,
            format!("line 22: arrays and inline tables nest deeper than {MAX_TOML_NESTING} levels")
        );
    }
}
