//! Remote schema references are never fetched: a loopback server holding the referenced
//! schemas counts every request, and must see none.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use wor_core::routine::{RosterEntry, ToolMode};
use wor_tools::{ArgumentError, prepare_arguments};

use crate::serve;

async fn schema_server() -> (SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&hits);
    let router = axum::Router::new().fallback(move || {
        count.fetch_add(1, Ordering::SeqCst);
        async { axum::Json(json!({"type": "object"})) }
    });
    (serve(router).await, hits)
}

fn entry() -> RosterEntry {
    RosterEntry {
        tool: "t".into(),
        mode: ToolMode::Auto,
        pinned: Default::default(),
    }
}

#[tokio::test]
async fn remote_refs_are_not_fetched() {
    let (addr, hits) = schema_server().await;
    let schemas: [Value; 3] = [
        json!({"$ref": format!("http://{addr}/root.json")}),
        json!({"type": "object", "properties": {"q": {"$ref": format!("http://{addr}/q.json")}}}),
        json!({"type": "object", "$defs": {"x": {"$ref": format!("http://{addr}/x.json#/a")}},
               "properties": {"q": {"$ref": "#/$defs/x"}}}),
    ];
    for schema in &schemas {
        // Validation runs on a blocking thread here only so the loopback server can answer
        // if a fetch were attempted; it must not be.
        let schema = schema.clone();
        let error = tokio::task::spawn_blocking(move || {
            prepare_arguments(&json!({"q": 1}), &entry(), &schema)
        })
        .await
        .unwrap()
        .unwrap_err();
        assert!(
            matches!(error, ArgumentError::UnusableSchema { .. }),
            "{error:?}"
        );
        assert!(
            error
                .to_string()
                .starts_with("the tool's input schema cannot be used: ")
        );
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_unknown_remote_meta_schema_is_not_fetched() {
    let (addr, hits) = schema_server().await;
    let schema = json!({"$schema": format!("http://{addr}/meta.json"), "type": "object"});
    let outcome =
        tokio::task::spawn_blocking(move || prepare_arguments(&json!({}), &entry(), &schema))
            .await
            .unwrap();
    // Refused or validated as a plain schema; either way nothing was fetched.
    if let Err(error) = &outcome {
        assert!(
            matches!(error, ArgumentError::UnusableSchema { .. }),
            "{error:?}"
        );
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}
