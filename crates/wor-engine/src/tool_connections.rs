//! Tool connections at work: reviewing a connection's live tools, pinning exactly what an
//! admin reviewed, and, at each run start, checking the live list against the pins (S9).
//!
//! Credentials come out of the vault only to build the [`ConnectionCredentials`] that
//! `wor-tools` attaches at send time; they never enter a value this module returns.

use std::collections::{BTreeMap, BTreeSet};

use secrecy::SecretString;
use serde_json::{Value, json};
use wor_core::ProjectId;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_store::{SecretSlot, StoreError};
use wor_store::{
    StoredPin, TOOL_CONNECTIONS_TABLE, ToolClass, ToolConnectionKind, ToolConnectionRecord,
    ToolConnectionStatus, header_field,
};
use wor_tools::{
    ConnectionCredentials, McpLimits, McpSession, PinnedToolDefinition, StreamableHttpEndpoint,
    ToolDefinition, ToolListDiff, compare,
};

use crate::{Engine, EngineError};

/// The vault field of a connection's bearer token.
pub const BEARER_TOKEN_FIELD: &str = "bearer_token";

/// One live tool as an admin reviews it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReviewedTool {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Value,
    /// The server's hints; shown, never trusted for decisions.
    pub annotations: Option<Value>,
    /// What enabling pins.
    pub hash: String,
}

/// How the live list differs from the pins.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReviewDiff {
    pub changed: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub duplicated: Vec<String>,
    /// The readable diff, path by path.
    pub text: String,
}

/// What `review` shows: the live tools, and the diff against the pins when there are pins.
#[derive(Debug, Clone)]
pub struct ToolReview {
    pub connection: ToolConnectionRecord,
    pub tools: Vec<ReviewedTool>,
    pub diff: Option<ReviewDiff>,
}

/// The slot of a connection's credential `field`.
pub fn credential_slot(record: &ToolConnectionRecord, field: impl Into<String>) -> SecretSlot {
    SecretSlot::new(record.project_id, TOOL_CONNECTIONS_TABLE, record.id, field)
}

/// A stored pin as the tool library's checked pin.
pub(crate) fn pin_from_stored(stored: &StoredPin) -> Result<PinnedToolDefinition, String> {
    let definition: ToolDefinition = serde_json::from_value(stored.definition.clone())
        .map_err(|e| format!("a stored pin is not a tool definition: {e}"))?;
    PinnedToolDefinition::from_stored(definition, &stored.hash).map_err(|e| e.to_string())
}

pub(crate) fn stored_from_definition(definition: &ToolDefinition) -> StoredPin {
    StoredPin {
        definition: serde_json::to_value(definition).unwrap_or(Value::Null),
        hash: definition.hash(),
    }
}

pub(crate) fn stored_pins(
    record: &ToolConnectionRecord,
) -> Result<Vec<PinnedToolDefinition>, String> {
    record.pinned_tools.values().map(pin_from_stored).collect()
}

/// The names a diff makes a quarantine of: changed, new and duplicated tools.
pub(crate) fn quarantine_names(diff: &ToolListDiff) -> Vec<String> {
    let mut names: BTreeSet<String> = diff.changed.iter().map(|c| c.name.clone()).collect();
    names.extend(diff.added.iter().map(|t| t.name.clone()));
    names.extend(diff.duplicated.iter().cloned());
    names.into_iter().collect()
}

fn review_diff(diff: &ToolListDiff) -> ReviewDiff {
    ReviewDiff {
        changed: diff.changed.iter().map(|c| c.name.clone()).collect(),
        added: diff.added.iter().map(|t| t.name.clone()).collect(),
        removed: diff.removed.clone(),
        duplicated: diff.duplicated.clone(),
        text: diff.to_string(),
    }
}

