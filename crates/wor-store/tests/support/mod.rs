//! Helpers the store's test binaries share.
#![allow(dead_code, reason = "each test binary uses some of the helpers")]

use std::time::Duration;

use wor_core::ProjectId;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_secrets::AuditSigningKey;
use wor_store::AuditConfig;

pub fn audit_config(checkpoint_every: i64) -> AuditConfig {
    AuditConfig {
        checkpoint_every,
        checkpoint_interval: Duration::from_secs(3600),
        max_batch: 64,
    }
}

pub fn signing_key(byte: u8) -> AuditSigningKey {
    use base64::Engine as _;
    AuditSigningKey::from_base64(&base64::engine::general_purpose::STANDARD.encode([byte; 32]))
        .unwrap()
}

pub fn key_event(project: ProjectId, i: usize) -> AuditEvent {
    AuditEvent::new(project, AuditCategory::KeyCreate, Actor::Operator)
        .subject("key_id", wor_core::ApiKeyId::new())
        .payload(serde_json::json!({ "name": format!("key {i}") }))
}

/// A run of `routine` started through the API by `started_by`, queued with the routine's
/// `max_concurrent`.
pub fn queued_run(
    routine: wor_core::RoutineId,
    routine_version: i64,
    started_by: Option<wor_core::ApiKeyId>,
    max_concurrent: u64,
) -> wor_store::NewRun {
    use wor_core::run::{Provenance, RunStatus};
    wor_store::NewRun {
        routine_id: routine,
        routine_version,
        trigger_kind: wor_core::call::TriggerKind::Api,
        started_by,
        started_by_member: None,
        max_concurrent,
        status: RunStatus::Queued,
        outcome: None,
        trigger_key: None,
        input_provenance: Provenance::Requester,
        thread: None,
        memory: None,
        parent: None,
    }
}
