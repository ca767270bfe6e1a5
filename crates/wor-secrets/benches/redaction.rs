//! Redaction throughput over a 1 MB tool result with 1,000 live secrets, against a plain scan.
//!
//! Run with `cargo bench -p wor-secrets --bench redaction`. Prints the best of several runs for
//! the full redaction and, as a baseline over the same buffer, a single-pass byte count and a
//! substring search, with the ratio between them.
#![expect(clippy::print_stdout, reason = "a benchmark reports on stdout")]
#![expect(clippy::unwrap_used, reason = "a benchmark may stop on a broken setup")]
#![expect(
    clippy::indexing_slicing,
    reason = "indices are taken modulo the length of non-empty constant tables"
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use wor_secrets::Redactor;

const TARGET_LEN: usize = 1 << 20;
const LIVE_SECRETS: usize = 1_000;
const RUNS: usize = 15;

/// Deterministic xorshift generator, so every run benchmarks the same text.
struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn token(&mut self, len: usize) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        (0..len)
            .map(|_| char::from(ALPHABET[(self.next() % ALPHABET.len() as u64) as usize]))
            .collect()
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }
}

fn live_secrets(rng: &mut Xorshift) -> Vec<String> {
    let prefixes = ["", "sk_", "tok_", "pw-", "api."];
    (0..LIVE_SECRETS)
        .map(|i| format!("{}{}", prefixes[i % prefixes.len()], rng.token(32)))
        .collect()
}

/// A JSON-lines tool result: issue records with prose, ids, URLs, numbers, and a few secrets.
fn tool_result(rng: &mut Xorshift, secrets: &[String]) -> String {
    let words = [
        "the",
        "ticket",
        "was",
        "escalated",
        "after",
        "customer",
        "reported",
        "that",
        "invoice",
        "totals",
        "differ",
        "between",
        "ledger",
        "and",
        "report",
        "please",
        "review",
        "task",
        "desk",
        "asked",
        "for",
        "key",
        "metrics",
        "password",
        "reset",
        "flow",
        "works",
        "token",
        "count",
        "secret",
        "santa",
        "event",
        "bearer",
        "of",
        "news",
    ];
    let mut out = String::with_capacity(TARGET_LEN + 4096);
    let mut record = 0usize;
    while out.len() < TARGET_LEN {
        record += 1;
        let sentence: Vec<&str> = (0..40).map(|_| rng.pick(&words)).collect();
        let extra = match record % 97 {
            0 => format!(" leaked {} here", secrets[record % secrets.len()]),
            13 => format!(" config ghp_{}", rng.token(36)),
            29 => format!(" db postgres://app:{}@db.internal/app", rng.token(16)),
            51 => " auth eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U".to_owned(),
            _ => String::new(),
        };
        out.push_str(&format!(
            "{{\"id\":\"iss_{:08x}\",\"url\":\"https://tracker.example.com/issues/{}\",\"score\":{},\"body\":\"{}{}\"}}\n",
            rng.next() as u32,
            record,
            rng.next() % 1000,
            sentence.join(" "),
            extra
        ));
    }
    out
}

fn best_of(runs: usize, mut f: impl FnMut()) -> Duration {
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap()
}

/// A run step's record as the engine redacts it on every call: many short strings (ids,
/// names, digests, a short argument and result), none of them secret.
fn step_record() -> serde_json::Value {
    serde_json::json!({
        "call": {
            "id": "replay_12_1",
            "name": "echo__echo",
            "arguments": {"text": "hi"},
            "tool": {"connection": "con_0193a0b4c5d6e7f8091a2b3c4d5e6f70", "name": "echo"},
            "class": "read_only",
            "binding": "5f2b9c0e8d7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c",
        },
        "verdict": {"decision": "allow", "reasons": ["policy0"], "policy": "project"},
        "provenance": {
            "arguments": {"text": {"label": "trusted", "sources": []}},
            "untrusted_sources": [],
        },
        "result": {
            "content": [{"type": "text", "text": "#1234#"}],
            "is_error": false,
            "source": "tool:echo__echo",
        },
        "run": "run_0193a0b4c5d6e7f8091a2b3c4d5e6f71",
        "project": "prj_0193a0b4c5d6e7f8091a2b3c4d5e6f72",
    })
}

