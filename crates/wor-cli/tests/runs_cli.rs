//! Routines and runs through the binary: apply a routine, start a run and follow it live,
//! list and show runs, and a run that fails ending the follow with a non-zero exit.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use common::{Server, create_project, database_args, text};

const ROUTINE: &str = r#"
name = "greeter"
instructions = "Greet the requester."

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
when = { context_contains = "fail please" }
tool_calls = [{ name = "mail/send" }]
repeat = true

[[model.script.turns]]
text = "Hello from the routine."
repeat = true
"#;

#[test]
fn a_routine_runs_and_is_followed_live() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_args(dir.path());
    let key = create_project(&db);
    let server = Server::start(&db, &[]);
    let file = dir.path().join("greeter.toml");
    std::fs::write(&file, ROUTINE).unwrap();
    let applied = server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(applied.status.success(), "{}", text(&applied.stderr));
    assert!(
        text(&applied.stdout).contains("applied greeter"),
        "{}",
        text(&applied.stdout)
    );
    let again = server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(
        text(&again.stdout).contains("unchanged greeter"),
        "{}",
        text(&again.stdout)
    );
    assert!(
        !text(&again.stderr).contains("warning"),
        "{}",
        text(&again.stderr)
    );
    // A roster naming a connection the project does not have is applied, and said.
    std::fs::write(
        &file,
        format!("{ROUTINE}[[tools]]\ntool = \"nocon/lookup\"\nmode = \"auto\"\n"),
    )
    .unwrap();
    let gap = server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(gap.status.success(), "{}", text(&gap.stderr));
    assert!(
        text(&gap.stderr)
            .contains("warning: `tools`: `nocon/lookup` names tool connection `nocon`"),
        "{}",
        text(&gap.stderr)
    );
    std::fs::write(&file, ROUTINE).unwrap();
    server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );

    let followed = server.client(
        &key,
        &["run", "start", "greeter", "--input", "hi there", "--follow"],
    );
    let out = text(&followed.stdout);
    assert!(
        followed.status.success(),
        "{out}\n{}",
        text(&followed.stderr)
    );
    assert!(out.contains("[requester] input: \"hi there\""), "{out}");
    // The model's text as it streams, its turn then pointing at it; or, for a follower that
    // came after the turn, the turn as recorded.
    assert!(
        out.contains("Hello from the routine.\n[model] (the text above)\n")
            || out.contains("[model] Hello from the routine.\n"),
        "{out}"
    );
    assert!(out.contains("[engine] succeeded"), "{out}");

    // A run that runs out of turns: the follow ends non-zero, naming the limit.
    let budget = ROUTINE.replace("[model]", "[budget]\nturns = 2\n\n[model]");
    std::fs::write(&file, budget).unwrap();
    assert!(
        server
            .client(
                &key,
                &["routine", "apply", "-f", &file.display().to_string()]
            )
            .status
            .success()
    );
    let failed = server.client(
        &key,
        &[
            "run",
            "start",
            "greeter",
            "--input",
            "fail please",
            "--follow",
        ],
    );
    assert_eq!(failed.status.code(), Some(1), "{}", text(&failed.stdout));
    assert!(
        text(&failed.stderr).contains("budget_exceeded"),
        "{}",
        text(&failed.stderr)
    );
    assert!(
        text(&failed.stdout).contains("not on this routine's roster"),
        "{}",
        text(&failed.stdout)
    );

    let listed = server.client(&key, &["run", "list", "--routine", "greeter"]);
    let listed = text(&listed.stdout);
    assert_eq!(listed.lines().count(), 2, "{listed}");
    assert!(
        listed.contains("succeeded") && listed.contains("budget_exceeded"),
        "{listed}"
    );
    let run_id = listed
        .lines()
        .last()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let shown = server.client(&key, &["run", "get", &run_id]);
    assert!(
        text(&shown.stdout).contains("Hello from the routine."),
        "{}",
        text(&shown.stdout)
    );

    let shown = server.client(&key, &["routine", "show", "greeter"]);
    assert!(
        text(&shown.stdout).contains("v2"),
        "{}",
        text(&shown.stdout)
    );
    server.stop();
}

