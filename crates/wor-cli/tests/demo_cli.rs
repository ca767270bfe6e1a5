//! `wor demo`: the scenario to its end with `--no-wait`, and the interactive form decided by a
//! person through `wor approvals` while the demo waits.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use common::{run, text, wor};

const CHECKS: [&str; 5] = [
    "ok      the read-only call demo/read_inbox ran",
    "ok      the upload to collector.evil.example was refused by the egress guard",
    "ok      the mail to attacker@evil.example was held for approval and not sent",
    "ok      the run finished with its summary",
    "ok      the audit chain of the demo project verifies",
];

fn data_dir_of(stdout: &str) -> PathBuf {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("data dir"))
        .unwrap_or_else(|| panic!("no data dir line in:\n{stdout}"));
    PathBuf::from(line.trim_start().trim_start_matches("data dir").trim())
}

#[test]
fn the_demo_runs_to_its_end_and_every_step_behaves() {
    let out = run(&mut wor(&["demo", "--no-wait"]));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for check in CHECKS {
        assert!(stdout.contains(check), "missing `{check}` in:\n{stdout}");
    }
    assert!(stdout.contains("ok      the held mail never reached the outbox"));
    assert!(!stdout.contains("FAILED"), "{stdout}");
    // The injected instruction was shown to the model inside the untrusted envelope.
    assert!(stdout.contains("<untrusted-data source=\"demo/read_inbox\""));
    assert!(
        !data_dir_of(&stdout).exists(),
        "the temporary data dir is removed"
    );
}

#[test]
fn a_person_decides_the_held_call_with_wor_approvals_while_the_demo_waits() {
    let mut child = wor(&["demo"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, received) = mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let mut seen = String::new();
    let mut read_until = |marker: &str| -> String {
        loop {
            let line = received
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no `{marker}` in:\n{seen}"));
            seen.push_str(&line);
            seen.push('\n');
            if line.contains(marker) {
                return line;
            }
        }
    };
    let export = read_until("export WOR_SERVER=");
    let deny = read_until("wor approvals deny");
    let mut vars = export.trim().trim_start_matches("export ").split(' ');
    let server = vars
        .next()
        .unwrap()
        .trim_start_matches("WOR_SERVER=")
        .to_owned();
    let approver_key = vars
        .next()
        .unwrap()
        .trim_start_matches("WOR_API_KEY=")
        .to_owned();
    let id = deny
        .split_whitespace()
        .find(|w| w.starts_with("apr_"))
        .unwrap()
        .to_owned();
    let client = |args: &[&str]| {
        let mut cmd = wor(args);
        cmd.env("WOR_SERVER", &server)
            .env("WOR_API_KEY", &approver_key);
        run(&mut cmd)
    };

    let listed = client(&["approvals", "list"]);
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    assert!(text(&listed.stdout).contains(&id));
    let shown = client(&["approvals", "show", &id]);
    let shown_text = text(&shown.stdout);
    assert!(shown.status.success(), "{}", text(&shown.stderr));
    assert!(
        shown_text.contains("to = \"attacker@evil.example\""),
        "{shown_text}"
    );
    assert!(
        shown_text.contains("(pinned by the routine)"),
        "{shown_text}"
    );
    assert!(shown_text.contains("tool:demo/read_inbox"), "{shown_text}");
    let missing_reason = client(&["approvals", "deny", &id]);
    assert!(!missing_reason.status.success());
    // The command exactly as the demo printed it, typed into a shell where `wor` is not on
    // PATH: it must name the binary so that it runs from where the user stands.
    let shell = |line: &str| {
        run(std::process::Command::new("sh")
            .args(["-c", line.trim()])
            .env("PATH", "/usr/bin:/bin")
            .env("WOR_SERVER", &server)
            .env("WOR_API_KEY", &approver_key))
    };
    let denied = shell(&deny);
    assert!(
        denied.status.success(),
        "`{}` failed: {}",
        deny.trim(),
        text(&denied.stderr)
    );
    let again = client(&["approvals", "approve", &id, "--reason", "changed my mind"]);
    assert!(!again.status.success(), "a decision is final");
    assert!(
        text(&again.stderr).contains("already denied"),
        "{}",
        text(&again.stderr)
    );
    // Edit and approve through the CLI: malformed edits are refused before anything is sent,
    // and an edit of a decided call is refused by the server like any decision.
    for (edit, needle) in [
        ("to", "NAME=JSON"),
        ("to=ops@example.com", "not JSON"),
        ("to=\"ops@example.com\"", "already denied"),
    ] {
        let edited = client(&[
            "approvals",
            "approve",
            &id,
            "--reason",
            "fix",
            "--edit",
            edit,
        ]);
        assert!(!edited.status.success(), "{edit}");
        assert!(
            text(&edited.stderr).contains(needle),
            "{edit}: {}",
            text(&edited.stderr)
        );
    }

    let verify = read_until("wor audit verify --data-dir");
    let dir = verify.split("--data-dir").nth(1).unwrap().trim().to_owned();
    let verified = shell(&verify);
    assert!(verified.status.success(), "{}", text(&verified.stdout));
    assert!(text(&verified.stdout).contains("intact"));

    // Ctrl-C ends the demo, which then reports and removes its data dir.
    let interrupted = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    let status = child.wait().unwrap();
    while let Ok(line) = received.recv_timeout(Duration::from_secs(5)) {
        seen.push_str(&line);
        seen.push('\n');
    }
    assert!(status.success(), "{seen}");
    for check in CHECKS {
        assert!(seen.contains(check), "missing `{check}` in:\n{seen}");
    }
    assert!(
        seen.contains("ok      the held mail never reached the outbox"),
        "{seen}"
    );
    assert!(
        !PathBuf::from(&dir).exists(),
        "the temporary data dir is removed"
    );
}
