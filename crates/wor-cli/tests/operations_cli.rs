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
use std::path::{Path, PathBuf};

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

/// `wor restore --from from --data-dir data_dir`, both keys given in the environment: a data
/// dir that is not there yet has no key file to read.
fn restore_with_keys(
    from: &Path,
    data_dir: &Path,
    encryption_key: &str,
    audit_signing_key: &str,
) -> std::process::Output {
    run(wor(&[
        "restore",
        "--from",
        &from.display().to_string(),
        "--data-dir",
        &data_dir.display().to_string(),
    ])
    .env("WOR_ENCRYPTION_KEY", encryption_key)
    .env("WOR_AUDIT_SIGNING_KEY", audit_signing_key))
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
    common::create_model_connection(&server, &owner, MODEL_KEY);
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
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(&second)
        .unwrap();
    std::fs::copy(
        first.join("audit-signing.key"),
        second.join("audit-signing.key"),
    )
    .unwrap();
    // A backup that is not there is the mistake named, whatever else is missing.
    let missing = root.path().join("nope.db");
    let nowhere = operator(
        &["restore", "--from", missing.to_str().unwrap()],
        &second,
        None,
    );
    assert_eq!(nowhere.status.code(), Some(2), "{}", text(&nowhere.stderr));
    assert!(
        text(&nowhere.stderr).contains("no backup file at"),
        "{}",
        text(&nowhere.stderr)
    );
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
    // Refused into a data dir it made, parents and all: none of them is left.
    let signing_key = std::fs::read_to_string(first.join("audit-signing.key")).unwrap();
    let nested = root.path().join("fresh").join("a").join("data");
    let refused = restore_with_keys(&backup, &nested, OTHER_KEY, signing_key.trim());
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    assert!(
        text(&refused.stderr).contains("wrong encryption key"),
        "{}",
        text(&refused.stderr)
    );
    assert!(
        !root.path().join("fresh").exists(),
        "a refused restore leaves no directory it made"
    );
    // Another audit signing key: the checkpoints are said to be another key's, not tampered.
    let (_, stranger) = wor_secrets::AuditSigningKey::generate().unwrap();
    let refused = restore_with_keys(
        &backup,
        &nested,
        KEY,
        secrecy::ExposeSecret::expose_secret(&stranger),
    );
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    let said = text(&refused.stderr);
    assert!(
        said.contains("are signed by key") && !said.contains("is broken"),
        "{said}"
    );
    assert!(!root.path().join("fresh").exists());
    // A copy whose audit log was opened to edits (its append-only triggers dropped) is not a
    // backup to restore: the migrations, recorded as run, would not make them again.
    let opened = root.path().join("opened.db");
    std::fs::copy(&backup, &opened).unwrap();
    rusqlite::Connection::open(&opened)
        .unwrap()
        .execute_batch(
            "DROP TRIGGER audit_entries_no_update; DROP TRIGGER audit_entries_no_delete;",
        )
        .unwrap();
    let refused = restore_with_keys(&opened, &nested, KEY, signing_key.trim());
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    assert!(
        text(&refused.stderr)
            .contains("append-only were altered (`audit_entries_no_update` missing"),
        "{}",
        text(&refused.stderr)
    );
    assert!(!root.path().join("fresh").exists());

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
    assert!(text(&over.stderr).contains("is there already (a database or its journal files)"));
    let verified = operator(&["audit", "verify"], &second, Some(KEY));
    assert!(verified.status.success(), "{}", text(&verified.stdout));
    assert!(text(&verified.stdout).contains("intact"));

    // Started without the key its secrets were sealed under, it refuses to make a new one;
    // started with another key, or another audit signing key, it refuses as well.
    let refused_start = |envs: &[(&str, &str)]| {
        let mut refused = wor(&[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            &second.display().to_string(),
        ])
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
        let began = std::time::Instant::now();
        let status = loop {
            if let Some(status) = refused.try_wait().unwrap() {
                break status;
            }
            if began.elapsed() > std::time::Duration::from_secs(60) {
                refused.kill().unwrap();
                panic!("a server started on a database its keys do not open: {envs:?}");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let mut refusal = String::new();
        std::io::Read::read_to_string(&mut refused.stderr.take().unwrap(), &mut refusal).unwrap();
        assert_eq!(status.code(), Some(1), "{refusal}");
        refusal
    };
    let refusal = refused_start(&[]);
    assert!(
        refusal.contains("holds 1 sealed secret(s), but WOR_ENCRYPTION_KEY is not set"),
        "{refusal}"
    );
    let (_, other_key) = wor_secrets::KeyRing::generate().unwrap();
    let other_key = secrecy::ExposeSecret::expose_secret(&other_key).to_owned();
    let refusal = refused_start(&[("WOR_ENCRYPTION_KEY", &other_key)]);
    assert!(
        refusal.contains("holds 1 secret(s) sealed under key")
            && refusal.contains("which neither WOR_ENCRYPTION_KEY"),
        "{refusal}"
    );
    let (_, other_signer) = wor_secrets::AuditSigningKey::generate().unwrap();
    let other_signer = secrecy::ExposeSecret::expose_secret(&other_signer).to_owned();
    let refusal = refused_start(&[
        ("WOR_ENCRYPTION_KEY", KEY),
        ("WOR_AUDIT_SIGNING_KEY", &other_signer),
    ]);
    assert!(
        refusal.contains("the newest audit checkpoint is signed by key"),
        "{refusal}"
    );
    assert!(!second.join(wor_secrets::DEV_KEY_FILE_NAME).exists());

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

    // A log a database left in the data dir would be read into the restored copy: refused,
    // and left as it was; so is a data dir any user may write to.
    std::fs::write(third.join("wor.db-wal"), "left over").unwrap();
    let refused = operator(&["restore", "--from", &backup_text], &third, Some(KEY));
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    assert!(
        text(&refused.stderr).contains("wor.db-wal` is there already"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(third.join("wor.db-wal")).unwrap(),
        "left over"
    );
    std::fs::remove_file(third.join("wor.db-wal")).unwrap();
    let open_dir = root.path().join("open");
    std::fs::create_dir(&open_dir).unwrap();
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let refused = restore_with_keys(&backup, &open_dir, KEY, signing_key.trim());
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    // Said by the first of the restore's steps to look in it: the key files' or the database's.
    let said = text(&refused.stderr);
    assert!(
        said.contains("any user may write to it") || said.contains("may be written by any user"),
        "{said}"
    );
    assert!(!open_dir.join("wor.db").exists());

    // A device that never ends, and a FIFO no one writes to, are refused before any of them is
    // read (opening the FIFO would wait for a writer).
    let fifo = root.path().join("fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    for device in ["/dev/zero".to_owned(), fifo.display().to_string()] {
        let refused = operator(&["restore", "--from", &device], &third, Some(KEY));
        assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
        assert!(
            text(&refused.stderr).contains("it is not a regular file"),
            "{device}: {}",
            text(&refused.stderr)
        );
    }

    // An SQLite database of something else is no backup, though migrations would fit it.
    let foreign = root.path().join("foreign.db");
    rusqlite::Connection::open(&foreign)
        .unwrap()
        .execute_batch("CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('x');")
        .unwrap();
    let refused = operator(
        &["restore", "--from", &foreign.display().to_string()],
        &third,
        Some(KEY),
    );
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    assert!(
        text(&refused.stderr).contains("an SQLite database of something else"),
        "{}",
        text(&refused.stderr)
    );
    assert!(!third.join("wor.db").exists());

    // A backup cut short (a copy that stopped part way) is refused at once, and the data dir
    // the restore would have made is not left behind, empty.
    let whole = std::fs::read(&backup).unwrap();
    let cut = root.path().join("cut.db");
    std::fs::write(&cut, &whole[..whole.len() / 2]).unwrap();
    let fourth = root.path().join("fourth");
    let started = std::time::Instant::now();
    let refused = restore_with_keys(&cut, &fourth, KEY, signing_key.trim());
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    let said = text(&refused.stderr);
    assert!(
        said.contains("is not a Work on Repeat backup: it is cut short"),
        "{said}"
    );
    assert!(!said.contains("pool timed out"), "{said}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "refused after {:?}",
        started.elapsed()
    );
    assert!(!fourth.exists(), "a refused restore leaves no data dir");
}

#[test]
fn a_traces_section_serve_cannot_use_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    for (section, says) in [
        (
            "[traces]\nendpoint = \"ftp://127.0.0.1:4318/v1/traces\"\nallowed_cidrs = [\"127.0.0.1/32\"]\n",
            "is not an http or https URL",
        ),
        (
            "[traces]\nendpoint = \"http://[::1\"\nallowed_cidrs = [\"127.0.0.1/32\"]\n",
            "is not an http or https URL",
        ),
    ] {
        std::fs::write(&config, section).unwrap();
        let out = run(wor(&[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            &dir.path().display().to_string(),
            "--config",
            &config.display().to_string(),
        ])
        .env("WOR_ENCRYPTION_KEY", KEY));
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
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

// ---------------------------------------------------------------------------------------------
// Metrics: `GET /metrics` on the operator's `[metrics] listen`.

/// Calls `routine__helper`, which waits for a person (mode `confirm`), then answers.
const CALLER: &str = r#"
name = "caller"
instructions = "Ask the helper."

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
when = { last_tool_result_contains = "Hello" }
text = "Done."
usage = { input_tokens = 10, output_tokens = 5 }
repeat = true

[[model.script.turns]]
tool_calls = [{ name = "routine__helper", arguments = { input = "hi" } }]
usage = { input_tokens = 10, output_tokens = 5 }
repeat = true

[[tools]]
tool = "routine/helper"
mode = "confirm"
"#;

fn helper_routine(name: &str) -> String {
    format!(
        "name = \"{name}\"\ninstructions = \"Greet.\"\n\n[model]\nprovider = \"replay\"\n\
         model = \"script\"\n\n[[model.script.turns]]\ntext = \"Hello from {name}.\"\n\
         usage = {{ input_tokens = 3, output_tokens = 2 }}\nrepeat = true\n"
    )
}

/// One HTTP/1.1 exchange on loopback; the whole response.
fn http(addr: &str, request: &str) -> String {
    use std::io::{Read as _, Write as _};
    #[expect(
        clippy::disallowed_methods,
        reason = "the test talks to its own server on loopback"
    )]
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// The exposition as `series -> value` (`name{labels}` as written), comments left out.
fn scrape(addr: &str) -> std::collections::BTreeMap<String, f64> {
    let response = http(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n",
    );
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap();
            (series.to_owned(), value.parse::<f64>().unwrap())
        })
        .collect()
}

fn value(metrics: &std::collections::BTreeMap<String, f64>, series: &str) -> f64 {
    metrics.get(series).copied().unwrap_or(0.0)
}

/// Scrapes until `ready` holds of the exposition, or fails after 30 s: a worker counts a run's
/// end just after the end's commit, which its followers and `run get` may see first.
fn scrape_until(
    addr: &str,
    ready: impl Fn(&std::collections::BTreeMap<String, f64>) -> bool,
) -> std::collections::BTreeMap<String, f64> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let now = scrape(addr);
        if ready(&now) {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the metrics never settled: {now:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn wait_for_status(server: &Server, key: &str, run: &str, status: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let shown = server.client(key, &["run", "get", run, "--json"]);
        let view: serde_json::Value = serde_json::from_slice(&shown.stdout)
            .unwrap_or_else(|_| panic!("{}", text(&shown.stderr)));
        if view["status"] == status {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "run {run} is {} not {status}",
            view["status"]
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn metrics_addr(server: &Server) -> String {
    let log = server.log.lock().unwrap().clone();
    log.lines()
        .find_map(|l| l.strip_prefix("wor: metrics on http://"))
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics listener: {log}"))
        .to_owned()
}

#[test]
fn metrics_move_by_exactly_a_held_approved_run_and_a_thousand_routines_add_no_series() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(&config, "[metrics]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let mut db = common::database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[]);
    let metrics = metrics_addr(&server);
    assert_ne!(metrics, server.url.trim_start_matches("http://"));
    let api_answer = http(
        server.url.trim_start_matches("http://"),
        "GET /metrics HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n",
    );
    assert!(
        !api_answer.contains("wor_runs"),
        "the API listener serves no metrics"
    );
    let approver = server.client(&owner, &["member", "create", "pat", "--role", "approver"]);
    assert!(approver.status.success(), "{}", text(&approver.stderr));
    let approver = text(&approver.stdout).trim().to_owned();
    for (name, toml) in [
        ("helper", helper_routine("helper")),
        ("caller", CALLER.to_owned()),
    ] {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let applied = server.client(
            &owner,
            &["routine", "apply", "-f", &file.display().to_string()],
        );
        assert!(applied.status.success(), "{}", text(&applied.stderr));
    }

    let before = scrape(&metrics);
    let started = server.client(&owner, &["run", "start", "caller", "--input", "go"]);
    assert!(started.status.success(), "{}", text(&started.stderr));
    let run = text(&started.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &run, "waiting_for_approval");
    let held = scrape(&metrics);
    assert_eq!(value(&held, "wor_approvals_pending"), 1.0);
    assert!(value(&held, "wor_approval_oldest_pending_age_seconds") >= 0.0);
    let delta = |now: &std::collections::BTreeMap<String, f64>, series: &str| {
        value(now, series) - value(&before, series)
    };
    assert_eq!(
        delta(&held, r#"wor_tool_calls_total{decision="confirm"}"#),
        1.0
    );
    assert_eq!(
        delta(&held, r#"wor_runs_started_total{trigger="api"}"#),
        1.0
    );
    assert_eq!(
        delta(
            &held,
            r#"wor_runs_finished_total{status="succeeded",trigger="api"}"#
        ),
        0.0
    );

    let listed = server.client(&approver, &["approvals", "list", "--json"]);
    let approvals: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let approval = approvals
        .as_array()
        .or_else(|| approvals["approvals"].as_array())
        .unwrap()[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let approved = server.client(
        &approver,
        &["approvals", "approve", &approval, "--reason", "expected"],
    );
    assert!(approved.status.success(), "{}", text(&approved.stderr));
    wait_for_status(&server, &owner, &run, "succeeded");

    let after = scrape_until(&metrics, |now| {
        delta(now, r#"wor_run_duration_seconds_count{status="succeeded"}"#) >= 2.0
    });
    for (series, expected) in [
        (r#"wor_runs_started_total{trigger="api"}"#, 1.0),
        (r#"wor_runs_started_total{trigger="routine"}"#, 1.0),
        (
            r#"wor_runs_finished_total{status="succeeded",trigger="api"}"#,
            1.0,
        ),
        (
            r#"wor_runs_finished_total{status="succeeded",trigger="routine"}"#,
            1.0,
        ),
        (r#"wor_tool_calls_total{decision="confirm"}"#, 1.0),
        (r#"wor_tool_calls_total{decision="allow"}"#, 0.0),
        (r#"wor_tool_calls_total{decision="deny"}"#, 0.0),
        (r#"wor_approvals_decided_total{outcome="approved"}"#, 1.0),
        (r#"wor_approvals_decided_total{outcome="denied"}"#, 0.0),
        // The caller's two turns and the helper's one.
        (r#"wor_model_calls_total{provider="replay"}"#, 3.0),
        (
            r#"wor_model_tokens_total{provider="replay",direction="input"}"#,
            10.0 + 10.0 + 3.0,
        ),
        (
            r#"wor_model_tokens_total{provider="replay",direction="output"}"#,
            5.0 + 5.0 + 2.0,
        ),
        ("wor_run_queue_lag_seconds_count", 2.0),
        (r#"wor_run_duration_seconds_count{status="succeeded"}"#, 2.0),
    ] {
        assert_eq!(delta(&after, series), expected, "{series}");
    }
    assert_eq!(value(&after, "wor_approvals_pending"), 0.0);
    assert_eq!(
        value(&after, "wor_approval_oldest_pending_age_seconds"),
        0.0
    );
    assert!(delta(&after, "wor_audit_append_seconds_count") >= 1.0);
    assert!(value(&after, "wor_db_pool_max_connections") >= 1.0);

    // A thousand routines, three of them run: not one series more.
    let series = after.len();
    let api = server.url.trim_start_matches("http://").to_owned();
    for n in 0..1000 {
        let body = serde_json::json!({ "toml": helper_routine(&format!("bulk-{n}")) }).to_string();
        let answer = http(
            &api,
            &format!(
                "POST /v1/routines HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer {owner}\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        );
        assert!(answer.starts_with("HTTP/1.1 20"), "{answer}");
    }
    for n in [0, 499, 999] {
        let out = server.client(
            &owner,
            &[
                "run",
                "start",
                &format!("bulk-{n}"),
                "--input",
                "hi",
                "--follow",
            ],
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let bulk = scrape_until(&metrics, |now| {
        delta(now, r#"wor_run_duration_seconds_count{status="succeeded"}"#) >= 2.0 + 3.0
    });
    assert_eq!(
        delta(
            &bulk,
            r#"wor_runs_finished_total{status="succeeded",trigger="api"}"#
        ),
        1.0 + 3.0
    );
    let names: Vec<&String> = bulk.keys().filter(|k| !after.contains_key(*k)).collect();
    assert_eq!(bulk.len(), series, "new series: {names:?}");
    assert!(
        !bulk
            .keys()
            .any(|k| k.contains("bulk-") || k.contains("caller") || k.contains("helper")),
        "a routine name in a label"
    );
    server.stop();
}

// ---------------------------------------------------------------------------------------------
// `wor doctor`: the readiness report.

fn doctor(args: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, serde_json::Value) {
    let mut all = vec!["doctor", "--json"];
    all.extend_from_slice(args);
    let out = run(wor(&all).envs(envs.iter().copied()));
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}{}", text(&out.stdout), text(&out.stderr)));
    (out.status.code(), report)
}

fn status<'a>(report: &'a serde_json::Value, name: &str) -> (&'a str, &'a str) {
    let found = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no `{name}` check: {report}"));
    (
        found["status"].as_str().unwrap(),
        found["detail"].as_str().unwrap(),
    )
}

#[test]
fn doctor_reports_readiness_with_an_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let db = common::database_args(dir.path());
    let db: Vec<&str> = db.iter().map(String::as_str).collect();
    let sandbox_ready = {
        let (code, report) = doctor(&["--sandbox-only"], &[]);
        assert_eq!(code == Some(0), report["ready"] == true, "{report}");
        report["ready"] == true
    };

    // Nothing set up yet: the database is missing (SQLite) or empty, and nothing is created.
    let empty = tempfile::tempdir().unwrap();
    let empty_dir = empty.path().display().to_string();
    let (code, report) = doctor(&["--data-dir", &empty_dir], &[]);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(report["ready"], false);
    assert_eq!(status(&report, "database").0, "fail", "{report}");
    assert!(
        !empty.path().join("wor.db").exists(),
        "doctor created a database"
    );
    assert!(
        !empty.path().join("encryption.key").exists(),
        "doctor created a key"
    );

    let owner = common::create_project(&db.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    assert!(owner.starts_with("wor_"), "{owner}");
    let (code, report) = doctor(&db, &[]);
    assert_eq!(status(&report, "encryption-key").0, "warn", "{report}");
    assert!(
        status(&report, "encryption-key")
            .1
            .contains("would generate one")
    );
    assert_eq!(code == Some(0), sandbox_ready, "{report}");
    // Verifying a vault with nothing sealed makes no key; a server's first start would.
    let mut verify = vec!["secrets", "verify"];
    verify.extend_from_slice(&db);
    assert!(run(&mut wor(&verify)).status.success());
    assert!(!dir.path().join(wor_secrets::DEV_KEY_FILE_NAME).exists());
    wor_secrets::load_or_create_dev_key(dir.path()).unwrap();
    let (code, report) = doctor(&db, &[]);
    let (database, detail) = status(&report, "database");
    assert_eq!(database, "ok", "{report}");
    assert!(detail.contains("migrations current"), "{detail}");
    assert_eq!(status(&report, "clock-skew").0, "ok", "{report}");
    assert_eq!(status(&report, "disk").0, "ok", "{report}");
    let (key, detail) = status(&report, "encryption-key");
    assert_eq!(key, "warn", "a development key file: {report}");
    assert!(detail.contains("day(s) old"), "{detail}");
    assert_eq!(code == Some(0), sandbox_ready, "{report}");
    // A key file `wor serve` would refuse, readable by others, is not ready either.
    let set_mode = |name: &str, mode: u32| {
        std::fs::set_permissions(dir.path().join(name), std::fs::Permissions::from_mode(mode))
            .unwrap();
    };
    for (name, check, before) in [
        (wor_secrets::DEV_KEY_FILE_NAME, "encryption-key", "warn"),
        (
            wor_secrets::AUDIT_SIGNING_KEY_FILE_NAME,
            "audit-signing-key",
            "ok",
        ),
        (
            wor_secrets::CONTROL_PLANE_SIGNING_KEY_FILE_NAME,
            "control-plane-key",
            "ok",
        ),
    ] {
        if !dir.path().join(name).exists() {
            if name == wor_secrets::AUDIT_SIGNING_KEY_FILE_NAME {
                wor_secrets::AuditSigningKey::load_or_create(dir.path()).unwrap();
            } else {
                wor_secrets::ControlPlaneSigningKey::load_or_create(dir.path()).unwrap();
            }
        }
        assert_eq!(status(&doctor(&db, &[]).1, check).0, before);
        set_mode(name, 0o644);
        let (code, report) = doctor(&db, &[]);
        let (state, detail) = status(&report, check);
        assert_eq!((state, code), ("fail", Some(1)), "{report}");
        assert!(detail.contains("644"), "{detail}");
        set_mode(name, 0o600);
    }

    // Production without a real key is not ready, whatever else is.
    let (code, report) = doctor(&db, &[("WOR_ENV", "production")]);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(status(&report, "encryption-key").0, "fail");
    assert_eq!(status(&report, "production").0, "fail");
    let (code, report) = doctor(
        &db,
        &[("WOR_ENV", "production"), ("WOR_ENCRYPTION_KEY", KEY)],
    );
    let (key, detail) = status(&report, "encryption-key");
    assert_eq!(key, "ok", "{report}");
    assert!(detail.contains("age is not known"), "{detail}");
    assert!(
        !report.to_string().contains(KEY),
        "the key is never printed"
    );
    let production_ok = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["check"] != "production");
    // A PostgreSQL URL without a password is a production problem of its own.
    let on_postgres = db.contains(&"--database");
    assert_eq!(production_ok, !on_postgres, "{report}");
    assert_eq!(code == Some(0), sandbox_ready && production_ok, "{report}");
    assert!(
        report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["check"] != "tls"),
        "no TLS configured, no TLS check"
    );

    // The listener's certificate: its expiry is reported; an expired one fails.
    let certs = tempfile::tempdir().unwrap();
    let config = certs.path().join("wor.toml");
    let write_tls = |cert: &str, key: &str| {
        write_tls_config(certs.path(), cert, key);
    };
    let fresh = generated_certificate();
    write_tls(&fresh.cert, &fresh.key);
    let config_text = config.display().to_string();
    let mut with_tls = db.clone();
    with_tls.extend(["--config", config_text.as_str()]);
    let (_, report) = doctor(&with_tls, &[]);
    let (tls, detail) = status(&report, "tls");
    assert_eq!(tls, "ok", "{report}");
    assert!(detail.contains("expires in"), "{detail}");
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    params.not_before = rcgen::date_time_ymd(2019, 1, 1);
    params.not_after = rcgen::date_time_ymd(2020, 1, 1);
    let key = rcgen::KeyPair::generate().unwrap();
    let expired = params.self_signed(&key).unwrap();
    write_tls(&expired.pem(), &key.serialize_pem());
    let (code, report) = doctor(&with_tls, &[]);
    let (tls, detail) = status(&report, "tls");
    assert_eq!((tls, code), ("fail", Some(1)), "{report}");
    assert!(detail.contains("expired"), "{detail}");
    write_tls(&fresh.cert, "not a key");
    let (code, report) = doctor(&with_tls, &[]);
    assert_eq!(
        (status(&report, "tls").0, code),
        ("fail", Some(1)),
        "{report}"
    );

    // Metrics served on every address, to anyone who asks: a warning, not a failure.
    std::fs::write(&config, "[metrics]\nlisten = \"0.0.0.0:0\"\n").unwrap();
    let (_, report) = doctor(&with_tls, &[]);
    let (metrics, detail) = status(&report, "metrics");
    assert_eq!(metrics, "warn", "{report}");
    assert!(detail.contains("every address of this host"), "{detail}");

    // An `[egress]` or `[traces]` section `wor serve` refuses fails here too, among them a
    // collector at an address its own `allowed_cidrs` leave closed.
    for (section, check, says) in [
        (
            "[egress]\nallowed_cidrs = [\"garbage\"]\n",
            "egress",
            "[egress]",
        ),
        (
            "[traces]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nallowed_cidrs = [\"bad\"]\n",
            "traces",
            "allowed_cidrs",
        ),
        (
            "[traces]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\n",
            "traces",
            "127.0.0.1",
        ),
    ] {
        std::fs::write(&config, section).unwrap();
        let (code, report) = doctor(&with_tls, &[]);
        let (state, detail) = status(&report, check);
        assert_eq!((state, code), ("fail", Some(1)), "{section}: {report}");
        assert!(detail.contains(says), "{section}: {detail}");
    }
    std::fs::write(
        &config,
        "[egress]\nallowed_cidrs = [\"10.1.0.0/16\"]\n[traces]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nallowed_cidrs = [\"127.0.0.1/32\"]\n",
    )
    .unwrap();
    let (_, report) = doctor(&with_tls, &[]);
    assert_eq!(status(&report, "egress").0, "ok", "{report}");
    assert_eq!(status(&report, "traces").0, "ok", "{report}");

    // A listener address that no interface of this host has fails, as `wor serve` would fail
    // to bind it (unless the host is set to bind addresses it does not have).
    let binds_any_address = std::fs::read_to_string("/proc/sys/net/ipv4/ip_nonlocal_bind")
        .is_ok_and(|value| value.trim() != "0");
    if binds_any_address {
        eprintln!("not checked: this host binds addresses it does not have (ip_nonlocal_bind)");
    } else {
        std::fs::write(&config, "[metrics]\nlisten = \"192.0.2.1:9090\"\n").unwrap();
        let (code, report) = doctor(&with_tls, &[]);
        let (metrics, detail) = status(&report, "metrics");
        assert_eq!((metrics, code), ("fail", Some(1)), "{report}");
        assert!(detail.contains("no interface of this host"), "{detail}");
        let (code, report) = doctor(&with_tls, &[("WOR_LISTEN", "192.0.2.1:8080")]);
        let (listen, detail) = status(&report, "listen");
        assert_eq!((listen, code), ("fail", Some(1)), "{report}");
        assert!(detail.contains("no interface of this host"), "{detail}");
    }
    // An address another process holds warns: it may be `wor serve` itself.
    let holder = || {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap().to_string();
        (held, addr)
    };
    let ((_api_held, api), (_metrics_held, metrics)) = (holder(), holder());
    std::fs::write(&config, format!("[metrics]\nlisten = \"{metrics}\"\n")).unwrap();
    let (code, report) = doctor(&with_tls, &[("WOR_LISTEN", &api)]);
    for (name, addr) in [("metrics", &metrics), ("listen", &api)] {
        let (state, detail) = status(&report, name);
        assert_eq!(state, "warn", "{report}");
        assert!(detail.contains(&format!("{addr} is in use")), "{detail}");
    }
    assert_eq!(code == Some(0), sandbox_ready, "warnings only: {report}");
    // The API and the metrics on one address: each binds alone, but not both.
    let free = holder().1;
    std::fs::write(&config, format!("[metrics]\nlisten = \"{free}\"\n")).unwrap();
    let (code, report) = doctor(&with_tls, &[("WOR_LISTEN", &free)]);
    let (metrics, detail) = status(&report, "metrics");
    assert_eq!((metrics, code), ("fail", Some(1)), "{report}");
    assert!(detail.contains("is where the API listens too"), "{detail}");

    // A certificate clients would refuse by its kind or its names warns: a CA's, one that
    // names no host.
    let write_signed = |params: rcgen::CertificateParams| {
        let key = rcgen::KeyPair::generate().unwrap();
        write_tls(
            &params.self_signed(&key).unwrap().pem(),
            &key.serialize_pem(),
        );
    };
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    write_signed(params);
    let (code, report) = doctor(&with_tls, &[]);
    let (tls, detail) = status(&report, "tls");
    assert_eq!(tls, "warn", "{report}");
    assert_eq!(code == Some(0), sandbox_ready, "warnings only: {report}");
    assert!(
        detail.contains("is a CA certificate") && detail.contains("names no host"),
        "{detail}"
    );

    // A file with the key before the certificate is read as `wor serve` reads it: the first
    // certificate in it.
    write_tls(&format!("{}{}", fresh.key, fresh.cert), &fresh.key);
    let (_, report) = doctor(&with_tls, &[]);
    let (tls, detail) = status(&report, "tls");
    assert_eq!(tls, "ok", "{report}");
    assert!(detail.contains("expires in"), "{detail}");
    // One not valid yet fails: clients refuse it until then.
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    let (year, month, day) = day_from_now(3);
    params.not_before = rcgen::date_time_ymd(year, month, day);
    params.not_after = rcgen::date_time_ymd(2099, 1, 1);
    write_signed(params);
    let (code, report) = doctor(&with_tls, &[]);
    let (tls, detail) = status(&report, "tls");
    assert_eq!((tls, code), ("fail", Some(1)), "{report}");
    assert!(detail.contains("is not valid yet"), "{detail}");
}

#[test]
fn doctor_fails_an_audit_log_that_is_no_longer_append_only() {
    let dir = tempfile::tempdir().unwrap();
    let db = common::database_args(dir.path());
    common::create_project(&db);
    let url = common::database_url(&db, dir.path());
    let args: Vec<&str> = db.iter().map(String::as_str).collect();
    let (_, report) = doctor(&args, &[]);
    assert_eq!(status(&report, "audit").0, "ok", "{report}");
    // Someone with the database's credentials drops the triggers that refuse edits.
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = wor_store::Store::connect(&url).await.unwrap();
        wor_store::testing::unguard_audit(&store).await.unwrap();
        store.close().await;
    });
    let (code, report) = doctor(&args, &[]);
    let (audit, detail) = status(&report, "audit");
    assert_eq!((audit, code), ("fail", Some(1)), "{report}");
    assert!(
        detail.contains("not append-only") && detail.contains("missing"),
        "{detail}"
    );
}

#[test]
fn doctor_compares_the_keys_with_the_database_as_serve_does() {
    let dir = tempfile::tempdir().unwrap();
    let db = common::database_args(dir.path());
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[("WOR_ENCRYPTION_KEY", KEY)]);
    common::create_model_connection(&server, &owner, MODEL_KEY);
    server.stop();
    let db: Vec<&str> = db.iter().map(String::as_str).collect();
    let keys_in_use = |envs: &[(&str, &str)]| {
        let (code, report) = doctor(&db, envs);
        let (state, detail) = status(&report, "keys-in-use");
        (code, state.to_owned(), detail.to_owned())
    };

    let (_, state, detail) = keys_in_use(&[("WOR_ENCRYPTION_KEY", KEY)]);
    assert_eq!(state, "ok", "{detail}");
    assert!(
        detail.contains("the key ring opens all 1 sealed secret(s)")
            && detail.contains("signed the newest of"),
        "{detail}"
    );
    // Another encryption key, or none: `wor serve` would refuse, and so does doctor.
    let (code, state, detail) = keys_in_use(&[("WOR_ENCRYPTION_KEY", OTHER_KEY)]);
    assert_eq!((code, state.as_str()), (Some(1), "fail"), "{detail}");
    assert!(
        detail.contains("1 secret(s) sealed under key")
            && detail.contains("which neither WOR_ENCRYPTION_KEY"),
        "{detail}"
    );
    let (code, state, detail) = keys_in_use(&[]);
    assert_eq!((code, state.as_str()), (Some(1), "fail"), "{detail}");
    assert!(detail.contains("no encryption key is set"), "{detail}");
    // The key's own check says the same, rather than that a first start would make one.
    let (_, report) = doctor(&db, &[]);
    let (state, detail) = status(&report, "encryption-key");
    assert_eq!(state, "fail", "{report}");
    assert!(
        detail.contains("refuses to start without the key they were sealed under"),
        "{detail}"
    );
    // A development key file in the data dir, with no key set, is named as that file.
    wor_secrets::load_or_create_dev_key(dir.path()).unwrap();
    let (code, state, detail) = keys_in_use(&[]);
    assert_eq!((code, state.as_str()), (Some(1), "fail"), "{detail}");
    assert!(
        detail.contains("which neither the development key file")
            && detail.contains("WOR_ENCRYPTION_KEY is not set"),
        "{detail}"
    );
    std::fs::remove_file(dir.path().join(wor_secrets::DEV_KEY_FILE_NAME)).unwrap();
    // Another audit signing key than the one that signed the chain.
    let (_, other) = wor_secrets::AuditSigningKey::generate().unwrap();
    let other = secrecy::ExposeSecret::expose_secret(&other).to_owned();
    let (code, state, detail) = keys_in_use(&[
        ("WOR_ENCRYPTION_KEY", KEY),
        ("WOR_AUDIT_SIGNING_KEY", &other),
    ]);
    assert_eq!((code, state.as_str()), (Some(1), "fail"), "{detail}");
    assert!(
        detail.contains("the newest audit checkpoint is signed by key"),
        "{detail}"
    );
    // No audit signing key at all, where checkpoints are signed: serve would make one.
    let key_file = dir.path().join(wor_secrets::AUDIT_SIGNING_KEY_FILE_NAME);
    let kept = dir.path().join("kept-audit-signing.key");
    std::fs::rename(&key_file, &kept).unwrap();
    let (code, state, detail) = keys_in_use(&[("WOR_ENCRYPTION_KEY", KEY)]);
    assert_eq!((code, state.as_str()), (Some(1), "fail"), "{detail}");
    assert!(
        detail.contains("signed audit checkpoint(s), but WOR_AUDIT_SIGNING_KEY is not set"),
        "{detail}"
    );
    assert!(!key_file.exists(), "doctor made no key");
    std::fs::rename(&kept, &key_file).unwrap();
    assert_eq!(keys_in_use(&[("WOR_ENCRYPTION_KEY", KEY)]).1, "ok");

    // An embedded database's data dir that others may write to: refused by both.
    if !db.contains(&"--database") {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let (code, report) = doctor(&db, &[("WOR_ENCRYPTION_KEY", KEY)]);
        let (state, detail) = status(&report, "database");
        assert_eq!((code, state), (Some(1), "fail"), "{report}");
        assert!(
            detail.contains("may be written by any user (mode 0777)"),
            "{detail}"
        );
        let mut serve = vec!["serve", "--listen", "127.0.0.1:0"];
        serve.extend_from_slice(&db);
        let refused = run(wor(&serve).env("WOR_ENCRYPTION_KEY", KEY));
        assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
        assert!(
            text(&refused.stderr).contains("chmod o-w"),
            "{}",
            text(&refused.stderr)
        );
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// TLS on the listener.

struct Pem {
    cert: String,
    key: String,
    der: rustls::pki_types::CertificateDer<'static>,
}

/// The day `days` from now, for a certificate's validity.
fn day_from_now(days: i64) -> (i32, u8, u8) {
    let time = chrono::Utc::now() + chrono::Duration::days(days);
    (
        chrono::Datelike::year(&time),
        u8::try_from(chrono::Datelike::month(&time)).unwrap(),
        u8::try_from(chrono::Datelike::day(&time)).unwrap(),
    )
}

fn generated_certificate() -> Pem {
    let made =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    Pem {
        cert: made.cert.pem(),
        key: made.signing_key.serialize_pem(),
        der: made.cert.der().clone(),
    }
}

/// The listener's files in `dir`: `cert` and `key` (PEM) as `cert.pem` and `key.pem`, and a
/// `wor.toml` whose `[tls]` names them. Returns the certificate's path, the key's and the
/// configuration's.
fn write_tls_config(dir: &Path, cert: &str, key: &str) -> (PathBuf, PathBuf, PathBuf) {
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert).unwrap();
    std::fs::write(&key_path, key).unwrap();
    let config = dir.join("wor.toml");
    std::fs::write(
        &config,
        format!(
            "[tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            cert_path.display(),
            key_path.display()
        ),
    )
    .unwrap();
    (cert_path, key_path, config)
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

async fn tls_connect(addr: &str, trusted: &Pem) -> std::io::Result<Tls> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.der.clone()).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    #[expect(
        clippy::disallowed_methods,
        reason = "the test talks to its own server on loopback"
    )]
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await
}

/// One request on a kept-alive connection; the status line and body of its answer.
async fn get(stream: &mut Tls, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let read = stream.read(&mut chunk).await.unwrap();
        assert!(read > 0, "the connection closed");
        buffer.extend_from_slice(&chunk[..read]);
        let text = String::from_utf8_lossy(&buffer).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|n| n.trim().parse().unwrap())
                })
                .unwrap();
            if body.len() >= length {
                return (head.lines().next().unwrap().to_owned(), body.to_owned());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_serves_a_generated_certificate_and_reloads_it_on_sighup_keeping_connections() {
    let dir = tempfile::tempdir().unwrap();
    let first = generated_certificate();
    let (cert_path, key_path, config) = write_tls_config(dir.path(), &first.cert, &first.key);
    let mut db = dir_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let server = tokio::task::block_in_place(|| Server::start(&db, &[]));
    let addr = server
        .url
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("not https: {}", server.url))
        .to_owned();

    let mut kept = tls_connect(&addr, &first).await.unwrap();
    let (status, body) = get(&mut kept, "/healthz").await;
    assert!(status.contains("200"), "{status}");
    assert!(body.contains("ok"), "{body}");
    // Plaintext on the TLS port gets no HTTP answer.
    let plain = tokio::task::block_in_place(|| {
        http(
            &addr,
            "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
    });
    assert!(!plain.contains("200 OK"), "{plain}");

    // A new certificate, then SIGHUP: the open connection goes on, new ones get the new one.
    let second = generated_certificate();
    std::fs::write(&cert_path, &second.cert).unwrap();
    std::fs::write(&key_path, &second.key).unwrap();
    server.signal("-HUP");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !server
        .log
        .lock()
        .unwrap()
        .contains("TLS certificate reloaded")
    {
        assert!(std::time::Instant::now() < deadline, "no reload logged");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (status, _) = get(&mut kept, "/healthz").await;
    assert!(
        status.contains("200"),
        "the open connection survived: {status}"
    );
    assert!(
        tls_connect(&addr, &first).await.is_err(),
        "a new connection no longer gets the old certificate"
    );
    let mut fresh = tls_connect(&addr, &second).await.unwrap();
    let (status, _) = get(&mut fresh, "/healthz").await;
    assert!(status.contains("200"), "{status}");

    // A broken file on the next SIGHUP keeps the working certificate.
    std::fs::write(&key_path, "not a key").unwrap();
    server.signal("-HUP");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !server
        .log
        .lock()
        .unwrap()
        .contains("the previous certificate stays in use")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no failed reload logged"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut again = tls_connect(&addr, &second).await.unwrap();
    let (status, _) = get(&mut again, "/healthz").await;
    assert!(status.contains("200"), "{status}");

    // So does a certificate that has expired, or one not valid yet: every client would
    // refuse it, where the working one still serves.
    for (refused, phrase) in [
        ((-10, -2), "expired 2 day(s) ago: clients would refuse it"),
        ((2, 40), "hour(s) more: clients would refuse it"),
    ] {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .unwrap();
        let ((year, month, day), (to_year, to_month, to_day)) =
            (day_from_now(refused.0), day_from_now(refused.1));
        params.not_before = rcgen::date_time_ymd(year, month, day);
        params.not_after = rcgen::date_time_ymd(to_year, to_month, to_day);
        let key = rcgen::KeyPair::generate().unwrap();
        std::fs::write(&cert_path, params.self_signed(&key).unwrap().pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        server.signal("-HUP");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !server.log.lock().unwrap().contains(phrase) {
            assert!(
                std::time::Instant::now() < deadline,
                "no refused reload logged: {}",
                server.log.lock().unwrap()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let mut still = tls_connect(&addr, &second).await.unwrap();
        let (status, _) = get(&mut still, "/healthz").await;
        assert!(status.contains("200"), "{status}");
    }
    drop((kept, fresh, again));
    tokio::task::block_in_place(|| server.stop());
}

#[test]
fn the_cli_trusts_a_private_certificate_it_is_given_and_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let made = generated_certificate();
    let (cert_path, key_path, config) = write_tls_config(dir.path(), &made.cert, &made.key);
    let mut db = dir_args(dir.path());
    let owner = common::create_project(&db);
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let server = Server::start(&db, &[]);
    assert!(server.url.starts_with("https://"), "{}", server.url);
    let list = |extra: &[&str], ca_env: Option<&std::path::Path>| {
        let mut args = vec!["key", "list"];
        args.extend_from_slice(extra);
        let mut cmd = wor(&args);
        cmd.env("WOR_SERVER", &server.url)
            .env("WOR_API_KEY", &owner)
            .env_remove("SSL_CERT_FILE")
            .env_remove("SSL_CERT_DIR")
            .env_remove("WOR_CA_CERT");
        if let Some(path) = ca_env {
            cmd.env("WOR_CA_CERT", path);
        }
        run(&mut cmd)
    };

    // Not trusted by the system: refused, saying why.
    let refused = list(&[], None);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    assert!(
        text(&refused.stderr).contains("its TLS certificate is not trusted here")
            && text(&refused.stderr).contains("--ca-cert or WOR_CA_CERT"),
        "{}",
        text(&refused.stderr)
    );
    // Trusted when given, by flag or by variable.
    let cert_text = cert_path.display().to_string();
    let flagged = list(&["--ca-cert", &cert_text], None);
    assert!(flagged.status.success(), "{}", text(&flagged.stderr));
    assert!(
        text(&flagged.stdout).contains("owner"),
        "{}",
        text(&flagged.stdout)
    );
    let from_env = list(&[], Some(&cert_path));
    assert!(from_env.status.success(), "{}", text(&from_env.stderr));
    // Another certificate is not this server's.
    let other = dir.path().join("other.pem");
    std::fs::write(&other, generated_certificate().cert).unwrap();
    let wrong = list(&["--ca-cert", &other.display().to_string()], None);
    assert_eq!(wrong.status.code(), Some(1), "{}", text(&wrong.stdout));
    assert!(
        text(&wrong.stderr).contains("signed by none of the certificates --ca-cert"),
        "{}",
        text(&wrong.stderr)
    );
    // An empty variable is no file: the server is refused as untrusted, not the variable.
    let empty = list(&[], Some(std::path::Path::new("")));
    assert_eq!(empty.status.code(), Some(1), "{}", text(&empty.stderr));
    assert!(
        text(&empty.stderr).contains("not trusted here"),
        "{}",
        text(&empty.stderr)
    );
    // A certificate block whose content is damaged is named, before any request.
    let damaged = dir.path().join("damaged.pem");
    // Forty characters less of one line: whole base64, but DER whose lengths do not add up.
    let pem: String = made
        .cert
        .lines()
        .enumerate()
        .map(|(n, line)| match n {
            3 => format!("{}\n", &line[..line.len() - 40]),
            _ => format!("{line}\n"),
        })
        .collect();
    std::fs::write(&damaged, pem).unwrap();
    let refused = list(&["--ca-cert", &damaged.display().to_string()], None);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("certificate 1 does not parse"),
        "{}",
        text(&refused.stderr)
    );
    // A file that holds no certificate is a usage error, before any request.
    let refused = list(&["--ca-cert", &key_path.display().to_string()], None);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("holds no `BEGIN CERTIFICATE` block"),
        "{}",
        text(&refused.stderr)
    );
    let missing = list(&["--ca-cert", "/nonexistent/ca.pem"], None);
    assert_eq!(missing.status.code(), Some(2), "{}", text(&missing.stderr));

    // The other scheme's URL for the same server: said so.
    let plain_url = server.url.replacen("https://", "http://", 1);
    let wrong_scheme =
        run(wor(&["key", "list", "--server", &plain_url]).env("WOR_API_KEY", &owner));
    assert_eq!(
        wrong_scheme.status.code(),
        Some(1),
        "{}",
        text(&wrong_scheme.stdout)
    );
    assert!(
        text(&wrong_scheme.stderr).contains("if it serves TLS, give an https:// URL"),
        "{}",
        text(&wrong_scheme.stderr)
    );

    // A worker enrols with a control plane whose certificate it is given, and only then.
    let db_args: Vec<String> = dir_args(dir.path());
    let enroll = |worker: &std::path::Path, ca_cert: Option<&str>| {
        let token = common::create_token(&db_args);
        let worker = worker.display().to_string();
        let mut args = vec![
            "worker",
            "enroll",
            "--control-plane",
            server.url.as_str(),
            "--token",
            token.as_str(),
            "--data-dir",
            worker.as_str(),
        ];
        if let Some(ca_cert) = ca_cert {
            args.extend(["--ca-cert", ca_cert]);
        }
        run(wor(&args)
            .env_remove("SSL_CERT_FILE")
            .env_remove("SSL_CERT_DIR")
            .env_remove("WOR_CA_CERT"))
    };
    let untrusted = enroll(&dir.path().join("worker-a"), None);
    assert_eq!(
        untrusted.status.code(),
        Some(1),
        "{}",
        text(&untrusted.stdout)
    );
    assert!(
        text(&untrusted.stderr).contains("the enrolment did not go through")
            && text(&untrusted.stderr).contains("not trusted here"),
        "{}",
        text(&untrusted.stderr)
    );
    let enrolled = enroll(&dir.path().join("worker-b"), Some(&cert_text));
    assert!(enrolled.status.success(), "{}", text(&enrolled.stderr));

    // The enrolment records the file it trusted, and the worker trusts it with no
    // WOR_CA_CERT of its own: it reaches the control plane and says so.
    let worker_dir = dir.path().join("worker-b");
    let enrolment: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(worker_dir.join("worker-enrolment.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(enrolment["ca_cert"], cert_text.as_str(), "{enrolment}");
    let worker = Server::try_spawn_within(
        &[
            "serve",
            "--role",
            "worker",
            "--data-dir",
            worker_dir.to_str().unwrap(),
        ],
        &[],
        "wor: worker ",
        std::time::Duration::from_secs(20),
    )
    .unwrap_or_else(|why| panic!("the worker did not reach its control plane: {why}"));
    worker.stop();

    // A self-signed certificate that is a CA (what `openssl req -x509` makes by default) is
    // refused by TLS as a server's own, whatever is trusted: the message says so.
    let mut params =
        rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let key = rcgen::KeyPair::generate().unwrap();
    let authority = params.self_signed(&key).unwrap();
    std::fs::write(&cert_path, authority.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    server.signal("-HUP");
    server.wait_logged(
        "TLS certificate reloaded",
        std::time::Duration::from_secs(10),
    );
    let refused = list(&["--ca-cert", &cert_text], None);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    assert!(
        text(&refused.stderr).contains("is a CA certificate"),
        "{}",
        text(&refused.stderr)
    );
    assert!(
        !text(&refused.stderr).contains("rustls_platform_verifier"),
        "the verifier's own log line is not shown: {}",
        text(&refused.stderr)
    );
    server.stop();
}

#[test]
fn serve_warns_of_a_listener_certificate_near_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    let (year, month, day) = day_from_now(3);
    params.not_after = rcgen::date_time_ymd(year, month, day);
    let key = rcgen::KeyPair::generate().unwrap();
    let (_, _, config) = write_tls_config(
        dir.path(),
        &params.self_signed(&key).unwrap().pem(),
        &key.serialize_pem(),
    );
    let mut db = dir_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let server = Server::start(&db, &[]);
    server.wait_logged("expires in", std::time::Duration::from_secs(10));
    // A certificate reloaded by SIGHUP is judged as one read at the start: a CA's that names
    // no host is warned of.
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let key = rcgen::KeyPair::generate().unwrap();
    write_tls_config(
        dir.path(),
        &params.self_signed(&key).unwrap().pem(),
        &key.serialize_pem(),
    );
    server.signal("-HUP");
    server.wait_logged("names no host", std::time::Duration::from_secs(10));
    let log = server.stop();
    assert!(log.contains("renew it, then reload with SIGHUP"), "{log}");
    assert!(log.contains("is a CA certificate"), "{log}");
}

#[test]
fn production_refuses_a_plaintext_listener_on_a_public_address() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().display().to_string();
    let out = run(wor(&[
        "serve",
        "--production",
        "--listen",
        "0.0.0.0:0",
        "--data-dir",
        &data,
    ])
    .env("WOR_ENCRYPTION_KEY", KEY));
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("plaintext on a non-loopback address") && stderr.contains("behind_proxy"),
        "{stderr}"
    );
}

// ---------------------------------------------------------------------------------------------
// Logs: fixed fields only, at every level.

#[test]
fn a_run_logged_at_trace_level_leaves_no_prompt_input_tool_content_or_secret_in_the_log() {
    const PROMPT: &str = "prompt-canary-4d1c9e";
    const INPUT: &str = "input-canary-7b3a10";
    const TOOL_TEXT: &str = "tool-content-canary-e52f08";
    const ANSWER: &str = "answer-canary-91c6d4";
    const REASON: &str = "reason-canary-2a7f3b";
    const SECRET: &str = "sk-log-canary-3f2e1d0c9b8a7968";
    let dir = tempfile::tempdir().unwrap();
    let db = common::database_args(dir.path());
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[("WOR_LOG", "trace")]);
    common::create_model_connection(&server, &owner, SECRET);
    let approver = server.client(&owner, &["member", "create", "pat", "--role", "approver"]);
    let approver = text(&approver.stdout).trim().to_owned();
    let helper = helper_routine("helper").replace("Hello from helper.", TOOL_TEXT);
    let caller = CALLER
        .replace("Ask the helper.", &format!("Ask the helper. {PROMPT}"))
        .replace(
            "last_tool_result_contains = \"Hello\"",
            &format!("last_tool_result_contains = \"{TOOL_TEXT}\""),
        )
        .replace("text = \"Done.\"", &format!("text = \"{ANSWER}\""));
    for (name, toml) in [("helper", helper), ("caller", caller)] {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let applied = server.client(
            &owner,
            &["routine", "apply", "-f", &file.display().to_string()],
        );
        assert!(applied.status.success(), "{}", text(&applied.stderr));
    }
    let started = server.client(&owner, &["run", "start", "caller", "--input", INPUT]);
    let run_id = text(&started.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &run_id, "waiting_for_approval");
    let listed = server.client(&approver, &["approvals", "list", "--json"]);
    let approvals: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let approval = approvals
        .as_array()
        .or_else(|| approvals["approvals"].as_array())
        .unwrap()[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let approved = server.client(
        &approver,
        &["approvals", "approve", &approval, "--reason", REASON],
    );
    assert!(approved.status.success(), "{}", text(&approved.stderr));
    wait_for_status(&server, &owner, &run_id, "succeeded");
    // The run really carried every canary: its record holds the answer and the tool content.
    let shown = text(
        &server
            .client(&owner, &["run", "get", &run_id, "--json"])
            .stdout,
    );
    assert!(
        shown.contains(ANSWER) && shown.contains(TOOL_TEXT),
        "{shown}"
    );
    let log = server.stop();
    // WOR_LOG=trace lets every level of the project's own components through.
    assert!(
        log.contains("\"level\":\"INFO\"") && log.contains("run ended"),
        "{log}"
    );
    assert!(log.contains(&run_id), "runs are logged by id");
    for canary in [PROMPT, INPUT, TOOL_TEXT, ANSWER, REASON, SECRET] {
        assert!(!log.contains(canary), "the log holds `{canary}`");
    }
}

// ---------------------------------------------------------------------------------------------
// Traces: OTLP/HTTP to the operator's collector, through the egress guard.

mod traced {
    //! A tool server and an OTLP collector, both the test's own on loopback: the tool server
    //! keeps the headers of every request it is sent (so trace context passed to it shows),
    //! the collector every body it receives, decoded as OTLP protobuf.

    use std::sync::{Arc, Mutex};

    use axum::Router;
    use axum::body::Bytes;
    use axum::http::HeaderMap;
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use prost::Message as _;
    use rmcp::ServerHandler;
    use rmcp::model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
        InitializeResult, ListToolsResult, PaginatedRequestParams, ServerCapabilities, Tool,
    };
    use rmcp::service::{RequestContext, RoleServer};
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };

    pub const RESULT: &str = "result-canary-6a0d2e";

    #[derive(Debug, Clone, Default)]
    pub struct Desk;

    impl ServerHandler for Desk {
        fn get_info(&self) -> InitializeResult {
            InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
        }

        async fn list_tools(
            &self,
            _request: Option<PaginatedRequestParams>,
            _context: RequestContext<RoleServer>,
        ) -> Result<ListToolsResult, ErrorData> {
            let schema = serde_json::json!({"type": "object",
                "properties": {"q": {"type": "string"}}, "required": ["q"]});
            Ok(ListToolsResult::with_all_items(vec![Tool::new(
                "lookup",
                "Looks a record up",
                Arc::new(schema.as_object().unwrap().clone()),
            )]))
        }

        async fn call_tool(
            &self,
            _request: CallToolRequestParams,
            _context: RequestContext<RoleServer>,
        ) -> Result<CallToolResponse, ErrorData> {
            Ok(CallToolResult::success(vec![ContentBlock::text(format!("FOUND {RESULT}"))]).into())
        }
    }

    /// Serves the tool server; returns its address and the headers of every request to it.
    pub async fn serve_desk() -> (std::net::SocketAddr, Arc<Mutex<Vec<HeaderMap>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let service = StreamableHttpService::new(
            || Ok(Desk),
            Arc::new(LocalSessionManager::default()),
            StreamableHttpServerConfig::default(),
        );
        let record = seen.clone();
        let router = Router::new()
            .nest_service("/mcp", service)
            .layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    record.lock().unwrap().push(request.headers().clone());
                    next.run(request)
                },
            ));
        (crate::common::serve_router(router).await, seen)
    }

    /// Runs a CLI command as a key (`key`, `args`, extra environment) against the server.
    pub type Client<'a> = dyn Fn(&str, &[&str], &[(&str, &str)]) -> std::process::Output + 'a;

    /// Creates the tool connection `name` on `desk`'s MCP server with `token` as its bearer,
    /// reviews it and enables it with `classified` after `connection enable` (say
    /// `--read-only lookup`), through the CLI (`client` runs it against the server).
    pub fn enable_desk(
        client: &Client<'_>,
        owner: &str,
        desk: std::net::SocketAddr,
        token: &str,
        dir: &std::path::Path,
        name: &str,
        classified: &[&str],
    ) {
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let created = client(
            owner,
            &[
                "connection",
                "create",
                name,
                "--url",
                &format!("http://{desk}/mcp"),
                "--allow",
                &desk.to_string(),
                "--bearer-env",
                "TOOL_TOKEN",
                "--json",
            ],
            &[("TOOL_TOKEN", token)],
        );
        assert!(created.status.success(), "{}", text(&created.stderr));
        let created: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
        let connection = created["id"].as_str().unwrap().to_owned();
        let review = client(owner, &["connection", "review", &connection, "--json"], &[]);
        assert!(review.status.success(), "{}", text(&review.stderr));
        let review_file = dir.join(format!("{name}-review.json"));
        std::fs::write(&review_file, &review.stdout).unwrap();
        let mut enable = vec![
            "connection",
            "enable",
            &connection,
            "--from-review",
            review_file.to_str().unwrap(),
        ];
        enable.extend_from_slice(classified);
        let enabled = client(owner, &enable, &[]);
        assert!(enabled.status.success(), "{}", text(&enabled.stderr));
    }

    /// Applies routine `name`, which looks `x` up once with `connection`'s `lookup`, then
    /// answers "Done.", through the CLI.
    pub fn apply_lookup_routine(
        client: &Client<'_>,
        owner: &str,
        dir: &std::path::Path,
        name: &str,
        connection: &str,
    ) {
        let routine = format!(
            r#"
name = "{name}"
instructions = "Look it up."

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
when = {{ last_tool_result_contains = "{RESULT}" }}
text = "Done."

[[model.script.turns]]
tool_calls = [{{ name = "{connection}__lookup", arguments = {{ q = "x" }} }}]

[[tools]]
tool = "{connection}/lookup"
mode = "auto"
"#
        );
        apply_routine(client, owner, dir, name, &routine);
    }

    /// Writes `toml` as routine `name`'s file in `dir` and applies it, through the CLI.
    pub fn apply_routine(
        client: &Client<'_>,
        owner: &str,
        dir: &std::path::Path,
        name: &str,
        toml: &str,
    ) {
        let file = dir.join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let applied = client(
            owner,
            &["routine", "apply", "-f", file.to_str().unwrap()],
            &[],
        );
        assert!(
            applied.status.success(),
            "{}",
            String::from_utf8_lossy(&applied.stderr)
        );
    }

    /// What the collector received: each request's headers and raw body.
    pub type Received = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

    pub async fn serve_collector() -> (std::net::SocketAddr, Received) {
        let received: Received = Arc::default();
        let keep = received.clone();
        let router = Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let keep = keep.clone();
                async move {
                    keep.lock().unwrap().push((headers, body));
                    (
                        [("content-type", "application/x-protobuf")],
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        (addr, received)
    }

    /// Every span received so far.
    pub fn spans(received: &Received) -> Vec<opentelemetry_proto::tonic::trace::v1::Span> {
        received
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(_, body)| {
                ExportTraceServiceRequest::decode(body.as_ref())
                    .unwrap()
                    .resource_spans
            })
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans)
            .collect()
    }
}

/// A string attribute of `span`.
fn attribute(span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str) -> Option<String> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            Value::StringValue(s) => s.clone(),
            Value::IntValue(n) => n.to_string(),
            other => format!("{other:?}"),
        })
}

#[test]
fn a_collector_receives_a_runs_spans_in_their_tree_and_no_content() {
    const PROMPT: &str = "prompt-canary-0b7e44";
    const INPUT: &str = "input-canary-c3d9a1";
    const ARGUMENT: &str = "argument-canary-58f2b6";
    const ANSWER: &str = "answer-canary-e17c05";
    const REASON: &str = "reason-canary-9d4a23";
    const TOOL_TOKEN: &str = "tok-trace-canary-1a2b3c4d5e6f7081";
    const MODEL_SECRET: &str = "sk-trace-canary-90817263544536271";
    // The collector's own credential, from the standard OTLP variable.
    const COLLECTOR_TOKEN: &str = "collector-canary-6b5a4f3e2d1c";
    // The test's own servers run on a runtime of their own (the test's database is set up on
    // another, which cannot be nested in one).
    let servers = tokio::runtime::Runtime::new().unwrap();
    let (desk, desk_headers) = servers.block_on(traced::serve_desk());
    let (collector, received) = servers.block_on(traced::serve_collector());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        format!(
            "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n\n[traces]\n\
             endpoint = \"http://{collector}/v1/traces\"\nallowed_cidrs = [\"127.0.0.1/32\"]\n"
        ),
    )
    .unwrap();
    let mut db = common::database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = common::create_project(&db);
    let collector_headers = format!("x-collector-token={COLLECTOR_TOKEN}");
    let server = Server::start(
        &db,
        &[
            ("WOR_LOG", "trace"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                collector_headers.as_str(),
            ),
        ],
    );
    let client = |key: &str, args: &[&str], envs: &[(&str, &str)]| {
        run(wor(args)
            .env("WOR_SERVER", &server.url)
            .env("WOR_API_KEY", key)
            .envs(envs.iter().copied()))
    };
    common::create_model_connection(&server, &owner, MODEL_SECRET);
    traced::enable_desk(&client, &owner, desk, TOOL_TOKEN, dir.path(), "desk", &[]);
    let routine = format!(
        r#"
name = "traced"
instructions = "Look it up. {PROMPT}"

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
when = {{ last_tool_result_contains = "{result}" }}
text = "{ANSWER}"
usage = {{ input_tokens = 7, output_tokens = 3 }}

[[model.script.turns]]
tool_calls = [{{ name = "desk__lookup", arguments = {{ q = "{ARGUMENT}" }} }}]
usage = {{ input_tokens = 11, output_tokens = 4 }}

[[tools]]
tool = "desk/lookup"
mode = "confirm"
"#,
        result = traced::RESULT
    );
    traced::apply_routine(&client, &owner, dir.path(), "traced", &routine);
    let approver = client(
        &owner,
        &["member", "create", "pat", "--role", "approver"],
        &[],
    );
    let approver = text(&approver.stdout).trim().to_owned();

    let started = client(&owner, &["run", "start", "traced", "--input", INPUT], &[]);
    assert!(started.status.success(), "{}", text(&started.stderr));
    let run_id = text(&started.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &run_id, "waiting_for_approval");
    let listed = client(&approver, &["approvals", "list", "--json"], &[]);
    let approvals: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let approval = approvals
        .as_array()
        .or_else(|| approvals["approvals"].as_array())
        .unwrap()[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let approved = client(
        &approver,
        &["approvals", "approve", &approval, "--reason", REASON],
        &[],
    );
    assert!(approved.status.success(), "{}", text(&approved.stderr));
    wait_for_status(&server, &owner, &run_id, "succeeded");
    let shown = text(&client(&owner, &["run", "get", &run_id, "--json"], &[]).stdout);
    assert!(
        shown.contains(ANSWER) && shown.contains(traced::RESULT) && shown.contains(ARGUMENT),
        "the run carried every canary: {shown}"
    );

    // The run's span is sent within the export interval of the run's end.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let spans = loop {
        let spans = traced::spans(&received);
        if spans.iter().any(|s| s.name == "wor.run") {
            break spans;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no run span: {spans:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let log = server.stop();

    // Every export carries the collector's header; the log never shows its value.
    for (headers, _) in received.lock().unwrap().iter() {
        assert_eq!(
            headers
                .get("x-collector-token")
                .and_then(|v| v.to_str().ok()),
            Some(COLLECTOR_TOKEN),
            "{headers:?}"
        );
    }
    assert!(
        !log.contains(COLLECTOR_TOKEN),
        "the collector's token is in the log"
    );

    // One trace, the run's: its id is the run id's 128 bits.
    let run_uuid = run_id.strip_prefix("run_").unwrap();
    for span in &spans {
        assert_eq!(
            span.trace_id
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>(),
            run_uuid,
            "{span:?}"
        );
        assert_eq!(
            attribute(span, "wor.run.id").as_deref(),
            Some(run_id.as_str())
        );
        assert!(
            span.end_time_unix_nano >= span.start_time_unix_nano,
            "{span:?}"
        );
    }
    let named = |name: &str| -> Vec<&opentelemetry_proto::tonic::trace::v1::Span> {
        spans.iter().filter(|s| s.name == name).collect()
    };
    let [run_span] = named("wor.run")[..] else {
        panic!("one run span: {spans:?}")
    };
    assert!(run_span.parent_span_id.is_empty(), "the run is the root");
    assert_eq!(
        attribute(run_span, "wor.run.status").as_deref(),
        Some("succeeded")
    );
    assert_eq!(
        attribute(run_span, "wor.run.trigger").as_deref(),
        Some("api")
    );
    let turns = named("wor.model_turn");
    assert_eq!(turns.len(), 2, "{spans:?}");
    for turn in &turns {
        assert_eq!(turn.parent_span_id, run_span.span_id);
        assert_eq!(
            attribute(turn, "wor.model.provider").as_deref(),
            Some("replay")
        );
    }
    let mut tokens: Vec<String> = turns
        .iter()
        .map(|t| attribute(t, "wor.model.input_tokens").unwrap())
        .collect();
    tokens.sort();
    assert_eq!(tokens, ["11", "7"]);
    let [call] = named("wor.tool_call")[..] else {
        panic!("one tool call span: {spans:?}")
    };
    assert_eq!(call.parent_span_id, run_span.span_id);
    assert_eq!(attribute(call, "wor.outcome").as_deref(), Some("held"));
    for (child, outcome_key, outcome) in [
        (
            "wor.tool_call.decision",
            "wor.tool_call.decision",
            "confirm",
        ),
        ("wor.tool_call.approval_wait", "wor.outcome", "approved"),
        ("wor.tool_call.execution", "wor.outcome", "ok"),
    ] {
        let [span] = named(child)[..] else {
            panic!("one {child} span: {spans:?}")
        };
        assert_eq!(span.parent_span_id, call.span_id, "{child} is the call's");
        assert_eq!(
            attribute(span, outcome_key).as_deref(),
            Some(outcome),
            "{child}"
        );
    }
    assert_eq!(
        attribute(named("wor.tool_call.approval_wait")[0], "wor.approval.id").as_deref(),
        Some(approval.as_str())
    );
    assert_eq!(spans.len(), 1 + 2 + 1 + 3, "{spans:?}");

    // No content: not in any byte the collector received, nor in any header.
    let bodies = received.lock().unwrap().clone();
    for (headers, body) in &bodies {
        assert_eq!(headers["content-type"], "application/x-protobuf");
        let headers = format!("{headers:?}");
        for canary in [
            PROMPT,
            INPUT,
            ARGUMENT,
            traced::RESULT,
            ANSWER,
            REASON,
            TOOL_TOKEN,
            MODEL_SECRET,
            "traced",
            "desk",
            "lookup",
        ] {
            assert!(
                !body.windows(canary.len()).any(|w| w == canary.as_bytes()),
                "a span holds `{canary}`"
            );
            assert!(
                !headers.contains(canary),
                "an export header holds `{canary}`"
            );
        }
    }
    // Nothing of the trace went to the tool server.
    let desk_headers = desk_headers.lock().unwrap();
    assert!(!desk_headers.is_empty());
    for headers in desk_headers.iter() {
        for name in ["traceparent", "tracestate", "baggage"] {
            assert!(
                !headers.contains_key(name),
                "the tool server was sent `{name}`"
            );
        }
    }
    assert!(
        !log.contains("trace export to the collector failed"),
        "{log}"
    );
}

/// A tool server the operator names in `[traces] propagate_to` gets the run's trace context,
/// and the spans its own work makes hang under the run's span.
#[test]
fn a_tool_server_named_by_the_operator_gets_the_runs_trace_context() {
    let servers = tokio::runtime::Runtime::new().unwrap();
    let (desk, desk_headers) = servers.block_on(traced::serve_desk());
    let (collector, received) = servers.block_on(traced::serve_collector());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        format!(
            "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n\n[traces]\n\
             endpoint = \"http://{collector}/v1/traces\"\nallowed_cidrs = [\"127.0.0.1/32\"]\n\
             propagate_to = [\"{desk}\"]\n"
        ),
    )
    .unwrap();
    let mut db = common::database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[]);
    let client = |key: &str, args: &[&str], envs: &[(&str, &str)]| {
        run(wor(args)
            .env("WOR_SERVER", &server.url)
            .env("WOR_API_KEY", key)
            .envs(envs.iter().copied()))
    };
    traced::enable_desk(
        &client,
        &owner,
        desk,
        "tok-propagated-0c1d2e3f",
        dir.path(),
        "desk",
        &[],
    );
    traced::apply_lookup_routine(&client, &owner, dir.path(), "propagated", "desk");
    let started = client(
        &owner,
        &["run", "start", "propagated", "--input", "go"],
        &[],
    );
    assert!(started.status.success(), "{}", text(&started.stderr));
    let run_id = text(&started.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &run_id, "succeeded");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let run_span = loop {
        if let Some(span) = traced::spans(&received)
            .into_iter()
            .find(|s| s.name == "wor.run")
        {
            break span;
        }
        assert!(std::time::Instant::now() < deadline, "no run span");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    server.stop();
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let expected = format!(
        "00-{}-{}-01",
        hex(&run_span.trace_id),
        hex(&run_span.span_id)
    );
    assert_eq!(
        hex(&run_span.trace_id),
        run_id.strip_prefix("run_").unwrap(),
        "the trace is the run's"
    );
    // Every request of the run's session carried it: the server's spans are the run's.
    let run_requests: Vec<_> = desk_headers
        .lock()
        .unwrap()
        .iter()
        .filter_map(|headers| headers.get("traceparent").cloned())
        .collect();
    assert!(!run_requests.is_empty(), "no request carried a traceparent");
    for value in run_requests {
        assert_eq!(value.to_str().unwrap(), expected);
    }
}

/// The write that reserves a tool call reaches the disk before the call runs when the call can
/// change something; a call to a tool the admin classified read-only waits for no flush (a
/// power cut may make the read again, a crash of the process cannot). Counted by the audit
/// writer's synced commits, over runs that each make one call, to one tool classified
/// read-only, consequential and open-world.
#[test]
fn only_a_call_that_can_change_something_waits_for_its_reservation_to_reach_the_disk() {
    let servers = tokio::runtime::Runtime::new().unwrap();
    let (desk, _) = servers.block_on(traced::serve_desk());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let mut db = common::database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[]);
    let metrics = metrics_addr(&server);
    let client = |key: &str, args: &[&str], envs: &[(&str, &str)]| {
        run(wor(args)
            .env("WOR_SERVER", &server.url)
            .env("WOR_API_KEY", key)
            .envs(envs.iter().copied()))
    };
    let token = "tok-durable-5b6c7d8e";
    for (connection, classified) in [
        ("reads", &["--read-only", "lookup"][..]),
        ("writes", &[][..]),
        ("visits", &["--open-world", "lookup"][..]),
    ] {
        traced::enable_desk(
            &client,
            &owner,
            desk,
            token,
            dir.path(),
            connection,
            classified,
        );
        traced::apply_lookup_routine(&client, &owner, dir.path(), connection, connection);
    }
    const RUNS: u32 = 4;
    let synced = |routine: &str| {
        let series = r#"wor_audit_commits_total{durability="synced"}"#;
        let before = value(&scrape(&metrics), series);
        for _ in 0..RUNS {
            let ran = client(
                &owner,
                &["run", "start", routine, "--input", "go", "--follow"],
                &[],
            );
            assert!(ran.status.success(), "{}", text(&ran.stderr));
            assert!(text(&ran.stdout).contains("Done."), "{}", text(&ran.stdout));
        }
        value(&scrape(&metrics), series) - before
    };
    let reads = synced("reads");
    let writes = synced("writes");
    let visits = synced("visits");
    server.stop();
    // Each run's start and end are synced either way (and two writes of one run never share a
    // commit: a run waits for each of its writes); a reservation only for a call that can
    // change something, or carry data out.
    assert!(
        reads >= f64::from(2 * RUNS),
        "{reads} synced commits for the reads"
    );
    for (what, count) in [("writes", writes), ("open-world visits", visits)] {
        assert!(
            count >= reads + f64::from(RUNS),
            "{count} synced commits for the {what}, {reads} for the reads"
        );
    }
}

/// A routine held for approval that fails when the approval expires, one run at a time, the
/// next skipped; a routine whose second turn is over its budget of turns; run webhooks to a
/// receiver the test hosts.
#[test]
fn metrics_count_skipped_runs_expired_approvals_budgets_by_limit_and_webhooks_by_result() {
    use std::io::{Read as _, Write as _};
    let receiver = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hook = receiver.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in receiver.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0u8; 65536];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n");
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        "approval_ttl_seconds = 1\n\n[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n\n\
         [metrics]\nlisten = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let mut db = common::database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[]);
    let metrics = metrics_addr(&server);
    let held = CALLER.replace("name = \"caller\"", "name = \"held\"")
        + "\n[approvals]\non_denial = \"fail\"\n\n[concurrency]\nmax_runs = 1\noverlap = \"skip\"\n";
    let tight = CALLER
        .replace("name = \"caller\"", "name = \"tight\"")
        .replace("mode = \"confirm\"", "mode = \"auto\"")
        + &format!(
            "\n[budget]\nturns = 1\n\n[notify]\nurl = \"http://{hook}/hook\"\n\
             events = [\"budget_exceeded\"]\n"
        );
    for (name, toml) in [
        ("helper", helper_routine("helper")),
        ("held", held),
        ("tight", tight),
    ] {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let applied = server.client(
            &owner,
            &["routine", "apply", "-f", &file.display().to_string()],
        );
        assert!(applied.status.success(), "{}", text(&applied.stderr));
    }
    let secret = server.client(&owner, &["routine", "webhook-secret", "tight", "--notify"]);
    assert!(secret.status.success(), "{}", text(&secret.stderr));
    let before = scrape(&metrics);
    let delta = |now: &std::collections::BTreeMap<String, f64>, series: &str| {
        value(now, series) - value(&before, series)
    };

    let started = server.client(&owner, &["run", "start", "held", "--input", "go"]);
    let held_run = text(&started.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &held_run, "waiting_for_approval");
    let skipped = server.client(&owner, &["run", "start", "held", "--input", "again"]);
    // Recorded skipped, not run: said on stderr, the id on stdout as for any start.
    assert!(
        text(&skipped.stderr).contains("was recorded skipped, not run"),
        "{}",
        text(&skipped.stderr)
    );
    let skipped = text(&skipped.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &skipped, "skipped");
    // Followed, it is said the same, and never that it started.
    let followed = server.client(
        &owner,
        &["run", "start", "held", "--input", "once more", "--follow"],
    );
    let said = text(&followed.stderr);
    assert!(
        said.contains("was recorded skipped, not run") && !said.contains(" started"),
        "{said}"
    );
    // Nobody decides: the approval expires and the run fails, as its routine says.
    wait_for_status(&server, &owner, &held_run, "failed");
    let tight = server.client(&owner, &["run", "start", "tight", "--input", "go"]);
    let tight = text(&tight.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &tight, "budget_exceeded");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let after = loop {
        let now = scrape(&metrics);
        if delta(&now, r#"wor_webhook_deliveries_total{result="delivered"}"#) >= 1.0 {
            break now;
        }
        assert!(std::time::Instant::now() < deadline, "no delivery counted");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    for (series, expected) in [
        (
            r#"wor_runs_finished_total{status="skipped",trigger="api"}"#,
            2.0,
        ),
        (
            r#"wor_runs_finished_total{status="failed",trigger="api"}"#,
            1.0,
        ),
        (
            r#"wor_runs_finished_total{status="budget_exceeded",trigger="api"}"#,
            1.0,
        ),
        // The helper it called has only what is left of its root's turns: none.
        (
            r#"wor_runs_finished_total{status="budget_exceeded",trigger="routine"}"#,
            1.0,
        ),
        (r#"wor_budget_exhausted_total{limit="turns"}"#, 2.0),
        (r#"wor_budget_exhausted_total{limit="tool_calls"}"#, 0.0),
        (r#"wor_approvals_decided_total{outcome="expired"}"#, 1.0),
        (r#"wor_approvals_decided_total{outcome="approved"}"#, 0.0),
        (r#"wor_webhook_deliveries_total{result="delivered"}"#, 1.0),
        (r#"wor_webhook_deliveries_total{result="failed"}"#, 0.0),
    ] {
        assert_eq!(delta(&after, series), expected, "{series}");
    }
    server.stop();
}

/// An HTTP tool whose API is on loopback, which the egress guard refuses (no
/// `[egress] allowed_cidrs`): the call is allowed by policy, then refused by egress. And a
/// queued run cancelled before any worker took it.
#[test]
fn metrics_count_a_tool_call_refused_by_egress_and_a_cancelled_queued_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(&config, "[metrics]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let mut db = common::database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[]);
    let metrics = metrics_addr(&server);

    let tools = dir.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"{"tools": [{"name": "ping", "method": "GET", "path": "/ping",
            "inputSchema": {"type": "object"}}]}"#,
    )
    .unwrap();
    let id = common::create_tools_file_connection(&server, &owner, &tools);
    let review = server.client(&owner, &["connection", "review", &id, "--json"]);
    assert!(review.status.success(), "{}", text(&review.stderr));
    let review_file = dir.path().join("review.json");
    std::fs::write(&review_file, &review.stdout).unwrap();
    let enabled = server.client(
        &owner,
        &[
            "connection",
            "enable",
            &id,
            "--from-review",
            review_file.to_str().unwrap(),
        ],
    );
    assert!(enabled.status.success(), "{}", text(&enabled.stderr));

    let pinger = "name = \"pinger\"\ninstructions = \"Ping.\"\n\n[model]\nprovider = \"replay\"\n\
                  model = \"script\"\n\n[[model.script.turns]]\n\
                  when = { last_tool_result_contains = \"egress\" }\ntext = \"refused\"\n\n\
                  [[model.script.turns]]\ntool_calls = [{ name = \"api__ping\" }]\n\n\
                  [[tools]]\ntool = \"api/ping\"\nmode = \"auto\"\n";
    let queued = CALLER.replace("name = \"caller\"", "name = \"queued\"")
        + "\n[concurrency]\nmax_runs = 1\noverlap = \"queue\"\n";
    for (name, toml) in [
        ("helper", helper_routine("helper")),
        ("pinger", pinger.to_owned()),
        ("queued", queued),
    ] {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let applied = server.client(
            &owner,
            &["routine", "apply", "-f", &file.display().to_string()],
        );
        assert!(applied.status.success(), "{}", text(&applied.stderr));
    }
    let before = scrape(&metrics);
    let delta = |now: &std::collections::BTreeMap<String, f64>, series: &str| {
        value(now, series) - value(&before, series)
    };

    let pinged = server.client(
        &owner,
        &["run", "start", "pinger", "--input", "go", "--follow"],
    );
    let shown = text(&pinged.stdout);
    assert!(pinged.status.success(), "{shown}\n{}", text(&pinged.stderr));
    assert!(shown.contains("refused"), "{shown}");

    let first = server.client(&owner, &["run", "start", "queued", "--input", "one"]);
    let first = text(&first.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &first, "waiting_for_approval");
    let second = server.client(&owner, &["run", "start", "queued", "--input", "two"]);
    let second = text(&second.stdout).trim().to_owned();
    wait_for_status(&server, &owner, &second, "queued");
    let cancelled = server.client(&owner, &["run", "cancel", &second]);
    assert!(cancelled.status.success(), "{}", text(&cancelled.stderr));
    wait_for_status(&server, &owner, &second, "cancelled");
    // No worker had it: the cancel records its end on the chain, as a worker would.
    let log = server.client(&owner, &["audit", "export"]);
    assert!(log.status.success(), "{}", text(&log.stderr));
    let ends: Vec<serde_json::Value> = text(&log.stdout)
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|entry| entry["category"] == "run.end" && entry["subjects"]["run_id"] == second)
        .map(|entry| entry["payload"].clone())
        .collect();
    assert_eq!(
        ends,
        [serde_json::json!({ "status": "cancelled", "outcome": "cancelled while queued" })]
    );

    let after = scrape_until(&metrics, |now| {
        delta(now, r#"wor_run_duration_seconds_count{status="succeeded"}"#) >= 1.0
    });
    for (series, expected) in [
        (r#"wor_tool_calls_total{decision="allow"}"#, 1.0),
        (r#"wor_tool_calls_total{decision="egress_refused"}"#, 1.0),
        // The queued routine's first run asks for its helper.
        (r#"wor_tool_calls_total{decision="confirm"}"#, 1.0),
        (r#"wor_tool_calls_total{decision="deny"}"#, 0.0),
        (r#"wor_egress_denials_total{reason="address"}"#, 1.0),
        (
            r#"wor_egress_denials_total{reason="host_not_allowed"}"#,
            0.0,
        ),
        (
            r#"wor_runs_finished_total{status="succeeded",trigger="api"}"#,
            1.0,
        ),
        (
            r#"wor_runs_finished_total{status="cancelled",trigger="api"}"#,
            1.0,
        ),
        // The pinger and the first queued run; the cancelled one never started.
        (r#"wor_runs_started_total{trigger="api"}"#, 2.0),
        ("wor_run_queue_lag_seconds_count", 2.0),
    ] {
        assert_eq!(delta(&after, series), expected, "{series}");
    }
    assert_eq!(value(&after, "wor_approvals_pending"), 1.0);
    server.stop();
}

#[test]
fn operator_commands_given_a_data_dir_without_a_database_make_nothing_there() {
    let root = tempfile::tempdir().unwrap();
    let missing = root.path().join("mistyped");
    let missing_text = missing.display().to_string();
    for args in [
        &["project", "list"][..],
        &["project", "recover-owner", "default"],
        &["secrets", "verify"],
        &["secrets", "rotate"],
        &[
            "backup",
            "--to",
            &root.path().join("b.db").display().to_string(),
        ],
        &["worker", "list"],
        &["audit", "verify"],
        &["audit", "public-key"],
    ] {
        let out = operator(args, &missing, Some(KEY));
        assert!(!out.status.success(), "{args:?}: {}", text(&out.stdout));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("no database at") || stderr.contains("no audit signing key"),
            "{args:?}: {stderr}"
        );
        assert!(!missing.exists(), "{args:?} made {missing_text}");
    }
    assert!(!root.path().join("b.db").exists());
}

#[test]
fn a_server_stops_on_sigterm_while_a_client_follows_a_run_that_waits_for_a_person() {
    let dir = tempfile::tempdir().unwrap();
    let db = common::database_args(dir.path());
    let owner = common::create_project(&db);
    let server = Server::start(&db, &[]);
    for (name, toml) in [
        ("helper", helper_routine("helper")),
        ("caller", CALLER.to_owned()),
    ] {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let applied = server.client(
            &owner,
            &["routine", "apply", "-f", &file.display().to_string()],
        );
        assert!(applied.status.success(), "{}", text(&applied.stderr));
    }
    // A client following a run that waits for a person: its event stream stays open.
    let follower = wor(&["run", "start", "caller", "--input", "go", "--follow"])
        .env("WOR_SERVER", &server.url)
        .env("WOR_API_KEY", &owner)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let listed = || {
        text(
            &server
                .client(&owner, &["run", "list", "--routine", "caller"])
                .stdout,
        )
    };
    let began = std::time::Instant::now();
    while !listed().contains("waiting_for_approval") {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(30),
            "{}",
            listed()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    let mut server = server;
    let stopping = std::time::Instant::now();
    let _ = std::process::Command::new("kill")
        .arg(server.child.id().to_string())
        .status();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            stopping.elapsed() < wor_server::DRAIN_GRACE + std::time::Duration::from_secs(20),
            "the server did not stop while a client followed a run"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    // The follower is told its stream ended, and does not take the run as finished.
    let followed = follower.wait_with_output().unwrap();
    assert!(!followed.status.success(), "{}", text(&followed.stdout));
    assert!(
        text(&followed.stderr).contains("broke off (the server may be stopping)"),
        "{}",
        text(&followed.stderr)
    );
}

#[test]
fn a_sighup_without_a_certificate_to_reload_is_logged_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let db = common::database_args(dir.path());
    let mut server = Server::start(&db, &[]);
    let addr = server.url.strip_prefix("http://").unwrap().to_owned();
    server.signal("-HUP");
    server.wait_logged(
        "no TLS certificate to reload",
        std::time::Duration::from_secs(10),
    );
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "SIGHUP ended the server"
    );
    let answer = http(
        &addr,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(answer.contains("200 OK"), "{answer}");
}

#[test]
fn a_second_signal_ends_a_draining_server_at_once() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let db = common::database_args(dir.path());
    let mut server = Server::start(&db, &[]);
    let addr = server.url.strip_prefix("http://").unwrap().to_owned();
    // A request whose body never comes: the drain waits its grace (10 s) for it.
    #[expect(
        clippy::disallowed_methods,
        reason = "the test's own client on loopback"
    )]
    let mut held = std::net::TcpStream::connect(&addr).unwrap();
    held.write_all(
        b"POST /hooks/rtn_0123456789abcdef0123456789abcdef HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    server.signal("-TERM");
    std::thread::sleep(std::time::Duration::from_millis(1000));
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server stopped without waiting for the open request"
    );
    let began = std::time::Instant::now();
    server.signal("-TERM");
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            began.elapsed() < std::time::Duration::from_secs(5),
            "a second SIGTERM did not end the drain"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(143), "{}", server.log.lock().unwrap());
    server.wait_logged("a second signal", std::time::Duration::from_secs(2));
    drop(held);
}
