//! The one error shape of the API, `{"error":{"code":…,"message":…}}`, and the one place
//! where errors become HTTP statuses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use wor_store::StoreError;

/// Everything a handler can answer other than success.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid API key")]
    Unauthenticated,
    #[error("{0}")]
    Forbidden(String),
    /// An inbound webhook whose signature or timestamp did not check out.
    #[error("{0}")]
    InvalidSignature(String),
    #[error("not found")]
    NotFound,
    /// A single-use link (an invitation, a sign-in link) that is unknown, used, expired or
    /// replaced: a 404 that says what to do next.
    #[error("{0}")]
    LinkGone(&'static str),
    #[error("no route for this method and path")]
    NoRoute,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    #[error("request body is larger than the limit")]
    PayloadTooLarge,
    #[error("expected `content-type: application/json`")]
    UnsupportedMediaType,
    #[error("{0}")]
    Conflict(String),
    /// An idempotency key that started a run sent again with a different request.
    #[error("{0}")]
    IdempotencyKeyReused(String),
    /// The change would leave the project without an owner who can manage it.
    #[error("{0}")]
    LastOwnerKey(String),
    /// The role change would leave the project without an owner who can manage it.
    #[error("{0}")]
    LastOwner(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{}", enrolment_refusal_message(*.0))]
    EnrolmentRefused(wor_store::EnrolmentRefusal),
    #[error(
        "the internal API takes no bearer credential: an API key or run credential never opens it"
    )]
    InternalCredentialRefused,
    #[error("{0}")]
    WorkerUnauthenticated(WorkerAuthError),
    /// A worker asked to act on a run whose lease it does not hold.
    #[error("this worker does not hold the run's lease; it must stop driving the run")]
    LeaseNotHeld,
    #[error("internal error")]
    Internal,
}

/// Why a worker's signed request was refused; logged, and named in the 401 it answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerAuthError {
    #[error("{0}")]
    Request(#[from] wor_secrets::WorkerRequestError),
    #[error("worker is not enrolled")]
    UnknownWorker,
    #[error("worker is revoked")]
    Revoked,
    #[error("request nonce was already used: a replay")]
    Replayed,
}

impl WorkerAuthError {
    /// The code a refusal answers with: a revoked worker's is its own, for the worker to stop
    /// on rather than ask again.
    pub fn code(&self) -> &'static str {
        match self {
            WorkerAuthError::Revoked => wor_engine::worker_wire::WORKER_REVOKED,
            _ => "worker_unauthenticated",
        }
    }
}

fn enrolment_refusal_message(refusal: wor_store::EnrolmentRefusal) -> &'static str {
    match refusal {
        wor_store::EnrolmentRefusal::Unknown => "enrolment token is not known",
        wor_store::EnrolmentRefusal::AlreadyUsed => "enrolment token was already used",
        wor_store::EnrolmentRefusal::Expired => "enrolment token has expired",
        wor_store::EnrolmentRefusal::KeysInUse => {
            "another worker already enrolled with these public keys"
        }
    }
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::InvalidSignature(_) => (StatusCode::UNAUTHORIZED, "invalid_signature"),
            ApiError::NotFound | ApiError::LinkGone(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::NoRoute => (StatusCode::NOT_FOUND, "no_route"),
            ApiError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            ApiError::BadRequest { code, .. } => (StatusCode::BAD_REQUEST, code),
            ApiError::PayloadTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            ApiError::UnsupportedMediaType => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
            }
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            ApiError::IdempotencyKeyReused(_) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
            }
            ApiError::LastOwnerKey(_) => (StatusCode::CONFLICT, "last_owner_key"),
            ApiError::LastOwner(_) => (StatusCode::CONFLICT, "last_owner"),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ApiError::EnrolmentRefused(wor_store::EnrolmentRefusal::KeysInUse) => {
                (StatusCode::CONFLICT, "keys_in_use")
            }
            ApiError::EnrolmentRefused(_) => (StatusCode::UNAUTHORIZED, "enrolment_refused"),
            ApiError::WorkerUnauthenticated(reason) => (StatusCode::UNAUTHORIZED, reason.code()),
            ApiError::InternalCredentialRefused => (StatusCode::UNAUTHORIZED, "bearer_refused"),
            ApiError::LeaseNotHeld => (StatusCode::CONFLICT, "lease_not_held"),
            ApiError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

