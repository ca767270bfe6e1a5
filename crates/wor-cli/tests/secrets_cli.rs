//! Secrets end to end through the binary (S2, S3, S4): the canary test, rotation across an
//! interruption and a restart, and ciphertexts swapped between rows.
//!
//! The canary test grows with the project: every feature that handles a secret plants a
//! canary here and the scans below must find none of it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::io::Write;
use std::process::Stdio;

use base64::Engine;
use common::{Server, create_project, database_url, own_database_args, run, text, wor};

/// Everything a canary may look like once encoded.
fn forms(canary: &str) -> Vec<String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let url = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    vec![
        canary.to_owned(),
        b64.encode(canary),
        url.encode(canary),
        canary.bytes().map(|b| format!("{b:02x}")).collect(),
    ]
}

fn assert_absent(haystack: &str, canaries: &[&str], place: &str) {
    for canary in canaries {
        for form in forms(canary) {
            assert!(
                !haystack.contains(&form),
                "{place} holds canary `{canary}` (as `{form}`)"
            );
        }
    }
}

/// The whole database as text: the SQLite files, or every row of every table on PostgreSQL.
async fn database_text(db: &[String], dir: &std::path::Path) -> String {
    let url = database_url(db, dir);
    if !url.starts_with("postgres") {
        return ["wor.db", "wor.db-wal", "wor.db-shm"]
            .iter()
            .map(|f| {
                String::from_utf8_lossy(&std::fs::read(dir.join(f)).unwrap_or_default())
                    .into_owned()
            })
            .collect();
    }
    let store = wor_store::Store::connect(&url).await.unwrap();
    let tables: Vec<(String,)> = sqlx::query_as(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let mut all = String::new();
    for (table,) in tables {
        let rows: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT CAST(t AS TEXT) FROM {table} t"
        )))
        .fetch_all(store.pool())
        .await
        .unwrap();
        for (row,) in rows {
            all.push_str(&row);
            all.push('\n');
        }
    }
    all
}

