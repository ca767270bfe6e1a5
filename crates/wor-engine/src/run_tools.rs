//! The tools one run may use, prepared at run start: each connection its roster names is
//! checked (`enabled`), connected, and its live list compared with the pins. A changed or new
//! tool quarantines the connection and the run fails closed; a removed tool is unavailable.
//!
//! The model sees only roster tools that are pinned, still listed and not `deny`, under a
//! provider-safe name (`CONNECTION__TOOL`) that is mapped back here.

use std::collections::BTreeMap;

use wor_core::call::ToolClass;
use wor_core::model::ToolSpec;
use wor_core::routine::{ROUTINE_CONNECTION, RoutineDefinition, ToolMode};
use wor_store::{RunRecord, StoreError, ToolConnectionRecord};
use wor_tools::{PinnedToolDefinition, ToolListVerdict, compare, model_view};

use crate::Engine;
use crate::tool_connections::{quarantine_names, stored_from_definition, stored_pins};

/// Longest function name the providers accept.
const MAX_MODEL_NAME: usize = 64;

/// One roster tool the model may call.
pub(crate) struct OfferedTool {
    /// `CONNECTION/TOOL`, as on the roster.
    pub roster_name: String,
    pub connection: String,
    pub tool: String,
    pub mode: ToolMode,
    pub pin: PinnedToolDefinition,
    pub entry: wor_core::routine::RosterEntry,
    pub class: ToolClass,
    /// The pin's input schema, compiled at the first call and kept for the run's others.
    /// INVARIANT: made from `pin` by [`OfferedTool::new`]; `pin` is never replaced after.
    schema: wor_tools::ArgumentSchema,
}

impl OfferedTool {
    /// `connection/tool` as the roster `entry` offers it, under `pin`, of `class`.
    pub(crate) fn new(
        entry: &wor_core::routine::RosterEntry,
        connection: &str,
        tool: &str,
        pin: PinnedToolDefinition,
        class: ToolClass,
    ) -> Self {
        let schema = wor_tools::ArgumentSchema::new(pin.input_schema());
        OfferedTool {
            roster_name: entry.tool.clone(),
            connection: connection.to_owned(),
            tool: tool.to_owned(),
            mode: entry.mode,
            pin,
            entry: entry.clone(),
            class,
            schema,
        }
    }

    /// The arguments to send for `model_arguments`: pipeline steps 2 and 3
    /// ([`wor_tools::ArgumentSchema::prepare`]).
    pub(crate) fn prepare_arguments(
        &self,
        model_arguments: &serde_json::Value,
    ) -> Result<wor_tools::CanonicalArguments, wor_tools::ArgumentError> {
        self.schema.prepare(model_arguments, &self.entry)
    }
}

/// An open connection of the run, with the record its pins were checked against.
pub(crate) struct LiveConnection {
    pub session: wor_tools::ToolSession,
    pub record: ToolConnectionRecord,
}

/// The run's tools: what the model is offered, and the sessions to call them on.
#[derive(Default)]
pub(crate) struct RunTools {
    /// By model-facing name.
    pub offered: BTreeMap<String, OfferedTool>,
    /// By connection name.
    pub connections: BTreeMap<String, LiveConnection>,
}

/// Why a run cannot start with its tools.
pub(crate) enum ToolsUnavailable {
    /// The run fails closed with this reason.
    Refused(String),
    Store(StoreError),
}

impl ToolsUnavailable {
    /// A connection the roster names cannot be used: the run fails closed, saying why.
    fn connection(error: crate::tool_connections::ConnectionError) -> Self {
        ToolsUnavailable::Refused(error.to_string())
    }
}

/// The name the model calls a roster tool by: letters, digits, `_` and `-` only.
pub(crate) fn model_name(connection: &str, tool: &str) -> String {
    format!("{connection}__{tool}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(MAX_MODEL_NAME)
        .collect()
}

impl RunTools {
    /// The tools as the model sees them: pinned arguments removed.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.offered
            .iter()
            .map(|(name, offered)| {
                let view = model_view(&offered.pin, &offered.entry);
                ToolSpec {
                    name: name.clone(),
                    description: view.description,
                    input_schema: view.input_schema,
                }
            })
            .collect()
    }

    /// The offered tool the model means by `name` (its model-facing or its roster name).
    pub fn find(&self, name: &str) -> Option<&OfferedTool> {
        self.offered
            .get(name)
            .or_else(|| self.offered.values().find(|t| t.roster_name == name))
    }

    pub async fn close(self) {
        for (_, connection) in self.connections {
            connection.session.close().await;
        }
    }
}

