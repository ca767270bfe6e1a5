//! `wor notify …` through the binary: a Slack route and an email route are made with their
//! secrets from the environment (never on the command line, never printed), listed, the
//! delivery log read and a route deleted, each with `--json` that parses; deciding with
//! `wor approvals approve` updates the Slack message a running server posted, and both
//! attempts are counted on the metrics listener.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use common::{Server, create_project, database_args, text, wor};
use serde_json::Value;

const BOT_TOKEN: &str = "xoxb-cli-test-3333-4444-abcdef";
const SIGNING_SECRET: &str = "cli-test-signing-secret-5555";
const SMTP_PASSWORD: &str = "cli-test-smtp-password-6666";

fn json_of(out: &std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&out.stdout)))
}

#[test]
fn notify_routes_are_made_listed_and_deleted_with_json_and_secrets_stay_sealed() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        "public_url = \"https://wor.example.com/\"\n[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n[notifications]\nsmtp_plaintext_loopback = true\n",
    )
    .unwrap();
    let mut db = database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let key = create_project(&db);
    let server = Server::start(&db, &[]);

    let create = |name: &str, extra: &[&str]| {
        let mut args = vec![
            "notify",
            "create",
            name,
            "--slack-channel",
            "C0CLI",
            "--slack-api-url",
            "http://127.0.0.1:9/api",
        ];
        args.extend_from_slice(extra);
        args.push("--json");
        common::run(
            wor(&args)
                .env("WOR_SERVER", &server.url)
                .env("WOR_API_KEY", &key)
                .env("WOR_SLACK_BOT_TOKEN", BOT_TOKEN)
                .env("WOR_SLACK_SIGNING_SECRET", SIGNING_SECRET),
        )
    };
    let out = create("ops", &["--tool", "notes/send_note"]);
    let route = json_of(&out);
    assert!(!text(&out.stdout).contains(BOT_TOKEN));
    assert!(!text(&out.stdout).contains(SIGNING_SECRET));
    assert_eq!(route["kind"], "slack");
    assert_eq!(route["channel"], "C0CLI");
    assert_eq!(route["tool"], "notes/send_note");
    assert_eq!(route["slack_bot_token"]["configured"], true);
    let id = route["id"].as_str().unwrap().to_owned();
    assert_eq!(route["interaction_path"], format!("/hooks/slack/{id}"));

    // A second route of the same name is refused; so is a channel that is no Slack id.
    let out = create("ops", &[]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("exists"),
        "{}",
        text(&out.stderr)
    );
    let out = create("bad", &["--slack-channel", "<!channel>"]);
    assert!(!out.status.success());

    let list = json_of(&server.client(&key, &["notify", "list", "--json"]));
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["id"], id.as_str());
    let plain = server.client(&key, &["notify", "list"]);
    assert!(
        text(&plain.stdout).contains("ops"),
        "{}",
        text(&plain.stdout)
    );

    let deliveries = json_of(&server.client(
        &key,
        &[
            "notify",
            "deliveries",
            "--route",
            &id,
            "--status",
            "failed",
            "--json",
        ],
    ));
    assert_eq!(deliveries, serde_json::json!([]));
    let out = server.client(&key, &["notify", "deliveries", "--status", "lost"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("status"),
        "{}",
        text(&out.stderr)
    );

    // An email route: the SMTP credentials from the environment, sealed, never printed.
    let email = |extra: &[&str]| {
        let mut args = vec![
            "notify",
            "create",
            "mail",
            "--email-to",
            "ann@example.com",
            "--email-to",
            "bob@example.com",
            "--email-from",
            "wor@example.com",
            "--smtp-host",
            "127.0.0.1",
            "--smtp-port",
            "2525",
        ];
        args.extend_from_slice(extra);
        common::run(
            wor(&args)
                .env("WOR_SERVER", &server.url)
                .env("WOR_API_KEY", &key)
                .env("WOR_SMTP_USERNAME", "relay-user")
                .env("WOR_SMTP_PASSWORD", SMTP_PASSWORD),
        )
    };
    let out = email(&[
        "--smtp-plaintext-loopback",
        "--digest-minutes",
        "10",
        "--json",
    ]);
    let mail = json_of(&out);
    assert!(!text(&out.stdout).contains(SMTP_PASSWORD));
    assert_eq!(mail["kind"], "email");
    assert_eq!(
        mail["email_to"],
        serde_json::json!(["ann@example.com", "bob@example.com"])
    );
    assert_eq!(mail["smtp_tls"], "plaintext_loopback");
    assert_eq!(mail["digest_minutes"], 10);
    assert_eq!(mail["smtp_credentials"]["configured"], true);
    let plain = server.client(&key, &["notify", "list"]);
    assert!(
        text(&plain.stdout).contains(
            "email ann@example.com,bob@example.com via 127.0.0.1:2525 (digest every 10 min)"
        ),
        "{}",
        text(&plain.stdout)
    );
    // A Slack channel and email recipients at once is no route.
    let out = email(&["--slack-channel", "C0BOTH"]);
    assert!(!out.status.success());

    let deleted = json_of(&server.client(&key, &["notify", "delete", &id, "--json"]));
    assert_eq!(deleted["id"], id.as_str());
    let list = json_of(&server.client(&key, &["notify", "list", "--json"]));
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["name"], "mail");
    let log = server.stop();
    assert!(!log.contains(BOT_TOKEN) && !log.contains(SIGNING_SECRET));
    assert!(!log.contains(SMTP_PASSWORD));
}

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
[[model.script.turns]]
tool_calls = [{ name = "routine__helper", arguments = { input = "hi" } }]
[[tools]]
tool = "routine/helper"
mode = "confirm"
"#;

