//! `wor notify …` through the binary: a Slack route and an email route are made with their
//! secrets from the environment (never on the command line, never printed), listed, the
//! delivery log read and a route deleted, each with `--json` that parses.
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
