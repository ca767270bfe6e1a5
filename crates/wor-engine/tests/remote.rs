//! A remote worker's engine against a control plane played by the test (`ControlPlaneLink`):
//! what its claims ask, which claims it gives back at once and which it leaves to their lease,
//! and what its readiness says.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use secrecy::SecretString;
use serde_json::{Value, json};
use wor_engine::{
    ClaimError, ControlPlaneLink, Engine, EngineConfig, LinkAnswer, LinkError, LinkFuture,
    StartRun, Trigger,
};
use wor_secrets::{
    ControlPlaneSigningKey, EnvelopeClaims, EnvelopeLimits, EnvelopeOpener, RunSecrets,
    WorkerIdentity,
};
use wor_store::testing::TestDatabase;
use wor_store::{AuditConfig, AuditLog, RunRecord, Vault};

const WORKER: &str = "wkr_test";
const ROUTINE: &str = "name = \"echo\"\ninstructions = \"Answer.\"\n[model]\nprovider = \"replay\"\n\
                       model = \"script\"\n[[model.script.turns]]\ntext = \"done\"\n";

/// The control plane as the test plays it: each request is kept, and answered with the next
/// answer queued, or a link failure when none is.
#[derive(Default)]
struct FakeLink {
    sent: Mutex<Vec<(String, Value)>>,
    answers: Mutex<VecDeque<Result<LinkAnswer, LinkError>>>,
}

impl FakeLink {
    fn answer(&self, status: u16, body: &Value) {
        self.answers.lock().unwrap().push_back(Ok(LinkAnswer {
            status,
            body: serde_json::to_vec(body).unwrap(),
        }));
    }

    fn sent(&self) -> Vec<(String, Value)> {
        self.sent.lock().unwrap().clone()
    }
}

impl ControlPlaneLink for FakeLink {
    fn post<'a>(
        &'a self,
        path: &'a str,
        body: Vec<u8>,
    ) -> LinkFuture<'a, Result<LinkAnswer, LinkError>> {
        Box::pin(async move {
            let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
            self.sent.lock().unwrap().push((path.to_owned(), body));
            self.answers
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or_else(|| Err(LinkError("no answer queued".to_owned())))
        })
    }
}

/// The control plane's side: an engine on a database of its own, with a project and the
/// routine [`ROUTINE`] to start runs of.
struct ControlPlane {
    engine: Engine,
    project: wor_core::ProjectId,
    key: wor_core::ApiKeyId,
    routine: wor_core::RoutineId,
    /// Kept for as long as the engine uses it.
    _db: TestDatabase,
}

impl ControlPlane {
    async fn new(config: EngineConfig) -> Self {
        let db = TestDatabase::isolated().await.unwrap();
        let created = db
            .store
            .create_project(&TestDatabase::unique_name("remote"), "owner")
            .await
            .unwrap();
        let project = created.project.id;
        let key = db.store.list_api_keys(project).await.unwrap()[0].id;
        let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
        let (signing, _) = wor_secrets::AuditSigningKey::generate().unwrap();
        let engine = Engine::new(
            db.store.clone(),
            Vault::new(db.store.clone(), Arc::new(keys)),
            wor_egress::EgressClient::new(wor_egress::EgressPolicy::development()).unwrap(),
            AuditLog::start(db.store.clone(), signing, AuditConfig::default()),
            config,
        );
        let definition = wor_core::routine::RoutineDefinition::from_toml(ROUTINE).unwrap();
        let routine = db
            .store
            .apply_routine(project, ROUTINE, &definition, None)
            .await
            .unwrap()
            .routine
            .id;
        ControlPlane {
            engine,
            project,
            key,
            routine,
            _db: db,
        }
    }

    /// Starts (queues) a run of the routine.
    async fn start(&self) -> RunRecord {
        self.engine
            .start_run(StartRun {
                project: self.project,
                routine: self.routine,
                input: json!("hello"),
                trigger: Trigger::Api(self.key),
                actor: None,
                thread: None,
                idempotency_key: None,
            })
            .await
            .unwrap()
            .into_run()
    }
}

