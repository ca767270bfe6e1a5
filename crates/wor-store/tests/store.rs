//! Repository behaviour on the configured backend (SQLite by default, PostgreSQL in CI).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use wor_core::Role;
use wor_core::call::ToolClass;
use wor_core::model::ToolResult;
use wor_core::step::{ApprovalUsedStep, InputStep, Step, StepKind, ToolResultStep};
use wor_store::testing::TestDatabase;
use wor_store::{ApiKeyKind, NewApiKey, StoreError};

mod support;
use support::{
    audit_config, claimed_run, created_project, held_mail_approval, isolated_on, key_event,
    model_turn, project_with_routine, queued_run, signing_key,
};

#[tokio::test]
async fn project_creation_makes_an_owner_with_a_working_key() {
    let db = TestDatabase::new().await.unwrap();
    let name = TestDatabase::unique_name("p");
    let created = db.store.create_project(&name, "alice").await.unwrap();
    let key = created.owner_key.expose().to_owned();
    assert!(key.starts_with("wor_") && key.len() == 4 + 64, "{key}");
    assert!(!format!("{:?}", created.owner_key).contains(&key[4..]));

    let auth = db.store.authenticate_api_key(&key).await.unwrap().unwrap();
    assert_eq!(auth.project_id, created.project.id);
    assert_eq!(auth.member_id, Some(created.owner.id));
    assert_eq!(auth.role, Role::Owner);

    let dup = db.store.create_project(&name, "bob").await.unwrap_err();
    assert!(
        matches!(dup, StoreError::Conflict(ref m) if m.contains(&name)),
        "{dup:?}"
    );
}

