//! Trace export: the engine's finished spans (`wor_engine::traces`) sent to the operator's
//! OpenTelemetry collector over OTLP/HTTP in protobuf, when `[traces]` is configured.
//!
//! The protobuf encoding and the OTLP request are `opentelemetry-otlp`'s; the HTTP under it
//! is ours: [`EgressHttpClient`] sends through `wor-egress` with an allowlist of exactly the
//! collector's host and port, so the exporter is one more caller of the one guarded client and
//! can reach nothing else. No trace context is read from or written into any other request.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use wor_egress::{EgressClient, EgressRequest, HostAllowlist};
use wor_engine::traces::{AttributeValue, FinishedSpan, SINK_BATCH, SpanReceiver};

/// The OTLP/HTTP span exporter.
pub use opentelemetry_otlp::SpanExporter as TraceExporter;

/// How often finished spans are sent.
pub const EXPORT_INTERVAL: Duration = Duration::from_secs(1);
/// How long one export request may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// The collector's answer is read up to this size (an OTLP answer is a few bytes).
const MAX_ANSWER_BYTES: u64 = 64 * 1024;

/// Why trace export could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TraceExportError {
    /// The endpoint is not an `http` or `https` URL with a host.
    #[error("`[traces] endpoint` `{0}` is not an http or https URL with a host")]
    Endpoint(String),
    /// The endpoint's host cannot be an allowlist entry.
    #[error("`[traces] endpoint` host cannot be allowed: {0}")]
    Allowlist(#[from] wor_egress::AllowlistError),
    /// The OTLP exporter refused its configuration.
    #[error("cannot set up the trace exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// The exporter's HTTP client: the egress client, allowed only the collector.
#[derive(Debug)]
pub struct EgressHttpClient {
    egress: EgressClient,
    collector: HostAllowlist,
}

#[async_trait::async_trait]
impl HttpClient for EgressHttpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let url = parts.uri.to_string();
        let mut sent = EgressRequest::new(parts.method, &url).with_allowlist(&self.collector);
        sent.headers = parts.headers;
        sent.body = Some(body.to_vec());
        sent.timeout = Some(EXPORT_TIMEOUT);
        sent.max_response_bytes = Some(MAX_ANSWER_BYTES);
        let answer = self.egress.send(sent).await?;
        let mut response = Response::builder().status(answer.status);
        if let Some(headers) = response.headers_mut() {
            *headers = answer.headers;
        }
        Ok(response.body(Bytes::from(answer.body))?)
    }
}

/// The exporter for the collector at `endpoint` (`http://10.0.0.5:4318/v1/traces`), sending
/// through `egress`.
pub fn exporter(endpoint: &str, egress: EgressClient) -> Result<TraceExporter, TraceExportError> {
    let parsed =
        url::Url::parse(endpoint).map_err(|_| TraceExportError::Endpoint(endpoint.to_owned()))?;
    let (Some(host), Some(port)) = (parsed.host(), parsed.port_or_known_default()) else {
        return Err(TraceExportError::Endpoint(endpoint.to_owned()));
    };
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(TraceExportError::Endpoint(endpoint.to_owned()));
    }
    let host = match host {
        url::Host::Ipv6(ip) => format!("[{ip}]:{port}"),
        other => format!("{other}:{port}"),
    };
    let collector = HostAllowlist::parse([host])?;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(EgressHttpClient { egress, collector })
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .with_timeout(EXPORT_TIMEOUT)
        .build()?;
    exporter.set_resource(&Resource::builder_empty().with_service_name("wor").build());
    Ok(exporter)
}

/// Sends the spans waiting in `spans` every [`EXPORT_INTERVAL`], or sooner when a full batch
/// waits, until `stop` completes; then sends what is left and returns. Spans are converted
/// and encoded here, a batch at a time, never on the path of the run that finished them.
pub async fn export(spans: SpanReceiver, exporter: TraceExporter, stop: impl Future<Output = ()>) {
    let scope = InstrumentationScope::builder("wor")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mut tick = tokio::time::interval(EXPORT_INTERVAL);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            () = spans.batch_full() => {}
            _ = tick.tick() => {}
        }
        send(&exporter, spans.take(), &scope).await;
    }
    send(&exporter, spans.take(), &scope).await;
}