/// A worker's engine on `link`, the control plane's key, the worker's public keys, and a run
/// of the control plane's database to claim.
struct Setup {
    engine: Engine,
    link: Arc<FakeLink>,
    control_plane: ControlPlaneSigningKey,
    worker_keys: wor_secrets::WorkerPublicKeys,
    run: RunRecord,
    _plane: ControlPlane,
}

async fn setup() -> Setup {
    let plane = ControlPlane::new(EngineConfig::default()).await;
    let run = plane.start().await;
    let (control_plane, _) = ControlPlaneSigningKey::generate().unwrap();
    let (identity, _) = WorkerIdentity::generate().unwrap();
    let worker_keys = identity.public_keys();
    let opener = EnvelopeOpener::new(
        identity,
        WORKER,
        control_plane.verifying_key(),
        EnvelopeLimits::default(),
    );
    let link = Arc::new(FakeLink::default());
    // A worker's engine is built on a store too (a scratch one in `wor serve --role
    // worker`); nothing of a claimed run is read from it or written to it.
    let engine = Engine::new(
        plane.engine.store().clone(),
        plane.engine.vault().clone(),
        wor_egress::EgressClient::new(wor_egress::EgressPolicy::development()).unwrap(),
        plane.engine.audit().clone(),
        EngineConfig {
            worker_id: WORKER.to_owned(),
            ..EngineConfig::default()
        },
    )
    .with_control_plane(link.clone(), opener);
    Setup {
        engine,
        link,
        control_plane,
        worker_keys,
        run,
        _plane: plane,
    }
}

impl Setup {
    /// A claim of the run with an envelope sealed to `recipient` for `worker`, carrying
    /// `source_toml` as the routine version.
    fn claim(
        &self,
        recipient: &wor_secrets::WorkerPublicKeys,
        worker: &str,
        source_toml: &str,
    ) -> Value {
        let now = wor_store::now_millis() / 1000;
        let claims = EnvelopeClaims {
            run_id: self.run.id.to_string(),
            lease_id: "lse_test".to_owned(),
            worker_id: worker.to_owned(),
            issued_at: now,
            expires_at: now + 60,
        };
        let secrets = RunSecrets {
            run_credential: SecretString::from("wrt_test-credential".to_owned()),
            model_key: None,
            tool_credentials: Vec::new(),
        };
        let sealed =
            wor_secrets::run_envelope::seal(&self.control_plane, recipient, &claims, &secrets)
                .unwrap();
        json!({
            "lease_id": "lse_test",
            "run": self.run,
            "routine_version": {
                "version": self.run.routine_version,
                "content_hash": "sha256:test",
                "source_toml": source_toml,
            },
            "project_policy": null,
            "steps": [],
            "model_connection": null,
            "tool_connections": [],
            "approvals": [],
            "routine_tools": [],
            "credential_expires_at": wor_store::now_millis() + 60_000,
            "lease_expires_at": wor_store::now_millis() + 30_000,
            "lease_ms": 30_000,
            "envelope": sealed.to_base64(),
        })
    }
}

