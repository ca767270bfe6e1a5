//! Approval requests by email, against a loopback SMTP relay written here: one message per
//! request (or one digest per window) with the call's facts and the link to its console page,
//! sent through the egress guard with retries; STARTTLS required unless the operator allows
//! plaintext to a loopback relay; STARTTLS and implicit TLS (SMTPS) completed with a relay
//! whose certificate the operator's configuration trusts; credentials sealed; the link asks
//! for a sign-in and comes back to the approval; every attempt counted by channel and result.
#![allow(
    clippy::disallowed_methods,
    reason = "the test hosts a loopback SMTP relay"
)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use base64::Engine as _;
use common::{Harness, serve};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tower::ServiceExt;

const CONSOLE_URL: &str = "https://wor.example.com";
const SMTP_USER: &str = "relay-user";
const SMTP_PASSWORD: &str = "relay-password-7f3a9c";

/// What the relay saw in one SMTP session.
#[derive(Debug, Default, Clone)]
struct Session {
    /// Every command line, in order (the AUTH line included).
    commands: Vec<String>,
    rcpt: Vec<String>,
    /// The message as sent after `DATA`, when one was accepted.
    data: Option<String>,
}

impl Session {
    fn saw(&self, verb: &str) -> bool {
        self.commands
            .iter()
            .any(|c| c.to_ascii_uppercase().starts_with(verb))
    }

    /// The decoded text body of the message (it is sent base64-encoded).
    fn body(&self) -> String {
        let data = self.data.as_deref().expect("a message");
        let (_, encoded) = data.split_once("\r\n\r\n").expect("headers and body");
        let joined: String = encoded.split("\r\n").collect();
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(joined.trim())
                .unwrap(),
        )
        .unwrap()
    }
}

#[derive(Clone, Copy)]
struct Relay {
    /// Offer STARTTLS (and then close: this relay speaks no TLS).
    starttls: bool,
    /// Offer `AUTH PLAIN`.
    auth: bool,
    /// Answer `MAIL FROM` with 451 in the first this many sessions.
    fail_first: usize,
}

type Sessions = Arc<Mutex<Vec<Session>>>;

