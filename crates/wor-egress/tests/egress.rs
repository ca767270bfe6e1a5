//! End-to-end tests of the egress guard. Loopback only: names resolve through stub resolvers,
//! allowed servers listen on 127.0.0.2 (explicitly listed by the policy), and a canary listener
//! on 127.0.0.1 counts every connection the denial tests might have made.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "test helpers outside #[test] functions"
)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use wor_egress::{
    EgressClient, EgressDecision, EgressDenial, EgressError, EgressLimits, EgressPolicy,
    EgressRequest, GuardedResolver, HostAllowlist, Lookup, LookupFuture, Method, NameResolver,
    StaticResolver, WEBHOOK_TIMEOUT, check,
};

const ALLOWED_IP: &str = "127.0.0.2";

/// A loopback HTTP/1.1 server answering every connection with `response`, counting connections.
struct TestServer {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
}

async fn serve(bind: SocketAddr, response: Option<Vec<u8>>) -> TestServer {
    serve_on(TcpListener::bind(bind).await.unwrap(), response)
}

/// [`serve`] on a listener already bound.
fn serve_on(listener: TcpListener, response: Option<Vec<u8>>) -> TestServer {
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&connections);
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let response = response.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                match response {
                    Some(response) => {
                        let _ = stream.write_all(&response).await;
                        let _ = stream.shutdown().await;
                    }
                    // Never answer: the timeout test.
                    None => tokio::time::sleep(Duration::from_secs(30)).await,
                }
            });
        }
    });
    TestServer { addr, connections }
}

fn ok_response(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn allowed_server(body: &str) -> TestServer {
    serve(
        format!("{ALLOWED_IP}:0").parse().unwrap(),
        Some(ok_response(body)),
    )
    .await
}

async fn canary() -> TestServer {
    serve("127.0.0.1:0".parse().unwrap(), Some(ok_response("canary"))).await
}

fn allowing_test_server(production: bool) -> EgressPolicy {
    let base = if production {
        EgressPolicy::production()
    } else {
        EgressPolicy::development()
    };
    base.with_allowed_cidrs([format!("{ALLOWED_IP}/32").parse().unwrap()])
        .unwrap()
}

fn client(policy: EgressPolicy, resolver: impl NameResolver + 'static) -> EgressClient {
    EgressClient::with_resolver(policy, Arc::new(resolver), EgressLimits::default()).unwrap()
}

fn stub(entries: &[(&str, &str)]) -> StaticResolver {
    let mut map = StaticResolver::new();
    for (host, ip) in entries {
        map.insert(host, ip.parse().unwrap());
    }
    map
}

/// Stub resolver for the corpus: every name resolves to a loopback, private or metadata
/// address, chosen by the name's length so all three kinds occur.
#[derive(Debug)]
struct HostileDns;

impl NameResolver for HostileDns {
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a> {
        let answers = ["127.0.0.1", "10.0.0.1", "169.254.169.254", "::1", "fd00::1"];
        let ip: IpAddr = answers[name.len() % answers.len()].parse().unwrap();
        Box::pin(async move {
            Ok(Lookup {
                addrs: vec![ip],
                ttl: Duration::from_secs(60),
            })
        })
    }
}

/// Answers with the next entry of a script on each lookup (then repeats the last).
#[derive(Debug)]
struct Scripted {
    answers: Vec<IpAddr>,
    calls: AtomicUsize,
}

impl NameResolver for Scripted {
    fn lookup<'a>(&'a self, _name: &'a str) -> LookupFuture<'a> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let ip = *self.answers.get(call).or(self.answers.last()).unwrap();
        Box::pin(async move {
            Ok(Lookup {
                addrs: vec![ip],
                ttl: Duration::ZERO,
            })
        })
    }
}

const CLASS_WORDS: &[&str] = &[
    "loopback",
    "private-use",
    "link-local",
    "this network",
    "this host",
    "unspecified",
    "unique-local",
];
const URL_WORDS: &[&str] = &[
    "credentials",
    "invalid",
    "scheme",
    "zone id",
    "no host",
    "port 0",
];

