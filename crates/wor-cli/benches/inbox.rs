//! Approvals inbox benchmark: the time to the first byte of the console's inbox
//! (`GET /console/approvals`, a signed-in member's session: the newest 50 pending calls, a
//! page) against `GET /v1/approvals?status=pending` for the same 50 and for 200 (the API's
//! largest page), in the same run of the benchmark, with `WOR_BENCH_PENDING` (default 1,000)
//! calls held for approval in the project.
//!
//! ```sh
//! cargo bench -p wor-cli --bench inbox                 # release build
//! cargo test -p wor-cli --bench inbox --profile dev    # quick, on the debug build
//! WOR_BENCH_PENDING=1000 WOR_BENCH_REQUESTS=20 cargo bench -p wor-cli --bench inbox
//! ```
//!
//! Each run of the routine asks at once for a `confirm` tool, so it parks with one pending
//! approval and calls nothing. Time to first byte is from sending the request to its response
//! headers (both answers are rendered whole before the first byte goes out); "whole" is to the
//! last byte of the body. Requests alternate between the two, one at a time.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark fails loudly and reports on stdout"
)]

#[allow(dead_code, reason = "each benchmark uses a part of the shared support")]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{Api, Server, env_number, ms, percentile, wor};

const PASSWORD: &str = "a long and quiet passphrase";

/// A browser's cookie jar, by hand: the console's cookies are few and plain.
#[derive(Default)]
struct Jar(BTreeMap<String, String>);