/// The strings in `value`, keys included.
fn strings_in(value: &serde_json::Value) -> usize {
    match value {
        serde_json::Value::String(_) => 1,
        serde_json::Value::Array(items) => items.iter().map(strings_in).sum(),
        serde_json::Value::Object(map) => map.len() + map.values().map(strings_in).sum::<usize>(),
        _ => 0,
    }
}

fn mb_per_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / 1e6 / elapsed.as_secs_f64()
}

fn main() {
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    let secrets = live_secrets(&mut rng);
    let text = tool_result(&mut rng, &secrets);

    let build_start = Instant::now();
    let redactor = Redactor::new(&secrets).unwrap();
    let build = build_start.elapsed();

    let redacted = redactor.redact(&text);
    let markers = redacted.matches("[REDACTED").count();
    assert!(markers > 0, "the benchmark text must contain secrets");
    assert!(secrets.iter().all(|s| !redacted.contains(s.as_str())));

    let redact = best_of(RUNS, || {
        black_box(redactor.redact(black_box(&text)));
    });
    let shapes = best_of(RUNS, || {
        black_box(wor_secrets::redact_shapes(black_box(&text)));
    });
    let count = best_of(RUNS, || {
        black_box(black_box(&text).bytes().filter(|&b| b == b'"').count());
    });
    let contains = best_of(RUNS, || {
        black_box(black_box(&text).contains("needle-that-is-absent"));
    });

    let redact_rate = mb_per_s(text.len(), redact);
    let count_rate = mb_per_s(text.len(), count);
    let contains_rate = mb_per_s(text.len(), contains);
    println!(
        "input: {} bytes, {} live secrets, {} spans redacted, redactor built in {:.1} ms",
        text.len(),
        secrets.len(),
        markers,
        build.as_secs_f64() * 1e3
    );
    println!(
        "redact:               {:>9.1} MB/s  ({:.3} ms, best of {RUNS})",
        redact_rate,
        redact.as_secs_f64() * 1e3
    );
    println!(
        "redact shapes only:   {:>9.1} MB/s  ({:.3} ms)",
        mb_per_s(text.len(), shapes),
        shapes.as_secs_f64() * 1e3
    );
    println!(
        "baseline byte count:  {:>9.1} MB/s  ({:.3} ms)",
        count_rate,
        count.as_secs_f64() * 1e3
    );
    println!(
        "baseline str contains:{:>9.1} MB/s  ({:.3} ms)",
        contains_rate,
        contains.as_secs_f64() * 1e3
    );
    println!(
        "ratio redact / byte count: {:.2}, redact / contains: {:.2}",
        redact_rate / count_rate,
        redact_rate / contains_rate
    );

    // Many short strings, as in a step's record: the cost per string, not per byte.
    const RECORDS: usize = 10_000;
    let record = step_record();
    let redact_records = best_of(RUNS, || {
        for _ in 0..RECORDS {
            let mut copy = black_box(&record).clone();
            redactor.redact_json(&mut copy);
            black_box(copy);
        }
    });
    let copy_records = best_of(RUNS, || {
        for _ in 0..RECORDS {
            black_box(black_box(&record).clone());
        }
    });
    let per_record = |elapsed: Duration| elapsed.as_secs_f64() * 1e6 / RECORDS as f64;
    println!(
        "step record ({} strings): redact_json {:.2} µs | baseline clone {:.2} µs | ratio {:.1}",
        strings_in(&record),
        per_record(redact_records),
        per_record(copy_records),
        redact_records.as_secs_f64() / copy_records.as_secs_f64()
    );
}
