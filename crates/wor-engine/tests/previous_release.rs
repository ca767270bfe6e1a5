//! A database written by the previous release is read and resumed by this one: every stored
//! step reads back as a typed step, and runs parked for a person go on to their end once the
//! person decides. The database is the embedded one (SQLite), whatever backend the other tests
//! use: it is a file written by that release (`testdata/SOURCES.md` says how).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::sync::Arc;

use wor_core::run::RunStatus;
use wor_core::step::{InputSource, Step, StepKind};
use wor_engine::{Engine, EngineConfig};
use wor_store::{AuditConfig, AuditLog, RunFilter, Store, Vault};

const PREVIOUS: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/previous-release/wor.db"
));

async fn previous_release() -> (Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("wor.db");
    std::fs::write(&file, PREVIOUS).unwrap();
    let store = Store::connect(&format!("sqlite://{}?mode=rw", file.display()))
        .await
        .unwrap();
    // That release filed its pending approvals with a lifetime that has since run out: they
    // are given a day from now, so the test does not depend on the date it runs on.
    let later = wor_store::now_millis() + 86_400_000;
    wor_store::testing::tamper(
        &store,
        &[format!(
            "UPDATE approvals SET expires_at = {later} WHERE status = 'pending'"
        )],
    )
    .await
    .unwrap();
    (store, dir)
}

#[tokio::test]
async fn a_database_of_the_previous_release_is_read_and_its_parked_runs_resume() {
    let (store, _dir) = previous_release().await;
    let project = store.find_project("fixture").await.unwrap().id;
    let runs = store
        .list_runs(
            project,
            &RunFilter {
                limit: 50,
                ..RunFilter::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(runs.len(), 4, "{runs:?}");

    // Every step of every run reads back typed, of every kind that release wrote.
    let mut kinds = std::collections::BTreeSet::new();
    for run in &runs {
        for step in store.list_run_steps(project, run.id, 0).await.unwrap() {
            kinds.insert(step.step.kind().as_str());
            if let Step::Input(input) = &step.step
                && run.trigger_kind == wor_core::call::TriggerKind::Webhook
            {
                assert_eq!(input.source, Some(InputSource::Webhook));
                assert!(input.boundary.is_some());
            }
        }
    }
    let written: std::collections::BTreeSet<&str> = [
        StepKind::Input,
        StepKind::Memory,
        StepKind::ModelTurn,
        StepKind::ToolCall,
        StepKind::ToolResult,
        StepKind::Outcome,
    ]
    .iter()
    .map(|k| k.as_str())
    .collect();
    assert_eq!(kinds, written);

    // The parked runs resume once a person approves, and end as their scripts say.
    let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
    let vault = Vault::new(store.clone(), Arc::new(keys));
    let (signing, _) = wor_secrets::AuditSigningKey::generate().unwrap();
    let audit = AuditLog::start(store.clone(), signing, AuditConfig::default());
    let egress = wor_egress::EgressClient::new(wor_egress::EgressPolicy::development()).unwrap();
    let engine = Engine::new(store.clone(), vault, egress, audit, EngineConfig::default());
    let member = store
        .create_member(project, "approver", wor_core::Role::Approver)
        .await
        .unwrap();
    let (key, _) = store
        .create_api_key(
            project,
            wor_store::NewApiKey {
                kind: wor_store::ApiKeyKind::Personal(member.id),
                name: "approver".to_owned(),
                role: wor_core::Role::Approver,
                created_by: None,
            },
        )
        .await
        .unwrap();
    let parked: Vec<_> = runs
        .iter()
        .filter(|r| r.status == RunStatus::WaitingForApproval)
        .collect();
    assert_eq!(parked.len(), 2);
    for run in &parked {
        let approvals = store
            .list_approvals(
                project,
                &wor_store::ApprovalFilter {
                    run_id: Some(run.id),
                    limit: 10,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(approvals.len(), 1, "{approvals:?}");
        engine
            .decide_approval(
                project,
                approvals[0].id,
                wor_engine::Approver {
                    key_id: Some(key.id),
                    member_id: Some(member.id),
                    role: wor_core::Role::Approver,
                },
                wor_store::ApprovalAnswer::Approve,
                "fine",
            )
            .await
            .unwrap();
    }
    for run in &parked {
        let mut ended = None;
        for _ in 0..20 {
            engine.run_next().await.unwrap();
            let now = store.get_run(project, run.id).await.unwrap();
            if now.status.is_terminal() {
                ended = Some(now);
                break;
            }
        }
        let ended = ended.expect("the resumed run ends");
        assert_eq!(ended.status, RunStatus::Succeeded, "{:?}", ended.outcome);
        // Its new steps follow the old ones: the approval used, the nested run's answer.
        let steps = store.list_run_steps(project, run.id, 0).await.unwrap();
        assert!(
            steps
                .iter()
                .any(|s| s.step.kind() == StepKind::ApprovalUsed),
            "{steps:?}"
        );
        assert_eq!(steps.last().map(|s| s.step.kind()), Some(StepKind::Outcome));
    }
}
