//! Outgoing HTTP of Wasm tools (wasi-http), sent only through the egress guard with the tool's
//! host allowlist. Without an allowlist every request is refused before anything is resolved.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody, WasiHttpHooks};
use wor_egress::{EgressClient, EgressError, EgressRequest};

use crate::WasmGrants;

type IoFuture = Box<dyn Future<Output = Result<(), HttpError>> + Send>;
type ResponseFuture =
    Box<dyn Future<Output = Result<(http::Response<WasiBody>, IoFuture), HttpError>> + Send>;

/// The most a request body may be.
const MAX_REQUEST_BYTES: usize = 1 << 20;

pub(crate) struct EgressHooks {
    egress: EgressClient,
    grants: Arc<WasmGrants>,
}

impl EgressHooks {
    pub(crate) fn new(egress: EgressClient, grants: Arc<WasmGrants>) -> Self {
        Self { egress, grants }
    }
}

impl WasiHttpHooks for EgressHooks {
    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        _options: Option<RequestOptions>,
        _io: IoFuture,
    ) -> ResponseFuture {
        let egress = self.egress.clone();
        let grants = self.grants.clone();
        Box::new(async move {
            let Some(allowlist) = grants.allowlist.as_ref() else {
                tracing::info!(
                    category = "wasm",
                    action = "http.refused",
                    "no network granted"
                );
                return Err(HttpError::HttpRequestDenied);
            };
            let (parts, body) = request.into_parts();
            // Read no more than the limit: the guest could stream without end.
            let body = http_body_util::Limited::new(body, MAX_REQUEST_BYTES)
                .collect()
                .await
                .map_err(|_| HttpError::HttpRequestBodySize(Some(MAX_REQUEST_BYTES as u64)))?
                .to_bytes();
            let url = parts.uri.to_string();
            let mut outgoing = EgressRequest::new(parts.method, &url).with_allowlist(allowlist);
            outgoing.headers = parts.headers;
            // The guard sets the host from the vetted URL.
            outgoing.headers.remove(http::header::HOST);
            if !body.is_empty() {
                outgoing.body = Some(body.to_vec());
            }
            let response = egress.send(outgoing).await.map_err(|error| {
                tracing::info!(
                    category = "wasm",
                    action = "http.failed",
                    denied = matches!(error, EgressError::Denied(_)),
                    "a Wasm tool's request did not go out"
                );
                http_error(&error)
            })?;
            let body: WasiBody = Full::new(Bytes::from(response.body))
                .map_err(HttpError::from)
                .boxed_unsync();
            let mut reply = http::Response::new(body);
            *reply.status_mut() = response.status;
            *reply.headers_mut() = response.headers;
            let io: IoFuture = Box::new(async { Ok(()) });
            Ok((reply, io))
        })
    }
}

fn http_error(error: &EgressError) -> HttpError {
    match error {
        EgressError::Denied(_) => HttpError::HttpRequestDenied,
        EgressError::Resolve { .. } => HttpError::DestinationNotFound,
        EgressError::Timeout(_) => HttpError::ConnectionTimeout,
        other => HttpError::InternalError(Some(other.to_string())),
    }
}