#[track_caller]
fn assert_denied_with_reason(url: &str, result: Result<impl std::fmt::Debug, EgressError>) {
    match result {
        Err(EgressError::Denied(denial)) => {
            let reason = denial.to_string();
            let named = match *denial {
                EgressDenial::Address { .. } => CLASS_WORDS.iter().any(|w| reason.contains(w)),
                EgressDenial::Url(_) => URL_WORDS.iter().any(|w| reason.contains(w)),
                _ => false,
            };
            assert!(
                named,
                "{url}: reason names neither a class nor a url problem: {reason}"
            );
            assert!(
                !reason.contains("hunter2"),
                "{url}: reason repeats credentials: {reason}"
            );
        }
        other => panic!("{url}: expected a denial, got {other:?}"),
    }
}

/// The SSRF corpus, from the repository (`testdata/SOURCES.md` names its source).
const SSRF_CORPUS: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/ssrf/block-urls.json"
));

fn corpus() -> Vec<String> {
    let json: serde_json::Value = serde_json::from_str(SSRF_CORPUS).unwrap();
    let urls: Vec<String> = json["urls"]
        .as_array()
        .expect("corpus has a `urls` array")
        .iter()
        .map(|u| u.as_str().unwrap().to_owned())
        .collect();
    assert!(urls.len() >= 50, "corpus looks truncated: {}", urls.len());
    urls
}

#[tokio::test]
async fn every_corpus_url_is_refused_and_nothing_connects() {
    let canary = canary().await;
    let port = canary.addr.port();
    let client = client(EgressPolicy::development(), HostileDns);
    let guard = GuardedResolver::new(Arc::new(HostileDns), Arc::new(EgressPolicy::development()));

    let mut urls = corpus();
    // The same tricks, aimed at the canary's port so a leak would be counted.
    for host in [
        "127.0.0.1",
        "localhost",
        "127.1",
        "0x7f.1",
        "0177.0.0.1",
        "2130706433",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[64:ff9b::7f00:1]",
        "[2002:7f00:1::1]",
        "[::127.0.0.1]",
        "[::1]",
        "[0:0:0:0:0:0:0:1]",
        "0.0.0.0",
        "rebind.example",
        "LOCALHOST.",
    ] {
        urls.push(format!("http://{host}:{port}/"));
        urls.push(format!("https://{host}:{port}/"));
    }
    urls.push(format!("http://hunter:hunter2@example.com:{port}/"));
    urls.push(format!("http://@127.0.0.1:{port}/"));
    urls.push(format!("ftp://127.0.0.1:{port}/"));
    urls.push(format!("http://[fe80::1%25lo]:{port}/"));

    for url in &urls {
        assert_denied_with_reason(url, client.send(EgressRequest::get(url)).await);
        let decision = check(url, None, &guard).await;
        assert!(
            matches!(decision, EgressDecision::Deny(_)),
            "{url}: check said {decision}"
        );
        assert!(decision.to_string().starts_with("deny: "));
        assert_denied_with_reason(url, client.streaming_request(Method::GET, url, None).await);
    }
    assert_eq!(canary.connections.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_allowed_destination_works() {
    let server = allowed_server("hello").await;
    let client = client(allowing_test_server(false), StaticResolver::new());
    let url = format!("http://{}/", server.addr);
    let response = client.send(EgressRequest::get(&url)).await.unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.body, b"hello");
    assert_eq!(server.connections.load(Ordering::SeqCst), 1);

    // The streaming builder reaches it too.
    let streamed = client
        .streaming_request(Method::GET, &url, None)
        .await
        .unwrap()
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.bytes().await.unwrap().as_ref(), b"hello");
}

#[tokio::test]
async fn a_name_resolved_to_a_listed_address_works() {
    let server = allowed_server("named").await;
    let client = client(
        allowing_test_server(false),
        stub(&[("api.example.test", ALLOWED_IP)]),
    );
    let url = format!("http://api.example.test:{}/x", server.addr.port());
    let response = client.send(EgressRequest::get(&url)).await.unwrap();
    assert_eq!(response.body, b"named");
}

