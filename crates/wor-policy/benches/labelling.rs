//! Argument labelling's cost to a decision: one call with 10 arguments against a 64 KB
//! context (4 KB of trusted instructions and input, 60 KB of untrusted tool results), decided
//! with the default policy with and without labelling its arguments first, in the same run;
//! and, for reference, indexing the context, which a run does once per piece of content as it
//! arrives, not once per decision.
//!
//! `cargo bench -p wor-policy --bench labelling`
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    reason = "a benchmark binary reports on stdout and fails loudly"
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use wor_core::call::ToolClass;
use wor_core::provenance::ContentIndex;
use wor_policy::{DecisionRequest, PolicyEngine};

const ITERATIONS: usize = 20_000;

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| {
        let index = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(index).copied().unwrap_or_default()
    };
    (at(0.50), at(0.99))
}

fn measure(iterations: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..iterations / 10 {
        f();
    }
    let samples = (0..iterations)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    percentiles(samples)
}

/// Text that reads like mail and web pages: words, numbers, URLs and addresses.
fn prose(seed: usize, bytes: usize) -> String {
    let words = [
        "invoice",
        "meeting",
        "quarter",
        "report",
        "budget",
        "review",
        "customer",
        "shipping",
        "delayed",
        "approved",
        "please",
        "thanks",
        "tomorrow",
        "account",
        "balance",
        "reference",
    ];
    let mut text = String::with_capacity(bytes + 64);
    let mut i = seed;
    while text.len() < bytes {
        let word = words[i % words.len()];
        text.push_str(word);
        match i % 23 {
            0 => text.push_str(&format!(" https://site{}.example.com/page/{i} ", i % 97)),
            5 => text.push_str(&format!(" person{}@example.org, ", i % 89)),
            11 => text.push_str(&format!(" {}.{:02} ", i * 7 % 10_000, i % 100)),
            _ => text.push(' '),
        }
        i = i.wrapping_mul(31).wrapping_add(17);
    }
    text
}

fn main() {
    let mut content = ContentIndex::new();
    let trusted = prose(1, 4 * 1024)
        + " fetch https://docs.example.com/guide and tell ops@example.com the total 1,200.50";
    let untrusted: Vec<String> = (0..6).map(|n| prose(100 + n, 10 * 1024)).collect();
    let index_time = measure(200, || {
        let mut index = ContentIndex::new();
        index.add_trusted(black_box(&trusted));
        for (n, text) in untrusted.iter().enumerate() {
            index.add_untrusted(&format!("tool:web/fetch{n}"), black_box(text));
        }
        black_box(index);
    });
    content.add_trusted(&trusted);
    for (n, text) in untrusted.iter().enumerate() {
        content.add_untrusted(&format!("tool:web/fetch{n}"), text);
    }
    let context_bytes = trusted.len() + untrusted.iter().map(String::len).sum::<usize>();

    let arguments: Map<String, Value> = json!({
        "url": "https://docs.example.com/guide",
        "to": "ops@example.com",
        "cc": ["person3@example.org", "someone@new.example"],
        "subject": "quarter report review",
        "body": "please find the budget review attached, thanks",
        "amount": 1200.5,
        "reference": "INV-2026-0042",
        "link": "https://site12.example.com/page/4",
        "options": {"priority": "high", "notify": true},
        "note": "a sentence the model wrote itself",
    })
    .as_object()
    .cloned()
    .unwrap();
    let engine = PolicyEngine::builder().build().unwrap();
    let request = |labelled: bool| {
        let mut builder =
            DecisionRequest::builder("triage", "run_1", "web", "visit", ToolClass::OpenWorld)
                .arguments(arguments.clone())
                .untrusted_source("tool:web/fetch0");
        if labelled {
            builder = builder.argument_labels(content.label(&arguments, &[]));
        }
        builder.build()
    };
    // Both build the request (a copy of the arguments, their canonical JSON) and decide; one
    // labels the arguments first.
    let without = measure(ITERATIONS, || {
        black_box(engine.decide(&request(false)));
    });
    let with = measure(ITERATIONS, || {
        black_box(engine.decide(&request(true)));
    });
    let label_only = measure(ITERATIONS, || {
        black_box(content.label(black_box(&arguments), &[]));
    });
    let decision = engine.decide(&request(true));
    println!(
        "{} arguments, context {} bytes, {ITERATIONS} iterations each; decision: {:?} ({})",
        arguments.len(),
        context_bytes,
        decision.outcome,
        decision.determining_policies.join(", ")
    );
    println!(
        "decide without labelling        p50 {:>9.2?}  p99 {:>9.2?}",
        without.0, without.1
    );
    println!(
        "decide with labelling           p50 {:>9.2?}  p99 {:>9.2?}",
        with.0, with.1
    );
    println!(
        "added by labelling              p50 {:>9.2?}",
        with.0.saturating_sub(without.0)
    );
    println!(
        "ContentIndex::label alone       p50 {:>9.2?}  p99 {:>9.2?}",
        label_only.0, label_only.1
    );
    println!(
        "indexing the 64 KB context once p50 {:>9.2?}  p99 {:>9.2?}",
        index_time.0, index_time.1
    );
}
