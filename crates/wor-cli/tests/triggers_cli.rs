//! Triggers through the binary: `wor webhook sign/verify` against the public vectors, and a
//! routine on a cron schedule that runs on time across a server restart, neither skipping nor
//! doubling a slot, whose run webhooks arrive signed and verify with `wor webhook verify`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Server, create_project, database_args, text, wor};
use serde_json::Value;

/// The webhook signature vectors, from the repository (`testdata/SOURCES.md` names their
/// sources).
fn corpus(name: &str) -> Value {
    let text = match name {
        "run-webhook-signature.json" => include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/webhooks/run-webhook-signature.json"
        )),
        "standard-webhooks.json" => include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/webhooks/standard-webhooks.json"
        )),
        other => panic!("no webhook corpus named `{other}`"),
    };
    serde_json::from_str(text).unwrap()
}

/// Runs `wor ARGS` with `body` on standard input.
fn with_stdin(args: &[&str], body: &[u8]) -> Output {
    let mut child = wor(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(body).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn webhook_commands_given_what_cannot_sign_or_verify_exit_2() {
    let standard = |command: &str, extra: &[&str]| {
        let mut args = vec![
            "webhook",
            command,
            "--scheme",
            "standard",
            "--timestamp",
            "1700000000",
        ];
        args.extend_from_slice(extra);
        with_stdin(&args, b"{}")
    };
    for (command, extra, says) in [
        (
            "sign",
            &["--secret", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"][..],
            "needs --id",
        ),
        (
            "verify",
            &[
                "--secret",
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                "--signature",
                "v1,x",
            ][..],
            "needs --id",
        ),
        (
            "verify",
            &[
                "--secret",
                "not-a-whsec",
                "--signature",
                "v1,x",
                "--id",
                "msg_1",
            ][..],
            "--secret",
        ),
    ] {
        let out = standard(command, extra);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{command} {extra:?}: {}",
            text(&out.stderr)
        );
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
}

#[test]
fn webhook_sign_and_verify_agree_with_the_public_vectors() {
    for vector in corpus("run-webhook-signature.json")["vectors"]
        .as_array()
        .unwrap()
    {
        let secret = vector["secret"].as_str().unwrap();
        let timestamp = vector["timestamp"].to_string();
        let body = vector["body"].as_str().unwrap().as_bytes();
        let expected = vector["signature_hex"].as_str().unwrap();
        let signed = with_stdin(
            &[
                "webhook",
                "sign",
                "--secret",
                secret,
                "--timestamp",
                &timestamp,
            ],
            body,
        );
        assert!(signed.status.success(), "{}", text(&signed.stderr));
        assert!(
            text(&signed.stdout).contains(&format!("wor-signature: {expected}")),
            "{}",
            text(&signed.stdout)
        );
        let verify = |body: &[u8], extra: &[&str]| {
            let mut args = vec![
                "webhook",
                "verify",
                "--secret",
                secret,
                "--timestamp",
                &timestamp,
                "--signature",
                expected,
            ];
            args.extend_from_slice(extra);
            with_stdin(&args, body).status.code()
        };
        assert_eq!(verify(body, &["--now", &timestamp]), Some(0));
        let mut tampered = body.to_vec();
        tampered.push(b' ');
        assert_eq!(
            verify(&tampered, &["--now", &timestamp]),
            Some(1),
            "tampered body"
        );
        assert_eq!(verify(body, &[]), Some(1), "stale: the vector is years old");
    }
    for vector in corpus("standard-webhooks.json")["vectors"]
        .as_array()
        .unwrap()
    {
        let timestamp = vector["timestamp"].to_string();
        let args = [
            "webhook",
            "verify",
            "--scheme",
            "standard",
            "--secret",
            vector["secret"].as_str().unwrap(),
            "--id",
            vector["id"].as_str().unwrap(),
            "--timestamp",
            &timestamp,
            "--signature",
            vector["signature"].as_str().unwrap(),
            "--now",
            &timestamp,
        ];
        let out = with_stdin(&args, vector["body"].as_str().unwrap().as_bytes());
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
        let mut wrong = args;
        wrong[7] = "msg_other";
        let out = with_stdin(&wrong, vector["body"].as_str().unwrap().as_bytes());
        assert_eq!(out.status.code(), Some(1), "a different id does not verify");
    }
}

/// Requests a receiver got: each one's headers (lower-case names) and body.
type Received = Arc<Mutex<Vec<(Vec<(String, String)>, Vec<u8>)>>>;

/// A loopback HTTP receiver that records each request's headers and body and answers 204.
fn start_receiver() -> (String, Received) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut headers = Vec::new();
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            loop {
                line.clear();
                reader.read_line(&mut line).unwrap();
                let trimmed = line.trim_end();
                if trimmed.is_empty() {
                    break;
                }
                if let Some((name, value)) = trimmed.split_once(':') {
                    headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
                }
            }
            let length: usize = headers
                .iter()
                .find(|(n, _)| n == "content-length")
                .map(|(_, v)| v.parse().unwrap())
                .unwrap_or(0);
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            sink.lock().unwrap().push((headers, body));
            let _ = stream.write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n");
        }
    });
    (format!("http://{addr}/hook"), got)
}