#[tokio::test]
async fn a_pinned_answer_survives_rebinding() {
    // Same port on both addresses: the server on 127.0.0.2, the canary on 127.0.0.1. A port
    // free on the one may be another process's on the other: then another port is tried.
    let mut pair = None;
    for _ in 0..50 {
        let listener = TcpListener::bind((ALLOWED_IP, 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        match TcpListener::bind(("127.0.0.1", port)).await {
            Ok(beside) => {
                pair = Some((listener, beside));
                break;
            }
            Err(taken) if taken.kind() == std::io::ErrorKind::AddrInUse => {}
            Err(other) => panic!("binding 127.0.0.1:{port}: {other}"),
        }
    }
    let (listener, beside) = pair.expect("a port free on both 127.0.0.1 and 127.0.0.2 in 50 tries");
    let server = serve_on(listener, Some(ok_response("pinned")));
    let port = server.addr.port();
    let canary = serve_on(beside, Some(ok_response("canary")));
    let dns = Scripted {
        answers: vec![ALLOWED_IP.parse().unwrap(), "127.0.0.1".parse().unwrap()],
        calls: AtomicUsize::new(0),
    };
    let client = client(allowing_test_server(false), dns);
    let url = format!("http://rebind.test:{port}/");
    for _ in 0..3 {
        let response = client.send(EgressRequest::get(&url)).await.unwrap();
        assert_eq!(response.body, b"pinned");
    }
    assert_eq!(server.connections.load(Ordering::SeqCst), 3);
    assert_eq!(canary.connections.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn redirects_come_back_unfollowed() {
    let canary = canary().await;
    for location in [
        format!("http://127.0.0.1:{}/", canary.addr.port()),
        format!("http://localhost:{}/", canary.addr.port()),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
    ] {
        let redirect = format!(
            "HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        let server = serve(
            format!("{ALLOWED_IP}:0").parse().unwrap(),
            Some(redirect.into_bytes()),
        )
        .await;
        let client = client(allowing_test_server(false), StaticResolver::new());
        let url = format!("http://{}/", server.addr);
        let response = client.send(EgressRequest::get(&url)).await.unwrap();
        assert_eq!(response.status, 302);
        assert_eq!(response.headers["location"], location.as_str());
    }
    assert_eq!(canary.connections.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_response_size_cap_holds_while_streaming() {
    let body = "x".repeat(10_000);
    let with_length = allowed_server(&body).await;
    // No content-length: the cap can only be enforced while reading.
    let without_length = serve(
        format!("{ALLOWED_IP}:0").parse().unwrap(),
        Some(format!("HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{body}").into_bytes()),
    )
    .await;
    let client = client(allowing_test_server(false), StaticResolver::new());
    for server in [&with_length, &without_length] {
        let url = format!("http://{}/", server.addr);
        let capped = EgressRequest {
            max_response_bytes: Some(1_000),
            ..EgressRequest::get(&url)
        };
        assert!(
            matches!(
                client.send(capped).await,
                Err(EgressError::ResponseTooLarge { limit: 1_000 })
            ),
            "{url}"
        );
        let roomy = EgressRequest {
            max_response_bytes: Some(10_000),
            ..EgressRequest::get(&url)
        };
        assert_eq!(client.send(roomy).await.unwrap().body.len(), 10_000);
    }
}

#[tokio::test]
async fn a_silent_server_times_out() {
    let silent = serve(format!("{ALLOWED_IP}:0").parse().unwrap(), None).await;
    let client = client(allowing_test_server(false), StaticResolver::new());
    let url = format!("http://{}/", silent.addr);
    let started = Instant::now();
    let result = client
        .send(EgressRequest {
            timeout: Some(Duration::from_millis(300)),
            ..EgressRequest::get(&url)
        })
        .await;
    assert!(matches!(result, Err(EgressError::Timeout(_))), "{result:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(silent.connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn webhooks_time_out_after_ten_seconds() {
    assert_eq!(WEBHOOK_TIMEOUT, Duration::from_secs(10));
    assert_eq!(EgressLimits::webhook().total_timeout, WEBHOOK_TIMEOUT);
    let request = EgressRequest::webhook("https://hooks.example.test/", b"{}".to_vec());
    assert_eq!(request.timeout, Some(WEBHOOK_TIMEOUT));
    assert_eq!(request.method, Method::POST);
}

#[tokio::test]
async fn allowlist_wildcards_and_ports() {
    let server = allowed_server("listed").await;
    let port = server.addr.port();
    let client = client(
        allowing_test_server(false),
        stub(&[
            ("api.example.test", ALLOWED_IP),
            ("example.test", ALLOWED_IP),
            ("api.other.test", ALLOWED_IP),
        ]),
    );
    let wildcard = HostAllowlist::parse(["*.example.test"]).unwrap();
    let with_port = HostAllowlist::parse([format!("api.example.test:{port}")]).unwrap();
    let wrong_port = HostAllowlist::parse(["api.example.test:1"]).unwrap();

    let send = |url: String, list: &HostAllowlist| {
        let client = client.clone();
        let list = list.clone();
        async move {
            client
                .send(EgressRequest::get(&url).with_allowlist(&list))
                .await
        }
    };
    let api = format!("http://api.example.test:{port}/");
    assert_eq!(send(api.clone(), &wildcard).await.unwrap().body, b"listed");
    assert_eq!(send(api.clone(), &with_port).await.unwrap().body, b"listed");
    for (url, list) in [
        (format!("http://example.test:{port}/"), &wildcard),
        (format!("http://api.other.test:{port}/"), &wildcard),
        (api.clone(), &wrong_port),
        (format!("http://{}/", server.addr), &wildcard),
    ] {
        match send(url.clone(), list).await {
            Err(EgressError::Denied(denial)) => {
                assert!(
                    matches!(*denial, EgressDenial::HostNotAllowed { .. }),
                    "{url}: {denial}"
                );
                assert!(denial.to_string().contains("allowlist"));
            }
            other => panic!("{url}: expected an allowlist denial, got {other:?}"),
        }
    }
    assert_eq!(server.connections.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn production_refuses_private_unless_listed() {
    let server = allowed_server("prod").await;
    let url = format!("http://{}/", server.addr);
    let unlisted = client(EgressPolicy::production(), StaticResolver::new());
    assert_denied_with_reason(&url, unlisted.send(EgressRequest::get(&url)).await);
    assert_eq!(server.connections.load(Ordering::SeqCst), 0);

    let listed = client(allowing_test_server(true), StaticResolver::new());
    assert_eq!(
        listed.send(EgressRequest::get(&url)).await.unwrap().body,
        b"prod"
    );
}

#[tokio::test]
async fn check_reports_allow_and_deny() {
    let policy = Arc::new(allowing_test_server(false));
    let dns = stub(&[
        ("svc.example.test", ALLOWED_IP),
        ("db.example.test", "10.1.2.3"),
    ]);
    let guard = GuardedResolver::new(Arc::new(dns), policy);
    let allowed = check("https://svc.example.test/", None, &guard).await;
    assert_eq!(allowed.to_string(), "allow");
    assert_eq!(
        allowed,
        EgressDecision::Allow(vec![ALLOWED_IP.parse().unwrap()])
    );
    assert_eq!(
        check("https://db.example.test/", None, &guard)
            .await
            .to_string(),
        "deny: `db.example.test` resolves to `10.1.2.3`, which is private-use 10.0.0.0/8"
    );
    assert_eq!(
        check("http://nowhere.example.test/", None, &guard)
            .await
            .to_string(),
        "deny: `nowhere.example.test` did not resolve: no address records"
    );
    let list = HostAllowlist::parse(["svc.example.test:443"]).unwrap();
    assert_eq!(
        check("http://svc.example.test/", Some(&list), &guard)
            .await
            .to_string(),
        "deny: `svc.example.test` port 80 is not on the connection's allowlist"
    );
}

#[tokio::test]
async fn a_tcp_connection_for_another_protocol_is_vetted_like_a_request() {
    let server = allowed_server("smtp").await;
    let canary = canary().await;
    let guard = client(
        allowing_test_server(true),
        stub(&[
            ("relay.example.test", ALLOWED_IP),
            ("sneaky.example.test", "127.0.0.1"),
            ("metadata.example.test", "169.254.169.254"),
        ]),
    );
    // A listed address, by name or literal, is dialled and the address reached is named.
    let (_, reached) = guard
        .connect_tcp("relay.example.test", server.addr.port())
        .await
        .unwrap();
    assert_eq!(reached, server.addr);
    guard
        .connect_tcp(ALLOWED_IP, server.addr.port())
        .await
        .unwrap();
    // Loopback, metadata and names resolving to them are refused before any dial.
    for host in [
        "127.0.0.1",
        "localhost",
        "sneaky.example.test",
        "metadata.example.test",
        "169.254.169.254",
        "::1",
    ] {
        let refused = guard.connect_tcp(host, canary.addr.port()).await;
        assert!(
            matches!(refused, Err(EgressError::Denied(_))),
            "{host}: {refused:?}"
        );
    }
    // A host that is not a host is refused too.
    assert!(guard.connect_tcp("a/b@c", 25).await.is_err());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(canary.connections.load(Ordering::SeqCst), 0);
    assert_eq!(server.connections.load(Ordering::SeqCst), 2);
}