impl Engine {
    /// Opens an MCP session with an `mcp_http` connection, its credentials attached by
    /// `wor-tools` at send time. Errors are for people: they name the connection, never a value.
    pub(crate) async fn open_tool_session(
        &self,
        record: &ToolConnectionRecord,
    ) -> Result<McpSession, String> {
        let name = &record.name;
        match record.kind {
            ToolConnectionKind::McpHttp => {}
            ToolConnectionKind::McpStdio => {
                return Err(format!(
                    "tool connection `{name}` is a stdio MCP server; stdio MCP servers run only in the sandbox, which this server does not start yet"
                ));
            }
            ToolConnectionKind::HttpApi => {
                return Err(format!(
                    "tool connection `{name}` is an http api, which routines cannot call yet"
                ));
            }
        }
        let allowlist = wor_egress::HostAllowlist::parse(&record.allowlist)
            .map_err(|e| format!("the allowlist of tool connection `{name}` is invalid: {e}"))?;
        let mut credentials = ConnectionCredentials::none();
        let bearer = credential_slot(record, BEARER_TOKEN_FIELD);
        if self
            .vault
            .metadata(&bearer)
            .await
            .map_err(|e| {
                format!("the credentials of tool connection `{name}` cannot be read: {e}")
            })?
            .is_some()
        {
            let token = self.open_secret(&bearer, name).await?;
            credentials = credentials
                .with_bearer(token)
                .map_err(|e| format!("tool connection `{name}`: {e}"))?;
        }
        for header in &record.secret_headers {
            let value = self
                .open_secret(&credential_slot(record, header_field(header)), name)
                .await?;
            credentials = credentials
                .with_header(header, value)
                .map_err(|e| format!("tool connection `{name}`: {e}"))?;
        }
        let endpoint = StreamableHttpEndpoint {
            url: record.url.clone(),
            allowlist,
            credentials,
        };
        McpSession::connect_http(&self.egress, endpoint, McpLimits::default())
            .await
            .map_err(|e| format!("tool connection `{name}` cannot be reached: {e}"))
    }

    async fn open_secret(&self, slot: &SecretSlot, name: &str) -> Result<SecretString, String> {
        self.vault
            .open(slot)
            .await
            .map_err(|e| format!("a credential of tool connection `{name}` cannot be opened: {e}"))
    }

    async fn live_tools(
        &self,
        record: &ToolConnectionRecord,
    ) -> Result<Vec<ToolDefinition>, EngineError> {
        let session = self
            .open_tool_session(record)
            .await
            .map_err(EngineError::Unreachable)?;
        let listed = session.list_tools().await;
        session.close().await;
        listed.map_err(|e| {
            EngineError::Unreachable(format!(
                "the tools of tool connection `{}` cannot be listed: {e}",
                record.name
            ))
        })
    }

    /// Connects to the connection, lists its live tools, and compares them with its pins.
    pub async fn review_tool_connection(
        &self,
        project: ProjectId,
        id: wor_core::ConnectionId,
    ) -> Result<ToolReview, EngineError> {
        let record = self.store.get_tool_connection(project, id).await?;
        let live = self.live_tools(&record).await?;
        let diff = if record.pinned_tools.is_empty() {
            None
        } else {
            let pins = stored_pins(&record).map_err(EngineError::Refused)?;
            Some(review_diff(&compare(&pins, &live)))
        };
        let tools = live
            .iter()
            .map(|t| ReviewedTool {
                name: t.name.clone(),
                description: t.description.clone(),
                input_schema: Value::Object(t.input_schema.clone()),
                annotations: t.annotations.clone(),
                hash: t.hash(),
            })
            .collect();
        Ok(ToolReview {
            connection: record,
            tools,
            diff,
        })
    }