impl Jar {
    fn header(&self) -> String {
        self.0
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn keep(&mut self, response: &reqwest::Response) {
        for set in response.headers().get_all(reqwest::header::SET_COOKIE) {
            let text = set.to_str().unwrap();
            let pair = text.split(';').next().unwrap();
            let (name, value) = pair.split_once('=').unwrap();
            self.0.insert(name.to_owned(), value.to_owned());
        }
    }
}

/// The value of the page's hidden `csrf` field.
fn csrf(page: &str) -> String {
    let start = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    let rest = &page[start..];
    rest[..rest.find('"').unwrap()].to_owned()
}

/// A form body, as a browser encodes it.
fn form(fields: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(fields)
        .finish()
}

/// Invites an approver with `wor member invite`, sets their password and signs them in, as a
/// browser without script would; returns the session's cookies.
async fn session(api: &Api, http: &reqwest::Client) -> String {
    let out = wor()
        .args(["member", "invite", "bench-approver", "--role", "approver"])
        .args(["--server", &api.base])
        .env("WOR_API_KEY", &api.key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let link = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let mut jar = Jar::default();
    let page = http.get(&link).send().await.unwrap();
    jar.keep(&page);
    let token = csrf(&page.text().await.unwrap());
    let accepted = http
        .post(&link)
        .header("cookie", jar.header())
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[
            ("csrf", token.as_str()),
            ("password", PASSWORD),
            ("repeat", PASSWORD),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(accepted.status().as_u16(), 303);
    let location = accepted.headers()["location"].to_str().unwrap().to_owned();
    let query: BTreeMap<String, String> =
        url::form_urlencoded::parse(location.split_once('?').unwrap().1.as_bytes())
            .into_owned()
            .collect();
    let page = http
        .get(format!("{}/console/sign-in", api.base))
        .send()
        .await
        .unwrap();
    let mut jar = Jar::default();
    jar.keep(&page);
    let token = csrf(&page.text().await.unwrap());
    let signed = http
        .post(format!("{}/console/sign-in", api.base))
        .header("cookie", jar.header())
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[
            ("csrf", token.as_str()),
            ("project", &query["project"]),
            ("name", &query["name"]),
            ("password", PASSWORD),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(signed.status().as_u16(), 303, "sign-in refused");
    let mut jar = Jar::default();
    jar.keep(&signed);
    jar.header()
}

/// Time to the response's headers and to its last byte.
async fn timed(request: reqwest::RequestBuilder) -> (Duration, Duration, usize) {
    let sent = Instant::now();
    let response = request.send().await.unwrap();
    let first = sent.elapsed();
    assert_eq!(response.status().as_u16(), 200);
    let body = response.bytes().await.unwrap();
    (first, sent.elapsed(), body.len())
}

fn line(name: &str, first: &mut [Duration], whole: &mut [Duration], bytes: usize) -> String {
    first.sort();
    whole.sort();
    format!(
        "{name:<28} first byte p50 {:>7.1}ms p95 {:>7.1}ms   whole p50 {:>7.1}ms   {} KiB",
        ms(percentile(first, 0.5)),
        ms(percentile(first, 0.95)),
        ms(percentile(whole, 0.5)),
        bytes / 1024
    )
}

#[tokio::main]
async fn main() {
    let pending = env_number("WOR_BENCH_PENDING", 1000);
    let requests = env_number("WOR_BENCH_REQUESTS", 20);
    let (server, key) = Server::start(None, "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n");
    let api = Api::new(&server, key);
    let tools = json!([{"name": "send_note", "description": "Sends a note", "method": "POST",
        "path": "/notes", "inputSchema": {"type": "object",
            "properties": {"to": {"type": "string"}, "text": {"type": "string"}}}}]);
    // Nothing listens there: every call is held before it would be sent.
    api.http_tools("notes", "127.0.0.1:9".parse().unwrap(), tools, &[])
        .await;
    let routine = api
        .apply(&format!(
            "name = \"sender\"\ninstructions = \"Send a note.\"\n[model]\nprovider = \"replay\"\n\
             model = \"script\"\n[[model.script.turns]]\n\
             tool_calls = [{{ name = \"notes__send_note\", arguments = {{ text = \"hello\" }} }}]\n\
             [[tools]]\ntool = \"notes/send_note\"\nmode = \"confirm\"\n\
             pinned = {{ to = \"team@example.com\" }}\n[concurrency]\nmax_runs = {}\n",
            pending + 10
        ))
        .await;
    let started = Instant::now();
    for _ in 0..pending {
        api.post(
            &format!("/v1/routines/{routine}/runs"),
            json!({"input": "send a note"}),
        )
        .await;
    }
    loop {
        let parked = api.runs_with_status("waiting_for_approval").await.len();
        if parked >= pending {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1200),
            "only {parked} of {pending} runs parked"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "inbox: {pending} calls held in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    #[expect(
        clippy::disallowed_methods,
        reason = "the benchmark is a browser of its own server on loopback"
    )]
    let http = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let cookies = session(&api, &http).await;
    let inbox = || {
        http.get(format!("{}/console/approvals", api.base))
            .header("cookie", cookies.clone())
    };
    let listing = |limit: u32| {
        http.get(format!(
            "{}/v1/approvals?status=pending&limit={limit}",
            api.base
        ))
        .bearer_auth(&api.key)
    };
    // One of each first, unmeasured: connections and caches warm.
    let (_, _, _) = timed(inbox()).await;
    let (_, _, _) = timed(listing(200)).await;
    let (mut inbox_first, mut inbox_whole, mut api_first, mut api_whole) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut page_first, mut page_whole) = (Vec::new(), Vec::new());
    let (mut inbox_bytes, mut api_bytes, mut page_bytes) = (0, 0, 0);
    for _ in 0..requests {
        let (first, whole, bytes) = timed(inbox()).await;
        inbox_first.push(first);
        inbox_whole.push(whole);
        inbox_bytes = bytes;
        let (first, whole, bytes) = timed(listing(200)).await;
        api_first.push(first);
        api_whole.push(whole);
        api_bytes = bytes;
        let (first, whole, bytes) = timed(listing(50)).await;
        page_first.push(first);
        page_whole.push(whole);
        page_bytes = bytes;
    }
    println!("inbox  {pending} pending approvals, {requests} requests each, SQLite");
    println!(
        "inbox  {}",
        line(
            "GET /console/approvals",
            &mut inbox_first,
            &mut inbox_whole,
            inbox_bytes
        )
    );
    println!(
        "inbox  {}",
        line(
            "GET /v1/approvals (200)",
            &mut api_first,
            &mut api_whole,
            api_bytes
        )
    );
    println!(
        "inbox  {}",
        line(
            "GET /v1/approvals (50)",
            &mut page_first,
            &mut page_whole,
            page_bytes
        )
    );
    println!(
        "inbox  ratio inbox / API of the same 50 (first byte p50): {:.2}x",
        ms(percentile(&inbox_first, 0.5)) / ms(percentile(&page_first, 0.5))
    );
    drop(server);
}