/// The body of every error response.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// A stable, machine-readable code such as `not_found` or `invalid_json`.
    pub code: String,
    /// A human-readable explanation.
    pub message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let bearer = matches!(self, ApiError::Unauthenticated);
        // Messages can quote what the caller sent; secret shapes never go back out (S4).
        let message = wor_secrets::redact_shapes(&self.to_string()).into_owned();
        let body = ErrorBody {
            error: ErrorDetail {
                code: code.to_owned(),
                message,
            },
        };
        let mut response = (status, axum::Json(body)).into_response();
        if bearer {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<wor_store::VaultError> for ApiError {
    fn from(err: wor_store::VaultError) -> Self {
        match err {
            wor_store::VaultError::Store(store) => store.into(),
            other => {
                // Names the slot, never a value; the caller sees only that it failed.
                tracing::error!(category = "vault", error = %other, "secret could not be sealed or opened");
                ApiError::Internal
            }
        }
    }
}

impl From<wor_engine::ToolConnectionSpecError> for ApiError {
    fn from(err: wor_engine::ToolConnectionSpecError) -> Self {
        ApiError::bad_request(err.code(), err.to_string())
    }
}

impl From<wor_engine::EngineError> for ApiError {
    fn from(err: wor_engine::EngineError) -> Self {
        match err {
            wor_engine::EngineError::ApproverRefused(refusal) => refusal.into(),
            wor_engine::EngineError::Decision(refusal) => match refusal {
                wor_engine::DecisionRefusal::NoReason
                | wor_engine::DecisionRefusal::ReasonTooLong => {
                    ApiError::bad_request("invalid_request", refusal.to_string())
                }
                wor_engine::DecisionRefusal::NotPending(_)
                | wor_engine::DecisionRefusal::Expired
                | wor_engine::DecisionRefusal::RunCancelled => {
                    ApiError::Conflict(refusal.to_string())
                }
            },
            // A routine whose policies, model or roster cannot be used: what is stored is
            // the conflict, not the request.
            error @ (wor_engine::EngineError::InvalidPolicies(_)
            | wor_engine::EngineError::RefusedInProduction(_)
            | wor_engine::EngineError::MissingRosterRoutine { .. }) => {
                ApiError::Conflict(error.to_string())
            }
            error @ wor_engine::EngineError::IdempotencyKeyReused { .. } => {
                ApiError::IdempotencyKeyReused(error.to_string())
            }
            error @ wor_engine::EngineError::IdempotencyKeySecret => {
                ApiError::bad_request("invalid_idempotency_key", error.to_string())
            }
            error @ (wor_engine::EngineError::InvalidThread
            | wor_engine::EngineError::ThreadWithoutMemory
            | wor_engine::EngineError::Schedule(_)
            | wor_engine::EngineError::Route(_)) => {
                ApiError::bad_request("invalid_request", error.to_string())
            }
            wor_engine::EngineError::ToolConnection(refusal) => match refusal {
                wor_engine::ToolConnectionRefusal::UnreviewedClass { .. }
                | wor_engine::ToolConnectionRefusal::TwoClasses { .. }
                | wor_engine::ToolConnectionRefusal::NotHttpApi { .. } => {
                    ApiError::bad_request("invalid_request", refusal.to_string())
                }
                // The server's list, not the request: review it again.
                wor_engine::ToolConnectionRefusal::DuplicateTool { .. }
                | wor_engine::ToolConnectionRefusal::ChangedSinceReview { .. } => {
                    ApiError::Conflict(refusal.to_string())
                }
            },
            wor_engine::EngineError::OAuth(refusal) => match refusal {
                wor_engine::OAuthRefusal::NoCallback
                | wor_engine::OAuthRefusal::NotMcpHttp { .. }
                | wor_engine::OAuthRefusal::NeedsClient { .. }
                | wor_engine::OAuthRefusal::UnknownState
                | wor_engine::OAuthRefusal::IssuerMismatch { .. } => {
                    ApiError::bad_request("invalid_request", refusal.to_string())
                }
                wor_engine::OAuthRefusal::NotAuthorized { .. } => {
                    ApiError::Conflict(refusal.to_string())
                }
                wor_engine::OAuthRefusal::AnotherMember => ApiError::Forbidden(refusal.to_string()),
            },
            wor_engine::EngineError::WebhookSecret(_) => {
                tracing::error!(category = "engine", "a webhook secret could not be made");
                ApiError::Internal
            }
            wor_engine::EngineError::EditRefused(refusal) => match refusal {
                wor_engine::EditRefusal::NotEditable
                | wor_engine::EditRefusal::ToolUnavailable { .. } => {
                    ApiError::Conflict(refusal.to_string())
                }
                wor_engine::EditRefusal::PolicyDenied { .. } => {
                    ApiError::Forbidden(refusal.to_string())
                }
                wor_engine::EditRefusal::NotAnObject
                | wor_engine::EditRefusal::Pinned { .. }
                | wor_engine::EditRefusal::UnknownArgument { .. }
                | wor_engine::EditRefusal::Unchanged
                | wor_engine::EditRefusal::Schema { .. } => {
                    ApiError::bad_request("invalid_edit", refusal.to_string())
                }
            },
            wor_engine::EngineError::Connection(error) => (*error).into(),
            error @ (wor_engine::EngineError::Authorization { .. }
            | wor_engine::EngineError::RefreshInProgress { .. }
            | wor_engine::EngineError::ControlPlane(_)
            // Only a remote worker's drive stops so; no request of the API meets it.
            | wor_engine::EngineError::Stopping) => ApiError::Unavailable(error.to_string()),
            // Only a worker driving a run loses its lease; a request that meets it raced one.
            wor_engine::EngineError::LeaseLost => {
                ApiError::Conflict("the run is being driven by another worker".to_owned())
            }
            wor_engine::EngineError::Vault(vault) => vault.into(),
            // Logged by kind only: the text can quote stored data.
            wor_engine::EngineError::InvalidState(_) | wor_engine::EngineError::NestedTask(_) => {
                tracing::error!(category = "engine", "stored state the engine cannot use");
                ApiError::Internal
            }
            // Logged by kind only: a panic's message can quote stored data.
            wor_engine::EngineError::StartTask(_) => {
                tracing::error!(
                    category = "run",
                    "the task starting a run ended without an answer"
                );
                ApiError::Internal
            }
            wor_engine::EngineError::Store(store) => store.into(),
        }
    }
}

impl From<wor_engine::ApproverRefusal> for ApiError {
    fn from(refusal: wor_engine::ApproverRefusal) -> Self {
        ApiError::Forbidden(refusal.to_string())
    }
}

impl From<wor_engine::ConnectionError> for ApiError {
    fn from(err: wor_engine::ConnectionError) -> Self {
        use wor_engine::ConnectionError;
        match err {
            // What people can change: the connection's status, the operator's rules for local
            // programs or the server's sandbox, a credential that does not fit its header.
            ConnectionError::NotEnabled { .. }
            | ConnectionError::Command { .. }
            | ConnectionError::NoSandbox { .. }
            | ConnectionError::Credential { .. } => ApiError::Conflict(err.to_string()),
            ConnectionError::Vault { source, .. } => source.into(),
            ConnectionError::Authorization(error) => (*error).into(),
            // Logged by kind only, like any stored state the engine cannot use.
            ConnectionError::InvalidStored { .. } => {
                tracing::error!(
                    category = "engine",
                    "a stored tool connection the engine cannot use"
                );
                ApiError::Internal
            }
            // The tool side: a server, an API or a component that cannot be used now.
            ConnectionError::Connect { .. }
            | ConnectionError::Start { .. }
            | ConnectionError::HttpApi { .. }
            | ConnectionError::Wasm { .. }
            | ConnectionError::List { .. } => ApiError::Unavailable(err.to_string()),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::NotFound => ApiError::NotFound,
            StoreError::Conflict(message) => ApiError::Conflict(message),
            last @ StoreError::LastOwnerKey { .. } => ApiError::LastOwnerKey(last.to_string()),
            last @ StoreError::LastOwner { .. } => ApiError::LastOwner(last.to_string()),
            StoreError::RoleChange(refusal) => ApiError::Forbidden(refusal.to_string()),
            // Other writes held the database for longer than a write waits: nothing was
            // written, and the same request may succeed in a moment.
            busy @ StoreError::WriteTurnTimedOut => {
                tracing::warn!(category = "store", kind = busy.kind(), "store busy");
                ApiError::Unavailable(busy.to_string())
            }
            // The database is down or unreachable: a 503 the client may retry, not a 500.
            down if down.is_unreachable() => {
                tracing::warn!(
                    category = "store",
                    kind = down.kind(),
                    "database unreachable"
                );
                ApiError::Unavailable("the database is not reachable; try again".to_owned())
            }
            other => {
                // The variant is logged, not the message: database messages can quote data.
                tracing::error!(category = "store", kind = other.kind(), "store error");
                ApiError::Internal
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use wor_store::StoreError;

    use super::ApiError;

    #[test]
    fn a_database_that_cannot_be_reached_is_a_503_and_other_store_errors_a_500() {
        for down in [sqlx::Error::PoolTimedOut, sqlx::Error::PoolClosed] {
            let answer = ApiError::from(StoreError::Database(down));
            assert_eq!(
                answer.status_and_code(),
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
                "{answer:?}"
            );
        }
        // Broken off in the middle of a statement, a write may have committed: not a 503
        // that invites the same request again.
        for other in [
            StoreError::Corrupt("x".to_owned()),
            StoreError::Database(sqlx::Error::Io(std::io::Error::from(
                std::io::ErrorKind::ConnectionReset,
            ))),
        ] {
            assert_eq!(
                ApiError::from(other).status_and_code(),
                (StatusCode::INTERNAL_SERVER_ERROR, "internal")
            );
        }
    }
}
