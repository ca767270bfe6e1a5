//! Helpers the store's test binaries share.
#![allow(dead_code, reason = "each test binary uses some of the helpers")]

use std::time::Duration;

use wor_core::ProjectId;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_secrets::AuditSigningKey;
use wor_store::AuditConfig;

/// An isolated database for a test that applies only to `backend`: `None`, having said `why`
/// on stderr, when the suite runs on the other one (CI runs it on both).
#[expect(
    clippy::print_stderr,
    reason = "a test says why it checks nothing on this backend"
)]
pub async fn isolated_on(
    backend: wor_store::Backend,
    why: &str,
) -> Option<wor_store::testing::TestDatabase> {
    let db = wor_store::testing::TestDatabase::isolated().await.unwrap();
    if db.store.backend() != backend {
        eprintln!("{why}");
        return None;
    }
    Some(db)
}

/// Runs `write` while this test holds the process's turn to write (SQLite's; the caller
/// checks the backend): it must not go in within 200 ms, and goes in once the turn is given
/// up. Returns what `write` returned.
pub async fn held_up<T>(store: &wor_store::Store, write: impl Future<Output = T>) -> T {
    let held = wor_store::testing::hold_write_turn(store).await.unwrap();
    let mut write = Box::pin(write);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut write)
            .await
            .is_err(),
        "a write went in while the turn to write was held"
    );
    drop(held);
    write.await
}

/// A model turn that says `text` and calls no tool.
pub fn model_turn(text: impl Into<String>) -> wor_core::step::Step {
    wor_core::step::Step::ModelTurn(wor_core::step::ModelTurnStep {
        message: wor_core::model::AssistantMessage {
            text: text.into(),
            tool_calls: Vec::new(),
        },
        usage: wor_core::model::Usage::default(),
        stop_reason: wor_core::model::StopReason::EndTurn,
        identity: None,
        nul_replaced: false,
    })
}

pub fn audit_config(checkpoint_every: i64) -> AuditConfig {
    AuditConfig {
        checkpoint_every,
        checkpoint_interval: Duration::from_secs(3600),
        max_batch: 64,
        // Tests share one PostgreSQL database: a writer leaves another test's fresh rows to it.
        ..AuditConfig::default()
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
        skip_at: None,
    }
}

/// A new project, its name `name` made unique, owned by `alice`.
pub async fn created_project(store: &wor_store::Store, name: &str) -> wor_store::CreatedProject {
    store
        .create_project(
            &wor_store::testing::TestDatabase::unique_name(name),
            "alice",
        )
        .await
        .unwrap()
}

/// A new project (its name `name`, made unique) with one replay routine `r` that allows
/// `max_runs` runs at once.
pub async fn project_with_routine(
    store: &wor_store::Store,
    name: &str,
    max_runs: u64,
) -> (ProjectId, wor_core::RoutineId) {
    let project = created_project(store, name).await.project.id;
    let toml = format!(
        "name = \"r\"\ninstructions = \"x\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\n\
         script = {{ turns = [{{ text = \"hi\" }}] }}\n[concurrency]\nmax_runs = {max_runs}\n"
    );
    let definition = wor_core::routine::RoutineDefinition::from_toml(&toml).unwrap();
    let routine = store
        .apply_routine(project, &toml, &definition, None)
        .await
        .unwrap()
        .routine
        .id;
    (project, routine)
}

/// A run of `routine`, created and claimed by `worker` for `lease_ms`.
pub async fn claimed_run(
    store: &wor_store::Store,
    project: ProjectId,
    routine: wor_core::RoutineId,
    worker: &str,
    lease_ms: i64,
) -> wor_core::RunId {
    let run = store
        .create_run(
            project,
            queued_run(routine, 1, None, 1),
            wor_core::step::InputStep::requested(serde_json::json!("x")),
        )
        .await
        .unwrap();
    store
        .claim_run_by_id(project, run.id, worker, lease_ms)
        .await
        .unwrap()
        .unwrap();
    run.id
}

/// A new MCP connection named `name` to a server at `mcp.example.com`, with no secret
/// headers.
pub fn mcp_connection(name: &str) -> wor_store::NewToolConnection {
    wor_store::NewToolConnection {
        name: name.to_owned(),
        kind: wor_store::ToolConnectionKind::McpHttp,
        url: "https://mcp.example.com/mcp".to_owned(),
        allowlist: vec!["mcp.example.com".to_owned()],
        secret_headers: Vec::new(),
        command: None,
        http_tools: Vec::new(),
        created_by: None,
    }
}

/// A request for a person's decision on call `call_1` (`mail/send`) of `run`, bound by
/// `binding`, expiring in a minute.
pub fn held_mail_approval(run: wor_core::RunId, binding: &str) -> wor_store::NewApproval {
    wor_store::NewApproval {
        run_id: run,
        call_id: "call_1".to_owned(),
        tool: "mail/send".to_owned(),
        pin_hash: "pin".to_owned(),
        arguments: serde_json::json!({}),
        arguments_hash: "args".to_owned(),
        pinned_keys: Vec::new(),
        binding_hash: binding.to_owned(),
        kind: wor_store::ApprovalKind::Policy,
        why: serde_json::json!({}),
        expires_at: wor_store::now_millis() + 60_000,
    }
}

/// The statements that make every insert into `audit_staged` fail (`injected failure`), and
/// that undo it, on `backend`: for a test on a database of its own that shows a change whose
/// entry cannot be staged is not made.
pub fn staging_refusal(backend: wor_store::Backend) -> (&'static str, &'static str) {
    match backend {
        wor_store::Backend::Sqlite => (
            "CREATE TRIGGER refuse_staging BEFORE INSERT ON audit_staged \
             BEGIN SELECT RAISE(ABORT, 'injected failure'); END;",
            "DROP TRIGGER refuse_staging;",
        ),
        wor_store::Backend::Postgres => (
            "CREATE FUNCTION refuse_staging() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$; \
             CREATE TRIGGER refuse_staging BEFORE INSERT ON audit_staged FOR EACH ROW \
             EXECUTE FUNCTION refuse_staging();",
            "DROP TRIGGER refuse_staging ON audit_staged; DROP FUNCTION refuse_staging();",
        ),
    }
}