/// A loopback SMTP relay that speaks just enough SMTP for one message per session.
async fn relay(options: Relay) -> (SocketAddr, Sessions) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sessions: Sessions = Arc::default();
    let sink = sessions.clone();
    tokio::spawn(async move {
        let mut served = 0_usize;
        while let Ok((stream, _)) = listener.accept().await {
            served += 1;
            let fail = served <= options.fail_first;
            let index = {
                let mut all = sink.lock().unwrap();
                all.push(Session::default());
                all.len() - 1
            };
            let sink = sink.clone();
            tokio::spawn(async move {
                let (read, mut write) = stream.into_split();
                let mut lines = BufReader::new(read).lines();
                write.write_all(b"220 relay.test ESMTP\r\n").await.unwrap();
                while let Ok(Some(line)) = lines.next_line().await {
                    sink.lock().unwrap()[index].commands.push(line.clone());
                    let verb = line.to_ascii_uppercase();
                    let reply: String = if verb.starts_with("EHLO") {
                        let mut reply = "250-relay.test\r\n".to_owned();
                        if options.starttls {
                            reply.push_str("250-STARTTLS\r\n");
                        }
                        if options.auth {
                            reply.push_str("250-AUTH PLAIN LOGIN\r\n");
                        }
                        reply.push_str("250 8BITMIME\r\n");
                        reply
                    } else if verb.starts_with("STARTTLS") {
                        write.write_all(b"220 go ahead\r\n").await.unwrap();
                        // No TLS here: the handshake fails and the client must give up.
                        write.write_all(b"not a TLS server hello\r\n").await.ok();
                        return;
                    } else if verb.starts_with("AUTH") {
                        "235 accepted\r\n".to_owned()
                    } else if verb.starts_with("MAIL FROM") {
                        if fail {
                            "451 try again later\r\n".to_owned()
                        } else {
                            "250 ok\r\n".to_owned()
                        }
                    } else if verb.starts_with("RCPT TO") {
                        let to = line
                            .split_once('<')
                            .and_then(|(_, r)| r.split_once('>'))
                            .map(|(a, _)| a.to_owned())
                            .unwrap_or_default();
                        sink.lock().unwrap()[index].rcpt.push(to);
                        "250 ok\r\n".to_owned()
                    } else if verb.starts_with("DATA") {
                        write.write_all(b"354 go on\r\n").await.unwrap();
                        let mut data = Vec::new();
                        while let Ok(Some(line)) = lines.next_line().await {
                            if line == "." {
                                break;
                            }
                            data.push(line);
                        }
                        sink.lock().unwrap()[index].data = Some(data.join("\r\n"));
                        "250 queued\r\n".to_owned()
                    } else if verb.starts_with("QUIT") {
                        write.write_all(b"221 bye\r\n").await.ok();
                        return;
                    } else {
                        "250 ok\r\n".to_owned()
                    };
                    if write.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, sessions)
}

/// A certificate for `127.0.0.1` that only the test trusts, and the relay's TLS acceptor
/// serving it.
fn relay_certificate() -> (Vec<u8>, tokio_rustls::TlsAcceptor) {
    let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let der = made.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::try_from(made.signing_key.serialize_der()).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key)
        .unwrap();
    (
        der.to_vec(),
        tokio_rustls::TlsAcceptor::from(Arc::new(config)),
    )
}

/// How the TLS relay encrypts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RelayTls {
    /// Plain SMTP until `STARTTLS`, then TLS.
    Starttls,
    /// TLS from the first byte (SMTPS).
    Implicit,
}

/// A loopback relay that completes TLS with `acceptor`'s certificate, then takes one message
/// with `AUTH`. The commands it saw before TLS are kept apart from those inside it.
async fn tls_relay(
    mode: RelayTls,
    acceptor: tokio_rustls::TlsAcceptor,
) -> (SocketAddr, Sessions, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sessions: Sessions = Arc::default();
    let before_tls: Arc<Mutex<Vec<String>>> = Arc::default();
    let (sink, plain_sink) = (sessions.clone(), before_tls.clone());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (sink, plain_sink, acceptor) = (sink.clone(), plain_sink.clone(), acceptor.clone());
            tokio::spawn(async move {
                if mode == RelayTls::Starttls {
                    stream.write_all(b"220 relay.test ESMTP\r\n").await.unwrap();
                    let mut reader = BufReader::new(&mut stream);
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let line = line.trim_end().to_owned();
                        plain_sink.lock().unwrap().push(line.clone());
                        let verb = line.to_ascii_uppercase();
                        let reply: &[u8] = if verb.starts_with("EHLO") {
                            b"250-relay.test\r\n250-STARTTLS\r\n250 8BITMIME\r\n"
                        } else if verb.starts_with("STARTTLS") {
                            b"220 go ahead\r\n"
                        } else {
                            b"530 must issue STARTTLS first\r\n"
                        };
                        reader.get_mut().write_all(reply).await.unwrap();
                        if verb.starts_with("STARTTLS") {
                            break;
                        }
                    }
                }
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let index = {
                    let mut all = sink.lock().unwrap();
                    all.push(Session::default());
                    all.len() - 1
                };
                smtp_inside_tls(tls, mode == RelayTls::Implicit, &sink, index).await;
            });
        }
    });
    (addr, sessions, before_tls)
}

/// The SMTP exchange inside TLS: `AUTH`, one message, `QUIT`.
async fn smtp_inside_tls<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    greet: bool,
    sink: &Sessions,
    index: usize,
) {
    let (read, mut write) = tokio::io::split(stream);
    let mut lines = BufReader::new(read).lines();
    if greet {
        write.write_all(b"220 relay.test ESMTP\r\n").await.unwrap();
    }
    while let Ok(Some(line)) = lines.next_line().await {
        sink.lock().unwrap()[index].commands.push(line.clone());
        let verb = line.to_ascii_uppercase();
        let reply = if verb.starts_with("EHLO") {
            "250-relay.test\r\n250-AUTH PLAIN LOGIN\r\n250 8BITMIME\r\n".to_owned()
        } else if verb.starts_with("AUTH") {
            "235 accepted\r\n".to_owned()
        } else if verb.starts_with("RCPT TO") {
            sink.lock().unwrap()[index].rcpt.push(line.clone());
            "250 ok\r\n".to_owned()
        } else if verb.starts_with("DATA") {
            write.write_all(b"354 go on\r\n").await.unwrap();
            let mut data = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                if line == "." {
                    break;
                }
                data.push(line);
            }
            sink.lock().unwrap()[index].data = Some(data.join("\r\n"));
            "250 queued\r\n".to_owned()
        } else if verb.starts_with("QUIT") {
            write.write_all(b"221 bye\r\n").await.ok();
            write.flush().await.ok();
            return;
        } else {
            "250 ok\r\n".to_owned()
        };
        if write.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
        write.flush().await.ok();
    }
}

