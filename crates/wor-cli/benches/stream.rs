//! Streamed text benchmark: the time to the model's first streamed text seen through `wor`
//! (`GET /v1/runs/{id}/events` of a run started through the API) against the same loopback
//! fake model server asked directly, in the same run of the benchmark.
//!
//! ```sh
//! cargo bench -p wor-cli --bench stream                 # release build
//! cargo test -p wor-cli --bench stream --profile dev    # quick, on the debug build
//! WOR_BENCH_RUNS=20 WOR_BENCH_FIRST_MS=200 WOR_BENCH_TOKEN_MS=20 cargo bench -p wor-cli --bench stream
//! ```
//!
//! The fake speaks OpenAI's streamed chat completions: it waits `WOR_BENCH_FIRST_MS` (the
//! model's time to its first token), then writes `WOR_BENCH_TOKENS` deltas every
//! `WOR_BENCH_TOKEN_MS`, then the finish, usage and `[DONE]`; once with deltas of 5 bytes
//! (`"word "`, a token's worth) and once with deltas of 300 bytes. It notes when
//! it wrote each request's first delta. Direct: a streamed request to the fake, from sending it
//! to the first delta read. Through `wor`: from `POST /v1/routines/{id}/runs` to the first
//! `event: text` read on the run's events (the watcher connects right after the start, before
//! the model has answered), so it includes queueing, the run's start and the model call being
//! made, and the stream redactor, which holds back the last 256 bytes until more text shows
//! whether they begin a secret. "relay" is from the fake writing its first delta to the
//! reader getting the first text.
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

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Api, Server, env_number, ms, percentile};

/// When the fake wrote the first delta of each request it answered, in order.
#[derive(Clone, Default)]
struct FirstWrites(Arc<Mutex<Vec<Instant>>>);

#[derive(Clone)]
struct Pace {
    first: Duration,
    every: Duration,
    tokens: usize,
    /// The text of each delta.
    delta: String,
}