fn with_stdin(server: &Server, key: &str, args: &[&str], input: &str) -> std::process::Output {
    let mut cmd = wor(args);
    cmd.env("WOR_SERVER", &server.url)
        .env("WOR_API_KEY", key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn canaries_in_secret_fields_appear_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let db = own_database_args(dir.path()).await;
    let owner = create_project(&db);
    let server = Server::start(&db, &[("WOR_LOG", "trace")]);
    let first = "sk-canary-first-0d9e8f7a6b5c4d3e";
    let second = "sk-ant-canary-second-1a2b3c4d5e6f";
    let mut responses = String::new();
    let mut record = |out: &std::process::Output| {
        responses.push_str(&text(&out.stdout));
        responses.push_str(&text(&out.stderr));
    };

    let created = with_stdin(
        &server,
        &owner,
        &[
            "model-connection",
            "create",
            "main",
            "--provider",
            "openai_compatible",
            "--base-url",
            "https://models.example.com/v1",
            "--api-key-stdin",
            "--json",
        ],
        first,
    );
    assert!(created.status.success(), "{}", text(&created.stderr));
    record(&created);
    let id = serde_json::from_slice::<serde_json::Value>(&created.stdout).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let replaced = run(wor(&[
        "model-connection",
        "set-key",
        &id,
        "--api-key-env",
        "CANARY",
        "--json",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", &owner)
    .env("CANARY", second));
    assert!(replaced.status.success(), "{}", text(&replaced.stderr));
    assert!(text(&replaced.stdout).contains("\"credential_version\": 2"));
    record(&replaced);
    for args in [
        vec!["model-connection", "list", "--json"],
        vec!["model-connection", "show", id.as_str(), "--json"],
        vec!["model-connection", "list"],
        vec!["key", "list", "--json"],
        vec!["whoami", "--json"],
    ] {
        let out = server.client(&owner, &args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        record(&out);
    }
    // A tool connection's bearer token and secret header: sealed, never shown.
    let tool_token = "tok-canary-tool-7c6b5a4f3e2d1c0b";
    let tool_header = "key-canary-tool-0f1e2d3c4b5a6978";
    let tool = run(wor(&[
        "connection",
        "create",
        "desk",
        "--url",
        "https://mcp.example.com/mcp",
        "--allow",
        "mcp.example.com",
        "--bearer-env",
        "TOOL_TOKEN",
        "--header-env",
        "X-Api-Key=TOOL_HEADER",
        "--json",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", &owner)
    .env("TOOL_TOKEN", tool_token)
    .env("TOOL_HEADER", tool_header));
    assert!(tool.status.success(), "{}", text(&tool.stderr));
    let tool_view: serde_json::Value = serde_json::from_slice(&tool.stdout).unwrap();
    assert_eq!(tool_view["status"], "pending_review");
    assert_eq!(tool_view["credentials"]["x-api-key"]["configured"], true);
    assert_eq!(
        tool_view["credentials"]["authorization"]["configured"],
        true
    );
    record(&tool);
    let tool_id = tool_view["id"].as_str().unwrap().to_owned();
    for args in [
        vec!["connection", "list", "--json"],
        vec!["connection", "show", tool_id.as_str(), "--json"],
        vec!["connection", "list"],
        vec!["audit", "export"],
    ] {
        let out = server.client(&owner, &args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        record(&out);
    }
    // MCP authorization needs the server's public URL for its callback, and says so.
    let authorize = server.client(&owner, &["connection", "authorize", tool_id.as_str()]);
    assert!(!authorize.status.success());
    assert!(
        text(&authorize.stderr).contains("public_url"),
        "{}",
        text(&authorize.stderr)
    );
    record(&authorize);
    // An HTTP API imported from an OpenAPI document (YAML), its schemes' secrets sealed; its
    // tools replaced from a hand-written tools file.
    let scheme_key = "key-canary-openapi-5a4b3c2d1e0f9988";
    let scheme_token = "tok-canary-openapi-1122aabbccddeeff";
    let petstore = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/openapi/petstore.yaml"
    );
    let imported = run(wor(&[
        "connection",
        "create",
        "pets",
        "--openapi",
        petstore,
        "--url",
        "https://petstore.example.com/v3",
        "--allow",
        "petstore.example.com",
        "--operation",
        "getPetById",
        "--operation",
        "addPet",
        "--scheme-env",
        "api_key=PET_KEY",
        "--scheme-env",
        "petstore_auth=PET_TOKEN",
        "--json",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", &owner)
    .env("PET_KEY", scheme_key)
    .env("PET_TOKEN", scheme_token));
    assert!(imported.status.success(), "{}", text(&imported.stderr));
    let pets: serde_json::Value = serde_json::from_slice(&imported.stdout).unwrap();
    assert_eq!(pets["kind"], "http_api");
    assert_eq!(pets["credentials"]["api_key"]["configured"], true);
    assert_eq!(pets["credentials"]["authorization"]["configured"], true);
    record(&imported);
    let tools_file = dir.path().join("tools.yaml");
    std::fs::write(
        &tools_file,
        "- name: get_pet\n  method: GET\n  path: /pet/{id}\n  inputSchema:\n    type: object\n    properties: {id: {type: integer}}\n",
    )
    .unwrap();
    let pets_id = pets["id"].as_str().unwrap().to_owned();
    let replaced_tools = server.client(
        &owner,
        &[
            "connection",
            "replace-tools",
            &pets_id,
            "--tools-file",
            tools_file.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(
        replaced_tools.status.success(),
        "{}",
        text(&replaced_tools.stderr)
    );
    let replaced_view: serde_json::Value = serde_json::from_slice(&replaced_tools.stdout).unwrap();
    assert_eq!(
        replaced_view["quarantined"], false,
        "nothing was pinned yet"
    );
    record(&replaced_tools);
    let tools_json = dir.path().join("tools.json");
    std::fs::write(
        &tools_json,
        r#"{"tools": [{"name": "list_notes", "method": "GET", "path": "/notes",
            "inputSchema": {"type": "object"}}]}"#,
    )
    .unwrap();
    let notes = server.client(
        &owner,
        &[
            "connection",
            "create",
            "notes",
            "--tools-file",
            tools_json.to_str().unwrap(),
            "--url",
            "https://notes.example.com/v1",
            "--allow",
            "notes.example.com",
            "--json",
        ],
    );
    assert!(notes.status.success(), "{}", text(&notes.stderr));
    let notes: serde_json::Value = serde_json::from_slice(&notes.stdout).unwrap();
    assert_eq!(notes["kind"], "http_api");
    assert_eq!(notes["status"], "pending_review");
    let missing = server.client(
        &owner,
        &[
            "connection",
            "create",
            "pets-2",
            "--openapi",
            petstore,
            "--allow",
            "petstore.example.com",
            "--operation",
            "getPetById",
        ],
    );
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr)
            .contains("`getPetById` needs one of: header `api_key` (scheme `api_key`)"),
        "{}",
        text(&missing.stderr)
    );
    // A request that fails carrying a canary: the error must not echo it.
    let bad = with_stdin(
        &server,
        &owner,
        &[
            "model-connection",
            "create",
            "bad",
            "--provider",
            "openai_compatible",
            "--base-url",
            "https://x:sk-canary-in-url-99887766@models.example.com",
            "--api-key-stdin",
        ],
        first,
    );
    assert!(!bad.status.success());
    record(&bad);
    let log = server.stop();

    let canaries = [
        first,
        second,
        "sk-canary-in-url-99887766",
        tool_token,
        tool_header,
        scheme_key,
        scheme_token,
    ];
    assert_absent(&responses, &canaries, "an API response or CLI output");
    assert_absent(&log, &canaries, "the server log");
    assert_absent(
        &database_text(&db, dir.path()).await,
        &canaries,
        "the database",
    );
    // The API key the owner uses is a credential too: not in the log, not in the database.
    assert_absent(&log, &[&owner], "the server log");
    assert_absent(
        &database_text(&db, dir.path()).await,
        &[&owner],
        "the database",
    );
}

fn secrets_cmd(args: &[&str], db: &[String], envs: &[(&str, &str)]) -> std::process::Output {
    let mut all = vec!["secrets"];
    all.extend_from_slice(args);
    all.extend(db.iter().map(String::as_str));
    run(wor(&all).envs(envs.iter().copied()))
}

fn generate_key() -> String {
    let out = run(&mut wor(&["secrets", "generate-key"]));
    assert!(out.status.success());
    let key = text(&out.stdout).trim().to_owned();
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(&key)
            .unwrap()
            .len(),
        32
    );
    key
}

#[tokio::test(flavor = "multi_thread")]
async fn rotation_survives_interruption_and_old_keys_can_then_be_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let db = own_database_args(dir.path()).await;
    let owner = create_project(&db);
    let old = generate_key();
    let new = generate_key();
    let server = Server::start(&db, &[("WOR_ENCRYPTION_KEY", old.as_str())]);
    let mut ids = Vec::new();
    for i in 0..3 {
        let out = with_stdin(
            &server,
            &owner,
            &[
                "model-connection",
                "create",
                &format!("m{i}"),
                "--provider",
                "anthropic",
                "--base-url",
                "https://models.example.com",
                "--api-key-stdin",
                "--json",
            ],
            &format!("sk-rotate-{i}-abcdef123456"),
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        ids.push(
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    server.stop();

    let both = [
        ("WOR_ENCRYPTION_KEY", new.as_str()),
        ("WOR_ENCRYPTION_KEY_RETIRED", old.as_str()),
    ];
    // Interrupted after one secret: the rest are still under the old key, and nothing is lost.
    let partial = secrets_cmd(&["rotate", "--limit", "1"], &db, &both);
    assert!(partial.status.success(), "{}", text(&partial.stderr));
    assert!(
        text(&partial.stderr).contains("re-sealed 1"),
        "{}",
        text(&partial.stderr)
    );
    let mid = secrets_cmd(&["verify"], &db, &both);
    assert!(mid.status.success(), "{}", text(&mid.stderr));

    // A server restarted midway serves with both keys.
    let server = Server::start(&db, &both);
    let listed = server.client(&owner, &["model-connection", "list"]);
    assert!(listed.status.success());
    server.stop();

    let rest = secrets_cmd(&["rotate"], &db, &both);
    assert!(rest.status.success(), "{}", text(&rest.stderr));
    assert!(
        text(&rest.stderr).contains("no stored secret needs the retired keys"),
        "{}",
        text(&rest.stderr)
    );

    // The old key is dropped: everything still opens under the new one alone.
    let only_new = [("WOR_ENCRYPTION_KEY", new.as_str())];
    let verified = secrets_cmd(&["verify"], &db, &only_new);
    assert!(verified.status.success(), "{}", text(&verified.stderr));
    // ... and the old key alone opens nothing of ours any more.
    let only_old = [("WOR_ENCRYPTION_KEY", old.as_str())];
    let stale = secrets_cmd(&["verify"], &db, &only_old);
    assert_eq!(stale.status.code(), Some(1));
    assert!(
        text(&stale.stderr).contains("unknown key id") || text(&stale.stderr).contains("key id"),
        "{}",
        text(&stale.stderr)
    );
    assert!(!text(&stale.stderr).contains(&new) && !text(&stale.stderr).contains(&old));
}

#[tokio::test(flavor = "multi_thread")]
async fn ciphertexts_swapped_between_rows_do_not_decrypt() {
    let dir = tempfile::tempdir().unwrap();
    let db = own_database_args(dir.path()).await;
    let owner = create_project(&db);
    let key = generate_key();
    let envs = [("WOR_ENCRYPTION_KEY", key.as_str())];
    let server = Server::start(&db, &envs);
    let mut ids = Vec::new();
    for name in ["a", "b"] {
        let out = with_stdin(
            &server,
            &owner,
            &[
                "model-connection",
                "create",
                name,
                "--provider",
                "anthropic",
                "--base-url",
                "https://models.example.com",
                "--api-key-stdin",
                "--json",
            ],
            &format!("sk-swap-{name}-0123456789"),
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        ids.push(
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    server.stop();
    assert!(secrets_cmd(&["verify"], &db, &envs).status.success());

    // An attacker with database access swaps the two ciphertexts.
    let store = wor_store::Store::connect(&db[3]).await.unwrap();
    let fetch = |id: String| {
        let pool = store.pool().clone();
        async move {
            let (blob,): (Vec<u8>,) =
                sqlx::query_as("SELECT sealed FROM sealed_secrets WHERE owner_id = $1")
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            blob
        }
    };
    let (a, b) = (fetch(ids[0].clone()).await, fetch(ids[1].clone()).await);
    for (id, blob) in [(&ids[0], &b), (&ids[1], &a)] {
        sqlx::query("UPDATE sealed_secrets SET sealed = $1 WHERE owner_id = $2")
            .bind(blob.clone())
            .bind(id.clone())
            .execute(store.pool())
            .await
            .unwrap();
    }
    store.close().await;

    let verified = secrets_cmd(&["verify"], &db, &envs);
    let stderr = text(&verified.stderr);
    assert_eq!(verified.status.code(), Some(1), "{stderr}");
    for id in &ids {
        assert!(
            stderr.contains(&format!("model_connections/{id}/api_key")),
            "names the slot: {stderr}"
        );
    }
    assert!(!stderr.contains("sk-swap-"), "{stderr}");
}