#[tokio::test]
async fn unknown_and_revoked_keys_do_not_authenticate() {
    let db = TestDatabase::new().await.unwrap();
    let created = created_project(&db.store, "p").await;
    let project = created.project.id;
    let (record, key) = service_key(&db.store, project, Role::Viewer).await;
    assert!(
        db.store
            .authenticate_api_key(key.expose())
            .await
            .unwrap()
            .is_some()
    );
    let mut wrong = key.expose().to_owned();
    wrong.pop();
    wrong.push('x');
    assert!(
        db.store
            .authenticate_api_key(&wrong)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        db.store
            .authenticate_api_key("Bearer nonsense")
            .await
            .unwrap()
            .is_none()
    );

    let revoked = db.store.revoke_api_key(project, record.id).await.unwrap();
    assert!(revoked.revoked_at.is_some());
    assert!(
        db.store
            .authenticate_api_key(key.expose())
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn every_lookup_is_confined_to_its_project() {
    let db = TestDatabase::new().await.unwrap();
    let a = created_project(&db.store, "a").await;
    let b = db
        .store
        .create_project(&TestDatabase::unique_name("b"), "bob")
        .await
        .unwrap();
    let a_key_id = db.store.list_api_keys(a.project.id).await.unwrap()[0].id;

    assert!(matches!(
        db.store.get_member(b.project.id, a.owner.id).await,
        Err(StoreError::NotFound)
    ));
    assert!(matches!(
        db.store.get_api_key(b.project.id, a_key_id).await,
        Err(StoreError::NotFound)
    ));
    assert!(matches!(
        db.store.revoke_api_key(b.project.id, a_key_id).await,
        Err(StoreError::NotFound)
    ));
    // The key of project A still works: B's revoke touched nothing.
    assert!(
        db.store
            .authenticate_api_key(a.owner_key.expose())
            .await
            .unwrap()
            .is_some()
    );
    // A personal key cannot be made for another project's member.
    let err = db
        .store
        .create_api_key(
            b.project.id,
            NewApiKey {
                name: "x".into(),
                role: Role::Viewer,
                kind: ApiKeyKind::Personal(a.owner.id),
                created_by: None,
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound));
    assert!(
        db.store
            .list_members(b.project.id)
            .await
            .unwrap()
            .iter()
            .all(|m| m.project_id == b.project.id)
    );
}

#[tokio::test]
async fn keys_are_stored_only_as_digests() {
    let db = TestDatabase::new().await.unwrap();
    let created = created_project(&db.store, "p").await;
    let key = created.owner_key.expose().to_owned();
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT prefix, sha256 FROM api_keys")
        .fetch_all(db.store.pool())
        .await
        .unwrap();
    let ours = rows
        .iter()
        .find(|(_, digest)| *digest == wor_store::api_key_digest(&key))
        .expect("the key's digest is stored");
    assert_eq!(ours.0, key[..12]);
    for (prefix, digest) in &rows {
        assert!(!digest.contains(&key[12..]) && !prefix.contains(&key[12..]));
    }
    if db.url.starts_with("sqlite:") {
        let bytes = std::fs::read(db.dir.path().join(wor_store::SQLITE_FILE)).unwrap();
        let wal = std::fs::read(db.dir.path().join("wor.db-wal")).unwrap_or_default();
        for file in [&bytes, &wal] {
            assert!(
                !file.windows(key.len()).any(|w| w == key.as_bytes()),
                "plaintext key found in the database files"
            );
        }
    }
}

#[tokio::test]
async fn migrations_are_idempotent() {
    let db = TestDatabase::new().await.unwrap();
    let again = wor_store::Store::connect(&db.url).await.unwrap();
    again.ping().await.unwrap();
}

#[tokio::test]
async fn a_database_of_a_newer_release_is_said_to_be_one() {
    let db = TestDatabase::isolated().await.unwrap();
    // A migration this release does not have, as a newer release would have recorded it.
    let pool = sqlx::AnyPool::connect(&db.url).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES ($1, 'from a newer release', TRUE, $2, 0)",
    )
    .bind(99_999_i64)
    .bind(vec![0u8; 48])
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let refused = wor_store::Store::connect(&db.url).await.unwrap_err();
    assert!(
        matches!(refused, StoreError::NewerSchema(99_999)),
        "{refused:?}"
    );
    assert!(refused.to_string().contains("newer release"), "{refused}");
}

// ---- The audit chain ----

use wor_core::ProjectId;
use wor_core::audit::{
    Actor, Anchor, AuditCategory, AuditEvent, BreakReason, ChainBreak, GENESIS_HASH, Verification,
};
use wor_core::canonical::canonical_hash;
use wor_store::{AuditLog, Store};

async fn new_project(db: &TestDatabase) -> ProjectId {
    created_project(&db.store, "audit").await.project.id
}

async fn verify(store: &Store, project: ProjectId, log: &AuditLog) -> Verification {
    store
        .verify_audit_chain(project, &log.verifying_key(), &[])
        .await
        .unwrap()
}

fn intact_entries(v: &Verification) -> i64 {
    match v {
        Verification::Intact(summary) => summary.entries,
        Verification::Broken(b) => panic!("chain broken: {b}"),
    }
}

#[tokio::test]
async fn concurrent_appends_form_one_chain_that_survives_a_restart() {
    let db = TestDatabase::new().await.unwrap();
    let project = new_project(&db).await;
    let log = AuditLog::start(db.store.clone(), signing_key(1), audit_config(10));

    let appends = (0..40).map(|i| {
        let log = log.clone();
        tokio::spawn(async move { log.append(key_event(project, i)).await.unwrap() })
    });
    let mut seqs = Vec::new();
    for task in appends.collect::<Vec<_>>() {
        seqs.push(task.await.unwrap().seq);
    }
    seqs.sort_unstable();
    assert_eq!(
        seqs,
        (1..=40).collect::<Vec<_>>(),
        "every caller got its own number"
    );
    let v = verify(&db.store, project, &log).await;
    assert_eq!(intact_entries(&v), 40);
    let Verification::Intact(summary) = v else {
        panic!("the chain is intact: {v:?}");
    };
    // Group commit may write all 40 in one batch; a checkpoint follows any batch that leaves
    // 10 or more entries unsigned.
    assert!(
        summary.checkpoints >= 1 && summary.unsigned_tail < 10,
        "{summary:?}"
    );
    let first = db.store.audit_entries(project, 0, 1).await.unwrap();
    assert_eq!(first[0].prev_hash, GENESIS_HASH);
    drop(log);

    // A new process: a new pool and a new writer continue the same chain.
    let reopened = Store::connect(&db.url).await.unwrap();
    let log = AuditLog::start(reopened.clone(), signing_key(1), audit_config(10));
    let receipt = log.append(key_event(project, 99)).await.unwrap();
    assert_eq!(receipt.seq, 41);
    log.checkpoint().await.unwrap();
    let Verification::Intact(summary) = verify(&reopened, project, &log).await else {
        panic!("broken after restart")
    };
    assert_eq!((summary.entries, summary.unsigned_tail), (41, 0));
    assert_eq!(summary.head_hash, receipt.hash);
}

/// An entry staged with its change (a run's start, a cancel) is appended once: by its caller's
/// `append_staged`, or, when the caller never gets there (a crash between the two), by the
/// sweep of the next writer to start; never twice, whichever comes first.
#[tokio::test]
async fn an_entry_staged_with_its_change_is_appended_once_by_its_caller_or_the_next_sweep() {
    let db = TestDatabase::isolated().await.unwrap();
    let project = new_project(&db).await;
    let routine = replay_routine(&db.store, project, "staged").await;
    let started = |id: wor_core::RunId| {
        AuditEvent::new(project, AuditCategory::RunStart, Actor::Operator).subject("run_id", id)
    };
    let create = |store: Store| async move {
        store
            .create_run_staged(
                project,
                queued_run(routine, 1, None, 100),
                InputStep::requested(serde_json::json!("x")),
                None,
                Some(&started),
            )
            .await
            .map(|(run, staged)| (run, staged.expect("an entry was given to stage")))
            .unwrap()
    };
    // What each entry of the chain is about, in order.
    let entries = |store: Store| async move {
        store
            .audit_entries(project, 0, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|e| (e.category, e.subjects["run_id"].clone()))
            .collect::<Vec<_>>()
    };
    // The writers of the later processes sweep staged rows at once, with no grace for their
    // callers.
    let config = || wor_store::AuditConfig {
        staged_grace: std::time::Duration::ZERO,
        ..audit_config(100)
    };
    // This one leaves them their grace: its own sweep after the grace must not take the rows
    // of the callers that stop below before the next process starts.
    let log = AuditLog::start(db.store.clone(), signing_key(4), audit_config(100));
    let (appended, staged) = create(db.store.clone()).await;
    log.append_staged(vec![staged]).await.unwrap();
    // A run, and a cancel, whose callers stop before they append their entries.
    let (lost, staged) = create(db.store.clone()).await;
    drop(staged);
    let (cancelled, staged) = db
        .store
        .request_cancel_staged(
            project,
            appended.id,
            "here",
            60_000,
            Some(&|asked| {
                AuditEvent::new(project, AuditCategory::RunCancel, Actor::Operator)
                    .subject("run_id", asked.run.id)
            }),
        )
        .await
        .unwrap();
    assert_eq!(cancelled.asked, 1);
    drop(staged);
    // A cancel that asks nothing stages nothing.
    let (_, none) = db
        .store
        .request_cancel_staged(
            project,
            appended.id,
            "here",
            60_000,
            Some(&|_| panic!("nothing was asked, so nothing is staged")),
        )
        .await
        .unwrap();
    assert!(none.is_none());
    log.checkpoint().await.unwrap();
    let start = |run: wor_core::RunId| ("run.start".to_owned(), run.to_string());
    let cancel = |run: wor_core::RunId| ("run.cancel".to_owned(), run.to_string());
    assert_eq!(entries(db.store.clone()).await, vec![start(appended.id)]);
    // A writer leaves a row younger than its grace to the caller who staged it.
    let graced = AuditLog::start(db.store.clone(), signing_key(4), audit_config(100));
    graced.checkpoint().await.unwrap();
    assert_eq!(entries(db.store.clone()).await, vec![start(appended.id)]);
    drop((log, graced));

    // The next process's writer appends what was left staged before anything else it commits.
    let reopened = Store::connect(&db.url).await.unwrap();
    let log = AuditLog::start(reopened.clone(), signing_key(4), config());
    log.checkpoint().await.unwrap();
    let expected = vec![start(appended.id), start(lost.id), cancel(appended.id)];
    assert_eq!(entries(reopened.clone()).await, expected);
    // A staged event the sweep appended is not appended again by its caller, late.
    let (late, staged) = create(reopened.clone()).await;
    let other = AuditLog::start(
        Store::connect(&db.url).await.unwrap(),
        signing_key(4),
        config(),
    );
    other.checkpoint().await.unwrap();
    log.append_staged(vec![staged]).await.unwrap();
    log.checkpoint().await.unwrap();
    let mut expected = expected;
    expected.push(start(late.id));
    assert_eq!(entries(reopened.clone()).await, expected);
    // Nor by a later sweep.
    drop((log, other));
    let log = AuditLog::start(reopened.clone(), signing_key(4), config());
    log.checkpoint().await.unwrap();
    assert_eq!(entries(reopened.clone()).await, expected);
    let Verification::Intact(summary) = verify(&reopened, project, &log).await else {
        panic!("the chain is broken")
    };
    assert_eq!(summary.entries, 4);
}

#[tokio::test]
async fn two_writers_on_one_database_keep_one_chain() {
    let db = TestDatabase::new().await.unwrap();
    let project = new_project(&db).await;
    let other = Store::connect(&db.url).await.unwrap();
    let a = AuditLog::start(db.store.clone(), signing_key(2), audit_config(7));
    let b = AuditLog::start(other, signing_key(2), audit_config(7));
    let mut tasks = Vec::new();
    for i in 0..30 {
        let log = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            log.append(key_event(project, i)).await.unwrap()
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    a.checkpoint().await.unwrap();
    b.checkpoint().await.unwrap();
    assert_eq!(intact_entries(&verify(&db.store, project, &a).await), 30);
}

#[tokio::test]
async fn stored_payloads_are_redacted_and_digested_in_full() {
    let db = TestDatabase::new().await.unwrap();
    let project = new_project(&db).await;
    let log = AuditLog::start(db.store.clone(), signing_key(3), audit_config(100));
    let token = format!(
        "ghp_{}",
        "a1B2c3D4e5".repeat(4).chars().take(36).collect::<String>()
    );
    let payload = serde_json::json!({ "note": format!("token {token} leaked") });
    log.append(
        AuditEvent::new(project, AuditCategory::KeyRevoke, Actor::Operator)
            .payload(payload.clone()),
    )
    .await
    .unwrap();
    let entry = &db.store.audit_entries(project, 0, 10).await.unwrap()[0];
    assert_eq!(entry.payload_digest, canonical_hash(&payload));
    let stored = entry.payload.to_string();
    assert!(
        !stored.contains(&token) && stored.contains("REDACTED"),
        "{stored}"
    );
}

#[tokio::test]
async fn audit_tables_refuse_update_and_delete() {
    let db = TestDatabase::new().await.unwrap();
    let project = new_project(&db).await;
    let log = AuditLog::start(db.store.clone(), signing_key(4), audit_config(1));
    log.append(key_event(project, 0)).await.unwrap();
    for sql in [
        "UPDATE audit_entries SET category = 'x' WHERE project_id = $1",
        "DELETE FROM audit_entries WHERE project_id = $1",
        "UPDATE audit_checkpoints SET seq = 9 WHERE project_id = $1",
        "DELETE FROM audit_checkpoints WHERE project_id = $1",
    ] {
        let err = sqlx::query(sql)
            .bind(project.to_string())
            .execute(db.store.pool())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("append-only"), "{sql}: {err}");
    }
    assert_eq!(intact_entries(&verify(&db.store, project, &log).await), 1);
}

#[tokio::test]
async fn every_tampering_of_the_stored_chain_is_detected() {
    let db = TestDatabase::new().await.unwrap();
    let log = AuditLog::start(db.store.clone(), signing_key(5), audit_config(3));
    // Each case: (name, SQL given the project id, expected first break).
    type Case = (&'static str, fn(&str) -> Vec<String>, ChainBreak);
    let brk = |seq, reason| ChainBreak { seq, reason };
    let cases: Vec<Case> = vec![
        (
            "modified entry",
            |p| {
                vec![format!(
                    "UPDATE audit_entries SET payload = '{{}}' WHERE project_id = '{p}' AND seq = 2"
                )]
            },
            brk(2, BreakReason::HashMismatch),
        ),
        (
            "malformed column",
            |p| {
                vec![format!(
                    "UPDATE audit_entries SET actor = 'nope' WHERE project_id = '{p}' AND seq = 4"
                )]
            },
            brk(
                4,
                BreakReason::Unreadable {
                    column: "actor".into(),
                },
            ),
        ),
        (
            "deleted entry",
            |p| {
                vec![format!(
                    "DELETE FROM audit_entries WHERE project_id = '{p}' AND seq = 2"
                )]
            },
            brk(2, BreakReason::Gap { found: 3 }),
        ),
        (
            "inserted entry",
            |p| {
                vec![
                    format!(
                        "UPDATE audit_entries SET seq = seq + 1000 WHERE project_id = '{p}' AND seq >= 2"
                    ),
                    format!(
                        "UPDATE audit_entries SET seq = seq - 999 WHERE project_id = '{p}' AND seq > 1000"
                    ),
                    format!(
                        "INSERT INTO audit_entries SELECT project_id, 2, at, actor, category, subjects, \
                         root_run_id, parent_run_id, payload_digest, payload, prev_hash, hash \
                         FROM audit_entries WHERE project_id = '{p}' AND seq = 1"
                    ),
                ]
            },
            brk(2, BreakReason::HashMismatch),
        ),
        (
            "reordered entries",
            |p| {
                vec![
                    format!(
                        "UPDATE audit_entries SET seq = 1002 WHERE project_id = '{p}' AND seq = 2"
                    ),
                    format!(
                        "UPDATE audit_entries SET seq = 2 WHERE project_id = '{p}' AND seq = 3"
                    ),
                    format!(
                        "UPDATE audit_entries SET seq = 3 WHERE project_id = '{p}' AND seq = 1002"
                    ),
                ]
            },
            brk(2, BreakReason::HashMismatch),
        ),
        (
            "chain cut back behind the last checkpoint",
            |p| {
                vec![format!(
                    "DELETE FROM audit_entries WHERE project_id = '{p}' AND seq >= 5"
                )]
            },
            brk(6, BreakReason::Truncated { head: 4 }),
        ),
        (
            "forged checkpoint over the unsigned tail",
            |p| {
                vec![format!(
                    "INSERT INTO audit_checkpoints SELECT project_id, 7, hash, at, \
                 (SELECT key_id FROM audit_checkpoints WHERE project_id = '{p}' AND seq = 3), \
                 '{sig}' FROM audit_entries WHERE project_id = '{p}' AND seq = 7",
                    sig = "ab".repeat(64)
                )]
            },
            brk(7, BreakReason::BadSignature),
        ),
        (
            "altered checkpoint",
            |p| {
                vec![format!(
                    "UPDATE audit_checkpoints SET at = at + 1 WHERE project_id = '{p}' AND seq = 3"
                )]
            },
            brk(3, BreakReason::BadSignature),
        ),
    ];
    for (name, tamper, expected) in cases {
        let project = new_project(&db).await;
        for i in 0..7 {
            log.append(key_event(project, i)).await.unwrap();
        }
        assert_eq!(
            intact_entries(&verify(&db.store, project, &log).await),
            7,
            "{name}"
        );
        db.tamper(&tamper(&project.to_string())).await.unwrap();
        assert_eq!(
            verify(&db.store, project, &log).await,
            Verification::Broken(expected),
            "{name}"
        );
    }
}

#[tokio::test]
async fn a_rewritten_chain_is_caught_by_its_checkpoints_and_a_cut_tail_by_an_anchor() {
    let db = TestDatabase::new().await.unwrap();
    let log = AuditLog::start(db.store.clone(), signing_key(6), audit_config(3));
    let project = new_project(&db).await;
    for i in 0..7 {
        log.append(key_event(project, i)).await.unwrap();
    }
    let Verification::Intact(before) = verify(&db.store, project, &log).await else {
        panic!()
    };
    assert_eq!(
        (before.last_checkpoint_seq, before.unsigned_tail),
        (Some(6), 1)
    );

    // The attacker rewrites entry 2 and recomputes every hash and link after it.
    let mut entries = db.store.audit_entries(project, 0, 100).await.unwrap();
    entries[1].payload = serde_json::json!({ "name": "innocent" });
    let mut prev = GENESIS_HASH.to_owned();
    let mut statements = Vec::new();
    for e in &mut entries {
        e.prev_hash = prev;
        e.hash = e.compute_hash();
        prev = e.hash.clone();
        statements.push(format!(
            "UPDATE audit_entries SET payload = '{}', prev_hash = '{}', hash = '{}' \
             WHERE project_id = '{project}' AND seq = {}",
            wor_core::canonical::to_canonical_json(&e.payload),
            e.prev_hash,
            e.hash,
            e.seq
        ));
    }
    db.tamper(&statements).await.unwrap();
    assert_eq!(
        verify(&db.store, project, &log).await,
        Verification::Broken(ChainBreak {
            seq: 3,
            reason: BreakReason::CheckpointMismatch
        })
    );

    // Cutting only the unsigned tail leaves a consistent chain: only an anchor kept outside
    // the database shows it.
    let other = new_project(&db).await;
    for i in 0..7 {
        log.append(key_event(other, i)).await.unwrap();
    }
    let Verification::Intact(head) = verify(&db.store, other, &log).await else {
        panic!()
    };
    db.tamper(&[format!(
        "DELETE FROM audit_entries WHERE project_id = '{other}' AND seq = 7"
    )])
    .await
    .unwrap();
    assert!(matches!(
        verify(&db.store, other, &log).await,
        Verification::Intact(_)
    ));
    let anchor = Anchor {
        seq: 7,
        hash: head.head_hash,
    };
    assert_eq!(
        db.store
            .verify_audit_chain(other, &log.verifying_key(), &[anchor])
            .await
            .unwrap(),
        Verification::Broken(ChainBreak {
            seq: 7,
            reason: BreakReason::AnchorMissing { head: 6 }
        })
    );
}

#[tokio::test]
async fn tool_connections_are_confined_to_their_project_and_keep_their_pins() {
    use std::collections::BTreeMap;
    use wor_store::{NewToolConnection, StoredPin, ToolConnectionStatus};

    let db = TestDatabase::new().await.unwrap();
    let a = created_project(&db.store, "a").await;
    let b = db
        .store
        .create_project(&TestDatabase::unique_name("b"), "bob")
        .await
        .unwrap();
    let new = || NewToolConnection {
        secret_headers: vec!["x-api-key".to_owned()],
        ..support::mcp_connection("desk")
    };
    let created = db
        .store
        .create_tool_connection(a.project.id, new())
        .await
        .unwrap();
    assert_eq!(created.status, ToolConnectionStatus::PendingReview);
    // Names are unique per project, not across projects.
    assert!(matches!(
        db.store.create_tool_connection(a.project.id, new()).await,
        Err(StoreError::Conflict(_))
    ));
    db.store
        .create_tool_connection(b.project.id, new())
        .await
        .unwrap();
    // Project B reaches none of A's rows, by id or by name, and cannot change them.
    assert!(matches!(
        db.store.get_tool_connection(b.project.id, created.id).await,
        Err(StoreError::NotFound)
    ));
    let disabled = |id: wor_core::ConnectionId| {
        wor_core::audit::AuditEvent::new(
            b.project.id,
            wor_core::audit::AuditCategory::ToolConnectionDisable,
            wor_core::audit::Actor::Operator,
        )
        .subject("connection_id", id)
    };
    assert!(matches!(
        db.store
            .disable_tool_connection_staged(b.project.id, created.id, disabled(created.id))
            .await,
        Err(StoreError::NotFound)
    ));
    let staged = |project| wor_store::testing::staged_count(&db.store, project);
    assert_eq!(
        staged(b.project.id).await.unwrap(),
        0,
        "a refused change stages nothing"
    );
    let b_desk = db
        .store
        .get_tool_connection_by_name(b.project.id, "desk")
        .await
        .unwrap();
    assert_ne!(b_desk.id, created.id);

    let pins = BTreeMap::from([(
        "echo".to_owned(),
        StoredPin {
            definition: serde_json::json!({"name": "echo", "description": null,
                "inputSchema": {"type": "object"}, "annotations": null}),
            hash: "ab".repeat(32),
        },
    )]);
    let classes = BTreeMap::from([("echo".to_owned(), ToolClass::ReadOnly)]);
    let event = |category, id: wor_core::ConnectionId| {
        wor_core::audit::AuditEvent::new(a.project.id, category, wor_core::audit::Actor::Operator)
            .subject("connection_id", id)
    };
    let recorded = |id| event(wor_core::audit::AuditCategory::ToolConnectionEnable, id);
    // Another project's connection is not found, and nothing is staged for it.
    let elsewhere = db
        .store
        .enable_tool_connection(
            b.project.id,
            created.id,
            &pins,
            &classes,
            recorded(created.id),
        )
        .await;
    assert!(
        matches!(elsewhere, Err(StoreError::NotFound)),
        "{elsewhere:?}"
    );
    assert_eq!(staged(a.project.id).await.unwrap(), 0);
    let (enabled, entry) = db
        .store
        .enable_tool_connection(
            a.project.id,
            created.id,
            &pins,
            &classes,
            recorded(created.id),
        )
        .await
        .unwrap();
    assert_eq!(entry.event(), &recorded(created.id));
    assert_eq!(
        staged(a.project.id).await.unwrap(),
        1,
        "staged with the change"
    );
    assert_eq!(enabled.status, ToolConnectionStatus::Enabled);
    assert_eq!(enabled.pinned_tools, pins);
    assert_eq!(enabled.class_of("echo"), ToolClass::ReadOnly);
    assert_eq!(enabled.class_of("other"), ToolClass::Consequential);
    let quarantine = |id| event(wor_core::audit::AuditCategory::ToolConnectionQuarantine, id);
    let elsewhere = db
        .store
        .quarantine_tool_connection(
            b.project.id,
            created.id,
            &BTreeMap::new(),
            quarantine(created.id),
        )
        .await;
    assert!(
        matches!(elsewhere, Err(StoreError::NotFound)),
        "{elsewhere:?}"
    );
    assert_eq!(
        staged(a.project.id).await.unwrap(),
        1,
        "nothing staged for a refusal"
    );
    let (quarantined, entry) = db
        .store
        .quarantine_tool_connection(
            a.project.id,
            created.id,
            &BTreeMap::new(),
            quarantine(created.id),
        )
        .await
        .unwrap();
    assert_eq!(entry.event(), &quarantine(created.id));
    assert_eq!(
        staged(a.project.id).await.unwrap(),
        2,
        "staged with the change"
    );
    assert_eq!(quarantined.status, ToolConnectionStatus::Quarantined);
    assert_eq!(
        quarantined.pinned_tools, pins,
        "a quarantine keeps the pins"
    );
    assert_eq!(quarantined.live_tools, Some(BTreeMap::new()));
    // Disabled once, with its entry; disabled again, nothing changes and nothing is staged.
    let disable = |id| {
        wor_core::audit::AuditEvent::new(
            a.project.id,
            wor_core::audit::AuditCategory::ToolConnectionDisable,
            wor_core::audit::Actor::Operator,
        )
        .subject("connection_id", id)
    };
    let (first, entry) = db
        .store
        .disable_tool_connection_staged(a.project.id, created.id, disable(created.id))
        .await
        .unwrap();
    assert_eq!(first.status, ToolConnectionStatus::Disabled);
    assert!(entry.is_some());
    assert_eq!(staged(a.project.id).await.unwrap(), 3);
    let (again, entry) = db
        .store
        .disable_tool_connection_staged(a.project.id, created.id, disable(created.id))
        .await
        .unwrap();
    assert_eq!(again.status, ToolConnectionStatus::Disabled);
    assert!(entry.is_none());
    assert_eq!(staged(a.project.id).await.unwrap(), 3);
}

#[tokio::test]
async fn an_ended_nested_run_always_releases_its_parked_parent() {
    use wor_core::run::{Provenance, RunStatus};
    use wor_store::{NewRun, ParentLink};
    // Claims pick any queued run of the database: this test needs one of its own.
    let db = TestDatabase::isolated().await.unwrap();
    let project = new_project(&db).await;
    let routine = replay_routine(&db.store, project, "r").await;
    let new = |parent: Option<ParentLink>, key: &str| NewRun {
        routine_id: routine,
        routine_version: 1,
        trigger_kind: wor_core::call::TriggerKind::Api,
        started_by: None,
        started_by_member: None,
        max_concurrent: 100,
        status: RunStatus::Queued,
        outcome: None,
        trigger_key: Some(key.to_owned()),
        input_provenance: Provenance::Requester,
        thread: None,
        memory: None,
        parent,
        skip_at: None,
    };
    let input = InputStep::requested(serde_json::json!("x"));
    let store = &db.store;
    let parent = store
        .create_run(project, new(None, "p"), input.clone())
        .await
        .unwrap();
    let parent = store
        .claim_run_by_id(project, parent.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    let link = || ParentLink {
        root: parent.id,
        parent: parent.id,
        depth: 1,
        budget_cap: serde_json::json!({"turns": 1}),
    };
    // A child cancelled while queued ends without being driven: the parent goes on.
    let child = store
        .create_run(project, new(Some(link()), "c1"), input.clone())
        .await
        .unwrap();
    assert_eq!(child.depth, 1);
    assert_eq!(child.budget_cap.as_ref().unwrap()["turns"], 1);
    assert_eq!(
        store
            .park_for_nested(project, parent.id, child.id, "w", None)
            .await
            .unwrap(),
        wor_store::NestedPark::Parked
    );
    let asked = store
        .request_cancel(project, child.id, "canceller", 60_000)
        .await
        .unwrap();
    assert_eq!(asked.to_end.len(), 1);
    // Taken from the queue for its canceller, who ends it: a worker's end, parent released.
    assert!(
        store
            .finish_run(
                project,
                child.id,
                "canceller",
                RunStatus::Cancelled,
                wor_store::CANCELLED_WHILE_QUEUED
            )
            .await
            .unwrap()
    );
    assert_eq!(
        store.get_run(project, parent.id).await.unwrap().status,
        RunStatus::Queued
    );
    // A child that finishes releases it in the same transaction.
    let parent = store
        .claim_run_by_id(project, parent.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    let child = store
        .create_run(project, new(Some(link()), "c2"), input.clone())
        .await
        .unwrap();
    assert_eq!(
        store
            .park_for_nested(project, parent.id, child.id, "w", None)
            .await
            .unwrap(),
        wor_store::NestedPark::Parked
    );
    let claimed = store
        .claim_run_by_id(project, child.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    // Time passes between the claim and the end: the end is stamped when it is written.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let before_end = wor_store::now_millis();
    assert!(
        store
            .finish_run(project, child.id, "w", RunStatus::Succeeded, "done")
            .await
            .unwrap()
    );
    let ended = store.get_run(project, child.id).await.unwrap();
    assert!(
        ended.finished_at.unwrap() >= before_end,
        "finished at {:?}, claimed at {:?}",
        ended.finished_at,
        claimed.started_at
    );
    assert_eq!(
        store.get_run(project, parent.id).await.unwrap().status,
        RunStatus::Queued
    );

    // Resumed, the parent records its ended child's usage, and the child's wall time counts
    // as its own: off its parked time and off its credential's expiry.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let parent = store
        .claim_run_by_id(project, parent.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    // Its child has ended: nothing is parked.
    assert_eq!(
        store
            .park_for_nested(project, parent.id, child.id, "w", None)
            .await
            .unwrap(),
        wor_store::NestedPark::ChildEnded
    );
    assert_eq!(
        store.get_run(project, parent.id).await.unwrap().status,
        RunStatus::Running
    );
    assert!(parent.parked_ms >= 30, "{}", parent.parked_ms);
    let deadline = wor_store::now_millis() + 100_000;
    let token = store
        .mint_run_token(project, parent.id, "w", deadline)
        .await
        .unwrap()
        .unwrap();
    let usage = wor_core::budget::BudgetUsage {
        turns: 3,
        ..Default::default()
    };
    store
        .record_nested_end(parent.id, "w", &usage, 10)
        .await
        .unwrap();
    let resumed = store.get_run(project, parent.id).await.unwrap();
    assert_eq!(resumed.usage.turns, 3);
    assert_eq!(resumed.parked_ms, parent.parked_ms - 10);
    let grant = store
        .authenticate_run_token(token.expose())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(grant.expires_at, deadline - 10);
    // Another worker records nothing: not the usage, not the parked time, not the deadline.
    let more = wor_core::budget::BudgetUsage {
        turns: 7,
        ..Default::default()
    };
    store
        .record_nested_end(parent.id, "x", &more, 5)
        .await
        .unwrap();
    let unchanged = store.get_run(project, parent.id).await.unwrap();
    assert_eq!(unchanged.usage.turns, 3);
    assert_eq!(unchanged.parked_ms, resumed.parked_ms);
    let grant = store
        .authenticate_run_token(token.expose())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(grant.expires_at, deadline - 10);
    // More than it was parked: its parked time goes to zero, never below.
    store
        .record_nested_end(parent.id, "w", &usage, 1_000_000)
        .await
        .unwrap();
    assert_eq!(
        store.get_run(project, parent.id).await.unwrap().parked_ms,
        0
    );
    assert_eq!(
        store
            .authenticate_run_token(token.expose())
            .await
            .unwrap()
            .map(|g| g.expires_at),
        None,
        "the deadline passed: 1,000 s came off it"
    );

    // Cancelling a run cancels its nested runs, however deep.
    let child = store
        .create_run(project, new(Some(link()), "c3"), input.clone())
        .await
        .unwrap();
    let grandchild_link = ParentLink {
        root: parent.id,
        parent: child.id,
        depth: 2,
        budget_cap: serde_json::json!({"turns": 1}),
    };
    // Another worker parks nothing.
    assert_eq!(
        store
            .park_for_nested(project, parent.id, child.id, "x", None)
            .await
            .unwrap(),
        wor_store::NestedPark::NotHeld
    );
    // The child runs; its own child waits in the queue.
    store
        .claim_run_by_id(project, child.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    let grandchild = store
        .create_run(project, new(Some(grandchild_link), "c4"), input.clone())
        .await
        .unwrap();
    let asked = store
        .request_cancel(project, parent.id, "canceller", 60_000)
        .await
        .unwrap();
    let to_end: Vec<_> = asked.to_end.iter().map(|run| run.id).collect();
    assert_eq!(
        to_end,
        [grandchild.id],
        "the queued one, for its canceller to end"
    );
    let child = store.get_run(project, child.id).await.unwrap();
    assert!(child.cancel_requested, "{child:?}");
    let grandchild = store.get_run(project, grandchild.id).await.unwrap();
    assert_eq!(
        (grandchild.status, grandchild.cancel_requested),
        (RunStatus::Running, true),
        "taken from the queue, flagged, for its canceller to end"
    );
    let end = async |holder: &str| {
        store
            .finish_run(
                project,
                grandchild.id,
                holder,
                RunStatus::Cancelled,
                wor_store::CANCELLED_WHILE_QUEUED,
            )
            .await
            .unwrap()
    };
    assert!(!end("w").await, "only its canceller holds it");
    assert!(end("canceller").await);
}

/// A parent parking for its nested run while that run's end is being written is never left
/// parked with the nested run over: the park waits for the end, or the end queues the parent.
#[tokio::test]
async fn a_parent_parking_as_its_nested_run_ends_is_never_left_parked() {
    use wor_core::run::{Provenance, RunStatus};
    use wor_store::{NestedPark, NewRun, ParentLink};
    let db = TestDatabase::isolated().await.unwrap();
    let project = new_project(&db).await;
    let routine = replay_routine(&db.store, project, "r").await;
    let store = db.store.clone();
    for round in 0..20 {
        let new = |parent: Option<ParentLink>, key: String| NewRun {
            routine_id: routine,
            routine_version: 1,
            trigger_kind: wor_core::call::TriggerKind::Api,
            started_by: None,
            started_by_member: None,
            max_concurrent: 100,
            status: RunStatus::Queued,
            outcome: None,
            trigger_key: Some(key),
            input_provenance: Provenance::Requester,
            thread: None,
            memory: None,
            parent,
            skip_at: None,
        };
        let input = InputStep::requested(serde_json::json!("x"));
        let parent = store
            .create_run(project, new(None, format!("p{round}")), input.clone())
            .await
            .unwrap();
        store
            .claim_run_by_id(project, parent.id, "w", 60_000)
            .await
            .unwrap()
            .unwrap();
        let link = ParentLink {
            root: parent.id,
            parent: parent.id,
            depth: 1,
            budget_cap: serde_json::json!({"turns": 1}),
        };
        let child = store
            .create_run(project, new(Some(link), format!("c{round}")), input)
            .await
            .unwrap();
        store
            .claim_run_by_id(project, child.id, "v", 60_000)
            .await
            .unwrap()
            .unwrap();
        let (ended, parked) = tokio::join!(
            store.finish_run(project, child.id, "v", RunStatus::Succeeded, "done"),
            store.park_for_nested(project, parent.id, child.id, "w", None),
        );
        assert!(ended.unwrap());
        let parked = parked.unwrap();
        let parent = store.get_run(project, parent.id).await.unwrap();
        match parked {
            // Parked first: the end queued it again.
            NestedPark::Parked => assert_eq!(parent.status, RunStatus::Queued, "round {round}"),
            // The end first: the parent goes on.
            NestedPark::ChildEnded => {
                assert_eq!(parent.status, RunStatus::Running, "round {round}");
            }
            NestedPark::NotHeld => panic!("round {round}: the parent was held"),
        }
    }
}

/// Many workers claiming the queue at once never run more of a routine than its
/// `max_concurrent`, nor more of a project than the per-project limit (on both backends).
#[tokio::test]
async fn concurrent_claims_keep_the_routine_and_project_limits() {
    use wor_core::run::RunStatus;
    use wor_store::RunFilter;
    let db = TestDatabase::isolated().await.unwrap();
    let project = new_project(&db).await;
    let store = db.store.clone();
    let mut routines = Vec::new();
    for name in ["narrow", "wide"] {
        routines.push(replay_routine(&store, project, name).await);
    }
    let queue = |routine, max_concurrent, count| {
        let store = store.clone();
        async move {
            for _ in 0..count {
                let new = queued_run(routine, 1, None, max_concurrent);
                store
                    .create_run(project, new, InputStep::requested(serde_json::json!("x")))
                    .await
                    .unwrap();
            }
        }
    };
    // `narrow` runs at most 2 at once; the project at most 5.
    queue(routines[0], 2, 10).await;
    queue(routines[1], 100, 10).await;
    let mut workers = Vec::new();
    for w in 0..12 {
        let store = store.clone();
        workers.push(tokio::spawn(async move {
            let worker = format!("worker-{w}");
            let mut claimed = 0;
            // Half the workers claim one run at a time, half several in one write.
            loop {
                let got = if w % 2 == 0 {
                    usize::from(store.claim_run(&worker, 60_000, 5).await.unwrap().is_some())
                } else {
                    store
                        .claim_runs(terms(&worker, 5), 3)
                        .await
                        .unwrap()
                        .runs
                        .len()
                };
                if got == 0 {
                    break;
                }
                claimed += got;
            }
            claimed
        }));
    }
    let mut total = 0;
    for worker in workers {
        total += worker.await.unwrap();
    }
    let running = |routine: Option<wor_core::RoutineId>| {
        let store = store.clone();
        async move {
            store
                .list_runs(
                    project,
                    &RunFilter {
                        routine_id: routine,
                        status: Some(RunStatus::Running),
                        limit: 200,
                        ..Default::default()
                    },
                )
                .await
                .unwrap()
                .len()
        }
    };
    assert_eq!(
        total, 5,
        "the project limit bounds what all workers claimed"
    );
    assert_eq!(running(None).await, 5);
    assert!(
        running(Some(routines[0])).await <= 2,
        "narrow ran more than 2"
    );
}

/// One claim of several takes the oldest runs the limits allow, oldest first, passing over
/// the runs they turn away; the claims it has made count against the limits as it goes on,
/// and its runs may belong to several projects.
#[tokio::test]
async fn a_claim_of_several_runs_keeps_the_limits_among_its_own_claims() {
    use wor_core::run::RunStatus;
    let db = TestDatabase::isolated().await.unwrap();
    let store = db.store.clone();
    let mut queued = Vec::new();
    for (project_runs, names) in [(4, ["narrow", "wide"]), (3, ["other", "unused"])] {
        let project = new_project(&db).await;
        let mut routines = Vec::new();
        for name in names {
            routines.push(replay_routine(&store, project, name).await);
        }
        // The first routine of the first project runs at most 2 at once.
        let limits = [if queued.is_empty() { 2 } else { 100 }, 100];
        for (routine, max_concurrent) in routines.iter().zip(limits) {
            for _ in 0..project_runs {
                let new = queued_run(*routine, 1, None, max_concurrent);
                let run = store
                    .create_run(project, new, InputStep::requested(serde_json::json!("x")))
                    .await
                    .unwrap();
                queued.push(run);
            }
        }
    }
    // Queued, oldest first: narrow ×4, wide ×4 (project one); other ×3, unused ×3 (two).
    // At most 5 running per project: narrow 0 and 1, wide 0, 1 and 2; then other 0, 1, 2.
    let expected: Vec<_> = [0, 1, 4, 5, 6, 8, 9, 10]
        .iter()
        .map(|&i| queued[i].id)
        .collect();
    let claimed = store.claim_runs(terms("batch", 5), 8).await.unwrap().runs;
    let ids: Vec<_> = claimed.iter().map(|run| run.id).collect();
    assert_eq!(ids, expected, "the oldest runs the limits allow, in order");
    for run in &claimed {
        assert_eq!(run.status, RunStatus::Running);
        assert!(run.started_at.is_some());
        assert!(
            store.renew_lease(run.id, "batch", 60_000).await.unwrap(),
            "leased to the claimer"
        );
    }
    // The second project has two places left (5 − 3 running); the first has none.
    let rest = store.claim_runs(terms("batch", 5), 8).await.unwrap().runs;
    assert_eq!(
        rest.iter().map(|run| run.id).collect::<Vec<_>>(),
        vec![queued[11].id, queued[12].id]
    );
    assert!(
        store
            .claim_runs(terms("batch", 5), 8)
            .await
            .unwrap()
            .runs
            .is_empty()
    );
    assert!(
        store
            .claim_runs(terms("batch", 100), 0)
            .await
            .unwrap()
            .runs
            .is_empty(),
        "a claim of no runs claims none"
    );
}

/// A claimed run whose stored row does not read as a run is returned apart, for its claimer
/// to end, and the runs behind it are claimed in the same write: one damaged row does not
/// hold up the queue.
#[tokio::test]
async fn a_claimed_run_that_does_not_read_back_is_returned_apart() {
    let db = TestDatabase::isolated().await.unwrap();
    let store = db.store.clone();
    let project = new_project(&db).await;
    let routine = replay_routine(&store, project, "r").await;
    let input = || InputStep::requested(serde_json::json!("x"));
    let damaged = store
        .create_run(project, queued_run(routine, 1, None, 100), input())
        .await
        .unwrap();
    let sound = store
        .create_run(project, queued_run(routine, 1, None, 100), input())
        .await
        .unwrap();
    // A trigger kind no release ever wrote: the row no longer reads as a run.
    let damage = async |run: wor_core::RunId| {
        db.tamper(&[format!(
            "UPDATE runs SET trigger_kind = 'carrier_pigeon' WHERE id = '{run}'"
        )])
        .await
        .unwrap();
    };
    damage(damaged.id).await;
    let claimed = store.claim_runs(terms("pool", 5), 2).await.unwrap();
    assert_eq!(
        claimed.runs.iter().map(|run| run.id).collect::<Vec<_>>(),
        vec![sound.id]
    );
    assert_eq!(claimed.unreadable.len(), 1, "{:?}", claimed.unreadable);
    let unreadable = &claimed.unreadable[0];
    assert_eq!((unreadable.project, unreadable.id), (project, damaged.id));
    assert!(
        unreadable.reason.contains("trigger_kind"),
        "{}",
        unreadable.reason
    );
    // Both are leased to the claimer; nothing is left to claim.
    assert!(store.renew_lease(damaged.id, "pool", 60_000).await.unwrap());
    let again = store.claim_runs(terms("pool", 5), 2).await.unwrap();
    assert!(again.runs.is_empty() && again.unreadable.is_empty());
    // The one-run claim says what it could not read.
    let third = store
        .create_run(project, queued_run(routine, 1, None, 100), input())
        .await
        .unwrap();
    damage(third.id).await;
    assert!(matches!(
        store.claim_run("pool", 60_000, 5).await,
        Err(StoreError::Corrupt(_))
    ));
}

/// A run created with a claim is claimed in the write that creates it only when no run of
/// its project queued before it is due and the limits allow it; otherwise it is queued.
#[tokio::test]
async fn a_run_is_claimed_as_it_is_created_only_when_nothing_older_waits() {
    use wor_core::run::RunStatus;
    let db = TestDatabase::isolated().await.unwrap();
    let store = db.store.clone();
    let project = new_project(&db).await;
    let routine = replay_routine(&store, project, "r").await;
    let input = || InputStep::requested(serde_json::json!("x"));
    let new = || queued_run(routine, 1, None, 100);
    let first = store.create_run(project, new(), input()).await.unwrap();
    let second = store
        .create_and_claim_run(project, new(), input(), terms("here", 3))
        .await
        .unwrap();
    assert_eq!(
        second.status,
        RunStatus::Queued,
        "behind an older queued run"
    );
    let claimed = store.claim_runs(terms("pool", 3), 2).await.unwrap().runs;
    assert_eq!(
        claimed.iter().map(|run| run.id).collect::<Vec<_>>(),
        vec![first.id, second.id]
    );
    let third = store
        .create_and_claim_run(project, new(), input(), terms("here", 3))
        .await
        .unwrap();
    assert_eq!(third.status, RunStatus::Running, "nothing older waits");
    assert_eq!(third.started_at, Some(third.created_at));
    assert!(store.renew_lease(third.id, "here", 60_000).await.unwrap());
    let fourth = store
        .create_and_claim_run(project, new(), input(), terms("here", 3))
        .await
        .unwrap();
    assert_eq!(
        fourth.status,
        RunStatus::Queued,
        "the project's limit is reached"
    );
}

/// A routine `name` of `project` on a one-turn replay model, applied as its first version.
async fn replay_routine(
    store: &wor_store::Store,
    project: wor_core::ProjectId,
    name: &str,
) -> wor_core::RoutineId {
    let toml = format!(
        "name = \"{name}\"\ninstructions = \"x\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\nscript = {{ turns = [{{ text = \"hi\" }}] }}\n"
    );
    let definition = wor_core::routine::RoutineDefinition::from_toml(&toml).unwrap();
    store
        .apply_routine(project, &toml, &definition, None)
        .await
        .unwrap()
        .routine
        .id
}

/// The terms of a claim for `worker`: a minute's lease, `max_per_project` running at once.
fn terms(worker: &str, max_per_project: u64) -> wor_store::ClaimTerms<'_> {
    wor_store::ClaimTerms {
        worker,
        lease_ms: 60_000,
        max_per_project,
    }
}

/// A personal `owner` key for `member`, as an owner would create one.
async fn owner_key(
    db: &TestDatabase,
    project: wor_core::ProjectId,
    member: wor_core::MemberId,
) -> wor_core::ApiKeyId {
    let (record, _) = db
        .store
        .create_api_key(
            project,
            NewApiKey {
                name: TestDatabase::unique_name("owner-key"),
                role: Role::Owner,
                kind: ApiKeyKind::Personal(member),
                created_by: None,
            },
        )
        .await
        .unwrap();
    record.id
}

/// A key revoked, a role changed and a model connection's key replaced or the connection revoked
/// stage their entry with the change, and only when something changed: revoking a revoked key,
/// giving a member the role they have, or replacing a revoked connection's key stages nothing.
#[tokio::test]
async fn revocations_role_changes_and_model_keys_stage_an_entry_only_when_they_change_something() {
    use wor_core::audit::{Actor, AuditCategory, AuditEvent};
    let db = TestDatabase::new().await.unwrap();
    let p = created_project(&db.store, "staged").await;
    let project = p.project.id;
    let staged = || wor_store::testing::staged_count(&db.store, project);
    let (service, _) = service_key(&db.store, project, Role::Viewer).await;
    let revoked = |key: &wor_store::ApiKeyRecord| {
        AuditEvent::new(project, AuditCategory::KeyRevoke, Actor::Operator)
            .subject("key_id", key.id)
    };
    let (key, entry) = db
        .store
        .revoke_api_key_staged(project, service.id, Some(&revoked))
        .await
        .unwrap();
    assert!(key.revoked_at.is_some());
    assert_eq!(entry.map(|e| e.event().clone()), Some(revoked(&key)));
    assert_eq!(staged().await.unwrap(), 1);
    let (_, again) = db
        .store
        .revoke_api_key_staged(project, service.id, Some(&revoked))
        .await
        .unwrap();
    assert!(again.is_none(), "a revoked key is not revoked again");
    assert_eq!(staged().await.unwrap(), 1);

    let member = db
        .store
        .create_member(project, &TestDatabase::unique_name("m"), Role::Viewer)
        .await
        .unwrap();
    let owner = wor_store::RoleChanger {
        role: Role::Owner,
        member: Some(p.owner.id),
    };
    let changed = |change: &wor_store::RoleChange| {
        AuditEvent::new(project, AuditCategory::MemberRoleChange, Actor::Operator)
            .subject("member_id", change.member.id)
    };
    for (role, stages) in [(Role::Approver, 2), (Role::Approver, 2), (Role::Viewer, 3)] {
        let (change, entry) = db
            .store
            .change_member_role_staged(project, member.id, role, owner, Some(&changed))
            .await
            .unwrap();
        assert_eq!(change.member.role, role);
        assert_eq!(entry.is_some(), change.changed(), "{role:?}");
        assert_eq!(staged().await.unwrap(), stages, "{role:?}");
    }

    // A model connection's key replaced, then the connection revoked: an entry each; a key
    // replaced on a revoked connection is refused and stages nothing.
    let model = db
        .store
        .create_model_connection(
            project,
            wor_store::NewModelConnection {
                name: "m".to_owned(),
                provider: wor_core::model::ProviderKind::OpenaiCompatible,
                base_url: "https://models.example.com/v1".to_owned(),
                owner_member_id: None,
                created_by: None,
            },
        )
        .await
        .unwrap();
    let set_key = |version: i64| {
        AuditEvent::new(
            project,
            AuditCategory::ModelConnectionSetKey,
            Actor::Operator,
        )
        .payload(serde_json::json!({ "credential_version": version }))
    };
    // The key is written in the transaction that raises the version and stages the entry.
    let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
    let vault = wor_store::Vault::new(db.store.clone(), std::sync::Arc::new(keys));
    let slot = wor_store::SecretSlot::new(project, "model_connections", model.id, "api_key");
    let key = |value: &str| vault.seal_put(&slot, value).unwrap();
    let (bumped, entry) = db
        .store
        .bump_model_credential_version(project, model.id, &key("key-two"), &set_key)
        .await
        .unwrap();
    assert_eq!(entry.event(), &set_key(bumped.credential_version));
    assert_eq!(bumped.credential_version, model.credential_version + 1);
    let held = || async {
        secrecy::ExposeSecret::expose_secret(&vault.open(&slot).await.unwrap()).to_owned()
    };
    assert_eq!(held().await, "key-two");
    // A key sealed for another connection's slot is refused, and nothing changes.
    let elsewhere =
        wor_store::SecretSlot::new(project, "model_connections", "con_other", "api_key");
    let misplaced = db
        .store
        .bump_model_credential_version(
            project,
            model.id,
            &vault.seal_put(&elsewhere, "key-x").unwrap(),
            &set_key,
        )
        .await;
    assert!(
        matches!(misplaced, Err(StoreError::MisplacedSecret { .. })),
        "{misplaced:?}"
    );
    assert_eq!(
        db.store
            .get_model_connection(project, model.id)
            .await
            .unwrap()
            .credential_version,
        bumped.credential_version
    );
    let revoked = AuditEvent::new(
        project,
        AuditCategory::ModelConnectionRevoke,
        Actor::Operator,
    );
    let (_, entry) = db
        .store
        .revoke_model_connection(project, model.id, revoked.clone())
        .await
        .unwrap();
    assert!(entry.is_some());
    assert_eq!(staged().await.unwrap(), 5);
    // Revoked again: nothing changes, so nothing is staged.
    let (again, entry) = db
        .store
        .revoke_model_connection(project, model.id, revoked)
        .await
        .unwrap();
    assert!(entry.is_none());
    assert!(matches!(again.status, wor_store::ConnectionStatus::Revoked));
    assert_eq!(staged().await.unwrap(), 5);
    let refused = db
        .store
        .bump_model_credential_version(project, model.id, &key("key-three"), &set_key)
        .await;
    assert!(
        matches!(refused, Err(StoreError::Conflict(_))),
        "{refused:?}"
    );
    assert_eq!(
        staged().await.unwrap(),
        5,
        "a refused change stages nothing"
    );
    assert_eq!(held().await, "key-two", "nor writes the key it was given");
}

#[tokio::test]
async fn the_last_owner_key_cannot_be_revoked() {
    let db = TestDatabase::new().await.unwrap();
    let p = created_project(&db.store, "p").await;
    let project = p.project.id;
    let first = db.store.list_api_keys(project).await.unwrap()[0].id;
    // A service key with role owner is no person: it does not keep the project manageable.
    let (service, _) = service_key(&db.store, project, Role::Owner).await;

    let err = db.store.revoke_api_key(project, first).await.unwrap_err();
    assert!(
        matches!(err, StoreError::LastOwnerKey { key_id } if key_id == first),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("wor project recover-owner"),
        "{err}"
    );
    assert!(
        db.store
            .get_api_key(project, first)
            .await
            .unwrap()
            .revoked_at
            .is_none()
    );
    assert!(
        db.store
            .authenticate_api_key(p.owner_key.expose())
            .await
            .unwrap()
            .is_some()
    );

    // With a second owner key, the first can go; then the second is the last.
    let second = owner_key(&db, project, p.owner.id).await;
    assert!(
        db.store
            .revoke_api_key(project, first)
            .await
            .unwrap()
            .revoked_at
            .is_some()
    );
    assert!(matches!(
        db.store.revoke_api_key(project, second).await,
        Err(StoreError::LastOwnerKey { .. })
    ));
    // Keys that are not owner keys revoke as before.
    assert!(
        db.store
            .revoke_api_key(project, service.id)
            .await
            .unwrap()
            .revoked_at
            .is_some()
    );
}

#[tokio::test]
async fn two_concurrent_revocations_cannot_both_remove_the_last_owner() {
    let db = TestDatabase::new().await.unwrap();
    for _ in 0..5 {
        let p = created_project(&db.store, "p").await;
        let project = p.project.id;
        let first = db.store.list_api_keys(project).await.unwrap()[0].id;
        let second = owner_key(&db, project, p.owner.id).await;
        let (a, b) = tokio::join!(
            tokio::spawn({
                let store = db.store.clone();
                async move { store.revoke_api_key(project, first).await }
            }),
            tokio::spawn({
                let store = db.store.clone();
                async move { store.revoke_api_key(project, second).await }
            }),
        );
        let outcomes = [a.unwrap(), b.unwrap()];
        let revoked = outcomes.iter().filter(|o| o.is_ok()).count();
        let refused = outcomes
            .iter()
            .filter(|o| matches!(o, Err(StoreError::LastOwnerKey { .. })))
            .count();
        assert_eq!((revoked, refused), (1, 1), "{outcomes:?}");
        let live = db
            .store
            .list_api_keys(project)
            .await
            .unwrap()
            .into_iter()
            .filter(|k| k.revoked_at.is_none())
            .count();
        assert_eq!(live, 1);
    }
}

#[tokio::test]
async fn two_owners_demoting_themselves_at_once_leave_one_owner() {
    let db = TestDatabase::new().await.unwrap();
    for _ in 0..5 {
        let p = created_project(&db.store, "p").await;
        let project = p.project.id;
        let bob = db
            .store
            .create_member(project, "bob", Role::Owner)
            .await
            .unwrap();
        owner_key(&db, project, bob.id).await;
        let demote = |member: wor_core::MemberId| {
            let store = db.store.clone();
            tokio::spawn(async move {
                store
                    .change_member_role(
                        project,
                        member,
                        Role::Admin,
                        wor_store::RoleChanger {
                            role: Role::Owner,
                            member: Some(member),
                        },
                    )
                    .await
            })
        };
        let (a, b) = tokio::join!(demote(p.owner.id), demote(bob.id));
        let outcomes = [a.unwrap(), b.unwrap()];
        let demoted = outcomes.iter().filter(|o| o.is_ok()).count();
        let refused = outcomes
            .iter()
            .filter(|o| matches!(o, Err(StoreError::LastOwner { .. })))
            .count();
        assert_eq!((demoted, refused), (1, 1), "{outcomes:?}");
        let owners = db
            .store
            .list_members(project)
            .await
            .unwrap()
            .into_iter()
            .filter(|m| m.role == Role::Owner)
            .count();
        assert_eq!(owners, 1);
    }
}

/// Sets when `project`'s console sessions were last seen, as a use at `at` would have.
async fn sessions_last_seen_at(store: &Store, project: ProjectId, at: i64) {
    sqlx::query("UPDATE console_sessions SET last_seen_at = $1 WHERE project_id = $2")
        .bind(at)
        .bind(project.to_string())
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_session_in_steady_use_is_written_down_once_its_idle_clock_is_a_tenth_of_the_limit_old() {
    let db = TestDatabase::new().await.unwrap();
    let p = created_project(&db.store, "p").await;
    let (project, member) = (p.project.id, p.owner.id);
    // An idle limit of 20 s: a use is written down once the recorded one is 2 s old.
    let idle_ms = 20_000;
    let session = db
        .store
        .create_console_session(project, member, 60_000, &Default::default())
        .await
        .unwrap();
    let recorded_at = async |at: i64| sessions_last_seen_at(&db.store, project, at).await;
    let last_seen = async || {
        let sessions = db
            .store
            .list_console_sessions(project, Some(member), idle_ms)
            .await
            .unwrap();
        assert_eq!(sessions.len(), 1, "{sessions:?}");
        sessions[0].last_seen_at
    };
    let use_it = async || {
        assert!(
            db.store
                .console_session(session.expose(), idle_ms)
                .await
                .unwrap()
                .is_some(),
            "the session is live"
        );
    };

    // Last recorded a second ago: a use writes nothing.
    let a_second_ago = wor_store::now_millis() - 1_000;
    recorded_at(a_second_ago).await;
    use_it().await;
    assert_eq!(last_seen().await, a_second_ago);

    // Last recorded 19 s ago, a second before it would idle out: a use is written down, and
    // the session has its whole idle limit again.
    recorded_at(wor_store::now_millis() - 19_000).await;
    let before = wor_store::now_millis();
    use_it().await;
    let refreshed = last_seen().await;
    assert!(refreshed >= before, "{refreshed} against {before}");

    // And the next use at once is not written.
    use_it().await;
    assert_eq!(last_seen().await, refreshed);

    // Past the idle limit, the session is gone.
    recorded_at(wor_store::now_millis() - 20_001).await;
    assert!(
        db.store
            .console_session(session.expose(), idle_ms)
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_live_session_is_answered_when_its_refresh_cannot_get_the_turn_to_write() {
    let db = TestDatabase::new().await.unwrap();
    let p = created_project(&db.store, "p").await;
    let project = p.project.id;
    let idle_ms = 600_000;
    let session = db
        .store
        .create_console_session(project, p.owner.id, 3_600_000, &Default::default())
        .await
        .unwrap();
    // Last recorded two minutes ago: the next use refreshes it.
    let two_minutes_ago = wor_store::now_millis() - 120_000;
    sessions_last_seen_at(&db.store, project, two_minutes_ago).await;
    let last_seen = async || {
        db.store
            .list_console_sessions(project, Some(p.owner.id), idle_ms)
            .await
            .unwrap()[0]
            .last_seen_at
    };
    let held = wor_store::testing::hold_write_turn(&db.store)
        .await
        .unwrap();
    let used = db
        .store
        .console_session(session.expose(), idle_ms)
        .await
        .expect("a live session is answered, refreshed or not");
    assert!(used.is_some(), "the session is live");
    if held.is_some() {
        // SQLite: the refresh waited for the turn as long as any write does, then gave way.
        assert_eq!(last_seen().await, two_minutes_ago);
        drop(held);
        assert!(
            db.store
                .console_session(session.expose(), idle_ms)
                .await
                .unwrap()
                .is_some()
        );
    }
    // With the turn free (PostgreSQL has none to hold), the use is written down.
    assert!(last_seen().await > two_minutes_ago);
}

#[tokio::test]
async fn a_live_key_authenticates_when_its_last_use_cannot_get_the_turn_to_write() {
    let db = TestDatabase::new().await.unwrap();
    let p = created_project(&db.store, "p").await;
    let project = p.project.id;
    let last_used = async || db.store.list_api_keys(project).await.unwrap()[0].last_used_at;
    assert_eq!(last_used().await, None, "a new key was never used");
    let held = wor_store::testing::hold_write_turn(&db.store)
        .await
        .unwrap();
    let key = db
        .store
        .authenticate_api_key(p.owner_key.expose())
        .await
        .expect("a live key authenticates, its use written down or not");
    assert_eq!(key.map(|k| k.project_id), Some(project));
    if held.is_some() {
        // SQLite: the write of its use waited for the turn as long as any write does, then
        // gave way.
        assert_eq!(last_used().await, None);
        drop(held);
        assert!(
            db.store
                .authenticate_api_key(p.owner_key.expose())
                .await
                .unwrap()
                .is_some()
        );
    }
    assert!(
        last_used().await.is_some(),
        "a use with the turn free is written down"
    );
}

#[tokio::test]
async fn a_demoted_members_keys_act_with_their_new_role_and_a_changer_is_read_as_they_are_now() {
    let db = TestDatabase::new().await.unwrap();
    let p = created_project(&db.store, "p").await;
    let project = p.project.id;
    let adam = db
        .store
        .create_member(project, "adam", Role::Admin)
        .await
        .unwrap();
    let (_, adam_key) = db
        .store
        .create_api_key(
            project,
            NewApiKey {
                name: "adam".into(),
                role: Role::Admin,
                kind: ApiKeyKind::Personal(adam.id),
                created_by: None,
            },
        )
        .await
        .unwrap();
    let acting = |key: &str| {
        let store = db.store.clone();
        let key = key.to_owned();
        async move {
            store
                .authenticate_api_key(&key)
                .await
                .unwrap()
                .unwrap()
                .role
        }
    };
    assert_eq!(acting(adam_key.expose()).await, Role::Admin);
    let owner = wor_store::RoleChanger {
        role: Role::Owner,
        member: Some(p.owner.id),
    };
    let change = db
        .store
        .change_member_role(project, adam.id, Role::Viewer, owner)
        .await
        .unwrap();
    assert!(change.changed() && change.previous == Role::Admin);
    assert_eq!(acting(adam_key.expose()).await, Role::Viewer);
    // Promoted again, the key acts with the role it was made with, never above it.
    db.store
        .change_member_role(project, adam.id, Role::Owner, owner)
        .await
        .unwrap();
    assert_eq!(acting(adam_key.expose()).await, Role::Admin);
    // A changer authenticated as admin but demoted since is refused as the viewer they are.
    db.store
        .change_member_role(project, adam.id, Role::Viewer, owner)
        .await
        .unwrap();
    let stale = wor_store::RoleChanger {
        role: Role::Admin,
        member: Some(adam.id),
    };
    let err = db
        .store
        .change_member_role(project, p.owner.id, Role::Viewer, stale)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::RoleChange(wor_core::RoleChangeRefusal::CannotConfigure {
                caller: Role::Viewer
            })
        ),
        "{err:?}"
    );
    // Another project's member is not found.
    let q = db
        .store
        .create_project(&TestDatabase::unique_name("q"), "olga")
        .await
        .unwrap();
    assert!(matches!(
        db.store
            .change_member_role(project, q.owner.id, Role::Viewer, owner)
            .await,
        Err(StoreError::NotFound)
    ));
}

#[tokio::test]
async fn recovering_an_owner_makes_a_working_owner_key() {
    let db = TestDatabase::new().await.unwrap();
    let p = created_project(&db.store, "p").await;
    let project = p.project.id;
    assert_eq!(
        db.store.find_project(&p.project.name).await.unwrap().id,
        project
    );

    // Each recovery stages what it says it made, from what it made.
    let entries = |recovered: &wor_store::RecoveredOwner| {
        let key = wor_core::audit::AuditEvent::new(
            project,
            wor_core::audit::AuditCategory::KeyCreate,
            wor_core::audit::Actor::Operator,
        )
        .subject("key_id", recovered.key.id);
        if recovered.owner_created {
            vec![key.clone().subject("member_id", recovered.owner.id), key]
        } else {
            vec![key]
        }
    };
    let staged = || wor_store::testing::staged_count(&db.store, project);
    // An existing owner gets a new key.
    let (again, entries_made) = db
        .store
        .recover_owner(project, "alice", &entries)
        .await
        .unwrap();
    assert_eq!(
        entries_made
            .iter()
            .map(|e| e.event().clone())
            .collect::<Vec<_>>(),
        entries(&again)
    );
    assert_eq!(staged().await.unwrap(), 1);
    assert!(!again.owner_created);
    assert_eq!(again.owner.id, p.owner.id);
    let auth = db
        .store
        .authenticate_api_key(again.plaintext.expose())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (auth.project_id, auth.member_id, auth.role),
        (project, Some(p.owner.id), Role::Owner)
    );

    // An unknown name becomes a new owner member.
    let (fresh, _) = db
        .store
        .recover_owner(project, "rescuer", &entries)
        .await
        .unwrap();
    assert_eq!(staged().await.unwrap(), 3, "a new owner and their key");
    assert!(fresh.owner_created);
    assert_eq!(fresh.owner.role, Role::Owner);
    assert_eq!(
        db.store
            .get_member(project, fresh.owner.id)
            .await
            .unwrap()
            .name,
        "rescuer"
    );
    assert_eq!(fresh.key.member_id, Some(fresh.owner.id));

    // Recovery promotes no one.
    let viewer = db
        .store
        .create_member(project, "vera", Role::Viewer)
        .await
        .unwrap();
    let err = db
        .store
        .recover_owner(project, "vera", &entries)
        .await
        .unwrap_err();
    assert_eq!(staged().await.unwrap(), 3, "nothing staged for a refusal");
    assert!(
        matches!(err, StoreError::Conflict(ref m) if m.contains("`vera`")),
        "{err:?}"
    );
    assert_eq!(
        db.store.get_member(project, viewer.id).await.unwrap().role,
        Role::Viewer
    );
    assert!(matches!(
        db.store
            .recover_owner(wor_core::ProjectId::new(), "x", &entries)
            .await,
        Err(StoreError::NotFound)
    ));
}

/// What the API and the workers do at once — apply routines, start runs, claim them, append
/// steps, park for approvals, decide them, use them, finish — from many tasks on one
/// database: every operation succeeds. On SQLite a write transaction that began deferred and
/// read first used to fail at once with "database is locked" (codes 5 and 517) instead of
/// waiting for the write lock (this test failed so, with codes 5 and 517).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_writers_all_succeed() {
    use wor_core::run::{Provenance, RunStatus};
    use wor_store::{ApprovalAnswer, ApprovalDecision, ApprovedCall, ApprovedStart};
    let db = TestDatabase::isolated().await.unwrap();
    let created = created_project(&db.store, "busy").await;
    let project = created.project.id;
    let key = db.store.list_api_keys(project).await.unwrap()[0].id;
    let mut tasks = Vec::new();
    for task in 0..12 {
        let store = db.store.clone();
        tasks.push(tokio::spawn(async move {
            let worker = format!("worker-{task}");
            for round in 0..6 {
                // A new version of the task's routine each round: read, then write.
                let toml = format!(
                    "name = \"r{task}\"\ninstructions = \"round {round}\"\n[model]\nprovider = \"replay\"\n\
                     model = \"m\"\nscript = {{ turns = [{{ text = \"hi\" }}] }}\n"
                );
                let definition = wor_core::routine::RoutineDefinition::from_toml(&toml).unwrap();
                let applied = store
                    .apply_routine(project, &toml, &definition, Some(key))
                    .await
                    .unwrap();
                let new = queued_run(applied.routine.id, applied.version, Some(key), 100);
                let run = store
                    .create_run(project, new, InputStep::requested(serde_json::json!("x")))
                    .await
                    .unwrap();
                store
                    .claim_run_by_id(project, run.id, &worker, 60_000)
                    .await
                    .unwrap()
                    .expect("a queued run of this task is claimed");
                for _ in 0..3 {
                    store
                        .append_run_step(
                            project,
                            run.id,
                            Provenance::Model,
                            &model_turn(format!("round {round}")),
                        )
                        .await
                        .unwrap();
                }
                let approval = held_mail_approval(run.id, &format!("binding-{task}-{round}"));
                let (approval_id, filed) = store
                    .park_for_approval(project, &worker, &approval)
                    .await
                    .unwrap()
                    .expect("the worker holds its run");
                assert!(filed);
                let decision = ApprovalDecision {
                    verdict: ApprovalAnswer::Approve,
                    key_id: Some(key),
                    member_id: None,
                    reason: "ok".to_owned(),
                };
                store
                    .decide_approval(project, approval_id, &decision)
                    .await
                    .unwrap();
                store
                    .claim_run_by_id(project, run.id, &worker, 60_000)
                    .await
                    .unwrap()
                    .expect("the approved run is queued again");
                let usage = wor_core::budget::BudgetUsage {
                    tool_calls: round + 1,
                    ..Default::default()
                };
                let started = store
                    .start_approved_call(
                        project,
                        run.id,
                        &worker,
                        &ApprovedCall {
                            approval: approval_id,
                            binding_hash: &approval.binding_hash,
                            step: &Step::ApprovalUsed(ApprovalUsedStep {
                                call_id: "call_1".to_owned(),
                                approval_id,
                                tool: "mail/send".to_owned(),
                            }),
                            usage: &usage,
                            claim: None,
                        },
                    )
                    .await
                    .unwrap();
                assert_eq!(started, ApprovedStart::Started);
                store
                    .append_run_step(
                        project,
                        run.id,
                        Provenance::Untrusted,
                        &Step::ToolResult(ToolResultStep {
                            tool: "mail/send".to_owned(),
                            result: ToolResult {
                                tool_call_id: "call_1".to_owned(),
                                content: "sent".to_owned(),
                                is_error: false,
                            },
                            nul_replaced: false,
                        }),
                    )
                    .await
                    .unwrap();
                assert!(
                    store
                        .finish_run(project, run.id, &worker, RunStatus::Succeeded, "done")
                        .await
                        .unwrap()
                );
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let finished = db
        .store
        .list_runs(
            project,
            &wor_store::RunFilter {
                status: Some(RunStatus::Succeeded),
                limit: 200,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(finished.len(), 12 * 6);
}

/// Using an approval and recording its call as started are one transaction: a failure in
/// between (injected here by a trigger that refuses the `approval_used` step) leaves the
/// approval unused, so the resumed run can still run the approved call.
#[tokio::test]
async fn an_approval_is_never_used_without_its_call_recorded_as_started() {
    use wor_core::budget::BudgetUsage;
    use wor_store::{ApprovalAnswer, ApprovalDecision, ApprovedCall, ApprovedStart, Backend};
    let db = TestDatabase::isolated().await.unwrap();
    let created = created_project(&db.store, "atomic").await;
    let project = created.project.id;
    let key = db.store.list_api_keys(project).await.unwrap()[0].id;
    let store = &db.store;
    let routine = replay_routine(store, project, "r").await;
    let new = queued_run(routine, 1, Some(key), 1);
    let run = store
        .create_run(project, new, InputStep::requested(serde_json::json!("x")))
        .await
        .unwrap();
    store
        .claim_run_by_id(project, run.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    let staged = || wor_store::testing::staged_count(store, project);
    let requested = |id: wor_core::ApprovalId| {
        wor_core::audit::AuditEvent::new(
            project,
            wor_core::audit::AuditCategory::ApprovalRequest,
            wor_core::audit::Actor::Run { run_id: run.id },
        )
        .subject("approval_id", id)
    };
    let parked = wor_core::audit::AuditEvent::new(
        project,
        wor_core::audit::AuditCategory::ToolCall,
        wor_core::audit::Actor::Run { run_id: run.id },
    );
    let request = held_mail_approval(run.id, "binding");
    let not_held = store
        .park_for_approval_staged(
            project,
            "another",
            None,
            &request,
            &requested,
            Some(parked.clone()),
        )
        .await
        .unwrap();
    assert!(
        not_held.is_none(),
        "a worker that does not hold the run parks nothing"
    );
    assert_eq!(staged().await.unwrap(), 0);
    let (approval, created, entries) = store
        .park_for_approval_staged(
            project,
            "w",
            None,
            &request,
            &requested,
            Some(parked.clone()),
        )
        .await
        .unwrap()
        .unwrap();
    assert!(created);
    assert_eq!(
        entries
            .iter()
            .map(|e| e.event().clone())
            .collect::<Vec<_>>(),
        vec![requested(approval), parked],
        "the request's entry, then the one given for the park"
    );
    assert_eq!(
        staged().await.unwrap(),
        2,
        "the entries are staged with the park"
    );
    let decision = ApprovalDecision {
        verdict: ApprovalAnswer::Approve,
        key_id: Some(key),
        member_id: None,
        reason: "ok".to_owned(),
    };
    store
        .decide_approval(project, approval, &decision)
        .await
        .unwrap();
    store
        .claim_run_by_id(project, run.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    let usage = BudgetUsage {
        tool_calls: 1,
        ..BudgetUsage::default()
    };
    let step = Step::ApprovalUsed(ApprovalUsedStep {
        call_id: "call_1".to_owned(),
        approval_id: approval,
        tool: "mail/send".to_owned(),
    });
    let call = ApprovedCall {
        approval,
        binding_hash: "binding",
        step: &step,
        usage: &usage,
        claim: None,
    };
    let (inject, remove) = match store.backend() {
        Backend::Sqlite => (
            "CREATE TRIGGER refuse_start BEFORE INSERT ON run_steps WHEN NEW.kind = 'approval_used' \
             BEGIN SELECT RAISE(ABORT, 'injected failure'); END;",
            "DROP TRIGGER refuse_start;",
        ),
        Backend::Postgres => (
            "CREATE FUNCTION refuse_start() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$; \
             CREATE TRIGGER refuse_start BEFORE INSERT ON run_steps FOR EACH ROW \
             WHEN (NEW.kind = 'approval_used') EXECUTE FUNCTION refuse_start();",
            "DROP TRIGGER refuse_start ON run_steps; DROP FUNCTION refuse_start();",
        ),
    };
    let used = wor_core::audit::AuditEvent::new(
        project,
        wor_core::audit::AuditCategory::ApprovalUse,
        wor_core::audit::Actor::Run { run_id: run.id },
    )
    .subject("approval_id", approval);
    sqlx::raw_sql(inject).execute(store.pool()).await.unwrap();
    let failed = store
        .start_approved_call_staged(project, run.id, "w", &call, Some(used.clone()))
        .await
        .unwrap_err();
    assert!(failed.to_string().contains("injected failure"), "{failed}");
    assert_eq!(
        staged().await.unwrap(),
        2,
        "no entry for a call that did not start"
    );
    let approval_now = store.get_approval(project, approval).await.unwrap();
    assert_eq!(approval_now.used_at, None, "the approval is not spent");
    let steps = store.list_run_steps(project, run.id, 0).await.unwrap();
    assert!(
        steps
            .iter()
            .all(|s| s.step.kind() != StepKind::ApprovalUsed)
    );
    assert_eq!(
        store
            .get_run(project, run.id)
            .await
            .unwrap()
            .usage
            .tool_calls,
        0
    );

    sqlx::raw_sql(remove).execute(store.pool()).await.unwrap();
    // A cancel asked since the worker last looked: the call does not start.
    let cancel = |flag: i64| {
        sqlx::query("UPDATE runs SET cancel_requested = $1 WHERE id = $2")
            .bind(flag)
            .bind(run.id.to_string())
    };
    cancel(1).execute(store.pool()).await.unwrap();
    let (cancelled, entry) = store
        .start_approved_call_staged(project, run.id, "w", &call, Some(used.clone()))
        .await
        .unwrap();
    assert_eq!(cancelled, ApprovedStart::CancelRequested);
    assert!(entry.is_none());
    assert_eq!(staged().await.unwrap(), 2);
    assert_eq!(
        store.get_approval(project, approval).await.unwrap().used_at,
        None
    );
    cancel(0).execute(store.pool()).await.unwrap();
    let (started, entry) = store
        .start_approved_call_staged(project, run.id, "w", &call, Some(used.clone()))
        .await
        .unwrap();
    assert_eq!(started, ApprovedStart::Started);
    assert_eq!(entry.map(|e| e.event().clone()), Some(used.clone()));
    assert_eq!(
        staged().await.unwrap(),
        3,
        "the use's entry is staged with it"
    );
    assert!(
        store
            .get_approval(project, approval)
            .await
            .unwrap()
            .used_at
            .is_some()
    );
    let steps = store.list_run_steps(project, run.id, 0).await.unwrap();
    assert_eq!(
        steps
            .iter()
            .filter(|s| s.step.kind() == StepKind::ApprovalUsed)
            .count(),
        1
    );
    assert_eq!(
        store
            .get_run(project, run.id)
            .await
            .unwrap()
            .usage
            .tool_calls,
        1
    );
    // Used once, never again, and nothing staged for the refusal.
    let (again, entry) = store
        .start_approved_call_staged(project, run.id, "w", &call, Some(used))
        .await
        .unwrap();
    assert_eq!(again, ApprovedStart::NotUsable);
    assert!(entry.is_none());
    assert_eq!(staged().await.unwrap(), 3);
}

#[tokio::test]
async fn model_connections_keep_every_connection_provider_and_refuse_replay() {
    use wor_core::model::ProviderKind;
    use wor_store::NewModelConnection;

    let db = TestDatabase::new().await.unwrap();
    let created = created_project(&db.store, "p").await;
    let project = created.project.id;
    let new = |name: &str, provider| NewModelConnection {
        name: name.to_owned(),
        provider,
        base_url: "https://models.example.com/v1".to_owned(),
        owner_member_id: None,
        created_by: None,
    };
    for kind in ProviderKind::ALL
        .into_iter()
        .filter(|k| k.needs_connection())
    {
        let record = db
            .store
            .create_model_connection(project, new(kind.as_str(), kind))
            .await
            .unwrap();
        let read = db
            .store
            .get_model_connection(project, record.id)
            .await
            .unwrap();
        assert_eq!(read.provider, kind);
    }
    // The schema itself refuses a connection to the scripted model.
    let refused = db
        .store
        .create_model_connection(project, new("scripted", ProviderKind::Replay))
        .await;
    assert!(refused.is_err(), "{refused:?}");
}

mod oauth_authorizations {
    use super::created_project;
    use serde_json::json;
    use wor_store::testing::TestDatabase;
    use wor_store::{ConnectionOAuthRecord, NewOAuthAuthorization, state_digest};

    /// A pending authorization is taken once, only by its `state`, only before it expires,
    /// and the state itself is not stored.
    #[tokio::test]
    async fn a_pending_authorization_is_taken_once_by_its_state_before_it_expires() {
        let db = TestDatabase::new().await.unwrap();
        let created = created_project(&db.store, "oauth").await;
        let project = created.project.id;
        let key = db
            .store
            .authenticate_api_key(created.owner_key.expose())
            .await
            .unwrap()
            .unwrap();
        let connection = db
            .store
            .create_tool_connection(project, super::support::mcp_connection("tracker"))
            .await
            .unwrap();
        let new = |lifetime_ms| NewOAuthAuthorization {
            connection_id: connection.id,
            member_id: created.owner.id,
            api_key_id: Some(key.key_id),
            client_id: "client-1".to_owned(),
            redirect_uri: "http://127.0.0.1:8080/hooks/oauth/callback".to_owned(),
            discovery: json!({"resource": "https://mcp.example.com/mcp"}),
            scope: Some("files:read".to_owned()),
            lifetime_ms,
        };
        // States are unique per run: the shared test database keeps earlier runs' rows.
        let state = TestDatabase::unique_name("state-canary");
        let state = state.as_str();
        let expired = TestDatabase::unique_name("expired-state");
        let expired = expired.as_str();
        let pending = db
            .store
            .create_oauth_authorization(project, state, new(600_000))
            .await
            .unwrap();
        assert_eq!(pending.state_digest, state_digest(state));
        assert_ne!(pending.state_digest, state);

        let owner = created.owner.id;
        assert_eq!(
            db.store
                .take_oauth_authorization("another", owner)
                .await
                .unwrap(),
            None
        );
        // Only the member who started it takes it; anyone else leaves it pending.
        assert_eq!(
            db.store
                .take_oauth_authorization(state, wor_core::MemberId::new())
                .await
                .unwrap(),
            None
        );
        assert_eq!(
            db.store.pending_oauth_authorization(state).await.unwrap(),
            Some(pending.clone())
        );
        let taken = db
            .store
            .take_oauth_authorization(state, owner)
            .await
            .unwrap()
            .expect("the first take finds it");
        assert_eq!(taken, pending);
        assert_eq!(
            db.store
                .take_oauth_authorization(state, owner)
                .await
                .unwrap(),
            None,
            "a state is used once"
        );
        assert_eq!(
            db.store.pending_oauth_authorization(state).await.unwrap(),
            None
        );

        db.store
            .create_oauth_authorization(project, expired, new(-1))
            .await
            .unwrap();
        assert_eq!(
            db.store
                .take_oauth_authorization(expired, owner)
                .await
                .unwrap(),
            None,
            "an expired authorization cannot be finished"
        );
        assert_eq!(
            db.store.pending_oauth_authorization(expired).await.unwrap(),
            None
        );
        // The taken and the expired one can be purged; a live one cannot.
        let live = TestDatabase::unique_name("live-state");
        let live = db
            .store
            .create_oauth_authorization(project, &live, new(600_000))
            .await
            .unwrap();
        let lapsed = db
            .store
            .lapsed_oauth_authorizations(project, wor_store::now_millis() + 1, 100)
            .await
            .unwrap();
        assert!(lapsed.contains(&state_digest(state)), "{lapsed:?}");
        assert!(lapsed.contains(&state_digest(expired)), "{lapsed:?}");
        assert!(!lapsed.contains(&live.state_digest), "{lapsed:?}");
        for digest in &lapsed {
            db.store
                .delete_oauth_authorization(project, digest)
                .await
                .unwrap();
        }
        assert_eq!(
            db.store
                .lapsed_oauth_authorizations(project, wor_store::now_millis() + 1, 100)
                .await
                .unwrap(),
            Vec::<String>::new()
        );

        assert_eq!(
            db.store
                .get_connection_oauth(project, connection.id)
                .await
                .unwrap(),
            None
        );
        let settled = ConnectionOAuthRecord {
            connection_id: connection.id,
            project_id: project,
            client_id: "client-1".to_owned(),
            discovery: json!({"resource": "https://mcp.example.com/mcp"}),
            access_expires_at: Some(1_000),
            authorized_by: created.owner.id,
            authorized_key_id: Some(key.key_id),
            authorized_at: 500,
            refreshed_at: None,
            scope: Some("files:read".to_owned()),
        };
        let staged = || wor_store::testing::staged_count(&db.store, project);
        let before = staged().await.unwrap();
        let event = |category| {
            wor_core::audit::AuditEvent::new(project, category, wor_core::audit::Actor::Operator)
                .subject("connection_id", connection.id)
        };
        let authorized = event(wor_core::audit::AuditCategory::ToolConnectionAuthorize);
        let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
        let vault = wor_store::Vault::new(db.store.clone(), std::sync::Arc::new(keys));
        let slot =
            wor_store::SecretSlot::new(project, "tool_connections", connection.id, "access_token");
        let token = |value: &str| vault.seal_put(&slot, value).unwrap();
        let held = || async {
            secrecy::ExposeSecret::expose_secret(&vault.open(&slot).await.unwrap()).to_owned()
        };
        let entry = db
            .store
            .put_connection_oauth_staged(&settled, &[token("access-1")], Some(authorized.clone()))
            .await
            .unwrap();
        assert_eq!(held().await, "access-1", "the tokens are written with it");
        assert_eq!(entry.map(|e| e.event().clone()), Some(authorized));
        assert_eq!(staged().await.unwrap(), before + 1);
        // Authorizing again replaces the record.
        db.store.put_connection_oauth(&settled).await.unwrap();
        assert_eq!(
            staged().await.unwrap(),
            before + 1,
            "nothing staged unasked"
        );
        let elsewhere = db
            .store
            .record_connection_oauth_refresh(wor_core::ProjectId::new(), connection.id, Some(2_000))
            .await;
        assert!(
            matches!(elsewhere, Err(wor_store::StoreError::NotFound)),
            "{elsewhere:?}"
        );
        db.store
            .record_connection_oauth_refresh(project, connection.id, Some(2_000))
            .await
            .unwrap();
        let after = db
            .store
            .get_connection_oauth(project, connection.id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(after.access_expires_at, Some(2_000));
        assert!(after.refreshed_at.is_some());
        assert_eq!(after.scope.as_deref(), Some("files:read"));
        // A server that asks for more scope widens what the next authorization asks for.
        db.store
            .set_connection_oauth_scope(project, connection.id, "files:read files:write")
            .await
            .unwrap();
        let widened = db
            .store
            .get_connection_oauth(project, connection.id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(widened.scope.as_deref(), Some("files:read files:write"));
        assert_eq!(
            widened.access_expires_at,
            Some(2_000),
            "nothing else changes"
        );
        let other = db
            .store
            .create_project(&TestDatabase::unique_name("oauth"), "bob")
            .await
            .unwrap();
        assert_eq!(
            db.store
                .get_connection_oauth(other.project.id, connection.id)
                .await
                .unwrap(),
            None,
            "another project does not see it"
        );
        assert!(
            matches!(
                db.store
                    .set_connection_oauth_scope(other.project.id, connection.id, "x")
                    .await,
                Err(wor_store::StoreError::NotFound)
            ),
            "nor widens it"
        );
    }
}

/// What a scheduler page reads together: the versions named, and the active runs of each
/// routine, each confined to the project it was asked for.
#[tokio::test]
async fn versions_and_active_counts_are_read_together_within_their_projects() {
    let db = TestDatabase::isolated().await.unwrap();
    let store = &db.store;
    let mut projects = Vec::new();
    for name in ["pages-a", "pages-b"] {
        projects.push(
            store
                .create_project(&TestDatabase::unique_name(name), "alice")
                .await
                .unwrap()
                .project
                .id,
        );
    }
    let source = |text: &str| {
        format!(
            "name = \"r\"\ninstructions = \"{text}\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\nscript = {{ turns = [{{ text = \"hi\" }}] }}\n"
        )
    };
    let mut routines = Vec::new();
    for (n, project) in projects.iter().enumerate() {
        for text in ["one", "two"] {
            let toml = source(&format!("{text} {n}"));
            let definition = wor_core::routine::RoutineDefinition::from_toml(&toml).unwrap();
            let applied = store
                .apply_routine(*project, &toml, &definition, None)
                .await
                .unwrap();
            routines.push((*project, applied.routine.id, applied.version));
        }
    }
    let (a, routine_a, _) = routines[0];
    let (b, routine_b, latest_b) = routines[3];
    // Versions 1 and 2 of each project's routine, a version that does not exist, and a
    // routine asked for under the other project.
    let wanted = [
        (a, routine_a, 1),
        (a, routine_a, 2),
        (b, routine_b, latest_b),
        (a, routine_a, 9),
        (a, routine_b, latest_b),
    ];
    let mut found: Vec<_> = store
        .get_routine_versions(&wanted)
        .await
        .unwrap()
        .into_iter()
        .map(|(project, version)| {
            assert_eq!(version.definition.name.as_str(), "r");
            (project, version.routine_id, version.version)
        })
        .collect();
    found.sort();
    let mut expected = vec![
        (a, routine_a, 1),
        (a, routine_a, 2),
        (b, routine_b, latest_b),
    ];
    expected.sort();
    assert_eq!(found, expected);

    for _ in 0..3 {
        store
            .create_run(
                a,
                queued_run(routine_a, 2, None, 10),
                InputStep::requested(serde_json::json!("x")),
            )
            .await
            .unwrap();
    }
    store
        .create_run(
            b,
            queued_run(routine_b, latest_b, None, 10),
            InputStep::requested(serde_json::json!("x")),
        )
        .await
        .unwrap();
    let counts = store
        .active_run_counts(&[(a, routine_a), (a, routine_b)])
        .await
        .unwrap();
    assert_eq!(counts.get(&routine_a), Some(&3));
    assert_eq!(
        counts.get(&routine_b),
        None,
        "another project's runs are not counted"
    );
    let counts = store.active_run_counts(&[(b, routine_b)]).await.unwrap();
    assert_eq!(counts.get(&routine_b), Some(&1));
}

#[tokio::test]
async fn an_enrolment_token_enrols_one_worker_even_when_raced_and_is_kept_as_a_digest() {
    let db = TestDatabase::isolated().await.unwrap();
    let token = db
        .store
        .create_worker_enrolment_token(60_000)
        .await
        .unwrap();
    assert!(!format!("{token:?}").contains(token.expose()));
    let attempts = (0..8).map(|i| {
        let store = db.store.clone();
        let token = token.expose().to_owned();
        tokio::spawn(async move {
            store
                .enroll_worker(
                    &token,
                    "w",
                    &format!("signing-{i}"),
                    &format!("exchange-{i}"),
                )
                .await
        })
    });
    let mut enrolled = 0;
    for attempt in attempts {
        match attempt.await.unwrap().unwrap() {
            Ok(_) => enrolled += 1,
            Err(refusal) => assert_eq!(refusal, wor_store::EnrolmentRefusal::AlreadyUsed),
        }
    }
    assert_eq!(enrolled, 1);
    assert_eq!(db.store.list_workers().await.unwrap().len(), 1);
    // The token is stored as its digest only.
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT id, sha256 FROM worker_enrolment_tokens")
            .fetch_all(db.store.pool())
            .await
            .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, token.id);
    assert_eq!(
        rows[0].1,
        wor_core::canonical::sha256_hex(token.expose().as_bytes())
    );
    assert_eq!(
        db.store
            .enroll_worker("wet_unknown", "w", "s", "e")
            .await
            .unwrap(),
        Err(wor_store::EnrolmentRefusal::Unknown)
    );
}

#[tokio::test]
async fn a_workers_request_is_taken_once_marks_the_worker_seen_and_a_replay_records_nothing() {
    use wor_store::WorkerRequestRefusal;
    let db = TestDatabase::isolated().await.unwrap();
    let token = db
        .store
        .create_worker_enrolment_token(60_000)
        .await
        .unwrap();
    let worker = db
        .store
        .enroll_worker(token.expose(), "w", "signing", "exchange")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(worker.last_seen_at, None);
    let keep_until = wor_store::now_millis() / 1000 + 600;
    let take = |nonce: &'static str, keep_until: i64| {
        let (store, id) = (db.store.clone(), worker.id.clone());
        async move {
            store
                .accept_worker_request(&id, nonce, keep_until)
                .await
                .unwrap()
        }
    };
    let nonces = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT nonce FROM worker_request_nonces WHERE worker_id = $1 ORDER BY nonce",
        )
        .bind(&worker.id)
        .fetch_all(db.store.pool())
        .await
        .unwrap()
    };
    let last_seen = || async {
        db.store
            .worker(&worker.id)
            .await
            .unwrap()
            .unwrap()
            .last_seen_at
    };
    let before = wor_store::now_millis();
    assert_eq!(take("nonce-1", keep_until).await, Ok(()));
    let after = wor_store::now_millis();
    let seen = last_seen().await.unwrap();
    assert!(before <= seen && seen <= after, "{before} {seen} {after}");
    // The same nonce again is a replay: refused, and the worker is not marked seen by it.
    sqlx::query("UPDATE workers SET last_seen_at = 1 WHERE id = $1")
        .bind(&worker.id)
        .execute(db.store.pool())
        .await
        .unwrap();
    assert_eq!(
        take("nonce-1", keep_until).await,
        Err(WorkerRequestRefusal::Replayed)
    );
    assert_eq!(last_seen().await, Some(1));
    // Another nonce is taken; one whose time is past is forgotten by the next request.
    assert_eq!(take("nonce-2", 0).await, Ok(()));
    assert_eq!(take("nonce-3", keep_until).await, Ok(()));
    assert_eq!(nonces().await, ["nonce-1", "nonce-3"]);
    // A worker revoked after its record was read is refused, and nothing of the request kept.
    db.store.revoke_worker(&worker.id).await.unwrap();
    let seen = last_seen().await;
    assert_eq!(
        take("nonce-4", keep_until).await,
        Err(WorkerRequestRefusal::NotActive)
    );
    assert_eq!(last_seen().await, seen);
    assert_eq!(nonces().await, ["nonce-1", "nonce-3"]);
}

/// On SQLite the audit writer's commits never checkpoint the write-ahead log themselves; the
/// checkpointer does it beside them, and once the log is past its limit the writer has it
/// reused from its start. Under writes that never pause, the log stays near that limit
/// (16 MiB) instead of growing with everything written (here 48 MiB).
#[tokio::test]
async fn the_write_ahead_log_is_reused_under_writes_that_never_pause() {
    use wor_core::run::Provenance;
    use wor_store::{AuditLog, RunWrite, RunWritten};

    let Some(db) = isolated_on(
        wor_store::Backend::Sqlite,
        "PostgreSQL keeps its own log: nothing of this test applies",
    )
    .await
    else {
        return;
    };
    let store = &db.store;
    let (project, routine) = project_with_routine(store, "wal", 8).await;
    let log = AuditLog::start(store.clone(), signing_key(9), audit_config(1_000));
    let database: String =
        sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    let wal = std::path::PathBuf::from(format!("{database}-wal"));
    // Four runs write 64 KiB turns back to back, 48 MiB in all.
    let mut writers = Vec::new();
    for n in 0..4 {
        let worker = format!("w{n}");
        let run = claimed_run(store, project, routine, &worker, 600_000).await;
        let log = log.clone();
        writers.push(tokio::spawn(async move {
            for _ in 0..192 {
                let turn = model_turn("x".repeat(64 * 1024));
                let written = log
                    .record(
                        RunWrite::new(project, run, &worker, 600_000)
                            .step(Provenance::Engine, turn),
                    )
                    .await
                    .unwrap();
                assert!(
                    matches!(written, RunWritten::Committed { .. }),
                    "{written:?}"
                );
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let length = std::fs::metadata(&wal).unwrap().len();
    assert!(
        length < 32 * 1024 * 1024,
        "the log grew to {} MiB",
        length / (1024 * 1024)
    );
}

/// On SQLite a run's write that finds the writer idle is committed on its caller's thread.
/// When another connection holds the database's write lock (here a transaction on a second
/// store, as another process would), the write waits for it without blocking that thread:
/// the runtime's other tasks go on, and the write commits once the lock is free. It used to
/// wait inside SQLite, holding the thread for `busy_timeout` (10 s) before its next try.
#[tokio::test(flavor = "current_thread")]
async fn a_write_waiting_for_the_database_lock_leaves_its_thread_to_other_tasks() {
    use wor_core::run::Provenance;
    use wor_store::{AuditLog, RunWrite, RunWritten};

    let Some(db) = isolated_on(
        wor_store::Backend::Sqlite,
        "PostgreSQL has no database-wide write lock: nothing of this test applies",
    )
    .await
    else {
        return;
    };
    let store = &db.store;
    let (project, routine) = project_with_routine(store, "lock", 1).await;
    let run = claimed_run(store, project, routine, "w", 600_000).await;
    let log = AuditLog::start(store.clone(), signing_key(10), audit_config(1_000));
    // A first write, so the writer has its own connection open and is idle again.
    let first = log
        .record(
            RunWrite::new(project, run, "w", 600_000).step(Provenance::Engine, model_turn("one")),
        )
        .await
        .unwrap();
    assert!(matches!(first, RunWritten::Committed { .. }), "{first:?}");

    let other = Store::connect(&db.url).await.unwrap();
    #[expect(
        clippy::disallowed_methods,
        reason = "another writer's transaction, holding SQLite's write lock"
    )]
    let holder = other.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let write = tokio::spawn({
        let log = log.clone();
        async move {
            log.record(
                RunWrite::new(project, run, "w", 600_000)
                    .step(Provenance::Engine, model_turn("two")),
            )
            .await
        }
    });
    // On this runtime's one thread: a write that held it would keep this short sleep from
    // ending until SQLite's own wait gave up.
    let asleep = std::time::Instant::now();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let slept = asleep.elapsed();
    assert!(
        slept < std::time::Duration::from_secs(5),
        "a 50 ms sleep beside the waiting write took {slept:?}"
    );
    assert!(!write.is_finished(), "the write went on without the lock");
    holder.rollback().await.unwrap();
    let second = write.await.unwrap().unwrap();
    assert!(matches!(second, RunWritten::Committed { .. }), "{second:?}");
    let turns: Vec<String> = store
        .list_run_steps(project, run, 0)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|s| match s.step {
            Step::ModelTurn(turn) => Some(turn.message.text),
            _ => None,
        })
        .collect();
    assert_eq!(turns, ["one", "two"]);
}

/// A run's journal write inserts its steps numbered after the run's last, its end's outcome
/// step after them, and a write that is refused (another worker's, or one to be made only
/// unless a cancel was requested) inserts none. On PostgreSQL the fence inserts a write's
/// steps in its own statement when there are no more than one statement takes; a write with
/// more inserts them all in statements of their own.
#[tokio::test]
async fn a_journal_write_numbers_its_steps_after_the_runs_last_and_a_refused_one_writes_none() {
    use wor_core::run::{Provenance, RunStatus};
    use wor_store::{AuditLog, RunWrite, RunWritten};

    let db = TestDatabase::isolated().await.unwrap();
    let store = &db.store;
    let (project, routine) = project_with_routine(store, "numbered", 1).await;
    let run = claimed_run(store, project, routine, "w", 600_000).await;
    let log = AuditLog::start(store.clone(), signing_key(11), audit_config(1_000));
    let write = || RunWrite::new(project, run, "w", 600_000);
    let steps = async || -> Vec<(i64, String)> {
        store
            .list_run_steps(project, run, 0)
            .await
            .unwrap()
            .into_iter()
            .map(|s| {
                let text = match s.step {
                    Step::ModelTurn(turn) => turn.message.text,
                    Step::Outcome(outcome) => format!("outcome {}", outcome.message),
                    other => other.kind().as_str().to_owned(),
                };
                (s.seq, text)
            })
            .collect()
    };
    let committed = |written: RunWritten| {
        assert!(
            matches!(written, RunWritten::Committed { .. }),
            "{written:?}"
        );
    };
    let before = steps().await;
    let last = before.last().map_or(0, |(seq, _)| *seq);

    committed(
        log.record(
            write()
                .step(Provenance::Engine, model_turn("a"))
                .step(Provenance::Engine, model_turn("b")),
        )
        .await
        .unwrap(),
    );
    committed(
        log.record(write().step(Provenance::Engine, model_turn("one")))
            .await
            .unwrap(),
    );
    // A write with no step inserts none and numbers nothing.
    committed(log.record(write()).await.unwrap());
    assert_eq!(
        log.record(
            RunWrite::new(project, run, "other", 600_000).step(Provenance::Engine, model_turn("x"))
        )
        .await
        .unwrap(),
        RunWritten::LeaseLost
    );
    // As many steps as the fence's statement inserts, and more.
    let most = wor_store::testing::STEPS_PER_WRITE_STATEMENT;
    let mut many = Vec::new();
    for (count, prefix) in [(most, "f"), (most * 2 + 7, "m")] {
        let texts: Vec<String> = (0..count).map(|n| format!("{prefix}{n}")).collect();
        let mut long = write();
        for text in &texts {
            long = long.step(Provenance::Engine, model_turn(text.as_str()));
        }
        committed(log.record(long).await.unwrap());
        many.extend(texts);
    }
    store
        .request_cancel(project, run, "canceller", 60_000)
        .await
        .unwrap();
    assert_eq!(
        log.record(
            write()
                .step(Provenance::Engine, model_turn("y"))
                .unless_cancelled()
        )
        .await
        .unwrap(),
        RunWritten::CancelRequested
    );
    committed(
        log.record(
            write()
                .step(Provenance::Engine, model_turn("c"))
                .end(RunStatus::Cancelled, "stopped"),
        )
        .await
        .unwrap(),
    );

    let after = steps().await;
    assert_eq!(after[..before.len()], before[..]);
    let added: Vec<(i64, String)> = after[before.len()..].to_vec();
    let expected: Vec<String> = ["a", "b", "one"]
        .into_iter()
        .map(str::to_owned)
        .chain(many)
        .chain(["c".to_owned(), "outcome stopped".to_owned()])
        .collect();
    assert_eq!(
        added,
        expected
            .into_iter()
            .zip(last + 1..)
            .map(|(text, seq)| (seq, text))
            .collect::<Vec<_>>()
    );
}

/// On PostgreSQL the audit writer takes the chain locks of a batch's projects with its
/// `BEGIN`, before it touches a run: while another process's writer holds a project's chain
/// lock, a run's write of that project waits for it without holding the run's row, which
/// another transaction may then lock at once.
#[tokio::test]
async fn a_journal_write_waits_for_its_chain_lock_before_it_touches_the_run() {
    use wor_core::run::Provenance;
    use wor_store::{AuditLog, RunWrite, RunWritten};

    let Some(db) = isolated_on(
        wor_store::Backend::Postgres,
        "SQLite's write lock is every chain's lock: nothing of this test applies",
    )
    .await
    else {
        return;
    };
    let store = &db.store;
    let (project, routine) = project_with_routine(store, "locked", 1).await;
    let run = claimed_run(store, project, routine, "w", 600_000).await;
    let log = AuditLog::start(store.clone(), signing_key(12), audit_config(1_000));
    let key = wor_store::testing::audit_chain_lock_key(project);

    let other = Store::connect(&db.url).await.unwrap();
    #[expect(
        clippy::disallowed_methods,
        reason = "another process's writer, holding the project's chain lock"
    )]
    let mut holder = other.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 AS locked FROM (SELECT pg_advisory_xact_lock($1)) AS l")
        .bind(key)
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let write = tokio::spawn({
        let log = log.clone();
        async move {
            log.record(
                RunWrite::new(project, run, "w", 600_000)
                    .step(Provenance::Engine, model_turn("waited"))
                    .audit(key_event(project, 1)),
            )
            .await
        }
    });
    // Until the writer's transaction waits for the lock.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND ((classid::bigint << 32) | objid::bigint) = $1",
        )
        .bind(key)
        .fetch_one(other.pool())
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the write never waited for the chain lock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    #[expect(
        clippy::disallowed_methods,
        reason = "a transaction that locks the run's row, and must not wait for it"
    )]
    let mut row = other.pool().begin().await.unwrap();
    let locked: Result<Option<String>, sqlx::Error> =
        sqlx::query_scalar("SELECT id FROM runs WHERE id = $1 FOR UPDATE NOWAIT")
            .bind(run.to_string())
            .fetch_optional(&mut *row)
            .await;
    assert_eq!(
        locked.expect("the run's row is free while its write waits for the chain lock"),
        Some(run.to_string())
    );
    row.rollback().await.unwrap();
    assert!(!write.is_finished(), "the write went on without the lock");
    holder.rollback().await.unwrap();
    let written = write.await.unwrap().unwrap();
    assert!(
        matches!(written, RunWritten::Committed { .. }),
        "{written:?}"
    );
    let steps = store.list_run_steps(project, run, 0).await.unwrap();
    let last = steps.last().map(|s| &s.step);
    assert!(
        matches!(last, Some(Step::ModelTurn(turn)) if turn.message.text == "waited"),
        "{last:?}"
    );
}

/// On PostgreSQL a sweep of the credentials of runs no worker drives skips one that another
/// transaction holds rather than waiting for it (a wait could deadlock with that
/// transaction); the next sweep ends it.
#[tokio::test]
async fn a_sweep_of_stale_credentials_skips_one_another_transaction_holds() {
    let Some(db) = isolated_on(
        wor_store::Backend::Postgres,
        "SQLite has no row locks: nothing of this test applies",
    )
    .await
    else {
        return;
    };
    let store = &db.store;
    let (project, routine) = project_with_routine(store, "sweep", 1).await;
    let run = claimed_run(store, project, routine, "w", 60_000).await;
    store
        .mint_run_token(project, run, "w", wor_store::now_millis() + 60_000)
        .await
        .unwrap()
        .unwrap();
    // The run is no longer driven, its credential not yet ended, and another transaction
    // holds it.
    wor_store::testing::tamper(
        store,
        &[format!(
            "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL \
             WHERE id = '{}'",
            run
        )],
    )
    .await
    .unwrap();
    #[expect(
        clippy::disallowed_methods,
        reason = "another writer's transaction, holding a row lock on PostgreSQL"
    )]
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query("SELECT run_id FROM run_tokens WHERE run_id = $1 FOR UPDATE")
        .bind(run.to_string())
        .fetch_all(&mut *holder)
        .await
        .unwrap();
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        store.requeue_expired_runs(),
    )
    .await
    .expect("the sweep waited for the held credential")
    .unwrap();
    assert!(store.run_token_exists(run).await.unwrap());
    holder.rollback().await.unwrap();
    store.requeue_expired_runs().await.unwrap();
    assert!(!store.run_token_exists(run).await.unwrap());
}

/// On SQLite, a write outside a transaction waits for the process's turn to write, in line
/// with its transactions and the audit writer's batches, rather than for the database's lock
/// in SQLite's busy handler: under a steady stream of transactions that handler's sleeps
/// missed the moments the lock was free, and such a write waited for seconds or failed as
/// "database is locked".
#[tokio::test]
async fn a_write_outside_a_transaction_waits_its_turn_with_the_process_writes() {
    use wor_store::ToolConnectionStatus;

    let db = TestDatabase::new().await.unwrap();
    let project = new_project(&db).await;
    // PostgreSQL has no such turn: its row locks order its writers.
    if db.store.backend() != wor_store::Backend::Sqlite {
        return;
    }
    let created = db
        .store
        .create_tool_connection(project, support::mcp_connection("desk"))
        .await
        .unwrap();
    let seen = support::held_up(
        &db.store,
        db.store
            .record_live_tools(project, created.id, &std::collections::BTreeMap::new()),
    )
    .await
    .unwrap();
    assert_eq!(seen.status, ToolConnectionStatus::PendingReview);
    assert_eq!(seen.live_tools, Some(std::collections::BTreeMap::new()));
    // The same for a statement that returns what it changed.
    let taken = support::held_up(
        &db.store,
        db.store
            .take_oauth_authorization("no-such-state", wor_core::MemberId::new()),
    )
    .await
    .unwrap();
    assert!(taken.is_none(), "there was no such authorization");
}

/// A cancel says how many runs it asked to stop and which it took from the queue, and asking
/// again asks none: a queued run is taken, flagged, for its canceller to end; a running one is
/// flagged once; a run flagged as it parked (the cancel landed between its held call and its
/// park) is queued for a worker by the next cancel, and a flagged queued run stays a worker's
/// to end, its approval pending until then.
#[tokio::test]
async fn a_cancel_counts_the_runs_it_asked_and_asking_again_asks_none() {
    use RunStatus::{Cancelled, Queued, Running};
    use wor_core::run::RunStatus;
    let db = TestDatabase::isolated().await.unwrap();
    let created = created_project(&db.store, "cancels").await;
    let project = created.project.id;
    let key = db.store.list_api_keys(project).await.unwrap()[0].id;
    let store = &db.store;
    let routine = replay_routine(store, project, "r").await;
    let create = async || {
        let new = queued_run(routine, 1, Some(key), 10);
        let input = InputStep::requested(serde_json::json!("x"));
        store.create_run(project, new, input).await.unwrap().id
    };
    // The run's status and flag after a cancel, how many runs the cancel asked, and how many
    // it took from the queue for its canceller to end.
    let cancel = async |id| {
        let asked = store
            .request_cancel(project, id, "canceller", 60_000)
            .await
            .unwrap();
        assert!(asked.to_end.iter().all(|run| run.id == id));
        (
            asked.run.status,
            asked.run.cancel_requested,
            asked.asked,
            asked.to_end.len(),
        )
    };

    let queued = create().await;
    assert_eq!(cancel(queued).await, (Running, true, 1, 1));
    assert_eq!(
        cancel(queued).await,
        (Running, true, 0, 0),
        "taken already, for its canceller to end"
    );
    assert!(
        store
            .finish_run(
                project,
                queued,
                "canceller",
                Cancelled,
                wor_store::CANCELLED_WHILE_QUEUED
            )
            .await
            .unwrap()
    );
    assert_eq!(
        cancel(queued).await,
        (Cancelled, true, 0, 0),
        "ended, nothing under it"
    );

    let running = create().await;
    store
        .claim_run_by_id(project, running, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cancel(running).await, (Running, true, 1, 0));
    assert_eq!(
        cancel(running).await,
        (Running, true, 0, 0),
        "flagged already"
    );

    // Flagged, it parks anyway (the driver saw no cancel when it recorded the held call).
    let (approval, _) = store
        .park_for_approval(project, "w", &held_mail_approval(running, "binding"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cancel(running).await, (Queued, true, 1, 0));
    // Queued and flagged, it is a worker's to end: asked again, it stays as it is.
    assert_eq!(cancel(running).await, (Queued, true, 0, 0));
    let pending = store.get_approval(project, approval).await.unwrap();
    assert_eq!(pending.status.as_str(), "pending");
}

/// A tool connection and a model connection are made with their sealed credentials and their
/// staged entry in one transaction: when the entry cannot be staged, or a credential was sealed
/// for another row, neither the connection nor any credential is written.
#[tokio::test]
async fn connections_are_made_with_their_credentials_and_entry_or_not_at_all() {
    use wor_core::ConnectionId;
    use wor_core::audit::{Actor, AuditCategory, AuditEvent};
    use wor_store::{NewModelConnection, SecretSlot};
    // Its own database: the injected refusal stops every staged write while it stands.
    let db = TestDatabase::isolated().await.unwrap();
    let project = created_project(&db.store, "connections").await.project.id;
    let store = &db.store;
    let staged = || wor_store::testing::staged_count(store, project);
    let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
    let vault = wor_store::Vault::new(store.clone(), std::sync::Arc::new(keys));
    let opened = |slot: SecretSlot| {
        let vault = vault.clone();
        async move {
            vault
                .open(&slot)
                .await
                .map(|s| secrecy::ExposeSecret::expose_secret(&s).to_owned())
        }
    };

    let tool_slot = |id: ConnectionId, field: &str| {
        SecretSlot::new(project, wor_store::TOOL_CONNECTIONS_TABLE, id, field)
    };
    let tool_entry = |record: &wor_store::ToolConnectionRecord| {
        AuditEvent::new(
            project,
            AuditCategory::ToolConnectionCreate,
            Actor::Operator,
        )
        .subject("connection_id", record.id)
    };
    let make_tool = |id: ConnectionId, name: &str, credentials: Vec<wor_store::SealedPut>| {
        let new = support::mcp_connection(name);
        async move {
            store
                .create_tool_connection_staged(project, id, new, &credentials, Some(&tool_entry))
                .await
        }
    };
    let sealed = |slot: SecretSlot, value: &str| vault.seal_put(&slot, value).unwrap();
    let key_slot = |id: ConnectionId| {
        SecretSlot::new(
            project,
            wor_store::MODEL_CONNECTIONS_TABLE,
            id,
            wor_store::API_KEY_FIELD,
        )
    };
    let model_entry = |record: &wor_store::ModelConnectionRecord| {
        AuditEvent::new(
            project,
            AuditCategory::ModelConnectionCreate,
            Actor::Operator,
        )
        .subject("connection_id", record.id)
    };
    let make_model = |id: ConnectionId, name: &str, key: wor_store::SealedPut| {
        let new = NewModelConnection {
            name: name.to_owned(),
            provider: wor_core::model::ProviderKind::OpenaiCompatible,
            base_url: "https://models.example.com/v1".to_owned(),
            owner_member_id: None,
            created_by: None,
        };
        async move {
            store
                .create_model_connection_staged(project, id, new, Some(&key), Some(&model_entry))
                .await
        }
    };

    // Refused staging: no connection, no credential.
    let refused_id = ConnectionId::new();
    let (inject, remove) = support::staging_refusal(store.backend());
    sqlx::raw_sql(inject).execute(store.pool()).await.unwrap();
    let refused = make_tool(
        refused_id,
        "refused",
        vec![sealed(tool_slot(refused_id, "bearer_token"), "tok-refused")],
    )
    .await;
    let refused_model = make_model(
        refused_id,
        "refused",
        sealed(key_slot(refused_id), "sk-refused"),
    )
    .await;
    sqlx::raw_sql(remove).execute(store.pool()).await.unwrap();
    assert!(refused.is_err(), "{refused:?}");
    assert!(refused_model.is_err(), "{refused_model:?}");
    assert!(matches!(
        store.get_tool_connection(project, refused_id).await,
        Err(StoreError::NotFound)
    ));
    assert!(matches!(
        store.get_model_connection(project, refused_id).await,
        Err(StoreError::NotFound)
    ));
    for slot in [tool_slot(refused_id, "bearer_token"), key_slot(refused_id)] {
        assert!(vault.metadata(&slot).await.unwrap().is_none(), "{slot}");
    }
    assert_eq!(staged().await.unwrap(), 0);

    // A credential sealed for another connection is refused before anything is written.
    let model_id = ConnectionId::new();
    let (model, entry) = make_model(model_id, "m", sealed(key_slot(model_id), "sk-1"))
        .await
        .unwrap();
    assert_eq!(model.id, model_id);
    assert_eq!(entry.map(|e| e.event().clone()), Some(model_entry(&model)));
    assert_eq!(opened(key_slot(model_id)).await.unwrap(), "sk-1");
    assert_eq!(staged().await.unwrap(), 1);
    let elsewhere = make_model(
        ConnectionId::new(),
        "elsewhere",
        sealed(key_slot(model_id), "sk-elsewhere"),
    )
    .await;
    assert!(
        matches!(elsewhere, Err(StoreError::MisplacedSecret { .. })),
        "{elsewhere:?}"
    );
    assert_eq!(
        opened(key_slot(model_id)).await.unwrap(),
        "sk-1",
        "another connection's key is left as it was"
    );
    let misplaced = make_tool(
        refused_id,
        "misplaced",
        vec![sealed(
            tool_slot(ConnectionId::new(), "bearer_token"),
            "tok-2",
        )],
    )
    .await;
    assert!(
        matches!(misplaced, Err(StoreError::MisplacedSecret { .. })),
        "{misplaced:?}"
    );
    assert!(matches!(
        store.get_tool_connection(project, refused_id).await,
        Err(StoreError::NotFound)
    ));
    assert_eq!(staged().await.unwrap(), 1);

    // Made: the connection, both credentials and the entry.
    let id = ConnectionId::new();
    let (record, entry) = make_tool(
        id,
        "desk",
        vec![
            sealed(tool_slot(id, "bearer_token"), "tok-1"),
            sealed(tool_slot(id, "header:x-api-key"), "key-1"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(record.id, id);
    assert_eq!(entry.map(|e| e.event().clone()), Some(tool_entry(&record)));
    assert_eq!(staged().await.unwrap(), 2);
    assert_eq!(
        opened(tool_slot(id, "bearer_token")).await.unwrap(),
        "tok-1"
    );
    assert_eq!(
        opened(tool_slot(id, "header:x-api-key")).await.unwrap(),
        "key-1"
    );

    // A taken name: nothing written, the first connection's credentials as they were.
    let second = ConnectionId::new();
    let taken = make_tool(
        second,
        "desk",
        vec![sealed(tool_slot(second, "bearer_token"), "tok-3")],
    )
    .await;
    assert!(matches!(taken, Err(StoreError::Conflict(_))), "{taken:?}");
    assert!(
        vault
            .metadata(&tool_slot(second, "bearer_token"))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        opened(tool_slot(id, "bearer_token")).await.unwrap(),
        "tok-1"
    );
    assert_eq!(staged().await.unwrap(), 2);
}

/// A routine's new version, a key, a member, an invitation and an approval's expiry each stage
/// their entry in the transaction that makes them; an apply that changes nothing and a member
/// refused for a taken name stage nothing.
#[tokio::test]
async fn creations_and_expiries_stage_their_entry_with_the_change() {
    use wor_core::audit::{Actor, AuditCategory, AuditEvent};
    // Its own database: an expiry sweep takes every project's due approvals.
    let db = TestDatabase::isolated().await.unwrap();
    let p = created_project(&db.store, "made").await;
    let project = p.project.id;
    let store = &db.store;
    let staged = || wor_store::testing::staged_count(store, project);

    let toml = "name = \"r\"\ninstructions = \"x\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\nscript = { turns = [{ text = \"hi\" }] }\n";
    let definition = wor_core::routine::RoutineDefinition::from_toml(toml).unwrap();
    let applied_entry = |applied: &wor_store::AppliedRoutine| {
        AuditEvent::new(project, AuditCategory::RoutineApply, Actor::Operator)
            .subject("routine_id", applied.routine.id)
            .payload(serde_json::json!({ "version": applied.version }))
    };
    for (round, changed, stages) in [(1, true, 1), (2, false, 1)] {
        let (applied, entry) = store
            .apply_routine_staged(project, toml, &definition, None, Some(&applied_entry))
            .await
            .unwrap();
        assert_eq!(applied.changed, changed, "apply {round}");
        assert_eq!(
            entry.map(|e| e.event().clone()),
            changed.then(|| applied_entry(&applied)),
            "apply {round}"
        );
        assert_eq!(staged().await.unwrap(), stages, "apply {round}");
    }

    let key_entry = |key: &wor_store::ApiKeyRecord| {
        AuditEvent::new(project, AuditCategory::KeyCreate, Actor::Operator)
            .subject("key_id", key.id)
    };
    let new_key = NewApiKey {
        name: "ci".into(),
        role: Role::Viewer,
        kind: ApiKeyKind::Service,
        created_by: None,
    };
    let (key, _, entry) = store
        .create_api_key_staged(project, new_key, Some(&key_entry))
        .await
        .unwrap();
    assert_eq!(entry.map(|e| e.event().clone()), Some(key_entry(&key)));
    assert_eq!(staged().await.unwrap(), 2);

    let member_entry = |member: &wor_store::MemberRecord| {
        AuditEvent::new(project, AuditCategory::MemberCreate, Actor::Operator)
            .subject("member_id", member.id)
    };
    let (member, entry) = store
        .create_member_staged(project, "bob", Role::Viewer, Some(&member_entry))
        .await
        .unwrap();
    assert_eq!(
        entry.map(|e| e.event().clone()),
        Some(member_entry(&member))
    );
    assert_eq!(staged().await.unwrap(), 3);
    let taken = store
        .create_member_staged(project, "bob", Role::Viewer, Some(&member_entry))
        .await;
    assert!(matches!(taken, Err(StoreError::Conflict(_))), "{taken:?}");
    assert_eq!(staged().await.unwrap(), 3, "nothing staged for a refusal");

    // The entry is written in the change's own transaction: when it cannot be written, the
    // change is not made either.
    let (inject, remove) = support::staging_refusal(store.backend());
    sqlx::raw_sql(inject).execute(store.pool()).await.unwrap();
    let refused = store
        .create_member_staged(project, "carol", Role::Viewer, Some(&member_entry))
        .await;
    sqlx::raw_sql(remove).execute(store.pool()).await.unwrap();
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("injected failure")),
        "{refused:?}"
    );
    let members = store.list_members(project).await.unwrap();
    assert!(
        members.iter().all(|m| m.name != "carol"),
        "no member without their entry"
    );
    assert_eq!(staged().await.unwrap(), 3);

    let invited = |expires_at: i64| {
        AuditEvent::new(project, AuditCategory::MemberInvite, Actor::Operator)
            .subject("member_id", member.id)
            .payload(serde_json::json!({ "expires_at": expires_at }))
    };
    let (_, expires_at, entry) = store
        .create_invitation_staged(project, member.id, None, 60_000, Some(&invited))
        .await
        .unwrap();
    assert_eq!(entry.map(|e| e.event().clone()), Some(invited(expires_at)));
    assert_eq!(staged().await.unwrap(), 4);

    // An approval whose time ran out: expired, its run queued again, its entry staged.
    let routine = replay_routine(store, project, "held").await;
    let run = store
        .create_run(
            project,
            queued_run(routine, 1, Some(key.id), 1),
            InputStep::requested(serde_json::json!("x")),
        )
        .await
        .unwrap();
    store
        .claim_run_by_id(project, run.id, "w", 60_000)
        .await
        .unwrap()
        .unwrap();
    let overdue = wor_store::NewApproval {
        expires_at: wor_store::now_millis() - 1,
        ..held_mail_approval(run.id, "binding")
    };
    let (approval, _) = store
        .park_for_approval(project, "w", &overdue)
        .await
        .unwrap()
        .unwrap();
    let expired_entry = |approval: &wor_store::ApprovalRecord, run: &wor_store::RunRecord| {
        AuditEvent::new(
            project,
            AuditCategory::ApprovalExpire,
            Actor::Run { run_id: run.id },
        )
        .subject("approval_id", approval.id)
        .runs(run.root_run_id, run.parent_run_id)
    };
    let expired = store.expire_approvals(&expired_entry).await.unwrap();
    let [(record, entry)] = expired.as_slice() else {
        panic!("one approval expired: {expired:?}");
    };
    assert_eq!(record.id, approval);
    assert_eq!(record.status.as_str(), "expired");
    let queued = store.get_run(project, run.id).await.unwrap();
    assert_eq!(entry.event(), &expired_entry(record, &queued));
    assert_eq!(staged().await.unwrap(), 5);
    assert!(
        store
            .expire_approvals(&expired_entry)
            .await
            .unwrap()
            .is_empty(),
        "an expired approval is not expired again"
    );
    assert_eq!(staged().await.unwrap(), 5);
}

/// Console sessions opened and ended, a session revoked, a sign-in link made, an invitation
/// used to set a password, and a notification route made and deleted each stage their entry
/// in the transaction that makes the change; what changes nothing (an unknown session ended
/// or revoked, a link for a member of another project, an invitation used twice, an unknown
/// route deleted) stages nothing.
#[tokio::test]
async fn console_sessions_links_and_routes_stage_their_entry_only_when_they_change_something() {
    use wor_core::audit::{Actor, AuditCategory, AuditEvent};
    // Its own database: the counts of staged rows are exact only where no other test's writer
    // sweeps them.
    let db = TestDatabase::isolated().await.unwrap();
    let p = created_project(&db.store, "console").await;
    let other = created_project(&db.store, "elsewhere").await;
    let project = p.project.id;
    let member = p.owner.id;
    let store = &db.store;
    let staged = || wor_store::testing::staged_count(store, project);
    let event = |category| {
        AuditEvent::new(
            project,
            category,
            Actor::ConsoleMember { member_id: member },
        )
        .subject("member_id", member)
    };

    let (token, entry) = store
        .create_console_session_staged(
            project,
            member,
            60_000,
            &Default::default(),
            Some(event(AuditCategory::ConsoleSignIn)),
        )
        .await
        .unwrap();
    assert_eq!(
        entry.map(|e| e.event().clone()),
        Some(event(AuditCategory::ConsoleSignIn))
    );
    assert_eq!(staged().await.unwrap(), 1);
    let unknown = store
        .end_console_session("wcs_unknown", event(AuditCategory::ConsoleSignOut))
        .await
        .unwrap();
    assert!(unknown.is_none(), "no session, nothing staged");
    let ended = store
        .end_console_session(token.expose(), event(AuditCategory::ConsoleSignOut))
        .await
        .unwrap();
    assert_eq!(
        ended.map(|e| e.event().clone()),
        Some(event(AuditCategory::ConsoleSignOut))
    );
    assert_eq!(staged().await.unwrap(), 2);

    store
        .create_console_session(project, member, 60_000, &Default::default())
        .await
        .unwrap();
    let session = store
        .list_console_sessions(project, None, 60_000)
        .await
        .unwrap()[0]
        .id;
    let revoked = |owner: wor_core::MemberId| {
        AuditEvent::new(
            project,
            AuditCategory::ConsoleSessionRevoke,
            Actor::Operator,
        )
        .subject("member_id", owner)
        .subject("session_id", session)
    };
    let elsewhere = store
        .revoke_console_session(other.project.id, session, None, &revoked)
        .await
        .unwrap();
    assert!(
        elsewhere.is_none(),
        "another project's session is not found"
    );
    let (owner, entry) = store
        .revoke_console_session(project, session, None, &revoked)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(owner, member);
    assert_eq!(entry.event(), &revoked(member));
    assert_eq!(staged().await.unwrap(), 3);

    let linked = |expires_at: i64| {
        event(AuditCategory::MemberSignInLink)
            .payload(serde_json::json!({ "expires_at": expires_at }))
    };
    let foreign = store
        .create_sign_in_link(project, other.owner.id, 60_000, &linked)
        .await;
    assert!(matches!(foreign, Err(StoreError::NotFound)), "{foreign:?}");
    assert_eq!(staged().await.unwrap(), 3, "nothing staged for a refusal");
    let (_, expires_at, entry) = store
        .create_sign_in_link(project, member, 60_000, &linked)
        .await
        .unwrap();
    assert_eq!(entry.event(), &linked(expires_at));
    assert_eq!(staged().await.unwrap(), 4);

    let (invitation, _) = store
        .create_invitation(project, member, None, 60_000)
        .await
        .unwrap();
    let set = |_: &wor_store::InvitationRecord| event(AuditCategory::MemberSetPassword);
    let (accepted, entry) = store
        .accept_invitation(invitation.expose(), "$argon2id$phc", &set)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(accepted.member_id, member);
    assert_eq!(entry.event(), &event(AuditCategory::MemberSetPassword));
    assert_eq!(staged().await.unwrap(), 5);
    let again = store
        .accept_invitation(invitation.expose(), "$argon2id$phc", &set)
        .await
        .unwrap();
    assert!(again.is_none(), "an invitation works once");
    assert_eq!(staged().await.unwrap(), 5);

    let route = wor_store::NewNotificationRoute {
        name: "ops".to_owned(),
        channel: wor_store::RouteChannel::Slack {
            channel: "C1".to_owned(),
            api_url: "https://slack.com/api".to_owned(),
        },
        filter: wor_store::RouteFilter::default(),
        created_by: None,
    };
    // A route is made with its secrets and its entry, or not at all.
    let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
    let vault = wor_store::Vault::new(store.clone(), std::sync::Arc::new(keys));
    let made = |id: wor_core::NotificationRouteId| {
        event(AuditCategory::NotificationRouteCreate).subject("route_id", id)
    };
    let token_of = |id: wor_core::NotificationRouteId| {
        wor_store::SecretSlot::new(
            project,
            wor_store::NOTIFICATION_ROUTES_TABLE,
            id,
            "bot_token",
        )
    };
    let unmade = wor_core::NotificationRouteId::new();
    let (inject, remove) = support::staging_refusal(store.backend());
    sqlx::raw_sql(inject).execute(store.pool()).await.unwrap();
    let refused = store
        .create_notification_route(
            project,
            unmade,
            &route,
            &[vault.seal_put(&token_of(unmade), "xoxb-refused").unwrap()],
            made(unmade),
        )
        .await;
    sqlx::raw_sql(remove).execute(store.pool()).await.unwrap();
    assert!(refused.is_err(), "{refused:?}");
    assert!(matches!(
        store.get_notification_route(project, unmade).await,
        Err(StoreError::NotFound)
    ));
    assert!(vault.metadata(&token_of(unmade)).await.unwrap().is_none());
    let misplaced = store
        .create_notification_route(
            project,
            unmade,
            &route,
            &[vault
                .seal_put(&token_of(wor_core::NotificationRouteId::new()), "xoxb-2")
                .unwrap()],
            made(unmade),
        )
        .await;
    assert!(
        matches!(misplaced, Err(StoreError::MisplacedSecret { .. })),
        "{misplaced:?}"
    );
    assert_eq!(staged().await.unwrap(), 5, "nothing staged for a refusal");
    let id = wor_core::NotificationRouteId::new();
    let (created, entry) = store
        .create_notification_route(
            project,
            id,
            &route,
            &[vault.seal_put(&token_of(id), "xoxb-1").unwrap()],
            made(id),
        )
        .await
        .unwrap();
    assert_eq!(created.id, id);
    assert_eq!(entry.event(), &made(created.id));
    assert_eq!(staged().await.unwrap(), 6);
    assert_eq!(
        secrecy::ExposeSecret::expose_secret(&vault.open(&token_of(id)).await.unwrap()),
        "xoxb-1"
    );
    let second = wor_core::NotificationRouteId::new();
    let taken = store
        .create_notification_route(
            project,
            second,
            &route,
            &[vault.seal_put(&token_of(second), "xoxb-3").unwrap()],
            made(second),
        )
        .await;
    assert!(matches!(taken, Err(StoreError::Conflict(_))), "{taken:?}");
    assert!(vault.metadata(&token_of(second)).await.unwrap().is_none());
    let deleted = || event(AuditCategory::NotificationRouteDelete).subject("route_id", created.id);
    let elsewhere = store
        .delete_notification_route(other.project.id, created.id, deleted())
        .await;
    assert!(
        matches!(elsewhere, Err(StoreError::NotFound)),
        "{elsewhere:?}"
    );
    assert_eq!(staged().await.unwrap(), 6, "nothing staged for a refusal");
    let entry = store
        .delete_notification_route(project, created.id, deleted())
        .await
        .unwrap();
    assert_eq!(entry.event(), &deleted());
    assert_eq!(staged().await.unwrap(), 7);

    // A secret sealed as a change of its own (a webhook secret made) stages its entry with it.
    let slot = wor_store::SecretSlot::new(project, "routines", "rtn_1", "webhook_secret");
    let rotated = event(AuditCategory::WebhookSecretRotate);
    let (_, entry) = vault
        .put_staged(&[(slot.clone(), "whsec-one")], Some(rotated.clone()))
        .await
        .unwrap();
    assert_eq!(entry.map(|e| e.event().clone()), Some(rotated.clone()));
    assert_eq!(staged().await.unwrap(), 8);
    assert_eq!(
        secrecy::ExposeSecret::expose_secret(&vault.open(&slot).await.unwrap()),
        "whsec-one"
    );
    // Several secrets sealed as one change: all of them with the entry, or none of them.
    let access = wor_store::SecretSlot::new(project, "tool_connections", "con_1", "access_token");
    let refresh = wor_store::SecretSlot::new(project, "tool_connections", "con_1", "refresh_token");
    let tokens = [(access.clone(), "access-1"), (refresh.clone(), "refresh-1")];
    sqlx::raw_sql(inject).execute(store.pool()).await.unwrap();
    let refused = vault.put_staged(&tokens, Some(rotated.clone())).await;
    sqlx::raw_sql(remove).execute(store.pool()).await.unwrap();
    assert!(refused.is_err(), "{refused:?}");
    for slot in [&access, &refresh] {
        assert!(
            vault.metadata(slot).await.unwrap().is_none(),
            "{slot} stays unset"
        );
    }
    assert_eq!(staged().await.unwrap(), 8);
    let (_, entry) = vault
        .put_staged(&tokens, Some(rotated.clone()))
        .await
        .unwrap();
    assert_eq!(entry.map(|e| e.event().clone()), Some(rotated));
    assert_eq!(staged().await.unwrap(), 9);
    for (slot, value) in tokens {
        assert_eq!(
            secrecy::ExposeSecret::expose_secret(&vault.open(&slot).await.unwrap()),
            value
        );
    }
}

/// A service key named `ci` with `role` in `project`.
async fn service_key(
    store: &Store,
    project: wor_core::ProjectId,
    role: Role,
) -> (wor_store::ApiKeyRecord, wor_store::PlaintextApiKey) {
    store
        .create_api_key(
            project,
            NewApiKey {
                name: "ci".into(),
                role,
                kind: ApiKeyKind::Service,
                created_by: None,
            },
        )
        .await
        .unwrap()
}

#[tokio::test]
async fn a_scheduled_start_a_skip_policy_may_pass_over_is_counted_in_its_transaction() {
    use wor_core::run::RunStatus;
    let db = TestDatabase::new().await.unwrap();
    let (project, routine) = project_with_routine(&db.store, "sched-skip", 2).await;
    let input = InputStep::requested(serde_json::json!("x"));
    // One run already active: the scheduler's count, made before, may not have seen it.
    db.store
        .create_run(project, queued_run(routine, 1, None, 2), input.clone())
        .await
        .unwrap();
    let start = |slot: i64, skip_at: Option<u64>| wor_store::ScheduledStart {
        project,
        run: wor_store::NewRun {
            trigger_kind: wor_core::call::TriggerKind::Schedule,
            trigger_key: Some(format!("slot:{slot}")),
            input_provenance: wor_core::run::Provenance::Engine,
            skip_at,
            ..queued_run(routine, 1, None, 2)
        },
        input: input.clone(),
        not_before: None,
    };
    let entry = |start: &wor_store::ScheduledStart, id: wor_core::RunId| {
        wor_core::audit::AuditEvent::new(
            start.project,
            wor_core::audit::AuditCategory::RunStart,
            wor_core::audit::Actor::Schedule {
                routine_id: start.run.routine_id,
            },
        )
        .subject("run_id", id)
        .payload(serde_json::json!({ "status": start.run.status.as_str() }))
    };
    let (recorded, staged) = db
        .store
        .start_scheduled(
            vec![start(1, Some(2)), start(2, Some(2)), start(3, Some(2))],
            &[],
            &entry,
        )
        .await
        .unwrap();
    let statuses: Vec<RunStatus> = recorded.iter().map(|r| r.unwrap().1).collect();
    assert_eq!(
        statuses,
        [RunStatus::Queued, RunStatus::Skipped, RunStatus::Skipped]
    );
    let skipped = db
        .store
        .get_run(project, recorded[1].unwrap().0)
        .await
        .unwrap();
    assert_eq!(skipped.status, RunStatus::Skipped);
    assert_eq!(
        skipped.outcome.as_deref(),
        Some("skipped: 2 run(s) of this routine active, at most 2")
    );
    // Each start's entry is made from the start as recorded.
    assert_eq!(staged.len(), 3);
    assert_eq!(
        staged[1].event(),
        &entry(&start(2, None), recorded[1].unwrap().0)
            .payload(serde_json::json!({ "status": "skipped" }))
    );
    // A start the policy does not look at is queued whatever is active.
    let (recorded, _staged) = db
        .store
        .start_scheduled(vec![start(4, None)], &[], &entry)
        .await
        .unwrap();
    assert_eq!(recorded[0].unwrap().1, RunStatus::Queued);
}