async fn fake_model(pace: Pace, writes: FirstWrites) -> std::net::SocketAddr {
    let route = axum::routing::post(move || {
        let writes = writes.clone();
        let pace = pace.clone();
        async move {
            let chunk = |delta: Value| {
                format!(
                    "data: {}\n\n",
                    json!({"id": "chatcmpl-b", "object": "chat.completion.chunk", "model": "m",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
                )
            };
            let mut chunks: Vec<(Duration, String)> = (0..pace.tokens)
                .map(|i| {
                    let pause = if i == 0 { pace.first } else { pace.every };
                    (pause, chunk(json!({"content": pace.delta})))
                })
                .collect();
            chunks.push((
                Duration::ZERO,
                format!(
                    "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
                    json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                    json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": pace.tokens}})
                ),
            ));
            let stream = futures::stream::unfold(
                (chunks.into_iter(), writes, true),
                |(mut chunks, writes, first)| async move {
                    let (pause, chunk) = chunks.next()?;
                    tokio::time::sleep(pause).await;
                    if first {
                        writes.0.lock().unwrap().push(Instant::now());
                    }
                    Some((
                        Ok::<_, std::convert::Infallible>(chunk),
                        (chunks, writes, false),
                    ))
                },
            );
            (
                [("content-type", "text/event-stream")],
                axum::body::Body::from_stream(stream),
            )
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route("/v1/chat/completions", route);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Reads `response` until `done` says a chunk read so far holds what is looked for; returns
/// when that chunk arrived.
async fn first_chunk_where(
    response: &mut reqwest::Response,
    mut done: impl FnMut(&str) -> bool,
) -> Instant {
    let mut seen = String::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        seen.push_str(&String::from_utf8_lossy(&chunk));
        if done(&seen) {
            return Instant::now();
        }
    }
    panic!("the stream ended first: {seen}");
}

/// Reads `response` to its end.
async fn drain(response: &mut reqwest::Response) {
    while response.chunk().await.unwrap().is_some() {}
}

struct Sample {
    first: Duration,
    relay: Duration,
}

fn line(name: &str, samples: &mut [Sample]) -> (Duration, String) {
    samples.sort_by_key(|s| s.first);
    let firsts: Vec<Duration> = samples.iter().map(|s| s.first).collect();
    let mut relays: Vec<Duration> = samples.iter().map(|s| s.relay).collect();
    relays.sort();
    let p50 = percentile(&firsts, 0.5);
    (
        p50,
        format!(
            "{name}: first text p50={:.1}ms p99={:.1}ms, relay p50={:.1}ms",
            ms(p50),
            ms(percentile(&firsts, 0.99)),
            ms(percentile(&relays, 0.5)),
        ),
    )
}

#[tokio::main]
async fn main() {
    let runs = env_number("WOR_BENCH_RUNS", 10);
    let first = Duration::from_millis(env_number("WOR_BENCH_FIRST_MS", 200) as u64);
    let every = Duration::from_millis(env_number("WOR_BENCH_TOKEN_MS", 20) as u64);
    let tokens = env_number("WOR_BENCH_TOKENS", 100);
    let (server, key) = Server::start(None, "[egress]\nmodel_cidrs = [\"127.0.0.1/32\"]\n");
    let api = Api::new(&server, key);
    // Deltas of a few bytes, as models send them; and deltas longer than the 256 bytes the
    // stream redactor holds back, which shows what the rest of the way costs.
    for (name, delta) in [("small", "word ".to_owned()), ("large", "word ".repeat(60))] {
        let pace = Pace {
            first,
            every,
            tokens,
            delta,
        };
        measure(&api, name, runs, pace).await;
    }
    drop(server);
}

async fn measure(api: &Api, name: &str, runs: usize, pace: Pace) {
    let writes = FirstWrites::default();
    let model = fake_model(pace.clone(), writes.clone()).await;
    api.post(
        "/v1/model-connections",
        json!({"name": name, "provider": "openai_compatible",
            "base_url": format!("http://{model}/v1")}),
    )
    .await;
    let routine = api
        .apply(&format!(
            "name = \"talker-{name}\"\ninstructions = \"Talk.\"\n[model]\nprovider = \"openai_compatible\"\n\
             connection = \"{name}\"\nmodel = \"m\"\n"
        ))
        .await;

    let mut direct = Vec::new();
    let mut through = Vec::new();
    for _ in 0..runs {
        // Directly: the request the provider would send, streamed.
        let sent = Instant::now();
        let mut response = api
            .http
            .post(format!("http://{model}/v1/chat/completions"))
            .json(&json!({"model": "m", "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "go"}]}))
            .send()
            .await
            .unwrap();
        let got = first_chunk_where(&mut response, |s| s.contains("\"content\":\"word")).await;
        let wrote = *writes.0.lock().unwrap().last().unwrap();
        drain(&mut response).await;
        direct.push(Sample {
            first: got - sent,
            relay: got.saturating_duration_since(wrote),
        });

        // Through wor: start a run, watch its events.
        let before = writes.0.lock().unwrap().len();
        let started = Instant::now();
        let run = api
            .post(
                &format!("/v1/routines/{routine}/runs"),
                json!({"input": "go"}),
            )
            .await;
        let id = run["id"].as_str().unwrap().to_owned();
        let mut events = api
            .http
            .get(format!("{}/v1/runs/{id}/events", api.base))
            .bearer_auth(&api.key)
            .send()
            .await
            .unwrap();
        let got = first_chunk_where(&mut events, |s| s.contains("event: text")).await;
        let wrote = {
            let writes = writes.0.lock().unwrap();
            assert_eq!(writes.len(), before + 1, "one model call per run");
            *writes.last().unwrap()
        };
        drain(&mut events).await;
        let ended = api.get(&format!("/v1/runs/{id}")).await;
        assert_eq!(ended["status"], "succeeded", "{ended}");
        through.push(Sample {
            first: got - started,
            relay: got.saturating_duration_since(wrote),
        });
    }
    let (direct_p50, direct_line) = line("direct", &mut direct);
    let (through_p50, through_line) = line("through wor", &mut through);
    println!(
        "stream  {name:<5}  fake: first delta after {}ms, then {} deltas of {} bytes every {}ms ({runs} runs)",
        pace.first.as_millis(),
        pace.tokens,
        pace.delta.len(),
        pace.every.as_millis()
    );
    println!("stream  {name:<5}  {direct_line}");
    println!("stream  {name:<5}  {through_line}");
    println!(
        "stream  {name:<5}  ratio through wor / direct (first text p50): {:.2}x",
        through_p50.as_secs_f64() / direct_p50.as_secs_f64()
    );
}
