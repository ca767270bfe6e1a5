//! Cost of the egress guard: sequential GETs through `EgressClient` against a plain reqwest
//! client, both to the same loopback server, and `check` alone per URL.
//!
//! Run: `cargo bench -p wor-egress --bench egress` (plain `Instant` timing, no harness).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::indexing_slicing,
    reason = "benchmark binary"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use wor_egress::{
    EgressClient, EgressLimits, EgressPolicy, EgressRequest, GuardedResolver, StaticResolver, check,
};

const REQUESTS: u32 = 2_000;
const CHECKS: u32 = 20_000;
const RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

/// A keep-alive HTTP/1.1 server writing a fixed response per request head.
async fn serve() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut pending = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => pending.extend_from_slice(&buf[..n]),
                    }
                    while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                        pending.drain(..end + 4);
                        if stream.write_all(RESPONSE).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

fn per_op(total: Duration, n: u32) -> f64 {
    total.as_secs_f64() * 1e6 / f64::from(n)
}

#[expect(
    clippy::disallowed_methods,
    reason = "the baseline is a plain reqwest client, outside the guard on purpose"
)]
fn plain_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let addr = serve().await;
    let port = addr.port();
    let policy = EgressPolicy::development()
        .with_allowed_cidrs(["127.0.0.2/32".parse().unwrap()])
        .unwrap();
    let mut names = StaticResolver::new();
    names.insert("bench.example.test", addr.ip());
    let guarded = EgressClient::with_resolver(
        policy.clone(),
        Arc::new(names.clone()),
        EgressLimits::default(),
    )
    .unwrap();
    let plain = plain_client();
    let named_url = format!("http://bench.example.test:{port}/");
    let ip_url = format!("http://{addr}/");

    // Warm both pools.
    for _ in 0..50 {
        guarded.send(EgressRequest::get(&named_url)).await.unwrap();
        plain
            .get(&ip_url)
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
    }

    let started = Instant::now();
    for _ in 0..REQUESTS {
        let response = guarded.send(EgressRequest::get(&named_url)).await.unwrap();
        assert_eq!(response.body, b"ok");
    }
    let guarded_time = started.elapsed();

    let started = Instant::now();
    for _ in 0..REQUESTS {
        let body = plain
            .get(&ip_url)
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(body.as_ref(), b"ok");
    }
    let plain_time = started.elapsed();

    let guard = GuardedResolver::new(Arc::new(names), Arc::new(policy));
    let check_urls = [
        named_url.as_str(),
        ip_url.as_str(),
        "http://0x7f.1/",
        "http://[::ffff:169.254.169.254]/",
        "http://user:pw@example.com/",
    ];
    let mut check_times = Vec::new();
    for url in check_urls {
        let started = Instant::now();
        for _ in 0..CHECKS {
            std::hint::black_box(check(url, None, &guard).await);
        }
        check_times.push((url, started.elapsed()));
    }

    let g = per_op(guarded_time, REQUESTS);
    let p = per_op(plain_time, REQUESTS);
    println!("sequential GETs over loopback, {REQUESTS} each, keep-alive");
    println!("  EgressClient (vet + pinned resolver + connect): {g:8.1} us/request");
    println!("  plain reqwest::Client:                          {p:8.1} us/request");
    println!(
        "  ratio guarded/plain:                            {:8.2}",
        g / p
    );
    println!("check alone, {CHECKS} each");
    for (url, time) in check_times {
        println!("  {:>8.2} us  {url}", per_op(time, CHECKS));
    }
}
