//! Operating a server through the binary: a backup taken while it runs, restored into a new
//! data dir and run again; a restore with the wrong key refused.
//!
//! Backups are of the embedded SQLite database, so these tests run on SQLite whatever
//! `WOR_TEST_DATABASE_URL` says; PostgreSQL's path (`pg_dump`) is named, not built.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use base64::Engine as _;
use common::{Server, run, text, wor};

const KEY: &str = "q6mZ2k0kq3c7b1pY8Jx0M1yJc4pN9rO2vW6tU5sR3aE=";
const OTHER_KEY: &str = "Zm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGw=";
const MODEL_KEY: &str = "sk-backup-canary-5e4d3c2b1a09f8e7";

const ROUTINE: &str = r#"
name = "greeter"
instructions = "Greet the requester."

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
text = "Hello from the routine."
repeat = true
"#;

fn dir_args(dir: &Path) -> Vec<String> {
    vec!["--data-dir".into(), dir.display().to_string()]
}

fn operator(args: &[&str], dir: &Path, key: Option<&str>) -> std::process::Output {
    let mut all: Vec<&str> = args.to_vec();
    let dir_text = dir.display().to_string();
    all.extend(["--data-dir", dir_text.as_str()]);
    let mut cmd = wor(&all);
    if let Some(key) = key {
        cmd.env("WOR_ENCRYPTION_KEY", key);
    }
    run(&mut cmd)
}

fn run_greeter(server: &Server, owner: &str) -> String {
    let out = server.client(
        owner,
        &["run", "start", "greeter", "--input", "hi", "--follow"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[engine] succeeded"), "{stdout}");
    stdout
}

#[test]
fn a_backup_of_a_running_server_restores_verifies_and_runs_and_a_wrong_key_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let first = root.path().join("first");
    let created = operator(&["project", "create", "ops"], &first, Some(KEY));
    assert!(created.status.success(), "{}", text(&created.stderr));
    let owner = text(&created.stdout).trim().to_owned();
    let server = Server::start(&dir_args(&first), &[("WOR_ENCRYPTION_KEY", KEY)]);
    let connection = run(wor(&[
        "model-connection",
        "create",
        "main",
        "--provider",
        "openai_compatible",
        "--base-url",
        "https://models.example.com/v1",
        "--api-key-env",
        "MODEL_KEY",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", &owner)
    .env("MODEL_KEY", MODEL_KEY));
    assert!(connection.status.success(), "{}", text(&connection.stderr));
    let file = root.path().join("greeter.toml");
    std::fs::write(&file, ROUTINE).unwrap();
    let applied = server.client(
        &owner,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(applied.status.success(), "{}", text(&applied.stderr));
    run_greeter(&server, &owner);

    // Taken while the server runs (and holds the database open).
    let backup = root.path().join("wor-backup.db");
    let backup_text = backup.display().to_string();
    let made = operator(&["backup", "--to", &backup_text], &first, None);
    assert!(made.status.success(), "{}", text(&made.stderr));
    assert_eq!(
        std::fs::metadata(&backup).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let again = operator(&["backup", "--to", &backup_text], &first, None);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        text(&again.stderr).contains("already exists"),
        "{}",
        text(&again.stderr)
    );
    // The key ring is never in the backup, and secrets are in it only sealed.
    let bytes = std::fs::read(&backup).unwrap();
    let raw_key = base64::engine::general_purpose::STANDARD
        .decode(KEY)
        .unwrap();
    assert!(!bytes.windows(raw_key.len()).any(|w| w == raw_key));
    for needle in [KEY, MODEL_KEY] {
        assert!(
            !bytes.windows(needle.len()).any(|w| w == needle.as_bytes()),
            "the backup holds `{needle}`"
        );
    }
    server.stop();

    // Restored into a new data dir, with the audit signing key the operator kept apart.
    let second = root.path().join("second");
    std::fs::create_dir_all(&second).unwrap();
    std::fs::copy(
        first.join("audit-signing.key"),
        second.join("audit-signing.key"),
    )
    .unwrap();
    let keyless = operator(&["restore", "--from", &backup_text], &second, None);
    assert_eq!(keyless.status.code(), Some(1));
    assert!(
        text(&keyless.stderr).contains("no encryption key"),
        "{}",
        text(&keyless.stderr)
    );
    let wrong = operator(
        &["restore", "--from", &backup_text],
        &second,
        Some(OTHER_KEY),
    );
    assert_eq!(wrong.status.code(), Some(1), "{}", text(&wrong.stdout));
    let complaint = text(&wrong.stderr);
    assert!(complaint.contains("wrong encryption key"), "{complaint}");
    assert!(complaint.contains("not in the key ring"), "{complaint}");
    assert!(
        !second.join("wor.db").exists(),
        "a refused restore leaves nothing"
    );

    let restored = operator(&["restore", "--from", &backup_text], &second, Some(KEY));
    assert!(restored.status.success(), "{}", text(&restored.stderr));
    let summary = text(&restored.stdout);
    assert!(summary.contains("audit intact"), "{summary}");
    assert!(
        summary.contains("1 sealed secret(s): every one opens"),
        "{summary}"
    );
    let over = operator(&["restore", "--from", &backup_text], &second, Some(KEY));
    assert_eq!(over.status.code(), Some(1));
    assert!(text(&over.stderr).contains("already holds a database"));
    let verified = operator(&["audit", "verify"], &second, Some(KEY));
    assert!(verified.status.success(), "{}", text(&verified.stdout));
    assert!(text(&verified.stdout).contains("intact"));

    let server = Server::start(&dir_args(&second), &[("WOR_ENCRYPTION_KEY", KEY)]);
    run_greeter(&server, &owner);
    let listed = server.client(&owner, &["run", "list", "--routine", "greeter"]);
    assert_eq!(
        text(&listed.stdout).lines().count(),
        2,
        "{}",
        text(&listed.stdout)
    );
    server.stop();
    let verified = operator(&["audit", "verify"], &second, Some(KEY));
    assert!(verified.status.success(), "{}", text(&verified.stdout));

    // Not a backup at all.
    let third = root.path().join("third");
    std::fs::create_dir_all(&third).unwrap();
    std::fs::copy(
        first.join("audit-signing.key"),
        third.join("audit-signing.key"),
    )
    .unwrap();
    let junk = root.path().join("junk.db");
    std::fs::write(&junk, "not a database").unwrap();
    let refused = operator(
        &["restore", "--from", &junk.display().to_string()],
        &third,
        Some(KEY),
    );
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        text(&refused.stderr).contains("not a Work on Repeat backup"),
        "{}",
        text(&refused.stderr)
    );
    assert!(!third.join("wor.db").exists());
}

#[test]
fn a_postgres_backup_names_pg_dump() {
    let root = tempfile::tempdir().unwrap();
    let out = run(&mut wor(&[
        "backup",
        "--to",
        &root.path().join("b.db").display().to_string(),
        "--data-dir",
        &root.path().display().to_string(),
        "--database",
        "postgres://wor@127.0.0.1:1/none",
    ]));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("pg_dump"),
        "{}",
        text(&out.stderr)
    );
    assert!(!root.path().join("b.db").exists());
}
