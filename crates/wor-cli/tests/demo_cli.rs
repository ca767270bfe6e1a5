//! `wor demo`: the scenario to its end with `--no-wait`, and the interactive form decided by a
//! person through `wor approvals` while the demo waits, after its console link signed the
//! approver in once, and a second Ctrl-C while it drains.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
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

/// An HTTP/1.1 exchange over loopback: the status, the `Set-Cookie` values and the body.
fn http(
    server: &str,
    method: &str,
    path: &str,
    cookie: &str,
    form: &str,
) -> (u16, Vec<String>, String) {
    let addr = server.trim_start_matches("http://");
    #[expect(
        clippy::disallowed_methods,
        reason = "the test talks to the demo's own server on loopback"
    )]
    let mut stream = TcpStream::connect(addr).unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nCookie: {cookie}\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
        form.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let cookies = head
        .lines()
        .filter_map(|l| l.strip_prefix("set-cookie: "))
        .map(|c| c.split(';').next().unwrap().to_owned())
        .collect();
    (status, cookies, body.to_owned())
}

/// The hidden `csrf` field of a page's form.
fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").unwrap() + "name=\"csrf\" value=\"".len();
    page[at..].split('"').next().unwrap().to_owned()
}

/// The demo's console link signs its approver in once: the page names them, its form opens a
/// session that shows the held call, and the same link is then refused.
fn the_console_link_signs_in_once(link: &str, approval: &str) {
    let (server, path) = link.split_at(link.find("/console/").unwrap());
    let (status, cookies, page) = http(server, "GET", path, "", "");
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("dana (approver)"), "{page}");
    let form = cookies
        .iter()
        .find(|c| c.starts_with("wor_form="))
        .unwrap()
        .clone();
    let csrf = csrf_of(&page);
    // Without its form token the form is refused and the link stays unused.
    let (status, _, _) = http(server, "POST", path, &form, "csrf=forged");
    assert_eq!(status, 403);
    let (status, cookies, _) = http(server, "POST", path, &form, &format!("csrf={csrf}"));
    assert_eq!(status, 303);
    let session = cookies
        .iter()
        .find(|c| c.starts_with("wor_session=wrs_"))
        .unwrap()
        .clone();
    let (status, _, inbox) = http(server, "GET", "/console/approvals", &session, "");
    assert_eq!(status, 200);
    assert!(inbox.contains(approval), "the approver sees the held call");
    assert!(inbox.contains("dana (approver)"));
    // Used once, the link is refused, to a fresh form as to the old one.
    let (status, _, _) = http(server, "POST", path, &form, &format!("csrf={csrf}"));
    assert_eq!(status, 404);
    let (status, _, _) = http(server, "GET", path, "", "");
    assert_eq!(status, 404);
}

/// `wor demo` waiting for a person, its output read line by line as it comes.
struct Waiting {
    child: std::process::Child,
    received: mpsc::Receiver<String>,
    /// Every line read so far.
    seen: String,
}

impl Waiting {
    fn start() -> Self {
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
        Waiting {
            child,
            received,
            seen: String::new(),
        }
    }

    /// Reads up to the first line that holds `marker`, and returns that line.
    fn read_until(&mut self, marker: &str) -> String {
        loop {
            let line = self
                .received
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no `{marker}` in:\n{}", self.seen));
            self.seen.push_str(&line);
            self.seen.push('\n');
            if line.contains(marker) {
                return line;
            }
        }
    }

    /// The server and the approver's key the demo printed for its `export` line.
    fn server_and_key(&mut self) -> (String, String) {
        let export = self.read_until("export WOR_SERVER=");
        let mut vars = export.trim().trim_start_matches("export ").split(' ');
        let server = vars.next().unwrap().trim_start_matches("WOR_SERVER=");
        let key = vars.next().unwrap().trim_start_matches("WOR_API_KEY=");
        (server.to_owned(), key.to_owned())
    }

    /// Sends the demo SIGINT, as Ctrl-C does.
    fn interrupt(&self) {
        let sent = std::process::Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }
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
    let mut demo = Waiting::start();
    let link = demo
        .read_until("/console/sign-in-links/wrl_")
        .trim()
        .to_owned();
    let (server, approver_key) = demo.server_and_key();
    let deny = demo.read_until("wor approvals deny");
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

    the_console_link_signs_in_once(&link, &id);

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

    let verify = demo.read_until("wor audit verify --data-dir");
    let dir = verify.split("--data-dir").nth(1).unwrap().trim().to_owned();
    let verified = shell(&verify);
    assert!(verified.status.success(), "{}", text(&verified.stdout));
    assert!(text(&verified.stdout).contains("intact"));

    // Ctrl-C ends the demo, which then reports and removes its data dir.
    demo.interrupt();
    let status = demo.child.wait().unwrap();
    while let Ok(line) = demo.received.recv_timeout(Duration::from_secs(5)) {
        demo.seen.push_str(&line);
        demo.seen.push('\n');
    }
    let seen = demo.seen;
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

#[test]
fn a_second_ctrl_c_while_the_demo_drains_still_removes_its_data_dir() {
    let mut demo = Waiting::start();
    let dir = data_dir_of(&demo.read_until("data dir"));
    let (server, key) = demo.server_and_key();
    demo.read_until("Waiting for the decision");
    let run = demo
        .seen
        .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .find(|w| w.starts_with("run_"))
        .unwrap()
        .to_owned();
    // A client following the waiting run holds the drain open (for its grace, 10 s), so the
    // second signal surely lands while the demo drains.
    #[expect(
        clippy::disallowed_methods,
        reason = "the test talks to the demo's own server on loopback"
    )]
    let mut follower = TcpStream::connect(server.trim_start_matches("http://")).unwrap();
    follower
        .write_all(
            format!(
                "GET /v1/runs/{run}/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
            )
            .as_bytes(),
        )
        .unwrap();
    let mut head = [0u8; 12];
    follower.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200", "the follower is answered");
    demo.interrupt();
    demo.read_until("Stopped before the decision");
    demo.interrupt();
    let status = demo.child.wait().unwrap();
    let mut stderr = String::new();
    demo.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("a second signal"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the temporary data dir {} is removed",
            dir.display()
        )),
        "{stderr}"
    );
    assert!(!dir.exists(), "{} is left: {stderr}", dir.display());
    drop(follower);
}