/// The metrics this process recorded, installed once (each test runs in its own process).
fn recorded_metrics() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| wor_server::metrics::install_recorder().unwrap())
}

/// The value of one series of the notification delivery counter; 0 when it has none yet.
fn delivery_count(channel: &str, result: &str) -> f64 {
    let text = recorded_metrics().render();
    let series =
        format!("wor_notification_deliveries_total{{channel=\"{channel}\",result=\"{result}\"}}");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// An HTTP API tool server whose `send_note` is held for approval, with `to` pinned.
async fn notes_tool(h: &Harness) {
    let api = Router::new().route(
        "/v1/notes",
        axum::routing::post(|| async { axum::Json(json!({"status": "sent"})) }),
    );
    let addr = serve(api).await;
    let tools = json!([
        {"name": "send_note", "description": "Sends a note", "method": "POST", "path": "/notes",
         "inputSchema": {"type": "object", "properties": {"to": {"type": "string"}, "text": {"type": "string"}}}}
    ]);
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(
                json!({"name": "notes", "kind": "http_api", "url": format!("http://{addr}/v1"),
                "allowlist": [addr.to_string()], "tools": tools}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    h.review_and_enable(created["id"].as_str().unwrap(), &[])
        .await;
}

async fn apply_routine(h: &Harness) -> String {
    let long = "x".repeat(300);
    let toml = format!(
        r#"
name = "note-sender"
instructions = "Send the note."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = {{ last_tool_result_contains = "sent" }}
text = "sent it"
[[model.script.turns]]
tool_calls = [{{ name = "notes__send_note", arguments = {{ text = "{long}" }} }}]
[[tools]]
tool = "notes/send_note"
mode = "confirm"
pinned = {{ to = "team@example.com" }}
[concurrency]
max_runs = 5
"#
    );
    let (status, applied) = h
        .call(Method::POST, "/v1/routines", Some(json!({"toml": toml})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{applied}");
    applied["routine"]["id"].as_str().unwrap().to_owned()
}

/// Starts a run and drives it until it parks; returns its approval's id.
async fn parked(h: &Harness, routine: &str) -> String {
    let (status, run) = h
        .call(
            Method::POST,
            &format!("/v1/routines/{routine}/runs"),
            Some(json!({"input": "send it"})),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{run}");
    assert!(h.engine.run_next().await.unwrap(), "no run was queued");
    let pending = h.pending_approvals(run["id"].as_str().unwrap()).await;
    assert_eq!(pending.len(), 1);
    pending[0]["id"].as_str().unwrap().to_owned()
}

async fn email_route(h: &Harness, relay: SocketAddr, extra: Value) -> (StatusCode, Value) {
    let mut body = json!({"name": "mail", "kind": "email", "smtp_host": "127.0.0.1",
        "smtp_port": relay.port(), "smtp_tls": "plaintext_loopback",
        "email_from": "wor@example.com", "email_to": ["ann@example.com", "bob@example.com"]});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    h.call(Method::POST, "/v1/notification-routes", Some(body))
        .await
}

/// Sends every notification due, as if `ahead_ms` later (retries wait out their backoff).
async fn deliver(h: &Harness, ahead_ms: i64) -> usize {
    h.engine
        .deliver_notifications(wor_store::now_millis() + ahead_ms)
        .await
        .unwrap()
}

async fn deliveries(h: &Harness, route: &str) -> Vec<Value> {
    let (status, list) = h
        .call(
            Method::GET,
            &format!("/v1/notification-deliveries?route_id={route}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{list}");
    list.as_array().unwrap().clone()
}

fn config(plaintext: bool) -> wor_engine::EngineConfig {
    wor_engine::EngineConfig {
        console_url: Some(CONSOLE_URL.to_owned()),
        smtp_plaintext_loopback: plaintext,
        ..wor_engine::EngineConfig::default()
    }
}

/// The configuration of a server whose operator trusts `root` for SMTP relays
/// (`[notifications] smtp_ca_file`); plaintext is not allowed.
fn trusting(root: Vec<u8>) -> wor_engine::EngineConfig {
    wor_engine::EngineConfig {
        smtp_root_certificates: vec![root],
        ..config(false)
    }
}

async fn tls_route(h: &Harness, name: &str, relay: SocketAddr, tls: &str) -> String {
    let (status, route) = h
        .call(
            Method::POST,
            "/v1/notification-routes",
            Some(
                json!({"name": name, "kind": "email", "smtp_host": "127.0.0.1",
                "smtp_port": relay.port(), "smtp_tls": tls, "email_from": "wor@example.com",
                "email_to": ["ann@example.com"], "smtp_username": SMTP_USER,
                "smtp_password": SMTP_PASSWORD}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{route}");
    assert_eq!(route["smtp_tls"], tls);
    route["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn starttls_with_a_trusted_certificate_carries_the_login_and_the_message_inside_tls() {
    recorded_metrics();
    let (root, acceptor) = relay_certificate();
    let h = Harness::with_config(trusting(root)).await;
    notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let (addr, sessions, before_tls) = tls_relay(RelayTls::Starttls, acceptor).await;
    let route = tls_route(&h, "relay", addr, "starttls").await;
    let approval = parked(&h, &routine).await;
    assert_eq!(deliver(&h, 0).await, 1);
    let log = deliveries(&h, &route).await;
    assert_eq!(log[0]["status"], "delivered", "{log:?}");
    assert_eq!(log[0]["last_status_code"], 250);
    // In the clear: the greeting and STARTTLS only.
    let plain = before_tls.lock().unwrap().clone();
    assert_eq!(plain.len(), 2, "{plain:?}");
    assert!(
        plain[0].to_ascii_uppercase().starts_with("EHLO"),
        "{plain:?}"
    );
    assert_eq!(plain[1].to_ascii_uppercase(), "STARTTLS");
    assert!(
        !plain
            .iter()
            .any(|l| l.contains("AUTH") || l.contains("MAIL"))
    );
    // Inside TLS: the login and the message, with its link.
    let sessions = sessions.lock().unwrap().clone();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert!(
        sessions[0].saw("AUTH") && sessions[0].saw("MAIL FROM"),
        "{sessions:?}"
    );
    assert!(
        sessions[0]
            .body()
            .contains(&format!("{CONSOLE_URL}/console/approvals/{approval}")),
        "{:?}",
        sessions[0]
    );
    assert_eq!(delivery_count("email", "delivered"), 1.0);
}

#[tokio::test]
async fn implicit_tls_delivers_inside_tls_from_the_first_byte_and_an_untrusted_relay_gets_nothing()
{
    recorded_metrics();
    let (root, acceptor) = relay_certificate();
    let h = Harness::with_config(trusting(root)).await;
    notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let (addr, sessions, before_tls) = tls_relay(RelayTls::Implicit, acceptor).await;
    let route = tls_route(&h, "relay", addr, "implicit_tls").await;
    let approval = parked(&h, &routine).await;
    assert_eq!(deliver(&h, 0).await, 1);
    let log = deliveries(&h, &route).await;
    assert_eq!(log[0]["status"], "delivered", "{log:?}");
    assert!(
        before_tls.lock().unwrap().is_empty(),
        "nothing in the clear"
    );
    {
        let sessions = sessions.lock().unwrap();
        assert_eq!(sessions.len(), 1, "{sessions:?}");
        assert!(sessions[0].saw("AUTH"), "{sessions:?}");
        assert!(
            sessions[0]
                .body()
                .contains(&format!("/console/approvals/{approval}")),
            "{:?}",
            sessions[0]
        );
    }
    assert_eq!(delivery_count("email", "delivered"), 1.0);

    // A relay whose certificate the configuration does not trust: the handshake fails, so
    // neither the login nor the message is sent, and the attempt counts as a TLS failure.
    let (_, stranger) = relay_certificate();
    for mode in [RelayTls::Implicit, RelayTls::Starttls] {
        let (addr, sessions, _) = tls_relay(mode, stranger.clone()).await;
        let (name, tls) = match mode {
            RelayTls::Implicit => ("stranger-smtps", "implicit_tls"),
            RelayTls::Starttls => ("stranger-starttls", "starttls"),
        };
        let route = tls_route(&h, name, addr, tls).await;
        parked(&h, &routine).await;
        deliver(&h, 0).await;
        let log = deliveries(&h, &route).await;
        assert_eq!(log[0]["status"], "pending", "{log:?}");
        assert!(
            log[0]["last_error"].as_str().unwrap().contains("handshake"),
            "{log:?}"
        );
        assert!(sessions.lock().unwrap().is_empty(), "nothing inside TLS");
    }
    assert!(delivery_count("email", "tls") >= 2.0);
    // An SMTPS route's port is 465 unless given.
    let (status, route) = h
        .call(
            Method::POST,
            "/v1/notification-routes",
            Some(
                json!({"name": "smtps-default", "kind": "email", "smtp_host": "127.0.0.1",
                "smtp_tls": "implicit_tls", "email_from": "wor@example.com",
                "email_to": ["ann@example.com"]}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{route}");
    assert_eq!(route["smtp_port"], 465);
}

#[tokio::test]
async fn each_request_is_mailed_with_its_facts_and_link_and_a_failure_is_retried() {
    recorded_metrics();
    let h = Harness::with_config(config(true)).await;
    notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let (addr, sessions) = relay(Relay {
        starttls: false,
        auth: true,
        fail_first: 1,
    })
    .await;
    let (status, route) = email_route(
        &h,
        addr,
        json!({"smtp_username": SMTP_USER, "smtp_password": SMTP_PASSWORD}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{route}");
    // The credentials go in and never come out (S3).
    assert!(!route.to_string().contains(SMTP_PASSWORD), "{route}");
    assert!(!route.to_string().contains(SMTP_USER), "{route}");
    assert_eq!(route["smtp_credentials"]["configured"], true);
    assert_eq!(route["kind"], "email");
    assert_eq!(route["smtp_tls"], "plaintext_loopback");
    assert!(route.get("channel").is_none(), "{route}");
    let route_id = route["id"].as_str().unwrap().to_owned();
    let (_, listed) = h
        .call(
            Method::GET,
            &format!("/v1/notification-routes/{route_id}"),
            None,
        )
        .await;
    assert!(!listed.to_string().contains(SMTP_PASSWORD));

    let approval = parked(&h, &routine).await;
    // The first attempt meets a 451: it stays pending, with its error, for a later attempt.
    assert_eq!(deliver(&h, 0).await, 1);
    let log = deliveries(&h, &route_id).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0]["action"], "email.send");
    assert_eq!(log[0]["status"], "pending");
    assert_eq!(log[0]["attempts"], 1);
    assert!(
        log[0]["last_error"].as_str().unwrap().contains("451"),
        "{log:?}"
    );
    // Not due again before its backoff.
    assert_eq!(deliver(&h, 0).await, 0);
    // Counted by channel and class of result, never by its text.
    assert_eq!(delivery_count("email", "refused"), 1.0);
    assert_eq!(delivery_count("email", "delivered"), 0.0);
    assert_eq!(deliver(&h, 60_000).await, 1);
    let log = deliveries(&h, &route_id).await;
    assert_eq!(log[0]["status"], "delivered", "{log:?}");
    assert_eq!(log[0]["last_status_code"], 250);
    assert_eq!(delivery_count("email", "delivered"), 1.0);
    assert_eq!(delivery_count("email", "refused"), 1.0);
    // A series' name and labels, not its value: a value (a duration, a count) may hold the
    // digits by chance.
    let rendered = recorded_metrics().render();
    let series_with_the_reply = rendered
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' ').map(|(series, _value)| series))
        .find(|series| series.contains("451"));
    assert_eq!(series_with_the_reply, None, "no free text in the labels");

    let sessions = sessions.lock().unwrap().clone();
    assert_eq!(sessions.len(), 2, "{sessions:?}");
    let sent = &sessions[1];
    assert_eq!(sent.rcpt, ["ann@example.com", "bob@example.com"]);
    // AUTH PLAIN carries the sealed credentials, decoded only to be sent.
    let auth = sent
        .commands
        .iter()
        .find(|c| c.starts_with("AUTH PLAIN"))
        .expect("an AUTH PLAIN");
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.trim_start_matches("AUTH PLAIN ").trim())
        .unwrap();
    assert_eq!(
        decoded,
        format!("\0{SMTP_USER}\0{SMTP_PASSWORD}").as_bytes()
    );
    let data = sent.data.as_deref().unwrap();
    assert!(
        data.contains("Subject: Approval needed: notes/send_note"),
        "{data}"
    );
    let body = sent.body();
    assert!(body.contains("notes/send_note"), "{body}");
    assert!(body.contains("routine note-sender (version 1)"), "{body}");
    assert!(body.contains("to (pinned): team@example.com"), "{body}");
    assert!(
        body.contains(&format!("text: {}", "x".repeat(200))),
        "{body}"
    );
    assert!(body.contains("100 more characters"), "{body}");
    assert!(!body.contains(&"x".repeat(201)), "long values are cut");
    assert!(body.contains("Expires at "), "{body}");
    assert!(body.contains("Why it is held"), "{body}");
    let link = format!("{CONSOLE_URL}/console/approvals/{approval}");
    assert!(body.contains(&link), "{body}");
    // Nothing in the message decides: no approve or deny address, no token.
    assert!(
        !body.contains("/approve") && !body.contains("/deny"),
        "{body}"
    );

    // The link asks for a sign-in and comes back to this approval once signed in.
    let path = format!("/console/approvals/{approval}");
    let response = h
        .router
        .clone()
        .oneshot(Request::get(&path).body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let next: String = url::form_urlencoded::byte_serialize(path.as_bytes()).collect();
    assert_eq!(location, format!("/console/sign-in?next={next}"));

    let audit = h.audit_text().await;
    assert!(audit.contains("notification_route.create"), "{audit}");
    assert!(!audit.contains(SMTP_PASSWORD));
}

#[tokio::test]
async fn a_digest_sends_the_requests_of_its_window_in_one_message() {
    let h = Harness::with_config(config(true)).await;
    notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let (addr, sessions) = relay(Relay {
        starttls: false,
        auth: false,
        fail_first: 0,
    })
    .await;
    let (status, route) = email_route(&h, addr, json!({"digest_minutes": 5})).await;
    assert_eq!(status, StatusCode::CREATED, "{route}");
    assert_eq!(route["digest_minutes"], 5);
    assert_eq!(route["smtp_credentials"]["configured"], false);
    let route_id = route["id"].as_str().unwrap().to_owned();
    let first = parked(&h, &routine).await;
    let second = parked(&h, &routine).await;
    // Nothing goes out before the window ends.
    assert_eq!(deliver(&h, 0).await, 0);
    assert!(sessions.lock().unwrap().is_empty());
    assert_eq!(deliver(&h, 6 * 60_000).await, 2);
    let sessions = sessions.lock().unwrap().clone();
    assert_eq!(
        sessions.len(),
        1,
        "one message for the window: {sessions:?}"
    );
    let body = sessions[0].body();
    assert!(body.contains("2 approval requests"), "{body}");
    for approval in [&first, &second] {
        assert!(
            body.contains(&format!("{CONSOLE_URL}/console/approvals/{approval}")),
            "{body}"
        );
    }
    assert!(!sessions[0].saw("AUTH"), "no credentials, no AUTH");
    let log = deliveries(&h, &route_id).await;
    assert_eq!(log.len(), 2);
    assert!(log.iter().all(|d| d["status"] == "delivered"), "{log:?}");
}

#[tokio::test]
async fn starttls_is_required_and_plaintext_goes_only_where_the_operator_allows() {
    // Without the operator's allowance a plaintext route is refused, naming the setting.
    let h = Harness::with_config(config(false)).await;
    notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let (plain, plain_sessions) = relay(Relay {
        starttls: false,
        auth: true,
        fail_first: 0,
    })
    .await;
    let (status, body) = email_route(&h, plain, json!({})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body.to_string().contains("smtp_plaintext_loopback"),
        "{body}"
    );
    // Bad input is a 400 naming the field; the other kind's fields are refused.
    for (extra, field) in [
        (
            json!({"smtp_tls": "starttls", "smtp_host": "169.254.169.254"}),
            "smtp_host",
        ),
        (
            json!({"smtp_tls": "starttls", "email_to": ["not an address"]}),
            "email_to",
        ),
        (json!({"smtp_tls": "starttls", "email_to": []}), "email_to"),
        (
            json!({"smtp_tls": "starttls", "email_from": "<@>"}),
            "email_from",
        ),
        (
            json!({"smtp_tls": "starttls", "digest_minutes": 0}),
            "digest_minutes",
        ),
        (
            json!({"smtp_tls": "starttls", "smtp_username": "only-a-name"}),
            "smtp_password",
        ),
        (
            json!({"smtp_tls": "starttls", "channel": "C0ABC"}),
            "channel",
        ),
    ] {
        let (status, body) = email_route(&h, plain, extra.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}: {body}");
        assert!(body.to_string().contains(field), "{extra}: {body}");
    }

    // A STARTTLS route to a relay that does not offer it: nothing is sent, not even the
    // credentials, and the failure says why.
    let (status, route) = email_route(
        &h,
        plain,
        json!({"smtp_tls": "starttls", "smtp_username": SMTP_USER, "smtp_password": SMTP_PASSWORD}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{route}");
    let route_id = route["id"].as_str().unwrap().to_owned();
    parked(&h, &routine).await;
    assert_eq!(deliver(&h, 0).await, 1);
    let log = deliveries(&h, &route_id).await;
    assert!(
        log[0]["last_error"]
            .as_str()
            .unwrap()
            .contains("does not offer STARTTLS"),
        "{log:?}"
    );
    {
        let seen = plain_sessions.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert!(!seen[0].saw("AUTH") && !seen[0].saw("MAIL"), "{seen:?}");
    }

    // A relay that offers STARTTLS but cannot finish the handshake gets nothing either.
    let (tls, tls_sessions) = relay(Relay {
        starttls: true,
        auth: true,
        fail_first: 0,
    })
    .await;
    let (status, route) = h
        .call(
            Method::POST,
            "/v1/notification-routes",
            Some(
                json!({"name": "tls", "kind": "email", "smtp_host": "127.0.0.1",
                "smtp_port": tls.port(), "email_from": "wor@example.com",
                "email_to": ["ann@example.com"], "smtp_username": SMTP_USER,
                "smtp_password": SMTP_PASSWORD}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{route}");
    assert_eq!(route["smtp_tls"], "starttls", "STARTTLS is the default");
    let tls_route = route["id"].as_str().unwrap().to_owned();
    parked(&h, &routine).await;
    deliver(&h, 60_000).await;
    let log = deliveries(&h, &tls_route).await;
    assert_eq!(log[0]["status"], "pending", "{log:?}");
    assert!(log[0]["last_error"].is_string(), "{log:?}");
    {
        let seen = tls_sessions.lock().unwrap();
        assert!(seen[0].saw("STARTTLS"), "{seen:?}");
        assert!(!seen[0].saw("AUTH") && !seen[0].saw("MAIL"), "{seen:?}");
    }

    // With the allowance, plaintext still goes only to a loopback relay.
    let h = Harness::with_config(config(true)).await;
    let (status, body) = h
        .call(
            Method::POST,
            "/v1/notification-routes",
            Some(
                json!({"name": "far", "kind": "email", "smtp_host": "smtp.example.com",
                "smtp_tls": "plaintext_loopback", "email_from": "wor@example.com",
                "email_to": ["ann@example.com"]}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.to_string().contains("loopback"), "{body}");
    // A viewer cannot make a route.
    let viewer = h.member("viewer").await;
    let (status, _, _) = h
        .call_as(
            &viewer,
            Method::POST,
            "/v1/notification-routes",
            Some(
                json!({"name": "v", "kind": "email", "smtp_host": "127.0.0.1",
                "smtp_tls": "plaintext_loopback", "email_from": "wor@example.com",
                "email_to": ["ann@example.com"]}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}