/// Sends `spans` in requests of at most [`SINK_BATCH`] spans.
async fn send(exporter: &TraceExporter, spans: Vec<FinishedSpan>, scope: &InstrumentationScope) {
    let mut spans = spans.into_iter().peekable();
    while spans.peek().is_some() {
        let batch: Vec<SpanData> = spans
            .by_ref()
            .take(SINK_BATCH)
            .map(|span| span_data(span, scope))
            .collect();
        let count = batch.len();
        // The error's text may quote the collector's answer: only the count is logged.
        if exporter.export(batch).await.is_err() {
            tracing::warn!(
                category = "traces",
                spans = count,
                "trace export to the collector failed"
            );
        }
    }
}

fn span_data(span: FinishedSpan, scope: &InstrumentationScope) -> SpanData {
    let attributes = span
        .attributes
        .into_iter()
        .map(|(key, value)| {
            let value = match value {
                AttributeValue::Word(word) => Value::from(word),
                AttributeValue::Int(n) => Value::I64(n),
                AttributeValue::Id(id) => Value::from(id.to_string()),
            };
            KeyValue::new(key, value)
        })
        .collect();
    let context = SpanContext::new(
        TraceId::from_bytes(span.trace_id),
        SpanId::from_bytes(span.span_id),
        TraceFlags::SAMPLED,
        false,
        TraceState::default(),
    );
    SpanData {
        span_context: context,
        parent_span_id: span
            .parent_span_id
            .map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: false,
        span_kind: SpanKind::Internal,
        name: span.kind.name().into(),
        start_time: span.start,
        end_time: span.end.max(span.start),
        attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: if span.ok {
            Status::Ok
        } else {
            Status::error("")
        },
        instrumentation_scope: scope.clone(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use super::*;

    fn request(url: &str) -> Request<Bytes> {
        http::Request::builder()
            .method(http::Method::POST)
            .uri(url)
            .body(Bytes::from_static(b"spans"))
            .unwrap()
    }

    fn refused(error: &HttpError) -> bool {
        matches!(
            error.downcast_ref::<wor_egress::EgressError>(),
            Some(wor_egress::EgressError::Denied(_))
        )
    }

    #[tokio::test]
    async fn the_exporter_reaches_only_its_collector_and_only_where_the_guard_allows() {
        // Loopback allowed by the policy, but the allowlist holds only the collector.
        let client = EgressHttpClient {
            egress: wor_egress::testing::loopback_egress(),
            collector: HostAllowlist::parse(["127.0.0.1:4318"]).unwrap(),
        };
        let elsewhere = client
            .send_bytes(request("http://127.0.0.1:9/v1/traces"))
            .await
            .unwrap_err();
        assert!(refused(&elsewhere), "{elsewhere}");
        // The collector itself, on an address the policy does not list: refused before any
        // connection is made.
        let unlisted = EgressHttpClient {
            egress: EgressClient::new(wor_egress::EgressPolicy::development()).unwrap(),
            collector: HostAllowlist::parse(["127.0.0.1:4318"]).unwrap(),
        };
        let error = unlisted
            .send_bytes(request("http://127.0.0.1:4318/v1/traces"))
            .await
            .unwrap_err();
        assert!(refused(&error), "{error}");
    }

    #[test]
    fn an_endpoint_that_is_not_an_http_url_is_refused() {
        let egress = wor_egress::testing::loopback_egress();
        for endpoint in [
            "collector:4318",
            "ftp://127.0.0.1/v1/traces",
            "mailto:ops@example.com",
        ] {
            assert!(
                matches!(
                    exporter(endpoint, egress.clone()),
                    Err(TraceExportError::Endpoint(_))
                ),
                "{endpoint}"
            );
        }
    }
}