impl Engine {
    /// Prepares the run's tools (see the module documentation).
    pub(crate) async fn prepare_tools(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
    ) -> Result<RunTools, ToolsUnavailable> {
        let mut tools = RunTools::default();
        // Connections by name, with the roster entries on each; `deny` entries need nothing.
        let mut wanted: BTreeMap<&str, Vec<(&str, &wor_core::routine::RosterEntry)>> =
            BTreeMap::new();
        for entry in &definition.tools {
            if entry.mode == ToolMode::Deny {
                continue;
            }
            let Some((connection, tool)) = entry.tool.split_once('/') else {
                return Err(ToolsUnavailable::Refused(format!(
                    "roster tool `{}` is not CONNECTION/TOOL",
                    entry.tool
                )));
            };
            wanted.entry(connection).or_default().push((tool, entry));
        }
        for (connection, entries) in wanted {
            if connection == ROUTINE_CONNECTION {
                for (routine, entry) in entries {
                    let offered =
                        self.routine_tool(run, routine, entry)
                            .await
                            .map_err(|e| match e {
                                crate::EngineError::Store(store) => ToolsUnavailable::Store(store),
                                other => ToolsUnavailable::Refused(other.to_string()),
                            })?;
                    let name = model_name(connection, routine);
                    if tools.offered.insert(name.clone(), offered).is_some() {
                        return Err(ToolsUnavailable::Refused(format!(
                            "two roster tools are offered to the model as `{name}`"
                        )));
                    }
                }
                continue;
            }
            let found = match self.remote_claim(run.id) {
                Some(claim) => {
                    let claim = claim.map_err(|_| {
                        ToolsUnavailable::Refused("the run's claim is no longer held".to_owned())
                    })?;
                    Engine::claimed_tool_connection(&claim, connection).ok_or(StoreError::NotFound)
                }
                None => {
                    self.store
                        .get_tool_connection_by_name(run.project_id, connection)
                        .await
                }
            };
            let record = match found {
                Ok(record) => record,
                Err(StoreError::NotFound) => {
                    return Err(ToolsUnavailable::Refused(format!(
                        "tool connection `{connection}` named by the roster does not exist"
                    )));
                }
                Err(other) => return Err(ToolsUnavailable::Store(other)),
            };
            Engine::check_enabled(&record).map_err(ToolsUnavailable::connection)?;
            let session = self
                .open_tool_session(&record, Some(run))
                .await
                .map_err(ToolsUnavailable::connection)?;
            let live = session.list_tools().await.map_err(|e| {
                ToolsUnavailable::Refused(format!(
                    "the tools of tool connection `{connection}` cannot be listed: {e}"
                ))
            })?;
            let pins = stored_pins(&record).map_err(ToolsUnavailable::connection)?;
            let diff = compare(&pins, &live);
            if diff.verdict() == ToolListVerdict::Quarantine {
                session.close().await;
                let names: Vec<String> = quarantine_names(&diff)
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect();
                if self.is_remote() {
                    let reason = match self.changed_on_remote(run.id, connection, &names).await {
                        Ok(reason) => reason,
                        Err(crate::EngineError::Store(store)) => {
                            return Err(ToolsUnavailable::Store(store));
                        }
                        Err(other) => other.to_string(),
                    };
                    return Err(ToolsUnavailable::Refused(reason));
                }
                self.quarantine_tool_connection(&record, &live, &diff, run)
                    .await
                    .map_err(ToolsUnavailable::Store)?;
                return Err(ToolsUnavailable::Refused(format!(
                    "tool connection `{connection}` is quarantined: tools changed since they were pinned: {}; an admin must review the diff and enable it again",
                    names.join(", ")
                )));
            }
            if diff.verdict() == ToolListVerdict::ToolsRemoved && !self.is_remote() {
                let seen = live
                    .iter()
                    .map(|t| (t.name.clone(), stored_from_definition(t)))
                    .collect();
                self.store
                    .record_live_tools(run.project_id, record.id, &seen)
                    .await
                    .map_err(ToolsUnavailable::Store)?;
            }
            for (tool, entry) in entries {
                // A pinned tool the server no longer lists is unavailable, not a quarantine.
                let Some(pin) = pins
                    .iter()
                    .find(|p| p.name() == tool && !diff.removed.iter().any(|r| r == tool))
                else {
                    continue;
                };
                self.offer(&mut tools, &record, connection, tool, entry, pin.clone())?;
            }
            tools
                .connections
                .insert(connection.to_owned(), LiveConnection { session, record });
        }
        Ok(tools)
    }

    fn offer(
        &self,
        tools: &mut RunTools,
        record: &ToolConnectionRecord,
        connection: &str,
        tool: &str,
        entry: &wor_core::routine::RosterEntry,
        pin: PinnedToolDefinition,
    ) -> Result<(), ToolsUnavailable> {
        let name = model_name(connection, tool);
        let offered = OfferedTool::new(entry, connection, tool, pin, record.class_of(tool));
        if tools.offered.insert(name.clone(), offered).is_some() {
            return Err(ToolsUnavailable::Refused(format!(
                "two roster tools are offered to the model as `{name}`; rename one connection"
            )));
        }
        Ok(())
    }
}