#[test]
fn a_start_sent_again_under_its_idempotency_key_starts_nothing_new() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_args(dir.path());
    let key = create_project(&db);
    let server = Server::start(&db, &[]);
    let file = dir.path().join("greeter.toml");
    std::fs::write(&file, ROUTINE).unwrap();
    let applied = server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(applied.status.success(), "{}", text(&applied.stderr));
    let start = |input: &str, idempotency_key: &str| {
        server.client(
            &key,
            &[
                "run",
                "start",
                "greeter",
                "--input",
                input,
                "--idempotency-key",
                idempotency_key,
            ],
        )
    };

    let first = start("hi", "order-1");
    assert!(first.status.success(), "{}", text(&first.stderr));
    let run_id = text(&first.stdout).trim().to_owned();
    assert!(run_id.starts_with("run_"), "{run_id}");
    // Sent again, after a lost answer say: the same run, and nothing new started.
    let again = start("hi", "order-1");
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout).trim(), run_id);
    assert!(
        text(&again.stderr).contains(&format!("already started run {run_id}")),
        "{}",
        text(&again.stderr)
    );
    // Other input under the key is refused with the run it started named.
    let reused = start("something else", "order-1");
    assert_eq!(reused.status.code(), Some(1), "{}", text(&reused.stdout));
    let said = text(&reused.stderr);
    assert!(
        said.contains("idempotency_key_reused")
            && said.contains("HTTP 422")
            && said.contains(&run_id)
            && said.contains("with other input"),
        "{said}"
    );
    // A key that cannot be one is a usage error, before any request.
    let bad = start("hi", "two words");
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
    assert!(
        text(&bad.stderr).contains("visible ASCII"),
        "{}",
        text(&bad.stderr)
    );

    // Through the API as it is: a replay answers 200 and says so; a repeated header is a 400.
    let shown = server.client(&key, &["run", "get", &run_id, "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["trigger_key"], "request:order-1");
    let routine_id = shown["routine_id"].as_str().unwrap().to_owned();
    let post = |headers: &str| {
        let body = r#"{"input":"hi"}"#;
        server.raw(&format!(
            "POST /v1/routines/{routine_id}/runs HTTP/1.1\r\nHost: wor\r\nAuthorization: Bearer {key}\r\n\
             Content-Type: application/json\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ))
    };
    let replayed = post("Idempotency-Key: order-1\r\n").to_ascii_lowercase();
    assert!(replayed.starts_with("http/1.1 200"), "{replayed}");
    assert!(replayed.contains("idempotent-replayed: true"), "{replayed}");
    assert!(replayed.contains(&run_id), "{replayed}");
    let empty = post("Idempotency-Key: \r\n");
    assert!(empty.starts_with("HTTP/1.1 400"), "{empty}");
    assert!(empty.contains("invalid_idempotency_key"), "{empty}");
    let twice = post("Idempotency-Key: a\r\nIdempotency-Key: b\r\n");
    assert!(twice.starts_with("HTTP/1.1 400"), "{twice}");
    assert!(twice.contains("invalid_idempotency_key"), "{twice}");
    // A key with a secret's shape would be kept and shown in the clear: refused.
    let shaped = ["ghp_", "0123456789abcdefghijABCDEFGHIJ012345"].concat();
    let secret = post(&format!("Idempotency-Key: {shaped}\r\n"));
    assert!(secret.starts_with("HTTP/1.1 400"), "{secret}");
    assert!(secret.contains("the shape of a secret"), "{secret}");
    // An error that quotes what was sent reaches the terminal with its control characters
    // escaped: the server's, and the CLI's own refusal of an argument.
    for (args, code) in [
        (["run", "start", "gone\u{1b}[2J\u{202e}"], 1),
        (["run", "get", "run_\u{1b}[2Jgone\r"], 2),
    ] {
        let escaped = server.client(&key, &args);
        assert_eq!(
            escaped.status.code(),
            Some(code),
            "{}",
            text(&escaped.stdout)
        );
        let said = text(&escaped.stderr);
        assert!(
            !said.contains(['\u{1b}', '\r', '\u{202e}']) && said.contains("\\u{"),
            "{said:?}"
        );
    }

    // An https URL for this plain HTTP server: said so.
    let tls_url = server.url.replacen("http://", "https://", 1);
    let wrong_scheme =
        common::run(common::wor(&["run", "list", "--server", &tls_url]).env("WOR_API_KEY", &key));
    assert_eq!(wrong_scheme.status.code(), Some(1));
    assert!(
        text(&wrong_scheme.stderr).contains("if it serves plain HTTP, give an http:// URL"),
        "{}",
        text(&wrong_scheme.stderr)
    );
    let fresh = post("Idempotency-Key: order-2\r\n");
    assert!(fresh.starts_with("HTTP/1.1 202"), "{fresh}");

    // One run for each key that started one, however often it was sent.
    let listed = server.client(&key, &["run", "list", "--routine", "greeter"]);
    assert_eq!(
        text(&listed.stdout).lines().count(),
        2,
        "{}",
        text(&listed.stdout)
    );
    server.stop();
}

#[test]
fn a_malformed_replay_script_is_refused_by_routine_apply_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_args(dir.path());
    let key = create_project(&db);
    let server = Server::start(&db, &[]);
    let file = dir.path().join("greeter.toml");
    // Both `arguments` and `arguments_after` in the first turn, which starts on line 9.
    let malformed = ROUTINE.replace(
        "tool_calls = [{ name = \"mail/send\" }]",
        "tool_calls = [{ name = \"mail/send\", arguments = {}, arguments_after = \"ARGS:\" }]",
    );
    std::fs::write(&file, malformed).unwrap();
    let applied = server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(!applied.status.success(), "{}", text(&applied.stdout));
    let err = text(&applied.stderr);
    assert!(
        err.contains("line 9: `model.script`: tool call `mail/send` of turn 1 has both `arguments` and `arguments_after`"),
        "{err}"
    );
    let listed = server.client(&key, &["routine", "list"]);
    assert!(
        !text(&listed.stdout).contains("greeter"),
        "{}",
        text(&listed.stdout)
    );
}

#[test]
fn a_keyless_model_connection_needs_the_operators_model_range() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(&config, "[egress]\nmodel_cidrs = [\"10.0.0.0/24\"]\n").unwrap();
    let mut db = database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let key = create_project(&db);
    let server = Server::start(&db, &[]);
    let create = |name: &str, base_url: &str| {
        server.client(
            &key,
            &[
                "model-connection",
                "create",
                name,
                "--provider",
                "openai_compatible",
                "--base-url",
                base_url,
            ],
        )
    };
    let local = create("local", "http://10.0.0.5:11434/v1");
    assert!(local.status.success(), "{}", text(&local.stderr));
    assert!(
        text(&local.stdout).contains("key absent"),
        "{}",
        text(&local.stdout)
    );
    let elsewhere = create("elsewhere", "http://10.0.1.5:11434/v1");
    assert!(!elsewhere.status.success());
    assert!(
        text(&elsewhere.stderr).contains("model_cidrs"),
        "{}",
        text(&elsewhere.stderr)
    );
    // The model range is not open to anything else: `wor egress check` (the policy of tools
    // and webhooks) still refuses it.
    let checked = common::run(&mut common::wor(&[
        "egress",
        "check",
        "http://10.0.0.5:11434/v1",
        "--config",
        &config.display().to_string(),
    ]));
    assert_eq!(checked.status.code(), Some(1), "{}", text(&checked.stdout));
    server.stop();
}

const STRUCTURED: &str = r#"
name = "triage"
instructions = "Classify the page."

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
text = '''{"severity": "high", "summary": "disk full"}'''
repeat = true

[output]
schema = { type = "object", required = ["severity", "summary"], properties = { severity = { enum = ["low", "high"] }, summary = { type = "string" } } }
"#;

#[test]
fn a_structured_result_is_shown_by_follow_and_get_and_is_json_with_json() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_args(dir.path());
    let key = create_project(&db);
    let server = Server::start(&db, &[]);
    let file = dir.path().join("triage.toml");
    std::fs::write(&file, STRUCTURED).unwrap();
    let applied = server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(applied.status.success(), "{}", text(&applied.stderr));
    let expected = serde_json::json!({"severity": "high", "summary": "disk full"});

    // Followed live: the checked result is a step of its own.
    let followed = server.client(&key, &["run", "start", "triage", "--follow"]);
    let out = text(&followed.stdout);
    assert!(followed.status.success(), "{out}");
    assert!(
        out.contains(r#"[model] result: {"severity":"high","summary":"disk full"}"#),
        "{out}"
    );

    // Followed with --json: stdout is the ended run, its result a JSON value.
    let followed = server.client(&key, &["run", "start", "triage", "--follow", "--json"]);
    assert!(followed.status.success(), "{}", text(&followed.stderr));
    let run: serde_json::Value = serde_json::from_slice(&followed.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", text(&followed.stdout)));
    assert_eq!(run["status"], "succeeded");
    assert_eq!(run["result"], expected);
    assert!(
        text(&followed.stderr).contains("[model] result:"),
        "the live view goes to stderr: {}",
        text(&followed.stderr)
    );
    let id = run["id"].as_str().unwrap();

    // Shown: indented under the summary, and as JSON with --json.
    let shown = server.client(&key, &["run", "get", id]);
    assert!(
        text(&shown.stdout)
            .contains("result:\n{\n  \"severity\": \"high\",\n  \"summary\": \"disk full\"\n}"),
        "{}",
        text(&shown.stdout)
    );
    let shown = server.client(&key, &["run", "get", id, "--json"]);
    let run: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(run["result"], expected);

    // Listed: each run's result, compact in the table and a JSON value with --json.
    let listed = server.client(&key, &["run", "list"]);
    let table = text(&listed.stdout);
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    assert_eq!(
        table
            .lines()
            .filter(|l| l.contains(r#"result {"severity":"high","summary":"disk full"}"#))
            .count(),
        2,
        "{table}"
    );
    let listed = server.client(&key, &["run", "list", "--json"]);
    let runs: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let runs = runs.as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r["result"] == expected), "{runs:?}");

    // Page by page: the page after the first run holds the second, and nothing follows it.
    let page = |args: &[&str]| {
        let mut all = vec!["run", "list", "--json", "--limit", "1"];
        all.extend_from_slice(args);
        let listed = server.client(&key, &all);
        assert!(listed.status.success(), "{}", text(&listed.stderr));
        let page: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
        page.as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let first = page(&[]);
    assert_eq!(first, [runs[0]["id"].as_str().unwrap()]);
    let second = page(&["--before", &first[0]]);
    assert_eq!(second, [runs[1]["id"].as_str().unwrap()]);
    assert!(page(&["--before", &second[0]]).is_empty());
    // A value is sent as one value: it cannot add a parameter of its own.
    let smuggled = server.client(&key, &["run", "list", "--status", "queued&limit=0"]);
    assert!(!smuggled.status.success());
    assert!(
        text(&smuggled.stderr).contains("queued&limit=0"),
        "{}",
        text(&smuggled.stderr)
    );
    server.stop();
}

/// A streaming OpenAI-compatible model on loopback: text deltas, a GitHub token split across
/// three of them, then the finish. The first comes at once and the second 500 ms later, the
/// rest 30 ms apart: `run start --follow` subscribes once the start has answered, most often
/// after the first, which it is given as the text so far.
fn streaming_model() -> std::net::SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let route = axum::routing::post(|| async {
                let filler = "and then some more words. ".repeat(12);
                let deltas = [
                    "The token is ".to_owned(),
                    "ghp_a1B2c3D4e5f6".to_owned(),
                    "G7h8I9j0k1L2m3n4".to_owned(),
                    "O5p6Q7r8".to_owned(),
                    " and ".to_owned(),
                    filler,
                ];
                let mut chunks: Vec<String> = deltas
                    .iter()
                    .map(|d| {
                        let chunk = serde_json::json!({"choices": [{"index": 0, "delta": {"content": d}}]});
                        format!("data: {chunk}\n\n")
                    })
                    .collect();
                chunks.push(format!(
                    "data: {}\n\ndata: [DONE]\n\n",
                    serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 40}})
                ));
                let stream = futures::stream::unfold(
                    (chunks.into_iter(), 0),
                    |(mut chunks, sent)| async move {
                        let chunk = chunks.next()?;
                        let wait_ms = match sent {
                            0 => 0,
                            1 => 500,
                            _ => 30,
                        };
                        tokio::time::sleep(std::time::Duration::from_millis(wait_ms)).await;
                        Some((Ok::<_, std::convert::Infallible>(chunk), (chunks, sent + 1)))
                    },
                );
                (
                    [("content-type", "text/event-stream")],
                    axum::body::Body::from_stream(stream),
                )
            });
            let app = axum::Router::new().route("/v1/chat/completions", route);
            axum::serve(listener, app).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

