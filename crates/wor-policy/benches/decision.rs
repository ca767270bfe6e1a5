//! Decision latency: `PolicyEngine::decide` (building the Cedar request and entities, checking
//! them against the schema, evaluating, reading the decisions) against a bare
//! `Authorizer::is_authorized` on the same policies with the request built beforehand; and, for
//! reference, building the request with the schema check that `decide` leaves out. Then what
//! building an engine of those policies costs (what a routine's apply and a new routine
//! version pay), beside parsing the built-in schema alone.
//!
//! `cargo bench -p wor-policy --bench decision`
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark binary reports on stdout and fails loudly"
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use cedar_policy::Authorizer;
use serde_json::json;
use wor_core::call::ToolClass;
use wor_core::routine::ToolMode;
use wor_policy::{BudgetUsed, DecisionRequest, PolicyEngine};

const ROUTINE_POLICY: &str = r#"
@id("external-recipients")
@decision("deny")
permit (principal, action == Action::"call_tool", resource == Tool::"mail/send")
when {
  context.arguments.hasTag("to") &&
  !(context.arguments.getTag("to") like "*@example.com")
};

@id("after-twenty-calls")
@decision("confirm")
permit (principal, action, resource)
when { context.budget_used.tool_calls >= 20 };
"#;

const ITERATIONS: usize = 20_000;

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| {
        let index = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(index).copied().unwrap_or_default()
    };
    (at(0.50), at(0.99))
}

/// Builds of an engine timed: each takes about a thousand times as long as a decision.
const BUILD_ITERATIONS: usize = 2_000;

fn measure(f: impl FnMut()) -> (Duration, Duration) {
    measure_n(ITERATIONS, f)
}

fn measure_n(iterations: usize, mut f: impl FnMut()) -> (Duration, Duration) {
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

fn builder() -> wor_policy::PolicyEngineBuilder {
    PolicyEngine::builder()
        .routine_policy(ROUTINE_POLICY)
        .roster_tool("mail/send", ToolMode::Auto)
        .roster_tool("web/fetch", ToolMode::Confirm)
        .roster_tool("shell/run", ToolMode::Deny)
}

fn main() {
    let engine = builder().build().expect("the benchmark policies load");
    let request = DecisionRequest::builder(
        "triage",
        "run_0190",
        "mail",
        "send",
        ToolClass::Consequential,
    )
    .arguments(
        json!({"to": "ops@example.com", "subject": "weekly report", "body": "all good", "cc": ["a@example.com"]})
            .as_object()
            .cloned()
            .unwrap(),
    )
    .untrusted_source("webhook")
    .budget_used(BudgetUsed {
        turns: 3,
        tool_calls: 4,
        cost_microdollars: 12_000,
    })
    .build();

    let (cedar_request, entities) = engine.cedar_request(&request).unwrap();
    let authorizer = Authorizer::new();
    let policies = engine.policy_set();
    let raw = measure(|| {
        black_box(authorizer.is_authorized(
            black_box(&cedar_request),
            policies,
            black_box(&entities),
        ));
    });
    let ours = measure(|| {
        black_box(engine.decide(black_box(&request)));
    });
    let build_only = measure(|| {
        black_box(engine.cedar_request(black_box(&request)).unwrap());
    });
    println!(
        "{} policies, {ITERATIONS} iterations each; decision: {:?}",
        policies.policies().count(),
        engine.decide(&request).outcome
    );
    println!(
        "raw Authorizer::is_authorized   p50 {:>8.2?}  p99 {:>8.2?}",
        raw.0, raw.1
    );
    println!(
        "PolicyEngine::decide            p50 {:>8.2?}  p99 {:>8.2?}",
        ours.0, ours.1
    );
    println!(
        "cedar_request (schema-checked) p50 {:>8.2?}  p99 {:>8.2?}",
        build_only.0, build_only.1
    );
    println!(
        "ratio decide/raw                p50 {:>8.2}  p99 {:>8.2}",
        ours.0.as_secs_f64() / raw.0.as_secs_f64(),
        ours.1.as_secs_f64() / raw.1.as_secs_f64()
    );

    let schema = measure_n(BUILD_ITERATIONS, || {
        let (schema, _warnings) =
            cedar_policy::Schema::from_cedarschema_str(black_box(wor_policy::SCHEMA)).unwrap();
        black_box(schema);
    });
    let build = measure_n(BUILD_ITERATIONS, || {
        black_box(builder().build().unwrap());
    });
    println!("{BUILD_ITERATIONS} iterations each");
    println!(
        "parse the built-in schema       p50 {:>8.2?}  p99 {:>8.2?}",
        schema.0, schema.1
    );
    println!(
        "PolicyEngineBuilder::build      p50 {:>8.2?}  p99 {:>8.2?}",
        build.0, build.1
    );
    println!(
        "ratio build/schema              p50 {:>8.2}  p99 {:>8.2}",
        build.0.as_secs_f64() / schema.0.as_secs_f64(),
        build.1.as_secs_f64() / schema.1.as_secs_f64()
    );
}
