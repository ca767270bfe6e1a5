//! Repository behaviour on the configured backend (SQLite by default, PostgreSQL in CI).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use wor_core::Role;
use wor_store::testing::TestDatabase;
use wor_store::{ApiKeyKind, NewApiKey, StoreError};

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
    let created = db
        .store
        .create_project(&TestDatabase::unique_name("p"), "alice")
        .await
        .unwrap();
    let project = created.project.id;
    let (record, key) = db
        .store
        .create_api_key(
            project,
            NewApiKey {
                name: "ci".into(),
                role: Role::Viewer,
                kind: ApiKeyKind::Service,
                created_by: None,
            },
        )
        .await
        .unwrap();
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
    let a = db
        .store
        .create_project(&TestDatabase::unique_name("a"), "alice")
        .await
        .unwrap();
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
    let created = db
        .store
        .create_project(&TestDatabase::unique_name("p"), "alice")
        .await
        .unwrap();
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
