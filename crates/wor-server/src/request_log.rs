//! One log line per request, with fixed fields only: method, route template, status, timing
//! and a request id. Never headers, query strings or bodies (S15).

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;

pub async fn log_request(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    // The route template (`/v1/keys/{key_id}`), not the URI: a URI can carry ids of other
    // tenants or query strings with secrets in them.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "<unmatched>".to_owned());
    let request_id = wor_core::ids::request_id();
    let mut response = next.run(request).await;
    let status = response.status().as_u16();
    tracing::info!(
        category = "http",
        request_id = %request_id,
        method = %method,
        route = %route,
        status,
        duration_us = started.elapsed().as_micros() as u64,
        "request"
    );
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}