    /// Pins exactly the tools an admin reviewed: `reviewed` maps each tool name to the hash
    /// they saw. The live list is fetched again and must be exactly that set, or nothing is
    /// pinned. `read_only` names the tools the admin classifies read-only.
    pub async fn enable_tool_connection(
        &self,
        project: ProjectId,
        id: wor_core::ConnectionId,
        reviewed: &BTreeMap<String, String>,
        read_only: &[String],
    ) -> Result<ToolConnectionRecord, EngineError> {
        let record = self.store.get_tool_connection(project, id).await?;
        for tool in read_only {
            if !reviewed.contains_key(tool) {
                return Err(EngineError::Invalid(format!(
                    "`read_only` names `{tool}`, which is not among the reviewed tools"
                )));
            }
        }
        let live = self.live_tools(&record).await?;
        let mut pins = BTreeMap::new();
        for tool in &live {
            if pins
                .insert(tool.name.clone(), stored_from_definition(tool))
                .is_some()
            {
                return Err(EngineError::Refused(format!(
                    "the server lists tool `{}` twice; it cannot be pinned",
                    tool.name
                )));
            }
        }
        let live_hashes: BTreeMap<&String, &String> =
            pins.iter().map(|(name, pin)| (name, &pin.hash)).collect();
        let reviewed_hashes: BTreeMap<&String, &String> = reviewed.iter().collect();
        if live_hashes != reviewed_hashes {
            let mut differing: BTreeSet<&String> = BTreeSet::new();
            for (name, hash) in &live_hashes {
                if reviewed_hashes.get(name) != Some(hash) {
                    differing.insert(name);
                }
            }
            differing.extend(
                reviewed_hashes
                    .keys()
                    .filter(|name| !live_hashes.contains_key(*name)),
            );
            let names: Vec<String> = differing.iter().map(|n| format!("`{n}`")).collect();
            return Err(EngineError::Refused(format!(
                "the live tool list changed since it was reviewed ({}); review it again",
                names.join(", ")
            )));
        }
        let classification: BTreeMap<String, ToolClass> = pins
            .keys()
            .map(|name| {
                let class = if read_only.contains(name) {
                    ToolClass::ReadOnly
                } else {
                    ToolClass::Consequential
                };
                (name.clone(), class)
            })
            .collect();
        Ok(self
            .store
            .enable_tool_connection(project, id, &pins, &classification)
            .await?)
    }

    /// Quarantines `record` because its live list differs from its pins, and records why.
    pub(crate) async fn quarantine_tool_connection(
        &self,
        record: &ToolConnectionRecord,
        live: &[ToolDefinition],
        diff: &ToolListDiff,
        run: &wor_store::RunRecord,
    ) -> Result<(), StoreError> {
        let mut seen = BTreeMap::new();
        for tool in live {
            seen.insert(tool.name.clone(), stored_from_definition(tool));
        }
        self.store
            .quarantine_tool_connection(record.project_id, record.id, &seen)
            .await?;
        tracing::warn!(category = "tools", action = "connection.quarantine", project_id = %record.project_id,
            connection_id = %record.id, run_id = %run.id, "tool connection quarantined");
        let event = AuditEvent::new(
            record.project_id,
            AuditCategory::ToolConnectionQuarantine,
            Actor::Run { run_id: run.id },
        )
        .subject("connection_id", record.id)
        .runs(run.root_run_id, run.parent_run_id)
        .payload(json!({
            "connection": record.name,
            "tools": quarantine_names(diff),
            "changed": diff.changed.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
            "added": diff.added.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
            "duplicated": diff.duplicated,
        }));
        self.audit.append(event).await?;
        Ok(())
    }

    /// Whether `status` lets runs use the connection, and why not.
    pub(crate) fn check_enabled(record: &ToolConnectionRecord) -> Result<(), String> {
        let name = &record.name;
        match record.status {
            ToolConnectionStatus::Enabled => Ok(()),
            ToolConnectionStatus::Quarantined => Err(format!(
                "tool connection `{name}` is quarantined: its tools changed since they were pinned; an admin must review the diff and enable it again"
            )),
            ToolConnectionStatus::PendingReview => Err(format!(
                "tool connection `{name}` is waiting for review; an admin must review and enable it"
            )),
            ToolConnectionStatus::Disabled => Err(format!("tool connection `{name}` is disabled")),
        }
    }
}