const HELPER: &str = r#"
name = "helper"
instructions = "Greet."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
text = "Hello."
repeat = true
"#;

type SlackCalls = std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>>;

/// A loopback fake of Slack's Web API: records each method called with its JSON body and
/// answers `ok` with the message's channel and ts.
fn fake_slack() -> (std::net::SocketAddr, SlackCalls) {
    use std::io::{BufRead as _, Read as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let calls: SlackCalls = std::sync::Arc::default();
    let sink = calls.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let mut reader = std::io::BufReader::new(stream);
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let mut length = 0_usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0_u8; length];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            let method = request_line
                .split_whitespace()
                .nth(1)
                .and_then(|path| path.rsplit('/').next())
                .unwrap_or_default()
                .to_owned();
            sink.lock()
                .unwrap()
                .push((method, serde_json::from_slice(&body).unwrap_or(Value::Null)));
            let reply = r#"{"ok":true,"channel":"C0CLI","ts":"1700000000.000100"}"#;
            let _ = write!(
                reader.get_mut(),
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reply}",
                reply.len()
            );
        }
    });
    (addr, calls)
}

/// Waits until Slack was called with `method` and a message holding `needle`.
fn wait_for_slack(calls: &SlackCalls, method: &str, needle: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let seen = calls.lock().unwrap().clone();
        if seen
            .iter()
            .any(|(m, body)| m == method && body.to_string().contains(needle))
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {method} with `{needle}`: {seen:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn deciding_with_the_cli_updates_the_slack_message_and_attempts_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        "public_url = \"https://wor.example.com/\"\n[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let mut db = database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let key = create_project(&db);
    let server = Server::start(&db, &[]);
    let (slack, calls) = fake_slack();
    let created = common::run(
        wor(&[
            "notify",
            "create",
            "ops",
            "--slack-channel",
            "C0CLI",
            "--slack-api-url",
            &format!("http://{slack}/api"),
            "--json",
        ])
        .env("WOR_SERVER", &server.url)
        .env("WOR_API_KEY", &key)
        .env("WOR_SLACK_BOT_TOKEN", BOT_TOKEN)
        .env("WOR_SLACK_SIGNING_SECRET", SIGNING_SECRET),
    );
    json_of(&created);
    for (name, toml) in [("helper", HELPER), ("caller", CALLER)] {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let applied = server.client(
            &key,
            &["routine", "apply", "-f", &file.display().to_string()],
        );
        assert!(applied.status.success(), "{}", text(&applied.stderr));
    }
    let approver = server.client(&key, &["member", "create", "pat", "--role", "approver"]);
    assert!(approver.status.success(), "{}", text(&approver.stderr));
    let approver = text(&approver.stdout).trim().to_owned();

    let started = server.client(&key, &["run", "start", "caller", "--input", "go"]);
    assert!(started.status.success(), "{}", text(&started.stderr));
    // The held call is posted to the channel by the server's own delivery loop.
    wait_for_slack(&calls, "chat.postMessage", "routine/helper");
    let listed = json_of(&server.client(&approver, &["approvals", "list", "--json"]));
    let approval = listed
        .as_array()
        .or_else(|| listed["approvals"].as_array())
        .unwrap()[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let approved = server.client(
        &approver,
        &[
            "approvals",
            "approve",
            &approval,
            "--reason",
            "from the terminal",
        ],
    );
    assert!(approved.status.success(), "{}", text(&approved.stderr));
    // Deciding in the CLI updates the Slack message: who, how and why.
    wait_for_slack(&calls, "chat.update", "through the API");
    let update = calls
        .lock()
        .unwrap()
        .iter()
        .find(|(m, _)| m == "chat.update")
        .cloned()
        .unwrap();
    assert_eq!(update.1["ts"], "1700000000.000100");
    let shown = update.1.to_string();
    assert!(
        shown.contains("pat") && shown.contains("from the terminal"),
        "{shown}"
    );

    // Both attempts are counted on the operator's metrics listener, by channel and result.
    let log = server.log.lock().unwrap().clone();
    let metrics = log
        .lines()
        .find_map(|l| l.strip_prefix("wor: metrics on http://"))
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics listener: {log}"))
        .to_owned();
    let scrape = || {
        use std::io::{Read as _, Write as _};
        #[expect(
            clippy::disallowed_methods,
            reason = "the test scrapes its own server on loopback"
        )]
        let mut stream = std::net::TcpStream::connect(&metrics).unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    };
    let delivered = |scraped: &str| {
        scraped
            .lines()
            .find_map(|l| {
                l.strip_prefix(
                    r#"wor_notification_deliveries_total{channel="slack",result="delivered"} "#,
                )
            })
            .map(|n| n.trim().to_owned())
    };
    // The update's attempt is counted when its answer is read, a moment after Slack saw it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut scraped = scrape();
    while delivered(&scraped).as_deref() != Some("2") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        scraped = scrape();
    }
    assert_eq!(delivered(&scraped).as_deref(), Some("2"), "{scraped}");
    let log = server.stop();
    assert!(!log.contains(BOT_TOKEN) && !log.contains(SIGNING_SECRET));
}