#[test]
fn follow_prints_the_models_text_as_it_streams_with_a_split_token_redacted() {
    let model = streaming_model();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(&config, "[egress]\nmodel_cidrs = [\"127.0.0.1/32\"]\n").unwrap();
    let mut db = database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let key = create_project(&db);
    let server = Server::start(&db, &[]);
    let created = server.client(
        &key,
        &[
            "model-connection",
            "create",
            "local",
            "--provider",
            "openai_compatible",
            "--base-url",
            &format!("http://{model}/v1"),
        ],
    );
    assert!(created.status.success(), "{}", text(&created.stderr));
    let file = dir.path().join("talker.toml");
    std::fs::write(
        &file,
        "name = \"talker\"\ninstructions = \"Talk.\"\n[model]\nprovider = \"openai_compatible\"\n\
         connection = \"local\"\nmodel = \"m\"\n",
    )
    .unwrap();
    let applied = server.client(
        &key,
        &["routine", "apply", "-f", &file.display().to_string()],
    );
    assert!(applied.status.success(), "{}", text(&applied.stderr));

    let followed = server.client(&key, &["run", "start", "talker", "--follow"]);
    let out = text(&followed.stdout);
    assert!(
        followed.status.success(),
        "{out}\n{}",
        text(&followed.stderr)
    );
    for part in ["ghp_", "a1B2c3D4", "G7h8I9j0", "O5p6Q7r8"] {
        assert!(!out.contains(part), "`{part}` was printed: {out}");
    }
    // The streamed text, redacted, on its own line before the recorded turn.
    let streamed = format!(
        "The token is [REDACTED:github-pat] and {}",
        "and then some more words. ".repeat(12)
    );
    let text_at = out
        .find(&format!("{streamed}\n"))
        .unwrap_or_else(|| panic!("no streamed line: {out}"));
    let turn_at = out.find("[model] ").unwrap();
    assert!(text_at < turn_at, "{out}");
    // The turn that records it is not shown again: its line points at the text above.
    let before_the_end = out.split("[engine]").next().unwrap();
    assert_eq!(before_the_end.matches("The token is").count(), 1, "{out}");
    assert!(out.contains("[model] (the text above)\n"), "{out}");
    server.stop();
}