#[tokio::test]
async fn a_claim_asks_to_wait_and_readiness_follows_the_control_planes_last_answer() {
    let setup = setup().await;
    let (engine, link) = (&setup.engine, &setup.link);
    let not_yet = engine.remote_ready().unwrap_err();
    assert!(not_yet.contains("not answered yet"), "{not_yet}");

    // Nothing queued: the claim asked to wait, and the worker is ready.
    link.answer(204, &Value::Null);
    assert!(
        engine
            .claim_remote(Duration::from_millis(1500))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(link.sent()[0].0, "/internal/v1/runs/claim");
    assert_eq!(link.sent()[0].1, json!({ "wait_ms": 1500 }));
    engine.remote_ready().unwrap();

    // Refused: not ready, saying the status and nothing of the answer's body.
    link.answer(
        401,
        &json!({"error": {"code": "worker_unauthenticated", "message": "revoked sk-canary"}}),
    );
    assert!(matches!(
        engine.heartbeat().await,
        Err(ClaimError::Refused { status: 401, .. })
    ));
    let refused = engine.remote_ready().unwrap_err();
    assert!(
        refused.contains("401") && !refused.contains("canary"),
        "{refused}"
    );

    // Unreachable: not ready; answering again: ready again.
    assert!(matches!(
        engine.claim_remote(Duration::ZERO).await,
        Err(ClaimError::Link(_))
    ));
    let unreachable = engine.remote_ready().unwrap_err();
    assert!(unreachable.contains("cannot be reached"), "{unreachable}");
    link.answer(200, &json!({ "worker_id": WORKER }));
    assert_eq!(engine.heartbeat().await.unwrap(), WORKER);
    engine.remote_ready().unwrap();
}

#[tokio::test]
async fn a_refused_envelope_goes_back_at_once_and_an_unreadable_claim_waits_out_its_lease() {
    let setup = setup().await;
    let (engine, link) = (&setup.engine, &setup.link);

    // Sealed to another worker: refused, and given back with the claim's lease id.
    let (other, _) = WorkerIdentity::generate().unwrap();
    link.answer(200, &setup.claim(&other.public_keys(), WORKER, ROUTINE));
    link.answer(204, &Value::Null);
    let refused = engine.claim_remote(Duration::ZERO).await.unwrap_err();
    assert!(matches!(refused, ClaimError::Envelope(_)), "{refused}");
    let sent = link.sent();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(
        sent[1].0,
        format!("/internal/v1/runs/{}/refuse", setup.run.id)
    );
    assert_eq!(sent[1].1["lease_id"], "lse_test");
    assert!(
        sent[1].1["reason"].as_str().unwrap().contains("envelope"),
        "{sent:?}"
    );

    // Addressed to another worker id: refused too.
    link.answer(200, &setup.claim(&setup.worker_keys, "wkr_other", ROUTINE));
    link.answer(204, &Value::Null);
    assert!(matches!(
        engine.claim_remote(Duration::ZERO).await,
        Err(ClaimError::Envelope(_))
    ));
    assert_eq!(link.sent().len(), 4);
    assert!(link.sent()[3].0.ends_with("/refuse"));

    // Its envelope opens but its routine does not read: any worker like this one would
    // refuse it again, so it is not handed back to go round ahead of the queue.
    link.answer(
        200,
        &setup.claim(&setup.worker_keys, WORKER, "name = \"echo\"\n[unclosed"),
    );
    let unreadable = engine.claim_remote(Duration::ZERO).await.unwrap_err();
    assert!(
        matches!(unreadable, ClaimError::Malformed(_)),
        "{unreadable}"
    );
    assert_eq!(
        link.sent().len(),
        5,
        "nothing was given back: {:?}",
        link.sent()
    );

    // A good claim is taken up.
    link.answer(200, &setup.claim(&setup.worker_keys, WORKER, ROUTINE));
    let claimed = engine.claim_remote(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(claimed.id, setup.run.id);
    assert_eq!(link.sent().len(), 6);
}

#[tokio::test]
async fn a_waiting_claim_is_answered_when_a_run_is_queued_not_at_the_next_poll() {
    // The control plane looks again only once a minute: only the wake-up of a run queued
    // here can answer the claim within its wait.
    let plane = ControlPlane::new(EngineConfig {
        poll_interval: Duration::from_secs(60),
        ..EngineConfig::default()
    })
    .await;
    let control_plane = &plane.engine;
    let waiting = {
        let control_plane = control_plane.clone();
        tokio::spawn(async move {
            control_plane
                .claim_for_worker_within(WORKER, Duration::from_secs(20))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "nothing was queued yet");
    let run = plane.start().await;
    let claimed = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the claim was answered before the next poll")
        .unwrap()
        .unwrap()
        .expect("the queued run");
    assert_eq!(claimed.run.id, run.id);
    // With nothing queued, a claim that may not wait answers at once.
    assert!(
        control_plane
            .claim_for_worker_within(WORKER, Duration::ZERO)
            .await
            .unwrap()
            .is_none()
    );
}