/// The schedule slots (Unix ms) of the routine's runs, with each run's status and creation.
/// Each scheduled run's slot, status, and when it was recorded and claimed (Unix ms).
fn scheduled_runs(server: &Server, key: &str) -> Vec<(i64, String, i64, Option<i64>)> {
    let out = server.client(key, &["run", "list", "--limit", "200", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let runs: Value = serde_json::from_slice(&out.stdout).unwrap();
    runs.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let slot = r["trigger_key"]
                .as_str()
                .unwrap()
                .strip_prefix("slot:")
                .unwrap()
                .parse()
                .unwrap();
            let millis = |field: &str| {
                r[field].as_str().map(|t| {
                    chrono::DateTime::parse_from_rfc3339(t)
                        .unwrap()
                        .timestamp_millis()
                })
            };
            (
                slot,
                r["status"].as_str().unwrap().to_owned(),
                millis("created_at").unwrap(),
                millis("started_at"),
            )
        })
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_scheduled_routine_runs_on_time_across_a_restart_and_its_webhooks_verify() {
    let dir = tempfile::tempdir().unwrap();
    let (hook_url, got) = start_receiver();
    let config = dir.path().join("wor.toml");
    std::fs::write(&config, "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n").unwrap();
    let mut db = database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let key = create_project(&db);
    let routine = dir.path().join("tick.toml");
    std::fs::write(
        &routine,
        format!(
            "name = \"tick\"\ninstructions = \"Tick.\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\n\
             [[model.script.turns]]\ntext = \"tock\"\n[concurrency]\nmax_runs = 50\n\
             [schedule]\ncron = \"*/2 * * * * *\"\n\
             [notify]\nurl = \"{hook_url}\"\nevents = [\"finished\"]\n"
        ),
    )
    .unwrap();

    let server = Server::start(&db, &[]);
    let applied = server.client(&key, &["routine", "apply", "-f", routine.to_str().unwrap()]);
    assert!(applied.status.success(), "{}", text(&applied.stderr));
    let secret = text(&applied.stdout)
        .lines()
        .find(|l| l.starts_with("whsec_"))
        .expect("the webhook secret is printed once")
        .to_owned();
    let shown = server.client(&key, &["routine", "show", "tick"]);
    assert!(
        text(&shown.stdout).contains("next firings (UTC):"),
        "{}",
        text(&shown.stdout)
    );
    wait_for(
        "two finished scheduled runs",
        Duration::from_secs(30),
        || {
            scheduled_runs(&server, &key)
                .iter()
                .filter(|(_, status, _, _)| status == "succeeded")
                .count()
                >= 2
        },
    );
    server.stop();
    let stopped_at = wor_store::now_millis();
    std::thread::sleep(Duration::from_secs(5));
    let restarted_at = wor_store::now_millis();
    let server = Server::start(&db, &[]);
    wait_for(
        "a run for a slot after the restart",
        Duration::from_secs(30),
        || {
            scheduled_runs(&server, &key)
                .iter()
                .any(|(slot, status, _, _)| *slot > restarted_at && status == "succeeded")
        },
    );
    let runs = scheduled_runs(&server, &key);
    wait_for("the run webhooks", Duration::from_secs(30), || {
        got.lock().unwrap().len() >= 3
    });
    server.stop();

    // Every two-second slot from the first to the last ran exactly once: the slots missed
    // while the server was down (well within the on-time grace) ran after the restart.
    let slots: Vec<i64> = runs.iter().map(|(slot, _, _, _)| *slot).collect();
    let unique: BTreeSet<i64> = slots.iter().copied().collect();
    assert_eq!(unique.len(), slots.len(), "a slot ran twice: {slots:?}");
    let first = *unique.first().unwrap();
    let last = *unique.last().unwrap();
    let expected: BTreeSet<i64> = (0..)
        .map(|i| first + i * 2_000)
        .take_while(|s| *s <= last)
        .collect();
    assert_eq!(unique, expected, "a slot was skipped");
    assert!(
        unique.iter().any(|s| *s > stopped_at && *s < restarted_at),
        "slots of the downtime ran after the restart: {unique:?}"
    );
    // While a server was up, each slot's run started on time (within the scheduler's tick).
    // A run may be recorded up to the scheduler's lead ahead of its slot, but none is claimed
    // before its slot.
    let ahead = wor_engine::DISPATCH_AHEAD_MS;
    for (slot, _, created, started) in &runs {
        if *slot < stopped_at || *slot > restarted_at + 2_000 {
            assert!(
                (-ahead..3_000).contains(&(created - slot)),
                "slot {slot} started at {created}"
            );
        }
        if let Some(started) = started {
            assert!(started >= slot, "slot {slot} was claimed at {started}");
        }
    }

    // A run webhook verifies with `wor webhook verify` over the raw body.
    let (headers, body) = got.lock().unwrap()[0].clone();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no `{name}` header"))
    };
    assert_eq!(header("wor-event"), "run.finished");
    let verified = with_stdin(
        &[
            "webhook",
            "verify",
            "--secret",
            &secret,
            "--timestamp",
            &header("wor-timestamp"),
            "--signature",
            &header("wor-signature"),
            "--window",
            "3600",
        ],
        &body,
    );
    assert_eq!(
        verified.status.code(),
        Some(0),
        "{}",
        text(&verified.stdout)
    );
    let payload: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(payload["routine"]["name"], "tick");
    assert_eq!(payload["run"]["trigger"], "schedule");
}
