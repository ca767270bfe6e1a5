//! What the tool-call pipeline adds to one call: the model's view of the tool, arguments
//! pinned and validated against the pinned schema, and the result redacted (50 live secrets
//! plus secret shapes), capped and labelled — against a baseline of merely copying and
//! serialising the same arguments and result, measured in the same run.
//!
//! Run: `cargo bench -p wor-tools --bench pipeline`
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::indexing_slicing,
    reason = "a benchmark reports on stdout and fails loudly"
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use wor_core::routine::{RosterEntry, ToolMode};
use wor_secrets::Redactor;
use wor_tools::{
    PinnedToolDefinition, ResultLimits, ShapedResult, ToolCallResult, ToolContent, ToolDefinition,
    model_view, prepare_arguments,
};

const ROUNDS: usize = 2_000;

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index]
}

fn measure(mut f: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..200 {
        f();
    }
    let mut samples = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        f();
        samples.push(start.elapsed());
    }
    (
        percentile(&mut samples, 0.5),
        percentile(&mut samples, 0.99),
    )
}

fn main() {
    let schema = json!({
        "type": "object",
        "properties": {
            "to": {"type": "string", "format": "email"},
            "subject": {"type": "string", "maxLength": 200},
            "body": {"type": "string"},
            "from": {"type": "string"},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5}
        },
        "required": ["to", "subject", "body"],
        "additionalProperties": false
    });
    let definition = ToolDefinition {
        name: "send".to_owned(),
        description: Some("Send a message".to_owned()),
        input_schema: schema.as_object().unwrap().clone(),
        annotations: None,
    };
    let pinned = PinnedToolDefinition::pin(definition);
    let mut pinned_arguments = Map::new();
    pinned_arguments.insert("from".to_owned(), json!("support@example.com"));
    let entry = RosterEntry {
        tool: "mail/send".to_owned(),
        mode: ToolMode::Auto,
        pinned: pinned_arguments.into_iter().collect(),
    };
    let arguments = json!({"to": "pat@example.com", "subject": "Your ticket", "body": "Hello ".repeat(40), "priority": 2});
    let secrets: Vec<String> = (0..50)
        .map(|i| format!("sk-live-{i:04}-0123456789abcdefghij"))
        .collect();
    let redactor = Redactor::new(secrets.iter()).unwrap();
    let text = "ticket 42: customer says the invoice total is wrong; see attached. ".repeat(60);
    let result = ToolCallResult {
        content: vec![ToolContent::Text(text.clone())],
        is_error: false,
    };
    let schema_value = pinned.input_schema();

    let (pipeline_p50, pipeline_p99) = measure(|| {
        let view = model_view(black_box(&pinned), black_box(&entry));
        let prepared = prepare_arguments(black_box(&arguments), &entry, &schema_value).unwrap();
        let wrapped = ShapedResult::new(black_box(&result), &redactor, ResultLimits::default());
        black_box((view, prepared, wrapped));
    });
    let (baseline_p50, baseline_p99) = measure(|| {
        let copied: Value = black_box(&arguments).clone();
        let serialised = copied.to_string();
        let echoed = black_box(&text).clone();
        black_box((serialised, echoed));
    });
    println!(
        "input: 5-property schema with 1 pinned argument, {} byte result, 50 live secrets",
        text.len()
    );
    println!(
        "pipeline (view + pin + validate + redact + cap): p50 {pipeline_p50:?}  p99 {pipeline_p99:?}"
    );
    println!(
        "baseline (copy + serialise the same data):       p50 {baseline_p50:?}  p99 {baseline_p99:?}"
    );
    println!(
        "ratio at p50: {:.1}x; pipeline share of a 1 ms budget at p99: {:.1}%",
        pipeline_p50.as_secs_f64() / baseline_p50.as_secs_f64().max(1e-9),
        pipeline_p99.as_secs_f64() * 100.0 / 1e-3
    );
}
